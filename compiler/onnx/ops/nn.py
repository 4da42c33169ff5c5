"""ONNX network layers: normalization, matmul and Gemm, convolution, pooling.

Every function has the signature (ctx, inputs, attrs) -> Tensor | list[Tensor]; `inputs` holds
None for omitted optional inputs. Opset differences are handled inside the op that has them.
"""
from __future__ import annotations

import math

import numpy as np

from compiler.ir.dtypes import dtypes
from compiler.ir.tensor import Tensor
from compiler.ir.uop import Ops
import compiler.onnx.ops.quant as quant
from compiler.onnx.ops.shape import arange_at
from compiler.onnx.registry import Choice, op


# ---- normalization ------------------------------------------------------------------------
@op("BatchNormalization")
def _batchnorm(ctx, i, a):
    x, scale, bias, mean, var = i[:5]
    eps = a.get("epsilon", 1e-5)
    if not a.get("training_mode", 0):
        inv = scale / (var + eps).sqrt()
        return x * _bshape(inv, x) + _bshape(bias - mean * inv, x)
    axes = [0] + list(range(2, x.ndim))  # batch statistics; running ones move by momentum
    bmean = x.mean(axes)
    bvar = ((x - bmean) * (x - bmean)).mean(axes)
    y = (x - bmean) / (bvar + eps).sqrt() * _bshape(scale, x) + _bshape(bias, x)
    m = a.get("momentum", 0.9)
    flat = lambda t: t.reshape((x.shape[1],))  # noqa: E731
    return [y, mean * m + flat(bmean) * (1 - m), var * m + flat(bvar) * (1 - m)]


def _bshape(t: Tensor, x: Tensor) -> Tensor:
    """A per-channel vector broadcast against NC... activations."""
    return t.reshape((1, t.shape[0]) + (1,) * (x.ndim - 2))


@op("InstanceNormalization")
def _instnorm(ctx, i, a):
    x, scale, bias = i
    axes = list(range(2, x.ndim))
    mean = x.mean(axes)
    d = x - mean
    var = (d * d).mean(axes)
    return d / (var + a.get("epsilon", 1e-5)).sqrt() * _bshape(scale, x) + _bshape(bias, x)


@op("LayerNormalization")
def _layernorm(ctx, i, a):
    x, scale = i[0], i[1]
    bias = i[2] if len(i) > 2 else None
    axis = a.get("axis", -1) % x.ndim
    axes = list(range(axis, x.ndim))
    mean = x.mean(axes)
    d = x - mean
    inv = ((d * d).mean(axes) + a.get("epsilon", 1e-5)).sqrt().reciprocal()
    y = d * inv * scale
    return [y + bias if bias is not None else y, mean, inv]


@op("LRN")
def _lrn(ctx, i, a):
    x, size = i[0], a["size"]
    alpha, beta, bias = a.get("alpha", 1e-4), a.get("beta", 0.75), a.get("bias", 1.0)
    sq = x * x
    lo, hi = (size - 1) // 2, size // 2  # ONNX: floor((size-1)/2) before, ceil after
    pads = ((0, 0), (lo, hi)) + ((0, 0),) * (x.ndim - 2)
    win = sq.pad(pads).permute([0] + list(range(2, x.ndim)) + [1])
    s = win.pool(Ops.ADD, (size,), (1,), (1,), ((0, 0),), 0.0)
    s = s.permute([0, x.ndim - 1] + list(range(1, x.ndim - 1)))
    return x / (s * (alpha / size) + bias).pow(Tensor.full(beta, x.dtype))


@op("LpNormalization")
def _lpnorm(ctx, i, a):
    x, axis = i[0], a.get("axis", -1)
    norm = x.abs().sum([axis]) if a.get("p", 2) == 1 else (x * x).sum([axis]).sqrt()
    return norm.eq(0).where(Tensor.full(0, x.dtype), x / norm)


@op("MeanVarianceNormalization")
def _mvn(ctx, i, a):
    x = i[0]
    axes = a.get("axes", [0, 2, 3])
    d = x - x.mean(axes)
    return d / ((d * d).mean(axes).sqrt() + 1e-9)


