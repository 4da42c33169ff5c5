"""Tensor graph -> ordered kernels.

Three decisions live here:
  1. fold: every weight-only subgraph is evaluated at compile time (numpy), so kernels only see
     inputs, weights and constants;
  2. realize: which tensors get a buffer. Everything else is inlined into its consumers, so
     elementwise chains fuse into producers and consumers (conv + bias + act + residual = 1 kernel);
  3. order: kernels in dependency order, one per realized tensor.
"""
from __future__ import annotations

import numpy as np

from compiler.ir.dtypes import dtypes
from compiler.ir.interp import evaluate
from compiler.ir.kernel import Kernel
from compiler.ir.rewrite import PatternMatcher, UPat, graph_rewrite
from compiler.ir.tensor import Tensor
from compiler.ir.uop import ALU, MOVEMENT, Ops, UOp

# Folding never materialises a weight much larger than the data it came from (an expanded bias
# stays a view of the small bias); below this many elements size does not matter.
FOLD_FREE_ELEMENTS = 1 << 16
PADDED_COPY_DEPTH = 32  # reduction length from which a conv reads a materialized padded input
PAD_WASTE = 2  # a PAD this many times its input realizes the costly ALU nodes under it
EXPENSIVE = {Ops.EXP2, Ops.EXP, Ops.LOG2, Ops.SIN, Ops.COS, Ops.SQRT, Ops.FDIV, Ops.RECIP, Ops.POW, Ops.IDIV, Ops.MOD}


# ---- 1. fold ------------------------------------------------------------------------------
def uniform(u: UOp):
    """The single value of a tensor whose elements are all equal, else None."""
    while u.op in MOVEMENT:
        if u.op is Ops.PAD:
            inner = uniform(u.src[0])
            return inner if inner is not None and inner == u.arg[1] else None
        u = u.src[0]
    return u.arg if u.op is Ops.CONST else None


def static(u: UOp) -> bool:
    while u.op in MOVEMENT:
        u = u.src[0]
    if u.op is Ops.GATHER:
        return static(u.src[0]) and static(u.src[1])
    return u.op in (Ops.CONST, Ops.WEIGHT)


def _leaf_elements(u: UOp) -> int:
    return sum(n.size for n in u.toposort() if n.op is Ops.WEIGHT)


def _as_tensor(value: np.ndarray) -> UOp:
    flat = value.reshape(-1)
    if flat.size and (flat == flat[0]).all() and not np.isnan(flat[0]) if flat.dtype.kind == "f" \
            else flat.size and (flat == flat[0]).all():
        return Tensor.full(flat[0].item(), dtypes.from_np(value.dtype), value.shape).uop
    return Tensor.weight(value).uop


def _fold(x: UOp) -> UOp | None:
    if x.op in MOVEMENT and x.src[0].op is not Ops.CONST:
        v = uniform(x)
        return Tensor.full(v, x.dtype, x.shape).uop if v is not None else None
    if not (x.op in ALU or x.op in (Ops.REDUCE, Ops.GATHER)) or not all(map(static, x.src)):
        return None
    if x.size > max(FOLD_FREE_ELEMENTS, _leaf_elements(x)):
        return None
    return _as_tensor(evaluate(x))


def _merge_movement(x: UOp) -> UOp | None:
    inner = x.src[0]
    if x.op is Ops.RESHAPE and inner.op is Ops.RESHAPE:
        return UOp(Ops.RESHAPE, x.dtype, inner.src, x.arg) if inner.src[0].shape != x.arg \
            else inner.src[0]
    if x.op is Ops.PERMUTE and inner.op is Ops.PERMUTE:
        order = tuple(inner.arg[i] for i in x.arg)
        return inner.src[0] if order == tuple(range(len(order))) else \
            UOp(Ops.PERMUTE, x.dtype, inner.src, order)
    if x.op is Ops.EXPAND and inner.op is Ops.EXPAND:
        return UOp(Ops.EXPAND, x.dtype, inner.src, x.arg)
    return None


tensor_rules = PatternMatcher([
    (UPat(MOVEMENT | ALU | {Ops.REDUCE, Ops.GATHER}, name="x"), _fold),
    (UPat({Ops.RESHAPE, Ops.PERMUTE, Ops.EXPAND}, name="x"), _merge_movement),
])


# ---- 2. realize ---------------------------------------------------------------------------
def consumers(roots: list[UOp]) -> dict[UOp, list[UOp]]:
    users: dict[UOp, list[UOp]] = {}
    for r in roots:
        for u in r.toposort():
            users.setdefault(u, [])
            for s in u.src:
                if u not in users.setdefault(s, []):
                    users[s].append(u)
    return users


def inlined(u: UOp, realized: set) -> list[UOp]:
    """`u` and the nodes its kernel computes or reads: the walk includes realized sources but
    does not enter them."""
    out, stack, seen = [], [u], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        out.append(n)
        if n is u or n not in realized:
            stack.extend(n.src)
    return out


