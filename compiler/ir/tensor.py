"""Tensor-level building blocks: broadcasting, movement, reductions and the composite ops
(matmul, conv, pooling, activations) written in terms of UOp primitives.

The ONNX frontend maps each node onto these; nothing here knows about ONNX.
"""
from __future__ import annotations

import math

import numpy as np

from compiler.ir.dtypes import DType, dtypes
from compiler.ir.uop import Ops, UOp, Weight, reduce_identity

LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
# tanh(x) = x * sum c_k x^2k
# a float's bits as an integer, and the mask that clears the low half of its mantissa
F_INT = {dtypes.float32: (dtypes.int32, -(1 << 12)), dtypes.float64: (dtypes.int64, -(1 << 26))}
TANH_SERIES = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075,
               -929569 / 638512875, 6404582 / 10854718875)


class Tensor:
    __slots__ = ("uop",)

    def __init__(self, uop: UOp):
        self.uop = uop

    # ---- construction ---------------------------------------------------------------------
    @staticmethod
    def input(name: str, shape, dtype: DType) -> Tensor:
        return Tensor(UOp(Ops.INPUT, dtype, (), (name, tuple(shape))))

    @staticmethod
    def weight(data: np.ndarray) -> Tensor:
        data = np.asarray(data)
        if data.size == 1:  # scalars broadcast as constants: they fold and render as literals
            return Tensor.full(data.reshape(()).item(), dtypes.from_np(data.dtype), data.shape)
        return Tensor(UOp(Ops.WEIGHT, dtypes.from_np(data.dtype), (), Weight(data)))

    @staticmethod
    def full(value, dtype: DType, shape=()) -> Tensor:
        t = Tensor(UOp.const(value, dtype))
        return t.reshape((1,) * len(shape)).expand(shape) if shape else t

    def const_like(self, value, dtype: DType | None = None) -> Tensor:
        return Tensor.full(value, dtype or self.dtype, self.shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.uop.shape

    @property
    def dtype(self) -> DType:
        return self.uop.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _mv(self, op: Ops, arg) -> Tensor:
        return Tensor(UOp(op, self.dtype, (self.uop,), arg))

    # ---- movement -------------------------------------------------------------------------
    def reshape(self, shape) -> Tensor:
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != self.uop.size:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return self if shape == self.shape else self._mv(Ops.RESHAPE, shape)

    def permute(self, order) -> Tensor:
        order = tuple(int(o) + self.ndim if int(o) < 0 else int(o) for o in order)
        if sorted(order) != list(range(self.ndim)):
            raise ValueError(f"{list(order)} is not a permutation of {self.ndim} axes")
        return self if order == tuple(range(self.ndim)) else self._mv(Ops.PERMUTE, order)

    def expand(self, shape) -> Tensor:
        shape = tuple(int(s) for s in shape)
        if len(shape) != self.ndim:
            return self.reshape((1,) * (len(shape) - self.ndim) + self.shape).expand(shape)
        for have, want in zip(self.shape, shape):
            if have != want and have != 1:
                raise ValueError(f"cannot expand {self.shape} to {shape}")
        return self if shape == self.shape else self._mv(Ops.EXPAND, shape)

    def pad(self, pads, value=0.0) -> Tensor:
        pads = tuple((int(b), int(a)) for b, a in pads)
        if any(b < 0 or a < 0 for b, a in pads):  # negative padding crops
            crop = tuple((max(-b, 0), s - max(-a, 0)) for (b, a), s in zip(pads, self.shape))
            return self.shrink(crop).pad(tuple((max(b, 0), max(a, 0)) for b, a in pads), value)
        if all(p == (0, 0) for p in pads):
            return self
        return self._mv(Ops.PAD, (pads, value))

    def shrink(self, bounds) -> Tensor:
        bounds = tuple((int(b), int(e)) for b, e in bounds)
        if bounds == tuple((0, s) for s in self.shape):
            return self
        return self._mv(Ops.SHRINK, bounds)

    def flip(self, axes) -> Tensor:
        axes = tuple(sorted(a % self.ndim for a in axes if self.shape[a % self.ndim] > 1))
        return self._mv(Ops.FLIP, axes) if axes else self

    def window(self, kernel, strides, dilations) -> Tensor:
        return self._mv(Ops.WINDOW, (tuple(kernel), tuple(strides), tuple(dilations)))

    def gather(self, indices: Tensor, axis: int) -> Tensor:
        return Tensor(UOp(Ops.GATHER, self.dtype, (self.uop, indices.uop), axis % self.ndim))

    def transpose(self, a: int = -2, b: int = -1) -> Tensor:
        order = list(range(self.ndim))
        order[a], order[b] = order[b], order[a]
        return self.permute(order)

    def unsqueeze(self, axis: int) -> Tensor:
        axis = axis % (self.ndim + 1)
        return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])

    def flatten(self, axis: int = 1) -> Tensor:
        return self.reshape((math.prod(self.shape[:axis]), math.prod(self.shape[axis:])))

    def slice(self, starts, ends, axes, steps) -> Tensor:
        """ONNX Slice semantics: clamped bounds, negative indices and negative steps."""
        bounds = [(0, s) for s in self.shape]
        strides = [1] * self.ndim
        flips = []
        for st, en, ax, step in zip(starts, ends, axes, steps):
            ax, n = ax % self.ndim, self.shape[ax % self.ndim]
            if step > 0:
                st = min(max(st + n if st < 0 else st, 0), n)
                en = min(max(en + n if en < 0 else en, 0), n)
                bounds[ax], strides[ax] = (st, max(st, en)), step
            else:  # walk backwards: flip, then it is a forward slice
                # ONNX clamps a backward start into [0, n-1] and its end into [-1, n-1]
                st = min(max(st + n if st < 0 else st, 0), n - 1)
                en = min(max(en + n if en < 0 else en, -1), n - 1)
                bounds[ax], strides[ax] = (n - 1 - st, max(n - 1 - st, n - 1 - en)), -step
                flips.append(ax)
        t = self.flip(flips) if flips else self
        t = t.shrink(bounds)
        if any(s != 1 for s in strides):
            t = t.stride(strides)
        return t

    def stride(self, strides) -> Tensor:
        """Every k-th element per axis: a 1-wide WINDOW with that stride."""
        out = tuple((s - 1) // k + 1 if s else 0 for s, k in zip(self.shape, strides))
        if 0 in out:
            return Tensor.full(0, self.dtype, out)
        return self.window((1,) * self.ndim, strides, (1,) * self.ndim).reshape(out)

    @staticmethod
    def cat(tensors: list[Tensor], axis: int) -> Tensor:
        """Concat as a sum of zero-padded views: one fused kernel with masked loads."""
        axis = axis % tensors[0].ndim
        tensors = [t for t in tensors if t.shape[axis] > 0]
        total, at, out = sum(t.shape[axis] for t in tensors), 0, None
        for t in tensors:
            pads = [(0, 0)] * t.ndim
            pads[axis] = (at, total - at - t.shape[axis])
            at += t.shape[axis]
            p = t.pad(pads, False if t.dtype is dtypes.bool else 0)
            out = p if out is None else (out | p if t.dtype is dtypes.bool else out + p)
        return out

    # ---- elementwise ----------------------------------------------------------------------
    def _lift(self, x) -> Tensor:
        return x if isinstance(x, Tensor) else Tensor.full(x, self.dtype)

    def _bin(self, op: Ops, other) -> Tensor:
        a, b = broadcast(self, self._lift(other))
        out = dtypes.bool if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE) else a.dtype
        return Tensor(UOp(op, out, (a.uop, b.uop)))

    def _un(self, op: Ops) -> Tensor:
        return Tensor(UOp(op, self.dtype, (self.uop,)))

    def __add__(self, x): return self._bin(Ops.ADD, x)
    def __radd__(self, x): return self._lift(x)._bin(Ops.ADD, self)
    def __rsub__(self, x): return self._lift(x)._bin(Ops.SUB, self)
    def __rmul__(self, x): return self._lift(x)._bin(Ops.MUL, self)
    def __rtruediv__(self, x): return self._lift(x) / self
    def __sub__(self, x): return self._bin(Ops.SUB, x)
    def __mul__(self, x): return self._bin(Ops.MUL, x)
    def __truediv__(self, x): return self._bin(Ops.FDIV if self.dtype.is_float else Ops.IDIV, x)
    def __mod__(self, x): return self._bin(Ops.MOD, x)
    def __neg__(self): return self._un(Ops.NEG)
    def __and__(self, x): return self._bin(Ops.AND, x)
    def __or__(self, x): return self._bin(Ops.OR, x)
    def __xor__(self, x): return self._bin(Ops.XOR, x)
    def __lt__(self, x): return self._bin(Ops.CMPLT, x)
    def __gt__(self, x): return self._lift(x)._bin(Ops.CMPLT, self)
    def eq(self, x): return self._bin(Ops.CMPEQ, x)
    def ne(self, x): return self._bin(Ops.CMPNE, x)
    def __le__(self, x): return self._lift(x) >= self

    def __ge__(self, x):
        """For floats `not (self < x)` would be true when either is NaN; IEEE says false."""
        x = self._lift(x)
        return (x < self) | self.eq(x) if self.dtype.is_float else (self < x).logical_not()

    def logical_not(self): return self.ne(True) if self.dtype is dtypes.bool else self.eq(0)
    def maximum(self, x): return self._bin(Ops.MAX, x)
    def minimum(self, x): return self._bin(Ops.MIN, x)
    def shl(self, x): return self._bin(Ops.SHL, x)
    def shr(self, x): return self._bin(Ops.SHR, x)
    def pow(self, x): return self._bin(Ops.POW, x)

    def where(self, a, b) -> Tensor:
        a = a if isinstance(a, Tensor) else Tensor.full(a, b.dtype if isinstance(b, Tensor) else dtypes.float32)
        b = b if isinstance(b, Tensor) else Tensor.full(b, a.dtype)
        c, a, b = broadcast(self, a, b)
        return Tensor(UOp(Ops.WHERE, a.dtype, (c.uop, a.uop, b.uop)))

    def cast(self, dtype: DType) -> Tensor:
        return self if dtype == self.dtype else Tensor(UOp(Ops.CAST, dtype, (self.uop,)))

    def bitcast(self, dtype: DType) -> Tensor:
        return Tensor(UOp(Ops.BITCAST, dtype, (self.uop,)))

    # float math, composed from EXP2/LOG2/SIN/SQRT which lower to polynomials per target
    def exp(self): return self._un(Ops.EXP)
    def log(self): return self._un(Ops.LOG2) * LN2
    def sqrt(self): return self._un(Ops.SQRT)
    def sin(self): return self._un(Ops.SIN)
    def cos(self): return self._un(Ops.COS)
    def reciprocal(self): return self._un(Ops.RECIP)
    def trunc(self): return self._un(Ops.TRUNC)
    def abs(self):  # 0 - x: fabs(-0.0) is +0.0
        return (self > 0).where(self, 0.0 - self) if self.dtype.is_float else \
            (self < 0).where(-self, self)

    def zero_signed_as(self, x):
        """Where self is zero, a zero with x's sign: an odd function maps -0.0 to -0.0 (libm,
        onnxruntime). Floats only; x * 0.0 is never folded (-0.0 * 0.0 is -0.0)."""
        return self.eq(0.0).where(x * 0.0, self) if self.dtype.is_float else self
    def relu(self): return self.maximum(0.0 if self.dtype.is_float else 0)  # NaN stays NaN

    def sign(self):
        s = (self > 0).cast(self.dtype) - (self < 0).cast(self.dtype)
        return self.ne(self).where(self, s) if self.dtype.is_float else s  # NaN stays NaN
    def sigmoid(self): return (1.0 + (-self).exp()).reciprocal()
    def silu(self): return self * self.sigmoid()

    def floor(self):
        t = self.trunc()
        return (self < t).where(t - 1.0, t)

    def ceil(self):
        t = self.trunc()
        return (self > t).where(t + 1.0, t)

    def round_even(self):
        """Round half to even (ONNX Round, numpy rint)."""
        f = (self + 0.5).floor()
        tie = (f - self).eq(0.5)
        odd = (f * 0.5).floor().ne(f * 0.5)
        return (tie & odd).where(f - 1.0, f).zero_signed_as(self)

    def tanh(self):
        """(1 - e) / (1 + e) with e = exp(-2|x|); below |x| = 1/8, where 1 - e cancels, the odd
        Taylor series (first omitted term < 1e-16 relative)."""
        a = self.abs()
        e = (a * -2.0).exp()
        t = (1.0 - e) / (1.0 + e)
        x2, s = self * self, None
        for c in TANH_SERIES[::-1]:
            s = Tensor.full(c, self.dtype, self.shape) if s is None else s * x2 + c
        t = (a < 0.125).where(a * s, t)
        return (self < 0).where(-t, t).zero_signed_as(self)

    def atan(self):
        """Reduce |x| to [0, tan(pi/8)] with atan(x) = pi/2 - atan(1/x) and
        atan(t) = pi/4 + atan((t-1)/(t+1)), then the odd series; first omitted term
        0.4142^(2n+1)/(2n+1) is 4e-10 for float32 (n=11), 6e-18 for float64 (n=22)."""
        a = self.abs()
        inv = a > 1.0
        t = inv.where(a.reciprocal(), a)
        big = t > 0.41421356237309503
        u = big.where((t - 1.0) / (t + 1.0), t)
        u2, s = u * u, None
        for k in range(22 if self.dtype is dtypes.float64 else 11, -1, -1):
            c = (-1.0) ** k / (2 * k + 1)
            s = Tensor.full(c, self.dtype, u.shape) if s is None else s * u2 + c
        r = big.where(u * s + math.pi / 4, u * s)
        r = inv.where(math.pi / 2 - r, r)
        return (self < 0).where(-r, r).zero_signed_as(self)

    def asin(self):
        return (self / ((1.0 - self) * (1.0 + self)).sqrt()).atan()

    def acos(self):
        return ((1.0 - self) / (1.0 + self)).sqrt().atan() * 2.0

    def _erf_parts(self):
        """(|x|, erf(|x|) by its Taylor series, t and the exponent p - x^2 of Numerical Recipes'
        Chebyshev fit erfc(|x|) = t e^(p - x^2) (fractional error < 1.2e-7)): the series where
        erf is small (relative accuracy near 0), the fit where erfc is."""
        a = self.abs()
        t = (a * 0.5 + 1.0).reciprocal()
        poly = t * 0.0
        for c in (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806,
                  0.09678418, 0.37409196, 1.00002368, -1.26551223):
            poly = poly * t + c
        x2, term, near = a * a, a, a
        for k in range(1, 7):  # erf(x) = 2/sqrt(pi) * sum (-1)^k x^(2k+1) / (k! (2k+1))
            term = term * x2 * (-1.0 / k)
            near = near + term * (1.0 / (2 * k + 1))
        return a, near * 1.1283791670955126, t, poly

    def erf(self):
        a, near, t, poly = self._erf_parts()
        r = (a < 0.5).where(near, 1.0 - t * (poly - a * a).exp())
        return (self < 0).where(-r, r).zero_signed_as(self)

    def erfc(self):
        """1 - erf(x), relative to its own size (Gelu of negative x, where 1 + erf cancels).
        In the tail x^2 is split as h^2 + (x - h)(x + h), h = x with its low mantissa half
        cleared, so h^2 is exact: e^(p - x^2) as one exp would carry x^2's rounding, an ulp of
        x^2 ~ 80, as a relative error of 4e-6."""
        a, near, t, poly = self._erf_parts()
        f = F_INT[self.dtype]
        h = (a.bitcast(f[0]) & f[1]).bitcast(self.dtype)
        tail = t * (-(h * h)).exp() * (poly - (a - h) * (a + h)).exp()
        tail = a.eq(math.inf).where(0.0, tail)  # inf - inf
        return (a < 0.5).where(1.0 - (self < 0).where(-near, near),
                               (self < 0).where(2.0 - tail, tail))

    # ---- reductions -----------------------------------------------------------------------
    def reduce(self, op: Ops, axes=None, keepdims: bool = True) -> Tensor:
        axes = tuple(range(self.ndim)) if axes is None else tuple(sorted({a % self.ndim for a in axes}))
        work = tuple(a for a in axes if self.shape[a] != 1)  # size-1 dims need no reduction
        out = Tensor(UOp(Ops.REDUCE, self.dtype, (self.uop,), (op, work))) if work else self
        if 0 in self.shape:  # reducing nothing gives the identity
            out = Tensor.full(reduce_identity(op, self.dtype), self.dtype,
                              tuple(1 if i in axes else s for i, s in enumerate(self.shape)))
        if keepdims:
            return out
        return out.reshape(tuple(s for i, s in enumerate(out.shape) if i not in axes))

    def sum(self, axes=None, keepdims=True): return self.reduce(Ops.ADD, axes, keepdims)
    def max(self, axes=None, keepdims=True): return self.reduce(Ops.MAX, axes, keepdims)
    def min(self, axes=None, keepdims=True): return self.reduce(Ops.MIN, axes, keepdims)
    def prod(self, axes=None, keepdims=True): return self.reduce(Ops.MUL, axes, keepdims)

    def mean(self, axes=None, keepdims=True):
        s = self.sum(axes, keepdims)
        n = self.uop.size // max(s.uop.size, 1)
        return s / float(n) if self.dtype.is_float else s / n

    def softmax(self, axis: int = -1) -> Tensor:
        e = (self - self.max([axis])).exp()
        return e / e.sum([axis])

    def log_softmax(self, axis: int = -1) -> Tensor:
        x = self - self.max([axis])
        return x - x.exp().sum([axis]).log()

    # ---- contractions ---------------------------------------------------------------------
    def matmul(self, w: Tensor) -> Tensor:
        """(..., M, K) @ (..., K, N); the reduction axis is last so both operands stream."""
        a, b = self, w
        if a.ndim == 1:  # a row vector whose row axis is dropped again
            out = a.unsqueeze(0).matmul(b)
            return out.reshape(out.shape[:-2] + out.shape[-1:] if b.ndim > 1 else ())
        if b.ndim == 1:
            return a.matmul(b.unsqueeze(1)).reshape(a.shape[:-1])
        lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a = a.expand(lead + a.shape[-2:])
        b = b.expand(lead + b.shape[-2:])
        (m, k), n = a.shape[-2:], b.shape[-1]
        prod = a.reshape(lead + (m, 1, k)) * b.transpose().reshape(lead + (1, n, k))
        return prod.sum([-1], keepdims=False)

    @staticmethod
    def dot4(bytes4: list[Tensor], words: Tensor) -> Tensor:
        """Per element, sum over k of uint8 bytes4[k] times the signed byte k of int32 `words`
        (Ops.DOT4), in int32; every operand has one shape."""
        return Tensor(UOp(Ops.DOT4, dtypes.int32, tuple(t.uop for t in bytes4) + (words.uop,)))

    def mulhi(self, m: Tensor) -> Tensor:
        """(self * m) >> 32 of int32 tensors (Ops.MULHI): the high word of the exact product."""
        a, b = broadcast(self, m)
        return Tensor(UOp(Ops.MULHI, dtypes.int32, (a.uop, b.uop)))

    def mul16(self, b: Tensor) -> Tensor:
        """self * b of int32 tensors whose b fits 16 signed bits (Ops.MUL16): HVX multiplies a
        word by a halfword, and accumulates it, in one instruction."""
        a, b = broadcast(self, b)
        return Tensor(UOp(Ops.MUL16, dtypes.int32, (a.uop, b.uop)))

    def conv(self, w: Tensor, strides, dilations, pads, groups: int = 1,
             product=None) -> Tensor:
        """N-d convolution. x: (N, C, *S), w: (Cout, C/g, *K), pads: ((b, a), ...) per spatial dim.

        The kernel's iteration space is (N, g, Cout/g, *OS, C/g, *K) with the last 1+len(K)
        axes reduced; the input is a WINDOW view of the padded input, so no im2col buffer exists.
        `product(x, w)`: the multiply (Tensor.mul16 for quantized weights on HVX targets).
        """
        nsp = len(w.shape) - 2
        n, c = self.shape[:2]
        cout, cg, ks = w.shape[0], w.shape[1], w.shape[2:]
        x = self.pad(((0, 0), (0, 0)) + tuple(pads))
        x = x.window(ks, strides, dilations)  # (N, C, *OS, *K)
        osp = x.shape[2:2 + nsp]
        x = x.reshape((n, groups, 1, cg) + osp + ks)
        x = x.permute((0, 1, 2) + tuple(range(4, 4 + nsp)) + (3,) + tuple(range(4 + nsp, 4 + 2 * nsp)))
        full = (n, groups, cout // groups) + osp + (cg,) + ks
        wv = w.reshape((1, groups, cout // groups) + (1,) * nsp + (cg,) + ks)
        prod = (product or Tensor.__mul__)(x.expand(full), wv.expand(full))
        out = prod.sum(list(range(3 + nsp, 4 + 2 * nsp)), keepdims=False)
        return out.reshape((n, cout) + osp)

    def pool(self, op: Ops, kernel, strides, dilations, pads, fill) -> Tensor:
        """Window reduction over the trailing len(kernel) dims (max/sum pooling)."""
        nsp = len(kernel)
        lead = ((0, 0),) * (self.ndim - nsp)
        x = self.pad(lead + tuple(pads), fill).window(kernel, strides, dilations)
        return x.reduce(op, list(range(x.ndim - nsp, x.ndim)), keepdims=False)


def broadcast(*ts: Tensor) -> list[Tensor]:
    shape = np.broadcast_shapes(*(t.shape for t in ts))
    return [t.expand(shape) for t in ts]