# ---- contractions ---------------------------------------------------------------------------
def contract(fn, x: Tensor, w: Tensor) -> Tensor:
    """A matmul/conv of float16 operands: exact products summed in float32, rounded once (what
    numpy and onnxruntime do; rounding each product to float16 loses up to 2 ulp)."""
    if x.dtype is not dtypes.float16:
        return fn(x, w)
    return fn(x.cast(dtypes.float32), w.cast(dtypes.float32)).cast(dtypes.float16)


def _dense(ctx, x: Tensor, w: Tensor) -> Tensor:
    """x @ w; a 2-D weight's product is a Choice (compiler/algorithms.py may pad its columns)."""
    build = lambda x, w: contract(Tensor.matmul, x, w)  # noqa: E731
    y = build(x, w)
    if w.ndim == 2:
        macs = math.prod(x.shape[:-1]) * math.prod(w.shape)
        ctx.choices.append(Choice(y.uop, x.uop, w.uop, macs, build))
    return y


@op("MatMul")
def _matmul(ctx, i, a):
    if (y := quant.integer_contract(ctx, i, a, _matmul, -1, -1)) is not None:
        return y  # QDQ: int8 products in int32
    return _dense(ctx, i[0], i[1])


@op("Gemm")
def _gemm(ctx, i, a):
    w_axis = 0 if a.get("transB", 0) else -1  # the output channel's axis in the weight
    if not a.get("transA", 0) and a.get("alpha", 1.0) == a.get("beta", 1.0) == 1.0 \
            and (y := quant.integer_contract(ctx, i, a, _gemm, w_axis, -1)) is not None:
        return y
    x, w = i[0], i[1]
    if a.get("transA", 0):
        x = x.transpose()
    if a.get("transB", 0):
        w = w.transpose()
    y = _dense(ctx, x, w)
    if a.get("alpha", 1.0) != 1.0:
        y = y * a["alpha"]
    if len(i) > 2 and i[2] is not None:
        c = i[2] if a.get("beta", 1.0) == 1.0 else i[2] * a["beta"]
        y = y + c
    return y


