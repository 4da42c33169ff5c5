"""Float math lowered to +, *, compares and bit casts, so kernels need no libm on any target.

Accuracy targets: float32 results within ~2 ulp of the correctly rounded value on the reduced
range; float64 within a few ulp. Polynomials are truncated Taylor/atanh series whose first omitted
term is below the type's epsilon on the reduced interval (bounds are in each docstring).
"""
from __future__ import annotations

import decimal
import functools
import math
from decimal import Decimal

import numpy as np

from compiler.ir.dtypes import dtypes
from compiler.ir.rewrite import PatternMatcher, UPat
from compiler.ir.uop import Ops, UOp

FLOATS = (dtypes.float32, dtypes.float64)
F = {dtypes.float32: dict(int=dtypes.int32, uint=dtypes.uint32, mant=23, bias=127),
     dtypes.float64: dict(int=dtypes.int64, uint=dtypes.uint64, mant=52, bias=1023)}


def _c(v, like: UOp) -> UOp:
    return UOp.const(v, like.dtype)


def _poly(x: UOp, coeffs) -> UOp:
    """Horner: coeffs from highest degree to constant."""
    acc = _c(coeffs[0], x)
    for c in coeffs[1:]:
        acc = acc * x + _c(c, x)
    return acc


def _magic(x: UOp) -> UOp:
    """1.5 * 2^mantissa: adding it to |v| < 2^(mantissa-1) rounds away v's fraction (to nearest
    even) and leaves rint(v) in the sum's low mantissa bits."""
    return _c(1.5 * 2.0 ** F[x.dtype]["mant"], x)


def _rint(x: UOp) -> UOp:
    """Round to nearest even by adding and subtracting the magic constant (2 ops). Exact for
    |x| < 2^(mantissa-1); larger floats are already integers, which the select keeps."""
    magic = _magic(x)
    r = (x + magic) - magic
    return x.maximum(-x).lt(_c(2.0 ** (F[x.dtype]["mant"] - 1), x)).where(r, x)


@functools.cache
def _normal_range(dt, ln: bool) -> tuple[float, float]:
    """[lo, hi]: the `dt` values x whose e^x (2^x unless `ln`) is a normal float. The edges are
    found in 40-digit decimal and stepped inwards, so no rounding carries one across."""
    info = np.finfo(dt.np)
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        scale = 1 if ln else Decimal(2).ln()
        edges = [Decimal(float(v)).ln() / scale for v in (info.tiny, info.max)]

    def inward(edge: Decimal, way: int) -> float:
        v = dt.np.type(float(edge))
        return float(v if way * (Decimal(float(v)) - edge) >= 0 else
                     np.nextafter(v, dt.np.type(way * np.inf)))
    return inward(edges[0], 1), inward(edges[1], -1)


# n ln 2 with ln 2 split in two (Cody-Waite): n * hi is exact for every n an exponent can reach
LN2_SPLIT = {dtypes.float32: (0.693359375, -2.12194440e-4),
             dtypes.float64: (6.93147180369123816490e-01, 1.90821492927058770002e-10)}


def _exp(x: UOp, ln: bool) -> UOp:
    """e^x (2^x unless `ln`) = 2^n * e^r, n = rint(x / ln 2), |r| <= ln2 / 2: Taylor of e^r to
    degree 7 for float32 (first omitted term 0.347^8/8! = 5e-9), 13 for float64 (4e-18).
    For e^x, r = x - n ln2 with the split ln 2, so r keeps full precision (x * log2e would lose
    ~1e-6 relative at |x| ~ 20). 2^n is added straight into e^r's exponent bits, which is right
    for every x whose result is normal; outside that range the result is inf above, and 0 below:
    subnormal results flush to zero, an absolute error under the smallest normal float (as on
    GPUs and in flush-to-zero SIMD code)."""
    dt, f = x.dtype, F[x.dtype]
    lo, hi = _normal_range(dt, ln)
    # x outside [lo, hi] computes garbage below, then is selected away: only bit casts, no
    # float-to-int conversion that could overflow, so no clamp is needed
    under, over = x.lt(_c(lo, x)), _c(hi, x).lt(x)
    # rint by the magic constant: n lands in t's low mantissa bits
    magic = _magic(x)
    t = x * (1 / math.log(2) if ln else 1.0) + magic
    nf = t - magic
    if ln:
        ln2_hi, ln2_lo = LN2_SPLIT[dt]
        r = (x - nf * ln2_hi) - nf * ln2_lo
    else:
        r = (x - nf) * math.log(2)
    p = _poly(r, [1 / math.factorial(k) for k in range(7 if dt is dtypes.float32 else 13, -1, -1)])
    # unsigned: t's bits shifted left leave n * 2^mantissa modulo the word, negative n included
    u = f["uint"]
    shift = UOp.const(f["mant"], u)
    bits = UOp(Ops.BITCAST, u, (p,)) + UOp(Ops.BITCAST, u, (t,)).alu(Ops.SHL, shift)
    out = over.where(_c(math.inf, x), under.where(_c(0, x), UOp(Ops.BITCAST, dt, (bits,))))
    return x.ne(x).where(x, out)  # a NaN's payload bits would shift into the exponent


