"""GPU loop plans (targets whose output dims are global ids): one work item per output tile;
OpenCL gives a kernel at most 3 global ids."""
from __future__ import annotations

import math
from dataclasses import replace

from compiler.codegen.plan import FULL_UNROLL, factor, reduce_shape
from compiler.ir.kernel import Axis, AxisKind, Kernel, Plan, find_reduce
from compiler.ir.uop import UOp
from compiler.target import Target

GPU_VECTOR = 4  # float4/half4 loads and stores, and one RGBA texel per image read
GPU_GROUP = 128  # work-group size aimed for: two 64-wide waves on Adreno
GPU_MIN_ITEMS = 1024  # fewer work items than this: tile less, or split the reduction
GPU_MIN_GROUP = 16  # a work-group reduction over fewer lanes is not worth its barriers


def plan_gpu(kernel: Kernel, params: dict[UOp, int], target: Target) -> Plan:
    """Every output dim is a global id (outer ones fused down to 3); the innermost output dim is
    upcast by 4 so loads and stores are float4 and image reads fetch whole texels; reductions
    also tile one more output dim by 4 (16 accumulators per work item) while enough work items
    remain, and unroll their innermost reduce dim. A reduction with too few outputs to fill the
    device (LayerNorm rows, a pooled vector) is split across a work-group instead ("group" axis:
    each work item sums a strided share, local memory combines the shares)."""
    red = find_reduce(kernel.root, set(params))
    full, rdims = reduce_shape(red, kernel.root)
    out_dims = [d for d in range(len(full)) if d not in rdims and full[d] > 1]
    upcast: dict[int, int] = {}
    unroll: dict[int, int] = {}
    items = math.prod(full[d] for d in out_dims)
    if out_dims:
        inner = out_dims[-1]
        upcast[inner] = factor(full[inner], GPU_VECTOR)
        items //= upcast[inner]
        if red is not None and len(out_dims) > 1:
            other = max(out_dims[:-1], key=lambda d: full[d])
            # an odd size (a transformer's 25 tokens) takes its divisor up to 8 (5) rather
            # than no tile: each weight read then serves 5 rows, not 1. Fewer work items are
            # worth that when the tile cuts the traffic by 4 or more.
            f = factor(full[other], GPU_VECTOR)
            f = f if f > 1 else factor(full[other], 2 * GPU_VECTOR)
            if items // f >= (GPU_MIN_ITEMS // 2 if f >= GPU_VECTOR else GPU_MIN_ITEMS):
                upcast[other] = f
    rd = [d for d in rdims if full[d] > 1]
    group = 0
    if rd:
        last = rd[-1]
        if items < GPU_MIN_ITEMS:
            group = _pow2_factor(full[last], min(target.max_workgroup, GPU_GROUP))
            group = group if group >= GPU_MIN_GROUP else 0
        share = full[last] // max(group, 1)
        unroll[last] = share if share <= FULL_UNROLL and not group else factor(share, 4)
    axes: list[Axis] = []
    for d, size in enumerate(full):
        if size == 1:
            continue
        kind = AxisKind.REDUCE if d in rdims else AxisKind.GLOBAL
        split = unroll.get(d, 1) if d in rdims else upcast.get(d, 1)
        across = group if group and d == rd[-1] else 1
        if split * across < size:
            axes.append(Axis(d, size // (split * across), kind))
        if across > 1:  # between the loop and the unrolled part: work items read side by side
            axes.append(Axis(d, across, AxisKind.GROUP))
        if split > 1:
            axes.append(Axis(d, split, AxisKind.UNROLL if d in rdims else AxisKind.UPCAST))
    # global ids first, then the loops; within a dim the order above (outer to inner) is kept
    rank = {AxisKind.GLOBAL: 0, AxisKind.REDUCE: 1, AxisKind.GROUP: 1, AxisKind.UPCAST: 2,
            AxisKind.UNROLL: 2}
    axes = sorted(axes, key=lambda a: rank[a.kind])
    n_global = sum(a.kind == AxisKind.GLOBAL for a in axes)
    keep = 3 - (group > 0)  # the group's local id takes one of OpenCL's 3 ids
    fused = (tuple(range(n_global - keep + 1)),) if n_global > keep else ()
    plan = Plan(tuple(full), tuple(rdims), tuple(axes), fused=fused)
    if group:
        return replace(plan, local=(group,) + (1,) * (len(plan.global_size) - 1))
    return replace(plan, local=_local_size(plan.global_size, min(target.max_workgroup,
                                                                  GPU_GROUP)))


def _pow2_factor(size: int, limit: int) -> int:
    """The largest power of two dividing size that is <= limit (halving trees need one)."""
    f = 1
    while size % (f * 2) == 0 and f * 2 <= limit:
        f *= 2
    return f


def _local_size(global_size: tuple[int, ...], budget: int) -> tuple[int, ...] | None:
    """Work-group size dividing the global size exactly (OpenCL 1.2 has no partial groups),
    filling id 0 first: neighbouring work items along id 0 touch neighbouring addresses."""
    if math.prod(global_size) == 1:
        return None
    local = []
    for g in global_size:
        f = factor(g, budget)
        local.append(f)
        budget //= f
    return tuple(local)