def _conv_pads(a: dict, x_sp, ks, strides, dil) -> tuple:
    nsp = len(ks)
    auto = a.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for s, k, st, d in zip(x_sp, ks, strides, dil):
            out = -(-s // st)
            total = max((out - 1) * st + (k - 1) * d + 1 - s, 0)
            small = total // 2
            pads.append((small, total - small) if auto == "SAME_UPPER" else (total - small, small))
        return tuple(pads)
    if auto == "VALID":
        return ((0, 0),) * nsp
    p = a.get("pads", [0] * (2 * nsp))
    return tuple(zip(p[:nsp], p[nsp:]))


def _window_attrs(a: dict, x: Tensor, ks):
    nsp = len(ks)
    strides = tuple(a.get("strides", [1] * nsp))
    dil = tuple(a.get("dilations", [1] * nsp))
    return strides, dil, _conv_pads(a, x.shape[2:], ks, strides, dil)


@op("Conv")
def _conv(ctx, i, a):
    if (y := quant.integer_contract(ctx, i, a, _conv, 0, 1)) is not None:
        return y  # QDQ: int8 products in int32
    x, w = i[0], i[1]
    ks = tuple(w.shape[2:])
    strides, dil, pads = _window_attrs(a, x, ks)
    group = a.get("group", 1)
    product = a.get(quant.PRODUCT)  # the QDQ path's multiply, where it has its own

    def build(x, w):
        return contract(lambda x, w: x.conv(w, strides, dil, pads, group, product), x, w)
    y = build(x, w)
    if group == 1:  # a Choice: compiler/algorithms.py may pad its channels or take Winograd's
        macs = x.shape[0] * math.prod(x.shape[2:]) // math.prod(strides) * math.prod(w.shape)
        ctx.choices.append(Choice(y.uop, x.uop, w.uop, macs, build, (strides, dil, pads, group)))
    if len(i) > 2 and i[2] is not None:
        y = y + _bshape(i[2], y)
    return y


@op("ConvTranspose")
def _conv_transpose(ctx, i, a):
    """Transposed conv = conv of the stride-dilated input with the flipped, transposed kernel."""
    x, w = i[0], i[1]
    g, nsp = a.get("group", 1), x.ndim - 2
    cin, coutg, ks = w.shape[0], w.shape[1], tuple(w.shape[2:])
    strides = tuple(a.get("strides", [1] * nsp))
    dil = tuple(a.get("dilations", [1] * nsp))
    outpad = tuple(a.get("output_padding", [0] * nsp))
    pads = a.get("pads")
    sp = x.shape[2:]
    if "output_shape" in a:
        want = tuple(a["output_shape"][-nsp:])
        total = [st * (s - 1) + op_ + ((k - 1) * d + 1) - o for s, st, op_, k, d, o in
                 zip(sp, strides, outpad, ks, dil, want)]
        if a.get("auto_pad", "NOTSET") == "SAME_UPPER":
            pads = [t // 2 for t in total] + [t - t // 2 for t in total]
        else:
            pads = [t - t // 2 for t in total] + [t // 2 for t in total]
    elif a.get("auto_pad", "NOTSET") in ("SAME_UPPER", "SAME_LOWER"):
        total = [st * (s - 1) + op_ + ((k - 1) * d + 1) - s * st for s, st, op_, k, d in
                 zip(sp, strides, outpad, ks, dil)]
        small = [t // 2 for t in total]
        pads = small + [t - s for t, s in zip(total, small)] if a["auto_pad"] == "SAME_UPPER" \
            else [t - s for t, s in zip(total, small)] + small
    pads = pads or [0] * (2 * nsp)
    # dilate the input by the stride: each element followed by (stride-1) zeros
    xd = x
    for d, st in enumerate(strides):
        if st > 1:
            ax = 2 + d
            zeros = [(0, 0)] * (ax + 1) + [(0, st - 1)] + [(0, 0)] * (xd.ndim - ax - 1)
            xd = xd.unsqueeze(ax + 1).pad(zeros)
            shp = list(xd.shape)
            xd = xd.reshape(shp[:ax] + [shp[ax] * st] + shp[ax + 2:])
            xd = xd.shrink([(0, s) if j != ax else (0, s - (st - 1))
                            for j, s in enumerate(xd.shape)])
    full_pads = tuple(((k - 1) * dd - pads[j], (k - 1) * dd - pads[nsp + j] + outpad[j])
                      for j, (k, dd) in enumerate(zip(ks, dil)))
    wt = w.reshape((g, cin // g, coutg) + ks).permute([0, 2, 1] + list(range(3, 3 + nsp)))
    wt = wt.reshape((g * coutg, cin // g) + ks).flip(list(range(2, 2 + nsp)))
    y = xd.conv(wt, (1,) * nsp, dil, full_pads, g)
    if len(i) > 2 and i[2] is not None:
        y = y + _bshape(i[2], y)
    return y


# ---- pooling --------------------------------------------------------------------------------
def _pool_attrs(a: dict, x: Tensor):
    """(kernel, strides, dilations, pads, pads before ceil_mode) of a MaxPool or AveragePool."""
    ks = tuple(a["kernel_shape"])
    strides, dil, sym = _window_attrs(a, x, ks)
    if not a.get("ceil_mode", 0):
        return ks, strides, dil, sym, sym
    pads = []  # extra right padding so the last partial window is included
    for (b, e), s, k, st, d in zip(sym, x.shape[2:], ks, strides, dil):
        span = s + b + e - ((k - 1) * d + 1)
        n_ceil = -(-span // st) + 1
        if (n_ceil - 1) * st >= s + b:  # the last window must start inside the input
            n_ceil -= 1
        pads.append((b, e + max((n_ceil - 1) * st + (k - 1) * d + 1 - (s + b + e), 0)))
    return ks, strides, dil, tuple(pads), sym


@op("MaxPool")
def _maxpool(ctx, i, a):
    x = i[0]
    ks, strides, dil, pads, _ = _pool_attrs(a, x)
    single = len(ctx.node.output) < 2 or not ctx.node.output[1]
    if single and (y := quant.integer_window(ctx, x, lambda q: q.pool(
            Ops.MAX, ks, strides, dil, pads, q.dtype.min))) is not None:
        return y  # QDQ: the max of the int8 values
    fill = -math.inf if x.dtype.is_float else x.dtype.min
    y = x.pool(Ops.MAX, ks, strides, dil, pads, fill)
    if single:
        return y
    return [y, _maxpool_indices(x, y, ks, strides, dil, pads, a.get("storage_order", 0))]


def _maxpool_indices(x, y, ks, strides, dil, pads, storage_order: int) -> Tensor:
    """Flat (N, C, *S) index of each window's first maximum (row-major scan of the window)."""
    nsp, sp = len(ks), x.shape[2:]
    fill = -math.inf if x.dtype.is_float else x.dtype.min
    lead = ((0, 0), (0, 0))
    win = x.pad(lead + tuple(pads), fill).window(ks, strides, dil)  # (N, C, *O, *K)
    order = np.arange(math.prod(sp)).reshape(sp)  # row-major scan order breaks ties
    pos = np.arange(math.prod(sp)).reshape(sp[::-1]).transpose() if storage_order else order
    kaxes = list(range(2 + nsp, 2 + 2 * nsp))
    big = math.prod(sp)

    def windowed(v):
        return Tensor.weight(v.reshape((1, 1) + sp).astype(np.int64)).pad(
            lead + tuple(pads), 0).window(ks, strides, dil)

    hit = win.eq(y.reshape(y.shape + (1,) * nsp))
    first = hit.where(windowed(order), Tensor.full(big, dtypes.int64)).min(kaxes)
    at = windowed(order).eq(first)
    local = (hit & at).where(windowed(pos), Tensor.full(0, dtypes.int64)).max(kaxes, False)
    n, c = x.shape[:2]
    plane = arange_at(n * c, 0, 1).reshape((n, c) + (1,) * nsp) * big
    return local + plane


@op("AveragePool")
def _avgpool(ctx, i, a):
    x = i[0]
    ks, strides, dil, pads, sym_pads = _pool_attrs(a, x)
    whole = pads == sym_pads and (a.get("count_include_pad", 0) or not any(map(any, pads)))
    if whole and (y := quant.integer_sum(ctx, x, lambda q: q.pool(
            Ops.ADD, ks, strides, dil, pads, 0), math.prod(ks))) is not None:
        return y  # QDQ, every window counts all of ks: the int32 sum, divided in the scale
    s = x.pool(Ops.ADD, ks, strides, dil, pads, 0.0)
    if a.get("count_include_pad", 0):
        # the divisor counts explicit padding but not the ceil_mode overhang
        ones = Tensor.full(1.0, x.dtype, x.shape).pad(((0, 0), (0, 0)) + sym_pads, 1.0)
        extra = tuple((0, e2 - e1) for (_, e1), (_, e2) in zip(sym_pads, pads))
        n = ones.pool(Ops.ADD, ks, strides, dil, extra, 0.0)
    else:
        n = Tensor.full(1.0, x.dtype, x.shape).pool(Ops.ADD, ks, strides, dil, pads, 0.0)
    return s / n


@op("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(ctx, i, a):
    x = i[0]
    axes = list(range(2, x.ndim))
    if ctx.node.op_type == "GlobalAveragePool":
        n = math.prod(x.shape[2:])
        y = quant.integer_sum(ctx, x, lambda q: q.sum(axes, keepdims=True), n)
        return x.mean(axes) if y is None else y
    return x.max(axes)


@op("LpPool")
def _lppool(ctx, i, a):
    x, ks, p = i[0], tuple(a["kernel_shape"]), a.get("p", 2)
    strides, dil, pads = _window_attrs(a, x, ks)
    s = x.abs().pow(Tensor.full(float(p), x.dtype)).pool(Ops.ADD, ks, strides, dil, pads, 0.0)
    return s.pow(Tensor.full(1.0 / p, x.dtype))


@op("GlobalLpPool")
def _glppool(ctx, i, a):
    x, p = i[0], a.get("p", 2)
    s = x.abs().pow(Tensor.full(float(p), x.dtype)).sum(list(range(2, x.ndim)))
    return s.pow(Tensor.full(1.0 / p, x.dtype))
