"""What the schedule hands codegen and codegen hands the link stage: a kernel (the tensor it
computes and the buffers it reads) and its loop plan (axes of an AxisKind). Both stages import
this module; neither imports the other's types."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from compiler.ir.uop import Ops, UOp


class AxisKind(StrEnum):
    """How a plan axis, and the RANGE lowered from it, runs. String-valued: a RANGE's arg and
    the kernel cache's pickles print as before."""
    GLOBAL = "global"  # a work-item id (GPU)
    GROUP = "group"  # GPU: a reduce dim split across one work-group's items (local ids)
    LOOP = "loop"  # an output loop (CPU)
    REDUCE = "reduce"
    UPCAST = "upcast"  # expanded into straight-line copies of an output dim (a register tile)
    UNROLL = "unroll"  # expanded copies of a reduce dim
    EPILOGUE = "epilogue"  # a loop over the register tile after a reduction (lower.py)


LOOP_KINDS = (AxisKind.GLOBAL, AxisKind.GROUP, AxisKind.LOOP, AxisKind.REDUCE)  # RANGEs
WORK_ITEM_KINDS = (AxisKind.GLOBAL, AxisKind.GROUP)  # RANGEs that are work-item ids, not loops


@dataclass(frozen=True)
class Kernel:
    """A scheduled kernel; frozen: later stages make new ones (dataclasses.replace)."""
    name: str
    root: UOp  # the tensor this kernel computes
    inputs: list[UOp]  # realized tensors / graph inputs / weights it reads, in parameter order
    # the tensor whose buffer this kernel writes, when that is not its root: a padded tensor
    # its fill kernel fills before the interior is computed (layout.pad_in_place), or a
    # residual the kernel overwrites in place (layout.in_place)
    into: UOp | None = None


def find_reduce(root: UOp, realized: set) -> UOp | None:
    """The kernel's fused reduction: the scheduler guarantees at most one per kernel."""
    stack, seen = [root], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op is Ops.REDUCE and (n is root or n not in realized):
            return n
        if n is root or n not in realized:
            stack.extend(n.src)
    return None


@dataclass(frozen=True)
class Axis:
    dim: int  # which dim of the kernel's full shape this axis (or part of it) iterates
    size: int
    kind: AxisKind


@dataclass(frozen=True)
class Plan:
    """The optimizer's choices for one kernel. Within one dim, axes are listed outer to inner."""
    full_shape: tuple[int, ...]
    reduce_dims: tuple[int, ...]
    axes: tuple[Axis, ...]
    local: tuple[int, ...] | None = None  # work-group size for GPU targets, in global_size order
    # GPU targets: positions in `axes` of adjacent GLOBAL axes that one RANGE (one global id)
    # iterates together, since OpenCL has at most 3 global ids
    fused: tuple[tuple[int, ...], ...] = ()
    lanes: int = 1  # C targets: the last upcast axis is zipped into vectors of this many lanes
    # C targets: a heavy epilogue (lower.py) runs as a loop over the register tile
    loop_epilogue: bool = False
    # targets with l2fetch: the lowered kernel's memory model (codegen/l2fetch.py Memory)
    memory: object = None

    @property
    def global_size(self) -> tuple[int, ...]:
        """Launch size per global id: id 0 (fastest varying) iterates the innermost global RANGE."""
        grouped = {i for g in self.fused for i in g[1:]}
        sizes = []
        for i, a in enumerate(self.axes):
            if a.kind in WORK_ITEM_KINDS and i not in grouped:
                group = next((g for g in self.fused if g[0] == i), (i,))
                sizes.append(math.prod(self.axes[j].size for j in group))
        return tuple(reversed(sizes)) or (1,)
