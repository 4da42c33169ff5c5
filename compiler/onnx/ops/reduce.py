"""ONNX reductions along axes: Reduce*, ArgMax/ArgMin and the softmax family.

Every function has the signature (ctx, inputs, attrs) -> Tensor | list[Tensor]; `inputs` holds
None for omitted optional inputs. Opset differences are handled inside the op that has them.
"""
from __future__ import annotations

import math

from compiler.ir.dtypes import dtypes
from compiler.ir.tensor import Tensor
from compiler.ir.uop import Ops
from compiler.onnx.ops.shape import arange_at, axes_arg
from compiler.onnx.registry import OPS, op


def _softmax_like(ctx, x: Tensor, axis: int, fn) -> Tensor:
    if ctx.opset >= 13:
        return fn(x, axis)
    axis = axis % x.ndim  # before opset 13: over the flattened trailing dims
    flat = x.reshape((math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))
    return fn(flat, -1).reshape(x.shape)


@op("Softmax")
def _softmax(ctx, i, a):
    return _softmax_like(ctx, i[0], a.get("axis", -1 if ctx.opset >= 13 else 1), Tensor.softmax)


@op("LogSoftmax")
def _logsoftmax(ctx, i, a):
    return _softmax_like(ctx, i[0], a.get("axis", -1 if ctx.opset >= 13 else 1),
                         Tensor.log_softmax)


@op("Hardmax")
def _hardmax(ctx, i, a):
    x = i[0]
    axis = a.get("axis", -1 if ctx.opset >= 13 else 1)
    if ctx.opset < 13:
        flat = x.reshape((math.prod(x.shape[:axis % x.ndim]), math.prod(x.shape[axis % x.ndim:])))
        return _onehot_argmax(flat, -1).reshape(x.shape)
    return _onehot_argmax(x, axis)


def _onehot_argmax(x: Tensor, axis: int) -> Tensor:
    idx = _argext(x, axis, Ops.MAX, last=False)
    ar = arange_at(x.shape[axis % x.ndim], axis % x.ndim, x.ndim)
    return ar.eq(idx).cast(x.dtype)


def _reduce_axes(ctx, i, a, x):
    axes = axes_arg(ctx, a, i)
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            return None
        return list(range(x.ndim))
    return axes


def _reducer(fn):
    def run(ctx, i, a):
        x = i[0]
        axes = _reduce_axes(ctx, i, a, x)
        if axes is None:
            return x
        return fn(x, axes, bool(a.get("keepdims", 1)))
    return run


for _name, _fn in {
    "ReduceSum": lambda x, ax, k: x.sum(ax, k), "ReduceMax": lambda x, ax, k: x.max(ax, k),
    "ReduceMin": lambda x, ax, k: x.min(ax, k), "ReduceProd": lambda x, ax, k: x.prod(ax, k),
    "ReduceMean": lambda x, ax, k: x.mean(ax, k),
    "ReduceL1": lambda x, ax, k: x.abs().sum(ax, k),
    "ReduceL2": lambda x, ax, k: (x * x).sum(ax, k).sqrt(),
    "ReduceSumSquare": lambda x, ax, k: (x * x).sum(ax, k),
    "ReduceLogSum": lambda x, ax, k: x.sum(ax, k).log(),
    "ReduceLogSumExp": lambda x, ax, k: _logsumexp(x, ax, k),
}.items():
    OPS[_name] = _reducer(_fn)


def _logsumexp(x: Tensor, axes, keep: bool) -> Tensor:
    m = x.max(axes)
    m = m.abs().eq(math.inf).where(0.0, m) if x.dtype.is_float else m
    out = (x - m).exp().sum(axes).log() + m
    return out if keep else out.reshape(tuple(s for j, s in enumerate(out.shape)
                                               if j not in [ax % x.ndim for ax in axes]))


def _argext(x: Tensor, axis: int, op_: Ops, last: bool) -> Tensor:
    """Index of the max/min along axis (keepdims): the first (or last) position that equals it."""
    best = x.reduce(op_, [axis])
    hit = x.eq(best)
    if x.dtype.is_float:
        hit = hit | (x.ne(x) & best.ne(best))  # a NaN maximum is found at the NaN
    ar = arange_at(x.shape[axis % x.ndim], axis % x.ndim, x.ndim).expand(x.shape)
    if last:
        return hit.where(ar, Tensor.full(-1, dtypes.int64)).max([axis])
    return hit.where(ar, Tensor.full(x.shape[axis % x.ndim], dtypes.int64)).min([axis])


@op("ArgMax", "ArgMin")
def _arg(ctx, i, a):
    x, axis = i[0], a.get("axis", 0)
    op_ = Ops.MAX if ctx.node.op_type == "ArgMax" else Ops.MIN
    out = _argext(x, axis, op_, bool(a.get("select_last_index", 0)))
    return out if a.get("keepdims", 1) else out.reshape(
        tuple(s for j, s in enumerate(out.shape) if j != axis % x.ndim))
