"""ONNX quantization ops: (de)quantize, and integer matmul/conv with zero points.

Integer contractions accumulate in int32 (exact, as the ONNX reference does); requantization
multiplies by the scale ratio in float64, rounds half to even and saturates to the output type.
"""
from __future__ import annotations

from compiler.ir.dtypes import DType, dtypes
from compiler.onnx.registry import OPS, onnx_dtype, op
from compiler.ir.tensor import Tensor


def qparam(v: Tensor | None, x: Tensor, axis: int, block: int = 0) -> Tensor | None:
    """A scale or zero point broadcastable against x: scalar, per-axis vector, or blocked
    (each entry repeated `block` times along `axis`)."""
    if v is None or v.uop.size == 1:
        return v if v is None else v.reshape(())
    axis %= x.ndim
    if not block:
        return v.reshape([v.uop.size if d == axis else 1 for d in range(x.ndim)])
    nb = v.shape[axis]
    rep = v.unsqueeze(axis + 1).expand(v.shape[:axis + 1] + (block,) + v.shape[axis + 1:])
    rep = rep.reshape(v.shape[:axis] + (nb * block,) + v.shape[axis + 1:])
    return rep.shrink([(0, x.shape[axis]) if d == axis else (0, s)
                       for d, s in enumerate(rep.shape)])


def saturate(v: Tensor, dt: DType) -> Tensor:
    """A float tensor holding integers, clamped to dt's range and converted."""
    return v.maximum(float(dt.min)).minimum(float(dt.max)).cast(dt)


def _widest(*ts: Tensor) -> DType:
    order = [dtypes.float16, dtypes.float32, dtypes.float64]
    return max((t.dtype for t in ts), key=order.index)


@op("QuantizeLinear")
def _quantize(ctx, i, a):
    x, scale = i[0], i[1]
    zp = i[2] if len(i) > 2 else None
    axis, block = a.get("axis", 1), a.get("block_size", 0)
    out = zp.dtype if zp is not None else \
        onnx_dtype(a["output_dtype"], ctx.where()) if a.get("output_dtype") else dtypes.uint8
    s = qparam(scale, x, axis, block)
    ct = onnx_dtype(a["precision"], ctx.where()) if a.get("precision") else _widest(x, s)
    v = (x.cast(ct) / s.cast(ct)).round_even()
    if zp is not None:
        v = v.cast(dtypes.float32) + qparam(zp, x, axis, block).cast(dtypes.float32)
    return saturate(v, out)


@op("DequantizeLinear")
def _dequantize(ctx, i, a):
    x, scale = i[0], i[1]
    zp = i[2] if len(i) > 2 else None
    axis, block = a.get("axis", 1), a.get("block_size", 0)
    dx = x.cast(dtypes.float32)
    if zp is not None:
        dx = dx - qparam(zp, x, axis, block).cast(dtypes.float32)
    y = dx * qparam(scale, x, axis, block).cast(dtypes.float32)
    out = onnx_dtype(a["output_dtype"], ctx.where()) if a.get("output_dtype") else scale.dtype
    return y.cast(out)


def _centered(x: Tensor, zp: Tensor | None, axis: int = -1) -> Tensor:
    """x - zero_point in int32; a vector zero point applies along `axis`."""
    x = x.cast(dtypes.int32)
    if zp is None:
        return x
    return x - qparam(zp, x, axis).cast(dtypes.int32)


def _requantize(acc: Tensor, multiplier: Tensor, zp: Tensor | None, out: DType) -> Tensor:
    v = (acc.cast(dtypes.float64) * multiplier.cast(dtypes.float64)).round_even()
    if zp is not None:
        v = v + zp.cast(dtypes.float64)
    return saturate(v, out)


@op("MatMulInteger")
def _matmul_integer(ctx, i, a):
    zp_a = i[2] if len(i) > 2 else None
    zp_b = i[3] if len(i) > 3 else None
    return _centered(i[0], zp_a, -2).matmul(_centered(i[1], zp_b, -1))


@op("QLinearMatMul")
def _qlinear_matmul(ctx, i, a):
    qa, sa, za, qb, sb, zb, sy, zy = i
    acc = _centered(qa, za, -2).matmul(_centered(qb, zb, -1))
    return _requantize(acc, sa * sb / sy, zy, zy.dtype if zy is not None else qa.dtype)


@op("ConvInteger")
def _conv_integer(ctx, i, a):
    zx = i[2] if len(i) > 2 else None
    zw = i[3] if len(i) > 3 else None
    return OPS["Conv"](ctx, [_centered(i[0], zx), _centered(i[1], zw, 0)], a)


@op("QLinearConv")
def _qlinear_conv(ctx, i, a):
    x, sx, zx, w, sw, zw, sy, zy = i[:8]
    bias = i[8] if len(i) > 8 else None
    acc = OPS["Conv"](ctx, [_centered(x, zx), _centered(w, zw, 0), bias], a)
    sw = qparam(sw, acc, 1)
    return _requantize(acc, sx * sw / sy, zy, zy.dtype if zy is not None else x.dtype)
