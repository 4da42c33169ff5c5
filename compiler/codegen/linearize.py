"""Kernel graph (SINK of STOREs over RANGEs) -> one ordered list of UOps with loop structure.

Placement rule: a node goes in the innermost loop whose range it depends on, so anything that is
loop-invariant is hoisted for free. A kernel has one group of reduce ranges, innermost; accumulators
are declared just outside them and everything that uses a reduction comes after them (inside
the epilogue loops, lower.py, where it depends on their ranges).
"""
from __future__ import annotations

from compiler.ir.kernel import AxisKind
from compiler.ir.uop import Ops, UOp

# group: a local id, not a loop; epilogue: after the reduce loops, over the register tile
KIND_ORDER = {AxisKind.GLOBAL: 0, AxisKind.GROUP: 1, AxisKind.LOOP: 2, AxisKind.REDUCE: 3,
              AxisKind.EPILOGUE: 4}


def _range_deps(order: list[UOp]) -> dict[UOp, frozenset]:
    deps: dict[UOp, frozenset] = {}
    for u in order:
        if u.op is Ops.RANGE:
            deps[u] = frozenset((u,))
            continue
        d = frozenset().union(*(deps[s] for s in u.src)) if u.src else frozenset()
        if u.op is Ops.REDUCE:
            d = d - frozenset(u.ranges)
        deps[u] = d
    return deps


def _after_reduce(order: list[UOp], deps: dict[UOp, frozenset], epilogue: frozenset) -> set[UOp]:
    """What runs after the reduce loops: the reductions' users, and what an epilogue loop needs."""
    post: set[UOp] = set()
    for u in order:
        if u.op in (Ops.REDUCE, Ops.STORE) or deps[u] & epilogue or any(s in post for s in u.src):
            post.add(u)
    return post


def linearize(sink: UOp) -> list[UOp]:
    order = sink.toposort()
    ranges = sorted((u for u in order if u.op is Ops.RANGE),
                    key=lambda r: (KIND_ORDER[r.arg[1]], r.arg[0]))
    outer = [r for r in ranges if r.arg[1] not in (AxisKind.REDUCE, AxisKind.EPILOGUE)]
    inner = [r for r in ranges if r.arg[1] == AxisKind.REDUCE]
    epilogue = [r for r in ranges if r.arg[1] == AxisKind.EPILOGUE]
    deps = _range_deps(order)
    post = _after_reduce(order, deps, frozenset(epilogue))
    depth_of = {r: i + 1 for i, r in enumerate(ranges)}

    def depth(u: UOp) -> int:
        return max((depth_of[r] for r in deps[u]), default=0)

    body = [u for u in order if u not in post and u.op not in (Ops.RANGE, Ops.SINK)]
    levels: list[list[UOp]] = [[] for _ in range(len(ranges) + 1)]
    for u in body:
        levels[depth(u)].append(u)
    reduces = [u for u in order if u.op is Ops.REDUCE]
    tail: list[list[UOp]] = [[] for _ in range(len(epilogue) + 1)]  # by epilogue loop depth
    for u in order:
        if u in post and u.op not in (Ops.REDUCE, Ops.RANGE):
            tail[max((epilogue.index(r) + 1 for r in deps[u] if r in epilogue), default=0)].append(u)

    out = list(levels[0])
    for i, r in enumerate(outer):
        out += [r] + levels[i + 1]
    out += [UOp(Ops.DEFINE_ACC, r.dtype, (r,)) for r in reduces]
    for i, r in enumerate(inner):
        out += [r] + levels[len(outer) + i + 1]
    out += reduces  # each is "acc = op(acc, value)" at the innermost reduce depth
    out += [UOp(Ops.ENDRANGE, r.dtype, (r,)) for r in reversed(inner)]
    out += tail[0]
    for i, r in enumerate(epilogue):
        out += [r] + tail[i + 1]
    out += [UOp(Ops.ENDRANGE, r.dtype, (r,)) for r in reversed(outer + epilogue)]
    return out
