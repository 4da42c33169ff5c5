"""What careless and hostile users do (issue 18): NaN feeds, odd output paths, invalid ONNX,
absurd shapes, wrong CLI arguments; and the second probe (issue 33): aliasing, interrupts,
close() and fork() around a run, a blob file changed after load, deep graphs, signed zeros,
paths and argument ranges in the tools. Each regression test failed before its fix, except
those that pin what already held: MaxPool's NaN, replacing a regular file, and the cases of a
parametrized test that were already right (docs/reliability.md lists the issue 33 tests per
case)."""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from compiler.blob import write_blob
from compiler.errors import CompileError
from compiler.pipeline import compile_model
from runner import AllocError, BlobError, ConfigError, InputError, Model
from runner.blob import parse_blob
from runner.cpu import threads_from_env
from runner.opencl import unavailable_reason
from tests.graphs import compiled_blob, keel_run, make_model, ort_run, single_node_model
from tests.hand_graphs import chain_artifact, write

REPO = Path(__file__).parents[1]
NO_OPENCL = unavailable_reason()

# ---- NaN and infinities propagate as in onnxruntime ---------------------------------------------

SHAPE = (2, 4, 16)  # 16 along the reduced axis: the reductions run vectorized on C targets
# (op, attrs, inputs): "x", "y" are the NaN-laden feeds, "nan"/"one" scalar initializers (so
# the compile-time folder sees NaN too)
NAN_NODES = [
    ("Relu", {}, ["x"]), ("LeakyRelu", {"alpha": 0.1}, ["x"]), ("PRelu", {}, ["x", "one"]),
    ("Max", {}, ["x", "y"]), ("Min", {}, ["x", "y"]), ("Max", {}, ["x", "one"]),
    ("Min", {}, ["one", "x"]), ("Clip", {}, ["x", "nega", "one"]), ("Sign", {}, ["x"]),
    ("Abs", {}, ["x"]), ("Pow", {}, ["x", "y"]), ("LessOrEqual", {}, ["x", "y"]),
    ("GreaterOrEqual", {}, ["x", "y"]), ("Less", {}, ["x", "y"]), ("Equal", {}, ["x", "y"]),
    ("ReduceMax", {"axes": [2]}, ["x"]), ("ReduceMin", {"axes": [2]}, ["x"]),
    ("ArgMax", {"axis": 2}, ["x"]), ("ArgMin", {"axis": 2}, ["x"]),
    ("Softmax", {"axis": 2}, ["x"]), ("Elu", {}, ["x"]),
    ("HardSigmoid", {}, ["x"]), ("Floor", {}, ["x"]), ("Sigmoid", {}, ["x"]),
    ("Max", {}, ["one", "nan"]), ("Relu", {}, ["nan"]),  # folded at compile time
]


def nan_model() -> onnx.ModelProto:
    nodes, outputs = [], []
    for k, (op, attrs, ins) in enumerate(NAN_NODES):
        out = f"{op.lower()}{k}"
        raw = f"{out}_raw" if "nan" in ins else out
        nodes.append(helper.make_node(op, ins, [raw], **attrs))
        if raw != out:  # a constant output: add x so it is a kernel's, not just a weight
            nodes.append(helper.make_node("Add", [raw, "x"], [out]))
        outputs.append(out)
    consts = {"nan": np.array(np.nan, np.float32), "one": np.array(1, np.float32),
              "nega": np.array(-1, np.float32)}
    dtypes = {"less": bool, "equal": bool, "lessorequal": bool, "greaterorequal": bool,
              "argmax": np.int64, "argmin": np.int64}
    return make_model(nodes, [("x", SHAPE, "float32"), ("y", SHAPE, "float32")],
                      [(o, None, dtypes.get(o.rstrip("0123456789"), np.float32))
                       for o in outputs], consts, opset=17)


def nan_feeds(seed: int = 0) -> dict[str, np.ndarray]:
    """Normal values with NaN, +-Inf, +-0, denormals and huge values sprinkled in. Huge is
    +-1e37, not float32's max: 16 of them still sum without overflow, whose inf (and then NaN
    against a -inf) would depend on the summation order, which is not onnxruntime's."""
    rng = np.random.default_rng(seed)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 1e37, -1e37, 1.0],
                       np.float32)
    feeds = {}
    for name in ("x", "y"):
        v = rng.standard_normal(SHAPE).astype(np.float32)
        hit = rng.random(SHAPE) < 0.2
        v[hit] = rng.choice(special, int(hit.sum()))
        feeds[name] = v
    feeds["x"][0, 0, :] = np.nan  # a row that is all NaN
    return feeds


