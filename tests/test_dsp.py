"""The Hexagon 685 backend executed: `dsp` blobs run under qemu-hexagon through the DSP-side
runtime (sim/dsp/runtime.c, sim/dsp/mock.py, KEEL_FASTRPC=mock) and are compared with onnxruntime.

Tolerances: float kernels run on the DSP's scalar FP units in float32, summing in another order
than onnxruntime and contracting multiply-adds (-ffp-contract=fast), ~1 ulp per step; measured
2026-11-24: the conv model's softmax max abs error 9e-8 on outputs up to 0.35, squeezenet's 1.4e-7
on outputs up to 0.08. rtol=1e-4 with atol=1e-6 is test_aarch64's bound for the same situation and
keeps a >7x margin. Integer kernels are exact: compared with assert_array_equal.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import time

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from compiler.blob import write_blob
from compiler.pipeline import compile_model
from compiler.target import get_target
from dsp import build
from models.quantized import quantize
from sim.dsp import mock
from runner import DeviceError, DeviceTimeout, Model
from runner.errors import ConfigError
from tests.deps import needs
from tests.graphs import assert_close, compiled_blob, make_model, ort_run, random_feeds
from tests.test_aarch64 import LIGHT_DIR, randomized

pytestmark = [needs("qemu-user, clang-19, lld-19", build.missing()),
              pytest.mark.xdist_group("dsp")]
OBJDUMP = "llvm-objdump-19"
SLOW_MS = 120_000  # qemu on a shared 2-core machine: a deadline no healthy run comes near
SCHEDULING_MARGIN_S = 0.5  # as test_device_contract: a hang is reported at its deadline
HVX = re.compile(r"\bv\d+(?::\d+)?(?:\.[bhw])? \+?= (vmpy\w*|vadd|vmax)\(")  # HVX arithmetic
HVX_ANY = re.compile(r"\bv\d+(?::\d+)?(?:\.\w+)? \S?= |\bvmem\(")  # any HVX instruction
SCALAR_FP = re.compile(r"\br\d+ \+?= (sfmpy|sfadd)\(")


def conv_model() -> onnx.ModelProto:
    """Conv (stride 2, padded) -> Relu -> Flatten -> Gemm -> Softmax: a float network in small."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("Gemm", ["f", "w2"], ["g"], transB=1),
             helper.make_node("Softmax", ["g"], ["y"])]
    inits = {"w1": rng.standard_normal((16, 3, 3, 3)).astype(np.float32) * 0.3,
             "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
             "w2": rng.standard_normal((10, 16 * 8 * 8)).astype(np.float32) * 0.05}
    return make_model(nodes, [("x", (1, 3, 16, 16), np.float32)], [("y", (1, 10), np.float32)],
                      inits)


def int8_model(n: int = 4096) -> onnx.ModelProto:
    """max(a * b + c, a) on int8: wrapping int8 arithmetic, one 128-lane HVX vector per step."""
    c = (np.arange(n) % 7 - 3).astype(np.int8)
    nodes = [helper.make_node("Mul", ["a", "b"], ["p"]), helper.make_node("Add", ["p", "c"], ["s"]),
             helper.make_node("Max", ["s", "a"], ["y"])]
    return make_model(nodes, [("a", (n,), np.int8), ("b", (n,), np.int8)],
                      [("y", (n,), np.int8)], {"c": c})


