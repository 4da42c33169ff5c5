"""Weight packing: lay every weight out in the order its kernel reads it.

Weights are constants, so their layout is the compiler's choice. After lowering, a kernel reads a
weight at `sum(coef_r * r) + c_l + step * lane` over its loop ranges r, with one constant c_l
per unrolled copy and the vector's lane (lower.lane) if its lanes read different elements. The
packed weight is ordered [ranges in loop-nest order][copies][lanes], so the innermost loop walks
it sequentially (a matmul's column strip becomes one contiguous stream instead of one cache line
and page per k step), and the lanes of one vector sit side by side: a conv's output-channel
lanes, 1152 floats apart in ONNX order, become one vector load instead of a W-lane gather.
The packing depends only on the kernel (a Packing: strides, not an index array), so every launch
of a shared program packs its own weight the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from compiler.ir.dtypes import dtypes
from compiler.codegen.linearize import KIND_ORDER
from compiler.codegen.lower import lane
from compiler.ir.kernel import AxisKind
from compiler.ir.rewrite import substitute
from compiler.ir.symbolic import build, linear_form
from compiler.target import LINE_BYTES
from compiler.ir.uop import Ops, UOp

MAX_GROWTH = 1.0  # packed size / original size: never duplicate weight data


@dataclass(frozen=True)
class Packing:
    """A weight's packed order: packed[*r, i, k] = weight[sum(coef * r) + consts[i] + step * k],
    over the kernel's ranges r (`axes`: (coef, size) each, outer to inner), its copies i and the
    lanes k of a vector."""
    axes: tuple[tuple[int, int], ...]
    consts: tuple[int, ...]  # ascending
    step: int
    lanes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (*[s for _, s in self.axes], len(self.consts), self.lanes)

    def index(self) -> np.ndarray:
        """The gather index: packed position -> original flat index."""
        old = np.asarray(self.consts, np.int64)[:, None] + \
            self.step * np.arange(self.lanes, dtype=np.int64)
        for c, s in reversed(self.axes):
            old = old + c * np.arange(s, dtype=np.int64).reshape((s,) + (1,) * old.ndim)
        return old.reshape(-1)

    def bounds(self) -> tuple[int, int]:
        """The least and the greatest original index it reads."""
        spans = [c * (s - 1) for c, s in self.axes] + [self.step * (self.lanes - 1)]
        return (self.consts[0] + sum(min(0, x) for x in spans),
                self.consts[-1] + sum(max(0, x) for x in spans))

    def identity(self) -> bool:
        """Whether it keeps the original order (then packing is pointless)."""
        cs = self.consts
        d = cs[1] - cs[0] if len(cs) > 1 else 0
        if cs[0] != 0 or any(b - a != d for a, b in zip(cs, cs[1:])):
            return False
        want = 1
        for stride, size in reversed(list(zip([c for c, _ in self.axes] + [d, self.step],
                                              self.shape))):
            if size > 1 and stride != want:
                return False
            want *= size
        return True

    def apply(self, flat: np.ndarray) -> np.ndarray:
        """The packed weight, flat: one strided copy per copy constant, not a gather through
        index() (docs/perf.md). bounds()
        was checked against the weight's size when the packing was made (_pack)."""
        flat = np.ascontiguousarray(flat).reshape(-1)
        out = np.empty(self.shape, flat.dtype)
        view = (*self.shape[:-2], self.lanes)
        strides = tuple(flat.itemsize * c for c, _ in self.axes) + (flat.itemsize * self.step,)
        for i, c in enumerate(self.consts):
            out[..., i, :] = as_strided(flat[c:], view, strides, writeable=False)
        return out.reshape(-1)


def _affine(idx: UOp) -> tuple[dict[UOp, int], int] | None:
    """The index as {range: coefficient} + constant, or None if it is not affine in the ranges."""
    coef, const = linear_form(idx)
    return (coef, const) if all(u.op is Ops.RANGE for u in coef) else None


def pack_weights(sink: UOp, weights: dict[int, int]) -> tuple[UOp, dict[int, Packing]]:
    """weights: param index -> element count. Returns the kernel with rewritten weight loads and,
    per packed param, its Packing."""
    loads: dict[int, list[UOp]] = {}
    for u in sink.toposort():
        if u.op is Ops.LOAD and u.src[0].arg[0] in weights:
            loads.setdefault(u.src[0].arg[0], []).append(u)
    mapping, packings = {}, {}
    for param, group in loads.items():
        packed = _pack(group, weights[param], lane(sink.arg or 1))
        if packed is not None:
            new_loads, packings[param] = packed
            mapping.update(new_loads)
    return (substitute(sink, mapping) if mapping else sink), packings


