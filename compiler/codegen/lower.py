"""Kernel lowering: a tensor-level kernel + its loop plan -> scalar UOps over RANGEs.

Movement ops become index arithmetic (symbolic.py simplifies it), PAD becomes a validity mask
that gates loads, and upcast/unroll axes are expanded into one copy of the scalar graph per value,
so hash-consing shares every load and index that the copies have in common (register tiling).
The vector axis is the exception: it expands into one copy per vector, not per lane, whose index
holds the lane as a variable (`lane`), and vectorize.py turns what depends on it into vectors. A
16-lane tile is then as cheap to build as a 1-lane one, and its lanes need no zipping.
The copies share them while they are built, not only after simplification: a kernel's builder
passes a Rewriter (rewrite.py) that simplifies each index as it is made, so two copies whose
indices simplify to the same node (a 3x3 window's neighbouring taps) lower that load once.
"""
from __future__ import annotations

import math
from functools import cache, reduce as fold
from itertools import product

from compiler.codegen.half import accumulator
from compiler.ir.dtypes import dtypes
from compiler.ir.kernel import LOOP_KINDS, AxisKind, Kernel, Plan, find_reduce
from compiler.ir.rewrite import Rewriter
from compiler.ir.symbolic import build, terms
from compiler.ir.uop import ALU, Ops, UOp

IDX = dtypes.index


_ICONSTS: dict[int, UOp] = {}  # index constants, the most asked-for nodes of lowering


def iconst(v: int) -> UOp:
    hit = _ICONSTS.get(v)
    if hit is None:
        hit = _ICONSTS[v] = UOp.const(int(v), IDX)
    return hit


def linear(idx, shape) -> UOp:
    """Row-major linear offset of idx in a contiguous tensor of `shape`."""
    out, stride = iconst(0), 1
    for i, s in reversed(list(zip(idx, shape))):
        if s != 1:
            out = out + i * stride
        stride *= s
    return out


