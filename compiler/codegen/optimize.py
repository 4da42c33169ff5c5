"""Per-kernel loop plans: loop order, register tiles (upcast), unrolled reductions.

The plan is chosen from what each operand's index depends on, found by lowering the kernel once
with a plain one-loop-per-dim plan and reading the loads:
  * loop nest (cache blocking): the order of the output tile loops, possibly with one dim split
    into a cache block, that streams the fewest bytes into L1 under a simple cache model
    (_traffic), so a tile of an operand stays in cache while the inner loops reuse it (a matmul
    walks a column strip of the weight once, not once per row);
  * register tile: the innermost output dim is upcast to the vector width (it is contiguous in
    the output and usually in the big operand, so it vectorises); one more output dim that the
    big operand does NOT depend on is upcast too, so each vector load of it feeds several
    accumulators;
  * the innermost reduction dim is unrolled (fully when short, like a 3x3 kernel row);
  * elementwise kernels upcast the innermost dim for vector width.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, replace

from compiler.codegen.lower import Axis, Plan, find_reduce, lower_kernel
from compiler.schedule.fusion import Kernel, inlined
from compiler.ir.tensor import Tensor
from compiler.target import LINE_BYTES, Target
from compiler.ir.rewrite import graph_rewrite, substitute
from compiler.ir.symbolic import linear_form, symbolic
from compiler.ir.uop import ALU, Ops, UOp

FULL_UNROLL = 8  # reduce dims up to this size disappear into straight-line code
GATHER_LANES = 2  # what a vector of per-lane scalar loads is worth, in lanes
WINDOW_UNROLL = 32  # whole reductions up to this size too (3x3 and 5x5 depthwise windows)
MAX_ROWS = 8  # accumulator rows: past this, code size (and compile time) grows for no gain
SHORT_REDUCE = 64  # reductions shorter than this pay for a scattered store like for a gather
MIN_OUTER_TRIPS = 8  # the outermost loop is what threads share: enough trips to balance them
# tiles in a cache block's inner loop: more walk so many rows a power-of-two stride apart (256
# channels: 1 KiB) that they collide in L1's sets (measured: 7 tiles of 8 pixels ran 1.8x slower)
BLOCK_TILES = 4
DRAM_COST = 4  # a byte from memory costs this many from L2 (~15 against ~60 GB/s, one core)
MAX_VREGS = 3  # accumulator columns, in vectors (measured: wider tiles stream more, gain nothing)


def _factor(size: int, limit: int) -> int:
    """The largest divisor of size that is <= limit."""
    for f in range(min(size, limit), 1, -1):
        if size % f == 0:
            return f
    return 1


@dataclass
class Operand:
    nbytes: int
    itemsize: int
    strides: dict[int, int | None]  # full-shape dim -> element stride (None: not affine)
    packable: bool  # a weight: pack.py will lay it out in read order
    gated: frozenset[int] = frozenset()  # dims its validity gate (padding) depends on
    store: bool = False  # the kernel's output, not a load


def operands(kernel: Kernel, params: dict[UOp, int], plan: Plan, packable) -> list[Operand]:
    """What each LOAD and the STORE of the kernel (lowered with a plain one-loop-per-dim plan)
    depend on."""
    dts = [kernel.root.dtype] + [n.dtype for n in sorted(params, key=params.get)]
    sink = graph_rewrite(lower_kernel(kernel, params, dts, plan), symbolic)
    dim_of = {u: plan.axes[u.arg[0]].dim for u in sink.toposort() if u.op is Ops.RANGE}
    out = []
    for u in sink.toposort():
        if u.op not in (Ops.LOAD, Ops.STORE):
            continue
        node = kernel.root if u.op is Ops.STORE else \
            next(n for n, i in params.items() if i == u.src[0].arg[0])
        coef, _ = linear_form(u.src[1])
        strides: dict[int, int | None] = {}
        for t, c in coef.items():
            if t.op is Ops.RANGE:
                strides[dim_of[t]] = strides.get(dim_of[t], 0) + c
        for t in coef:  # div/mod or data-dependent: every range inside is "not affine"
            if t.op is not Ops.RANGE:
                strides.update({dim_of[r]: None for r in t.toposort() if r.op is Ops.RANGE})
        gated = frozenset(dim_of[r] for r in u.src[2].toposort() if r.op is Ops.RANGE) \
            if u.op is Ops.LOAD and len(u.src) > 2 else frozenset()
        out.append(Operand(node.size * node.dtype.itemsize, node.dtype.itemsize, strides,
                           u.op is Ops.LOAD and params[node] in packable, gated, u.op is Ops.STORE))
    return out


def channels_last(kernels: list[Kernel], realized: set, keep: set) -> set[UOp]:
    """Tensors to store channels-last (NHWC): the input and output of every 2-D window
    reduction (conv or pool). There a conv's vector of output channels is one store (in NCHW,
    a scatter 784 floats apart), its input pixel's channels are one contiguous run, rows of 7,
    14 or 28 pixels need not be whole vectors, and a depthwise window reads whole channel
    vectors instead of gathers. Elementwise kernels over a channels-last tensor (a residual
    add, a squeeze-excite scale) store channels-last too, and so do their same-shape inputs:
    they stay plain vector code instead of becoming transposes.
    `keep`: tensors whose layout is fixed (graph inputs and outputs)."""
    out = set()

    def take(*us):
        out.update(u for u in us if u in realized and u.op not in (Ops.INPUT, Ops.WEIGHT)
                   and u not in keep and len(u.shape) == 4 and u.shape[1] > 1)
    reds = [find_reduce(k.root, realized) for k in kernels]
    for k, red in zip(kernels, reds):
        if red is None:
            if any(u in out and u.shape == k.root.shape for u in k.inputs):
                take(k.root)
            continue
        for n in inlined(k.root, realized):
            if n.op is Ops.WINDOW:
                src = n.src[0]
                while src not in realized and src.op in (Ops.PAD, Ops.RESHAPE, Ops.PERMUTE):
                    src = src.src[0]
                take(src)
                if k.root.shape[2:] == n.shape[2:4]:  # a conv's or pool's own output
                    take(k.root)
    # and what feeds an elementwise kernel that stores channels-last
    for k, red in reversed(list(zip(kernels, reds))):
        if red is None and k.root in out:
            take(*(u for u in k.inputs if u.shape == k.root.shape))
    return out


def pad_in_place(kernels: list[Kernel], realized: set, keep: set) -> list[Kernel]:
    """A reduction whose only reader pads it (the padded input of a deep conv, realized by the
    scheduler so the conv reads no bounds checks) stores straight into the padded tensor's
    interior, after a kernel that fills the whole buffer with the pad value: a fill instead of
    a copy, and no buffer for the unpadded tensor. `realized` loses the unpadded tensors.
    `keep`: tensors whose buffers are fixed (graph outputs)."""
    readers = Counter(u for k in kernels for u in k.inputs)
    at = {k.root: i for i, k in enumerate(kernels)}
    out: list[list[Kernel]] = [[k] for k in kernels]
    for i, k in enumerate(kernels):
        pad = k.root
        src = pad.src[0] if pad.op is Ops.PAD else None
        if src is None or k.inputs != [src] or src not in at or readers[src] != 1 \
                or pad in keep or src in keep or find_reduce(src, realized) is None:
            continue
        j = at[src]
        realized.discard(src)
        fill = Tensor.full(pad.arg[1], pad.dtype, (pad.size,)).uop  # flat: whole vectors
        out[j] = [Kernel(f"{kernels[j].name}_fill", fill, [], into=pad),
                  Kernel(kernels[j].name, pad, kernels[j].inputs)]
        out[i] = []
    return [k for ks in out for k in ks]


def in_place(kernels: list[Kernel], realized: set, last: set, keep: set) -> list[Kernel]:
    """A reduction whose epilogue adds a tensor at its own output position (a residual), as that
    tensor's last reader, writes its result over it: each output line is read and written in
    one visit instead of streaming a second tensor through the caches. Same shape, dtype and
    layout, and only elementwise paths from the root to it, so every element is read before
    the store that replaces it, by the thread that stores it."""
    last_reader = {u: i for i, k in enumerate(kernels) for u in k.inputs}

    def over(i: int, k: Kernel, r: UOp) -> bool:
        return (last_reader[r] == i and r in realized and r not in keep
                and r.op not in (Ops.INPUT, Ops.WEIGHT) and r.shape == k.root.shape
                and r.dtype == k.root.dtype and (r in last) == (k.root in last)
                and _elementwise(k.root, r, realized))
    out = []
    for i, k in enumerate(kernels):
        if k.into is None and k.root not in keep and find_reduce(k.root, realized) is not None:
            k = replace(k, into=next((r for r in k.inputs if over(i, k, r)), None))
        out.append(k)
    return out


def _elementwise(root: UOp, r: UOp, realized: set) -> bool:
    """Whether the kernel computing `root` reads `r` only along paths of ALU ops from the root,
    so at its own output index: not inside its reduction, not through a view."""
    stack, seen, found = [(root, True)], set(), False
    while stack:
        n, direct = stack.pop()
        if (n, direct) in seen:
            continue
        seen.add((n, direct))
        direct = direct and n.op in ALU
        for s in n.src:
            if s is r:
                if not direct:
                    return False
                found = True
            elif s not in realized:
                stack.append((s, direct))
    return found


def _plain(full, rdims) -> Plan:
    """One loop per dim, nothing tiled: the plan operands() reads strides from."""
    return Plan(tuple(full), tuple(rdims), tuple(
        Axis(d, s, "reduce" if d in rdims else "loop") for d, s in enumerate(full) if s > 1))


def merge_dims(kernel: Kernel, params: dict[UOp, int]) -> Kernel:
    """The same reduction over fewer, longer output dims: adjacent output dims that every operand
    walks as one (stride of the outer = size * stride of the inner, no padding gate) merge, so a
    1x1 conv over 28x28 pixels tiles like a 784-column matmul (784 = 49 vectors of 16; 28 is
    not a whole number of vectors). The reduction's source is reshaped and its result reshaped
    back, so the kernel's output and meaning are unchanged; symbolic.merge_divmod joins the
    split index again."""
    red = find_reduce(kernel.root, set(params))
    if red is None:
        return kernel
    full, rdims = red.src[0].shape, red.arg[1]
    ops = operands(kernel, params, _plain(full, rdims), ())

    def joins(group: list[int], b: int) -> bool:
        if group[-1] in rdims or b in rdims:
            return False
        if full[b] == 1:
            return True
        a = max((d for d in group if full[d] > 1), default=None)  # size-1 dims join anything
        return a is None or all(
            a not in o.gated and b not in o.gated and o.strides.get(a, 0) is not None
            and o.strides.get(b, 0) is not None
            and o.strides.get(a, 0) == full[b] * o.strides.get(b, 0) for o in ops)

    groups = [[0]]
    for d in range(1, len(full)):
        if joins(groups[-1], d):
            groups[-1].append(d)
        else:
            groups.append([d])
    if len(groups) == len(full):
        return kernel
    shape = tuple(math.prod(full[d] for d in g) for g in groups)
    axes = tuple(i for i, g in enumerate(groups) if g[0] in rdims)
    src = UOp(Ops.RESHAPE, red.src[0].dtype, (red.src[0],), shape)
    merged = UOp(Ops.REDUCE, red.dtype, (src,), (red.arg[0], axes))
    back = UOp(Ops.RESHAPE, red.dtype, (merged,), red.shape)
    return Kernel(kernel.name, substitute(kernel.root, {red: back}), kernel.inputs)


def _gathers(ops: list[Operand], d: int) -> int:
    """Loads that would need one scalar load per lane if dim d were the vector dim."""
    return sum(1 for o in ops if not o.packable and o.strides.get(d, 0) not in (0, 1))


def plan_kernel(kernel: Kernel, realized: set, target: Target,
                params: dict[UOp, int] | None = None, packable=()) -> Plan:
    if target.renderer != "c":
        return _plan_gpu(kernel, realized, target)
    red = find_reduce(kernel.root, realized)
    full = red.src[0].shape if red is not None else kernel.root.shape
    rdims = red.arg[1] if red is not None else ()
    lanes = max(target.vector_bytes // max(kernel.root.dtype.itemsize, 1), 1)
    out_dims = [d for d in range(len(full)) if d not in rdims and full[d] > 1]
    upcast: dict[int, int] = {}
    unroll: dict[int, int] = {}
    blocks: dict[int, int] = {}  # dim -> outer cache-block loop trips (that loop goes first)
    order = list(range(len(full)))
    window = False  # every output position reads its own input window (depthwise conv)
    ops: list[Operand] = []
    lines: dict[int, int] = {}  # reduce dim -> innermost reduce loop over one cache line of it
    if red is not None and params is not None and out_dims:
        # only what the reduction reads shapes the inner loop (epilogue loads run once per output)
        every = operands(kernel, params, _plain(full, rdims), packable)
        ops = [o for o in every if any(d in rdims for d in o.strides)]
        store = next(o for o in every if o.store)
        big = set(max(ops, key=lambda o: o.nbytes).strides) if ops else set()
        order = sorted(order, key=lambda d: (d not in big, d))  # tie-break for _loop_order
        # vector dim: the most useful lanes (a gathering dim fills its lanes one scalar load at
        # a time: worth 2 lanes at most), then fewest gathers, fewest scattered stores,
        # innermost. So a depthwise conv over 28-wide rows takes 4-lane vectors along the row,
        # not 16-lane gathers across channels 784 apart. A scattered store costs as much as a
        # gather only under a short reduction: a 1x1 conv over 256 channels stores once per 256
        # FMAs, a 3x3 depthwise once per 9.
        short = math.prod(full[d] for d in rdims) < SHORT_REDUCE

        def cost(d):
            gathers, scatters = _gathers(ops, d), _gathers([store], d)
            usable = GATHER_LANES if gathers or (short and scatters) else lanes
            return -min(_width(full[d], lanes), usable), gathers, scatters, -d
        vec = min(out_dims, key=cost)
        # row dim: one the vector operands do not depend on, so each vector load feeds a row
        feeders = [o for o in ops if o.strides.get(vec, 0) != 0]
        reuse = [d for d in out_dims if d != vec and all(o.strides.get(d, 0) == 0 for o in feeders)]
        # no such dim (a depthwise conv reads its input at every output position): tile the
        # innermost other dim anyway, for independent accumulators and shared window loads
        others = [d for d in out_dims if d != vec]
        row = reuse[-1] if reuse else (others[-1] if others else None)
        window = not reuse and bool(others)
        width = _width(full[vec], lanes)
        # a window kernel's channels share no load: tiles wider than a vector only add
        # accumulators, which spill under a long epilogue (swish)
        upcast.update(_register_tile(full, vec, row, width, target.registers,
                                     1 if window else MAX_VREGS))
        order, blocks = _loop_order(order, out_dims, every, full, upcast, target,
                                    store if window else None)
        vec_dim = vec
    elif red is not None and out_dims:
        inner = out_dims[-1]
        upcast[inner] = _factor(full[inner], lanes)
    if red is not None:
        rd = [d for d in rdims if full[d] > 1]
        if rd and window and math.prod(full[d] for d in rd) <= WINDOW_UNROLL:
            # a depthwise window: all of it in straight-line code, so overlapping windows of
            # neighbouring output rows share their loads
            unroll.update({d: full[d] for d in rd})
        elif rd:
            rd = _contiguous_last(ops, rd, full)
            inner = iter(rd)
            order = [next(inner) if d in rd else d for d in order]
            last = rd[-1]
            unroll[last] = full[last] if full[last] <= FULL_UNROLL else _factor(full[last], 4)
            lines = _line_split(ops, rd, full)
    elif out_dims:
        upcast[out_dims[-1]] = _factor(full[out_dims[-1]], lanes)
    if red is None or params is None or not out_dims:
        vec_dim = out_dims[-1] if out_dims else -1
    lanes = _width(upcast.get(vec_dim, 1), lanes)
    axes: list[Axis] = []
    for d in order:
        size = full[d]
        if size == 1:
            continue
        kind = "reduce" if d in rdims else ("global" if target.renderer != "c" else "loop")
        split = unroll.get(d, 1) if d in rdims else upcast.get(d, 1)
        if d in blocks:
            axes.insert(0, Axis(d, blocks[d], kind))
        rest = size // split // blocks.get(d, 1) // lines.get(d, 1)
        if rest > 1:
            axes.append(Axis(d, rest, kind))
        if split > 1:
            axes.append(Axis(d, split, "unroll" if d in rdims else "upcast"))
    axes += [Axis(d, n, "reduce") for d, n in lines.items()]  # innermost reduce loops (_nest)
    return Plan(tuple(full), tuple(rdims), tuple(_nest(axes, vec_dim)), lanes=lanes)


def _register_tile(full, vec: int, row: int | None, lanes: int, registers: int,
                   max_vregs: int) -> dict:
    """Upcasts for a (rows x vector columns) accumulator tile, at most `max_vregs` vectors
    wide: as many accumulators as the register file holds beside the operands (4 registers: two
    vector loads, a broadcast, spare); among equal counts, the squarest tile (fewest loads per
    FMA: one per column and per row)."""
    budget = max(registers - 4, 1)
    best, best_tile = (0, 0), {vec: _factor(full[vec], lanes)}
    for vregs in range(1, max_vregs + 1):
        cols = vregs * lanes
        if full[vec] % cols:
            continue
        rows = _factor(full[row], min(budget // vregs, MAX_ROWS)) if row is not None else 1
        score = (vregs * rows, -(vregs + rows))
        if score > best:
            best, best_tile = score, {vec: cols, **({row: rows} if rows > 1 else {})}
    return best_tile


def _contiguous_last(ops: list[Operand], rdims: list[int], full) -> list[int]:
    """Reduce dims, innermost last, with one that an activation reads contiguously and that fits
    in a cache line moved innermost: each line read whole before the next. A stem conv over
    3-channel channels-last input otherwise walks its 7 window columns innermost, 24 bytes
    apart, and unrolls them (measured: 1.85 against 1.46 ms with the channels innermost).
    Packed weights are read in loop order whatever it is, so they do not count."""
    for o in ops:
        short = [d for d in rdims if not o.packable and o.strides.get(d) == 1
                 and full[d] * o.itemsize <= LINE_BYTES]
        if short:
            return [d for d in rdims if d != short[0]] + short[:1]
    return rdims


def _line_split(ops: list[Operand], rdims: list[int], full) -> dict[int, int]:
    """{reduce dim: a cache line's worth of it, as the innermost reduce loop} for a reduce dim
    some operand reads contiguously while a reduce dim inside it jumps lines. A 3x3 conv over
    channels-last input reads 3 rows x 3 columns of pixels per channel: left outermost, the
    channel loop keeps 27+ lines live at once, 2 KiB apart at 512 channels, so they share two of
    L1's sets and evict each other before their next channel is read (measured: 1.45x
    onnxruntime's time). Each line read whole before the next: one live line per column."""
    out = {}
    for i, d in enumerate(rdims[:-1]):
        for o in ops:
            per_line = LINE_BYTES // o.itemsize
            if o.strides.get(d) == 1 and full[d] % per_line == 0 and full[d] > per_line and any(
                    (o.strides.get(e) or 0) * o.itemsize >= LINE_BYTES for e in rdims[i + 1:]):
                out[d] = per_line
    return out


def _loop_order(order: list[int], out_dims: list[int], ops: list[Operand], full, upcast,
                target: Target, window: Operand | None = None) -> tuple[list[int], dict[int, int]]:
    """The nest of output tile loops that streams the fewest bytes into L1 (see _traffic): an
    order of the tiled dims, and optionally one dim split in two with its outer (block) loop
    outermost, the classic cache block. Only nests whose outermost loop has enough trips to
    share among threads count, when there is one. `order` is the preference among equals (and
    places the reduce dims). Returns the order and {dim: outer block count}.

    A window kernel (`window`: its store) reuses nothing across tiles but its small weight and
    the rows its windows overlap, which any order keeps in L1; it walks its output in memory
    order instead, so every stream is sequential for the prefetchers. Measured on a 3x3
    depthwise conv over 144 channels-last channels at 56x56: 242 us rows then pixels then
    channels, 285 us with channels between, 293 us in channel strips."""
    trips = {d: t for d in out_dims if (t := full[d] // upcast.get(d, 1)) > 1}
    tiled = [d for d in order if d in trips]
    perms = list(itertools.permutations(tiled))
    nests = [[(d, trips[d]) for d in p] for p in perms]
    if window is None:
        nests += [[(b, trips[b] // inner)] + [(d, inner if d == b else trips[d]) for d in p]
                  for p in perms for b in p for inner in range(2, min(trips[b], BLOCK_TILES + 1))
                  if trips[b] % inner == 0]
    ok = [n for n in nests if n and n[0][1] >= MIN_OUTER_TRIPS] or nests
    if window is None:
        best = min(ok, key=lambda n: _traffic(ops, n, full, upcast, target), default=[])
    else:  # memory order: the store's strides, descending
        best = min(ok, key=lambda n: [-(window.strides.get(d) or 0) for d, _ in n], default=[])
    blocks = {best[0][0]: best[0][1]} if len(best) > len(tiled) else {}
    rest = iter(d for d, _ in best[len(blocks):])
    return [next(rest) if d in trips else d for d in order], blocks


def _traffic(ops: list[Operand], loops, full, upcast, target: Target) -> float:
    """Bytes the operands stream into L1 over the tile loops `loops` ((dim, trips), outermost
    first), beyond their first read: a loop over a dim an operand does not depend on reads it
    again, on every trip, all of it that one trip touches; from L2 when what all operands touch
    in one trip fits there, from memory (DRAM_COST times dearer) when not, for free when it fits
    L1. So a 1x1 conv over many pixels keeps a block of pixels and a slice of its weight in L1,
    instead of re-reading the whole weight from L2 for every 8 pixels."""
    def depends(o, d):
        return o.strides.get(d, 0) != 0
    # bytes of each operand that one register tile reads, over its whole reduction and all of
    # every output dim that is not register-tiled: an upper bound, so the model does not bet on
    # tight fits (measured: exact working sets picked a stem-conv nest that thrashed L1, 2x slower)
    # A dim that every operand depends on (a batch: Winograd's 16 products) partitions them all,
    # so one tile touches one index of it.
    batch = {d for d in range(len(full)) if all(depends(o, d) for o in ops)}
    ws = [min(o.nbytes, o.itemsize * math.prod(upcast.get(d, 1) if d in upcast or d in batch
                                               else full[d]
                                               for d in range(len(full)) if depends(o, d)))
          for o in ops]
    cost = 0.0  # bytes re-read within one trip of the loops walked so far
    for d, t in reversed(loops):
        total = sum(ws)
        level = 0 if total <= target.l1_bytes else 1 if total <= target.l2_bytes else DRAM_COST
        cost *= t
        for i, o in enumerate(ops):
            if depends(o, d):
                ws[i] = min(ws[i] * t, o.nbytes)
            else:
                cost += ws[i] * (t - 1) * level
    return cost


def _width(size: int, lanes: int) -> int:
    """Vector lanes for a dim of `size`: the widest power of two <= lanes that divides it."""
    w = lanes
    while w > 1 and size % w:
        w //= 2
    return w


def _nest(axes: list[Axis], vec_dim: int) -> list[Axis]:
    """Loop nest: output loops (in the chosen order), then reduce loops; expanded axes last, the
    vector axis innermost so its lanes are consecutive stores."""
    rank = {"global": 0, "loop": 1, "reduce": 2, "upcast": 3, "unroll": 3}
    return sorted(axes, key=lambda a: (rank[a.kind], a.kind == "upcast" and a.dim == vec_dim))


# ---- GPU targets ----------------------------------------------------------------------------
# One work item per output tile; OpenCL gives a kernel at most 3 global ids.
GPU_VECTOR = 4  # float4/half4 loads and stores, and one RGBA texel per image read
GPU_GROUP = 128  # work-group size aimed for: two 64-wide waves on Adreno
GPU_MIN_ITEMS = 1024  # fewer work items than this: tile less, or split the reduction
GPU_MIN_GROUP = 16  # a work-group reduction over fewer lanes is not worth its barriers


def _plan_gpu(kernel: Kernel, realized: set, target: Target) -> Plan:
    """Every output dim is a global id (outer ones fused down to 3); the innermost output dim is
    upcast by 4 so loads and stores are float4 and image reads fetch whole texels; reductions
    also tile one more output dim by 4 (16 accumulators per work item) while enough work items
    remain, and unroll their innermost reduce dim. A reduction with too few outputs to fill the
    device (LayerNorm rows, a pooled vector) is split across a work-group instead ("group" axis:
    each work item sums a strided share, local memory combines the shares)."""
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
    group = 0
    if rd:
        last = rd[-1]
        if items < GPU_MIN_ITEMS:
            group = _pow2_factor(full[last], min(target.max_workgroup, GPU_GROUP))
            group = group if group >= GPU_MIN_GROUP else 0
        share = full[last] // max(group, 1)
        unroll[last] = share if share <= FULL_UNROLL and not group else _factor(share, 4)
    axes: list[Axis] = []
    for d, size in enumerate(full):
        if size == 1:
            continue
        kind = "reduce" if d in rdims else "global"
        split = unroll.get(d, 1) if d in rdims else upcast.get(d, 1)
        across = group if group and d == rd[-1] else 1
        if split * across < size:
            axes.append(Axis(d, size // (split * across), kind))
        if across > 1:  # between the loop and the unrolled part: work items read side by side
            axes.append(Axis(d, across, "group"))
        if split > 1:
            axes.append(Axis(d, split, "unroll" if d in rdims else "upcast"))
    # global ids first, then the loops; within a dim the order above (outer to inner) is kept
    rank = {"global": 0, "reduce": 1, "group": 1, "upcast": 2, "unroll": 2}
    axes = sorted(axes, key=lambda a: rank[a.kind])
    n_global = sum(a.kind == "global" for a in axes)
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
        f = _factor(g, budget)
        local.append(f)
        budget //= f
    return tuple(local)
