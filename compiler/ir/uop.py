"""The one IR: UOp(op, dtype, src, arg), immutable and hash-consed.

The same node type carries the tensor graph (nodes with a `shape`), the per-kernel graph after
lowering (scalar nodes: RANGE, LOAD, STORE, REDUCE over ranges) and the linearized program.
Hash-consing means structural equality is identity: CSE is free and rewrite memo tables can key
on the node itself.
"""
from __future__ import annotations

import math
import weakref
from enum import IntEnum, auto

import numpy as np

from compiler.ir.dtypes import DType, dtypes


class Ops(IntEnum):  # IntEnum: hashing an op is C-level, and every UOp key hashes one
    # leaves
    CONST = auto()  # arg = python value; tensor-level shape ()
    INPUT = auto()  # arg = (name, shape); tensor-level graph input
    WEIGHT = auto()  # arg = Weight; read-only data known at compile time
    # movement (views, never copies)
    RESHAPE = auto()  # arg = new shape
    PERMUTE = auto()  # arg = order
    EXPAND = auto()  # arg = new shape (only size-1 dims grow)
    PAD = auto()  # arg = (((before, after), ...), fill value)
    SHRINK = auto()  # arg = ((start, stop), ...)
    FLIP = auto()  # arg = axes
    WINDOW = auto()  # arg = (kernel, strides, dilations) over the trailing dims
    GATHER = auto()  # src = (data, indices), arg = axis; the one data-dependent view
    # unary
    NEG = auto(); RECIP = auto(); SQRT = auto(); EXP2 = auto(); EXP = auto(); LOG2 = auto()
    SIN = auto(); COS = auto()
    TRUNC = auto()  # float -> float toward zero
    CAST = auto(); BITCAST = auto()
    # binary
    ADD = auto(); SUB = auto(); MUL = auto(); FDIV = auto()
    IDIV = auto(); MOD = auto()  # C semantics: truncate toward zero, sign of dividend
    MAX = auto(); MIN = auto()  # NaN-propagating
    POW = auto()
    CMPLT = auto(); CMPEQ = auto(); CMPNE = auto()
    AND = auto(); OR = auto(); XOR = auto(); SHL = auto(); SHR = auto()
    # ternary
    WHERE = auto()
    # src = (b0, b1, b2, b3, w): sum over k of uint8 b_k times the signed byte k of int32 w (the
    # low byte first), in int32: four 8-bit multiply-adds, HVX's vrmpy lane (renderers/c.py);
    # kernel level also src = (word, w): the four bytes as one uint32 (codegen/build.py)
    DOT4 = auto()
    MULHI = auto()  # (a * b) >> 32 of int32 a, b: the high word of the exact 64-bit product
    MUL16 = auto()  # a * b of int32 a, b where b fits 16 signed bits (a quantized weight)
    # reduction: tensor-level arg = (op, axes) keeping dims; kernel-level src = (value, *ranges)
    REDUCE = auto()
    # kernel level
    # a kernel's buffer parameter; arg = (index, shape): the tensor it holds while the kernel is a
    # tensor graph (schedule/layout.py canonical), () once lowered to loads and stores
    PARAM = auto()
    RANGE = auto()  # src = (end,), arg = (axis id, kind): kind in "loop", "reduce", "global"
    LOAD = auto()  # src = (param, index[, valid])
    STORE = auto()  # src = (param, index, value)
    PREFETCH = auto()  # src = (param, index): a hint to start reading memory that comes next
    SINK = auto()  # groups stores (and prefetches); the root of a kernel
    VECTORIZE = auto()  # src = one scalar per lane
    GEP = auto()  # arg = lane: one lane of a vector
    STACK = auto()  # src = values: an array of them, in registers' place (lower.py's looped epilogue)
    PICK = auto()  # src = (stack, index): one value of a STACK
    # linearized program only
    DEFINE_ACC = auto()  # src = (reduce,), declares its accumulator before the reduce loops
    ENDRANGE = auto()  # src = (range,)


UNARY = {Ops.NEG, Ops.RECIP, Ops.SQRT, Ops.EXP2, Ops.EXP, Ops.LOG2, Ops.SIN, Ops.COS, Ops.TRUNC, Ops.CAST, Ops.BITCAST}
BINARY = {Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.MIN, Ops.POW,
          Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR}
