"""Helpers of the planners (plan_cpu.py, plan_gpu.py), which choose a kernel's loop plan
(compiler/ir/kernel.py Plan); lower.py turns one into scalar UOps."""
from __future__ import annotations

FULL_UNROLL = 8  # reduce dims up to this size disappear into straight-line code


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
