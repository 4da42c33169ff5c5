"""Vectorization: lowering built one copy of each store per vector, whose index holds the lane
(lower.lane); every node that depends on the lane becomes a vector node.

A lane-wise op on vectors is that op on vectors, a load at base + lane is one vector load, and what
does not depend on the lane stays scalar (the renderer broadcasts it). Anything else (gathers,
per-lane padding gates, ops without a vector form) is expanded into its W lanes, substituted and
simplified one by one, and zipped (Zipper): lanes with the same op, dtype and arg zip when their
sources do, W loads at consecutive addresses become one vector load, and the rest becomes
VECTORIZE of its scalar lanes, so vectorizing is an optimization that can never change what is
computed.
"""
from __future__ import annotations

from compiler.codegen.lower import iconst, lane
from compiler.ir.dtypes import dtypes
from compiler.ir.rewrite import Rewriter
from compiler.ir.symbolic import linear_form
from compiler.ir.uop import Ops, UOp

# ops with a direct lane-wise vector form in every C-family target
LANEWISE = {Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.MAX, Ops.MIN, Ops.NEG, Ops.CMPLT,
            Ops.CMPEQ, Ops.CMPNE, Ops.WHERE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR,
            Ops.CAST, Ops.BITCAST, Ops.REDUCE, Ops.STACK, Ops.PICK, Ops.DOT4, Ops.MULHI, Ops.MUL16}


def _contiguous(idxs: tuple[UOp, ...]) -> bool:
    """Lane k reads base + k."""
    base, c0 = linear_form(idxs[0])
    return all(linear_form(idx) == (base, c0 + k) for k, idx in enumerate(idxs[1:], 1))


class Zipper:
    def __init__(self, width: int, overread: set[int]):
        self.width = width
        self.overread = overread  # params whose neighbours are readable (arena, guarded ends)
        self.memo: dict[tuple, UOp] = {}

    def __call__(self, lanes: tuple[UOp, ...]) -> UOp:
        return _memo_walk(self.memo, lanes, self._sources, self._zip)

    def _sources(self, lanes: tuple[UOp, ...]) -> list:
        """The lane tuples _zip zips to zip these: their sources', when they zip lane-wise."""
        first = lanes[0]
        if all(u is first for u in lanes) or not self._same(lanes) or \
                first.op not in LANEWISE or not self._vector_ok(first):
            return []
        return [tuple(u.src[i] for u in lanes) for i in range(len(first.src))]

    @staticmethod
    def _same(lanes: tuple[UOp, ...]) -> bool:
        first = lanes[0]
        return all(u.op is first.op and u.dtype is first.dtype and u.arg == first.arg
                   and len(u.src) == len(first.src) for u in lanes)

    def _zip(self, lanes: tuple[UOp, ...]) -> UOp:
        first = lanes[0]
        if all(u is first for u in lanes):
            return first  # the same value in every lane: stays scalar
        dt = first.dtype
        vdt = dt.vec(self.width)
        same = self._same(lanes)
        if same and first.op is Ops.LOAD and len(first.src) == 2 and dt is not dtypes.bool \
                and all(u.src[0] is first.src[0] for u in lanes) \
                and _contiguous(tuple(u.src[1] for u in lanes)):
            return UOp(Ops.LOAD, vdt, first.src)
        if same and first.op is Ops.LOAD and len(first.src) == 3 and dt is not dtypes.bool \
                and all(u.src[0] is first.src[0] for u in lanes) \
                and _contiguous(tuple(u.src[1] for u in lanes)):
            masked = self._gated_load(lanes, vdt)
            if masked is not None:
                return masked
        if same and first.op in LANEWISE and self._vector_ok(first):
            src = tuple(self(tuple(u.src[i] for u in lanes)) for i in range(len(first.src)))
            if first.op is Ops.REDUCE and any(s.dtype.count > 1 for s in src if s.op is Ops.RANGE):
                return UOp(Ops.VECTORIZE, vdt, lanes)
            return UOp(first.op, vdt, src, first.arg)
        return UOp(Ops.VECTORIZE, vdt, lanes)

    def _gated_load(self, lanes: tuple[UOp, ...], vdt) -> UOp | None:
        """Padding gates: the vector load runs only if some lane's gate holds (the conjuncts every
        lane shares, and any lane's remainder), and the remainders (a column check at a row edge)
        select lanes afterwards. A running load's window thus holds at least one valid address,
        so it reads at most W-1 elements past valid memory: allowed only where that memory is
        ours (arena buffers; the arena has guard bytes at both ends)."""
        first = lanes[0]
        conj = [_conjuncts(u.src[2]) for u in lanes]
        shared = [c for c in conj[0] if all(c in cs for cs in conj[1:])]
        rest = tuple(_all_of([c for c in cs if c not in shared]) for cs in conj)
        any_rest = [] if any(r.op is Ops.CONST and r.arg for r in rest) else [_any_of(rest)]
        gate = _all_of(shared + any_rest)
        load = UOp(Ops.LOAD, vdt, first.src[:2] + ((gate,) if gate.op is not Ops.CONST else ()))
        if all(r.op is Ops.CONST and r.arg for r in rest):
            return load
        if first.src[0].arg[0] not in self.overread:
            return None
        mask = self(rest)
        return UOp(Ops.WHERE, vdt, (mask, load, UOp.const(0, vdt.scalar)))

    def _vector_ok(self, u: UOp) -> bool:
        """Bool data and 8-byte integers stay scalar: their masks and conversions differ between
        C compilers, and they are rare in hot loops. A PICK's index is one scalar for all lanes."""
        kinds = [u.dtype] + [s.dtype for s in (u.src[:1] if u.op is Ops.PICK else u.src)]
        if u.op in (Ops.CAST, Ops.BITCAST) and dtypes.bool in kinds:
            return False
        return all(d.kind != "i" or d.itemsize <= 4 for d in kinds if d is not dtypes.void)


