"""Placement: which buffer each kernel writes and how every buffer is stored, decided before
codegen, which needs the storage (region, dtype, image) of every parameter. Graph inputs and
outputs get io slots, every other written tensor a buffer in the arena; nothing has an address
yet. Weights are placed by the link stage (compiler/link/buffers.py), once codegen has chosen
how each is packed."""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from compiler.artifact import Buffer, Image
from compiler.ir.kernel import Kernel
from compiler.ir.uop import UOp
from compiler.schedule.storage import StoragePolicy, storage_nbytes
from runner.format import Region


@dataclass(frozen=True)
class Layout:
    """How a kernel parameter's buffer is stored: kernels agreeing on it can share a program."""
    region: Region
    dtype: str  # storage dtype's numpy name
    image: Image | None


@dataclass(frozen=True)
class Placement:
    """buffers: the graph inputs (io slots 0..), then one per tensor a kernel writes, in kernel
    order (graph outputs take io slots after the inputs, in output order); ids are positions.
    writes: per kernel, the buffer it writes. reads: tensor -> the buffer it is read from."""
    buffers: tuple[Buffer, ...]
    writes: tuple[int, ...]
    reads: MappingProxyType
    storage: StoragePolicy
    n_inputs: int
    outputs: tuple[int, ...]  # buffer ids in graph output order

    def layout(self, u: UOp) -> Layout:
        """The layout of the buffer that `u` is or will be read from (a weight's, if none)."""
        if u in self.reads:
            return self.layout_of(self.reads[u])
        dt, image = self.storage(Region.WEIGHTS, u.dtype, u.shape, u)
        return Layout(Region.WEIGHTS, dt.name, image)

    def layout_of(self, bid: int) -> Layout:
        b = self.buffers[bid]
        return Layout(b.region, b.dtype, b.image)


def place(kernels: list[Kernel], inputs: list[tuple[str, UOp]], outputs: list[tuple[str, UOp]],
          storage: StoragePolicy) -> Placement:
    buffers: list[Buffer] = []
    reads: dict[UOp, int] = {}

    def new(region: Region, u: UOp, name: str = "", slot: int | None = None) -> int:
        dt, image = storage(region, u.dtype, u.shape, u, name)
        buffers.append(Buffer(len(buffers), region, 0, storage_nbytes(dt, u.shape, image),
                              dt.name, tuple(u.shape), name, image, slot))
        return len(buffers) - 1

    for i, (name, u) in enumerate(inputs):
        reads[u] = new(Region.INPUT, u, name, i)
    pending, out_ids = list(outputs), [None] * len(outputs)
    writes = [_write(k, pending, out_ids, reads, new, len(inputs)) for k in kernels]
    return Placement(tuple(buffers), tuple(writes), MappingProxyType(reads), storage,
                     len(inputs), tuple(out_ids))


def _write(k: Kernel, pending: list, out_ids: list, reads: dict, new, n_in: int) -> int:
    """The buffer kernel `k` writes: a graph output's (taken once), else its tensor's own."""
    for j, (name, u) in enumerate(pending):
        # a kernel writing another tensor's buffer is never a graph output's writer, even
        # when its root (hash-consed: a fill's constant) is the same node as an output
        if u is k.root and k.into is None:
            pending[j] = (name, None)
            out_ids[j] = bid = new(Region.OUTPUT, u, name, n_in + j)
            if k.inputs != [k.root]:
                reads.setdefault(u, bid)
            return bid
    node = k.into or k.root
    # a padded tensor's buffer exists from its fill kernel on; one overwritten in place
    # already has its own
    if node not in reads:
        reads[node] = new(Region.ARENA, node)
    reads.setdefault(k.root, reads[node])
    return reads[node]