def exp2(x: UOp) -> UOp:
    return _exp(x, ln=False)


def exp(x: UOp) -> UOp:
    return _exp(x, ln=True)


def log2(x: UOp) -> UOp:
    """log2(x) = e + log2(m), m in [sqrt(1/2), sqrt(2)); log(m) = 2 atanh(t), t = (m-1)/(m+1),
    |t| <= 0.1716: series to t^9 (next term 4e-10) for float32, to t^21 for float64."""
    dt, f = x.dtype, F[x.dtype]
    it = f["int"]
    tiny = x.lt(_c(2.0 ** (1 - f["bias"]), x))
    xs = tiny.where(x * _c(2.0 ** f["mant"], x), x)  # lift subnormals into the normal range
    bits = UOp(Ops.BITCAST, it, (xs,))
    e = bits.alu(Ops.SHR, UOp.const(f["mant"], it)) - f["bias"]
    e = tiny.where(e - f["mant"], e)
    mbits = bits.alu(Ops.AND, UOp.const((1 << f["mant"]) - 1, it)).alu(
        Ops.OR, UOp.const(f["bias"] << f["mant"], it))
    m = UOp(Ops.BITCAST, dt, (mbits,))
    big = (_c(math.sqrt(2), m)).lt(m)
    m = big.where(m * 0.5, m)
    e = big.where(e + 1, e).cast(dt)
    t = (m - 1.0).alu(Ops.FDIV, m + 1.0)
    t2 = t * t
    terms = 5 if dt is dtypes.float32 else 11
    s = _poly(t2, [1 / (2 * k + 1) for k in range(terms - 1, -1, -1)])
    out = e + t * s * (2 / math.log(2))
    out = x.lt(_c(0, x)).where(_c(math.nan, x), out)
    out = x.eq(_c(0, x)).where(_c(-math.inf, x), out)
    out = x.eq(_c(math.inf, x)).where(x, out)
    return x.ne(x).where(x, out)


# 2/pi's first 224 bits after the binary point, in 32-bit words: enough for the float32
# Payne-Hanek reduction at every exponent
TWO_OVER_PI = (0xA2F9836E, 0x4E441529, 0xFC2757D1, 0xF534DDC0, 0xDB629599, 0x3C439041, 0xFE5163AB)
# pi/2 in three float64 parts (fdlibm's pio2_1, pio2_2, pio2_2t): the first two have 33 bits, so
# k times them is exact for k < 2^20
PIO2_PARTS64 = (1.57079632673412561417e+00, 6.07710050630396597660e-11, 2.02226624879595063154e-21)


def _u32(v: int) -> UOp:
    return UOp.const(v, dtypes.uint32)


def _table_word(idx: UOp, k: int) -> UOp:
    """(0, *TWO_OVER_PI)[idx + k] for idx in 0..4, as selects: vector lanes stay lanes."""
    table = (0,) + TWO_OVER_PI
    out = _u32(table[k])
    for j in range(1, 5):
        out = idx.eq(_u32(j)).where(_u32(table[j + k]), out)
    return out


def _mul_wide(m: UOp, w: UOp) -> tuple[UOp, UOp]:
    """The exact product of uint32 m < 2^24 and w as (high, low) words: the signed high word
    (Ops.MULHI) corrected for w's top bit, which the signed product read as -2^32."""
    i32 = dtypes.int32
    mi, wi = UOp(Ops.BITCAST, i32, (m,)), UOp(Ops.BITCAST, i32, (w,))
    hi = mi.alu(Ops.MULHI, wi) + wi.lt(UOp.const(0, i32)).where(mi, UOp.const(0, i32))
    return UOp(Ops.BITCAST, dtypes.uint32, (hi,)), m * w


