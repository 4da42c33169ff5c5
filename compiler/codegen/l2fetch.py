"""L2 prefetch for HVX kernels (targets with `l2fetch`: the Hexagon cDSP), and the kernel's
memory model.

HVX loads are served by the L2 cache, not L1 (the V65 HVX PRM: an unaligned vmemu is several
accesses to the L2 cache), so the prefetch that matters is `l2fetch`: a background
fetch into L2 of a box of `height` rows of `width` bytes, `stride` bytes apart (the fields of
Rt or Rtt: qemu's imported system.idef, Y4_l2fetch and Y5_l2fetch; renderers/hvx.py packs
them). It issues in slot 0 only. `dcfetch` fills L1, which vector loads bypass.

Each kernel's outermost loop walks output tiles (rows, pixel groups, or output-channel tiles,
as codegen/plan_cpu.py chose, blocking for the target's L2). At the top of every trip the
kernel hints the block a trip `ahead` trips later will read first: of the buffer it streams
most of per trip, the part that trip reads and the trip before it did not (a 3x3 window's next
input row; a 1x1 conv's next pixel group; the next output-channel tile's weight slice). One
l2fetch per trip, never several: a thread has one prefetch in flight (the Hexagon SDK's
q6cache.h waits for it on a USR status bit), and one box per trip costs about one packet. The
box is clamped into the buffer, so it never names an address the kernel does not read.

What packets cannot show: whether the fetch arrives in time. `ahead` is chosen so that the
trips in between take about AHEAD_PACKETS (XNNPACK's Hexagon prefetch: "at least several
hundred cycles prior to using the data"); only the device's cycle counter and L2 miss counts
(SysMon, the Hexagon profiler) can confirm it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from compiler.codegen.linearize import KIND_ORDER
from compiler.ir.dtypes import dtypes
from compiler.ir.symbolic import build, linear_form
from compiler.ir.uop import Ops, UOp

ROW = 128  # bytes per box row: one HVX vector
AHEAD_PACKETS = 400  # how far ahead (estimated packets) the block is hinted
PACKET_OPS = 2  # vector ops per packet, for the estimate (docs/perf.md, "Issue 36, item 2")
MAX_HEIGHT = (1 << 16) - 1  # Rtt's height field
LINES_MAX = 1 << 18  # accesses per trip the model enumerates (a few ms each)


@dataclass(frozen=True)
class Footprint:
    """What one trip of the outer loop reads of one buffer: within [lo, hi) (elements, at trip
    0), advancing `step` elements per trip (0: the same block every trip, resident); `touched`
    bytes of it: the ROW-byte lines its accesses touch (a strided read touches a line per
    access, not the interval between)."""
    param: UOp
    lo: int
    hi: int
    step: int
    touched: int


@dataclass(frozen=True)
class Memory:
    """The kernel's memory model, in bytes: `resident` is read again by every trip of the outer
    loop (a 1x1 conv's weights, a channel tile loop's input), `live` what one trip reads and
    writes of the streamed buffers, `fetched` the box hinted per trip, `ahead` trips before its
    use. The working set that must stay in L2 is resident + live + ahead * fetched."""
    trips: int
    resident: int
    live: int
    fetched: int
    ahead: int

    @property
    def working_set(self) -> int:
        return self.resident + self.live + self.ahead * self.fetched

    def record(self) -> dict:
        """The blob's meta "memory" entry of a launch (tools/dsp_memory.py reads it)."""
        return {"trips": self.trips, "resident": self.resident, "live": self.live,
                "fetched": self.fetched, "ahead": self.ahead}


def outer_range(sink: UOp) -> UOp | None:
    """The outermost loop: each of its trips computes one output tile."""
    loops = [u for u in sink.toposort() if u.op is Ops.RANGE and u.arg[1] in ("global", "loop")]
    return min(loops, key=lambda r: (KIND_ORDER[r.arg[1]], r.arg[0]), default=None)


