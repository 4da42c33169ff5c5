"""Vectorization by zipping lanes: the W scalar copies of a store that lowering made for the
vector axis are merged node by node into vector UOps.

Two lane nodes zip when they have the same op, dtype and arg and their sources zip; lanes that are
one shared node stay scalar (the renderer broadcasts them); W loads at consecutive addresses
become one vector load. Anything else becomes VECTORIZE of its scalar lanes, and those keep their
scalar graph, so vectorizing is an optimization that can never change what is computed.
"""
from __future__ import annotations

from compiler.ir.dtypes import dtypes
from compiler.ir.symbolic import linear_form
from compiler.ir.uop import Ops, UOp

# ops with a direct lane-wise vector form in every C-family target
LANEWISE = {Ops.ADD, Ops.SUB, Ops.MUL, Ops.FDIV, Ops.MAX, Ops.MIN, Ops.NEG, Ops.CMPLT,
            Ops.CMPEQ, Ops.CMPNE, Ops.WHERE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR,
            Ops.CAST, Ops.BITCAST, Ops.REDUCE}


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
        if lanes not in self.memo:
            self.memo[lanes] = self._zip(lanes)
        return self.memo[lanes]

    def _zip(self, lanes: tuple[UOp, ...]) -> UOp:
        first = lanes[0]
        if all(u is first for u in lanes):
            return first  # the same value in every lane: stays scalar
        dt = first.dtype
        vdt = dt.vec(self.width)
        same = all(u.op is first.op and u.dtype is dt and u.arg == first.arg
                   and len(u.src) == len(first.src) for u in lanes)
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
        C compilers, and they are rare in hot loops."""
        kinds = [u.dtype] + [s.dtype for s in u.src]
        if u.op in (Ops.CAST, Ops.BITCAST) and dtypes.bool in kinds:
            return False
        return all(d.kind != "i" or d.itemsize <= 4 for d in kinds if d is not dtypes.void)


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


def vectorize(sink: UOp, overread: set[int] = frozenset()) -> UOp:
    width = sink.arg or 1
    if width <= 1 or len(sink.src) % width:
        return sink
    z, stores = Zipper(width, overread), []
    for g in range(0, len(sink.src), width):
        group = sink.src[g:g + width]
        params = {s.src[0] for s in group}
        idxs = tuple(s.src[1] for s in group)
        if group[0].src[2].dtype is dtypes.bool:
            stores.extend(group)
            continue
        value = z(tuple(s.src[2] for s in group))
        if len(params) == 1 and _contiguous(idxs):
            if value.dtype.count == 1:  # every lane the same value: store it W times
                value = UOp(Ops.VECTORIZE, value.dtype.vec(width), (value,) * width)
            stores.append(UOp(Ops.STORE, dtypes.void, (group[0].src[0], idxs[0], value)))
        elif value.op is Ops.VECTORIZE or value.dtype.count == 1:
            stores.extend(group)  # nothing was vectorized: keep the scalar stores
        else:  # computed as a vector, stored lane by lane (a strided output)
            stores.extend(UOp(Ops.STORE, dtypes.void, (s.src[0], s.src[1],
                                                       UOp(Ops.GEP, value.dtype.scalar, (value,), k)))
                          for k, s in enumerate(group))
    return UOp(Ops.SINK, dtypes.void, tuple(stores))