def _pack(group: list[UOp], size: int, lane_var: UOp):
    """A copy is a load of one vector (lowering builds one per vector, the lane in its index):
    the packed weight is [ranges][copies][lanes], so a vector's lanes are side by side."""
    if any(len(u.src) != 2 for u in group):
        return None  # gated loads (padding) keep the original layout
    forms = [_affine(u.src[1]) for u in group]
    if any(f is None for f in forms) or any(f[0] != forms[0][0] for f in forms):
        return None
    coef = dict(forms[0][0])
    step = coef.pop(lane_var, 0)  # between lanes, in the original layout
    w = lane_var.src[0].arg if step else 1
    ranges = sorted(coef, key=lambda r: (KIND_ORDER[r.arg[1]], r.arg[0]))
    consts = sorted({f[1] for f in forms})
    packing = Packing(tuple((coef[r], r.src[0].arg) for r in ranges), tuple(consts), step, w)
    lo, hi = packing.bounds()
    if math.prod(packing.shape) > size * MAX_GROWTH or lo < 0 or hi >= size \
            or packing.identity():
        return None
    terms_new = _strides(ranges, len(consts) * w) + ([(1, lane_var)] if step else [])
    slot = {c: i * w for i, c in enumerate(consts)}
    new = {u: UOp(Ops.LOAD, u.dtype, (u.src[0], build(terms_new, slot[c], dtypes.index)))
           for u, (_, c) in zip(group, forms)}
    return new, packing


def prefetch_next_tiles(sink: UOp, weights: dict[int, int]) -> UOp:
    """Weights are cold on every run (a model's weights outgrow the caches), and a kernel that
    moves to the next output tile's weight slice waits on memory for all of it. So each
    reduction step of a tile also hints a line of the next tile's slice (packing put it right
    after this one), spread over every step of every loop the tile repeats its slice for, so
    the next slice streams into L2 while this one computes (a 3x3 conv over 7 rows of 512
    channels: 590 KB per 32-channel tile, 1/7 of it per row). Spread, not all per step: a
    software prefetch holds a line fill buffer until memory answers, and too many starve the
    loads the FMAs wait on (docs/perf.md)."""
    loops = sorted((u for u in sink.toposort() if u.op is Ops.RANGE),
                   key=lambda r: (KIND_ORDER[r.arg[1]], r.arg[0]))
    steps = [r for r in loops if r.arg[1] == AxisKind.REDUCE]
    hints, done = [], set()
    for u in sink.toposort():
        if u.op is not Ops.LOAD or u.dtype.count == 1 or u.src[0] in done \
                or u.src[0].arg[0] not in weights:
            continue
        coef, _ = linear_form(u.src[1])
        outer = [r for r in loops
                 if r.arg[1] not in (AxisKind.REDUCE, AxisKind.EPILOGUE) and r in coef]
        if not outer or not steps or any(r not in coef for r in steps):
            continue
        done.add(u.src[0])
        tile = outer[-1]  # each of its trips reads another slice
        line = LINE_BYTES // u.dtype.scalar.itemsize
        per_step = coef[steps[-1]]  # packed: [loops][copies], so the innermost stride is a step
        # the innermost loops the tile repeats its slice for, enough of them that a line per
        # step covers the slice; the trips past that wrap around (a power of two: a mask) and
        # hint it again, from L2, instead of tiles further ahead
        repeats, trips = [], 1
        for r in reversed([r for r in loops[loops.index(tile) + 1:]
                           if r.arg[1] not in (AxisKind.REDUCE, AxisKind.EPILOGUE)]):
            if trips * line >= per_step:
                break
            repeats, trips = [r] + repeats, trips * r.src[0].arg
        trip = build(_strides(repeats, 1), 0, dtypes.index)
        wrap = 1 << max(-(-per_step // line) - 1, 0).bit_length()
        if wrap < trips:
            trip, trips = trip.alu(Ops.AND, UOp.const(wrap - 1, dtypes.index)), wrap
        lines = -(-per_step // (line * trips))  # per step, so that all trips cover the slice
        # position = ((trip * steps per trip + step) * lines + j) * line
        size = lines * line * math.prod(r.src[0].arg for r in steps)
        base = build([(coef[r], r) for r in outer] + _strides(steps, lines * line), coef[tile],
                     dtypes.index)
        base = base if trip.op is Ops.CONST else base + trip * size
        hints += [UOp(Ops.PREFETCH, dtypes.void, (u.src[0], base + j * line if j else base))
                  for j in range(lines)]
    return UOp(Ops.SINK, dtypes.void, sink.src + tuple(hints), sink.arg) if hints else sink


def _strides(ranges: list[UOp], inner: int) -> list[tuple[int, UOp]]:
    """Row-major (stride, range) terms of the ranges' combined index, times `inner`."""
    out = []
    for r in reversed(ranges):
        out.append((inner, r))
        inner *= r.src[0].arg
    return out