def assert_same_nonfinite(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """NaN exactly where onnxruntime has NaN, the same infinities; finite values within 1e-5
    relative (keel's exp is a polynomial a few ulp from libm's) or 1e-6 absolute (Elu's
    exp(x) - 1 cancels near 0: a few ulp of 1.0). No sums here: with +-1e37 among the values,
    what survives a sum depends on its order, which is not onnxruntime's."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert got.shape == want.shape, what
    nan = np.isnan(w)
    assert (np.isnan(g) == nan).all(), f"{what}: NaN at {np.argwhere(np.isnan(g) != nan)[:4]}"
    np.testing.assert_allclose(g[~nan], w[~nan], rtol=1e-5, atol=1e-6, err_msg=what)


# onnxruntime's max-reductions keep `if (x > max)`, so whether a NaN wins depends on where it
# sits; onnx's reference implementation (numpy) and keel let it win wherever it is.
NAN_BY_REFERENCE = ("ReduceMax", "ReduceMin", "ArgMax", "ArgMin")


def nan_want(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """onnxruntime's outputs, but the reference implementation's for NAN_BY_REFERENCE ops."""
    from onnx.reference import ReferenceEvaluator
    want = ort_run(model, feeds)
    names = [n.output[0] for n in model.graph.node if n.op_type in NAN_BY_REFERENCE]
    with np.errstate(all="ignore"):
        want.update(zip(names, ReferenceEvaluator(model).run(names, feeds)))
    return want


AVX512 = "avx512f" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() \
    else False
TARGETS = ["cpu",
           pytest.param("cpu-avx512", marks=pytest.mark.skipif(not AVX512, reason="no AVX-512")),
           pytest.param("opencl", marks=pytest.mark.skipif(
               NO_OPENCL is not None, reason=f"OpenCL: {NO_OPENCL}"))]


@pytest.mark.parametrize("target", TARGETS)
def test_nan_and_inf_propagate_as_in_onnxruntime(target):
    model, feeds = nan_model(), nan_feeds()
    want, got = nan_want(model, feeds), keel_run(model, feeds, target=target)
    for name, value in want.items():
        assert_same_nonfinite(got[name], value, f"{target} {name}")


@pytest.mark.parametrize("target", TARGETS)
def test_maxpool_propagates_nan_where_onnxruntime_drops_it(target):
    """A deliberate difference: onnxruntime's MaxPool keeps `if (x > max)` and so skips NaN,
    which makes a corrupt frame look valid. keel's max wins on NaN everywhere (as in onnx's
    reference implementation)."""
    x = np.arange(32, dtype=np.float32).reshape(1, 2, 4, 4)
    x[0, 0, 1, 1] = np.nan
    model = single_node_model("MaxPool", [((1, 2, 4, 4), "float32")], {"kernel_shape": [2, 2]})
    got = keel_run(model, {"x0": x}, target=target)["y"]
    assert np.isnan(got[0, 0, :2, :2]).all()  # the 4 windows (stride 1) that hold the NaN
    assert np.isnan(got).sum() == 4 and got[0, 1, 0, 0] == 21


def test_relu_with_a_nan_test_costs_nothing_in_the_c_source(monkeypatch):
    """max(x, 0) is rendered `0 > x ? 0 : x`: a NaN x falls through, with no `x != x` test."""
    from compiler import toolchain
    sources, build = [], toolchain.build_shared
    monkeypatch.setattr(toolchain, "build_shared", lambda src, *a: sources.append(src) or
                        build(src, *a))
    compile_model(single_node_model("Relu", [((4, 64), "float32")]))
    kernel = sources[0][sources[0].index("static void k0"):]
    kernel = kernel[:kernel.index("\n}\n")]
    assert "!=" not in kernel and "0.0f}) > v" in kernel, kernel


@pytest.mark.parametrize("float16", [False, True])
def test_qcom_opencl_c_lets_nan_win(float16):
    """No Adreno here to run it: the qcom source must hold the same NaN tests PoCL runs."""
    def lines(op, specs):
        src = compile_model(single_node_model(op, specs), target="qcom",
                            float16=float16).programs.decode()
        return [line for line in src.splitlines() if "?" in line]
    f = ((4, 64), "float32")
    assert all("!=" in line for line in lines("Max", [f, f])), lines("Max", [f, f])
    assert all(" > v" in line and "!=" not in line for line in lines("Relu", [f]))


# ---- tools/compile.py -o refuses what is not a regular file --------------------------------------

def _tool(*args, env=None):
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=300)


def _one_line_error(proc, *words) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def relu_onnx(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "relu.onnx"
    onnx.save(single_node_model("Relu", [((1, 3, 8, 8), "float32")]), path)
    return path


def _fifo(p): os.mkfifo(p)
def _symlink(p): os.symlink(p.parent / "elsewhere", p)
def _chardev(p): os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # like /dev/null
def _directory(p): p.mkdir()


@pytest.mark.parametrize("make,kind", [(_fifo, "a FIFO"), (_symlink, "a symlink"),
                                       (_chardev, "a character device"),
                                       (_directory, "a directory")])
def test_compile_refuses_to_replace_what_is_not_a_regular_file(relu_onnx, tmp_path, make, kind):
    out = tmp_path / "out.blob"
    make(out)
    before = os.lstat(out)
    _one_line_error(_tool("tools/compile.py", relu_onnx, "-o", out), str(out), kind)
    after = os.lstat(out)
    assert (after.st_mode, after.st_ino, after.st_rdev) == \
        (before.st_mode, before.st_ino, before.st_rdev)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.blob"]  # no *.tmp<pid> left


def test_compile_failure_names_the_failing_path_and_leaves_no_temporary(relu_onnx, tmp_path):
    """The temporary's name is taken by a directory (file modes would not stop root)."""
    out = tmp_path / "out.blob"
    tmp = Path(f"{out}.tmp{os.getpid()}")
    art = compile_model(onnx.load(relu_onnx))
    tmp.mkdir()
    with pytest.raises(IsADirectoryError) as e:
        write_blob(art, out)
    assert e.value.filename == str(tmp) and not out.exists()
    tmp.rmdir()
    write_blob(art, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.blob"]


def test_compile_writes_over_a_regular_file(relu_onnx, tmp_path):
    out = tmp_path / "out.blob"
    out.write_bytes(b"old")
    assert _tool("tools/compile.py", relu_onnx, "-o", out).returncode == 0
    assert Model.load(out).run({"x0": np.ones((1, 3, 8, 8), np.float32)})["y"].sum() == 192


# ---- invalid ONNX and absurd shapes do not compile ----------------------------------------------

def _relu_bytes() -> bytes:
    return single_node_model("Relu", [((1, 3, 8, 8), "float32")]).SerializeToString()


def _without_opset(data: bytes) -> bytes:
    """The longest prefix that still parses, has a graph, and has lost its opset_import."""
    for n in range(len(data), 0, -1):
        m = onnx.ModelProto()
        try:
            m.ParseFromString(data[:n])
        except Exception:  # protobuf's DecodeError: not every prefix parses
            continue
        if m.HasField("graph") and not m.opset_import:
            return data[:n]
    raise AssertionError("no such prefix")


@pytest.mark.parametrize("data,why", [(b"", "ir_version"), (b"\x08\x07", "opset_import"),
                                      (_without_opset(_relu_bytes()), "opset_import")])
def test_invalid_onnx_does_not_compile(tmp_path, data, why):
    path = tmp_path / "bad.onnx"
    path.write_bytes(data)
    with pytest.raises(CompileError, match=f"not a valid ONNX model.*{why}"):
        compile_model(str(path))
    _one_line_error(_tool("tools/compile.py", path, "-o", tmp_path / "o.blob"), "bad.onnx")
    assert not (tmp_path / "o.blob").exists()


def _invalid_graphs():
    """Models the fuzzer (tests/fuzz_inputs.py) found raising untyped errors."""
    x = ("x", (2, 3), "float32")
    def model(node, inputs=(x,), inits=None, out_dtype="float32"):
        return make_model([node], inputs, [("y", None, out_dtype)], inits or {})
    bad_perm = model(helper.make_node("Transpose", ["x"], ["y"], perm=[1, 255]))
    short_init = model(helper.make_node("Add", ["x", "w"], ["y"]), inits={
        "w": np.ones((2, 3), np.float32)})
    short_init.graph.initializer[0].dims[0] = 4  # 24 bytes of data for 12 floats
    mixed = model(helper.make_node("MatMul", ["x", "w"], ["y"]), [("x", (2, 3), "int32")],
                  {"w": np.ones((3, 2), np.float32)})
    bad_type = model(helper.make_node("Relu", ["x"], ["y"]))
    bad_type.graph.input[0].type.tensor_type.elem_type = 100
    return [(bad_perm, "perm"), (short_init, "initializer 'w'|data"),
            (mixed, "MatMul"), (bad_type, "type 100")]


@pytest.mark.parametrize("model,words", _invalid_graphs(), ids=["perm", "init", "mixed", "type"])
def test_inconsistent_graphs_are_compile_errors(model, words):
    with pytest.raises(CompileError, match=words):
        compile_model(model)


def test_a_file_the_checker_passed_is_not_checked_again_and_a_refused_one_always_is(
        tmp_path, monkeypatch):
    # compiler/cache.py valid/: a recompile skips onnx's checker for bytes it passed with this
    # onnx; refusals are never cached, so an invalid model is refused every time
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    good, bad = tmp_path / "good.onnx", tmp_path / "bad.onnx"
    good.write_bytes(_relu_bytes())
    bad.write_bytes(_invalid_graphs()[2][0].SerializeToString())  # MatMul of int32 by float
    checks, check = [], onnx.checker.check_model
    monkeypatch.setattr(onnx.checker, "check_model",
                        lambda m, *a, **k: checks.append(1) or check(m, *a, **k))
    compile_model(str(good))
    compile_model(str(good))
    assert len(checks) == 1
    for _ in range(2):
        with pytest.raises(CompileError, match="not a valid ONNX model.*MatMul"):
            compile_model(str(bad))
    assert len(checks) == 3


def test_a_nan_constant_compiles(monkeypatch):
    """One NaN constant was a new node at every rewrite (nan != nan), so compiling never ended."""
    def stop(*_):
        raise TimeoutError("compile did not finish in 60 s")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)
    try:
        model = make_model([helper.make_node("Add", ["nan", "x"], ["y"])],
                           [("x", (2, 4, 16), "float32")], [("y", None, "float32")],
                           {"nan": np.array(np.nan, np.float32)})
        got = keel_run(model, {"x": np.ones((2, 4, 16), np.float32)})["y"]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert np.isnan(got).all()