def _reduce32(a: UOp) -> tuple[UOp, UOp]:
    """Payne-Hanek: float32 a >= 2^-7 (finite) as q = rint(a * 2/pi) mod 4 (uint32) and
    r = a - q pi/2 in radians, |r| <= pi/4. With a = m 2^(e-150), m a 24-bit integer, the bits of
    2/pi before bit e-120 only add multiples of 4 quarter turns and those 96 bits after it less
    than 2^-71 of one, so m times that 96-bit window, in 32-bit words, gives q and r to 2^-62
    quarter turns. No float32 lies closer than 2^-29.86 quarter turns to a multiple of pi/2
    (16367173 * 2^72, found by trying every float32 >= 2^-7), so that is 2^-32 of r at worst:
    float32 rounding is the only error, at every exponent."""
    u = dtypes.uint32
    bits = UOp(Ops.BITCAST, u, (a,))
    m = bits.alu(Ops.AND, _u32(0x7FFFFF)).alu(Ops.OR, _u32(0x800000))
    p = bits.alu(Ops.SHR, _u32(23)) - _u32(120)  # window start in (32 zero bits, 2/pi)
    idx, sh = p.alu(Ops.SHR, _u32(5)), p.alu(Ops.AND, _u32(31))
    t = [_table_word(idx, k) for k in range(4)]
    # (t >> 1) >> (31 - sh): both shifts stay under 32 (a shift by 32 is undefined in C)
    w = [t[k].alu(Ops.SHL, sh).alu(
        Ops.OR, t[k + 1].alu(Ops.SHR, _u32(1)).alu(Ops.SHR, _u32(31) - sh)) for k in range(3)]
    (_, l0), (h1, l1), (h2, _) = (_mul_wide(m, wk) for wk in w)  # the rest is unused
    limb1 = l1 + h2
    carry = limb1.lt(h2).where(_u32(1), _u32(0))
    # quarter turns: bit 30 of the third word weighs 1; adding a half rounds q to nearest
    limb2 = l0 + h1 + carry + _u32(1 << 29)
    q = limb2.alu(Ops.SHR, _u32(30))
    f32, i32 = dtypes.float32, dtypes.int32

    def part(v: UOp, scale: float) -> UOp:  # an integer under 2^31 times a power of two
        return UOp(Ops.BITCAST, i32, (v,)).cast(f32) * UOp.const(scale, f32)
    frac = UOp(Ops.BITCAST, i32, (limb2.alu(Ops.AND, _u32((1 << 30) - 1)),)) - (1 << 29)
    # frac is exact in float32 below 2^24, above it its top 22 bits are (the rest joins the
    # low words, far smaller): the only roundings are the last multiply-add's
    exact = frac.maximum(-frac).lt(UOp.const(1 << 24, i32))
    top = exact.where(frac, frac.alu(Ops.AND, UOp.const(-256, i32)))
    low = (part(frac - top, 2.0 ** -30) + part(limb1.alu(Ops.SHR, _u32(8)), 2.0 ** -54)
           + part(limb1.alu(Ops.AND, _u32(255)), 2.0 ** -62))
    hi = float(np.float32(math.pi / 2))
    turns = part(top, 2.0 ** -30)
    return q, turns * hi + (turns * (math.pi / 2 - hi) + low * (math.pi / 2))


def _reduce64(a: UOp) -> tuple[UOp, UOp]:
    """Cody-Waite with pi/2 in three parts: exact products for a < 2^20 pi/2 (float64 sin of
    larger arguments loses accuracy: docs/reliability.md)."""
    k = _rint(a * (2 / math.pi))
    p1, p2, p3 = PIO2_PARTS64
    r = ((a - k * p1) - k * p2) - k * p3
    return k.cast(dtypes.int64).alu(Ops.AND, UOp.const(3, dtypes.int64)).cast(dtypes.uint32), r


