"""The test-model generators: valid ONNX that onnxruntime runs, openpilot's exact interface,
standard topologies, and the FLOP counter they are measured with."""
from __future__ import annotations

import functools
import platform

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from compiler.onnx.metadata import output_slices
from models.efficientnet import make_efficientnet
from models.flops import count_flops
from models.openpilot import INPUTS, N_OUTPUTS, make_openpilot
from models.resnet import make_resnet50
from tests.graphs import make_model, ort_run, random_feeds, single_node_model


@functools.cache
def openpilot(float16: bool) -> onnx.ModelProto:
    return make_openpilot(float16=float16)  # ~1.5 s each: build once per session


def _dims(vi: onnx.ValueInfoProto) -> tuple[int, ...]:
    return tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)


def _np_dtype(vi: onnx.ValueInfoProto) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))


def _check_and_run(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """checker with shape inference, an ORT run, and outputs that are finite and O(1)."""
    onnx.checker.check_model(model, full_check=True)
    outputs = ort_run(model, random_feeds(model, seed=0))
    for name, value in outputs.items():
        assert np.isfinite(value).all(), f"{model.graph.name} {name}: non-finite"
        rms = float(np.sqrt(np.mean(value.astype(np.float64) ** 2)))
        assert 0.1 < rms < 10, f"{model.graph.name} {name}: rms {rms:.3g}, expected O(1)"
    return outputs


def _check_openpilot_interface(model: onnx.ModelProto) -> None:
    got = {vi.name: (_np_dtype(vi), _dims(vi)) for vi in model.graph.input}
    want = {name: (np.dtype(dtype), shape) for name, (dtype, shape) in INPUTS.items()}
    assert got == want
    assert [(o.name, _np_dtype(o), _dims(o)) for o in model.graph.output] == \
        [("outputs", np.dtype(np.float32), (1, N_OUTPUTS))]
    assert 6000 <= N_OUTPUTS <= 7000
    meta = {p.key: p.value for p in model.metadata_props}
    # openpilot's format (a base64 pickle of {name: slice}), decoded the way the compiler does
    got = output_slices(meta["output_slices"], [("outputs", (1, N_OUTPUTS))])["slices"]
    slices = sorted((start, stop) for _, start, stop, _ in got)
    # The slices tile [0, N) exactly: no gaps, no overlaps.
    assert [s[0] for s in slices] == [0] + [s[1] for s in slices[:-1]]
    assert slices[-1][1] == N_OUTPUTS


def test_generators_run_in_onnxruntime():
    for float16 in (False, True):
        model = openpilot(float16)
        _check_openpilot_interface(model)
        assert _check_and_run(model)["outputs"].shape == (1, N_OUTPUTS)
        assert 1e9 <= count_flops(model)["total"] <= 2e9
    for make in (make_resnet50, make_efficientnet):
        assert _check_and_run(make(size=64))["logits"].shape == (1, 1000)


def test_openpilot_fp16_variant_is_the_same_model_with_fp16_weights():
    fp32, fp16 = openpilot(False), openpilot(True)
    floats = [t for t in fp16.graph.initializer if t.data_type == TensorProto.FLOAT]
    # Only exact constants (pixel scale, mask, 1/sqrt(d), ...) stay fp32; they are tiny.
    assert all(np.prod(t.dims) <= 25 * 25 for t in floats)
    assert sum(t.data_type == TensorProto.FLOAT16 for t in fp16.graph.initializer) > 500
    feeds = random_feeds(fp32, seed=1)
    a, b = ort_run(fp32, feeds)["outputs"], ort_run(fp16, feeds)["outputs"]
    rel = np.sqrt(np.mean((a - b) ** 2) / np.mean(a**2))
    assert rel < 1e-2, f"fp16 weights moved the outputs by {rel:.2%} rms"


def test_generators_are_deterministic_per_seed():
    assert make_openpilot().SerializeToString() == openpilot(False).SerializeToString()
    a, b = make_efficientnet(seed=3, size=32), make_efficientnet(seed=3, size=32)
    assert a.SerializeToString() == b.SerializeToString()
    c = make_efficientnet(seed=4, size=32)
    assert a.graph.initializer[0].raw_data != c.graph.initializer[0].raw_data


@pytest.mark.parametrize("make, params", [(make_resnet50, 25_557_032),
                                          (make_efficientnet, 5_288_548)])
def test_standard_topologies_have_torchvisions_parameter_count(make, params):
    model = make(size=32)
    # BatchNorm running statistics are buffers, not parameters, in torchvision's count.
    learned = [t for t in model.graph.initializer if not t.name.startswith(("bn_mean", "bn_var"))]
    assert sum(int(np.prod(t.dims)) for t in learned) == params


def test_flops_counts_two_per_multiply_add():
    conv = single_node_model("Conv", [((1, 4, 8, 8), "float32"), ((6, 2, 3, 3), "float32")],
                             {"group": 2, "pads": [1, 1, 1, 1]})
    matmul = single_node_model("MatMul", [((2, 3, 4), "float32"), ((4, 5), "float32")])
    gemm = single_node_model("Gemm", [((4, 3), "float32"), ((5, 4), "float32")],
                             {"transA": 1, "transB": 1})
    assert count_flops(conv)["Conv"] == 2 * (6 * 8 * 8) * (2 * 3 * 3)
    assert count_flops(matmul)["MatMul"] == 2 * (2 * 3 * 5) * 4
    assert count_flops(gemm)["total"] == 2 * (3 * 5) * 4


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="onnxruntime's ARM64 build has fp16 MLAS kernels")
def test_onnxruntime_cpu_has_no_fp16_conv(tmp_path):
    """Pins the premise of openpilot.py's fp16 choice (fp16 weights + Cast, fp32 compute): if
    this fails, ORT can run Conv in fp16 and a fully fp16 variant has an honest reference."""
    import onnxruntime as ort

    model = make_model([helper.make_node("Conv", ["x", "w"], ["y"])],
                       [("x", (1, 2, 4, 4), np.float16), ("w", (2, 2, 1, 1), np.float16)],
                       [("y", (1, 2, 4, 4), np.float16)])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "placed.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    placed = onnx.load(options.optimized_model_filepath)
    assert "Cast" in [n.op_type for n in placed.graph.node], "ORT now runs fp16 Conv natively"
