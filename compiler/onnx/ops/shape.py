"""ONNX shape and movement ops, constants and index builders, and the helpers other op
modules share (axes from an attribute or input, an index laid along an axis, a one-hot select).

Every function has the signature (ctx, inputs, attrs) -> Tensor | list[Tensor]; `inputs` holds
None for omitted optional inputs. Opset differences are handled inside the op that has them.
"""
from __future__ import annotations

import math

import numpy as np

from compiler.errors import CompileError
from compiler.ir.dtypes import dtypes
from compiler.ir.tensor import Tensor
import compiler.onnx.ops.quant as quant
from compiler.onnx.registry import Ctx, onnx_dtype, op


def axes_arg(ctx: Ctx, a: dict, inputs, pos: int = 1, key: str = "axes"):
    """Axes from the attribute (older opsets) or the input (newer)."""
    if len(inputs) > pos and inputs[pos] is not None:
        return [int(v) for v in ctx.static(inputs[pos], key).reshape(-1)]
    return a.get(key)


def arange_at(n: int, axis: int, ndim: int) -> Tensor:
    """int64 0..n-1 laid along `axis` of an ndim-d tensor (size 1 elsewhere)."""
    shape = [1] * ndim
    shape[axis] = n
    return Tensor.weight(np.arange(n, dtype=np.int64).reshape(shape)) if n > 1 else \
        Tensor.full(0, dtypes.int64, shape)


def pick(match: Tensor, x: Tensor, axis: int) -> Tensor:
    """sum over `axis` of x where `match`, with at most one match per output element: a one-hot
    select that is exact for every dtype (the other terms are zeros)."""
    if x.dtype is dtypes.bool:
        return pick(match, x.cast(dtypes.int32), axis).ne(0)
    return match.where(x, Tensor.full(0, x.dtype)).sum([axis], keepdims=False)


@op("Reshape")
def _reshape(ctx, i, a):
    x = i[0]
    shape = [int(v) for v in (ctx.static(i[1], "shape") if len(i) > 1 else a["shape"])]
    allowzero = a.get("allowzero", 0)
    shape = [x.shape[j] if v == 0 and not allowzero else v for j, v in enumerate(shape)]
    if -1 in shape:
        known = math.prod(v for v in shape if v != -1)
        shape[shape.index(-1)] = x.uop.size // known if known else 0
    return x.reshape(shape)


@op("Flatten")
def _flatten(ctx, i, a):
    axis = a.get("axis", 1)
    return i[0].flatten(axis + i[0].ndim if axis < 0 else axis)


@op("Transpose")
def _transpose(ctx, i, a):
    x = i[0]
    return x.permute(a.get("perm", list(range(x.ndim))[::-1]))


@op("Squeeze")
def _squeeze(ctx, i, a):
    x = i[0]
    axes = axes_arg(ctx, a, i)
    axes = [d % x.ndim for d in axes] if axes else [d for d, s in enumerate(x.shape) if s == 1]
    return x.reshape(tuple(s for d, s in enumerate(x.shape) if d not in axes))


@op("Unsqueeze")
def _unsqueeze(ctx, i, a):
    x = i[0]
    axes = axes_arg(ctx, a, i)
    n = x.ndim + len(axes)
    axes = sorted(d % n for d in axes)
    shape = list(x.shape)
    for d in axes:
        shape.insert(d, 1)
    return x.reshape(shape)


@op("Concat")
def _concat(ctx, i, a):
    xs = [t for t in i if t is not None]
    y = Tensor.cat(xs, a["axis"])
    quant.note_concat(ctx, y, xs, a["axis"] % y.ndim)
    return y