ALU = UNARY | BINARY | {Ops.WHERE, Ops.DOT4, Ops.MULHI, Ops.MUL16}
COMPARE = {Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE}
MOVEMENT = {Ops.RESHAPE, Ops.PERMUTE, Ops.EXPAND, Ops.PAD, Ops.SHRINK, Ops.FLIP, Ops.WINDOW}
COMMUTATIVE = {Ops.ADD, Ops.MUL, Ops.MAX, Ops.MIN, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR}


def reduce_identity(op: Ops, dtype: DType):
    """The value a reduction starts from: what an empty reduction gives, and an accumulator's
    initial value."""
    if op is Ops.ADD:
        return 0
    if op is Ops.MUL:
        return 1
    return dtype.min if op is Ops.MAX else dtype.max


class Weight:
    """Compile-time data. Identity-hashed: two weights are the same node only if the same array."""

    __slots__ = ("data", "__weakref__")

    def __init__(self, data: np.ndarray):
        self.data = np.ascontiguousarray(data)
        self.data.setflags(write=False)

    def __repr__(self) -> str:
        return f"Weight({self.data.dtype}{list(self.data.shape)})"


# constants are few and reused everywhere (index strides, lane offsets): keep them for good
_CONSTS: dict = {}


class cached:
    """functools.cached_property without its lock (Python 3.11 takes one on every first read,
    and every node reads its shape or value range once): the value lands in the instance dict,
    which shadows this non-data descriptor from then on."""

    def __init__(self, fn):
        self.fn, self.name = fn, fn.__name__

    def __get__(self, u, owner=None):
        if u is None:
            return self
        v = u.__dict__[self.name] = self.fn(u)
        return v


class deep(cached):
    """A cached property computed from the same property of the sources (shape): filled in
    sources first, without recursion, so a first read at the end of a 10,000-node chain does
    not recurse 10,000 deep."""

    def __get__(self, u, owner=None):
        if u is None:
            return self
        name, stack = self.name, [u]
        while stack:
            n = stack[-1]
            if name in n.__dict__:
                stack.pop()
                continue
            todo = [s for s in n.src if name not in s.__dict__]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            n.__dict__[name] = self.fn(n)
        return u.__dict__[name]


