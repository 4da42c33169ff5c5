"""ONNX elementwise ops: math, comparisons, casts and activations.

Every function has the signature (ctx, inputs, attrs) -> Tensor | list[Tensor]; `inputs` holds
None for omitted optional inputs. Opset differences are handled inside the op that has them.
"""
from __future__ import annotations

import math

import numpy as np

from compiler.ir.dtypes import dtypes
from compiler.ir.tensor import Tensor
import compiler.onnx.ops.quant as quant
from compiler.onnx.registry import OPS, onnx_dtype, op


def _unary(fn):
    return lambda ctx, i, a: fn(i[0])


for _name, _fn in {
    "Relu": Tensor.relu, "Sigmoid": Tensor.sigmoid, "Tanh": Tensor.tanh, "Exp": Tensor.exp,
    "Log": Tensor.log, "Sqrt": Tensor.sqrt, "Neg": lambda x: -x, "Abs": Tensor.abs,
    "Reciprocal": Tensor.reciprocal, "Floor": Tensor.floor, "Ceil": Tensor.ceil,
    "Round": Tensor.round_even, "Sign": Tensor.sign, "Cos": Tensor.cos,
    "Sin": lambda x: x.sin().zero_signed_as(x),
    "Erf": Tensor.erf, "Not": Tensor.logical_not, "Identity": lambda x: x,
    "Softplus": lambda x: softplus(x), "Mish": lambda x: x * softplus(x).tanh(),
    "Tan": lambda x: (x.sin() / x.cos()).zero_signed_as(x), "IsNaN": lambda x: x.ne(x),
    "Atan": Tensor.atan, "Asin": Tensor.asin, "Acos": Tensor.acos,
    "Sinh": lambda x: _sinh(x), "Cosh": lambda x: _cosh(x),
    "Asinh": lambda x: _asinh(x), "Acosh": lambda x: _acosh(x), "Atanh": lambda x: _atanh(x),
    "BitwiseNot": lambda x: x ^ Tensor.full(-1 if x.dtype.kind == "i" else x.dtype.max, x.dtype),
}.items():
    OPS[_name] = _unary(_fn)


@op("IsInf")
def _isinf(ctx, i, a):
    x = i[0]
    none = Tensor.full(False, dtypes.bool, x.shape)
    pos = x.eq(math.inf) if a.get("detect_positive", 1) else none
    return pos | x.eq(-math.inf) if a.get("detect_negative", 1) else pos


def softplus(x: Tensor) -> Tensor:
    # log(1 + e^x) without overflow: max(x, 0) + log1p(e^-|x|)
    return x.relu() + _log1p((-x.abs()).exp())


def _log1p(t: Tensor, big: Tensor | None = None, a: Tensor | None = None) -> Tensor:
    """log(1 + t), accurate for tiny t: log(u) * t / (u - 1) with u = 1 + t rounded (no
    correction where u - 1 is t exactly, which keeps t = inf from becoming inf / inf).
    Where `big`, log(2a) = log(a) + ln 2 instead (2a may overflow), from the same one log."""
    u = t + 1.0
    ln = (u if big is None else big.where(a, u)).log()
    ratio = (u - 1.0).eq(t).where(1.0, t / (u - 1.0))
    out = u.eq(1.0).where(t, ln * ratio)
    return out if big is None else big.where(ln + math.log(2), out)


def _horner(x: Tensor, coeffs) -> Tensor:
    """The polynomial with `coeffs` (highest degree first) at x."""
    s = Tensor.full(coeffs[0], x.dtype, x.shape)
    for c in coeffs[1:]:
        s = s * x + c
    return s


def expm1(x: Tensor) -> Tensor:
    """e^x - 1 without its cancellation near 0: below |x| = 1/2 the Taylor series to x^9 (first
    omitted term 0.5^10 / 10! < 3e-10) in float32, to x^17 in float64. Zero goes through
    e^0 - 1 = +0, as onnxruntime's Selu and Celu of -0.0 are +0.0."""
    n = 17 if x.dtype is dtypes.float64 else 9
    s = _horner(x, [1 / math.factorial(k) for k in range(n, 0, -1)])
    return ((x.abs() < 0.5) & x.ne(0.0)).where(x * s, x.exp() - 1.0)


def _odd(x: Tensor, y: Tensor) -> Tensor:
    """y computed on |x|, given x's sign (a zero keeps x's, as libm's odd functions do)."""
    return (x < 0).where(-y, y).zero_signed_as(x)


def _big(x: Tensor) -> float:
    """From here on 1 + x^2 and x^2 - 1 round to x^2 (2 / sqrt(epsilon)), so sqrt(x^2 +- 1) is
    x and asinh, acosh are log(2x) to the type's precision."""
    return 2.0 / math.sqrt(float(np.finfo(x.dtype.np).eps))