def _reduces_in(u: UOp, realized: set) -> list[UOp]:
    return [n for n in inlined(u, realized) if n.op is Ops.REDUCE and (n is u or n not in realized)]


def _duplicated_work(root: UOp, realized: set, recompute: bool = False) -> set[UOp]:
    """ALU nodes under a broadcasting view (EXPAND, overlapping WINDOW) or a PAD that at least
    doubles its input: inlining them would recompute them once per broadcast element (a relu
    before a conv would run Cout*K*K times per input), or at every padded position (a warp
    shifted into a queue as Concat(Slice(q, 1..), warp) would run once per queue row). Inside
    reductions any such node is realized; in elementwise kernels only costly ones.
    The padded input of a deep windowed reduction (a conv over many channels) is realized too:
    one copy with zero borders beats a bounds check on every one of its Cin*K*K reads.
    `recompute` (target.recompute_cheap): a node inside a reduction stays inlined when it is one
    ALU op reading one tensor of its own size (the rest broadcast, _one_full_read): the
    reduction reads that tensor in place of the node's, so no bytes are added and one write and
    one read are saved; and a costly gather index is stored as the gathered values where they
    are fewer bytes (_values_over_index)."""
    reds = _reduces_in(root, realized)
    depth = reds[0].src[0].size // max(reds[0].size, 1) if reds else 0
    hits, stack, seen = set(), [(root, False)], set()
    while stack:
        n, dup = stack.pop()
        if (n, dup) in seen:
            continue
        seen.add((n, dup))
        if dup and recompute and n.op is Ops.GATHER and _values_over_index(n, realized):
            hits.add(n)
            continue
        if dup and n.op in ALU and not static(n) and (
                _costly(n, realized) or reds and not (recompute and _one_full_read(n, realized))):
            hits.add(n)
            continue
        if dup and n.op is Ops.PAD and depth >= PADDED_COPY_DEPTH and not static(n):
            hits.add(n)
            continue
        # a PAD to twice its input or more (a Concat's piece, a queue's new row) computes its
        # input at every padded position too, where the value is masked off
        grows = n.op in (Ops.EXPAND, Ops.WINDOW) or \
            n.op is Ops.PAD and n.size >= PAD_WASTE * n.src[0].size
        stack.extend((s, dup or grows) for s in n.src if s not in realized)
    return hits


def _values_over_index(g: UOp, realized: set) -> bool:
    """On a target memory bounds (recompute_cheap), a duplicated gather whose index is costly
    to compute is realized as its gathered values where they are no more bytes than the index
    (the warp's uint8 samples against their int32 indices): the index kernel reads the source
    itself, and its index arithmetic stays in view of the gather's load (a frame read as an
    image takes (column, row) without dividing). A CPU keeps storing the index: a gather in
    the coordinate kernel would cost that kernel its vectors (plan_cpu.GATHER_LANES)."""
    ind = g.src[1]
    return ind not in realized and not static(g) and _costly(ind, realized) and \
        g.size * g.dtype.itemsize <= ind.size * ind.dtype.itemsize


def realize(outputs: list[UOp], recompute: bool = False) -> set[UOp]:
    users = consumers(outputs)
    order = [u for u in _topo(outputs)]
    realized = set(outputs)
    for u in order:  # reductions end kernels unless an elementwise chain continues them
        if u.op is Ops.REDUCE:
            realized.add(u)
    rank = {u: i for i, u in enumerate(order)}
    for r in [u for u in order if u.op is Ops.REDUCE and u not in outputs]:
        _fuse_epilogue(r, users, realized, rank)  # a reduction that is an output stays one
    for u in order:  # shared, expensive subexpressions are computed once
        # but not inside a fused epilogue (u inlines its reduction): every user of u is in that
        # kernel, and realizing two such nodes would compute the reduction twice
        if u not in realized and u.op in ALU and len(users[u]) > 1 and _costly(u, realized) \
                and not _reduces_in(u, realized):
            realized.add(u)
    changed = True
    while changed:
        changed = False
        for u in list(realized):
            hits = _duplicated_work(u, realized, recompute)
            if hits:
                realized |= hits
                changed = True
    _merge_into_consumer(order, outputs, users, realized, recompute)
    return realized


def _merge_into_consumer(order: list[UOp], outputs: list[UOp], users: dict, realized: set,
                         recompute: bool) -> None:
    """A realized elementwise tensor whose users all lie in one other kernel is computed in
    that kernel instead (which computes a shared node once): one write and one read fewer. Not
    where the kernel would broadcast it (_duplicated_work would realize it again). Exact GELU's
    erf, realized piece by piece as shared costly subexpressions (its reciprocal, exp and square
    among a dozen uses), becomes one kernel instead of six."""
    outs = set(outputs)
    for u in reversed(order):  # consumers first, so a chain folds into its last kernel
        if u not in realized or u in outs or u.op not in ALU or _reduces_in(u, realized):
            continue
        roots = _kernels_reading(u, users, realized)
        if len(roots) == 1 and not _duplicated_work(next(iter(roots)), realized - {u},
                                                     recompute):
            realized.discard(u)


