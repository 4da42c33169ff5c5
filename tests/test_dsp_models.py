"""Issue 36's quantized models on the emulated DSP (qemu-hexagon, KEEL_FASTRPC=mock):
MobileNetV2 and the DM-shaped model (models/quantized.py: quantize_static, QDQ, int8 weights per
channel, uint8 activations), against onnxruntime.

Tolerance: 2 steps of the output's quantization scale and the same top-1 (test_dsp's bound for
its quantized CNN and squeezenet, and issue 36's): each conv's requantization is a fixed-point
multiply rounding half up where onnxruntime rounds in float (one step apart, rarely, on an
element within float error of a half), and later layers carry such differences.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import pytest

from dsp import build
from models import quantized
from tests.deps import needs
from tests.graphs import compiled_blob, ort_run
from tests.test_dsp import HVX_ANY, _disassemble, _functions, _load, _output_step
from tools import profile

pytestmark = [needs("qemu-user, clang-19, lld-19", build.missing()),
              pytest.mark.xdist_group("dsp")]
STEPS = 2


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    monkeypatch.setenv("KEEL_FASTRPC", "mock")
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)


def _profiled(m, feeds: dict) -> tuple[dict, list[int], list[int]]:
    """outputs, per launch packets and HVX instructions (qemu's counters)."""
    profile.counters(m.device, True)
    out = m.run(feeds)
    n = len(m.blob.launches)
    return out, m.device.last_ticks[:n], m.device.last_ticks[n:]


def _conv_launches_run_hvx(model: onnx.ModelProto, path, m, feeds: dict) -> int:
    """Every launch that may compute an ONNX Conv has HVX instructions in its own symbol's
    disassembly (dsp kernels are not inlined) and executes some under qemu; -> their count,
    which is at least the model's Conv count. Such a launch: one whose provenance lists a Conv
    or a QuantizeLinear of one (the integer path computes the accumulator the Q reads, never
    the Conv's float value), or any reduction over integer buffers but a pad fill (a launch
    table's provenance lists each node once, so a conv can go unnamed)."""
    from runner.blob import read_blob
    _, _, hvx = _profiled(m, feeds)
    blob = read_blob(path)
    code, prov = _functions(_disassemble(path)), blob.variant_manifest["provenance"]
    nodes = {n.name: n for n in model.graph.node}
    made = {o: n for n in model.graph.node for o in n.output}
    kinds = {i: np.dtype(b.dtype).kind for i, b in blob.buffers.items()}
    convs = 0
    for i, ln in enumerate(m.blob.launches):
        names = [prov["nodes"][k][0] for k in prov["launches"][i]]
        ops = {nodes[x].op_type for x in names} | {
            made[nodes[x].input[0]].op_type for x in names
            if nodes[x].op_type == "QuantizeLinear" and nodes[x].input[0] in made}
        integer_reduction = "_radd_" in ln.kernel and not ln.kernel.endswith("_fill") \
            and all(kinds[a] in "iu" for a in ln.args)
        if "Conv" in ops or integer_reduction:
            convs += 1
            assert HVX_ANY.search(code[ln.kernel]), ln.kernel
            assert hvx[i] > 0, ln.kernel
    assert convs >= sum(n.op_type == "Conv" for n in model.graph.node)
    return convs


@pytest.mark.slow  # ~7 s cold: quantize, compile and emulate MobileNetV2 at 32x32
def test_every_conv_of_a_quantized_mobilenetv2_runs_on_hvx():
    """At 32x32 (the same 52 convs, 1/49 of the pixels): the 24-channel convs, which were
    scalar code (8 int32 lanes are not an HVX vector), now pad to 32 lanes."""
    model = quantized.mobilenetv2(size=32, classes=10)
    path = compiled_blob(model, target="dsp")
    assert _conv_launches_run_hvx(model, path, _load(path), quantized.image(20, 32)) >= 52


@pytest.mark.slow  # ~25 s cold compile, ~5 s per image under qemu
def test_quantized_mobilenetv2_matches_onnxruntime_on_five_images():
    model = quantized.mobilenetv2()
    path = compiled_blob(model, target="dsp")
    m, step = _load(path), _output_step(model)
    for seed in range(20, 25):  # not among the calibration inputs (0-7)
        feeds = quantized.image(seed)
        got, want = m.run(feeds)["logits"], ort_run(model, feeds)["logits"]
        assert np.abs(got - want).max() <= STEPS * step + 1e-6, (seed, step)
        assert got.argmax() == want.argmax(), seed


@pytest.mark.slow  # ~2 s per frame under qemu (1.4 M input pixels)
def test_dm_shaped_model_matches_onnxruntime_on_the_emulated_dsp():
    """The frame's bytes go straight into the stem conv (its DequantizeLinear is the model's
    own), so every conv is HVX; the two Gemms and the Concats are the float ends."""
    model = quantized.dm()
    path = compiled_blob(model, target="dsp")
    m, step = _load(path), _output_step(model)  # the output Concat is quantized too
    _conv_launches_run_hvx(model, path, m, quantized.dm_frame(20))
    for seed in range(20, 25):
        feeds = quantized.dm_frame(seed)
        got, want = m.run(feeds)["outputs"], ort_run(model, feeds)["outputs"]
        assert got.shape == (1, 84 + 512)
        assert np.abs(got - want).max() <= STEPS * step + 1e-6, (seed, step)


@pytest.mark.slow  # the 32x32 MobileNetV2's blob (shared with the test above), ~7 s cold alone
def test_profile_tool_reports_packets_hvx_and_macs_per_kernel_on_the_dsp(capsys):
    """tools/profile.py on a dsp blob: a launch's packets are its slowest thread's, `packets`
    (the critical path) their sum over launches, `packets_total` every thread's, per thread in
    `packets_per_thread`; each kernel's MACs per packet is its MACs over its packets."""
    model = quantized.mobilenetv2(size=32, classes=10)
    path = compiled_blob(model, target="dsp")
    argv, sys.argv = sys.argv, ["profile.py", str(path), "--device", "dsp", "--json"]
    try:
        assert profile.main() == 0
    finally:
        sys.argv = argv
    s = json.loads(capsys.readouterr().out)
    assert s["counter"] == "packets"
    assert s["packets"] == sum(r["packets"] for r in s["launches"]) > 0
    assert all(r["packets"] == max(r["threads"]) for r in s["launches"])
    assert s["packets_total"] == sum(s["packets_per_thread"]) == \
        sum(sum(r["threads"]) for r in s["launches"])
    assert len(s["packets_per_thread"]) == 4  # the SD845 cDSP's hardware threads
    assert s["packets"] < 0.7 * s["packets_total"]  # the convs split between threads
    assert s["hvx_instructions"] == sum(r["hvx_instructions"] for r in s["launches"]) > 0
    assert sum(k["packets"] for k in s["kernels"]) == s["packets"]
    for k in s["kernels"]:
        assert k["macs_per_packet"] == pytest.approx(k["macs"] / k["packets"])
    assert max(k["macs_per_packet"] for k in s["kernels"]) > 1  # the convs' kernels


def test_quantize_linear_divides_by_its_scale_exactly_on_the_dsp(tmp_path):
    """On dsp a QuantizeLinear to 8 bits divides by its constant scale as a multiply by the
    nearest reciprocal and one fused correction (quant_hvx.clamped_quotient): the same
    quotient, rounded to nearest, as onnxruntime's division, so the same integers, for scales
    whose reciprocal is not exact, at the halves where rounding decides, a float32 ulp either
    side of them, and random values over the whole range (and past it, saturating)."""
    from compiler.blob import write_blob
    from compiler.pipeline import compile_model
    from onnx import helper
    from tests.graphs import make_model
    scales = [0.03115052543580532, 1 / 3, 0.0078125 * 1.1, 7.3e-3]
    rng = np.random.default_rng(5)
    nodes, inits, xs = [], {}, {}
    for i, s in enumerate(np.float32(scales)):
        halves = (np.arange(-140, 140) + 0.5).astype(np.float32) * s
        x = np.concatenate([halves, np.nextafter(halves, np.inf), np.nextafter(halves, -np.inf),
                            rng.uniform(-300, 300, 4000).astype(np.float32) * s])
        xs[f"x{i}"] = x.astype(np.float32)
        inits[f"s{i}"], inits[f"z{i}"] = s, np.uint8(128 + 7 * i)
        nodes.append(helper.make_node("QuantizeLinear", [f"x{i}", f"s{i}", f"z{i}"], [f"y{i}"]))
    model = make_model(nodes, [(k, v.shape, np.float32) for k, v in xs.items()],
                       [(f"y{i}", xs[f"x{i}"].shape, np.uint8) for i in range(len(scales))],
                       inits, opset=13)
    write_blob(compile_model(model, target="dsp"), tmp_path / "q.blob")
    got = _load(tmp_path / "q.blob").run(xs)
    for k, want in ort_run(model, xs).items():
        np.testing.assert_array_equal(got[k], want, k)
