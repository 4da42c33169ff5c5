"""The fuzzer, proven before the compiler relies on it: its graphs are valid, onnxruntime runs
them with the shapes the strategy declared, values stay bounded, and two independent fp32
implementations (onnxruntime and onnx's numpy reference) agree within test_fuzz's tolerance."""
from __future__ import annotations

import numpy as np
import onnx
from hypothesis import given, settings
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from tests.fuzz_graphs import MAX_BOUND, graph_strategy, onnx_slice_len
from tests.graphs import assert_close, ort_run


class Slice(OpRun):
    """Slice as the spec clamps it. onnx's reference uses Python slicing, which returns nothing
    for a start before the beginning with a negative step; the spec (and onnxruntime) clamp that
    start to 0 and return the first element."""

    op_domain = ""

    def _run(self, data, starts, ends, axes=None, steps=None):
        axes = range(len(starts)) if axes is None else axes
        steps = [1] * len(starts) if steps is None else steps
        for start, end, axis, step in zip(starts, ends, axes, steps):
            start, end, step = int(start), int(end), int(step)
            dim = data.shape[axis]
            first = min(max(start + dim if start < 0 else start, 0), dim - 1 if step < 0 else dim)
            count = onnx_slice_len(dim, start, end, step)
            data = np.take(data, first + step * np.arange(count, dtype=np.int64), axis=int(axis))
        return (data,)


class Pad(OpRun):
    """Pad with negative pads (cropping), which onnx's reference (np.pad) rejects."""

    op_domain = ""

    def _run(self, data, pads, constant_value=None, axes=None, mode="constant"):
        rank = data.ndim
        begins, ends = pads[:rank], pads[rank:]
        crop = tuple(slice(max(-b, 0), d - max(-e, 0)) for d, b, e in zip(data.shape, begins, ends))
        widths = [(max(b, 0), max(e, 0)) for b, e in zip(begins, ends)]
        kwargs = {"constant_values": 0 if constant_value is None else constant_value}
        padded = np.pad(data[crop], widths, mode=mode, **(kwargs if mode == "constant" else {}))
        return (padded.astype(data.dtype),)


@settings(max_examples=100, deadline=None)
@given(graph_strategy())
def test_fuzz_graphs_are_valid_and_run_in_onnxruntime(model_and_feeds):
    model, feeds = model_and_feeds
    # full_check runs strict shape inference, which also rejects a wrong declared output shape.
    onnx.checker.check_model(model, full_check=True)
    outputs = ort_run(model, feeds)
    for out in model.graph.output:
        declared = tuple(d.dim_value for d in out.type.tensor_type.shape.dim)
        value = outputs[out.name]
        assert value.shape == declared, f"{out.name}: ORT shape {value.shape}, declared {declared}"
        assert value.size > 0, f"{out.name}: empty"
        assert np.isfinite(value).all(), f"{out.name}: non-finite values"
        assert np.abs(value).max() <= MAX_BOUND, f"{out.name}: |value| above {MAX_BOUND}"


@settings(max_examples=100, deadline=None)
@given(graph_strategy())
def test_fuzz_graphs_are_well_conditioned(model_and_feeds):
    model, feeds = model_and_feeds
    want = ort_run(model, feeds)
    got = ReferenceEvaluator(model, new_ops=[Slice, Pad]).run(None, feeds)
    for out, value in zip(model.graph.output, got):
        assert_close(np.asarray(value), want[out.name], rtol=1e-4, atol=1e-5, what=out.name)
