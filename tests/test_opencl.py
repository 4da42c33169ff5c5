"""OpenCL: the renderer, the image path, float16 and the runner device, run on whatever OpenCL
platform is installed (PoCL in CI) and compared against onnxruntime.

Tests that execute kernels skip, naming PoCL, only when no OpenCL platform exists (in CI they
fail instead: tests/deps.py). The renderer-only tests (clang's OpenCL front end type-checks the
fp16-compute sources that no CI device can run) need clang-19 and run everywhere.

PoCL compiles every kernel with LLVM at load (~0.1 s a kernel on 2 cores); it keeps its own
kernel cache (~/.cache/pocl), so re-runs are much faster than the first.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from compiler.blob import write_blob
from compiler.pipeline import compile_model
from compiler.target import TARGETS
from runner import BlobError, DeviceTimeout, Model
from tests.deps import needs, needs_clang, opencl_missing
from tests.fuzz_graphs import graph_strategy
from tests.graphs import assert_close, hostile_floats, keel_run, make_model, ort_run
from tests.test_compiler import check_trig, trig_model

REPO = Path(__file__).parents[1]
needs_opencl = needs("pocl-opencl-icd", opencl_missing())
CLANG = shutil.which("clang-19")
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
# the cheapest real models of onnx's backend suite (PoCL compile + run of each: a few seconds)
LIGHT = ["squeezenet", "shufflenet"]
SLOW_RUN_MS = 120_000  # PoCL on 2 CPU cores: a big graph's first runs take seconds


def opencl_target(**changes):
    return dataclasses.replace(TARGETS["opencl"], **changes)


def run_opencl(model, feeds, tmp_path, target="opencl", **kwargs):
    artifact = compile_model(model, target=target, **kwargs)
    path = tmp_path / "model.blob"
    write_blob(artifact, path)
    m = Model.load(path)
    m.timeout_ms = SLOW_RUN_MS
    return artifact, m.run(feeds)


# ---- models ---------------------------------------------------------------------------------

def mlp(rng, rows=6, dims=(20, 36, 12)):
    """x @ w1 -> Sigmoid -> @ w2 + b: the weights and the hidden activation have inner dims that
    are multiples of 4 but odd texel widths (9, 3), so they all become images."""
    w1 = rng.standard_normal(dims[:2]).astype(np.float32) * 0.3
    w2 = rng.standard_normal(dims[1:]).astype(np.float32) * 0.3
    b = rng.standard_normal(dims[2]).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Sigmoid", ["h"], ["s"]),
             helper.make_node("MatMul", ["s", "w2"], ["m"]),
             helper.make_node("Add", ["m", "b"], ["y"])]
    model = make_model(nodes, [("x", (rows, dims[0]), "float32")],
                       [("y", (rows, dims[2]), "float32")], {"w1": w1, "w2": w2, "b": b})
    return model, {"x": rng.standard_normal((rows, dims[0])).astype(np.float32)}


def conv_net(rng, width=20):
    """Conv (pad 1, stride 1 and 2) -> Relu -> Conv: the activations' inner dim (W) is read as an
    image through strided, padded windows, so most image loads are single lanes with masks."""
    w1 = rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3
    w2 = rng.standard_normal((4, 8, 3, 3)).astype(np.float32) * 0.3
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])]
    out_w = (width - 1) // 2 + 1
    model = make_model(nodes, [("x", (1, 3, 12, width), "float32")],
                       [("y", (1, 4, 6, out_w), "float32")], {"w1": w1, "w2": w2})
    return model, {"x": rng.standard_normal((1, 3, 12, width)).astype(np.float32)}


def light_case(name):
    """The model and onnx's backend-runner input (arange / n), and the stored expected output."""
    model = onnx.load(LIGHT_DIR / f"light_{name}.onnx")
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name not in inits:
            shape = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
            n = int(np.prod(shape))
            feeds[vi.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    want = numpy_helper.to_array(onnx.load_tensor(str(LIGHT_DIR / f"light_{name}_output_0.pb")))
    return model, feeds, want


# ---- end to end -------------------------------------------------------------------------------

@pytest.mark.timeout(1200)  # PoCL compiles a whole model: minutes on loaded cores
@pytest.mark.slow
@needs_opencl
@pytest.mark.parametrize("name", LIGHT)
def test_light_model_matches_stored_output(name, tmp_path):
    model, feeds, want = light_case(name)
    _, out = run_opencl(model, feeds, tmp_path)
    (got,) = out.values()
    assert_close(got, want, rtol=1e-3, atol=1e-7, what=name)  # onnx's tolerance for these


@needs_opencl
@pytest.mark.parametrize("images", [False, True])
def test_conv_net_matches_onnxruntime_with_images_on_and_off(images, tmp_path):
    model, feeds = conv_net(np.random.default_rng(0))
    artifact, out = run_opencl(model, feeds, tmp_path, images=images)
    assert ("read_imagef" in artifact.programs.decode()) == images
    assert any(b.image for b in artifact.buffers) == images
    assert_close(out["y"], ort_run(model, feeds)["y"], 1e-5, 1e-5, "conv net")


@needs_opencl
@pytest.mark.parametrize("align", [1, 16, 64])
@pytest.mark.parametrize("width", [20, 28])
def test_image_path_with_pitch_alignment_and_odd_widths(align, width, tmp_path):
    """Texel widths 5 and 7 (odd), row pitch padded to `align` texels."""
    target = opencl_target(image_pitch_align=align)
    model, feeds = conv_net(np.random.default_rng(1), width)
    artifact, out = run_opencl(model, feeds, tmp_path, target=target, images=True)
    pitched = [b for b in artifact.buffers if b.image is not None]
    assert pitched and all(b.image.pitch % align == 0 and b.image.pitch >= b.image.width
                           for b in pitched)
    assert any(b.region == "arena" for b in pitched)  # an activation, written with pitched rows
    assert_close(out["y"], ort_run(model, feeds)["y"], 1e-5, 1e-5, f"align {align}")


@needs_opencl
@pytest.mark.parametrize("align", [1, 64])
def test_image_matmul_reads_whole_texels(align, tmp_path):
    model, feeds = mlp(np.random.default_rng(2))
    artifact, out = run_opencl(model, feeds, tmp_path, target=opencl_target(
        image_pitch_align=align), images=True)
    assert {(b.region, b.image.width) for b in artifact.buffers if b.image} == {
        ("weights", 9), ("arena", 9), ("weights", 3)}
    assert_close(out["y"], ort_run(model, feeds)["y"], 1e-5, 1e-5, "mlp")


@needs_opencl
def test_image_limits_keep_wide_tensors_as_buffers(tmp_path):
    model, feeds = mlp(np.random.default_rng(3))
    artifact, out = run_opencl(model, feeds, tmp_path, target=opencl_target(
        image_max_width=6), images=True)
    assert {b.image.width for b in artifact.buffers if b.image} == {3}  # 9 texels: too wide
    assert_close(out["y"], ort_run(model, feeds)["y"], 1e-5, 1e-5, "mlp")


@needs_opencl
def test_more_than_three_output_dims_fold_into_three_global_ids(tmp_path):
    shape = (2, 3, 5, 6, 8)
    nodes = [helper.make_node("Mul", ["a", "b"], ["m"]), helper.make_node("Tanh", ["m"], ["y"])]
    model = make_model(nodes, [("a", shape, "float32"), ("b", shape[1:], "float32")],
                       [("y", shape, "float32")])
    rng = np.random.default_rng(4)
    feeds = {"a": rng.standard_normal(shape).astype(np.float32),
             "b": rng.standard_normal(shape[1:]).astype(np.float32)}
    artifact, out = run_opencl(model, feeds, tmp_path)
    assert all(len(ln.global_size) <= 3 for ln in artifact.launches)
    assert_close(out["y"], ort_run(model, feeds)["y"], 1e-5, 1e-6, "5-d")


def softmax_rows(rows=5, n=512):
    """Softmax over 512 and a mean: 5 rows are too few work items, so each reduction is split
    across a work-group (local memory, barriers); max and sum combine differently."""
    nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=1),
             helper.make_node("ReduceMean", ["s"], ["m"], axes=[1]),
             helper.make_node("Add", ["s", "m"], ["y"])]
    model = make_model(nodes, [("x", (rows, n), "float32")], [("y", (rows, n), "float32")],
                       opset=13)
    return model, {"x": np.random.default_rng(14).standard_normal((rows, n), np.float32) * 4}