def _exp_pair(a: Tensor, plus: bool) -> Tensor:
    """(e^a +- e^-a) / 2 for a >= 0. Near ln(max), e^a overflows where the result need not:
    from ln(max) - 1 on it is e^(a/2) * (e^(a/2) / 2), e^-a being under the result's ulp."""
    big = a > math.log(float(np.finfo(a.dtype.np).max)) - 1.0
    e = big.where(a * 0.5, a).exp()
    near = (e + (1.0 / e if plus else -1.0 / e)) * 0.5
    return big.where(e * 0.5 * e, near)


def _sinh(x: Tensor) -> Tensor:
    """Below |x| = 1, where e^x - e^-x cancels, the odd Taylor series to x^13 (first omitted
    term 1/15! < 1e-12)."""
    a = x.abs()
    s = _horner(a * a, [1 / math.factorial(2 * k + 1) for k in range(6, -1, -1)])
    return _odd(x, (a < 1.0).where(a * s, _exp_pair(a, plus=False)))


def _cosh(x: Tensor) -> Tensor:
    return _exp_pair(x.abs(), plus=True)


def _asinh(x: Tensor) -> Tensor:
    """log1p(a + a^2 / (1 + sqrt(1 + a^2))), a = |x|: no cancellation near 0 (asinh(1e-30) is
    1e-30); log(a) + ln 2 past _big, where a^2 would overflow."""
    a = x.abs()
    a2 = a * a
    return _odd(x, _log1p(a + a2 / ((a2 + 1.0).sqrt() + 1.0), a > _big(x), a))


def _acosh(x: Tensor) -> Tensor:
    """log1p(t), t = (x - 1) + sqrt((x - 1)(x + 1)): x - 1 is exact near 1, where log(x +
    sqrt(x^2 - 1)) lost the digits; log(x) + ln 2 past _big, where the product overflows (as it
    does for x < -_big: below 1 the answer is NaN, said outright)."""
    t = (x - 1.0) + ((x - 1.0) * (x + 1.0)).sqrt()
    return (x < 1.0).where(math.nan, _log1p(t, x > _big(x), x))


def _atanh(x: Tensor) -> Tensor:
    """log1p(2a / (1 - a)) / 2, a = |x|: atanh(1e-30) is 1e-30, 1 gives inf, above 1 NaN."""
    a = x.abs()
    return _odd(x, _log1p(a * 2.0 / (1.0 - a)) * 0.5)


def _binary(fn):
    return lambda ctx, i, a: fn(i[0], i[1])


def _quantizable(fn, integer):
    """A binary op whose QDQ form also records its integers, for a QuantizeLinear after it."""
    def build(ctx, i, a):
        y = fn(i[0], i[1])
        integer(ctx, i[0], i[1], y)
        return y
    return build


OPS["Add"] = _quantizable(Tensor.__add__, quant.integer_add)
OPS["Mul"] = _quantizable(Tensor.__mul__, quant.integer_mul)

for _name, _fn in {
    "Sub": Tensor.__sub__,
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
    # ONNX's defaults: the type's lowest and largest finite values (Clip(inf) is FLT_MAX)
    big = float(np.finfo(x.dtype.np).max) if x.dtype.is_float else None
    lo = i[1] if len(i) > 1 and i[1] is not None else a.get("min", big and -big)
    hi = i[2] if len(i) > 2 and i[2] is not None else a.get("max", big)
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
    return (x < 0).where(expm1(x) * a.get("alpha", 1.0), x)  # Elu(-0.0) is -0.0


@op("Selu")
def _selu(ctx, i, a):
    x = i[0]
    alpha = a.get("alpha", 1.67326319217681884765625)
    gamma = a.get("gamma", 1.05070102214813232421875)
    return (x > 0).where(x * gamma, expm1(x) * (alpha * gamma))


@op("Celu")
def _celu(ctx, i, a):
    x, alpha = i[0], a.get("alpha", 1.0)
    return x.relu() + expm1(x / alpha).minimum(0.0) * alpha


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
    return x * 0.5 * (x * (-1 / math.sqrt(2))).erfc()  # 1 + erf(x / sqrt 2) cancels below 0


@op("Softsign")
def _softsign(ctx, i, a):
    return i[0] / (i[0].abs() + 1.0)


@op("Shrink")
def _shrink(ctx, i, a):
    x, lambd, bias = i[0], a.get("lambd", 0.5), a.get("bias", 0.0)
    return (x < -lambd).where(x + bias, (x > lambd).where(x - bias, 0.0))
