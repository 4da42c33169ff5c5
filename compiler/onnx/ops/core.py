"""ONNX ops, one function each, written with compiler/ir/tensor.py building blocks.

Every function has the signature (ctx, inputs, attrs) -> Tensor | list[Tensor]; `inputs` holds
None for omitted optional inputs. Opset differences are handled inside the op that has them.
"""
from __future__ import annotations

import math

import numpy as np

from compiler.ir.dtypes import dtypes
from compiler.errors import CompileError
from compiler.onnx.ops import winograd
from compiler.onnx.registry import OPS, Ctx, onnx_dtype, op
from compiler.ir.tensor import Tensor
from compiler.ir.uop import Ops


def _axes(ctx: Ctx, x, a: dict, inputs, pos: int = 1, key: str = "axes"):
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


# ---- elementwise ------------------------------------------------------------------------------
def _unary(fn):
    return lambda ctx, i, a: fn(i[0])


for _name, _fn in {
    "Relu": Tensor.relu, "Sigmoid": Tensor.sigmoid, "Tanh": Tensor.tanh, "Exp": Tensor.exp,
    "Log": Tensor.log, "Sqrt": Tensor.sqrt, "Neg": lambda x: -x, "Abs": Tensor.abs,
    "Reciprocal": Tensor.reciprocal, "Floor": Tensor.floor, "Ceil": Tensor.ceil,
    "Round": Tensor.round_even, "Sign": Tensor.sign, "Sin": Tensor.sin, "Cos": Tensor.cos,
    "Erf": Tensor.erf, "Not": Tensor.logical_not, "Identity": lambda x: x,
    "Softplus": lambda x: _softplus(x), "Mish": lambda x: x * _softplus(x).tanh(),
    "Tan": lambda x: x.sin() / x.cos(), "IsNaN": lambda x: x.ne(x),
    "Atan": Tensor.atan, "Asin": Tensor.asin, "Acos": Tensor.acos,
    "Sinh": lambda x: (x.exp() - (-x).exp()) * 0.5, "Cosh": lambda x: (x.exp() + (-x).exp()) * 0.5,
    "Asinh": lambda x: x.sign() * (x.abs() + (x * x + 1.0).sqrt()).log(),
    "Acosh": lambda x: (x + (x * x - 1.0).sqrt()).log(),
    "Atanh": lambda x: ((1.0 + x) / (1.0 - x)).log() * 0.5,
    "BitwiseNot": lambda x: x ^ Tensor.full(-1 if x.dtype.kind == "i" else x.dtype.max, x.dtype),
}.items():
    OPS[_name] = _unary(_fn)


@op("IsInf")
def _isinf(ctx, i, a):
    x = i[0]
    none = Tensor.full(False, dtypes.bool, x.shape)
    pos = x.eq(math.inf) if a.get("detect_positive", 1) else none
    return pos | x.eq(-math.inf) if a.get("detect_negative", 1) else pos


def _softplus(x: Tensor) -> Tensor:
    # log(1 + e^x) without overflow: max(x, 0) + log1p(e^-|x|)
    return x.relu() + _log1p((-x.abs()).exp())


def _log1p(t: Tensor) -> Tensor:
    """log(1 + t), accurate for tiny t: log(u) * t / (u - 1) with u = 1 + t rounded."""
    u = t + 1.0
    return u.eq(1.0).where(t, u.log() * t / (u - 1.0))


def _binary(fn):
    return lambda ctx, i, a: fn(i[0], i[1])


for _name, _fn in {
    "Add": Tensor.__add__, "Sub": Tensor.__sub__, "Mul": Tensor.__mul__,
    "Div": Tensor.__truediv__, "Equal": Tensor.eq, "Less": Tensor.__lt__,
    "Greater": Tensor.__gt__, "LessOrEqual": Tensor.__le__, "GreaterOrEqual": Tensor.__ge__,
    "And": Tensor.__and__, "Or": Tensor.__or__, "Xor": Tensor.__xor__,
    "BitwiseAnd": Tensor.__and__, "BitwiseOr": Tensor.__or__, "BitwiseXor": Tensor.__xor__,
}.items():
    OPS[_name] = _binary(_fn)


@op("Pow")
def _pow(ctx, i, a):
    x, y = i
    return x.pow(y.cast(x.dtype))