def test_absurd_input_shape_is_refused_at_compile_time(tmp_path):
    model = single_node_model("Relu", [(("n", 3, 8, 8), "float32")])
    with pytest.raises(CompileError, match=r"input 'x0'.*19199999999808 elements.*2147483647"):
        compile_model(model, input_shapes={"x0": (99999999999, 3, 8, 8)})


def test_absurd_intermediate_shape_is_refused_at_compile_time():
    model = single_node_model("Expand", [((1,), "float32"), np.array([10**5, 10**5])])
    with pytest.raises(CompileError, match=r"Expand node.*output 'y'.*10000000000 elements"):
        compile_model(model)


def test_memory_that_cannot_be_had_at_load_is_a_typed_error(tmp_path):
    art = dataclasses.replace(chain_artifact(), arena_bytes=2**50)
    path = write(art, tmp_path / "huge.blob")
    with pytest.raises(AllocError, match=f"cannot allocate {2**50} bytes"):
        Model.load(path)
    assert issubclass(AllocError, BlobError) and issubclass(AllocError, MemoryError)
    _one_line_error(_tool("tools/run.py", path), str(2**50))


# ---- CLI errors are one line, status 2 ----------------------------------------------------------

@pytest.fixture(scope="module")
def relu_blob(relu_onnx) -> Path:
    path = relu_onnx.with_suffix(".blob")
    write_blob(compile_model(onnx.load(relu_onnx)), path)
    return path


def test_run_refuses_an_npy_where_an_npz_is_expected(relu_blob, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((1, 3, 8, 8), np.float32))
    _one_line_error(_tool("tools/run.py", relu_blob, "--inputs", tmp_path / "x.npy"), ".npz")


@pytest.mark.parametrize("n", ["-5", "0", "abc"])
def test_run_bench_needs_a_positive_count(relu_blob, n):
    _one_line_error(_tool("tools/run.py", relu_blob, "--bench", n), "--bench", repr(n))