@needs_opencl
@pytest.mark.parametrize("float16", [False, True])
def test_small_reductions_split_across_a_work_group(float16, tmp_path):
    model, feeds = softmax_rows()
    artifact, out = run_opencl(model, feeds, tmp_path, float16=float16)
    src = artifact.programs.decode()
    assert "get_local_id" in src and "barrier(CLK_LOCAL_MEM_FENCE)" in src
    grouped = [ln for ln in artifact.launches if ln.local_size and ln.local_size[0] > 1
               and ln.global_size[0] == ln.local_size[0]]
    assert grouped
    tol = (1e-2, 1e-4) if float16 else (1e-5, 1e-7)
    assert_close(out["y"], ort_run(model, feeds)["y"], *tol, "softmax rows")


# ---- fusion for memory traffic (target.recompute_cheap) ---------------------------------------

def squeeze_excite(rng, c=8, hw=6):
    """EfficientNet's squeeze-excite, x * Sigmoid(Conv1x1(GlobalAveragePool(x))), then the
    block's 1x1 projection."""
    w = {"w1": rng.standard_normal((c, c, 1, 1)).astype(np.float32) * 0.5,
         "w2": rng.standard_normal((4, c, 1, 1)).astype(np.float32) * 0.5}
    steps = [("GlobalAveragePool", ["x"], "g"), ("Conv", ["g", "w1"], "h"),
             ("Sigmoid", ["h"], "s"), ("Mul", ["x", "s"], "scaled"), ("Conv", ["scaled", "w2"], "y")]
    nodes = [helper.make_node(op, ins, [out], name=out) for op, ins, out in steps]
    model = make_model(nodes, [("x", (1, c, hw, hw), "float32")],
                       [("y", (1, 4, hw, hw), "float32")], w)
    return model, {"x": rng.standard_normal((1, c, hw, hw)).astype(np.float32)}


