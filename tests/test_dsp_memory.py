"""The DSP's L2 prefetch (compiler/codegen/l2fetch.py, Target.l2fetch): what each kernel hints
and its memory model (the blob's meta "memory"), and that the hints change no output bit.

qemu-hexagon executes l2fetch as a no-op (its fL2FETCH macro is empty), so under emulation a
hint can only cost packets; whether it arrives in time is a device measurement (docs/dsp.md).
"""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from onnx import helper

from compiler.pipeline import compile_model
from compiler.target import get_target
from dsp import build
from models.quantized import quantize
from runner.blob import read_blob
from tests.deps import needs
from tests.graphs import compiled_blob, make_model
from tests.test_dsp import _disassemble, _functions, _load, image, qdq_resblock

pytestmark = [needs("qemu-user, clang-19, lld-19", build.missing()),
              pytest.mark.xdist_group("dsp")]
DSP = get_target("dsp")


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    monkeypatch.setenv("KEEL_FASTRPC", "mock")
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)


def depthwise(stride: int, c: int = 32, hw: int = 16):
    """A quantized 3x3 depthwise conv (MobileNetV2's), Relu, then a 1x1 conv: the depthwise one
    is an integer kernel between two quantized tensors."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["d"], group=c, pads=[1, 1, 1, 1],
                              strides=[stride, stride]),
             helper.make_node("Relu", ["d"], ["r"]),
             helper.make_node("Conv", ["r", "w2", "b2"], ["y"])]
    inits = {"w": rng.standard_normal((c, 1, 3, 3)).astype(np.float32) * 0.3,
             "b": rng.standard_normal(c).astype(np.float32) * 0.1,
             "w2": rng.standard_normal((c, c, 1, 1)).astype(np.float32) * 0.2,
             "b2": rng.standard_normal(c).astype(np.float32) * 0.1}
    o = hw // stride
    model = make_model(nodes, [("x", (1, c, hw, hw), np.float32)],
                       [("y", (1, c, o, o), np.float32)], inits, opset=13)
    feeds = [{"x": rng.standard_normal((1, c, hw, hw)).astype(np.float32)} for _ in range(4)]
    return quantize(model, feeds, activations="int8", pre_process=False)


@pytest.mark.parametrize("stride", [1, 2])
def test_a_depthwise_conv_hints_the_input_rows_each_output_row_adds(stride):
    """Its outer loop walks output rows; each row's box is the input rows it reads that the row
    before did not: one at stride 1, two at stride 2 (16 pixels of 32 int32 channels each). Its
    3x3 weights, bias and requantization constants are the resident set, and all of it fits
    the 512 KiB L2 with room to spare."""
    art = compile_model(depthwise(stride), target="dsp")
    buffers = {b.id: b for b in art.buffers}
    dw = next(i for i, ln in enumerate(art.launches) if ln.kernel.startswith("k1_radd"))
    memory, args = art.meta["memory"][dw], [buffers[a] for a in art.launches[dw].args]
    row = next(b for b in args[1:] if b.region != "weights").nbytes // 16  # 16 input rows
    assert memory["trips"] == 16 // stride
    assert memory["fetched"] == stride * row
    assert memory["resident"] == sum(b.nbytes for b in args if b.region == "weights")
    ws = memory["resident"] + memory["live"] + memory["ahead"] * memory["fetched"]
    assert ws < DSP.l2_bytes // 8


def test_l2fetch_hints_change_no_output_bit_and_the_switch_removes_them():
    """The residual net (3x3 convs at stride 2 and 1, a 1x1 conv, residual Adds, pools) with
    and without Target.l2fetch: bit-identical outputs under qemu; every kernel the model says
    hints a box has an l2fetch in its own symbol, and without the switch no kernel has one
    and the blob has no memory model."""
    model = qdq_resblock()
    on, off = compiled_blob(model, target="dsp"), \
        compiled_blob(model, target=replace(DSP, l2fetch=False))
    got = [_load(p).run(image(20))["y"] for p in (on, off)]
    np.testing.assert_array_equal(got[0], got[1])
    blob = read_blob(on)
    hinted = {ln.kernel for ln, mem in zip(blob.launches, blob.manifest["meta"]["memory"])
              if mem and mem["fetched"]}
    code = _functions(_disassemble(on))
    assert hinted and all(re.search(r"\bl2fetch\(", code[k]) for k in hinted)
    assert not re.search(r"\bl2fetch\(", _disassemble(off))
    assert "memory" not in read_blob(off).manifest["meta"]


def test_memory_tool_sums_each_kernels_launches_and_refuses_a_blob_without_the_model():
    """tools/dsp_memory.py: a kernel's working set is resident + live + ahead boxes, the bytes
    it moves are its launches' buffers, and a blob compiled without l2fetch is refused by
    name."""
    from tools import dsp_memory
    model = qdq_resblock()
    on, off = compiled_blob(model, target="dsp"), \
        compiled_blob(model, target=replace(DSP, l2fetch=False))
    blob, table = read_blob(on), dsp_memory.rows(str(on))
    assert sum(r["launches"] for r in table) == len(blob.launches)
    assert sum(r["moved"] for r in table) == sum(blob.buffers[a].nbytes
                                                 for ln in blob.launches for a in ln.args)
    for r in table:
        assert r["working_set"] == r["resident"] + r["live"] + r["ahead"] * r["fetched"]
    with pytest.raises(SystemExit, match="no memory model"):
        dsp_memory.rows(str(off))


def test_l2fetch_descriptor_packs_the_boxs_fields_as_qemus_idef_decodes_them():
    """l2fetch(Rs, Rt): height Rt[7:0], width Rt[15:8], stride Rt[31:16]; past 255 rows
    l2fetch(Rs, Rtt): height Rtt[15:0], width [31:16], stride [47:32] (qemu's system.idef)."""
    from compiler.renderers.hvx import l2fetch
    short = re.search(r"Y4_l2fetch\(.*, (0x[0-9a-f]+)u\);", l2fetch("p", 128, 6, 128)).group(1)
    assert int(short, 16) == 6 | 128 << 8 | 128 << 16
    long = re.search(r"Y5_l2fetch\(.*, (0x[0-9a-f]+)ull\);", l2fetch("p", 128, 300, 128))
    assert int(long.group(1), 16) == 300 | 128 << 16 | 128 << 32