def _kernels_reading(u: UOp, users: dict, realized: set) -> set[UOp]:
    """The realized tensors whose kernels read u: its users, or theirs through inlined nodes."""
    out, stack, seen = set(), list(users[u]), set()
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            if n in realized:
                out.add(n)
            else:
                stack.extend(users[n])
    return out


def _fuse_epilogue(r: UOp, users: dict, realized: set, rank: dict) -> None:
    """Move the realization of reduction `r` down to where its elementwise consumers rejoin:
    relu(conv + bias) uses the sum twice (compare and select) and is still one kernel."""
    end = r
    while True:
        join = _rejoin(end, users, realized, rank, r)
        if join is None:
            break
        end = join
        if end in realized:  # a graph output: the chain stops here
            break
    if end is not r:
        realized.discard(r)
        realized.add(end)


def _rejoin(start: UOp, users: dict, realized: set, rank: dict, r: UOp) -> UOp | None:
    """The first node every path from `start` passes through, if the nodes on the way are
    unrealized, elementwise (or reshapes) of r's size, and bring in no other reduction."""
    frontier, region = set(users[start]), {start}
    if start is not r and start in realized:
        return None
    for _ in range(64):
        if not frontier:
            return None
        n = min(frontier, key=rank.__getitem__)
        if not (n.op in ALU or n.op is Ops.RESHAPE) or n.size != r.size:
            return None
        others = [s for s in n.src if s not in region and s not in realized]
        if any(_reduces_in(s, realized) for s in others):
            return None
        if len(frontier) == 1:
            return n
        if n in realized:
            return None
        frontier.remove(n)
        region.add(n)
        frontier |= set(users[n])
    return None


def _one_full_read(u: UOp, realized: set) -> bool:
    """u is one ALU op reading exactly one tensor (realized, input or weight) as large as itself
    (x * s[c], relu(x)): recomputed per multiply-add of a reduction, it adds half the ALU work
    at most, where a LayerNorm's normalization (4 ops) would triple it."""
    body = inlined(u, realized)
    leaves = [n for n in body[1:] if n in realized or n.op in (Ops.INPUT, Ops.WEIGHT)]
    ops = [n for n in body if n.op in ALU and (n is u or n not in realized)]
    return len(ops) == 1 and sum(n.size >= u.size for n in leaves) == 1


def _costly(u: UOp, realized: set) -> bool:
    body = [n for n in inlined(u, realized) if n is u or n not in realized]
    return sum(n.op in ALU for n in body) > 6 or any(n.op in EXPENSIVE for n in body)


def _topo(roots: list[UOp]) -> list[UOp]:
    seen, order = set(), []
    for r in roots:
        for u in r.toposort():
            if u not in seen:
                seen.add(u)
                order.append(u)
    return order


# ---- 3. order -----------------------------------------------------------------------------
def schedule(outputs: list[UOp], track: tuple[UOp, ...] = (), recompute: bool = False
             ) -> tuple[list[UOp], list[Kernel], set[UOp], list[UOp]]:
    """Returns (folded outputs, kernels in order, realized set, `track` folded). `track`: more
    tensors to fold in the same rewrite, so they are the very nodes the kernels hold (a second
    rewrite would build new weights, and new nodes above them): the ONNX nodes' outputs, for
    provenance. `recompute`: the target's recompute_cheap (see _duplicated_work)."""
    sink = UOp(Ops.SINK, dtypes.void, tuple(outputs) + tuple(track))
    folded = list(graph_rewrite(sink, tensor_rules).src)
    folded, tracked = folded[:len(outputs)], folded[len(outputs):]
    realized = realize(folded, recompute)
    kernels = []
    for u in _topo(folded):
        if u in realized and not (u.op in (Ops.INPUT, Ops.WEIGHT, Ops.CONST) and u not in folded):
            kernels.append(kernel_of(u, realized, f"k{len(kernels)}"))
    return folded, kernels, realized, tracked


def kernel_of(u: UOp, realized: set, prefix: str) -> Kernel:
    """The kernel computing `u`, named `prefix` and what it does, reading the realized tensors
    (and inputs and weights) it reaches."""
    reads = [n for n in inlined(u, realized)[1:] if n in realized
             or n.op in (Ops.INPUT, Ops.WEIGHT)]
    if u.op in (Ops.INPUT, Ops.WEIGHT):
        reads = [u]  # an output that is an input or weight: a copy kernel
    return Kernel(f"{prefix}_{_describe(u, realized)}", u, list(dict.fromkeys(reads)))


def _describe(u: UOp, realized: set) -> str:
    """A short kernel name from its heaviest op: readable in profiles and inspect output."""
    body = inlined(u, realized)
    red = [n for n in body if n.op is Ops.REDUCE]
    if red:
        kind = "r" + red[0].arg[0].name.lower()
    else:
        kind = "e" if any(n.op in ALU for n in body) else "copy"
    return f"{kind}_{'x'.join(map(str, u.shape)) or '1'}"