def gelu_mlp(rows=5, d=16):
    """A transformer's MLP as torch exports it: MatMul + Add, GELU through Erf, MatMul + Add."""
    from models.blocks import GraphBuilder, gelu, linear
    g = GraphBuilder(seed=3)
    x = g.input("x", np.float32, (1, rows, d))
    y = linear(g, gelu(g, linear(g, x, d, 2 * d)), 2 * d, d)
    model = g.model([(y, np.float32, (1, rows, d))], "mlp")
    return model, {"x": np.random.default_rng(8).standard_normal((1, rows, d), np.float32)}


def launch_node_sets(artifact) -> list[set[str]]:
    names = [name for name, _ in artifact.provenance["nodes"]]
    return [{names[i] for i in launch} for launch in artifact.provenance["launches"]]


@needs_opencl
def test_gpu_projection_reads_the_squeeze_excite_input_and_scale_itself(tmp_path):
    """On a GPU the 1x1 projection computes x * s[c] as it reads (no x * s written and read
    back: target.recompute_cheap); the CPU keeps x * s its own kernel."""
    model, feeds = squeeze_excite(np.random.default_rng(7))
    gpu, out = run_opencl(model, feeds, tmp_path)
    assert any({"scaled", "y"} <= s for s in launch_node_sets(gpu))
    assert {"scaled"} in launch_node_sets(compile_model(model, target="cpu"))
    # fp32 on both sides, 8-term sums of O(1) values: rounding differs by a few ulp
    assert_close(out["y"], ort_run(model, feeds)["y"], 1e-5, 1e-5, "squeeze-excite")


@needs_opencl
def test_gpu_computes_a_gelu_in_one_kernel(tmp_path):
    """Erf's shared costly pieces all have their users in the GELU's kernel, so that kernel
    computes them (one launch; tests/test_compiler.py checks the same on the CPU)."""
    model, feeds = gelu_mlp()
    gpu, out = run_opencl(model, feeds, tmp_path)
    gelu = {n.name for n in model.graph.node if n.op_type in ("Div", "Erf", "Mul")}
    assert {frozenset(s) for s in launch_node_sets(gpu) if s & gelu} == {
        frozenset(gelu | {"add_2"})}  # add_2: the 1 + Erf
    # fp32; keel's erf has a fractional error < 1.2e-7 (Tensor.erf), 32-term sums of O(1)
    assert_close(out[model.graph.output[0].name], ort_run(model, feeds)[
        model.graph.output[0].name], 1e-5, 1e-5, "GELU MLP")


