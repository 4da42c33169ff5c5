"""FLOPs of the dense ops (Conv, MatMul, Gemm) of an ONNX model, from onnx shape inference.

One multiply-add is 2 FLOPs. Elementwise ops, pooling, normalization and bias adds are not
counted: they are a few percent of these models and the compute-bound kernels are what matter.

    python -m models.flops model.onnx [--ort]    # --ort: also onnxruntime latency, 1 thread
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import onnx

from models.blocks import calibration_feeds


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    graph = inferred.graph
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        dims = vi.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[vi.name] = tuple(d.dim_value for d in dims)
    return shapes


def _conv(node, shapes) -> int:
    weight, out = shapes[node.input[1]], shapes[node.output[0]]
    # out is (N, Cout, *spatial); weight is (Cout, Cin/group, *kernel): one MAC per weight per
    # output position, whatever the grouping.
    return 2 * out[0] * math.prod(out[2:]) * math.prod(weight)


def _matmul(node, shapes) -> int:
    a, out = shapes[node.input[0]], shapes[node.output[0]]
    return 2 * math.prod(out) * a[-1]


def _gemm(node, shapes) -> int:
    a, out = shapes[node.input[0]], shapes[node.output[0]]
    trans_a = next((attr.i for attr in node.attribute if attr.name == "transA"), 0)
    return 2 * math.prod(out) * (a[0] if trans_a else a[1])


COUNTERS = {"Conv": _conv, "MatMul": _matmul, "Gemm": _gemm}


def count_flops(model: onnx.ModelProto) -> dict[str, int]:
    """{"Conv": n, "MatMul": n, "Gemm": n, "total": n}; KeyError if a needed shape is unknown."""
    shapes = _shapes(model)
    counts = dict.fromkeys(COUNTERS, 0)
    for node in model.graph.node:
        if node.op_type in COUNTERS:
            counts[node.op_type] += COUNTERS[node.op_type](node, shapes)
    counts["total"] = sum(counts.values())
    return counts


def ort_latency_ms(model: onnx.ModelProto, optimize: bool, runs: int = 20) -> tuple[float, float]:
    """(min, median) ms of onnxruntime CPU on 1 thread, on random inputs."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    feeds = calibration_feeds(list(model.graph.input), seed=0)
    session.run(None, feeds)  # first run allocates
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--ort", action="store_true", help="also time onnxruntime, 1 thread")
    args = ap.parse_args()
    model = onnx.load(args.model)
    for op, n in count_flops(model).items():
        print(f"{op:8s} {n / 1e9:8.4f} GFLOP")
    for optimize in (False, True) if args.ort else ():
        fastest, median = ort_latency_ms(model, optimize)
        level = "ORT_ENABLE_ALL" if optimize else "ORT_DISABLE_ALL"
        print(f"onnxruntime 1 thread, {level}: min {fastest:.1f} ms, median {median:.1f} ms")


if __name__ == "__main__":
    main()