def cnn() -> onnx.ModelProto:
    """Conv (s2) -> Relu -> Conv -> Relu -> MaxPool -> Flatten -> Gemm: a small image network
    for the quantizer (opset 13: per-channel DequantizeLinear needs its axis attribute)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("MaxPool", ["r2"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], transB=1)]
    inits = {"w1": rng.standard_normal((16, 3, 3, 3)).astype(np.float32) * 0.3,
             "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
             "w2": rng.standard_normal((32, 16, 3, 3)).astype(np.float32) * 0.1,
             "b2": rng.standard_normal(32).astype(np.float32) * 0.1,
             "w3": rng.standard_normal((10, 32 * 8 * 8)).astype(np.float32) * 0.03,
             "b3": rng.standard_normal(10).astype(np.float32) * 0.1}
    return make_model(nodes, [("x", (1, 3, 32, 32), np.float32)], [("y", (1, 10), np.float32)],
                      inits, opset=13)


def resblock() -> onnx.ModelProto:
    """A ResNet-ish net for the quantizer: Conv (s2) -> Relu -> AveragePool 2x2 -> [Conv -> Relu
    -> Conv] + skip -> Relu -> Conv 1x1 + skip -> GlobalAveragePool -> Flatten -> Gemm. Its two
    residual Adds join tensors of different scales (quantize_static folds each Relu into the
    QuantizeLinear after it)."""
    rng = np.random.default_rng(0)

    def conv(x, w, y, **attrs):  # weight wN, bias bN
        return helper.make_node("Conv", [x, w, "b" + w[1:]], [y], **attrs)
    nodes = [conv("x", "w1", "c1", pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("AveragePool", ["r1"], ["a1"], kernel_shape=[2, 2], strides=[2, 2]),
             conv("a1", "w2", "c2", pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c2"], ["r2"]),
             conv("r2", "w3", "c3", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c3", "a1"], ["s"]), helper.make_node("Relu", ["s"], ["r3"]),
             conv("r3", "w4", "c4"), helper.make_node("Add", ["c4", "r3"], ["s2"]),
             helper.make_node("GlobalAveragePool", ["s2"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "w5", "b5"], ["y"], transB=1)]
    shapes = {"w1": (32, 3, 3, 3), "w2": (32, 32, 3, 3), "w3": (32, 32, 3, 3),
              "w4": (32, 32, 1, 1), "w5": (10, 32)}
    inits = {}
    for w, shape in shapes.items():  # weights ~ 1/sqrt(fan-in): activations stay O(1)
        inits[w] = (rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))).astype(np.float32)
        inits["b" + w[1:]] = rng.standard_normal(shape[0]).astype(np.float32) * 0.1
    return make_model(nodes, [("x", (1, 3, 32, 32), np.float32)], [("y", (1, 10), np.float32)],
                      inits, opset=13)


def image(seed: int) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((1, 3, 32, 32)).astype(np.float32)}


def quantized(model: onnx.ModelProto, images: list[dict]) -> onnx.ModelProto:
    """`model` through onnxruntime's quantize_static: QDQ format, int8 activations calibrated on
    `images`, int8 weights per output channel, int32 biases."""
    return quantize(model, images, activations="int8", pre_process=False)


def qdq_cnn() -> onnx.ModelProto:
    return quantized(cnn(), [image(k) for k in range(8)])


def qdq_resblock() -> onnx.ModelProto:
    return quantized(resblock(), [image(k) for k in range(8)])


def squeezenet64() -> onnx.ModelProto:
    """onnx's light squeezenet (randomized weights, test_aarch64) at 64x64: it ends in a global
    average pool, so a smaller image is the same network at 1/12 of the emulated time."""
    model = randomized(onnx.load(LIGHT_DIR / "light_squeezenet.onnx"), seed=0)
    image = next(i for i in model.graph.input if len(i.type.tensor_type.shape.dim) == 4)
    dims = image.type.tensor_type.shape.dim
    dims[2].dim_value = dims[3].dim_value = 64
    del model.graph.value_info[:]
    for out in model.graph.output:
        out.type.tensor_type.ClearField("shape")
    return model


def qdq_squeezenet() -> onnx.ModelProto:
    """squeezenet64() through quantize_static: a real network's QDQ model (opset 13, the graph
    inputs that the old IR also lists for weights dropped), calibrated on 8 images."""
    from onnx import version_converter
    model = squeezenet64()
    weights = {i.name for i in model.graph.initializer}
    data = [i for i in model.graph.input
            if i.name not in weights and len(i.type.tensor_type.shape.dim) == 4]
    del model.graph.input[:]
    model.graph.input.extend(data)
    model = version_converter.convert_version(model, 13)
    rng = [np.random.default_rng(k) for k in range(8)]
    return quantized(model, [{data[0].name: r.standard_normal((1, 3, 64, 64)).astype(np.float32)}
                             for r in rng])


@pytest.fixture(scope="module")
def blobs():
    """name -> (model, blob path), compiled for `dsp` once across workers (compiled_blob)."""
    made = {}

    def get(name):
        if name not in made:
            model = {"conv": conv_model, "int8": int8_model, "squeezenet": squeezenet64,
                     "qdq": qdq_cnn, "qdq-res": qdq_resblock}[name]()
            made[name] = model, compiled_blob(model, target="dsp")
        return made[name]
    return get


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    monkeypatch.setenv("KEEL_FASTRPC", "mock")
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)


def _load(path) -> Model:
    m = Model.load(path)  # the blob's target names the device: "dsp"
    m.timeout_ms = SLOW_MS
    return m


def _disassemble(blob_path) -> str:
    from runner.blob import read_blob
    so = bytes(read_blob(blob_path).programs)
    return subprocess.run([OBJDUMP, "-d", "-"], input=so, capture_output=True,
                          check=True).stdout.decode()


# ---- the renderer's objects --------------------------------------------------------------------

def test_integer_kernels_are_hvx_and_float_kernels_scalar_fp(blobs):
    ints, floats = _disassemble(blobs("int8")[1]), _disassemble(blobs("conv")[1])
    assert {m.group(1)[:4] for m in HVX.finditer(ints)} >= {"vmpy", "vadd", "vmax"}
    assert not SCALAR_FP.search(ints)
    assert SCALAR_FP.search(floats)
    assert not HVX.search(floats), "v65 HVX has no float lanes: float kernels stay scalar"


def test_programs_are_a_position_independent_v65_object(blobs):
    from runner.blob import read_blob
    so = bytes(read_blob(blobs("conv")[1]).programs)
    assert so[:4] == b"\x7fELF" and so[4] == 1  # ELF32
    e_type, e_machine = np.frombuffer(so[16:20], "<u2")
    e_flags = int(np.frombuffer(so[36:40], "<u4")[0])
    assert (e_type, e_machine) == (3, 164)  # ET_DYN, EM_HEXAGON
    assert e_flags & 0xff == 0x65  # EF_HEXAGON_MACH_V65: runs on the Hexagon 685
    dyn = subprocess.run(["llvm-readelf-19", "-d", "-l", "-r", "-"], input=so, capture_output=True,
                         check=True).stdout.decode()
    assert "TEXTREL" not in dyn  # code is never patched: shareable, mappable read-only
    # every loadable segment page-aligned, as the DSP's loader maps them
    aligns = [int(line.split()[-1], 16) for line in dyn.splitlines() if line.strip()
              .startswith("LOAD")]
    assert aligns and all(a % 4096 == 0 for a in aligns)


# ---- runs under qemu-hexagon --------------------------------------------------------------------

def test_float_model_matches_onnxruntime(blobs):
    model, path = blobs("conv")
    feeds = random_feeds(model, seed=1)
    assert_close(_load(path).run(feeds)["y"], ort_run(model, feeds)["y"], 1e-4, 1e-6, "conv")


@pytest.mark.slow  # ~10 s compile, ~10 s of scalar FP under emulation
def test_light_squeezenet_matches_onnxruntime(blobs):
    model, path = blobs("squeezenet")
    feeds = random_feeds(model, seed=1)
    (name, want), = ort_run(model, feeds).items()
    assert want.std() > 1e-4  # randomized: the outputs are not all equal
    assert_close(_load(path).run(feeds)[name], want, 1e-4, 1e-6, "squeezenet")


def test_hvx_int8_kernels_match_onnxruntime_exactly(blobs):
    model, path = blobs("int8")
    m = _load(path)
    for seed in (1, 2):  # a second run on new inputs: the shared buffer is rewritten
        feeds = random_feeds(model, seed=seed)
        np.testing.assert_array_equal(m.run(feeds)["y"], ort_run(model, feeds)["y"])


def test_outputs_bound_to_host_arrays_are_copied_back(blobs):
    model, path = blobs("int8")
    m, feeds = _load(path), random_feeds(model, seed=3)
    y = np.full(4096, 77, np.int8)
    m.run(feeds, out={"y": y})
    np.testing.assert_array_equal(y, ort_run(model, feeds)["y"])


def test_profiled_runs_count_packets_per_kernel_and_hvx_only_where_integer(blobs):
    """qemu's packet counter per launch: the cost signal. The int8 kernel's work is HVX; the
    float model has none. A profiled run computes the same outputs (launch by launch)."""
    for name, hvx in (("int8", True), ("conv", False)):
        model, path = blobs(name)
        m, feeds = _load(path), random_feeds(model, seed=1)
        m.device.profile(True)
        got, n = m.run(feeds), len(m.blob.launches)
        packets, hvx_ops = m.device.last_ticks[:n], m.device.last_ticks[n:]
        assert len(m.device.last_ticks) == 2 * n and all(p > 0 for p in packets)
        assert (sum(hvx_ops) > 0) == hvx, name
        for k, want in ort_run(model, feeds).items():
            assert_close(got[k], want, 1e-4, 1e-6, name)


def test_hvx_kernel_takes_a_tenth_of_the_packets_of_scalar_code(blobs, tmp_path):
    """The cost signal compares HVX with scalar code: the same int8 kernel compiled with 4-byte
    "vectors" (what a target without HVX would tile for). Measured 2026-11-24 under qemu 7.2:
    175 packets against 17419; 10x leaves room for scheduling changes."""
    model, path = blobs("int8")
    scalar = dataclasses.replace(get_target("dsp"), vector_bytes=4)
    write_blob(compile_model(model, target=scalar), tmp_path / "scalar.blob")
    feeds, packets = random_feeds(model, seed=1), []
    for p in (path, tmp_path / "scalar.blob"):
        m = _load(p)
        m.device.profile(True)
        np.testing.assert_array_equal(m.run(feeds)["y"], ort_run(model, feeds)["y"])
        packets.append(sum(m.device.last_ticks[:len(m.blob.launches)]))
    assert packets[0] * 10 < packets[1], packets


# ---- threads: each launch shared between the cDSP's hardware threads ----------------------------

# a share's own cost: its call, its loop bounds (two divisions); docs/dsp.md "Threads" has the
# packets measured per extra share on these models
SHARE_PACKETS = 200


def _threaded_and_serial(model, path, feeds):
    """Profiled runs with the runtime's workers, then on one thread: (outputs, per worker per
    launch packets, spans) for each."""
    runs = []
    for serial in (False, True):
        m = _load(path)
        m.device.serial = serial
        m.device.profile(True)
        runs.append((m.run(feeds), m.device.worker_ticks, m.device.spans()))
        m.close()
    return runs


@pytest.mark.parametrize("name", ["conv", "qdq"])
def test_threaded_runs_are_bit_identical_to_one_thread_and_shorten_the_critical_path(name, blobs):
    """The float model (scalar FP: split four ways) and the quantized CNN (HVX: two ways, the
    SD845's HVX contexts): every output bit for bit as on one thread (each output keeps its
    reduction order), the threads' packets together the single thread's plus at most
    SHARE_PACKETS per extra share, and the critical path (per launch its slowest thread, summed)
    well under the total."""
    model, path = blobs(name)
    (got, threads, _), (want, serial, _) = _threaded_and_serial(model, path,
                                                                random_feeds(model, seed=1))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert not any(map(any, serial[1:]))  # serial: worker 0 alone
    shares = sum(p > 0 for row in threads for p in row)
    total, one = sum(map(sum, threads)), sum(serial[0])
    assert one <= total <= one + SHARE_PACKETS * (shares - len(serial[0])), (one, total)
    critical = sum(map(max, zip(*threads)))
    assert critical < 0.6 * total, (critical, total)
    workers = {sum(p > 0 for p in launch) for launch in zip(*threads)}
    assert max(workers) == 4  # each model has a scalar kernel, split over the 4 threads


def test_hvx_kernels_split_two_ways_and_a_kernel_with_one_output_runs_on_one_thread(blobs):
    """The quantized CNN's HVX convs run on the 2 HVX contexts; the float model's softmax max
    over one row (one output: nothing to split) runs on worker 0 alone; spans() draws each
    share on its worker's lane."""
    from runner.blob import read_blob
    for name in ("qdq", "conv"):
        model, path = blobs(name)
        (_, threads, spans), _ = _threaded_and_serial(model, path, random_feeds(model, seed=1))
        blob = read_blob(path)
        # the timeline: a lane per worker with a share; a launch starts when the last share of
        # the one before it has ended
        assert {(s.launch, s.lane) for s in spans} == \
            {(i, w) for w, row in enumerate(threads) for i, p in enumerate(row) if p}
        ends = [max(s.end_ns for s in spans if s.launch == i) for i in range(len(threads[0]))]
        assert all(s.start_ns == (ends[s.launch - 1] if s.launch else 0) for s in spans)
        for i, ln in enumerate(blob.launches):
            on = [w for w, row in enumerate(threads) if row[i]]
            if blob.buffers[ln.args[0]].nbytes <= 4:
                assert on == [0], (name, ln.kernel, on)
            elif name == "qdq" and "_radd_1x32x" in ln.kernel:
                assert on == [0, 1], (ln.kernel, on)