# ---- float16 --------------------------------------------------------------------------------

@needs_opencl
@pytest.mark.parametrize("images", [False, True])
def test_float16_storage_without_fp16_extension(images, tmp_path):
    """Weights and activations stored as half (half the bytes), fp32 arithmetic; the source uses
    vload_half/vstore_half (or half images) and never needs cl_khr_fp16."""
    model, feeds = mlp(np.random.default_rng(5))
    artifact, out = run_opencl(model, feeds, tmp_path, float16=True, images=images)
    src = artifact.programs.decode()
    assert "cl_khr_fp16" not in src
    stored = {b.dtype for b in artifact.buffers if b.region in ("arena", "weights")}
    assert stored == {"float16"}
    assert artifact.outputs[0].dtype == "float32"
    # fp16 rounding of weights and of the hidden activation: ~2^-11 relative each
    assert_close(out["y"], ort_run(model, feeds)["y"], 1e-2, 1e-2, "fp16 mlp")


# ---- openpilot ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def openpilot_case():
    from models.openpilot import INPUTS, make_openpilot
    rng = np.random.default_rng(0)
    feeds = {}
    for name, (dtype, shape) in INPUTS.items():
        feeds[name] = (rng.integers(0, 256, shape).astype(dtype) if dtype == np.uint8
                       else rng.standard_normal(shape).astype(dtype))
    return make_openpilot, feeds


@pytest.mark.timeout(1200)  # PoCL compiles a whole model: minutes on loaded cores
@pytest.mark.slow
@needs_opencl
@pytest.mark.parametrize("float16", [False, True])
def test_openpilot_matches_onnxruntime(float16, openpilot_case, tmp_path):
    """fp32: same math, different summation order: 1e-3 relative, 1e-4 absolute (the outputs are
    O(1); a 1.4 GFLOP graph accumulates ~1e-6 relative per layer over ~100 layers).
    fp16 weights in the ONNX model (dequantized by Cast) against ORT computing exactly that: our
    half storage also rounds every activation to fp16 (2^-11 relative) at ~100 layer boundaries,
    which compounds through LayerNorms and residuals to ~1e-2; 5e-2 absolute on O(1) outputs."""
    make_openpilot, feeds = openpilot_case
    model = make_openpilot(float16=float16)
    want = ort_run(model, feeds)["outputs"]
    _, out = run_opencl(model, feeds, tmp_path, float16=float16)
    tol = (5e-2, 5e-2) if float16 else (1e-3, 1e-4)
    assert_close(out["outputs"], want, *tol, f"openpilot float16={float16}")


# ---- fuzzer -----------------------------------------------------------------------------------

@pytest.mark.slow
@needs_opencl
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.data_too_large])
@given(graph_strategy(), st.sampled_from([None, 1, 16]))
def test_fuzz_graphs_match_onnxruntime(model_and_feeds, image_align):
    """Random graphs, with images off or on at two pitch alignments; test_fuzz's tolerance."""
    model, feeds = model_and_feeds
    kwargs = {} if image_align is None else dict(
        target=opencl_target(image_pitch_align=image_align), images=True)
    kwargs.setdefault("target", "opencl")
    got = keel_run(model, feeds, **kwargs)
    want = ort_run(model, feeds)
    for name, value in want.items():
        assert_close(got[name], value, rtol=1e-4, atol=1e-5, what=name)


# ---- runner ---------------------------------------------------------------------------------

def _caching_init(init):
    def caching(self):  # PoCL turns binary caching off (its own kernel cache is cheaper)
        init(self)
        self.cache_binaries = True
    return caching