def test_run_check_against_a_different_model_says_so(relu_blob, tmp_path):
    other = tmp_path / "flat.onnx"
    onnx.save(single_node_model("Flatten", [((1, 3, 8, 8), "float32")]), other)
    _one_line_error(_tool("tools/run.py", relu_blob, "--check", other), "shape (1, 3, 8, 8)",
                    "(1, 192)")


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_bad_keel_threads_is_a_typed_error_and_one_cli_line(relu_blob, monkeypatch, value):
    monkeypatch.setenv("KEEL_THREADS", value)
    with pytest.raises(ConfigError, match=f"KEEL_THREADS.*{value!r}"):
        threads_from_env()
    _one_line_error(_tool("tools/run.py", relu_blob, env={**os.environ}), "KEEL_THREADS")


def test_cli_argument_errors_are_one_line(relu_onnx, relu_blob):
    _one_line_error(_tool("tools/compile.py", relu_onnx), "--output")
    _one_line_error(_tool("tools/run.py", relu_blob, "--bogus"), "--bogus")


# ---- messages that name the thing ---------------------------------------------------------------

@pytest.mark.parametrize("shape,words", [
    ((1, 4, 8, 8), ["input 'x0'", "dim 1 = 4", "the model says 3"]),
    ((1, 3, 8), ["input 'x0'", "3 dims", "the model says 4"])])
def test_input_shape_disagreeing_with_static_dims_names_input_dim_and_values(shape, words):
    model = single_node_model("Conv", [((1, 3, 8, 8), "float32"),
                                       np.ones((2, 3, 3, 3), np.float32)])
    with pytest.raises(CompileError) as e:
        compile_model(model, input_shapes={"x0": shape})
    assert all(w in str(e.value) for w in words) and "IndexError" not in str(e.value)


def test_truncated_blob_says_what_the_header_promised(relu_blob):
    data = relu_blob.read_bytes()
    with pytest.raises(BlobError, match=f"truncated: the header says {len(data)} bytes, the file "
                                        f"has {len(data) - 100}"):
        parse_blob(data[:-100])


def test_model_load_takes_paths_only_and_leaves_fds_alone():
    r, w = os.pipe()
    try:
        with pytest.raises(TypeError, match="expected a path.*int"):
            Model.load(r)
        os.fstat(r)  # still open: an int is not taken for a file descriptor
    finally:
        os.close(r), os.close(w)


# ---- issue 33: aliasing, validation before writing, untyped run() errors -------------------------

def _recurrent_model() -> onnx.ModelProto:
    """h_new = h @ w + b: every output element reads a whole row of h, so writing h_new into h
    while the kernel runs gives wrong values."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((256, 256)) / 16).astype(np.float32)
    b = np.ones(256, np.float32)
    return make_model([helper.make_node("MatMul", ["h", "w"], ["hw"]),
                       helper.make_node("Add", ["hw", "b"], ["h_new"])],
                      [("h", (1, 256), "float32")], [("h_new", (1, 256), "float32")],
                      {"w": w, "b": b})


@pytest.fixture(scope="module")
def recurrent():
    model = _recurrent_model()
    return model, Model.load(compiled_blob(model))


@pytest.fixture(scope="module")
def transpose():
    model = single_node_model("Transpose", [((8, 8), "float32")])
    return model, Model.load(compiled_blob(model))


@pytest.fixture(scope="module")
def two_inputs_two_outputs():
    """y0 = a + b, y1 = a - b over (4, 8)."""
    model = make_model([helper.make_node("Add", ["a", "b"], ["y0"]),
                        helper.make_node("Sub", ["a", "b"], ["y1"])],
                       [("a", (4, 8), "float32"), ("b", (4, 8), "float32")],
                       [("y0", (4, 8), "float32"), ("y1", (4, 8), "float32")])
    return model, Model.load(compiled_blob(model))


def _state(seed=0, shape=(16, 16)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_recurrent_state_written_over_its_own_feed_is_right(recurrent):
    """m.run({"h": st}, out={"h_new": st}) as modeld writes it: three steps, each equal to
    onnxruntime's step from the previous state (1e-5: one MatMul of 256 terms, rounding order)."""
    model, m = recurrent
    st, ref = _state(0, (1, 256)), _state(0, (1, 256))
    for _ in range(3):
        ref = ort_run(model, {"h": ref})["h_new"]
        got = m.run({"h": st}, out={"h_new": st})["h_new"]
        assert got is st
        np.testing.assert_allclose(st, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["view", "input_view", "bind_input"])
def test_output_into_the_array_the_run_reads_is_right(transpose, how):
    model, m = transpose
    x = _state(1, (8, 8))
    want = x.T.copy()
    if how == "view":  # out is a view of the feed (same memory, another array object)
        buf = x.copy()
        m.run({"x0": buf}, out={"y": buf.view()})
    elif how == "input_view":
        buf = m.input_view("x0")
        buf[:] = x
        m.run(out={"y": buf})
    else:
        buf = x.copy()
        m.bind_input("x0", buf)
        try:
            m.run(out={"y": buf})
        finally:
            m.bind_input("x0", None)
    np.testing.assert_array_equal(buf, want)  # a transpose is exact


def test_two_outputs_in_one_array_is_an_input_error_naming_both(two_inputs_two_outputs):
    _, m = two_inputs_two_outputs
    one = np.full((4, 8), 7, np.float32)
    a, b = np.ones((4, 8), np.float32), np.ones((4, 8), np.float32)
    with pytest.raises(InputError, match=r"out\['y0'\] and out\['y1'\] share memory"):
        m.run({"a": a, "b": b}, out={"y0": one, "y1": one})
    with pytest.raises(InputError, match="share memory"):  # and the feed: y0 would be staged
        m.run({"a": one, "b": b}, out={"y0": one, "y1": one})
    wide = np.full(48, 7, np.float32)  # overlapping by 16 values, not identical
    with pytest.raises(InputError, match="share memory"):
        m.run({"a": a, "b": b}, out={"y0": wide[:32].reshape(4, 8), "y1": wide[16:].reshape(4, 8)})
    assert (wide == 7).all()
    assert (one == 7).all()