def test_fastrpc_sizes_a_profiled_answer_as_the_runtime_fills_it(blobs):
    """dsp/fastrpc.py gives RUN an out buffer of the answer's size; the emulated runtime's
    answer to the same request (the skel's code) is exactly that long."""
    import struct
    from dsp import fastrpc
    model, path = blobs("conv")
    m, answers = _load(path), []
    link = m.device._link
    replies = link.replies

    def spy():
        got = replies()
        answers.extend(got)
        return got
    link.replies = spy
    m.device.profile(True)
    m.run(random_feeds(model, seed=1))
    n = len(m.blob.launches)
    (_, _, ticks), = [a for a in answers if a[0]]  # (seq, status, ticks); seq 0: loaded
    assert fastrpc.profile_bytes(struct.pack("<5I", 1, 1, 0, n, 0)) == 8 * len(ticks) > 0
    assert fastrpc.profile_bytes(struct.pack("<5I", 1, 0, 0, n, 0)) == 0  # unprofiled


# ---- the int8 QDQ path -------------------------------------------------------------------------

def _output_step(model: onnx.ModelProto) -> float:
    """The scale of the last DequantizeLinear before the graph output: one quantization step."""
    out = model.graph.output[0].name
    node = next(n for n in model.graph.node if out in n.output)
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    return float(inits[node.input[1]])