@needs_opencl
def test_program_binary_is_cached_beside_the_blob(tmp_path, monkeypatch):
    import runner.opencl
    model, feeds = mlp(np.random.default_rng(6))
    monkeypatch.setattr(runner.opencl.OpenCLDevice, "__init__", _caching_init(
        runner.opencl.OpenCLDevice.__init__))
    path = tmp_path / "m.blob"
    write_blob(compile_model(model, target="opencl"), path)
    want = Model.load(path).run(feeds)["y"]
    cached = list((tmp_path / "m.blob.clcache").glob("*.bin"))
    assert len(cached) == 1

    def no_source_builds(self, source):
        raise AssertionError("built from source although a cached binary exists")
    with monkeypatch.context() as m:
        m.setattr(runner.opencl.OpenCLDevice, "_from_source", no_source_builds)
        np.testing.assert_array_equal(Model.load(path).run(feeds)["y"], want)
    cached[0].write_bytes(b"not a program binary")  # a corrupt entry is rebuilt, not fatal
    np.testing.assert_array_equal(Model.load(path).run(feeds)["y"], want)


@needs_opencl
def test_load_by_device_name_and_refuse_other_targets(tmp_path):
    model, feeds = mlp(np.random.default_rng(7))
    write_blob(compile_model(model, target="opencl"), tmp_path / "gpu.blob")
    m = Model.load(tmp_path / "gpu.blob", device="opencl")
    assert_close(m.run(feeds)["y"], ort_run(model, feeds)["y"], 1e-5, 1e-5, "mlp")
    write_blob(compile_model(model, target="cpu"), tmp_path / "cpu.blob")
    with pytest.raises(BlobError, match="device 'opencl' runs targets"):
        Model.load(tmp_path / "cpu.blob", device="opencl")


@needs_opencl
def test_wait_times_out_then_recovers(tmp_path):
    n = 384  # a 0.1 GFLOP matmul: tens of milliseconds even on a fast device
    rng = np.random.default_rng(8)
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", (n, n), "float32")],
                       [("y", (n, n), "float32")], {"w": rng.standard_normal((n, n), np.float32)})
    feeds = {"x": rng.standard_normal((n, n), np.float32)}
    path = tmp_path / "m.blob"
    write_blob(compile_model(model, target="opencl"), path)
    m = Model.load(path)
    want = m.run(feeds)["y"]
    m.timeout_ms = 0.001
    with pytest.raises(DeviceTimeout, match=r"opencl submission \d+ not complete by its deadline "
                                            r"\(0.001 ms after submit\)"):
        for _ in range(20):  # a run that finishes before the first poll is not a timeout
            m.run(feeds)
    m.timeout_ms = SLOW_RUN_MS
    np.testing.assert_array_equal(m.run(feeds)["y"], want)


@needs_opencl
def test_kernel_build_failure_names_kernel_and_shows_log(tmp_path):
    model, _ = mlp(np.random.default_rng(9))
    artifact = compile_model(model, target="opencl")
    src = artifact.programs.decode()
    victim = artifact.launches[1].kernel
    head, sep, rest = src.partition(f"__kernel void {victim}(")
    broken = head + sep + rest.replace("{\n", "{\n  undeclared_thing += 1;\n", 1)
    path = tmp_path / "m.blob"
    write_blob(dataclasses.replace(artifact, programs=broken.encode()), path)
    with pytest.raises(BlobError, match=rf"(?s)OpenCL build failed.*{victim}.*undeclared_thing"):
        Model.load(path)