def reshape_index(idx, from_shape, to_shape) -> tuple[UOp, ...]:
    """Each run (_runs) is flattened and split on its own, and a run of one dim on both sides
    keeps its index."""
    out = [iconst(0)] * len(to_shape)
    for ins, outs in _runs(tuple(from_shape), tuple(to_shape)):
        if len(ins) == 1 and len(outs) == 1:
            out[outs[0]] = _as_sum(idx[ins[0]])
            continue
        lin, stride = linear([idx[d] for d in ins], [from_shape[d] for d in ins]), 1
        for n in reversed(outs):
            out[n] = (lin // stride) % to_shape[n]
            stride *= to_shape[n]
    return tuple(out)


@cache
def _runs(from_shape: tuple, to_shape: tuple) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The dims a reshape maps onto each other: non-1 dims group into runs whose sizes have equal
    products on both sides (most reshapes only add or drop size-1 dims, or merge or split one
    run). Size-1 dims index 0; a shape without elements has no runs (nothing is read)."""
    if 0 in from_shape:
        return ()
    src = [d for d, s in enumerate(from_shape) if s != 1]
    dst = [d for d, s in enumerate(to_shape) if s != 1]
    runs, a, b = [], 0, 0
    while a < len(src):
        a2, b2, pa, pb = a + 1, b + 1, from_shape[src[a]], to_shape[dst[b]]
        while pa != pb:  # grow the side with the smaller product until they meet
            if pa < pb:
                pa, a2 = pa * from_shape[src[a2]], a2 + 1
            else:
                pb, b2 = pb * to_shape[dst[b2]], b2 + 1
        runs.append((tuple(src[a:a2]), tuple(dst[b:b2])))
        a, b = a2, b2
    return tuple(runs)


def _as_sum(i: UOp) -> UOp:
    """i rebuilt as sum(coef * term) + const: the form that flattening the index and splitting
    it again gave it (symbolic.fold_divmod rebuilds what it keeps), so the code is the same."""
    if i.op is not Ops.ADD and i.op is not Ops.MUL:
        return i  # one term: already that form
    hit = i.__dict__.get("as_sum")  # kept on the node, as symbolic.terms is
    if hit is None:
        ts, c = terms(i)
        hit = i.__dict__["as_sum"] = build(list(ts), c, i.dtype)
    return hit


def all_true(*conds):
    conds = [c for c in conds if c is not None]
    return fold(lambda a, b: a.logical_and(b), conds) if conds else None


def _same(u: UOp) -> UOp:
    return u


class Lowerer:
    def __init__(self, kernel: Kernel, params: dict[UOp, int], param_dtypes: list,
                 simp: Rewriter | None = None):
        self.kernel, self.root = kernel, kernel.root
        self.params = params
        self.param_uops = [UOp.param(i, dt) for i, dt in enumerate(param_dtypes)]
        self.memo: dict = {}
        self.acc: UOp | None = None
        self.red = find_reduce(kernel.root, set(params))
        self.simp = simp or _same
        self.done = simp.memo if simp else {}  # simp's answers, read without a call
        self.dims: dict = {}  # for _dim_index
        # what the reduction's value flows into: its lowering depends on the copy's accumulator
        self.above: set[UOp] = set()
        for n in kernel.root.toposort(leaves=set(params) - {kernel.root}):
            if n is self.red or any(s in self.above for s in n.src):
                self.above.add(n)

    def load(self, node: UOp, idx, valid) -> UOp:
        p = self.param_uops[self.params[node]]
        src = (p, linear(idx, node.shape)) + ((valid,) if valid is not None else ())
        return UOp(Ops.LOAD, node.dtype, src)

    def __call__(self, node: UOp, idx: tuple, valid=None) -> UOp:
        return self._drive(self._simplified(node, idx, valid))

    def _simplified(self, node: UOp, idx: tuple, valid) -> tuple:
        simp, done = self.simp, self.done
        idx = tuple([done[i] if i in done else simp(i) for i in idx])
        valid = None if valid is None else done[valid] if valid in done else simp(valid)
        return node, idx, valid

    def _drive(self, want: tuple) -> UOp:
        """The lowered value of `want` = (node, simplified index, gate), without recursion: a
        graph's depth would be the stack's. Each node's lowering (_lower) is a generator that
        yields what it needs, (node, index, gate, simplified?), and is sent each value back."""
        memo, stack, value = self.memo, [], None
        while True:
            key = (*want, self.acc if want[0] in self.above else None)
            if key in memo:
                value = memo[key]
            else:
                stack.append((key, self._lower(*want)))
                value = None
            while stack:
                key, steps = stack[-1]
                try:
                    node, idx, valid, simplified = steps.send(value)
                except StopIteration as lowered:
                    stack.pop()
                    value = memo[key] = self.simp(lowered.value)
                    continue
                want = (node, idx, valid) if simplified else self._simplified(node, idx, valid)
                break
            else:
                return value

    def _lower(self, n: UOp, idx: tuple, valid):
        """A generator: yields (node, index, gate, simplified?) for each value it needs."""
        op, arg = n.op, n.arg
        if n in self.params and (n is not self.root or op in (Ops.INPUT, Ops.WEIGHT, Ops.PARAM)):
            return self.load(n, idx, valid)
        if n is self.red:
            return self.acc
        if op is Ops.CONST:
            return n
        if op in ALU:
            src = []
            for s in n.src:
                src.append((yield s, idx, valid, True))
            return UOp(op, n.dtype, tuple(src), arg)
        src = n.src[0].shape if n.src else ()
        if op is Ops.RESHAPE:
            return (yield n.src[0], reshape_index(idx, n.shape, src), valid, False)
        if op is Ops.PERMUTE:
            out = [None] * len(idx)
            for i, o in enumerate(arg):
                out[o] = idx[i]
            return (yield n.src[0], tuple(out), valid, False)
        if op is Ops.EXPAND:
            return (yield n.src[0], tuple(iconst(0) if s == 1 else i for i, s in zip(idx, src)),
                    valid, False)
        if op is Ops.SHRINK:
            return (yield n.src[0], tuple(i + b for i, (b, _) in zip(idx, arg)), valid, False)
        if op is Ops.FLIP:
            return (yield n.src[0], tuple(iconst(s - 1) + i * -1 if d in arg else i
                                          for d, (i, s) in enumerate(zip(idx, src))), valid, False)
        if op is Ops.PAD:
            return (yield from self._pad(n, idx, valid))
        if op is Ops.WINDOW:
            return (yield from self._window(n, idx, valid))
        if op is Ops.GATHER:
            return (yield from self._gather(n, idx, valid))
        raise NotImplementedError(f"cannot lower {op}")

    def _pad(self, n: UOp, idx, valid):
        pads, fill = n.arg
        inside = all_true(*(c for i, (b, a), s in zip(idx, pads, n.src[0].shape)
                            for c in ((i.lt(b)).logical_not() if b else None,
                                      i.lt(b + s) if a else None)))
        inner = yield (n.src[0], tuple(i + -b for i, (b, _) in zip(idx, pads)),
                       all_true(valid, inside), False)
        return inner if inside is None else inside.where(inner, UOp.const(fill, n.dtype))

    def _window(self, n: UOp, idx, valid):
        ks, ss, ds = n.arg
        nsp, nlead = len(ks), len(n.src[0].shape) - len(ks)
        lead, outs, kern = idx[:nlead], idx[nlead:nlead + nsp], idx[nlead + nsp:]
        sp = tuple(o * s + k * d for o, k, s, d in zip(outs, kern, ss, ds))
        return (yield n.src[0], lead + sp, valid, False)

    def _gather(self, n: UOp, idx, valid):
        data, ind = n.src
        ax, r, size = n.arg, len(ind.shape), data.shape[n.arg]
        i = (yield ind, idx[ax:ax + r], valid, False).cast(IDX)
        i = i.lt(0).where(i + size, i).maximum(0).minimum(size - 1)  # clamp: never read outside
        return (yield data, idx[:ax] + (i,) + idx[ax + r:], valid, False)


def root_index(views: list[UOp], idx: tuple) -> tuple:
    """The index in the kernel root of the output whose reduction index is `idx`: `views` (from
    views_between) applied bottom-up."""
    for n in reversed(views):
        if n.op is Ops.RESHAPE:
            idx = reshape_index(idx, n.src[0].shape, n.shape)
        elif n.op is Ops.PERMUTE:
            idx = tuple(idx[o] for o in n.arg)
        elif n.op is Ops.PAD:  # a padded tensor's interior (layout.pad_in_place)
            idx = tuple(i + b for i, (b, _) in zip(idx, n.arg[0]))
    return idx


def views_between(root: UOp, red: UOp) -> list[UOp]:
    """The views on a path from root down to red: reshapes in the epilogue, a permute on top that
    stores in another layout, a pad on top whose interior the kernel writes. The scheduler only
    fuses epilogues whose paths all carry the same views, so the first path found is the
    answer."""
    stack, seen = [(root, [])], set()
    while stack:
        n, path = stack.pop()
        if n is red:
            return path
        if n in seen:
            continue
        seen.add(n)
        step = path + [n] if n.op in (Ops.RESHAPE, Ops.PERMUTE, Ops.PAD) else path
        stack.extend((s, step) for s in n.src)
    raise ValueError("kernel root does not depend on its reduction")


def _combine(op: Ops, vals: list[UOp]) -> UOp:
    acc = accumulator(vals[0].dtype)
    if acc is not vals[0].dtype:
        return _combine(op, [v.cast(acc) for v in vals]).cast(vals[0].dtype)
    while len(vals) > 1:  # a balanced tree keeps the dependency chain short
        vals = [vals[i].alu(op, vals[i + 1]) if i + 1 < len(vals) else vals[i]
                for i in range(0, len(vals), 2)]
    return vals[0]


def _ranges(plan: Plan) -> dict[int, UOp]:
    """{axis position: its index}: a RANGE per loop axis, keyed by position since two axes may
    be equal (a dim split into same-size parts); fused axes share one RANGE, split back into
    each member's value."""
    fused = {i for g in plan.fused for i in g}
    ranges = {n: UOp(Ops.RANGE, IDX, (iconst(a.size),), (n, a.kind))
              for n, a in enumerate(plan.axes) if a.kind in LOOP_KINDS and n not in fused}
    for group in plan.fused:
        members = [plan.axes[i] for i in group]
        r = UOp(Ops.RANGE, IDX, (iconst(math.prod(a.size for a in members)),),
                (group[0], members[0].kind))
        stride = 1
        for i in reversed(group):
            ranges[i] = (r // stride) % plan.axes[i].size
            stride *= plan.axes[i].size
    return ranges


@cache
def _dim_axes(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """Per full-shape dim, the positions of the axes that iterate it, inner to outer."""
    return tuple(tuple(reversed([n for n, a in enumerate(plan.axes) if a.dim == d]))
                 for d in range(len(plan.full_shape)))


def _dim_index(plan: Plan, values: dict, reduce_too: bool, memo: dict) -> tuple:
    """The full-shape index that axis values address (reduce dims 0 unless `reduce_too`).
    `memo`: each dim's index by its axis values, which most copies share."""
    out = []
    for d, ns in enumerate(_dim_axes(plan)):
        if d in plan.reduce_dims and not reduce_too:
            out.append(iconst(0))
            continue
        key = (d, *[values[n] for n in ns])
        if key not in memo:
            idx, stride = iconst(0), 1
            for n in ns:
                idx = idx + values[n] * stride
                stride *= plan.axes[n].size
            memo[key] = idx
        out.append(memo[key])
    return tuple(out)


def lane(width: int) -> UOp:
    """The lane of the vector axis, 0..width-1, in the index of a vector's copy (a RANGE, so the
    simplifier knows its bounds: (16*c + lane) // 16 is c)."""
    return UOp(Ops.RANGE, IDX, (iconst(width),), (-1, "lane"))


def _expanded(plan: Plan, kind: str, base: dict):
    """Axis values for every copy of the straight-line code that `kind` axes expand into. The
    vector axis (the last upcast axis, plan.lanes of its values per vector) expands per vector."""
    ns = [n for n, a in enumerate(plan.axes) if a.kind == kind]
    sizes = [plan.axes[n].size for n in ns]
    w = plan.lanes if kind == AxisKind.UPCAST else 1
    if w > 1:
        assert sizes[-1] % w == 0, "the vector axis is a whole number of vectors"
        sizes[-1] //= w
    for combo in product(*(range(s) for s in sizes)):
        values = {n: iconst(v) for n, v in zip(ns, combo)}
        if w > 1:
            values[ns[-1]] = lane(w) + combo[-1] * w if combo[-1] else lane(w)
        yield {**base, **values}


def _accumulate(lw: Lowerer, plan: Plan, ranges: dict, values: dict, upcast: bool) -> UOp:
    """The reduction's value for one output: its unrolled parts, accumulated over the reduce
    loops."""
    red = lw.red
    parts = [lw(red.src[0], _dim_index(plan, v, True, lw.dims))
             for v in _expanded(plan, AxisKind.UNROLL, values)]
    rr = [r for n, r in ranges.items()
          if plan.axes[n].kind in (AxisKind.REDUCE, AxisKind.GROUP)]
    if rr and not upcast and accumulator(red.dtype) is red.dtype:
        # a lone accumulator would wait on its own latency every step: each unrolled part gets
        # its own, summed after the loop (docs/perf.md)
        return _combine(red.arg[0], [UOp(Ops.REDUCE, red.dtype, (p, *rr), red.arg[0])
                                     for p in parts])
    if rr:  # unrolled parts accumulate one by one: acc += a*b chains become FMAs
        return UOp(Ops.REDUCE, red.dtype, (*parts, *rr), red.arg[0])
    return _combine(red.arg[0], parts)


# ops that lower to a polynomial of dozens of operations (transcendental.py)
HEAVY = {Ops.EXP, Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.COS, Ops.POW}


def _loops_epilogue(plan: Plan, lw: Lowerer, copies: int) -> bool:
    """Whether what follows the reduction runs as a loop over the register tile (the
    accumulators in a STACK, each trip PICKs one), not once per copy in straight-line code. For
    a heavy epilogue only: 24 straight-line copies of SiLU's exp were most of the C that clang
    compiled for the openpilot-shaped model. The loop costs a store and a load per accumulator,
    once per tile."""
    return plan.loop_epilogue and lw.red is not None and copies > 1 and \
        any(n.op in HEAVY for n in lw.above)


def _epilogue(plan: Plan, base: dict) -> tuple[dict, UOp]:
    """Axis values of the epilogue loop: a RANGE per upcast axis (the vector axis's counts
    vectors), and the copy each trip handles, numbered as _expanded yields them."""
    ns = [n for n, a in enumerate(plan.axes) if a.kind == AxisKind.UPCAST]
    w, values, copy = plan.lanes, {}, iconst(0)
    for n in ns:
        size = plan.axes[n].size // (w if n == ns[-1] else 1)
        r = UOp(Ops.RANGE, IDX, (iconst(size),), (n, AxisKind.EPILOGUE))
        values[n] = lane(w) + r * w if n == ns[-1] and w > 1 else r
        copy = copy * size + r
    return {**base, **values}, copy


def lower_kernel(kernel: Kernel, params: dict[UOp, int], param_dtypes: list, plan: Plan,
                 simp: Rewriter | None = None) -> UOp:
    """`simp`: simplifies as lowering builds (the caller rewrites the result with it after)."""
    lw = Lowerer(kernel, params, param_dtypes, simp)
    ranges = _ranges(plan)
    upcast = any(a.kind == AxisKind.UPCAST for a in plan.axes)
    views = views_between(kernel.root, lw.red) if lw.red is not None else []
    copies = list(_expanded(plan, AxisKind.UPCAST, ranges))
    looped = _loops_epilogue(plan, lw, len(copies))
    if looped:
        accs = tuple(_accumulate(lw, plan, ranges, v, upcast) for v in copies)
        values, copy = _epilogue(plan, ranges)
        lw.acc = UOp(Ops.PICK, accs[0].dtype, (UOp(Ops.STACK, accs[0].dtype, accs), lw.simp(copy)))
        copies = [values]
    stores = []
    for values in copies:
        if lw.red is not None and not looped:
            lw.acc = _accumulate(lw, plan, ranges, values, upcast)
        out_idx = root_index(views, _dim_index(plan, values, False, lw.dims))
        value = lw(kernel.root, out_idx)
        stores.append(UOp(Ops.STORE, dtypes.void,
                          (lw.param_uops[0], linear(out_idx, kernel.root.shape), value)))
    return UOp(Ops.SINK, dtypes.void, tuple(stores), plan.lanes)