@pytest.mark.parametrize("target", ["dsp", "cpu"])
@pytest.mark.parametrize("name", ["qdq", "qdq-res"])
def test_quantize_static_model_matches_onnxruntime(name, target, blobs):
    """Bound: 2 steps of the output scale for the CNN, 3 for the residual net, and the same
    top-1. The output is quantized
    (DequantizeLinear of int8), and keel rounds differently from onnxruntime in two places:
    - each conv's requantization is a fixed-point multiply rounding half up, onnxruntime's is
      float rounding half to even: they differ where the value is within float error of a
      half, one step on that element, rarely;
    - an average pool requantized to its input's scale (the residual net's 2x2 pool) divides
      an exact int32 sum by 4 and rounds halves to even; onnxruntime divides a float sum, and
      its halves (1 sum in 4) land an ulp either side, so ~3% of the pool's outputs are one
      step apart. The convs after it sum those differences (up to 3 steps in the intermediate
      layers, measured), and the global average pool and Gemm average them down again.
    That propagation has no tight bound, so the residual net's is empirical with a step of
    margin: measured 2026-11-24 over images 20-29, the CNN 0 steps, the residual net 0-2 (1 on
    these three), the same on cpu and dsp."""
    model, path = blobs(name)
    if target == "cpu":
        from compiler.toolchain import host_target
        path = compiled_blob(model, target=host_target())
    m, step = (_load(path) if target == "dsp" else Model.load(path)), _output_step(model)
    for seed in (20, 21, 22):  # not among the calibration images
        got, want = m.run(image(seed))["y"], ort_run(model, image(seed))["y"]
        bound = {"qdq": 2, "qdq-res": 3}[name] * step + 1e-6
        assert np.abs(got - want).max() <= bound, (seed, np.abs(got - want).max(), step)
        assert got.argmax() == want.argmax()


@pytest.mark.slow  # ~40 s compile (cached across runs by tests/graphs.py), 2 s under qemu
def test_quantized_squeezenet_matches_onnxruntime_on_the_emulated_dsp():
    """Same bound as the CNN's (2 output steps, same top-1) over ten requantized layers, where
    onnxruntime's fused kernels round in float: measured 2026-11-24, 0 steps on these images
    (the output is a softmax quantized to 1/255)."""
    model = qdq_squeezenet()
    path = compiled_blob(model, target="dsp")
    m, step = _load(path), _output_step(model)
    for seed in (30, 31, 32):
        feeds = {model.graph.input[0].name: np.random.default_rng(seed)
                 .standard_normal((1, 3, 64, 64)).astype(np.float32)}
        (name, want), = ort_run(model, feeds).items()
        got = m.run(feeds)[name]
        assert np.abs(got - want).max() <= 2 * step + 1e-6 and got.argmax() == want.argmax()
    # its convs (the 1000-channel one too: computed to 1024 channels, whole HVX vectors) and
    # max pools; the expand convs before each rescaling Concat are float kernels
    assert _integer_kernels_run_hvx(path, m, feeds, None) >= 20


