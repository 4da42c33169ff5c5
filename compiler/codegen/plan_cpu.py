"""CPU loop plans (targets whose output dims are loops): loop order, register tiles (upcast),
unrolled reductions.

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
from dataclasses import dataclass, field

from compiler.codegen.lower import lower_kernel
from compiler.codegen.plan import FULL_UNROLL, factor, reduce_shape
from compiler.ir.kernel import Axis, AxisKind, Kernel, Plan, find_reduce
from compiler.ir.rewrite import graph_rewrite, substitute
from compiler.ir.symbolic import linear_form, symbolic
from compiler.ir.uop import Ops, UOp
from compiler.target import LINE_BYTES, Target

GATHER_LANES = 2  # what a vector of per-lane scalar loads is worth, in lanes
SCALAR_CHAINS = 16  # independent elements a scalar elementwise kernel computes at once
WINDOW_UNROLL = 32  # whole window reductions up to this size unroll (3x3, 5x5 depthwise)
MAX_ROWS = 8  # accumulator rows: past this, code size (and compile time) grows for no gain
SHORT_REDUCE = 64  # reductions shorter than this pay for a scattered store like for a gather
MIN_OUTER_TRIPS = 8  # the outermost loop is what threads share: enough trips to balance them
# tiles in a cache block's inner loop: more walk so many rows a power-of-two stride apart (256
# channels: 1 KiB) that they collide in L1's sets (docs/perf.md)
BLOCK_TILES = 4
DRAM_COST = 4  # a byte from memory costs this many from L2 (~15 against ~60 GB/s, one core)
MAX_VREGS = 3  # accumulator columns, in vectors: wider tiles stream more, gain nothing


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


def _plain(full, rdims) -> Plan:
    """One loop per dim, nothing tiled: the plan operands() reads strides from."""
    return Plan(tuple(full), tuple(rdims), tuple(
        Axis(d, s, AxisKind.REDUCE if d in rdims else AxisKind.LOOP)
        for d, s in enumerate(full) if s > 1))


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
    full, rdims = reduce_shape(red, kernel.root)
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


@dataclass
class Tile:
    """The output side of a plan: loop order (reduce dims included, placed later), register
    tile, cache blocks."""
    order: list[int]
    upcast: dict[int, int]  # output dim -> register tile size
    vec: int  # the dim whose register tile is zipped into vectors (-1: none)
    blocks: dict[int, int] = field(default_factory=dict)  # dim -> outer cache-block loop trips
    window: bool = False  # every output position reads its own input window (depthwise conv)
    ops: list[Operand] = field(default_factory=list)  # what the reduction reads


def plan_cpu(kernel: Kernel, params: dict[UOp, int], target: Target, packable=()) -> Plan:
    red = find_reduce(kernel.root, set(params))
    full, rdims = reduce_shape(red, kernel.root)
    kinds = {u.dtype for u in kernel.root.toposort()} if target.float_vector_bytes \
        else {kernel.root.dtype}
    width = target.vector_width(kinds)
    # dsp (float_vector_bytes set): lanes of the kernel's widest type, so an int8-output conv
    # that computes in int32 takes 32 lanes (one HVX register per value), not 128 in four
    # registers, which lowering builds one by one (quantized squeezenet: 65 s to compile, not 93)
    lanes = max(width // max(max(k.itemsize for k in kinds), 1), 1)
    out_dims = [d for d in range(len(full)) if d not in rdims and full[d] > 1]
    if red is not None and out_dims:
        tile = _reduce_tile(kernel, params, packable, target, full, rdims, out_dims, lanes)
    else:  # elementwise, or a reduction to one value: vectors along the innermost dim, as
        # wide as divide it (factor alone gave 56-pixel rows 14 = 2 lanes x 7 at 16 lanes)
        inner = out_dims[-1] if out_dims else -1
        up = (_width(full[inner], lanes) if full[inner] % 2 == 0 else factor(full[inner], lanes)
              ) if out_dims else 1
        upcast = {inner: up} if out_dims else {}
        if lanes == 1 and len(out_dims) > 1:  # scalar code (dsp float): independent elements
            # from the next dim too, so the FP slots pair instead of waiting on one chain
            row = out_dims[-2]
            upcast[row] = factor(full[row], max(SCALAR_CHAINS // full[inner], 1))
        tile = Tile(list(range(len(full))), upcast, inner)
    order, unroll, lines = _reduce_loops(tile, full, rdims)
    axes = _axes(full, rdims, order, tile, unroll, lines)
    return Plan(tuple(full), tuple(rdims), tuple(_nest(axes, tile.vec)),
                lanes=_width(tile.upcast.get(tile.vec, 1), lanes), loop_epilogue=True)


def _reduce_tile(kernel: Kernel, params, packable, target: Target, full, rdims, out_dims,
                 lanes: int) -> Tile:
    """Register tile and loop order for a reduction, from what its operands depend on. Only what
    the reduction reads shapes the inner loop (epilogue loads run once per output)."""
    every = operands(kernel, params, _plain(full, rdims), packable)
    ops = [o for o in every if any(d in rdims for d in o.strides)]
    store = next(o for o in every if o.store)
    big = set(max(ops, key=lambda o: o.nbytes).strides) if ops else set()
    order = sorted(range(len(full)), key=lambda d: (d not in big, d))  # tie-break for _loop_order
    vec = _vector_dim(ops, store, full, rdims, out_dims, lanes)
    # row dim: one the vector operands do not depend on, so each vector load feeds a row
    feeders = [o for o in ops if o.strides.get(vec, 0) != 0]
    reuse = [d for d in out_dims if d != vec and all(o.strides.get(d, 0) == 0 for o in feeders)]
    # no such dim (a depthwise conv reads its input at every output position): tile the
    # innermost other dim anyway, for independent accumulators and shared window loads
    others = [d for d in out_dims if d != vec]
    row = reuse[-1] if reuse else (others[-1] if others else None)
    window = not reuse and bool(others)
    # a window kernel's channels share no load: tiles wider than a vector only add
    # accumulators, which spill under a long epilogue (swish)
    upcast = _register_tile(full, vec, row, _width(full[vec], lanes), target.registers,
                            1 if window else MAX_VREGS)
    order, blocks = _loop_order(order, out_dims, every, full, upcast, target,
                                store if window else None)
    return Tile(order, upcast, vec, blocks, window, ops)


def _vector_dim(ops: list[Operand], store: Operand, full, rdims, out_dims, lanes: int) -> int:
    """The most useful lanes (a gathering dim fills its lanes one scalar load at a time: worth 2
    lanes at most), then fewest gathers, fewest scattered stores, innermost. So a depthwise conv
    over 28-wide rows takes 4-lane vectors along the row, not 16-lane gathers across channels
    784 apart. A scattered store costs as much as a gather only under a short reduction: a 1x1
    conv over 256 channels stores once per 256 FMAs, a 3x3 depthwise once per 9."""
    short = math.prod(full[d] for d in rdims) < SHORT_REDUCE

    def cost(d):
        gathers, scatters = _gathers(ops, d), _gathers([store], d)
        usable = GATHER_LANES if gathers or (short and scatters) else lanes
        return -min(_width(full[d], lanes), usable), gathers, scatters, -d
    return min(out_dims, key=cost)


def _reduce_loops(tile: Tile, full, rdims) -> tuple[list[int], dict[int, int], dict[int, int]]:
    """(loop order, {reduce dim: unroll}, {reduce dim: cache-line inner loop}) for the reduce
    dims: a depthwise window unrolls whole, so overlapping windows of neighbouring output rows
    share their loads; otherwise the innermost reduce dim unrolls (fully when short)."""
    rd = [d for d in rdims if full[d] > 1]
    if not rd:
        return tile.order, {}, {}
    if tile.window and math.prod(full[d] for d in rd) <= WINDOW_UNROLL:
        return tile.order, {d: full[d] for d in rd}, {}
    rd = _contiguous_last(tile.ops, rd, full)
    inner = iter(rd)
    order = [next(inner) if d in rd else d for d in tile.order]
    last = rd[-1]
    unroll = {last: full[last] if full[last] <= FULL_UNROLL else factor(full[last], 4)}
    return order, unroll, _line_split(tile.ops, rd, full)


def _axes(full, rdims, order: list[int], tile: Tile, unroll: dict, lines: dict) -> list[Axis]:
    """Each dim split into its cache block (outermost), its loop, its line loop and its
    register tile or unrolled part."""
    axes: list[Axis] = []
    for d in order:
        if full[d] == 1:
            continue
        kind = AxisKind.REDUCE if d in rdims else AxisKind.LOOP
        split = unroll.get(d, 1) if d in rdims else tile.upcast.get(d, 1)
        if d in tile.blocks:
            axes.insert(0, Axis(d, tile.blocks[d], kind))
        rest = full[d] // split // tile.blocks.get(d, 1) // lines.get(d, 1)
        if rest > 1:
            axes.append(Axis(d, rest, kind))
        if split > 1:
            axes.append(Axis(d, split, AxisKind.UNROLL if d in rdims else AxisKind.UPCAST))
    return axes + [Axis(d, n, AxisKind.REDUCE) for d, n in lines.items()]  # innermost (_nest)


def _register_tile(full, vec: int, row: int | None, lanes: int, registers: int,
                   max_vregs: int) -> dict:
    """Upcasts for a (rows x vector columns) accumulator tile, at most `max_vregs` vectors
    wide: as many accumulators as the register file holds beside the operands (4 registers: two
    vector loads, a broadcast, spare); among equal counts, the squarest tile (fewest loads per
    FMA: one per column and per row)."""
    budget = max(registers - 4, 1)
    best, best_tile = (0, 0), {vec: factor(full[vec], lanes)}
    for vregs in range(1, max_vregs + 1):
        cols = vregs * lanes
        if full[vec] % cols:
            continue
        rows = factor(full[row], min(budget // vregs, MAX_ROWS)) if row is not None else 1
        score = (vregs * rows, -(vregs + rows))
        if score > best:
            best, best_tile = score, {vec: cols, **({row: rows} if rows > 1 else {})}
    return best_tile


def _contiguous_last(ops: list[Operand], rdims: list[int], full) -> list[int]:
    """Reduce dims, innermost last, with one that an activation reads contiguously and that fits
    in a cache line moved innermost: each line read whole before the next. A stem conv over
    3-channel channels-last input otherwise walks its 7 window columns innermost, 24 bytes
    apart, and unrolls them (docs/perf.md).
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
    L1's sets and evict each other before their next channel is read (docs/perf.md). Each line
    read whole before the next: one live line per column."""
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
    order instead, so every stream is sequential for the prefetchers (docs/perf.md)."""
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
    # tight fits: exact working sets picked a stem-conv nest that thrashed L1 (docs/perf.md)
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
    rank = {AxisKind.GLOBAL: 0, AxisKind.LOOP: 1, AxisKind.REDUCE: 2, AxisKind.UPCAST: 3,
            AxisKind.UNROLL: 3}
    return sorted(axes, key=lambda a: (rank[a.kind],
                                       a.kind == AxisKind.UPCAST and a.dim == vec_dim))