def _sin_cos(x: UOp, quarter: int) -> UOp:
    """sin(x + quarter pi/2): reduce |x| to q quarter turns and |r| <= pi/4, then sin/cos Taylor
    on r: float32 to degree 11/12 (next term 6e-12), float64 to 21/22. cos is quarter = 1, not
    sin(x + pi/2), whose rounded sum is off by up to half an ulp of x near cos's zeros."""
    dt = x.dtype
    a = x.maximum(-x)
    if dt is dtypes.float32:
        q, r = _reduce32(a)
        tiny = a.lt(_c(2.0 ** -7, a))  # below the window's reach, and needing no reduction
        q, r = tiny.where(_u32(0), q), tiny.where(a, r)
    else:
        q, r = _reduce64(a)
    q = (q + _u32(quarter)).alu(Ops.AND, _u32(3))
    r2 = r * r
    n = 6 if dt is dtypes.float32 else 11
    s = r * _poly(r2, [(-1) ** j / math.factorial(2 * j + 1) for j in range(n - 1, -1, -1)])
    c = _poly(r2, [(-1) ** j / math.factorial(2 * j) for j in range(n, -1, -1)])
    out = q.eq(_u32(0)).where(s, q.eq(_u32(1)).where(c, q.eq(_u32(2)).where(-s, -c)))
    if quarter == 0:  # sin is odd
        out = x.lt(_c(0, x)).where(-out, out)
    out = a.eq(_c(math.inf, x)).where(_c(math.nan, x), out)
    return x.ne(x).where(x, out)


def sin(x: UOp) -> UOp:
    return _sin_cos(x, 0)


def cos(x: UOp) -> UOp:
    return _sin_cos(x, 1)


def trunc(x: UOp) -> UOp:
    """Through an integer cast where the value has a fraction; larger magnitudes are integers.
    A zero result keeps x's sign, as truncf does (trunc(-0.5) is -0.0)."""
    f = F[x.dtype]
    small = x.maximum(-x).lt(_c(2.0 ** f["mant"], x))
    t = x.cast(f["int"]).cast(x.dtype)
    return small.where(t.eq(_c(0, x)).where(x * _c(0, x), t), x)


def pow_(x: UOp, y: UOp) -> UOp:
    """x^y with IEEE pow's special cases that ONNX tests: negative base with integer exponent,
    zero base (-0.0 to an odd negative power is -inf: the sign bit decides, not x < 0),
    y == 0 or x == 1 (1 even when the other operand is NaN), (-1)^+-inf = 1."""
    ax = x.lt(0).where(-x, x)
    mag = ax.eq(_c(1, x)).logical_and(y.eq(y)).where(_c(1, x), exp2(y * log2(ax)))  # 0 * inf
    yint = UOp(Ops.TRUNC, y.dtype, (y,)).eq(y)
    odd = UOp(Ops.TRUNC, y.dtype, (y * 0.5,)).ne(y * 0.5).logical_and(yint)
    it = F[x.dtype]["int"]
    signed = UOp(Ops.BITCAST, it, (x,)).lt(UOp.const(0, it))
    out = signed.logical_and(odd).where(-mag, mag)
    nan = x.lt(0).logical_and(yint.logical_not()).logical_and(x.ne(_c(-math.inf, x)))
    out = nan.where(_c(math.nan, x), out)  # (-inf)^y is +-0 or +-inf, not NaN
    return y.eq(_c(0, y)).alu(Ops.OR, x.eq(_c(1, x))).where(_c(1, x), out)


def _float(fn):
    return lambda x: fn(x.src[0]) if x.dtype in FLOATS else None


def pow_int(x: UOp) -> UOp | None:
    a, b = x.src
    if x.dtype.is_float:
        return pow_(a, b) if x.dtype in FLOATS else None
    wide = pow_(a.cast(dtypes.float64), b.cast(dtypes.float64))
    return _rint(wide).cast(x.dtype)


transcendental_rules = PatternMatcher([
    (UPat(Ops.EXP2, name="x"), _float(exp2)),
    (UPat(Ops.EXP, name="x"), _float(exp)),
    (UPat(Ops.LOG2, name="x"), _float(log2)),
    (UPat(Ops.SIN, name="x"), _float(sin)),
    (UPat(Ops.COS, name="x"), _float(cos)),
    (UPat(Ops.TRUNC, name="x"), _float(trunc)),
    (UPat(Ops.POW, name="x"), pow_int),
    (UPat(Ops.RECIP, name="x"), lambda x: _c(1, x).alu(Ops.FDIV, x.src[0])),
])