def test_qdq_matmul_runs_in_integers_on_cpu(tmp_path, monkeypatch):
    """MatMul's weights are quantized per output column (the last axis); the integer path
    must pick those scales, not the rows'. Bound as above: the output is one requantized layer,
    so 1 step; measured 0."""
    from compiler.toolchain import host_target
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, 24)).astype(np.float32)
    w *= np.linspace(0.01, 1, 24, dtype=np.float32)  # column scales far apart: per-column matters
    model = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])],
                       [("x", (1, 16, 32), np.float32)], [("y", (1, 16, 24), np.float32)],
                       {"w": w}, opset=13)
    feeds = [{"x": np.random.default_rng(k).standard_normal((1, 16, 32)).astype(np.float32)}
             for k in range(6)]
    q = quantized(model, feeds[:4])
    assert [n.op_type for n in q.graph.node].count("DequantizeLinear") == 3
    from compiler.onnx.ops import quant
    taken, contract = [], quant.integer_contract
    monkeypatch.setattr(quant, "integer_contract",
                        lambda *a: taken.append(contract(*a)) or taken[-1])
    write_blob(compile_model(q, target=host_target()), tmp_path / "mm.blob")
    assert any(t is not None for t in taken), "the MatMul took the float path"
    m, step = Model.load(tmp_path / "mm.blob"), _output_step(q)
    for f in feeds[4:]:
        got, want = m.run(f)["y"], ort_run(q, f)["y"]
        assert np.abs(got - want).max() <= step + 1e-6


@pytest.mark.parametrize("m", [1e-9, 2.0 ** -31 * 1.5, 0.3, 0.999999, 0.5, 0.75, 1.0, 3.0])
def test_fixed_point_multiplier_is_within_half_a_unit_of_q31(m):
    from compiler.onnx.ops.quant import fixed_point
    m0, r = fixed_point(np.array([m]))
    assert 1 << 30 <= m0[0] < 1 << 31 and 1 <= r[0] <= 62
    assert abs(m0[0] * 2.0 ** -r[0] - m) <= 2.0 ** -(r[0] + 1)
    acc = np.arange(-5000, 5000, 7, dtype=np.int64)  # the requantization the kernels compute
    got = (acc * m0[0] + (1 << int(r[0] - 1))) >> r[0]
    assert np.abs(got - acc * m).max() <= 0.5 + 1e-6 * max(1, np.abs(acc * m).max())


@pytest.mark.parametrize("target", ["dsp", "cpu"])
def test_int32_requantization_equals_the_int64_formula_at_the_extremes(target, tmp_path):
    """The requantization runs in int32 lanes (quant.py:mulhi, a 32x32 high multiply from
    16-bit halves); it must equal (acc * m0 + 2**(r-1)) >> r in int64 exactly, for every
    int32 accumulator. A QDQ Gemm whose int32 biases reach +-2**31 (minus what the products
    add) and whose per-channel multipliers run from 2**-31 to 0.24 (r from 33 to 62) gives
    accumulators over the whole int32 range; the output zero point and small scales keep most
    of them inside int8, so a wrong low bit shows. Exact: compared with assert_array_equal."""
    from compiler.onnx.ops.quant import fixed_point
    from compiler.toolchain import host_target
    rng = np.random.default_rng(7)
    n, k, rows = 32, 8, 64
    m = np.geomspace(2.0 ** -31, 0.24, n)  # the multipliers, one per output channel
    spread = np.minimum(2.0 ** 31 - 1 - 127 * 128 * k, 120 / m)  # |acc * m| stays near int8
    bias = (rng.uniform(-1, 1, n) * spread).astype(np.int32)
    w = rng.integers(-127, 128, (n, k), dtype=np.int8)
    x = rng.integers(-128, 128, (rows, k), dtype=np.int8)
    sw = m.astype(np.float32)  # sx = sy = 1, so m = sw (as float32 -> float64)
    inits = {"sx": np.float32(1), "zx": np.int8(0), "w": w, "sw": sw, "zw": np.zeros(n, np.int8),
             "b": bias, "sb": sw, "zb": np.zeros(n, np.int32), "sy": np.float32(1),
             "zy": np.int8(3)}
    nodes = [helper.make_node("DequantizeLinear", ["x", "sx", "zx"], ["xf"]),
             helper.make_node("DequantizeLinear", ["w", "sw", "zw"], ["wf"], axis=0),
             helper.make_node("DequantizeLinear", ["b", "sb", "zb"], ["bf"], axis=0),
             helper.make_node("Gemm", ["xf", "wf", "bf"], ["yf"], transB=1),
             helper.make_node("QuantizeLinear", ["yf", "sy", "zy"], ["y"])]
    model = make_model(nodes, [("x", (rows, k), np.int8)], [("y", (rows, n), np.int8)], inits,
                       opset=13)
    path = tmp_path / "gemm.blob"
    write_blob(compile_model(model, target=target if target == "dsp" else host_target()), path)
    got = (_load(path) if target == "dsp" else Model.load(path)).run({"x": x})["y"]
    m0, r = fixed_point(sw.astype(np.float64))
    assert r.min() > 32  # the int32 path (a multiplier of 1/4 or more keeps int64)
    acc = x.astype(np.int64) @ w.astype(np.int64).T + bias
    want = np.clip(((acc * m0 + (1 << (r - 1))) >> r) + 3, -128, 127)
    assert np.abs(acc).max() > 2 ** 30 and (np.abs(want) < 127).mean() > 0.5  # what it covers
    np.testing.assert_array_equal(got, want)