def test_missing_platform_names_what_to_install(tmp_path):
    """With no ICD registered (OCL_ICD_VENDORS pointing at an empty dir), loading an opencl blob
    fails with the packages to install."""
    model, _ = mlp(np.random.default_rng(10))
    path = tmp_path / "m.blob"
    write_blob(compile_model(model, target="opencl"), path)
    empty = tmp_path / "no_vendors"
    empty.mkdir()
    code = textwrap.dedent(f"""
        from runner import BlobError, Model
        try:
            Model.load({str(path)!r})
        except BlobError as e:
            print("ERROR:", e)
    """)
    env = {**os.environ, "OCL_ICD_VENDORS": str(empty), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert "ERROR:" in out.stdout, out.stderr
    assert "apt-get install pocl-opencl-icd ocl-icd-libopencl1" in out.stdout


# ---- renderer only (no device) ------------------------------------------------------------------

def _clang_cl(src: str, tmp_path: Path, fp16: bool) -> subprocess.CompletedProcess:
    f = tmp_path / "k.cl"
    f.write_text(src)
    ext = "+cl_khr_fp16" if fp16 else "-cl_khr_fp16"
    return subprocess.run([CLANG, "-x", "cl", "-cl-std=CL2.0", "-target", "spir64", "-Xclang",
                           f"-cl-ext={ext}", "-fsyntax-only", str(f)],
                          capture_output=True, text=True)


@needs_clang
def test_half_compute_sources_type_check_with_cl_khr_fp16(tmp_path):
    """qcom (Adreno: cl_khr_fp16) with float16: half arithmetic, fp32 accumulators, half
    images. No CI device runs fp16, so clang's OpenCL front end checks the source; without the
    extension the same source must fail (the check is not vacuous)."""
    sources = [compile_model(m, target="qcom", float16=True).programs.decode() for m in (
        conv_net(np.random.default_rng(11))[0], mlp(np.random.default_rng(11))[0],
        softmax_rows()[0])]
    assert all("read_imageh" in src for src in sources[:2])  # half images
    assert "barrier(CLK_LOCAL_MEM_FENCE)" in sources[2]  # work-group reduction
    for src in sources:
        assert "#pragma OPENCL EXTENSION cl_khr_fp16 : enable" in src
        assert "half4" in src
        assert "float acc" in src and "half acc" not in src  # reductions accumulate in fp32
        ok = _clang_cl(src, tmp_path, fp16=True)
        assert ok.returncode == 0, ok.stderr
        assert _clang_cl(src, tmp_path, fp16=False).returncode != 0


def test_half_compute_rules_are_numerically_sound_on_the_cpu_backend():
    """No CI device computes in fp16, but the same kernel IR (demote_half: elementwise math in
    half, fp32 accumulators) renders to C with _Float16 and runs on the host: an fp16 model
    agrees with onnxruntime to about an ulp of fp16."""
    rng = np.random.default_rng(15)
    w = (rng.standard_normal((256, 32)) * 0.1).astype(np.float16)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Mul", ["r", "r"], ["y"])]
    model = make_model(nodes, [("x", (8, 256), "float16")], [("y", (8, 32), "float16")], {"w": w})
    feeds = {"x": rng.standard_normal((8, 256)).astype(np.float16)}
    target = dataclasses.replace(TARGETS["cpu"], half_compute=True)
    got = keel_run(model, feeds, target=target)["y"].astype(np.float32)
    x32, w32 = feeds["x"].astype(np.float32), w.astype(np.float32)
    exact = np.maximum(x32 @ w32, 0) ** 2
    # one fp16 rounding of the fp32 sum, one of the product: ~2 ulp; an fp16 accumulator over
    # 256 terms would be off by far more
    assert_close(got, exact.astype(np.float32), 2e-3, 2e-3, "fp16 compute")


@needs_opencl
def test_trig_and_hyperbolics_on_opencl_are_within_a_few_ulp_at_every_magnitude(tmp_path):
    """The same reductions and bounds as on the CPU (test_compiler.py TRIG_ULPS): integer
    Payne-Hanek words, mul_hi, selects. Subnormal inputs and results included (PoCL keeps
    them)."""
    x = hostile_floats(np.float32)
    model = trig_model(x)
    check_trig(x, run_opencl(model, {"x": x}, tmp_path)[1], ort_run(model, {"x": x}))


@needs_clang
def test_half_storage_sources_need_no_fp16_extension(tmp_path):
    model, _ = conv_net(np.random.default_rng(12))
    for images in (False, True):
        src = compile_model(model, target="opencl", float16=True, images=images).programs.decode()
        res = _clang_cl(src, tmp_path, fp16=False)
        assert res.returncode == 0, res.stderr


def test_targets_describe_adreno_limits():
    qcom = TARGETS["qcom"]
    assert (qcom.max_workgroup, qcom.image_max_width, qcom.image_pitch_align) == (1024, 16384, 64)
    assert qcom.half_compute and not TARGETS["opencl"].half_compute


def test_launch_sizes_fit_work_group_limits():
    model, _ = conv_net(np.random.default_rng(13), width=64)
    for name in ("opencl", "qcom"):
        artifact = compile_model(model, target=name)
        for ln in artifact.launches:
            assert 1 <= len(ln.global_size) <= 3
            if ln.local_size is not None:
                assert np.prod(ln.local_size) <= TARGETS[name].max_workgroup
                assert all(g % l == 0 for g, l in zip(ln.global_size, ln.local_size))