def test_runs_of_the_same_arrays_see_every_binding_made_between_them(two_inputs_two_outputs):
    """run() skips rebinding the arrays its entry's last binding bound when nothing rebound
    since (runner/model.py, _bind): a feed copied into its slot, or the device rebound behind
    the Model's back, in between must not leave the next run reading a stale binding."""
    _, m = two_inputs_two_outputs
    a, b = np.full((4, 8), 1, np.float32), np.full((4, 8), 2, np.float32)
    out = {"y0": np.empty((4, 8), np.float32)}
    assert (m.run({"a": a, "b": b}, out=out)["y0"] == 3).all()
    fortran = np.full((8, 4), 5, np.float32).T  # copied into a's slot, which is bound instead
    assert (m.run({"a": fortran, "b": b}, out=out)["y0"] == 7).all()
    assert (m.run({"a": a, "b": b}, out=out)["y0"] == 3).all()
    m.device.bind(0, np.full((4, 8), 9, np.float32))
    assert (m.run({"a": a, "b": b}, out=out)["y0"] == 3).all()
    assert (m.run({"a": a, "b": b}, out=out)["y0"] == 3).all()  # and nothing since: skipped


def test_a_run_that_fails_on_one_feed_writes_nothing(two_inputs_two_outputs):
    """Input a is not contiguous (it would be copied into its slot); input b is wrong: the
    slot of a and the out= arrays keep what they held."""
    _, m = two_inputs_two_outputs
    m.input_view("a")[:] = 5
    a = np.ones((8, 4), np.float32).T  # Fortran order: copied, not bound
    out = {"y0": np.full((4, 8), 9, np.float32)}
    with pytest.raises(InputError, match="input 'b'"):
        m.run({"a": a, "b": np.ones((4, 8), np.float64)}, out=out)
    assert (m.input_view("a") == 5).all() and (out["y0"] == 9).all()
    with pytest.raises(InputError, match="out"):
        m.run({"a": a, "b": np.ones((4, 8), np.float32)}, out={"y0": out["y0"], "bogus": a})
    assert (m.input_view("a") == 5).all()


def test_a_feed_that_is_another_inputs_slot_is_read_before_that_slot_is_written(
        two_inputs_two_outputs):
    _, m = two_inputs_two_outputs
    m.input_view("b")[:] = 2
    new_b = np.full((8, 4), 3, np.float32).T  # not contiguous: copied into b's slot
    got = m.run({"a": m.input_view("b"), "b": new_b})
    assert (got["y0"] == 5).all() and (got["y1"] == -1).all()


@pytest.mark.parametrize("timeout", [np.float32(50), np.int64(50), np.float64(50), 50, 1e12])
def test_numpy_and_large_timeouts_are_accepted(transpose, timeout):
    _, m = transpose
    x = _state(2, (8, 8))
    assert (m.run({"x0": x}, timeout_ms=timeout)["y"] == x.T).all()


@pytest.mark.parametrize("timeout", [1e13, 1e300, float("inf"), float("nan"), 0, -1, True,
                                     "50", np.bool_(True)])
def test_bad_timeouts_are_input_errors(transpose, timeout):
    _, m = transpose
    with pytest.raises(InputError, match="timeout_ms"):
        m.run({"x0": _state(2, (8, 8))}, timeout_ms=timeout)


@pytest.mark.parametrize("feeds,out,words", [
    ([np.zeros((8, 8), np.float32)], None, "feeds: expected a dict"),
    ((np.zeros((8, 8), np.float32), np.zeros((8, 8), np.float32)), None, "got tuple"),
    (np.zeros((8, 8), np.float32), None, "got ndarray"),
    ({"x0": np.zeros((8, 8), np.float32)}, [np.zeros((8, 8), np.float32)], "out: expected a dict")])
def test_feeds_and_out_that_are_not_dicts_are_input_errors(transpose, feeds, out, words):
    _, m = transpose
    with pytest.raises(InputError, match=words):
        m.run(feeds, out=out)


@pytest.mark.parametrize("device,words", [("nonsense", "unknown device 'nonsense'"),
                                          (["cpu"], "device: expected a name")])
def test_a_bad_device_name_is_a_config_error(relu_blob, device, words):
    with pytest.raises(ConfigError, match=words):
        Model.load(relu_blob, device=device)


def test_a_path_with_nul_is_a_blob_error(tmp_path):
    with pytest.raises(BlobError, match="NUL"):
        Model.load(f"{tmp_path}/a\0b.blob")


# ---- issue 33: a loaded blob is immune to its file; paths are regular files ---------------------

_AFTER_LOAD = """
import os, shutil, sys
import numpy as np
from runner import Model
blob, other, how = sys.argv[1:]
m = Model.load(blob)
x = np.arange(192, dtype=np.float32).reshape(1, 3, 8, 8) - 96
before = m.run({"x0": x})["y"].copy()
if how == "truncate":
    os.truncate(blob, 100)
else:  # cp other.blob b.blob: the same inode, new bytes
    with open(other, "rb") as src, open(blob, "r+b") as dst:
        shutil.copyfileobj(src, dst)
for _ in range(3):
    assert (m.run({"x0": x})["y"] == before).all()
print("ok")
"""


