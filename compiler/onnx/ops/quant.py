"""ONNX quantization ops: (de)quantize, and integer matmul/conv with zero points.

Integer contractions accumulate in int32 (exact, as the ONNX reference does); requantization
multiplies by the scale ratio in float64, rounds half to even and saturates to the output type.

QDQ models (what quantizers such as onnxruntime's quantize_static emit) spell integer layers as
float ops between DequantizeLinear and QuantizeLinear. Here they run in integers: a
DequantizeLinear of int8/uint8 with constant scale and zero point records its integer origin
(Ctx.qdq; a reshape of it keeps it, `origin`); Conv, MatMul and Gemm whose inputs both have one
(and whose bias, if any, is the int32 DequantizeLinear quantizers emit) multiply the integers and
accumulate in int32, Add of two sums them at a common Q20 scale, Mul multiplies them, average pools
sum them, and each records the int32 accumulator with its scale; a QuantizeLinear of such a value
requantizes the accumulator with a fixed-point multiplier and shift in int32 lanes instead of going
through float; MaxPool takes its max on the integers (dequantization is increasing); a
QuantizeLinear of a dequantized int8 tensor, or of a Concat of them, with the same scale and zero
point keeps the integers. Everything else (a Concat or Q that changes scales) stays the float
computation the graph spells, between its DQ and Q: requantized only where the graph says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compiler.ir.dtypes import DType, dtypes
from compiler.ir.uop import Ops
from compiler.onnx.ops.quant_hvx import clamped_quotient, dot4_conv
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
    if not block and (q := integer_requantize(ctx, x, scale, zp, out)) is not None:
        return q
    if not block and (q := integer_rescale(ctx, x, scale, zp, out)) is not None:
        return q
    s = qparam(scale, x, axis, block)
    ct = onnx_dtype(a["precision"], ctx.where()) if a.get("precision") else _widest(x, s)
    z = qparam(zp, x, axis, block) if zp is not None else None
    if ct is dtypes.float32 and out.itemsize <= 2:
        return _round_to(ctx, x.cast(ct), s.cast(ct), z, out)
    v = (x.cast(ct) / s.cast(ct)).round_even()
    return saturate(v if z is None else v.cast(dtypes.float32) + z.cast(dtypes.float32), out)


MAGIC = 1.5 * 2 ** 23  # float32's ulp is 1 from 2**23 to 2**24


def _round_to(ctx, x: Tensor, s: Tensor, zq: Tensor | None, out: DType) -> Tensor:
    """saturate(round_even(x / s) + zq, out) for float32 x, s and an 8- or 16-bit out. The
    quotient clamped to the integers out's range allows (minus zq) commutes with rounding and
    leaves |v| < 2**17, where v + 1.5 * 2**23 is v rounded half to even in IEEE float32
    arithmetic (the sum's ulp is 1, and 1.5 * 2**23 is even), and its bits minus those of
    1.5 * 2**23 are that integer: one float add where round_even() takes a floor, a halving and
    compares, and the zero point added as an integer (scalar float on the DSP: the float
    input's quantization)."""
    lo, hi = float(out.min), float(out.max)
    if zq is not None:
        z = zq.cast(dtypes.float32)
        lo, hi = Tensor.full(lo, dtypes.float32) - z, Tensor.full(hi, dtypes.float32) - z
    bits = (clamped_quotient(ctx, x, s, lo, hi) + MAGIC).bitcast(dtypes.int32)
    r = bits - int(np.float32(MAGIC).view(np.int32))
    return (r if zq is None else r + zq.cast(dtypes.int32)).cast(out)


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
    y = y.cast(out)
    if not block and out is dtypes.float32:
        note_dq(ctx, y, x, scale, zp, axis)
    return y


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


# ---- the integer QDQ path ---------------------------------------------------------------------

# int32 lanes of a 128-byte HVX vector: a conv whose output channels are a few short of a
# multiple (squeezenet's 1000) is computed with zero channels up to it, at most 1/16 more work,
# so its kernel takes whole vectors instead of the widest power of two dividing the count (8)
LANES = 32
# the attribute (no ONNX name has a dot) by which integer_contract gives _conv its multiply
PRODUCT = "keel.product"


@dataclass(frozen=True)
class Dq:
    """A DequantizeLinear's integer origin: q (int8/uint8/int32), its constant zero point and
    scale (numpy, scalar or per `axis`)."""
    q: Tensor
    zp: np.ndarray
    scale: np.ndarray
    axis: int


@dataclass(frozen=True)
class Cat:
    """A Concat of dequantized int8 tensors (each its own scale) along `axis`."""
    parts: tuple
    axis: int


@dataclass(frozen=True)
class Acc:
    """An int32 accumulator and the float scale per element of `axis` that makes it the value."""
    acc: Tensor
    scale: np.ndarray
    axis: int
    keep: int = 0  # the value is the first `keep` entries of `axis` (0: all)


def note_dq(ctx, y: Tensor, x: Tensor, scale: Tensor, zp: Tensor | None, axis: int) -> None:
    if x.dtype not in (dtypes.int8, dtypes.uint8, dtypes.int32):
        return
    s = ctx.constant(scale)
    z = np.zeros(1, np.int64) if zp is None else ctx.constant(zp)
    if s is not None and z is not None:
        ctx.qdq[y.uop] = Dq(x, z.astype(np.int64), s.astype(np.float64), axis % max(x.ndim, 1))


def origin(ctx, t: Tensor | None):
    """t's quantized origin (Dq, Cat or Acc) or None. A reshape (Flatten, Reshape, Squeeze,
    Unsqueeze) of a per-tensor dequantized tensor is the dequantized reshape of its integers,
    so a Q after a Flatten keeps them, and the max pool before it stays integer."""
    if t is None:
        return None
    u = t.uop
    while u not in ctx.qdq and u.op is Ops.RESHAPE:
        u = u.src[0]
    d = ctx.qdq.get(u)
    if u is t.uop:
        return d
    return Dq(d.q.reshape(t.shape), d.zp, d.scale, d.axis) if _per_tensor8(d) else None


def integer_contract(ctx, i: list, a: dict, float_op, w_axis: int, out_axis: int):
    """Conv / MatMul / Gemm on dequantized integers, in integers; None when the inputs are not
    all quantized per tensor (activations) and per tensor or per output channel (weights)."""
    x, w = (origin(ctx, t) for t in i[:2])
    if not (isinstance(x, Dq) and isinstance(w, Dq)) or x.q.dtype is dtypes.int32 \
            or x.scale.size != 1 or x.zp.size != 1 or np.any(w.zp):
        return None
    if w.scale.size != 1 and w.axis != w_axis % w.q.ndim:
        return None
    scale = (x.scale.reshape(()) * w.scale).reshape(-1)
    bias = ctx.qdq.get(i[2].uop) if len(i) > 2 and i[2] is not None else None
    if len(i) > 2 and i[2] is not None and not (
            isinstance(bias, Dq) and bias.q.dtype is dtypes.int32 and not np.any(bias.zp)
            and np.allclose(np.broadcast_to(bias.scale.reshape(-1), scale.shape), scale,
                            rtol=1e-6, atol=0)):
        return None  # a float bias, or one quantized with another scale
    xi, wq, bq, n = _int32(x), w.q, bias.q if bias else None, w.q.shape[w_axis]
    wc = ctx.constant(wq)
    if w_axis == 0 and wc is not None and a.get("group", 1) == 1 and \
            (padded := _channels_kept(x.q)) is not None:
        # the input is a padded conv's first channels: read all of them (the padding's
        # centered values are 0) against zero weights, so no kernel copies the first ones out
        x = Dq(padded, x.zp, x.scale, x.axis)
        xi = _int32(x)
        wc = np.pad(wc, ((0, 0), (0, padded.shape[1] - wc.shape[1])) + ((0, 0),) * (wc.ndim - 2))
        wq = Tensor.weight(wc)
    if w_axis == 0 and wc is not None and wc.shape[1] == 1 and a.get("group", 1) == wc.shape[0] \
            == x.q.shape[1] and (padded := _channels_kept(x.q)) is not None:
        # depthwise over a padded conv's first channels: all of them, one group each, the
        # padding's against zero weights and bias (its result is the zero point, cut off after)
        x, pad = Dq(padded, x.zp, x.scale, x.axis), padded.shape[1] - wc.shape[0]
        xi, a = _int32(x), {**a, "group": padded.shape[1]}
        wc = np.pad(wc, ((0, pad),) + ((0, 0),) * (wc.ndim - 1))
        wq = Tensor.weight(wc)
        if bq is not None:
            if (bc := ctx.constant(bq)) is None:
                return None
            bq = Tensor.weight(np.pad(bc, (0, pad)))
        scale = np.pad(np.broadcast_to(scale, n), (0, pad), mode="edge")
    if wc is not None and wc.ndim == 2 and (xw := _pixels_first(x, wc, 1 if w_axis == 0 else 0)):
        xi, wc = xw
        wq = Tensor.weight(wc)
    # the weight's first axis is the output channel's; a grouped conv's channels are its groups'
    if w_axis == 0 and wc is not None and a.get("group", 1) == 1:
        wq, bq, scale = _whole_vectors(ctx, wq, wc, bq, scale)
    if (acc := dot4_conv(ctx, x.q, int(x.zp.reshape(-1)[0]),
                                   ctx.constant(wq) if wc is not None else None, bq, a)) is None:
        if ctx.hvx and wq.dtype in (dtypes.int8, dtypes.uint8):  # weights fit a halfword
            a = {**a, PRODUCT: Tensor.mul16}
        acc = float_op(ctx, [xi, wq.cast(dtypes.int32)] + ([bq] if bq is not None else []), a)
    out_axis %= acc.ndim
    shape = [scale.size if d == out_axis else 1 for d in range(acc.ndim)]
    y = acc.cast(dtypes.float32) * Tensor.weight(scale.astype(np.float32).reshape(shape))
    keep = n if wq.shape[w_axis] != n else 0  # padded: the first n channels are the value
    if keep:
        y = y.shrink([(0, n) if d == out_axis else (0, s) for d, s in enumerate(acc.shape)])
    ctx.qdq[y.uop] = Acc(acc, scale, out_axis, keep)
    return y


def _whole_vectors(ctx, wq: Tensor, wc: np.ndarray, bq: Tensor | None, scale: np.ndarray):
    """(weight, bias, scale) with zero output channels up to a multiple of LANES when that adds
    at most 1/16 of the work (1/ctx.narrow_pad_divisor when the count is not a multiple of
    LANES) and the bias is constant too; else as they are."""
    n = wc.shape[0]
    pad, bc = -n % LANES, ctx.constant(bq) if bq is not None else None
    divisor = ctx.narrow_pad_divisor if n % LANES else 16
    if not pad or pad * divisor > n or (bq is not None and bc is None):
        return wq, bq, scale
    wq = Tensor.weight(np.pad(wc, ((0, pad),) + ((0, 0),) * (wc.ndim - 1)))
    bq = Tensor.weight(np.pad(bc, (0, pad))) if bq is not None else None
    return wq, bq, np.pad(np.broadcast_to(scale, n), (0, pad), mode="edge")


def _pixels_first(x: Dq, w: np.ndarray, k_axis: int) -> tuple[Tensor, np.ndarray] | None:
    """A matrix product whose input is a flattened (1, C, H, W) image reads it (widened to
    int32, minus its zero point) pixel by pixel, channels innermost, with the weight's K axis
    reordered to match: the same sums. The image is a channels-last conv or pool result
    (schedule/layout.py), so the kernel that computes and widens it stores whole vectors of
    channels, where the NCHW order scattered each lane 64 bytes apart (the QDQ CNN's max pool
    + flatten: 10,501 packets on HVX against 6,593 as scalar code)."""
    u = x.q.uop
    if u.op is not Ops.RESHAPE or len(u.src[0].shape) != 4 or len(x.q.shape) != 2:
        return None
    n, c, h, wd = u.src[0].shape
    if n != 1 or h * wd == 1 or w.shape[k_axis] != c * h * wd:
        return None
    order = np.arange(c * h * wd).reshape(c, h, wd).transpose(1, 2, 0).reshape(-1)
    xi = _int32(Dq(Tensor(u.src[0]), x.zp, x.scale, x.axis))
    return xi.permute((0, 2, 3, 1)).reshape(x.q.shape), np.take(w, order, axis=k_axis)


def _channels_kept(q: Tensor) -> Tensor | None:
    """The whole tensor when q is the first channels (axis 1) of a conv result padded to whole
    vectors (_whole_vectors, integer_requantize): its other channels hold the zero point."""
    u = q.uop
    if u.op is not Ops.SHRINK or len(u.shape) != 4:
        return None
    whole = u.src[0].shape
    if any(b != (0, n) for d, (b, n) in enumerate(zip(u.arg, whole)) if d != 1) \
            or u.arg[1][0] != 0:
        return None
    return Tensor(u.src[0])


def _int32(d: Dq) -> Tensor:
    """A per-tensor quantized value's integers minus its zero point, in int32."""
    zp = int(d.zp.reshape(-1)[0])
    return d.q.cast(dtypes.int32) - zp if zp else d.q.cast(dtypes.int32)


def _as_accumulator(ctx, acc: Tensor, scale: float, bound: int, y: Tensor | None = None,
            keep: int = 0) -> Tensor:
    """y (by default acc's float value), recorded as the int32 accumulator `acc` of one scale
    for a QuantizeLinear after it. |acc| <= bound: the accumulator is scaled up by a power of
    two while it stays below 2**30, which leaves the value unchanged and keeps the
    requantization's multiplier below 1/4, where it runs in int32 lanes (a 2x2 average pool
    requantized to its input's scale has a multiplier of exactly 1/4)."""
    k = max(0, min(16, 30 - int(bound).bit_length()))
    acc, scale = (acc * (1 << k), scale / (1 << k)) if k else (acc, scale)
    y = acc.cast(dtypes.float32) * float(scale) if y is None else y
    ctx.qdq[y.uop] = Acc(acc, np.array([scale]), 1, keep)
    return y


def _scale(d) -> float:
    return float(d.scale.reshape(-1)[0]) if _per_tensor8(d) and d.scale.reshape(-1)[0] > 0 else 0


def integer_sum(ctx, x: Tensor, fn, count: int):
    """An average (pool or global) of a dequantized int8 tensor: fn sums windows of the int32
    values minus the zero point (an explicit pad adds 0, the zero point's own value), and the
    division by `count` joins the scale, so the QuantizeLinear after it requantizes the exact
    sum once. None when x has no per-tensor int8 origin."""
    d = origin(ctx, x)
    if not _scale(d):
        return None
    return _as_accumulator(ctx, fn(_int32(d)), _scale(d) / count, 255 * count)


def integer_add(ctx, a: Tensor, b: Tensor, y: Tensor) -> None:
    """Add of two dequantized int8 tensors with their own scales: both rescaled to the larger
    scale s in Q20 fixed point, (a - za) * round(sa / s * 2**20) + (b - zb) * round(sb / s *
    2**20), an int32 accumulator of scale s / 2**20 (|acc| < 2**29) that the QuantizeLinear
    after it requantizes once, as QLinearAdd defines the result: round((sa (a - za) + sb (b -
    zb)) / sy) + zy. The rounded ratio adds at most 255 * 2**-21 of s to the value."""
    da, db = origin(ctx, a), origin(ctx, b)
    sa, sb = _scale(da), _scale(db)
    if not (sa and sb):
        return
    s = max(sa, sb)
    pa, pb = _channels_kept(da.q), _channels_kept(db.q)
    keep = 0
    if pa is not None and pb is not None and pa.shape == pb.shape and da.q.shape == db.q.shape:
        # both the first channels of padded results: add all of them (the padding stays zero)
        da, db = Dq(pa, da.zp, da.scale, da.axis), Dq(pb, db.zp, db.scale, db.axis)
        keep = y.shape[1]
    acc = _int32(da) * round(sa / s * 2 ** 20) + _int32(db) * round(sb / s * 2 ** 20)
    _as_accumulator(ctx, acc, s / 2 ** 20, 255 << 21, y, keep)


def integer_mul(ctx, a: Tensor, b: Tensor, y: Tensor) -> None:
    """Mul of two dequantized int8 tensors (either may broadcast): (a - za) * (b - zb) exactly
    in int32 (|product| <= 255**2), of scale sa * sb, which the QuantizeLinear after it
    requantizes once, as QLinearMul defines the result: round(sa sb (a - za)(b - zb) / sy) + zy."""
    da, db = origin(ctx, a), origin(ctx, b)
    sa, sb = _scale(da), _scale(db)
    if sa and sb:
        _as_accumulator(ctx, _int32(da) * _int32(db), sa * sb, 255 * 255, y)


def fixed_point(m: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """m = m0 * 2**-r with m0 a Q31 integer in [2**30, 2**31) and 1 <= r <= 62 (so an int32
    accumulator times m0 fits int64); None when some m is <= 0 or outside [2**-32, 2**30): such
    a layer keeps the float requantization."""
    frac, exp = np.frexp(m.astype(np.float64))
    m0 = np.round(frac * 2.0 ** 31).astype(np.int64)
    exp = np.where(m0 == 1 << 31, exp + 1, exp)
    m0 = np.where(m0 == 1 << 31, 1 << 30, m0)
    r = 31 - exp
    if np.any(m <= 0) or np.any(r < 1) or np.any(r > 62):
        return None
    return m0, r.astype(np.int64)


def integer_requantize(ctx, x: Tensor, scale: Tensor, zp: Tensor | None, out: DType):
    """QuantizeLinear of a recorded accumulator: round(acc * m) + zero point, saturated, with m
    as a fixed-point multiplier m0 and shift r, rounding half up: (acc * m0 + 2**(r-1)) >> r
    (half to even when m is a power of two). None when the output scale or zero point is not
    one constant, or m has no fixed-point form."""
    acc = ctx.qdq.get(x.uop)
    sy = ctx.constant(scale)
    zy = np.zeros(1) if zp is None else ctx.constant(zp)
    if not isinstance(acc, Acc) or sy is None or zy is None or sy.size != 1 or zy.size != 1:
        return None
    fp = fixed_point(acc.scale / float(sy.reshape(-1)[0]))
    if fp is None:
        return None
    m0, r = fp
    shape = [m0.size if d == acc.axis else 1 for d in range(acc.acc.ndim)]
    w = lambda v, dt: Tensor.weight(v.astype(dt).reshape(shape))  # noqa: E731
    j = int(r.reshape(-1)[0]) - 30  # m = 2**-j when m0 = 2**30
    if m0.size == 1 and m0.reshape(-1)[0] == 1 << 30 and 1 <= j <= 30:
        # an average pool requantized to its input's scale: exact halves are common (one sum
        # in two for a 2x2 pool), so they round to even, as onnxruntime's QuantizeLinear does
        a = acc.acc
        v = (a + ((1 << (j - 1)) - 1) + (a.shr(j) & 1)).shr(j)
    elif np.all(r > 32):
        # r = 32 + s, s >= 1: adding 2**(r-1) and shifting by r drops the product's low word,
        # (hi + 2**(s-1)) >> s with hi = (acc * m0) >> 32, exactly. All in int32 lanes, which
        # vectorize where int64 ones do not (HVX has no 64-bit lanes; clang scalarizes them)
        hi = acc.acc.mulhi(w(m0, np.int32)) if ctx.hvx else mulhi(acc.acc, m0, w)
        v = (hi + w(1 << (r - 33), np.int32)).shr(w(r - 32, np.int32))
    else:  # m >= 1/4: the low word rounds too
        v = acc.acc.cast(dtypes.int64) * w(m0, np.int64)
        v = (v + w(1 << (r - 1), np.int64)).shr(w(r, np.int64))
    v = v + int(zy.reshape(-1)[0])
    v = v.maximum(int(out.min)).minimum(int(out.max)).cast(out)
    if acc.keep:
        v = v.shrink([(0, acc.keep) if d == acc.axis else (0, s) for d, s in enumerate(v.shape)])
    return v


def mulhi(a: Tensor, m: np.ndarray, w) -> Tensor:
    """(a * m) >> 32 for int32 a and constants m in [2**30, 2**31), from 16-bit halves in
    int32 lanes (Hacker's Delight's mulhs): no partial product or sum leaves int32, and the
    one that needs 32 unsigned bits (low x low) is taken in uint32. w(values, numpy dtype)
    makes the per-channel constants."""
    a0, a1 = a & 0xFFFF, a.shr(16)
    m_lo, m_hi = m & 0xFFFF, m >> 16
    w0 = (a0.cast(dtypes.uint32) * w(m_lo, np.uint32)).shr(16).cast(dtypes.int32)
    t = a1 * w(m_lo, np.int32) + w0
    w1 = a0 * w(m_hi, np.int32) + (t & 0xFFFF)
    return a1 * w(m_hi, np.int32) + t.shr(16) + w1.shr(16)


def integer_window(ctx, x: Tensor, fn):
    """A max over windows of a dequantized int8 tensor, taken on the integers: dequantization
    with a positive scale is increasing, so max(DQ(q)) = DQ(max(q)). None when x has no
    per-tensor integer origin."""
    d = origin(ctx, x)
    if not isinstance(d, Dq) or d.q.dtype is dtypes.int32 or d.scale.size != 1 \
            or d.zp.size != 1 or not d.scale.reshape(-1)[0] > 0:
        return None
    q = fn(d.q)
    y = (q.cast(dtypes.float32) - float(d.zp.reshape(-1)[0])) * float(d.scale.reshape(-1)[0])
    ctx.qdq[y.uop] = Dq(q, d.zp, d.scale, d.axis)
    return y


def note_concat(ctx, y: Tensor, xs: list[Tensor], axis: int) -> None:
    """A Concat of DequantizeLinear outputs: a QuantizeLinear after it to the inputs' scale and
    zero point concatenates the integers instead of the floats (integer_rescale)."""
    parts = tuple(origin(ctx, x) for x in xs)
    if all(_per_tensor8(d) for d in parts):
        ctx.qdq[y.uop] = Cat(parts, axis)


def _per_tensor8(d) -> bool:
    return isinstance(d, Dq) and d.q.dtype in (dtypes.int8, dtypes.uint8) \
        and d.scale.size == 1 and d.zp.size == 1


def integer_rescale(ctx, x: Tensor, scale: Tensor, zp: Tensor | None, out: DType):
    """QuantizeLinear of a dequantized int8 tensor (or a Concat of them) back to the same scale,
    zero point and type: the integers themselves (the float round trip is exact for them).
    None otherwise: rescaling to another scale stays the float computation (in integers it
    vectorizes, but lowering it in every conv epilogue before a Concat made quantized
    squeezenet's compile 8x slower)."""
    d = origin(ctx, x)
    sy = ctx.constant(scale)
    zy = np.zeros(1, np.int64) if zp is None else ctx.constant(zp)
    if sy is None or zy is None or sy.size != 1 or zy.size != 1:
        return None
    parts = d.parts if isinstance(d, Cat) else (d,) if _per_tensor8(d) else ()
    same = all(np.float32(p.scale.reshape(-1)[0]) == np.float32(sy.reshape(-1)[0])
               and int(p.zp.reshape(-1)[0]) == int(zy.reshape(-1)[0]) and p.q.dtype is out
               for p in parts)
    if not parts or not same:
        return None
    return Tensor.cat([p.q for p in parts], d.axis) if isinstance(d, Cat) else parts[0].q