class _ranged:
    """vmin and vmax: both come from one bounds() call, and both are stored."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, u, owner=None):
        if u is None:
            return self
        d = u.__dict__
        d["vmin"], d["vmax"] = bounds(u)
        return d[self.name]


class _Ref(weakref.ref):
    """An intern-table entry that knows its key, so one callback (not a closure per node)
    drops it when its node dies."""
    __slots__ = ("key",)


def _drop(ref: _Ref) -> None:
    if UOp._cache.get(ref.key) is ref:
        del UOp._cache[ref.key]


def window_out(size: int, k: int, s: int, d: int) -> int:
    return (size - d * (k - 1) - 1) // s + 1


def _const_key(v):
    """What tells constants apart: -0.0 from 0.0 (1/x does), and one NaN is every NaN."""
    return repr(v) if type(v) is float and (v == 0 or v != v) else v


class UOp:
    __slots__ = ("op", "dtype", "src", "arg", "__weakref__", "__dict__")
    # intern table: key -> weakref. A plain dict of weakrefs (not WeakValueDictionary, whose
    # Python-level get/set dominated compile time); the ref's callback drops dead entries.
    _cache: dict = {}

    def __new__(cls, op: Ops, dtype: DType = dtypes.void, src: tuple = (), arg=None):
        # -0.0 == 0.0 in Python, but they are different constants (1/x tells them apart); and
        # nan != nan, so every NaN would be a new node and a rewrite would never settle
        key = (op, dtype, tuple(map(id, src)), _const_key(arg) if type(arg) is float else arg)
        try:
            ref = UOp._cache.get(key)
        except TypeError as e:
            raise TypeError(f"UOp arg must be hashable, got {type(arg).__name__}") from e
        if ref is not None:
            hit = ref()
            if hit is not None:
                return hit
        self = object.__new__(cls)
        self.op, self.dtype, self.src, self.arg = op, dtype, tuple(src), arg
        ref = UOp._cache[key] = _Ref(self, _drop)
        ref.key = key
        return self

    def __reduce__(self):
        return UOp, (self.op, self.dtype, self.src, self.arg)

    def __repr__(self) -> str:
        return pretty(self)

    # ---- construction helpers -------------------------------------------------------------
    @staticmethod
    def const(value, dtype: DType) -> UOp:
        t = type(value)
        key = (value if t is not float else _const_key(value), dtype, t)
        hit = _CONSTS.get(key)
        if hit is None:
            hit = _CONSTS[key] = UOp(Ops.CONST, dtype, (), normalize_const(value, dtype))
        return hit

    @staticmethod
    def param(index: int, dtype: DType) -> UOp:
        """A kernel's buffer parameter `index` with elements of `dtype`."""
        return UOp(Ops.PARAM, dtype, (), (index, ()))

    def alu(self, op: Ops, *others: UOp) -> UOp:
        out = dtypes.bool if op in COMPARE else self.dtype
        return UOp(op, out, (self, *others))

    def cast(self, dtype: DType) -> UOp:
        return self if dtype == self.dtype else UOp(Ops.CAST, dtype, (self,))

    def _lift(self, x) -> UOp:
        return x if isinstance(x, UOp) else UOp.const(x, self.dtype)

    def __add__(self, x): return self.alu(Ops.ADD, self._lift(x))
    def __radd__(self, x): return self._lift(x).alu(Ops.ADD, self)
    def __sub__(self, x): return self.alu(Ops.SUB, self._lift(x))
    def __mul__(self, x): return self.alu(Ops.MUL, self._lift(x))
    def __rmul__(self, x): return self._lift(x).alu(Ops.MUL, self)
    def __floordiv__(self, x): return self.alu(Ops.IDIV, self._lift(x))
    def __mod__(self, x): return self.alu(Ops.MOD, self._lift(x))
    def __neg__(self): return self.alu(Ops.NEG)
    def lt(self, x): return self.alu(Ops.CMPLT, self._lift(x))
    def ne(self, x): return self.alu(Ops.CMPNE, self._lift(x))
    def eq(self, x): return self.alu(Ops.CMPEQ, self._lift(x))
    def maximum(self, x): return self.alu(Ops.MAX, self._lift(x))
    def minimum(self, x): return self.alu(Ops.MIN, self._lift(x))
    def where(self, a, b): return UOp(Ops.WHERE, a.dtype, (self, a, b))
    def logical_and(self, x): return self.alu(Ops.AND, self._lift(x))
    def logical_not(self): return self.alu(Ops.CMPNE, UOp.const(True, dtypes.bool))

    # ---- tensor-level shape ---------------------------------------------------------------
    @deep
    def shape(self) -> tuple[int, ...]:
        op, arg = self.op, self.arg
        if op is Ops.CONST:
            return ()
        if op in (Ops.INPUT, Ops.PARAM):
            return arg[1]
        if op is Ops.WEIGHT:
            return arg.data.shape
        if op in (Ops.RESHAPE, Ops.EXPAND):
            return arg
        src = self.src[0].shape
        if op is Ops.PERMUTE:
            return tuple(src[i] for i in arg)
        if op is Ops.PAD:
            return tuple(s + b + a for s, (b, a) in zip(src, arg[0]))
        if op is Ops.SHRINK:
            return tuple(e - b for b, e in arg)
        if op is Ops.WINDOW:
            ks, ss, ds = arg
            lead, tail = src[: len(src) - len(ks)], src[len(src) - len(ks):]
            return lead + tuple(map(window_out, tail, ks, ss, ds)) + tuple(ks)
        if op is Ops.GATHER:
            ax, ind = arg, self.src[1].shape
            return src[:ax] + ind + src[ax + 1:]
        if op is Ops.REDUCE:
            return tuple(1 if i in arg[1] else s for i, s in enumerate(src))
        return src  # elementwise: all sources share one shape

    @cached
    def size(self) -> int:
        return math.prod(self.shape)

    # ---- kernel-level value ranges (for symbolic simplification) --------------------------
    vmin = _ranged()  # inclusive value range, for symbolic simplification
    vmax = _ranged()

    @property
    def parts(self) -> tuple[UOp, ...]:
        """A kernel-level REDUCE's values, accumulated in order (its other sources are RANGEs)."""
        return tuple(s for s in self.src if s.op is not Ops.RANGE)

    @property
    def ranges(self) -> tuple[UOp, ...]:
        return tuple(s for s in self.src if s.op is Ops.RANGE)

    def toposort(self, leaves=()) -> list[UOp]:
        """Sources before users, iteratively: graphs are deep (thousands of nodes in a chain).
        Nodes in `leaves` are listed but not walked into."""
        order, seen, stack = [], set(), [(self, False)]
        while stack:
            node, done = stack.pop()
            if done:
                order.append(node)
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.append((node, True))
            if node not in leaves:
                stack.extend([(s, False) for s in reversed(node.src) if s not in seen])
        return order


