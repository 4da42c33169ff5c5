"""The buffer table: every buffer the graph touches, the region and offset it lives at, how it
is stored, and the launch records that use it. The arena's offsets come from memory.py once
every launch is recorded (lifetimes are launch steps)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import TYPE_CHECKING

import numpy as np

from compiler.artifact import Buffer, Image, Launch
from compiler.ir.kernel import Kernel
from compiler.ir.uop import Ops, UOp, Weight
from compiler.schedule.memory import plan as plan_memory
from compiler.schedule.storage import StoragePolicy, storage_bytes, storage_nbytes
from runner.format import Region

if TYPE_CHECKING:  # codegen packs, the schedule only applies the result
    from compiler.codegen.pack import Packing

ARENA_GUARD = 128  # >= the widest vector (16 lanes of 8 bytes) minus one lane
WEIGHT_ALIGN = 64  # cache line: vector loads of a weight never straddle two lines at its start


@dataclass(frozen=True)
class Layout:
    """How a kernel parameter's buffer is stored: kernels agreeing on it can share a program."""
    region: Region
    dtype: str  # storage dtype's numpy name
    image: Image | None


class Buffers:
    """Every buffer the graph touches, their regions, and the launch records that use them."""

    def __init__(self, inputs: list[tuple[str, UOp]], outputs: list[tuple[str, UOp]],
                 storage: StoragePolicy, align: int = WEIGHT_ALIGN, spill=None):
        """spill: stored bytes -> the same bytes out of memory (compiler/blob.py BlobWriter.spill),
        so the packed weights are not all held at once beside the model's own."""
        self.storage, self.spill = storage, spill
        self.align = max(align, WEIGHT_ALIGN)
        self.table: dict[int, Buffer] = {}
        self.node_buf: dict[UOp, int] = {}
        self.inputs = [self._new(Region.INPUT, i, u, name) for i, (name, u) in enumerate(inputs)]
        for (_, u), b in zip(inputs, self.inputs):
            self.node_buf[u] = b.id
        self.outputs: list[Buffer] = []
        self.out_index: dict[int, int] = {}  # buffer id -> position among graph outputs
        self.pending_outputs = list(outputs)
        self.weights: list[tuple[int, bytes]] = []  # (buffer id, stored bytes), in layout order
        self.weight_size = 0
        self.launches: list[Launch] = []
        self.flops: list[int] = []
        self.life: dict[int, list[int]] = {}
        self.inits: dict[str, int] = {}  # state name -> weights buffer of its initial value

    def _new(self, region: Region, offset: int, u: UOp, name: str = "") -> Buffer:
        dt, image = self.storage(region, u.dtype, u.shape, u)
        b = Buffer(len(self.table), region, offset, storage_nbytes(dt, u.shape, image), dt.name,
                   tuple(u.shape), name, image)
        self.table[b.id] = b
        return b

    def output_of(self, k: Kernel) -> int:
        for j, (name, u) in enumerate(self.pending_outputs):
            # a kernel writing another tensor's buffer is never a graph output's writer, even
            # when its root (hash-consed: a fill's constant) is the same node as an output
            if u is k.root and k.into is None:
                self.pending_outputs[j] = (name, None)
                b = self._new(Region.OUTPUT, 0, u, name)
                self.out_index[b.id] = j
                if k.inputs != [k.root]:
                    self.node_buf.setdefault(u, b.id)
                return b.id
        node = k.into or k.root
        # a padded tensor's buffer exists from its fill kernel on; one overwritten in place
        # already has its own
        if node not in self.node_buf:
            self.node_buf[node] = self._new(Region.ARENA, 0, node).id
        self.node_buf.setdefault(k.root, self.node_buf[node])
        return self.node_buf[node]

    def layout(self, u: UOp) -> Layout:
        """The layout of the buffer that `u` is or will be read from."""
        if u in self.node_buf:
            return self.layout_of(self.node_buf[u])
        dt, image = self.storage(Region.WEIGHTS, u.dtype, u.shape, u)
        return Layout(Region.WEIGHTS, dt.name, image)

    def layout_of(self, bid: int) -> Layout:
        b = self.table[bid]
        return Layout(b.region, b.dtype, b.image)

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

    def plan_arena(self) -> None:
        n_in = len(self.inputs)
        for bid, j in self.out_index.items():  # io slots: inputs first, then outputs in order
            b = self.table[bid]
            self.table[bid] = replace(b, offset=n_in + j)
        self.outputs = [self.table[bid] for bid in sorted(self.out_index, key=self.out_index.get)]
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
        of the model (compiler/blob.py:share_weights lays it out and holds its bytes)."""
        for bid, off in offsets.items():
            self.table[bid] = replace(self.table[bid], offset=off)
