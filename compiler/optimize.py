"""Per-kernel loop plans: loop order, register tiles (upcast), unrolled reductions.

The plan is chosen from what each operand's index depends on, found by lowering the kernel once
with a plain one-loop-per-dim plan and reading the loads:
  * loop order (cache blocking): output dims that index the largest operand go outermost, so a
    tile of it stays in cache while the inner loops reuse it (a matmul walks a column strip of
    the weight once, not once per row);
  * register tile: the innermost output dim is upcast to the vector width (it is contiguous in
    the output and usually in the big operand, so it vectorises); one more output dim that the
    big operand does NOT depend on is upcast too, so each vector load of it feeds several
    accumulators;
  * the innermost reduction dim is unrolled (fully when short, like a 3x3 kernel row);
  * elementwise kernels upcast the innermost dim for vector width.
"""
from __future__ import annotations

import math
from dataclasses import replace

from compiler.lower import Axis, Plan, find_reduce, lower_kernel
from compiler.schedule import Kernel
from compiler.target import Target
from compiler.uop import Ops, UOp

FULL_UNROLL = 8  # reduce dims up to this size disappear into straight-line code
ROW_TILE = 6  # rows of accumulators per vector column (MLAS-style 6 x 2-vector tiles)


def _factor(size: int, limit: int) -> int:
    """The largest divisor of size that is <= limit."""
    for f in range(min(size, limit), 1, -1):
        if size % f == 0:
            return f
    return 1


def operand_dims(kernel: Kernel, params: dict[UOp, int], plan: Plan) -> list[tuple[int, set]]:
    """For each LOAD in the kernel: (buffer bytes, the full-shape dims its index depends on)."""
    dts = [kernel.root.dtype] + [n.dtype for n in sorted(params, key=params.get)]
    sink = lower_kernel(kernel, params, dts, plan)
    dim_of = {u: u.arg[0] for u in sink.toposort() if u.op is Ops.RANGE}
    axis_dim = [a.dim for a in plan.axes]
    out = []
    for u in sink.toposort():
        if u.op is Ops.LOAD:
            node = next(n for n, i in params.items() if i == u.src[0].arg[0])
            rs = {axis_dim[dim_of[r]] for r in u.src[1].toposort() if r.op is Ops.RANGE}
            out.append((node.size * node.dtype.itemsize, rs))
    return out