@op("Mod")
def _mod(ctx, i, a):
    x, y = i
    if x.dtype.is_float:  # C fmod: x - trunc(x/y)*y, sign of the dividend; fmod(x, +-inf) = x
        r = y.abs().eq(math.inf).where(x, x - (x / y).trunc() * y)
    elif a.get("fmod", 0) or x.dtype.is_unsigned:
        return x % y
    else:
        r = x % y  # C semantics: sign of the dividend
    if a.get("fmod", 0):
        return r
    fix = r.ne(0) & (r < 0).ne(y < 0)  # Python semantics: sign of the divisor
    return fix.where(r + y, r)


@op("BitShift")
def _bitshift(ctx, i, a):
    """Shift counts outside [0, bits) saturate (0, or -1 for a negative value shifted right),
    as numpy does; C would take them modulo the width."""
    x, n = i
    wide = (n < 0) | (n >= x.dtype.bits) if n.dtype.kind == "i" else n >= x.dtype.bits
    if a["direction"] == "LEFT":
        return wide.where(Tensor.full(0, x.dtype), x.shl(n))
    fill = (x < 0).where(Tensor.full(-1, x.dtype), Tensor.full(0, x.dtype)) \
        if x.dtype.kind == "i" else Tensor.full(0, x.dtype)
    return wide.where(fill, x.shr(n))


@op("Max", "Min", "Sum", "Mean")
def _variadic(ctx, i, a):
    fn = {"Max": Tensor.maximum, "Min": Tensor.minimum, "Sum": Tensor.__add__,
          "Mean": Tensor.__add__}[ctx.node.op_type]
    out = i[0]
    for t in i[1:]:
        out = fn(out, t)
    return out / float(len(i)) if ctx.node.op_type == "Mean" else out


@op("Where")
def _where(ctx, i, a):
    return i[0].where(i[1], i[2])


@op("Clip")
def _clip(ctx, i, a):
    x = i[0]
    lo = i[1] if len(i) > 1 and i[1] is not None else a.get("min")
    hi = i[2] if len(i) > 2 and i[2] is not None else a.get("max")
    if lo is not None:
        x = x.maximum(lo if isinstance(lo, Tensor) else Tensor.full(lo, x.dtype))
    if hi is not None:  # min applied last: Clip with min > max gives max, as onnxruntime does
        x = x.minimum(hi if isinstance(hi, Tensor) else Tensor.full(hi, x.dtype))
    return x


@op("Cast")
def _cast(ctx, i, a):
    return _cast_to(i[0], onnx_dtype(a["to"], ctx.where()))


def _cast_to(x: Tensor, dt) -> Tensor:
    if x.dtype.is_float and dt is dtypes.bool:
        return x.ne(0.0)
    if dtypes.float16 in (x.dtype, dt) and dtypes.float32 not in (x.dtype, dt) and x.dtype != dt:
        # freestanding C has no half<->double/int64 conversion routines: go through float
        return x.cast(dtypes.float32).cast(dt)
    return x.cast(dt)


@op("CastLike")
def _castlike(ctx, i, a):
    return _cast_to(i[0], i[1].dtype)


@op("LeakyRelu")
def _leaky(ctx, i, a):
    x = i[0]
    return (x > 0).where(x, x * a.get("alpha", 0.01))


@op("PRelu")
def _prelu(ctx, i, a):
    x, slope = i
    return (x > 0).where(x, x * slope)


@op("Elu")
def _elu(ctx, i, a):
    x = i[0]
    return (x > 0).where(x, (x.exp() - 1.0) * a.get("alpha", 1.0))


@op("Selu")
def _selu(ctx, i, a):
    x = i[0]
    alpha = a.get("alpha", 1.67326319217681884765625)
    gamma = a.get("gamma", 1.05070102214813232421875)
    return (x > 0).where(x * gamma, (x.exp() - 1.0) * (alpha * gamma))


@op("Celu")
def _celu(ctx, i, a):
    x, alpha = i[0], a.get("alpha", 1.0)
    return x.relu() + ((x / alpha).exp() - 1.0).minimum(0.0) * alpha


@op("ThresholdedRelu")
def _trelu(ctx, i, a):
    return (i[0] > a.get("alpha", 1.0)).where(i[0], 0.0)


@op("HardSigmoid")
def _hsig(ctx, i, a):
    return (i[0] * a.get("alpha", 0.2) + a.get("beta", 0.5)).maximum(0.0).minimum(1.0)


@op("HardSwish")
def _hswish(ctx, i, a):
    x = i[0]
    return x * (x * (1 / 6) + 0.5).maximum(0.0).minimum(1.0)


