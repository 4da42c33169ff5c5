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
    "Softplus": lambda x: _softplus(x), "Mish": lambda x: x * _softplus(x).tanh(),
    "Tan": lambda x: (x.sin() / x.cos()).zero_signed_as(x), "IsNaN": lambda x: x.ne(x),
    "Atan": Tensor.atan, "Asin": Tensor.asin, "Acos": Tensor.acos,
    "Sinh": lambda x: ((x.exp() - (-x).exp()) * 0.5).zero_signed_as(x),
    "Cosh": lambda x: (x.exp() + (-x).exp()) * 0.5,
    "Asinh": lambda x: (x.sign() * (x.abs() + (x * x + 1.0).sqrt()).log()).zero_signed_as(x),
    "Acosh": lambda x: (x + (x * x - 1.0).sqrt()).log(),
    "Atanh": lambda x: (((1.0 + x) / (1.0 - x)).log() * 0.5).zero_signed_as(x),
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
    return (x < 0).where((x.exp() - 1.0) * a.get("alpha", 1.0), x)  # Elu(-0.0) is -0.0


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