def plan_kernel(kernel: Kernel, realized: set, target: Target,
                params: dict[UOp, int] | None = None) -> Plan:
    if target.renderer != "c":
        return _plan_gpu(kernel, realized, target)
    red = find_reduce(kernel.root, realized)
    full = red.src[0].shape if red is not None else kernel.root.shape
    rdims = red.arg[1] if red is not None else ()
    lanes = max(target.vector_bytes // max(kernel.root.dtype.itemsize, 1), 1)
    out_dims = [d for d in range(len(full)) if d not in rdims and full[d] > 1]
    upcast: dict[int, int] = {}
    unroll: dict[int, int] = {}
    order = list(range(len(full)))
    if red is not None and params is not None and out_dims:
        plain = Plan(tuple(full), tuple(rdims), tuple(
            Axis(d, s, "reduce" if d in rdims else "loop") for d, s in enumerate(full) if s > 1))
        loads = operand_dims(kernel, params, plain)
        big = max(loads, key=lambda t: t[0])[1] if loads else set()
        order = sorted(order, key=lambda d: (d not in big, d))
        inner = out_dims[-1]
        upcast[inner] = _factor(full[inner], 2 * lanes if full[inner] >= 2 * lanes else lanes)
        reuse = [d for d in out_dims[:-1] if d not in big]
        if reuse:
            upcast[reuse[-1]] = _factor(full[reuse[-1]], ROW_TILE)
    elif red is not None and out_dims:
        inner = out_dims[-1]
        upcast[inner] = _factor(full[inner], lanes)
    if red is not None:
        rd = [d for d in rdims if full[d] > 1]
        if rd:
            last = rd[-1]
            unroll[last] = full[last] if full[last] <= FULL_UNROLL else _factor(full[last], 4)
    elif out_dims:
        upcast[out_dims[-1]] = _factor(full[out_dims[-1]], lanes)
    vec_dim = out_dims[-1] if out_dims else -1
    lanes = _lanes(upcast.get(vec_dim, 1), lanes) if target.renderer == "c" else 1
    axes: list[Axis] = []
    for d in order:
        size = full[d]
        if size == 1:
            continue
        kind = "reduce" if d in rdims else ("global" if target.renderer != "c" else "loop")
        split = unroll.get(d, 1) if d in rdims else upcast.get(d, 1)
        if split < size:
            axes.append(Axis(d, size // split, kind))
        if split > 1:
            axes.append(Axis(d, split, "unroll" if d in rdims else "upcast"))
    return Plan(tuple(full), tuple(rdims), tuple(_nest(axes, vec_dim)), lanes=lanes)


def _lanes(tile: int, width: int) -> int:
    """Vector lanes for a tile of `tile` elements: the register width, else a half register."""
    for w in (width, width // 2):
        if w > 1 and tile % w == 0:
            return w
    return 1


def _nest(axes: list[Axis], vec_dim: int) -> list[Axis]:
    """Loop nest: output loops (in the chosen order), then reduce loops; expanded axes last, the
    vector axis innermost so its lanes are consecutive stores."""
    rank = {"global": 0, "loop": 1, "reduce": 2, "upcast": 3, "unroll": 3}
    return sorted(axes, key=lambda a: (rank[a.kind], a.kind == "upcast" and a.dim == vec_dim))



# ---- GPU targets ----------------------------------------------------------------------------
# One work item per output tile; OpenCL gives a kernel at most 3 global ids.
GPU_VECTOR = 4  # float4/half4 loads and stores, and one RGBA texel per image read
GPU_GROUP = 128  # work-group size aimed for: two 64-wide waves on Adreno
GPU_MIN_ITEMS = 1024  # keep at least this many work items before tiling a second output dim


def _plan_gpu(kernel: Kernel, realized: set, target: Target) -> Plan:
    """Every output dim is a global id (outer ones fused down to 3); the innermost output dim is
    upcast by 4 so loads and stores are float4 and image reads fetch whole texels; reductions
    also tile one more output dim by 4 (16 accumulators per work item) while enough work items
    remain, and unroll their innermost reduce dim."""
    red = find_reduce(kernel.root, realized)
    full = red.src[0].shape if red is not None else kernel.root.shape
    rdims = red.arg[1] if red is not None else ()
    out_dims = [d for d in range(len(full)) if d not in rdims and full[d] > 1]
    upcast: dict[int, int] = {}
    unroll: dict[int, int] = {}
    items = math.prod(full[d] for d in out_dims)
    if out_dims:
        inner = out_dims[-1]
        upcast[inner] = _factor(full[inner], GPU_VECTOR)
        items //= upcast[inner]
        if red is not None and len(out_dims) > 1:
            other = max(out_dims[:-1], key=lambda d: full[d])
            f = _factor(full[other], GPU_VECTOR)
            if items // f >= GPU_MIN_ITEMS:
                upcast[other] = f
    rd = [d for d in rdims if full[d] > 1]
    if rd:
        last = rd[-1]
        unroll[last] = full[last] if full[last] <= FULL_UNROLL else _factor(full[last], 4)
    axes: list[Axis] = []
    for d, size in enumerate(full):
        if size == 1:
            continue
        kind = "reduce" if d in rdims else "global"
        split = unroll.get(d, 1) if d in rdims else upcast.get(d, 1)
        if split < size:
            axes.append(Axis(d, size // split, kind))
        if split > 1:
            axes.append(Axis(d, split, "unroll" if d in rdims else "upcast"))
    axes = _nest(axes, out_dims[-1] if out_dims else -1)
    n_global = sum(a.kind == "global" for a in axes)
    fused = (tuple(range(n_global - 2)),) if n_global > 3 else ()  # outermost ones share id 2
    plan = Plan(tuple(full), tuple(rdims), tuple(axes), fused=fused)
    return replace(plan, local=_local_size(plan.global_size, min(target.max_workgroup,
                                                                  GPU_GROUP)))


def _local_size(global_size: tuple[int, ...], budget: int) -> tuple[int, ...] | None:
    """Work-group size dividing the global size exactly (OpenCL 1.2 has no partial groups),
    filling id 0 first: neighbouring work items along id 0 touch neighbouring addresses."""
    if math.prod(global_size) == 1:
        return None
    local = []
    for g in global_size:
        f = _factor(g, budget)
        local.append(f)
        budget //= f
    return tuple(local)