@pytest.mark.parametrize("how", ["truncate", "overwrite"])
def test_a_loaded_blob_runs_what_was_loaded_after_its_file_changes(tmp_path, how):
    """The kernels read their weights from the blob: a mapped file's pages would be the new
    file's (or gone: SIGBUS)."""
    blob, other = tmp_path / "b.blob", tmp_path / "other.blob"
    for path, scale in ((blob, 2), (other, 3)):
        w = np.full((1, 3, 8, 8), scale, np.float32)
        write_blob(compile_model(single_node_model("Mul", [((1, 3, 8, 8), "float32"), w])), path)
    proc = subprocess.run([sys.executable, "-c", _AFTER_LOAD, blob, other, how], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "ok\n", (proc.returncode, proc.stderr)


def test_a_fifo_is_refused_as_a_blob_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.blob"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-c", "import sys; from runner import Model\n"
                           "try: Model.load(sys.argv[1])\n"
                           "except Exception as e: print(type(e).__name__, e)", fifo],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.startswith("BlobError") and "a FIFO" in proc.stdout, proc


# ---- issue 33: interrupts, close() and fork() around a run; thread counts -----------------------

@pytest.fixture(scope="module")
def matmul_blob() -> Path:
    """A run long enough (milliseconds at 2 threads) to be interrupted in the middle."""
    w = np.random.default_rng(4).standard_normal((384, 384)).astype(np.float32) / 20
    return compiled_blob(single_node_model("MatMul", [((384, 384), "float32"), w]))


def _script(code: str, *args, threads="2", timeout=120):
    env = {**os.environ, "PYTHONPATH": str(REPO), "KEEL_THREADS": threads}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


_INTERRUPTED = """
import os, random, signal, sys, threading
import numpy as np
from runner import Model
m = Model.load(sys.argv[1])
x = np.random.default_rng(0).standard_normal((384, 384)).astype(np.float32)
want = m.run({"x0": x})["y"].copy()
rng = random.Random(int(sys.argv[2]))
interrupted = 0
def interrupted_run():
    timer = threading.Timer(rng.uniform(0, 0.004), os.kill, (os.getpid(), signal.SIGINT))
    try:
        timer.start()
        m.run({"x0": x})
        timer.join()  # the signal may land after run() returned
        m.run({"x0": x})
    except KeyboardInterrupt:
        return 1
    return 0
for _ in range(25):
    interrupted += interrupted_run()
assert (m.run({"x0": x})["y"] == want).all()
print(interrupted + interrupted_run())  # and exit at once: workers may still be running
"""


@pytest.mark.parametrize("seed", range(4))
def test_an_interrupted_threaded_run_leaves_the_pool_consistent_and_exit_clean(matmul_blob, seed):
    """SIGINT lands anywhere in run(): the next runs are right and the exit does not crash (a
    worker still running unloaded code segfaulted it)."""
    proc = _script(_INTERRUPTED, matmul_blob, seed)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout) > 0  # the test did interrupt runs


_CLOSED_DURING_RUN = """
import sys, threading, time
import numpy as np
from runner import DeviceError, Model
m = Model.load(sys.argv[1], device=sys.argv[2])
x = np.ones((384, 384), np.float32)
closer = threading.Thread(target=lambda: (time.sleep(0.05), m.close()))
closer.start()
runs = 0
try:
    while True:
        m.run({"x0": x})
        runs += 1
except DeviceError as e:
    assert "closed" in str(e), e
closer.join()
print(runs)
"""


@pytest.mark.parametrize("device", ["cpu", "mock"])
def test_close_from_another_thread_waits_for_the_run_in_flight(matmul_blob, device):
    for _ in range(3):
        proc = _script(_CLOSED_DURING_RUN, matmul_blob, device)
        assert proc.returncode == 0 and int(proc.stdout) > 0, proc.stderr[-2000:]


_FORKED = """
import os, sys, time
import numpy as np
from runner import DeviceError, Model
m = Model.load(sys.argv[1], device=sys.argv[2])
x = np.ones((384, 384), np.float32)
want = m.run({"x0": x})["y"]
pid = os.fork()
if pid == 0:
    t = time.monotonic()
    try:
        m.run({"x0": x}, timeout_ms=20000)
        os._exit(3)
    except DeviceError as e:
        ok = "fork" in str(e) and time.monotonic() - t < 1
    again = Model.load(sys.argv[1], device=sys.argv[2])
    os._exit(0 if ok and (again.run({"x0": x})["y"] == want).all() else 4)
_, status = os.waitpid(pid, 0)
assert (m.run({"x0": x})["y"] == want).all()
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("device", ["cpu", "mock"])
def test_a_forked_child_gets_a_clear_error_at_once_and_can_load_again(matmul_blob, device):
    proc = _script(_FORKED, matmul_blob, device)
    assert proc.returncode == 0 and proc.stdout.strip() == "0", (proc.stdout, proc.stderr)


@pytest.mark.parametrize("value", ["99999", "２", "1_0", "+2", " 0x2"])
def test_keel_threads_takes_ascii_digits_within_bounds(monkeypatch, value):
    monkeypatch.setenv("KEEL_THREADS", value)
    with pytest.raises(ConfigError, match="KEEL_THREADS must be an integer in"):
        threads_from_env()


def test_huge_keel_threads_leaves_no_thread_and_later_loads_work(matmul_blob):
    proc = _script("import os, sys, threading\nimport numpy as np\n"
                   "from runner import ConfigError, Model\n"
                   "try: Model.load(sys.argv[1])\nexcept ConfigError as e: print(e)\n"
                   "print(threading.active_count())\nos.environ['KEEL_THREADS'] = '2'\n"
                   "print(Model.load(sys.argv[1]).run({'x0': np.ones((384, 384), np.float32)})"
                   "['y'].shape)", matmul_blob, threads="99999")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and "KEEL_THREADS" in lines[0], proc
    assert lines[1:] == ["1", "(384, 384)"]  # no thread left; a later load runs


def test_workers_that_cannot_start_are_an_alloc_error_and_are_stopped(monkeypatch):
    from runner import cpu
    started, start = [], threading.Thread.start
    def start_three(self):
        if len(started) == 3:
            raise RuntimeError("can't start new thread")
        start(self)
        started.append(self)
    monkeypatch.setattr(threading.Thread, "start", start_three)
    with pytest.raises(AllocError, match="cannot start 7 worker threads.*started 3"):
        cpu.Pool(lambda *a: None, 8)
    for t in started:
        t.join(5)
        assert not t.is_alive()


# ---- issue 33: tools: one checked open per path, every argument range-checked -------------------

def _quick_tool(*args):
    """A tool that must answer at once: a FIFO that blocked it would hang here, not pass."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("tool", ["compile", "run", "bisect-model", "bisect-blob", "run-inputs",
                                  "run-check"])
