"""numpy evaluation of the tensor-level IR, with C semantics (wrapping ints, truncating division).

Used to fold weight-only subgraphs at compile time; tests also use it as an oracle for lowering.
"""
from __future__ import annotations

import numpy as np

from compiler.ir.uop import Ops, UOp, window_out


def _window(x: np.ndarray, arg) -> np.ndarray:
    ks, ss, ds = arg
    nsp = len(ks)
    lead = x.shape[: x.ndim - nsp]
    outs = tuple(map(window_out, x.shape[x.ndim - nsp:], ks, ss, ds))
    strides = x.strides[: x.ndim - nsp]
    sp = x.strides[x.ndim - nsp:]
    view = np.lib.stride_tricks.as_strided(
        x, lead + outs + tuple(ks),
        strides + tuple(st * s for st, s in zip(sp, ss)) + tuple(st * d for st, d in zip(sp, ds)))
    return view.copy()


def _gather(x: np.ndarray, ind: np.ndarray, axis: int) -> np.ndarray:
    n = x.shape[axis]
    ind = ind.astype(np.int64)
    ind = np.clip(np.where(ind < 0, ind + n, ind), 0, max(n - 1, 0))  # clamp: never read outside
    return np.take(x, ind, axis=axis)


def _cdiv(a, b):
    if a.dtype.kind == "f":
        return a / b
    b = np.where(b == 0, 1, b)
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q).astype(a.dtype)


def _cmod(a, b):
    if a.dtype.kind == "f":
        return np.fmod(a, b)
    b = np.where(b == 0, 1, b)
    return (a - _cdiv(a, b) * b).astype(a.dtype)


BINARY = {
    Ops.ADD: np.add, Ops.SUB: np.subtract, Ops.MUL: np.multiply, Ops.FDIV: np.divide,
    Ops.IDIV: _cdiv, Ops.MOD: _cmod, Ops.MAX: np.maximum, Ops.MIN: np.minimum,  # NaN wins
    Ops.POW: np.power,
    Ops.CMPLT: np.less, Ops.CMPEQ: np.equal, Ops.CMPNE: np.not_equal,
    Ops.AND: np.bitwise_and, Ops.OR: np.bitwise_or, Ops.XOR: np.bitwise_xor,
    Ops.SHL: np.left_shift, Ops.SHR: np.right_shift,
}
UNARY = {
    Ops.NEG: np.negative, Ops.RECIP: np.reciprocal, Ops.SQRT: np.sqrt, Ops.EXP2: np.exp2,
    Ops.EXP: np.exp,
    Ops.LOG2: np.log2, Ops.SIN: np.sin, Ops.COS: np.cos, Ops.TRUNC: np.trunc,
}
REDUCE = {Ops.ADD: np.sum, Ops.MAX: np.max, Ops.MIN: np.min, Ops.MUL: np.prod}


def eval_node(u: UOp, s: list[np.ndarray], env: dict) -> np.ndarray:
    """One node's value from its sources' values `s` (env: graph inputs by name)."""
    op, arg, dt = u.op, u.arg, u.dtype.np
    if op is Ops.CONST:
        return np.array(arg, dt)
    if op is Ops.WEIGHT:
        return arg.data
    if op is Ops.INPUT:
        return np.asarray(env[arg[0]], dt).reshape(arg[1])
    if op is Ops.RESHAPE:
        return s[0].reshape(arg)
    if op is Ops.PERMUTE:
        return s[0].transpose(arg)
    if op is Ops.EXPAND:
        return np.broadcast_to(s[0], arg)
    if op is Ops.PAD:
        return np.pad(s[0], arg[0], constant_values=arg[1])
    if op is Ops.SHRINK:
        return s[0][tuple(slice(b, e) for b, e in arg)]
    if op is Ops.FLIP:
        return np.flip(s[0], arg)
    if op is Ops.WINDOW:
        return _window(np.ascontiguousarray(s[0]), arg)
    if op is Ops.GATHER:
        return _gather(s[0], s[1], arg)
    if op is Ops.REDUCE:
        return REDUCE[arg[0]](s[0], axis=arg[1], keepdims=True).astype(dt)
    if op is Ops.CAST:
        return _cast(s[0], u.dtype.np)
    if op is Ops.BITCAST:
        return np.ascontiguousarray(s[0]).view(dt)
    if op is Ops.WHERE:
        return np.where(s[0], s[1], s[2]).astype(dt)
    if op is Ops.DOT4:
        return dot4(s[:4], s[4]).astype(dt)
    if op is Ops.MUL16:
        return (s[0] * s[1]).astype(dt)
    if op is Ops.MULHI:
        return ((s[0].astype(np.int64) * s[1].astype(np.int64)) >> 32).astype(dt)
    with np.errstate(all="ignore"):
        if op in UNARY:
            return UNARY[op](s[0]).astype(dt)
        return BINARY[op](s[0], s[1]).astype(dt)


def dot4(bytes4, words: np.ndarray) -> np.ndarray:
    """Ops.DOT4: sum over k of uint8 bytes4[k] times the signed byte k of int32 words."""
    w = np.asarray(words).astype(np.int64)
    return sum(np.asarray(b).astype(np.int64) * (((w >> (8 * k)) & 0xFF ^ 0x80) - 0x80)
               for k, b in enumerate(bytes4))


def _cast(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    with np.errstate(all="ignore"):
        if x.dtype.kind == "f" and dt.kind in "iu":  # C truncation; NaN/inf become 0 not UB
            x = np.nan_to_num(np.trunc(x), nan=0, posinf=0, neginf=0)
            info = np.iinfo(dt)
            return np.clip(x, info.min, info.max).astype(dt)
        return x.astype(dt)


def evaluate(root: UOp, env: dict | None = None) -> np.ndarray:
    vals: dict[UOp, np.ndarray] = {}
    for u in root.toposort():
        vals[u] = eval_node(u, [vals[x] for x in u.src], env or {})
    return np.asarray(vals[root])
