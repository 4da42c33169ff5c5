"""Per-kernel loop plans: which axes loop, which are upcast into registers, which reductions unroll.

Heuristics, stated once:
  * reductions keep a register tile of outputs: the innermost output dim (contiguous in the output
    and usually in one operand, so it vectorises) times one more output dim (reuse of the other
    operand), at most `tile` accumulators;
  * the innermost reduction dim is unrolled (fully when short, like a 3x3 kernel row);
  * elementwise kernels upcast the innermost dim for vector width.
"""
from __future__ import annotations

from compiler.lower import Axis, Plan, find_reduce
from compiler.schedule import Kernel
from compiler.target import Target

FULL_UNROLL = 8  # reduce dims up to this size disappear into straight-line code


def _factor(size: int, limit: int) -> int:
    for f in (16, 8, 4, 3, 2):
        if f <= limit and size % f == 0 and size > f // 2:
            return f
    return 1


def plan_kernel(kernel: Kernel, realized: set, target: Target) -> Plan:
    red = find_reduce(kernel.root, realized)
    full = red.src[0].shape if red is not None else kernel.root.shape
    rdims = red.arg[1] if red is not None else ()
    lanes = max(target.vector_bytes // max(kernel.root.dtype.itemsize, 1), 1)
    upcast: dict[int, int] = {}
    unroll: dict[int, int] = {}
    out_dims = [d for d in range(len(full)) if d not in rdims and full[d] > 1]
    if red is not None:
        tile = target.registers * 2  # accumulators: about half the vector register file
        if out_dims:
            inner = out_dims[-1]
            upcast[inner] = _factor(full[inner], min(lanes, tile))
            rest = sorted(out_dims[:-1], key=lambda d: -full[d])
            if rest:
                upcast[rest[0]] = _factor(full[rest[0]], max(tile // upcast[inner], 1))
        rd = [d for d in rdims if full[d] > 1]
        if rd:
            last = rd[-1]
            unroll[last] = full[last] if full[last] <= FULL_UNROLL else _factor(full[last], 4)
    elif out_dims:
        upcast[out_dims[-1]] = _factor(full[out_dims[-1]], lanes)
    axes: list[Axis] = []
    for d, size in enumerate(full):
        if size == 1:
            continue
        kind = "reduce" if d in rdims else ("global" if target.renderer != "c" else "loop")
        split = unroll.get(d, 1) if d in rdims else upcast.get(d, 1)
        if split < size:
            axes.append(Axis(d, size // split, kind))
        if split > 1:
            axes.append(Axis(d, split, "unroll" if d in rdims else "upcast"))
    return Plan(tuple(full), tuple(rdims), tuple(_order(axes)))


def _order(axes: list[Axis]) -> list[Axis]:
    """Loop nest: output loops in dim order, then reduce loops; expanded axes anywhere."""
    rank = {"global": 0, "loop": 1, "reduce": 2, "upcast": 3, "unroll": 3}
    return sorted(axes, key=lambda a: rank[a.kind])