def test_a_fifo_given_as_a_path_is_refused_in_one_line(relu_onnx, relu_blob, tmp_path, tool):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    args = {"compile": ["tools/compile.py", fifo, "-o", tmp_path / "o.blob"],
            "run": ["tools/run.py", fifo],
            "run-inputs": ["tools/run.py", relu_blob, "--inputs", fifo],
            "run-check": ["tools/run.py", relu_blob, "--check", fifo],
            "bisect-model": ["tools/bisect.py", fifo, "cpu"],
            "bisect-blob": ["tools/bisect.py", relu_onnx, f"{fifo}.blob"]}[tool]
    if tool == "bisect-blob":
        os.rename(fifo, f"{fifo}.blob")
    _one_line_error(_quick_tool(*args), "a FIFO", "expected a regular file")


def test_compile_output_can_never_name_its_input(relu_onnx, tmp_path):
    model = tmp_path / "model.onnx"
    model.write_bytes(relu_onnx.read_bytes())
    os.link(model, tmp_path / "hardlink.onnx")
    for out in (model, tmp_path / "hardlink.onnx", tmp_path / ".." / tmp_path.name / "model.onnx"):
        _one_line_error(_tool("tools/compile.py", model, "-o", out), "is the input")
        assert model.read_bytes() == relu_onnx.read_bytes()


_FULL_DISK = """
import errno, os, sys
def full(fd, data, offset):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
os.pwrite = full
from tools.compile import main
sys.exit(main(sys.argv[1:]))
"""