@op("Split")
def _split(ctx, i, a):
    x, axis = i[0], a.get("axis", 0) % i[0].ndim
    n = len(ctx.node.output)
    if len(i) > 1 and i[1] is not None:
        sizes = [int(v) for v in ctx.static(i[1], "split")]
    elif "split" in a:
        sizes = list(a["split"])
    else:
        parts = a.get("num_outputs", n)
        step = -(-x.shape[axis] // parts)
        sizes = [min(step, x.shape[axis] - step * j) for j in range(parts)]
    outs, at = [], 0
    for s in sizes:
        b = [(0, d) for d in x.shape]
        b[axis] = (at, at + s)
        outs.append(x.shrink(b))
        at += s
    return outs


@op("Slice")
def _slice(ctx, i, a):
    x = i[0]
    if ctx.opset < 10:
        starts, ends = a["starts"], a["ends"]
        axes = a.get("axes", list(range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts = [int(v) for v in ctx.static(i[1], "starts")]
        ends = [int(v) for v in ctx.static(i[2], "ends")]
        axes = [int(v) for v in ctx.static(i[3], "axes")] if len(i) > 3 and i[3] is not None \
            else list(range(len(starts)))
        steps = [int(v) for v in ctx.static(i[4], "steps")] if len(i) > 4 and i[4] is not None \
            else [1] * len(starts)
    big = 1 << 62  # INT64 sentinels mean "to the end"
    starts = [max(min(s, big), -big) for s in starts]
    ends = [max(min(e, big), -big) for e in ends]
    return x.slice(starts, ends, axes, steps)


@op("Gather")
def _gather(ctx, i, a):
    return i[0].gather(i[1], a.get("axis", 0))


@op("GatherElements")
def _gather_elements(ctx, i, a):
    """out[.., j, ..] = x[.., ind[.., j, ..], ..]: a one-hot match along `axis`."""
    x, ind = i
    axis = a.get("axis", 0) % x.ndim
    n = x.shape[axis]
    x = x.shrink([(0, n) if d == axis else (0, s) for d, s in enumerate(ind.shape)])
    ind = ind.cast(dtypes.int64)
    ind = (ind < 0).where(ind + n, ind)
    match = ind.unsqueeze(axis).eq(arange_at(n, axis, x.ndim + 1))  # (.., n, m, ..)
    return pick(match, x.unsqueeze(axis + 1), axis)


@op("Expand")
def _expand(ctx, i, a):
    x = i[0]
    shape = [int(v) for v in ctx.static(i[1], "shape")]
    out = np.broadcast_shapes(tuple(x.shape), tuple(shape))
    return x.expand(out)


@op("Tile")
def _tile(ctx, i, a):
    x = i[0]
    reps = [int(v) for v in ctx.static(i[1], "repeats")]
    inner = x.reshape([d for s in x.shape for d in (1, s)])
    big = inner.expand([d for r, s in zip(reps, x.shape) for d in (r, s)])
    return big.reshape([r * s for r, s in zip(reps, x.shape)])


@op("Pad")
def _pad(ctx, i, a):
    x = i[0]
    mode = a.get("mode", "constant")
    if ctx.opset < 11:
        pads, value = a["pads"], a.get("value", 0.0)
    else:
        pads = [int(v) for v in ctx.static(i[1], "pads")]
        value = ctx.static(i[2], "constant_value").reshape(-1)[0].item() \
            if len(i) > 2 and i[2] is not None else 0
    axes = list(range(x.ndim))
    if len(i) > 3 and i[3] is not None:
        axes = [int(v) % x.ndim for v in ctx.static(i[3], "axes")]
    n = len(axes)
    per = [(0, 0)] * x.ndim
    for j, ax in enumerate(axes):
        per[ax] = (pads[j], pads[n + j])
    if mode == "constant":
        return x.pad(per, value if x.dtype.is_float else int(value))
    for ax, (b, e) in enumerate(per):
        x = _pad_edges(x, ax, b, e, mode)
    return x


def _pad_edges(x: Tensor, ax: int, b: int, e: int, mode: str) -> Tensor:
    """reflect / edge / wrap padding on one axis, built from shrink, flip and concat."""
    if b == 0 and e == 0:
        return x
    n = x.shape[ax]

    def part(lo, hi):
        bounds = [(0, s) for s in x.shape]
        bounds[ax] = (lo, hi)
        return x.shrink(bounds)

    def rep(t: Tensor, k: int) -> Tensor:
        return Tensor.cat([t] * k, ax) if k > 1 else t

    if mode == "edge":
        before, after = rep(part(0, 1), b), rep(part(n - 1, n), e)
    elif mode == "reflect":
        before = part(1, b + 1).flip([ax]) if b else None
        after = part(n - 1 - e, n - 1).flip([ax]) if e else None
    elif mode == "wrap":
        before = part(n - b, n) if b else None
        after = part(0, e) if e else None
    else:
        raise CompileError(f"Pad mode {mode!r} is not supported; "
                           "expected constant, reflect, edge or wrap")
    pieces = [t for t in ((before if b else None), x, (after if e else None)) if t is not None]
    return Tensor.cat(pieces, ax)


@op("Shape")
def _shape(ctx, i, a):
    shape = np.array(i[0].shape, dtype=np.int64)
    start, end = a.get("start", 0), a.get("end", len(shape))
    return Tensor.weight(shape[start:end]) if len(shape[start:end]) != 1 else \
        Tensor.full(int(shape[start:end][0]), dtypes.int64, (1,))


@op("Size")
def _size(ctx, i, a):
    return Tensor.full(int(i[0].uop.size), dtypes.int64)


@op("ConstantOfShape")
def _const_of_shape(ctx, i, a):
    shape = [int(v) for v in ctx.static(i[0], "shape")]
    v = a.get("value", np.zeros(1, np.float32))
    return Tensor.full(v.reshape(-1)[0].item(), dtypes.from_np(v.dtype), tuple(shape))


@op("Constant")
def _constant(ctx, i, a):
    if "value" in a:
        return Tensor.weight(a["value"])
    for key, dt in (("value_float", np.float32), ("value_int", np.int64)):
        if key in a:
            return Tensor.weight(np.array(a[key], dt))
    for key, dt in (("value_floats", np.float32), ("value_ints", np.int64)):
        if key in a:
            return Tensor.weight(np.array(a[key], dt))
    raise CompileError(f"{ctx.where()}: unsupported Constant attribute {sorted(a)}")


@op("Dropout")
def _dropout(ctx, i, a):
    x = i[0]
    return [x, Tensor.full(True, dtypes.bool, x.shape)]


@op("Range")
def _range(ctx, i, a):
    start, limit, delta = (ctx.static(t, n).reshape(()).item() for t, n in
                           zip(i, ("start", "limit", "delta")))
    return Tensor.weight(np.arange(start, limit, delta).astype(i[0].dtype.np))


@op("OneHot")
def _onehot(ctx, i, a):
    ind, depth, values = i
    d = int(ctx.static(depth, "depth").reshape(-1)[0])
    axis = a.get("axis", -1)
    ind = ind.cast(dtypes.int64)
    ind = (ind < 0).where(ind + d, ind)
    out_axis = axis % (ind.ndim + 1)
    shape = [1] * (ind.ndim + 1)
    shape[out_axis] = d
    hot = ind.unsqueeze(out_axis).eq(arange_at(d, out_axis, ind.ndim + 1))
    off = values.shrink(((0, 1),)).reshape(())
    on = values.shrink(((1, 2),)).reshape(())
    return hot.where(on, off)


@op("EyeLike")
def _eyelike(ctx, i, a):
    x, k = i[0], a.get("k", 0)
    dt = onnx_dtype(a["dtype"], ctx.where()) if "dtype" in a else x.dtype
    return Tensor.weight(np.eye(x.shape[0], x.shape[1], k, dtype=dt.np))


@op("Trilu")
def _trilu(ctx, i, a):
    x = i[0]
    k = int(ctx.static(i[1], "k").reshape(-1)[0]) if len(i) > 1 and i[1] is not None else 0
    n, m = x.shape[-2:]
    mask = (np.triu if a.get("upper", 1) else np.tril)(np.ones((n, m), bool), k)
    return Tensor.weight(mask).where(x, Tensor.full(0, x.dtype))


@op("DepthToSpace")
def _d2s(ctx, i, a):
    x, b = i[0], a["blocksize"]
    n, c, h, w = x.shape
    if a.get("mode", "DCR") == "DCR":
        t = x.reshape((n, b, b, c // (b * b), h, w)).permute((0, 3, 4, 1, 5, 2))
    else:
        t = x.reshape((n, c // (b * b), b, b, h, w)).permute((0, 1, 4, 2, 5, 3))
    return t.reshape((n, c // (b * b), h * b, w * b))


@op("SpaceToDepth")
def _s2d(ctx, i, a):
    x, b = i[0], a["blocksize"]
    n, c, h, w = x.shape
    order = (0, 1, 3, 5, 2, 4) if a.get("mode", "DCR") == "CRD" else (0, 3, 5, 1, 2, 4)
    t = x.reshape((n, c, h // b, b, w // b, b)).permute(order)
    return t.reshape((n, c * b * b, h // b, w // b))