def _memo_walk(memo: dict, key, sources, compute):
    """memo[key] = compute(key), after memo holds every key in sources(key), transitively: a
    recursive memoized function run without recursion (expressions are as deep as the graph's
    elementwise chains)."""
    stack = [key]
    while stack:
        top = stack[-1]
        if top in memo:
            stack.pop()
            continue
        todo = [s for s in sources(top) if s not in memo]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        memo[top] = compute(top)
    return memo[key]


def _conjuncts(g: UOp) -> list[UOp]:
    return _conjuncts(g.src[0]) + _conjuncts(g.src[1]) if g.op is Ops.AND else [g]


def _all_of(conds: list[UOp]) -> UOp:
    out = UOp.const(True, dtypes.bool)
    for c in conds:
        out = c if out.op is Ops.CONST else UOp(Ops.AND, dtypes.bool, (out, c))
    return out


def _any_of(conds) -> UOp:
    out = conds[0]
    for c in conds[1:]:
        out = UOp(Ops.OR, dtypes.bool, (out, c))
    return out


class Vectorizer:
    """Template nodes (scalar, lane-dependent) -> vector nodes. `simp`: the kernel's Rewriter,
    which simplifies each lane of what expands lane by lane."""

    def __init__(self, sink: UOp, overread: set[int], simp: Rewriter):
        self.width, self.lane, self.simp = sink.arg, lane(sink.arg), simp
        self.zip = Zipper(self.width, overread)
        self.varies = {self.lane}  # the nodes that depend on the lane
        for u in sink.toposort():
            if any(s in self.varies for s in u.src):
                self.varies.add(u)
        self.memo: dict[UOp, UOp] = {}
        self.at: list[dict[UOp, UOp]] = [{self.lane: iconst(k)} for k in range(self.width)]

    def lanes(self, u: UOp) -> tuple[UOp, ...]:
        return tuple(self.simp(self._at(u, k)) for k in range(self.width))

    def _at(self, u: UOp, k: int) -> UOp:
        """u in lane k: rebuilt through the nodes that depend on the lane, and only those."""
        memo, varies = self.at[k], self.varies
        stack = [u]
        while stack:
            n = stack[-1]
            if n in memo or n not in varies:
                stack.pop()
                continue
            todo = [s for s in n.src if s in varies and s not in memo]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            memo[n] = UOp(n.op, n.dtype, tuple([memo.get(s, s) for s in n.src]), n.arg)
        return memo.get(u, u)

    def base(self, idx: UOp) -> UOp | None:
        """Lane 0's index, if lane k reads base + k."""
        coef, _ = linear_form(idx)
        if coef.get(self.lane) != 1 or any(t in self.varies for t in coef if t is not self.lane):
            return None
        return self.simp(self._at(idx, 0))

    def __call__(self, u: UOp) -> UOp:
        if u not in self.varies:
            return u  # the same value in every lane: stays scalar
        return _memo_walk(self.memo, u, self._sources, self._vec)

    def _sources(self, u: UOp) -> list[UOp]:
        """What _vec vectorizes to vectorize u: its lane-dependent sources, for a lane-wise op."""
        if u.op in LANEWISE and self.zip._vector_ok(u):
            return [s for s in u.src if s in self.varies]
        return []

    def _vec(self, u: UOp) -> UOp:
        vdt = u.dtype.vec(self.width)
        if u.op is Ops.LOAD and u.dtype is not dtypes.bool \
                and not any(s in self.varies for s in u.src[2:]) \
                and (base := self.base(u.src[1])) is not None:
            return UOp(Ops.LOAD, vdt, (u.src[0], base) + u.src[2:])
        if u.op in LANEWISE and self.zip._vector_ok(u):
            return UOp(u.op, vdt, tuple([self(s) for s in u.src]), u.arg)
        return self.zip(self.lanes(u))

    def store(self, s: UOp) -> list[UOp]:
        p, idx, val = s.src
        if val.dtype is dtypes.bool:
            return list(self.lanes(s))
        value, base = self(val), self.base(idx)
        if base is None and _contiguous(idxs := self.lanes(idx)):
            base = idxs[0]
        if base is not None:
            if value.dtype.count == 1:  # every lane the same value: store it W times
                value = UOp(Ops.VECTORIZE, value.dtype.vec(self.width), (value,) * self.width)
            return [UOp(Ops.STORE, dtypes.void, (p, base, value))]
        if value.op is Ops.VECTORIZE or value.dtype.count == 1:
            return list(self.lanes(s))  # nothing was vectorized: keep the scalar stores
        # computed as a vector, stored lane by lane (a strided output)
        return [UOp(Ops.STORE, dtypes.void, (p, i, UOp(Ops.GEP, value.dtype.scalar, (value,), k)))
                for k, i in enumerate(idxs)]


def vectorize(sink: UOp, simp: Rewriter, overread: set[int] = frozenset()) -> UOp:
    if (sink.arg or 1) <= 1:
        return sink
    v = Vectorizer(sink, overread, simp)
    return UOp(Ops.SINK, dtypes.void, tuple(st for s in sink.src for st in v.store(s)))