@op("Gelu")
def _gelu(ctx, i, a):
    x = i[0]
    if a.get("approximate", "none") == "tanh":
        return x * 0.5 * ((x + x * x * x * 0.044715) * math.sqrt(2 / math.pi)).tanh() + x * 0.5
    return x * 0.5 * ((x * (1 / math.sqrt(2))).erf() + 1.0)


@op("Softsign")
def _softsign(ctx, i, a):
    return i[0] / (i[0].abs() + 1.0)


@op("Shrink")
def _shrink(ctx, i, a):
    x, lambd, bias = i[0], a.get("lambd", 0.5), a.get("bias", 0.0)
    return (x < -lambd).where(x + bias, (x > lambd).where(x - bias, 0.0))


# ---- softmax & normalization ----------------------------------------------------------------
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


@op("MatMul")
def _matmul(ctx, i, a):
    return contract(Tensor.matmul, i[0], i[1])


@op("Gemm")
def _gemm(ctx, i, a):
    x, w = i[0], i[1]
    if a.get("transA", 0):
        x = x.transpose()
    if a.get("transB", 0):
        w = w.transpose()
    y = contract(Tensor.matmul, x, w)
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
    x, w = i[0], i[1]
    ks = tuple(w.shape[2:])
    strides, dil, pads = _window_attrs(a, x, ks)
    group = a.get("group", 1)
    if ctx.winograd and x.dtype is dtypes.float32 \
            and winograd.eligible(x.shape, w.shape, strides, dil, pads, group) \
            and (value := ctx.constant(w)) is not None:
        y = winograd.conv(x, value, pads)
    else:
        y = contract(lambda x, w: x.conv(w, strides, dil, pads, group), x, w)
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
def _pool_pads(a, x, ks, strides, dil):
    pads = _conv_pads(a, x.shape[2:], ks, strides, dil)
    if a.get("ceil_mode", 0):  # extra right padding so the last partial window is included
        out = []
        for (b, e), s, k, st, d in zip(pads, x.shape[2:], ks, strides, dil):
            span = s + b + e - ((k - 1) * d + 1)
            n_ceil = -(-span // st) + 1
            if (n_ceil - 1) * st >= s + b:  # the last window must start inside the input
                n_ceil -= 1
            out.append((b, e + max((n_ceil - 1) * st + (k - 1) * d + 1 - (s + b + e), 0)))
        pads = tuple(out)
    return pads


@op("MaxPool")
def _maxpool(ctx, i, a):
    x, ks = i[0], tuple(a["kernel_shape"])
    strides = tuple(a.get("strides", [1] * len(ks)))
    dil = tuple(a.get("dilations", [1] * len(ks)))
    pads = _pool_pads(a, x, ks, strides, dil)
    fill = -math.inf if x.dtype.is_float else x.dtype.min
    y = x.pool(Ops.MAX, ks, strides, dil, pads, fill)
    if len(ctx.node.output) < 2 or not ctx.node.output[1]:
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
    x, ks = i[0], tuple(a["kernel_shape"])
    strides = tuple(a.get("strides", [1] * len(ks)))
    dil = tuple(a.get("dilations", [1] * len(ks)))
    pads = _pool_pads(a, x, ks, strides, dil)
    s = x.pool(Ops.ADD, ks, strides, dil, pads, 0.0)
    sym_pads = _conv_pads(a, x.shape[2:], ks, strides, dil)
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
    return x.mean(axes) if ctx.node.op_type == "GlobalAveragePool" else x.max(axes)


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


# ---- reductions -----------------------------------------------------------------------------
def _reduce_axes(ctx, i, a, x):
    axes = _axes(ctx, x, a, i)
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


# ---- shape & movement -------------------------------------------------------------------------
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
    axes = _axes(ctx, x, a, i)
    axes = [d % x.ndim for d in axes] if axes else [d for d, s in enumerate(x.shape) if s == 1]
    return x.reshape(tuple(s for d, s in enumerate(x.shape) if d not in axes))


@op("Unsqueeze")
def _unsqueeze(ctx, i, a):
    x = i[0]
    axes = _axes(ctx, x, a, i)
    n = x.ndim + len(axes)
    axes = sorted(d % n for d in axes)
    shape = list(x.shape)
    for d in axes:
        shape.insert(d, 1)
    return x.reshape(shape)


@op("Concat")
def _concat(ctx, i, a):
    return Tensor.cat([t for t in i if t is not None], a["axis"])


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

