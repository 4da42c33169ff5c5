"""A kernel's loop plan: which loops it runs, in what order, and which dims are expanded into
straight-line code. plan_cpu.py and plan_gpu.py choose plans; lower.py turns one into scalar UOps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from compiler.codegen.l2fetch import Memory

LOOP_KINDS = ("global", "group", "loop", "reduce")
FULL_UNROLL = 8  # reduce dims up to this size disappear into straight-line code


@dataclass(frozen=True)
class Axis:
    dim: int  # which dim of the kernel's full shape this axis (or part of it) iterates
    size: int
    kind: str  # "global" | "loop" | "reduce" (loops) ; "upcast" | "unroll" (expanded)
    # GPU: "group" splits a reduce dim across the work items of one work-group (local ids);
    # each accumulates its share, then the group combines them through local memory


@dataclass(frozen=True)
class Plan:
    """The optimizer's choices for one kernel. Within one dim, axes are listed outer to inner."""
    full_shape: tuple[int, ...]
    reduce_dims: tuple[int, ...]
    axes: tuple[Axis, ...]
    local: tuple[int, ...] | None = None  # work-group size for GPU targets, in global_size order
    # GPU targets: positions in `axes` of adjacent "global" axes that one RANGE (one global id)
    # iterates together, since OpenCL has at most 3 global ids
    fused: tuple[tuple[int, ...], ...] = ()
    lanes: int = 1  # C targets: the last upcast axis is zipped into vectors of this many lanes
    # C targets: a heavy epilogue (lower.py) runs as a loop over the register tile
    loop_epilogue: bool = False
    # targets with l2fetch: the lowered kernel's memory model (codegen/l2fetch.py)
    memory: Memory | None = None

    @property
    def global_size(self) -> tuple[int, ...]:
        """Launch size per global id: id 0 (fastest varying) iterates the innermost global RANGE."""
        grouped = {i for g in self.fused for i in g[1:]}
        sizes = []
        for i, a in enumerate(self.axes):
            if a.kind in ("global", "group") and i not in grouped:
                group = next((g for g in self.fused if g[0] == i), (i,))
                sizes.append(math.prod(self.axes[j].size for j in group))
        return tuple(reversed(sizes)) or (1,)


def factor(size: int, limit: int) -> int:
    """The largest divisor of size that is <= limit."""
    for f in range(min(size, limit), 1, -1):
        if size % f == 0:
            return f
    return 1


def reduce_shape(red, root) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(full shape, reduce dims) of a kernel: its reduction's input shape, or its output's."""
    if red is None:
        return root.shape, ()
    return red.src[0].shape, red.arg[1]