def normalize_const(value, dtype: DType):
    """Python scalar in the dtype's value set (wrapping ints, rounding floats) so equal consts hash."""
    if dtype.kind == "b":
        return bool(value)
    if dtype.kind == "f":
        v = float(value)
        return float(np.array(v, dtype.np)) if dtype is not dtypes.float64 else v
    v = int(value)
    if dtype.kind == "x":
        return v
    v &= (1 << dtype.bits) - 1  # two's-complement wrap, as the C cast does
    return v - (1 << dtype.bits) if dtype.kind == "i" and v >> (dtype.bits - 1) else v


def bounds(u: UOp):
    """Inclusive value range of an index/int/bool node, used by symbolic rules. Floats: unknown."""
    op, s = u.op, u.src
    if u.dtype.is_float:
        return -math.inf, math.inf
    if op is Ops.CONST:
        return u.arg, u.arg
    if op is Ops.RANGE:
        return 0, s[0].vmax - 1
    if u.dtype is dtypes.bool and op not in (Ops.WHERE,) and op not in COMPARE:
        return False, True
    if op is Ops.ADD:
        return s[0].vmin + s[1].vmin, s[0].vmax + s[1].vmax
    if op is Ops.SUB:
        return s[0].vmin - s[1].vmax, s[0].vmax - s[1].vmin
    if op is Ops.MUL:
        c = [a * b for a in (s[0].vmin, s[0].vmax) for b in (s[1].vmin, s[1].vmax)]
        return min(c), max(c)
    if op is Ops.NEG:
        return -s[0].vmax, -s[0].vmin
    if op in (Ops.MAX, Ops.MIN):
        f = max if op is Ops.MAX else min
        return f(s[0].vmin, s[1].vmin), f(s[0].vmax, s[1].vmax)
    if op is Ops.WHERE:
        return min(s[1].vmin, s[2].vmin), max(s[1].vmax, s[2].vmax)
    if op is Ops.IDIV and s[1].op is Ops.CONST and s[1].arg > 0 and s[0].vmin >= 0:
        return s[0].vmin // s[1].arg, s[0].vmax // s[1].arg
    if op is Ops.MOD and s[1].op is Ops.CONST and s[1].arg > 0 and s[0].vmin >= 0:
        return (s[0].vmin, s[0].vmax) if s[0].vmax < s[1].arg else (0, s[1].arg - 1)
    if op is Ops.CMPLT:
        if s[0].vmax < s[1].vmin:
            return True, True
        if s[0].vmin >= s[1].vmax:
            return False, False
        return False, True
    if op is Ops.CAST and s[0].dtype.is_int and u.dtype.is_int:
        lo, hi = s[0].vmin, s[0].vmax
        if u.dtype.min <= lo and hi <= u.dtype.max:
            return lo, hi
    dt = dtypes.int64 if u.dtype.kind == "x" else u.dtype
    return dt.min, dt.max


def pretty(u: UOp, depth: int = 3) -> str:
    arg = "" if u.arg is None else f", {u.arg!r}"
    if depth == 0 or not u.src:
        return f"{u.op.name}({u.dtype.name}{arg})" if u.src == () else f"{u.op.name}(...)"
    inner = ", ".join(pretty(s, depth - 1) for s in u.src)
    return f"{u.op.name}({u.dtype.name}{arg}, [{inner}])"
