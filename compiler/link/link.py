"""The link stage: after codegen, every variant's programs become launches over concrete buffers.
It packs each weight as its program reads it, records the launches, plans the arena, marks the
barriers, stores the states' initial values and the inputs' defaults, and lays out one weights
region that every variant and entry shares. Nothing before it has an address; nothing after it
moves one."""
from __future__ import annotations

from dataclasses import dataclass

from compiler.codegen.build import Built
from compiler.ir.kernel import Kernel
from compiler.link.buffers import Buffers
from compiler.link.hazards import mark_barriers
from compiler.link.weights import share_weights
from compiler.schedule.place import Placement


@dataclass(frozen=True)
class Use:
    """One launch: a scheduled kernel, the buffer it writes and the job that builds its program."""
    kernel: Kernel
    out: int
    key: tuple


@dataclass
class Linked:
    """One variant's buffer table (launches, arena, weights at their final offsets) and its
    inputs' defaults: [input index, weights buffer]."""
    buffers: Buffers
    defaults: list[list[int]]


def link(placements: list[Placement], uses: list[list[Use]], built: list[dict[tuple, Built]],
         aligns: list[int], graphs: list, n_inputs: list[int], pairs: dict[str, str], writer=None,
         units=lambda bufs: {}) -> tuple[list[Linked], tuple[bytes, tuple[int, ...]]]:
    """Per variant: its placement, launches (`uses`), built programs and buffer alignment.
    writer: compiler/blob.py BlobWriter, whose file the packed weights spill to and the shared
    region is laid out in. n_inputs: per entry, its scheduled inputs. units: a variant's buffers -> the io buffers one memory holds
    (hazards.mark_barriers; a ring's, compiler/ring.py units).
    -> (each variant linked, (the weights region, its sections' sizes))."""
    out = []
    for placed, vuses, vbuilt, align in zip(placements, uses, built, aligns):
        bufs = Buffers(placed, align, writer and writer.spill)
        _launches(bufs, vuses, vbuilt, units)
        out.append(Linked(bufs, _defaults(bufs, graphs, n_inputs, pairs)))
    weights = share_weights([v.buffers for v in out], writer and writer.region)
    return out, weights


def _launches(bufs: Buffers, uses: list[Use], built: dict[tuple, Built], units) -> None:
    """Record one variant's launches of its built programs, plan its arena, mark barriers."""
    for use in uses:
        b = built[use.key]
        args = [use.out] + [bufs.of(u, b.packings.get(j))
                            for j, u in enumerate(use.kernel.inputs, 1)]
        bufs.launch(Kernel(b.name, use.kernel.root, use.kernel.inputs), args, b.plan)
    bufs.plan_arena()
    bufs.launches = mark_barriers(bufs.launches, bufs.by_id(), units(bufs))


def _defaults(bufs: Buffers, graphs: list, n_inputs: list[int],
              pairs: dict[str, str]) -> list[list[int]]:
    """Stores the states' initial values (weights with the state's bytes) and the inputs'
    default values (--overridable); returns [input index, weights buffer] of the latter."""
    for x in pairs:
        default = next((g.defaults[x] for g in graphs if x in g.defaults), None)
        if default is not None:
            bufs.state_init(x, default)
    found, first = [], 0
    for g, n in zip(graphs, n_inputs):  # an entry's own inputs first, then a ring's windows
        found += [[first + j, bufs.default(g.input_defaults[name])]
                  for j, (name, _) in enumerate(g.inputs) if name in g.input_defaults]
        first += n
    return found
