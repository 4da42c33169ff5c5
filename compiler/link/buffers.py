"""The buffer table of one variant: the placed buffers (schedule/place.py), the weights in the
packing codegen chose for each kernel, the launch records that use them, and the offsets of
everything in the arena and the weights region. Built by the link stage (link.py), which alone
assigns offsets; the arena's come from memory.py once every launch is recorded (lifetimes are
launch steps)."""
from __future__ import annotations

from dataclasses import replace
from math import prod

import numpy as np

from compiler.artifact import Buffer, Launch
from compiler.codegen.pack import Packing
from compiler.ir.kernel import Kernel
from compiler.ir.uop import MOVEMENT, Ops, UOp, Weight
from compiler.link.memory import plan as plan_memory
from compiler.schedule.place import Placement
from compiler.schedule.storage import storage_bytes, storage_nbytes
from runner.format import Region

ARENA_GUARD = 128  # >= the widest vector (16 lanes of 8 bytes) minus one lane
WEIGHT_ALIGN = 64  # cache line: vector loads of a weight never straddle two lines at its start


def gather_samples(k: Kernel) -> list[list[int]]:
    """[parameter, samples] for each input the kernel reads only through Gathers: a Gather
    touches at most one element of its data per element of its output, however large the data
    (a camera frame); tools/roofline.py counts those bytes, not the whole buffer."""
    params = {u: j for j, u in enumerate(k.inputs, 1)}
    found: dict[int, int] = {}
    direct, stack, seen = set(), [k.root], set()  # inputs read other than as a Gather's data
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in params and n is not k.root:
            direct.add(params[n])
            continue
        if n.op is Ops.GATHER:
            data = n.src[0]
            while data not in params and data.op in MOVEMENT:
                data = data.src[0]
            if data in params:
                found[params[data]] = found.get(params[data], 0) + prod(n.shape)
                stack.append(n.src[1])
                continue
        stack.extend(n.src)
    return [[j, found[j]] for j in sorted(found) if j not in direct]


class Buffers:
    """Every buffer the graph touches, their regions, and the launch records that use them."""

    def __init__(self, placed: Placement, align: int, spill=None):
        """spill: stored bytes -> the same bytes out of memory (compiler/blob.py BlobWriter.spill),
        so the packed weights are not all held at once beside the model's own."""
        self.storage, self.spill = placed.storage, spill
        self.align = max(align, WEIGHT_ALIGN)
        self.table: dict[int, Buffer] = dict(enumerate(placed.buffers))  # a copy: link's own
        self.node_buf: dict = dict(placed.reads)
        self.inputs = list(placed.buffers[:placed.n_inputs])
        self.outputs = [placed.buffers[bid] for bid in placed.outputs]
        self.weights: list[tuple[int, bytes]] = []  # (buffer id, stored bytes), in layout order
        self.weight_size = 0
        self.launches: list[Launch] = []
        self.flops: list[int] = []
        self.gathers: list[list[list[int]]] = []  # per launch: gather_samples
        self.memory: list[dict | None] = []  # per launch, its kernel's L2 model (l2fetch.py)
        self.life: dict[int, list[int]] = {}
        self.inits: dict[str, int] = {}  # state name -> weights buffer of its initial value

    def _new(self, region: Region, offset: int, u: UOp, name: str = "") -> Buffer:
        dt, image = self.storage(region, u.dtype, u.shape, u)
        b = Buffer(len(self.table), region, offset, storage_nbytes(dt, u.shape, image), dt.name,
                   tuple(u.shape), name, image)
        self.table[b.id] = b
        return b

    def of(self, u: UOp, packing: Packing | None = None) -> int:
        """The buffer `u` is read from; a weight read through a packing (codegen/pack.py) gets
        its own packed copy (one per distinct packing)."""
        key = u if packing is None else (u, packing)
        if key not in self.node_buf:
            assert u.op is Ops.WEIGHT, f"unscheduled read of {u.op}"
            data = u.arg.data if packing is None else packing.apply(u.arg.data)
            self.weight_size = -(-self.weight_size // self.align) * self.align
            b = self._new(Region.WEIGHTS, self.weight_size, u if packing is None else
                          UOp(Ops.WEIGHT, u.dtype, (), Weight(data)))
            stored = storage_bytes(data, b)
            self.weights.append((b.id, self.spill(stored) if self.spill else stored))
            self.weight_size += b.nbytes
            self.node_buf[key] = b.id
        return self.node_buf[key]

    def default(self, data) -> int:
        """A weights buffer holding an input's default value as the input's own bytes (no
        storage policy: the runner binds it in the input's place)."""
        self.weight_size = -(-self.weight_size // self.align) * self.align
        b = Buffer(len(self.table), Region.WEIGHTS, self.weight_size, data.nbytes, data.dtype.name,
                   tuple(data.shape), "")
        self.table[b.id] = b
        self.weights.append((b.id, memoryview(data).cast("B")))
        self.weight_size += b.nbytes
        return b.id

    def state_init(self, name: str, value: np.ndarray) -> None:
        """A state's initial value as a weights buffer stored exactly as the state input is."""
        like = next(b for b in self.inputs if b.name == name)
        self.weight_size = -(-self.weight_size // self.align) * self.align
        b = Buffer(len(self.table), Region.WEIGHTS, self.weight_size, like.nbytes, like.dtype,
                   like.shape, f"{name} (initial value)")
        self.table[b.id] = b
        self.weights.append((b.id, np.ascontiguousarray(value, like.dtype).tobytes()))
        self.weight_size += b.nbytes
        self.inits[name] = b.id

    def launch(self, k: Kernel, args: list[int], plan) -> None:
        step = len(self.launches)
        for b in args:
            self.life.setdefault(b, [step, step])[1] = step
        self.launches.append(Launch(k.name, tuple(args), plan.global_size, plan.local))
        # work per launch, for GFLOP/s in profiles: a multiply-add per reduced element (four
        # for a DOT4's, which multiplies four bytes)
        per = 4 if any(n.op is Ops.DOT4 for n in k.root.toposort(leaves=set(k.inputs))) else 1
        self.flops.append(2 * per * prod(plan.full_shape) if plan.reduce_dims
                          else prod(plan.full_shape))
        self.gathers.append(gather_samples(k))
        self.memory.append(plan.memory and plan.memory.record())

    def plan_arena(self) -> None:
        arena = [b for b in self.table.values() if b.region is Region.ARENA]
        p = plan_memory([b.nbytes for b in arena],
                        [tuple(self.life.get(b.id, (0, 0))) for b in arena], self.align)
        # guard bytes at both ends: a masked vector load may read a few elements past a buffer
        # (vectorize.py), which must stay inside the arena; inside it they hit a neighbour
        guard = -(-ARENA_GUARD // self.align) * self.align
        for b, off in zip(arena, p.offsets):
            self.table[b.id] = replace(b, offset=off + guard)
        self.arena_bytes, self.lower_bound = p.arena_bytes + 2 * guard, p.lower_bound

    def by_id(self) -> dict[int, Buffer]:
        return dict(sorted(self.table.items()))

    def move_weights(self, offsets: dict[int, int]) -> None:
        """Place each weight buffer at offsets[id] of a weights region shared with other builds
        of the model (link/weights.py share_weights lays it out and holds its bytes)."""
        for bid, off in offsets.items():
            self.table[bid] = replace(self.table[bid], offset=off)
