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


def sin(x: UOp) -> UOp:
    """Reduce by pi/2 (two-part Cody-Waite constant), then sin/cos Taylor on |r| <= pi/4:
    float32 to degree 11/12 (next term 6e-12), float64 to 21/22."""
    dt = x.dtype
    k = _rint(x * (2 / math.pi))
    hi = float(UOp.const(math.pi / 2, dt).arg) if dt is dtypes.float32 else math.pi / 2
    r = x - k * hi - k * (math.pi / 2 - hi)
    r2 = r * r
    n = 6 if dt is dtypes.float32 else 11
    s = r * _poly(r2, [(-1) ** j / math.factorial(2 * j + 1) for j in range(n - 1, -1, -1)])
    c = _poly(r2, [(-1) ** j / math.factorial(2 * j) for j in range(n, -1, -1)])
    q = k.cast(F[dt]["int"]).alu(Ops.AND, UOp.const(3, F[dt]["int"]))
    q = q.cast(dtypes.index)
    out = q.eq(0).where(s, q.eq(1).where(c, q.eq(2).where(-s, -c)))
    return x.ne(x).where(x, out)


def trunc(x: UOp) -> UOp:
    """Through an integer cast where the value has a fraction; larger magnitudes are integers.
    A zero result keeps x's sign, as truncf does (trunc(-0.5) is -0.0)."""
    f = F[x.dtype]
    small = x.maximum(-x).lt(_c(2.0 ** f["mant"], x))
    t = x.cast(f["int"]).cast(x.dtype)
    return small.where(t.eq(_c(0, x)).where(x * _c(0, x), t), x)


def pow_(x: UOp, y: UOp) -> UOp:
    """x^y with IEEE pow's special cases that ONNX tests: negative base with integer exponent,
    zero base, y == 0 or x == 1 (1 even when the other operand is NaN)."""
    ax = x.lt(0).where(-x, x)
    mag = exp2(y * log2(ax))
    yint = UOp(Ops.TRUNC, y.dtype, (y,)).eq(y)
    odd = UOp(Ops.TRUNC, y.dtype, (y * 0.5,)).ne(y * 0.5).logical_and(yint)
    out = x.lt(0).logical_and(odd).where(-mag, mag)
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
    (UPat(Ops.TRUNC, name="x"), _float(trunc)),
    (UPat(Ops.POW, name="x"), pow_int),
    (UPat(Ops.RECIP, name="x"), lambda x: _c(1, x).alu(Ops.FDIV, x.src[0])),
])