def footprints(sink: UOp, outer: UOp, op: Ops) -> list[Footprint]:
    """Per buffer that `op` (LOAD or STORE) accesses at indices affine in the loops, its block
    per trip of `outer` (gated reads count whole: their gate only trims a border)."""
    blocks: dict[UOp, list] = {}
    for u in sink.toposort():
        if u.op is not op:
            continue
        coef, const = linear_form(u.src[1])
        if any(t.op is not Ops.RANGE for t in coef):
            continue
        width = (u.dtype if op is Ops.LOAD else u.src[2].dtype)
        size = u.src[0].dtype.itemsize
        count = -(-width.itemsize * width.count // size)  # elements one access reads
        inner = [(c, t.src[0].arg) for t, c in coef.items() if t is not outer]
        lo = const + sum(min(0, c * (n - 1)) for c, n in inner)
        hi = const + sum(max(0, c * (n - 1)) for c, n in inner) + count
        lines = _lines(const, inner, size, count * size)
        blocks.setdefault(u.src[0], []).append((lo, hi, coef.get(outer, 0), lines))
    out = []
    for param, accesses in blocks.items():
        steps = {step for _, _, step, _ in accesses}
        if len(steps) > 1 or min(steps) < 0:  # one stride per trip
            continue
        lo, hi = min(a[0] for a in accesses), max(a[1] for a in accesses)
        touched = (hi - lo) * param.dtype.itemsize
        if all(a[3] is not None for a in accesses):
            touched = ROW * len(np.unique(np.concatenate([a[3] for a in accesses])))
        out.append(Footprint(param, lo, hi, steps.pop(), touched))
    return out


def _lines(const: int, inner: list[tuple[int, int]], size: int, nbytes: int):
    """The ROW-byte lines (at or past the buffer's start) that one trip's accesses of `nbytes`
    at element `const + sum(c * r)` touch, or None past LINES_MAX accesses (the interval
    stands in)."""
    if math.prod(n for _, n in inner) > LINES_MAX:
        return None
    at = np.zeros(1, np.int64) + const * size
    for c, n in inner:
        at = (at[:, None] + c * size * np.arange(n, dtype=np.int64)).reshape(-1)
    lines = np.concatenate([at // ROW, (at + nbytes - 1) // ROW])
    return lines[lines >= 0]


def _nbytes(f: Footprint, elements: int) -> int:
    return min(f.touched, elements * f.param.dtype.itemsize)


def _new(f: Footprint) -> int:
    """Elements a trip reads that the trip before it did not."""
    return min(f.step, f.hi - f.lo)


def packets_per_trip(sink: UOp, outer: UOp) -> int:
    """Estimated packets of one trip: its vector ops (each times the trips of the inner loops it
    sits in) over PACKET_OPS."""
    deps: dict[UOp, frozenset] = {}
    ops = 0
    for u in sink.toposort():
        d = frozenset((u,)) if u.op is Ops.RANGE else frozenset().union(*(deps[s] for s in u.src))
        deps[u] = d - frozenset(u.ranges) if u.op is Ops.REDUCE else d
        if u.dtype.count > 1 and u.op not in (Ops.CONST, Ops.VECTORIZE, Ops.GEP):
            ops += math.prod(r.src[0].arg for r in deps[u] if r is not outer)
    return max(1, ops // PACKET_OPS)


def l2fetch_next_tile(sink: UOp, sizes: dict[int, int], l2: int) -> tuple[UOp, Memory | None]:
    """The kernel with one PREFETCH (arg: the box (width, height, stride) in bytes) of the block
    `ahead` trips on, and its Memory; unchanged and None without an outer loop. `sizes`: param
    index -> its element count (the box is clamped inside). The box is cut to what `l2` bytes
    hold beside the resident set and a trip's live bytes: a hint that evicts the lines the
    current trip still reads costs more than it saves."""
    outer = outer_range(sink)
    if outer is None:
        return sink, None
    trips = outer.src[0].arg
    reads = [f for f in footprints(sink, outer, Ops.LOAD) if f.param.arg[0] in sizes]
    writes = footprints(sink, outer, Ops.STORE)
    resident = sum(_nbytes(f, sizes[f.param.arg[0]]) for f in reads if f.step == 0)
    live = sum(_nbytes(f, sizes.get(f.param.arg[0], f.hi - f.lo)) for f in reads + writes
               if f.step)
    streamed = [f for f in reads if f.step and trips > 1]
    if not streamed:
        return sink, Memory(trips, resident, live, 0, 0)
    f = max(streamed, key=lambda f: _new(f) * f.param.dtype.itemsize)
    elements, size = min(_new(f), sizes[f.param.arg[0]]), f.param.dtype.itemsize
    if elements * size < ROW:  # a scalar loop's element per trip: a packet each, for a line
        return sink, Memory(trips, resident, live, 0, 0)
    # at most a quarter of the trips ahead: further, most trips would hint the clamped last block
    ahead = max(1, min(trips // 4, -(-AHEAD_PACKETS // packets_per_trip(sink, outer))))
    # the block trip (outer + ahead) reads first, the last trip's when past the end
    trip = outer.alu(Ops.ADD, UOp.const(ahead, dtypes.index)).alu(
        Ops.MIN, UOp.const(trips - 1, dtypes.index))
    start = build([(f.step, trip)], f.hi - elements, dtypes.index)
    start = start.alu(Ops.MIN, UOp.const(sizes[f.param.arg[0]] - elements, dtypes.index)).alu(
        Ops.MAX, UOp.const(0, dtypes.index))
    height = min(-(-elements * size // ROW), MAX_HEIGHT, (l2 - resident - live) // (ROW * ahead))
    if height < 1:
        return sink, Memory(trips, resident, live, 0, 0)
    hint = UOp(Ops.PREFETCH, dtypes.void, (f.param, start), (ROW, height, ROW))
    memory = Memory(trips, resident, live, height * ROW, ahead)
    return UOp(Ops.SINK, dtypes.void, sink.src + (hint,), sink.arg), memory
