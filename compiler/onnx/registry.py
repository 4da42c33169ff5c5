"""The ONNX op registry and what an op implementation may ask about its node.

Op modules (compiler/onnx/ops/*.py) register into OPS with `@op(...)`; compiler/onnx/load.py
builds graphs from it. Nothing here imports an op module, so there is no import cycle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx

from compiler.errors import CompileError, StaticInputError
from compiler.ir.dtypes import DType, dtypes
from compiler.ir.interp import evaluate
from compiler.ir.tensor import Tensor
from compiler.ir.uop import Ops, UOp
from compiler.schedule.fusion import static

OPS: dict = {}


def op(*names):
    def register(fn):
        for n in names:
            OPS[n] = fn
        return fn
    return register


ONNX_DTYPES = {
    onnx.TensorProto.BOOL: dtypes.bool, onnx.TensorProto.INT8: dtypes.int8,
    onnx.TensorProto.INT16: dtypes.int16, onnx.TensorProto.INT32: dtypes.int32,
    onnx.TensorProto.INT64: dtypes.int64, onnx.TensorProto.UINT8: dtypes.uint8,
    onnx.TensorProto.UINT16: dtypes.uint16, onnx.TensorProto.UINT32: dtypes.uint32,
    onnx.TensorProto.UINT64: dtypes.uint64, onnx.TensorProto.FLOAT16: dtypes.float16,
    onnx.TensorProto.FLOAT: dtypes.float32, onnx.TensorProto.DOUBLE: dtypes.float64,
}
ONNX_CODES = {dt: code for code, dt in ONNX_DTYPES.items()}
MIN_OPSET, MAX_OPSET = 1, 21


def onnx_dtype(code: int, what: str) -> DType:
    if code not in ONNX_DTYPES:
        name = onnx.TensorProto.DataType.Name(code) if code in onnx.TensorProto.DataType.values() \
            else str(code)
        raise CompileError(f"{what}: element type {name} is not supported; keel supports "
                           + ", ".join(sorted(d.name for d in ONNX_DTYPES.values())))
    return ONNX_DTYPES[code]


@dataclass(frozen=True)
class Choice:
    """A MatMul's, Gemm's or Conv's product by a weight, as the importer built it (the plain
    algorithm), and what compiler/algorithms.py needs to build it another way for a target:
    `build(x, w)` is the plain product of its operands (float16 ones cast as the importer
    casts them), so rebuilding it from the same operands gives the same nodes."""
    out: UOp  # build(x, w): the plain product
    x: UOp
    w: UOp  # its output channels along axis 0 (a conv's) or 1 (a matmul's)
    macs: int  # multiply-adds
    build: Callable
    window: tuple | None = None  # a conv's (strides, dilations, pads, group); None: a matmul


@dataclass
class Ctx:
    """What an op implementation may ask about its node."""
    opset: int
    node: onnx.NodeProto | None = None
    float16: bool = False
    hvx: bool = False  # Target.hvx
    narrow_pad_divisor: int = 16  # Target.narrow_pad_divisor
    # quantized origins of float values, for the integer QDQ path (onnx/ops/quant.py): shared by
    # every node's Ctx (dataclasses.replace copies the reference)
    qdq: dict = field(default_factory=dict)
    choices: list[Choice] = field(default_factory=list)  # shared as qdq is

    def static(self, t: Tensor | None, what: str) -> np.ndarray:
        """A compile-time value (shape vectors, pads, axes...): its weight-only subgraph,
        evaluated."""
        if t is None:
            raise CompileError(f"{self.where()}: input {what} is required")
        value = self.constant(t)
        if value is None:
            graph_inputs = sorted({n.arg[0] for n in t.uop.toposort() if n.op is Ops.INPUT})
            raise StaticInputError(f"{self.where()}: input {what} must be known at compile time "
                                   f"(a constant or computed from shapes), but it depends on "
                                   f"graph input(s) {graph_inputs}", graph_inputs)
        return value

    def constant(self, t: Tensor) -> np.ndarray | None:
        return constant(t)

    def where(self) -> str:
        return f"{self.node.op_type} node {self.node.name or '(unnamed)'!r} (opset {self.opset})"


def constant(t: Tensor) -> np.ndarray | None:
    """t's value if it is computed from constants alone (a weight, maybe cast), else None."""
    if not static(t.uop) and any(n.op is Ops.INPUT for n in t.uop.toposort()):
        return None
    return evaluate(t.uop)