def test_qdq_concat_and_max_pool_at_one_scale_stay_int8(tmp_path):
    """Q(Concat(DQ(a), DQ(b))) and Q(MaxPool(DQ(.))) at the inputs' scale and zero point are the
    integers themselves: the blob has no float buffer, and the output equals onnxruntime's
    exactly (the float round trip of an int8 value is exact, so there is no rounding to
    differ in)."""
    from compiler.toolchain import host_target
    from runner.blob import read_blob
    q = {"s": np.float32(0.05), "z": np.int8(-7)}
    nodes = [helper.make_node("DequantizeLinear", ["a", "s", "z"], ["af"]),
             helper.make_node("DequantizeLinear", ["b", "s", "z"], ["bf"]),
             helper.make_node("Concat", ["af", "bf"], ["c"], axis=1),
             helper.make_node("QuantizeLinear", ["c", "s", "z"], ["cq"]),
             helper.make_node("DequantizeLinear", ["cq", "s", "z"], ["cf"]),
             helper.make_node("MaxPool", ["cf"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("QuantizeLinear", ["p", "s", "z"], ["y"])]
    model = make_model(nodes, [("a", (1, 8, 16, 16), np.int8), ("b", (1, 24, 16, 16), np.int8)],
                       [("y", (1, 32, 8, 8), np.int8)], q, opset=13)
    path = tmp_path / "cat.blob"
    write_blob(compile_model(model, target=host_target()), path)
    assert all(np.dtype(b.dtype).kind == "i" for b in read_blob(path).buffers.values())
    feeds = random_feeds(model, seed=4)
    np.testing.assert_array_equal(Model.load(path).run(feeds)["y"], ort_run(model, feeds)["y"])


def test_qdq_add_and_average_pools_run_in_integers_and_round_as_onnxruntime(tmp_path):
    """Q(AveragePool(DQ a)) at a's own scale, Q(DQ a + DQ b) across three scales and
    Q(GlobalAveragePool(DQ a)) to another scale: no float buffer in the blob, and
    - the 2x2 pool is the exact int32 sum / 4 rounded half to even; onnxruntime's float sum
      lands its halves an ulp either side, so it is 1 step away on exact halves only;
    - the Add (both inputs in Q20 of the larger scale) and the global pool (the count folded
      into the requantization's multiplier) round the exact value, except within 1e-3 of a
      half (the Q20 ratio's error is below 255 * 2**-21 of a step of the larger scale), and
      are within 1 step of onnxruntime everywhere."""
    from compiler.toolchain import host_target
    from runner.blob import read_blob
    q = {"sa": np.float32(0.031), "za": np.int8(-9), "sb": np.float32(0.0127),
         "zb": np.int8(5), "sy": np.float32(0.0405), "zy": np.int8(-3),
         "sg": np.float32(0.0078), "zg": np.int8(11)}
    dq = lambda x, t: helper.make_node("DequantizeLinear", [x, "s" + t, "z" + t], [x + "f"])  # noqa
    qn = lambda x, y, t: helper.make_node("QuantizeLinear", [x, "s" + t, "z" + t], [y])  # noqa
    nodes = [dq("a", "a"), dq("b", "b"),
             helper.make_node("AveragePool", ["af"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Add", ["af", "bf"], ["s"]),
             helper.make_node("GlobalAveragePool", ["af"], ["g"]),
             qn("p", "pq", "a"), qn("s", "sq", "y"), qn("g", "gq", "g")]
    shape = (1, 16, 8, 8)
    model = make_model(nodes, [("a", shape, np.int8), ("b", shape, np.int8)],
                       [("pq", (1, 16, 4, 4), np.int8), ("sq", shape, np.int8),
                        ("gq", (1, 16, 1, 1), np.int8)], q, opset=13)
    path = tmp_path / "pools.blob"
    write_blob(compile_model(model, target=host_target()), path)
    assert all(np.dtype(b.dtype).kind in "iu" for b in read_blob(path).buffers.values())
    m = Model.load(path)
    for seed in (1, 2):
        feeds = random_feeds(model, seed=seed)
        got, ort = m.run(feeds), ort_run(model, feeds)
        a, b = (feeds[k].astype(np.int64) - int(q["z" + k]) for k in "ab")
        sums = a.reshape(1, 16, 4, 2, 4, 2).sum((3, 5))
        np.testing.assert_array_equal(got["pq"], np.clip(np.round(sums / 4) - 9, -128, 127))
        off = got["pq"] != ort["pq"]
        assert np.all(sums[off] % 4 == 2) and np.abs(got["pq"] - ort["pq"].astype(int)).max() <= 1
        f64 = lambda v: float(np.float32(v))  # noqa: E731  the scales as the model holds them
        exact = {"sq": ((f64(q["sa"]) * a + f64(q["sb"]) * b) / f64(q["sy"]), -3),
                 "gq": (a.sum((2, 3), keepdims=True) * f64(q["sa"]) / 64 / f64(q["sg"]), 11)}
        for k, (v, zp) in exact.items():
            sure = np.abs(v - np.floor(v) - 0.5) > 1e-3
            want = np.clip(np.round(v) + zp, -128, 127)
            np.testing.assert_array_equal(got[k][sure], want[sure])
            assert np.abs(got[k] - ort[k].astype(int)).max() <= 1, k


def test_qdq_mul_runs_in_integers_and_rounds_the_exact_product(tmp_path):
    """Q(DQ a * DQ b) with b broadcast per channel, the way QLinearMul defines it: no float
    buffer in the blob, the exact product's rounding except within 1e-3 of a half (the Q31
    multiplier's error is below 2**-31 of the value, so only near-halves can turn), and within
    1 step of onnxruntime everywhere (its float product rounds near-halves either way)."""
    from compiler.toolchain import host_target
    from runner.blob import read_blob
    q = {"sa": np.float32(0.023), "za": np.int8(4), "sb": np.float32(0.0191),
         "zb": np.int8(-7), "sy": np.float32(0.0377), "zy": np.int8(2)}
    nodes = [helper.make_node("DequantizeLinear", [x, "s" + x, "z" + x], [x + "f"]) for x in "ab"]
    nodes += [helper.make_node("Mul", ["af", "bf"], ["p"]),
              helper.make_node("QuantizeLinear", ["p", "sy", "zy"], ["y"])]
    model = make_model(nodes, [("a", (1, 16, 8, 8), np.int8), ("b", (1, 16, 1, 1), np.int8)],
                       [("y", (1, 16, 8, 8), np.int8)], q, opset=13)
    path = tmp_path / "mul.blob"
    write_blob(compile_model(model, target=host_target()), path)
    assert all(np.dtype(b.dtype).kind in "iu" for b in read_blob(path).buffers.values())
    # DQ -> Mul -> Q is one elementwise kernel either way: its source says which arithmetic
    assert "float" not in compile_model(model, target="opencl").programs.decode()
    m = Model.load(path)
    for seed in (1, 2):
        feeds = random_feeds(model, seed=seed)
        got, ort = m.run(feeds)["y"], ort_run(model, feeds)["y"]
        a, b = (feeds[k].astype(np.int64) - int(q["z" + k]) for k in "ab")
        v = float(np.float32(q["sa"])) * float(np.float32(q["sb"])) * a * b / float(q["sy"])
        sure = np.abs(v - np.floor(v) - 0.5) > 1e-3
        want = np.clip(np.round(v) + 2, -128, 127)
        np.testing.assert_array_equal(got[sure], want[sure])
        assert np.abs(got.astype(int) - ort.astype(int)).max() <= 1


@pytest.mark.parametrize("target", ["dsp", "cpu"])
def test_quantize_linear_rounds_halves_to_even_and_saturates_exactly(target, tmp_path):
    """QuantizeLinear of float32 to int8 / uint8 (quant.py:_round_to: clamp, then the 1.5 *
    2**23 add and subtract) equals onnxruntime exactly: exact halves both ways (scale 0.5
    makes x / scale exact), values a float32 ulp either side of a half, -0.0, out-of-range
    values and infinities saturating, a zero point moving the clamp."""
    from compiler.toolchain import host_target
    halves = np.arange(-140, 140) + 0.5
    near = np.concatenate([np.nextafter(halves, np.inf), np.nextafter(halves, -np.inf)])
    x = np.concatenate([halves, near, [-0.0, 0.0, 1e6, -1e6, np.inf, -np.inf, 254.5, 255.5]])
    x = (x * 0.5).astype(np.float32)
    inits = {"s": np.float32(0.5), "zi": np.int8(-3), "zu": np.uint8(130)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zi"], ["yi"]),
             helper.make_node("QuantizeLinear", ["x", "s", "zu"], ["yu"])]
    model = make_model(nodes, [("x", x.shape, np.float32)],
                       [("yi", x.shape, np.int8), ("yu", x.shape, np.uint8)], inits, opset=13)
    path = tmp_path / "q.blob"
    write_blob(compile_model(model, target=target if target == "dsp" else host_target()), path)
    got = (_load(path) if target == "dsp" else Model.load(path)).run({"x": x})
    for k, want in ort_run(model, {"x": x}).items():
        np.testing.assert_array_equal(got[k], want, k)


@pytest.mark.parametrize("m", [0.0, -0.5, 1e-12, 2.0 ** 31])
def test_multipliers_without_a_q31_form_keep_the_float_requantization(m):
    from compiler.onnx.ops.quant import fixed_point
    assert fixed_point(np.array([0.5, m])) is None


def _functions(text: str) -> dict[str, str]:
    """llvm-objdump's disassembly split per function symbol."""
    parts = re.split(r"^[0-9a-f]+ <(\w+)>:$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _integer_kernels_run_hvx(path, m: Model, feeds: dict, float_ops: set | None) -> int:
    """Runs `feeds` profiled and checks that every launch whose buffers are all integers
    disassembles to HVX instructions in its own symbol (dsp kernels are not inlined) and
    executes some under qemu; every other launch computes only `float_ops` (ONNX op types;
    None: any). Returns the number of integer launches."""
    from runner.blob import read_blob
    m.device.profile(True)
    m.run(feeds)
    m.device.profile(False)
    blob, n = read_blob(path), len(m.blob.launches)
    kinds = {i: np.dtype(b.dtype).kind for i, b in blob.buffers.items()}
    code, prov = _functions(_disassemble(path)), blob.variant_manifest["provenance"]
    ints = 0
    for i, ln in enumerate(m.blob.launches):
        ops = {prov["nodes"][k][1] for k in prov["launches"][i]}
        if all(kinds[a] in "iu" for a in ln.args):
            ints += 1
            assert HVX_ANY.search(code[ln.kernel]), (ln.kernel, ops)
            assert m.device.last_ticks[n + i] > 0, (ln.kernel, ops)  # executed HVX
        else:
            assert float_ops is None or ops <= float_ops, (ln.kernel, ops)
    # no float64 (v65 has no double instructions: they would be calls the runtime lacks)
    assert "df" not in set(re.findall(r"= (df)\w+\(", "".join(code.values())))
    return ints


@pytest.mark.parametrize("name", ["qdq", "qdq-res"])
def test_every_integer_kernel_of_a_qdq_model_is_hvx(name, blobs):
    """Every integer kernel (convs with their requantization, max and average pools, flatten,
    residual adds) is HVX code, and the kernels that are not integer are the graph's float
    ends only: quantizing the float input, and the Gemm whose result is dequantized to the
    float output (v65 has no HVX float). Before: the CNN's max pool + flatten ran 56,780
    scalar packets (its Flatten lost the integers)."""
    model, path = blobs(name)
    ints = _integer_kernels_run_hvx(path, _load(path), image(20),
                                    {"QuantizeLinear", "DequantizeLinear", "Gemm"})
    assert ints >= {"qdq": 4, "qdq-res": 8}[name], ints


# ---- faults: the runtime core's contract on the emulated DSP ------------------------------------

def test_hang_times_out_at_its_deadline_and_the_next_run_matches(blobs, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "hang@2")
    model, path = blobs("int8")
    m = _load(path)
    feeds = [random_feeds(model, seed=s) for s in (1, 2)]
    np.testing.assert_array_equal(m.run(feeds[0])["y"], ort_run(model, feeds[0])["y"])
    t = time.monotonic()
    with pytest.raises(DeviceTimeout, match=r"dsp submission 2 not complete by its deadline "
                                            r"\(100 ms after submit\)"):
        m.run(feeds[1], timeout_ms=100)
    assert 0.100 <= time.monotonic() - t < 0.100 + SCHEDULING_MARGIN_S
    np.testing.assert_array_equal(m.run(feeds[1])["y"], ort_run(model, feeds[1])["y"])


def test_fault_is_a_device_error_and_the_next_run_recovers(blobs, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "fault@1,slow@2:30")
    model, path = blobs("int8")
    m, feeds = _load(path), random_feeds(model, seed=1)
    with pytest.raises(DeviceError, match=r"dsp invoke 1 failed on the DSP"):
        m.run(feeds)
    t = time.monotonic()
    np.testing.assert_array_equal(m.run(feeds)["y"], ort_run(model, feeds)["y"])
    assert time.monotonic() - t >= 0.030


def test_timeline_and_waits_follow_the_device_contract(blobs):
    """runner/device.py v2, as test_device_contract checks it for the other devices: values grow
    by one, invokes queue in order, a completed wait with a past deadline is no timeout."""
    model, path = blobs("int8")
    m = _load(path)
    dev, feeds = m.device, random_feeds(model, seed=5)
    dev.io_buffer(0)[:], dev.io_buffer(1)[:] = feeds["a"], feeds["b"]
    assert m.input_view("a") is dev.io_buffer(0)
    deadline = time.monotonic() + SLOW_MS / 1000
    values = [dev.submit(deadline) for _ in range(3)]
    assert values[1:] == [values[0] + 1, values[0] + 2]
    dev.wait(values[-1], deadline)
    assert dev.completed() >= values[-1]
    dev.wait(values[0], time.monotonic() - 1)
    np.testing.assert_array_equal(dev.io_buffer(2), ort_run(model, feeds)["y"])


def test_recover_without_a_failure_and_double_close_are_harmless(blobs):
    model, path = blobs("int8")
    m, feeds = _load(path), random_feeds(model, seed=6)
    m.device.recover()  # a new emulated DSP, the shared buffer (weights) kept
    np.testing.assert_array_equal(m.run(feeds)["y"], ort_run(model, feeds)["y"])
    m.close()
    m.close()
    with pytest.raises(DeviceError, match="run\\(\\) on a closed Model; load it again"):
        m.run(feeds)


def test_runtime_refuses_an_object_that_is_not_hexagon(tmp_path):
    from compiler.toolchain import build_shared
    link = mock.QemuTransport()
    try:
        link.alloc(4096)
        x86 = build_shared("void keel_graph(void) {}\n", "cpu")
        with pytest.raises(DeviceError, match="not an ELF32 Hexagon shared object"):
            link.open(x86, 0, 0, [], b"", time.monotonic() + 30)
    finally:
        link.close()


def test_the_skel_refuses_a_launch_table_past_the_shared_buffer(blobs):
    # the emulated DSP calls dsp/skel.c's entry with LOAD's remote_args: its check, not the mock's
    import struct
    from runner.blob import read_blob
    link = mock.QemuTransport()
    try:
        link.alloc(4096)
        table = struct.pack("<2I", 1, 4096)  # one launch, its one argument at the buffer's end
        with pytest.raises(DeviceError, match="the skel refused the programs: a bad launch table"):
            link.open(bytes(read_blob(blobs("int8")[1]).programs), 0, 0, [], table,
                      time.monotonic() + 30)
    finally:
        link.close()


def test_without_fastrpc_and_without_the_mock_load_says_what_to_do(blobs, monkeypatch):
    import os
    from dsp import fastrpc
    if os.path.exists(fastrpc.RPC_NODE):
        pytest.skip("a FastRPC device: the transport opens for real (tests/device/test_dsp.py)")
    monkeypatch.delenv("KEEL_FASTRPC")
    with pytest.raises(DeviceError, match="adsprpc-smd absent: .* set KEEL_FASTRPC=mock"):
        Model.load(blobs("int8")[1])


def test_a_wrong_transport_is_a_config_error(blobs, monkeypatch):
    monkeypatch.setenv("KEEL_FASTRPC", "usb")
    with pytest.raises(ConfigError,
                       match=r"KEEL_FASTRPC='usb': expected 'mock' .* or unset/'device'"):
        Model.load(blobs("int8")[1])
