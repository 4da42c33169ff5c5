"""Kernel-level simplification rules: constant folding, algebra and index math with value ranges.

Lowering writes index arithmetic naively (a reshape is "flatten, then div/mod per dim"); these
rules make it collapse back to plain affine expressions so loads become base + stride * i.
"""
from __future__ import annotations

from functools import cache

from compiler.ir.dtypes import dtypes
from compiler.ir.rewrite import PatternMatcher, UPat
from compiler.ir.uop import ALU, Ops, UOp

INTS = (dtypes.index, dtypes.int32, dtypes.int64, dtypes.int16, dtypes.int8, dtypes.uint8,
        dtypes.uint16, dtypes.uint32, dtypes.uint64)


def _cdiv(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


PY_ALU = {
    Ops.ADD: lambda a, b: a + b, Ops.SUB: lambda a, b: a - b, Ops.MUL: lambda a, b: a * b,
    Ops.IDIV: lambda a, b: _cdiv(a, b) if b else 0,
    Ops.MOD: lambda a, b: a - _cdiv(a, b) * b if b else 0,
    Ops.MAX: lambda a, b: a if a != a or a > b else b,  # NaN wins, as in the kernels
    Ops.MIN: lambda a, b: a if a != a or a < b else b,
    Ops.CMPLT: lambda a, b: a < b, Ops.CMPEQ: lambda a, b: a == b,
    Ops.CMPNE: lambda a, b: a != b, Ops.AND: lambda a, b: a & b, Ops.OR: lambda a, b: a | b,
    Ops.XOR: lambda a, b: a ^ b, Ops.NEG: lambda a: -a,
    Ops.WHERE: lambda c, a, b: a if c else b,
}


def fold_const(x: UOp) -> UOp | None:
    """Fold integer and boolean ops on constants. Float folding stays with numpy at tensor level:
    C and Python round differently for float32, so we don't fold floats here."""
    if x.dtype.is_float or x.op not in PY_ALU or any(s.op is not Ops.CONST for s in x.src):
        return None
    if any(s.dtype.is_float for s in x.src):
        return None
    return UOp.const(PY_ALU[x.op](*(s.arg for s in x.src)), x.dtype)


def fold_range(x: UOp) -> UOp | None:
    """An int/bool node whose value range is one point is that constant."""
    if x.dtype.is_float or x.op in (Ops.CONST, Ops.LOAD) or x.op not in ALU:
        return None
    return UOp.const(x.vmin, x.dtype) if x.vmin == x.vmax else None


def terms(x: UOp) -> tuple[tuple[tuple[int, UOp], ...], int]:
    """x as sum(coef * term) + const. Kept on the node: every ADD of a long index sum asks for
    the terms of the sum below it, which would make one sum quadratic."""
    hit = x.__dict__.get("terms")
    if hit is None:
        hit = x.__dict__["terms"] = _terms(x)
    return hit


def _terms(x: UOp) -> tuple[tuple[tuple[int, UOp], ...], int]:
    if x.op is Ops.CONST:
        return (), x.arg
    if x.op is Ops.ADD:
        (ta, ca), (tb, cb) = terms(x.src[0]), terms(x.src[1])
        return ta + tb, ca + cb
    if x.op is Ops.MUL and x.src[1].op is Ops.CONST:
        t, c = terms(x.src[0])
        k = x.src[1].arg
        return tuple((a * k, u) for a, u in t), c * k
    return ((1, x),), 0


def linear_form(x: UOp) -> tuple[dict[UOp, int], int]:
    """x as {term: coefficient} + constant: equal terms merged, zero coefficients dropped."""
    ts, const = terms(x)
    coef: dict[UOp, int] = {}
    for c, t in ts:
        coef[t] = coef.get(t, 0) + c
    return {t: c for t, c in coef.items() if c}, const


def build(ts: list[tuple[int, UOp]], const: int, dtype) -> UOp:
    merged: dict[UOp, int] = {}
    for coef, t in ts:
        merged[t] = merged.get(t, 0) + coef
    out = None
    for t, coef in merged.items():
        if coef == 0:
            continue
        term = t if coef == 1 else UOp(Ops.MUL, dtype, (t, UOp.const(coef, dtype)))
        out = term if out is None else UOp(Ops.ADD, dtype, (out, term))
    if out is None:
        return UOp.const(const, dtype)
    return out if const == 0 else UOp(Ops.ADD, dtype, (out, UOp.const(const, dtype)))


def fold_divmod(x: UOp) -> UOp | None:
    """(q*c + r) // c = q + r // c and (q*c + r) % c = r % c, valid in C when r >= 0; and
    r // c = 0, r % c = r when 0 <= r < c. A common factor of c and every coefficient divides out."""
    num, den = x.src
    if den.op is not Ops.CONST or den.arg <= 0 or num.vmin < 0 or x.dtype.is_float:
        return None
    c = den.arg
    ts, k = terms(num)
    quot = [(a // c, t) for a, t in ts if a % c == 0]
    rest = [(a, t) for a, t in ts if a % c != 0]
    rem = build(rest, k % c, x.dtype)
    if rem.vmin < 0:
        return None
    qconst = k // c
    if rem.vmax < c:
        return build(quot, qconst, x.dtype) if x.op is Ops.IDIV else rem
    for d in _divisors(c):
        # rest = d*m + s with 0 <= s < d and d | c: floor(rest / c) = floor(m / (c/d))
        if not all(t.vmin >= 0 for _, t in rest):
            continue
        big = [(a // d, t) for a, t in rest if a % d == 0]
        small = build([(a, t) for a, t in rest if a % d], (k % c) % d, x.dtype)
        if not big or small.vmin < 0 or small.vmax >= d:
            continue
        m = build(big, (k % c) // d, x.dtype)
        inner = UOp(x.op, x.dtype, (m, UOp.const(c // d, x.dtype)))
        if x.op is Ops.IDIV:
            return build(quot + [(1, inner)], qconst, x.dtype)
        return build([(d, inner), (1, small)], 0, x.dtype)
    if not quot and qconst == 0:
        return None  # nothing to pull out
    if x.op is Ops.IDIV:
        return build(quot + [(1, UOp(Ops.IDIV, x.dtype, (rem, den)))], qconst, x.dtype)
    return UOp(Ops.MOD, x.dtype, (rem, den))


@cache
def _divisors(c: int) -> tuple[int, ...]:
    """The divisors of c above 1, largest first."""
    return tuple(d for d in range(c, 1, -1) if c % d == 0)


def fold_minmax(x: UOp) -> UOp | None:
    a, b = x.src
    if x.dtype.is_float:
        return None
    if x.op is Ops.MAX:
        return a if a.vmin >= b.vmax else b if b.vmin >= a.vmax else None
    return a if a.vmax <= b.vmin else b if b.vmax <= a.vmin else None


def fold_cmp_offset(x: UOp) -> UOp | None:
    """(a + c) < d  ->  a < d - c: masks compare the bare loop variable."""
    a, d = x.src
    if a.op is Ops.ADD and a.src[1].op is Ops.CONST and d.op is Ops.CONST and a.dtype in INTS:
        return UOp(Ops.CMPLT, dtypes.bool, (a.src[0], UOp.const(d.arg - a.src[1].arg, a.dtype)))
    return None


def cast_terms(x: UOp) -> UOp | None:
    """An integer (a + b) or (a * b) cast to an index is cast(a) + cast(b) or cast(a) * cast(b)
    where it cannot have wrapped (its range fits its type): a gather's index computed in the
    kernel (int32 y*W + x, clipped) then shows fold_divmod its terms."""
    v = x.src[0]
    if v.op not in (Ops.ADD, Ops.MUL) or v.dtype not in INTS or v.dtype is dtypes.index \
            or not v.dtype.min <= v.vmin <= v.vmax <= v.dtype.max:
        return None
    return UOp(v.op, x.dtype, tuple(UOp(Ops.CAST, x.dtype, (s,)) for s in v.src))


def distribute(x: UOp) -> UOp | None:
    """Keep index sums flat: (a + b) * c -> a*c + b*c, (a * c1) * c2 -> a * (c1*c2)."""
    a, c = x.src
    if c.op is not Ops.CONST or x.dtype not in INTS:
        return None
    if a.op is Ops.ADD:
        return UOp(Ops.ADD, x.dtype, (a.src[0] * c, a.src[1] * c))
    if a.op is Ops.MUL and a.src[1].op is Ops.CONST:
        return UOp(Ops.MUL, x.dtype, (a.src[0], UOp.const(a.src[1].arg * c.arg, x.dtype)))
    return None


def reassociate(x: UOp) -> UOp | None:
    """(a + c1) + c2 -> a + (c1+c2); constants move right so other rules see them."""
    a, b = x.src
    if x.dtype not in INTS:
        return None
    if a.op is Ops.CONST and b.op is not Ops.CONST:
        return UOp(Ops.ADD, x.dtype, (b, a))
    if b.op is Ops.CONST and a.op is Ops.ADD and a.src[1].op is Ops.CONST:
        return UOp(Ops.ADD, x.dtype, (a.src[0], UOp.const(a.src[1].arg + b.arg, x.dtype)))
    if b.op is Ops.ADD and b.src[1].op is Ops.CONST:  # a + (b + c) -> (a + b) + c
        return UOp(Ops.ADD, x.dtype, (UOp(Ops.ADD, x.dtype, (a, b.src[0])), b.src[1]))
    return None


def merge_divmod(x: UOp) -> UOp | None:
    """(y // c)*c*k + (y % c)*k -> y*k: a dim split by a reshape and joined again (merged
    loop dims index their tensors through both halves)."""
    if x.dtype not in INTS or all(t.op is not Ops.MOD for _, t in terms(x)[0]):
        return None
    coef, const = linear_form(x)
    for t, a in coef.items():
        if t.op is Ops.MOD and t.src[1].op is Ops.CONST:
            y, c = t.src[0], t.src[1].arg
            q = UOp(Ops.IDIV, x.dtype, (y, t.src[1]))
            if coef.get(q) == a * c and y.vmin >= 0:
                rest = [(b, u) for u, b in coef.items() if u is not t and u is not q]
                return build(rest + [(a, y)], const, x.dtype)
    return None


x_, c_ = UPat.var("x"), UPat.cvar("c")

symbolic = PatternMatcher([
    (UPat(ALU, name="x"), fold_const),
    (UPat(ALU, dtype=INTS + (dtypes.bool,), name="x"), fold_range),
    (UPat(Ops.ADD, src=(x_, c_)), lambda x, c: x if c.arg == 0 and not x.dtype.is_float else None),
    (UPat(Ops.MUL, src=(x_, c_)), lambda x, c: x if c.arg == 1 else
        (UOp.const(0, x.dtype) if c.arg == 0 and not x.dtype.is_float else None)),
    (UPat(Ops.SUB, src=(x_, c_)), lambda x, c: x if c.arg == 0 else None),
    (UPat(Ops.SUB, dtype=dtypes.index, name="s"), lambda s: UOp(Ops.ADD, s.dtype, (
        s.src[0], s.src[1] * -1))),
    (UPat(Ops.IDIV, src=(x_, c_)), lambda x, c: x if c.arg == 1 else None),
    (UPat({Ops.IDIV, Ops.MOD}, name="x"), fold_divmod),
    (UPat({Ops.MAX, Ops.MIN}, name="x"), fold_minmax),
    (UPat(Ops.MUL, name="x"), distribute),
    (UPat(Ops.ADD, name="x"), reassociate),
    (UPat(Ops.ADD, name="x"), merge_divmod),
    (UPat(Ops.CMPLT, name="x"), fold_cmp_offset),
    (UPat(Ops.WHERE, src=(c_, UPat.var("a"), UPat.var("b"))), lambda c, a, b: a if c.arg else b),
    (UPat(Ops.WHERE, src=(UPat.var(), x_, x_)), lambda x: x),
    # a gated load already yields 0 where its gate is false
    (UPat(Ops.WHERE, src=(UPat.var("g"), UPat(Ops.LOAD, name="ld"), c_)),
        lambda g, ld, c: ld if len(ld.src) == 3 and ld.src[2] is g and c.arg == 0 else None),
    (UPat(Ops.AND, src=(x_, c_), dtype=dtypes.bool), lambda x, c: x if c.arg else c),
    (UPat(Ops.OR, src=(x_, c_), dtype=dtypes.bool), lambda x, c: c if c.arg else x),
    (UPat(Ops.LOAD, name="ld"), lambda ld: UOp(Ops.LOAD, ld.dtype, ld.src[:2])
        if len(ld.src) == 3 and ld.src[2].op is Ops.CONST and ld.src[2].arg else
        (UOp.const(0, ld.dtype) if len(ld.src) == 3 and ld.src[2].op is Ops.CONST else None)),
    (UPat(Ops.CAST, dtype=dtypes.index, name="x"), cast_terms),
    (UPat(Ops.CAST, src=(c_,), name="x"), lambda x, c: UOp.const(c.arg, x.dtype)
        if not x.dtype.is_float and not c.dtype.is_float else None),
])