def test_compiling_onto_a_full_disk_is_exactly_one_line(tmp_path):
    """The weights are written on a thread while the kernels compile: its error was a thread
    traceback before the main thread's own line."""
    model = tmp_path / "mul.onnx"
    onnx.save(single_node_model("Mul", [((1, 3, 8, 8), "float32"),
                                        np.full((1, 3, 8, 8), 2, np.float32)]), model)
    proc = _script(_FULL_DISK, model, "-o", tmp_path / "o.blob")
    progress = re.compile(r"[a-z ]+: \d+/\d+ \(\d+%\)")  # the compile's status lines
    proc.stderr = "".join(line for line in proc.stderr.splitlines(keepends=True)
                          if not progress.fullmatch(line.strip()))
    _one_line_error(proc, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mul.onnx"]


@pytest.mark.parametrize("args,words", [
    (["tools/soak.py", "BLOB", "--timeout-ms", "1e20"], "--timeout-ms"),
    (["tools/soak.py", "BLOB", "--warmup", "-5"], "--warmup"),
    (["tools/soak.py", "BLOB", "--allow-faults", "-3"], "--allow-faults"),
    (["tools/soak.py", "BLOB", "--hours", "nan"], "--hours"),
    (["tools/soak.py", "BLOB", "--runs", "1_0"], "--runs"),
    (["tools/soak.py", "BLOB", "--log", "nodir/x.jsonl", "--runs", "1"], "nodir/x.jsonl"),
    (["tools/soak.py", "BLOB", "--log", "BLOB", "--runs", "1"], "is the input"),
    (["tools/soak.py", "BLOB", "--plot", "nodir/x.png", "--runs", "1"], "nodir/x.png"),
    (["tools/modeld.py", "BLOB", "--timeout-ms", "1e20"], "--timeout-ms"),
    (["tools/modeld.py", "BLOB", "--hz", "1e-300"], "--hz"),
    (["tools/modeld.py", "BLOB", "--frames", "２"], "--frames"),
    (["tools/run.py", "BLOB", "--bench", "1e3"], "--bench"),
    (["tools/compile.py", "ONNX", "-o", "x.blob", "--input-shape", "x0=1_0"], "--input-shape")])
def test_out_of_range_cli_arguments_are_one_line(relu_onnx, relu_blob, tmp_path, args, words):
    blob = tmp_path / "relu.blob"
    blob.write_bytes(relu_blob.read_bytes())
    args = [str(blob) if a == "BLOB" else str(relu_onnx) if a == "ONNX" else a for a in args]
    args[0] = str(REPO / args[0])
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    _one_line_error(proc, words.replace("BLOB", str(blob)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["relu.blob"]  # no log, no plot


def test_bisect_with_a_wrong_shape_input_is_one_line(relu_onnx, tmp_path):
    np.savez(tmp_path / "x.npz", x0=np.zeros((1, 3, 4, 4), np.float32))
    _one_line_error(_tool("tools/bisect.py", relu_onnx, "cpu", "--inputs", tmp_path / "x.npz"),
                    "'x0'", "[1, 3, 8, 8]", "[1, 3, 4, 4]")


# ---- issue 33: the compiler: deep graphs, signed zeros, Clip ------------------------------------

def _chain(ops: list[str], consts: dict | None = None) -> onnx.ModelProto:
    """x -> ops[0] -> ops[1] -> ... -> y over (4, 8); a binary op's second operand is the
    constant of its name in `consts`."""
    nodes, prev = [], "x"
    for k, op in enumerate(ops):
        out = "y" if k == len(ops) - 1 else f"t{k}"
        nodes.append(helper.make_node(op, [prev] + ([f"c_{op}"] if consts else []), [out]))
        prev = out
    inits = {f"c_{op}": np.array(v, np.float32) for op, v in (consts or {}).items()}
    return make_model(nodes, [("x", (4, 8), "float32")], [("y", (4, 8), "float32")], inits)


def _compiles_and_matches(model: onnx.ModelProto, rtol: float) -> None:
    x = np.random.default_rng(5).standard_normal((4, 8)).astype(np.float32)
    got, want = keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)


def test_a_chain_of_150_unary_nodes_compiles():
    """It was a RecursionError in codegen/lower.py. 1e-5: each of 25 transcendentals is a
    polynomial a few ulp from onnxruntime's; they contract (sigmoid, tanh), so errors do not
    grow along the chain."""
    _compiles_and_matches(_chain(["Neg", "Sigmoid", "Abs", "Tanh", "Relu", "Exp"] * 25), 1e-5)


@pytest.mark.slow
def test_a_chain_of_10000_elementwise_nodes_compiles_without_recursion():
    """x -> (x + 0.5) * 0.999 -> ...: a contraction, so rounding differences stay at the last
    ulp of a value near 500 (1e-5 relative). The lowering, the vectorizer and the shape of the
    last node recursed as deep as the chain."""
    _compiles_and_matches(_chain(["Add", "Mul"] * 5000, {"Add": 0.5, "Mul": 0.999}), 1e-5)


SIGNED = np.array([-0.0, 0.0, -0.3, 0.3, -0.5, 0.5, -1e-30, 1e-30, np.inf, -np.inf, -1.5, 2.5,
                   -2.5, 1e30, -1e30, np.nan], np.float32)
# Elu, Selu and Celu are left out: at -1e-30 onnxruntime's e^x - 1 cancels to 0 where keel's
# expm1 gives the exact -1e-30 (test_compiler.py's test_expm1_and_erfc_activations_...)
ZERO_SIGN_OPS = ["Abs", "Neg", "Floor", "Ceil", "Round", "Erf", "Tanh", "Atan", "Asin", "Sqrt",
                 "Relu", "Sign", "Clip", "Identity", "LeakyRelu", "HardSwish", "Softsign",
                 "Sin", "Tan", "Sinh", "Asinh", "Atanh"]


def test_signed_zeros_infinities_and_clip_defaults_are_onnxruntimes():
    """Exactly where onnxruntime is exact (a zero, an infinity, Clip's default bounds: the
    type's finite extremes), within 1e-5 relative elsewhere (polynomial approximations)."""
    nodes = [helper.make_node(op, ["x"], [f"y{k}"]) for k, op in enumerate(ZERO_SIGN_OPS)]
    model = make_model(nodes, [("x", (16,), "float32")],
                       [(f"y{k}", (16,), "float32") for k in range(len(ZERO_SIGN_OPS))])
    got, want = keel_run(model, {"x": SIGNED}), ort_run(model, {"x": SIGNED})
    for k, op in enumerate(ZERO_SIGN_OPS):
        g, w = got[f"y{k}"], want[f"y{k}"]
        exact = (w == 0) | ~np.isfinite(w) | (np.abs(w) == np.finfo(np.float32).max)
        assert (np.signbit(g) == np.signbit(w))[exact & ~np.isnan(w)].all(), (op, SIGNED, g, w)
        assert_same_nonfinite(np.where(exact, g, 0), np.where(exact, w, 0), op)
        np.testing.assert_array_equal(g[exact], w[exact], err_msg=op)
        np.testing.assert_allclose(g[~exact], w[~exact], rtol=1e-5, err_msg=op)


# ---- issue 33: graph outputs listed twice, inputs with an initializer --------------------------

def test_a_graph_output_listed_twice_is_one_output():
    """onnxruntime returns it twice; a dict of outputs holds it once."""
    model = single_node_model("Relu", [((2, 3), "float32")])
    model.graph.output.append(model.graph.output[0])
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    m = Model.load(compiled_blob(model))
    assert list(m.outputs) == ["y"]
    assert (m.run({"x0": x})["y"] == ort_run(model, {"x0": x})["y"]).all()


def _initializer_input(ir_version: int) -> onnx.ModelProto:
    """y = x + w, where w is an input and an initializer [10, 20, 30]."""
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"])],
                       [("x", (3,), "float32"), ("w", (3,), "float32")], [("y", (3,), "float32")],
                       {"w": np.array([10, 20, 30], np.float32)})
    model.ir_version = ir_version
    return model


def test_a_feed_overrides_an_overridable_initializer_input_as_in_onnxruntime():
    model, x = _initializer_input(8), np.ones(3, np.float32)
    m = Model.load(compiled_blob(model, overridable=("w",)))
    w = np.array([5, 6, 7], np.float32)
    for feeds in ({"x": x}, {"x": x, "w": w}):
        assert (m.run(feeds)["y"] == ort_run(model, feeds)["y"]).all(), feeds
    assert (m.run({"x": x, "w": w})["y"] == [6, 7, 8]).all()
    m.input_view("x")[:] = x  # without feeds: the slot, which starts holding the default
    assert (m.run()["y"] == [11, 21, 31]).all()
    m.input_view("w")[:] = w
    assert (m.run()["y"] == [6, 7, 8]).all()
    assert (m.run({"x": x})["y"] == [11, 21, 31]).all()  # a feed dict without w: the default


def test_an_initializer_input_is_a_constant_unless_overridable_and_feeding_it_says_how():
    """A constant keeps shapes static and weights packed (models exported with every weight
    listed as an input too); feeding it names the option that makes it an input."""
    m = Model.load(compiled_blob(_initializer_input(8)))
    assert list(m.inputs) == ["x"]
    with pytest.raises(InputError, match=r"unexpected inputs \['w'\].*--overridable"):
        m.run({"x": np.ones(3, np.float32), "w": np.ones(3, np.float32)})
    with pytest.raises(CompileError, match=r"--overridable names \['v'\].*\['w'\]"):
        compile_model(_initializer_input(8), overridable=("v",))
