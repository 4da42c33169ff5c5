"""The recorded graph and its binding table: what every device backend runs, built once per load
from the blob (runner/blob.py has checked every field it reads).

Guarantees:
  * `io` lists every io buffer in slot order (inputs of every entry, then outputs; docs/blob.md).
  * every launch argument is one typed Binding: a region (arena or weights) and a byte offset, or
    an io slot. A backend turns a Binding into its own address with `address`, the one place a
    region or slot becomes a pointer, GPU address or buffer offset.
  * `sites[slot]` lists every (launch, argument) that reads or writes io slot `slot`: the only
    places a rebind patches.
  * each Entry names its launch range, its own inputs and outputs (the io slots a caller feeds
    and reads) and the io slots bound to state, split from them: a state's read slot is bound to
    its current value, its write slot (and a ring's mirror slot) to where the next value goes,
    a ring's window slot to the next value (runner/state.py).
Nothing here touches a device: a backend records `launches` into its own command format.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import numpy as np

from runner.blob import Blob, BufferSpec, StateSpec
from runner.errors import InputError
from runner.format import Region


class Kind(Enum):
    ARENA = "arena"
    WEIGHTS = "weights"
    IO = "io"  # an io slot: inputs and outputs, state ones included


class Binding(NamedTuple):
    """One launch argument: in `kind`'s memory at `at` (a byte offset into the arena or the
    weights, or an io slot number)."""
    kind: Kind
    at: int


@dataclass(frozen=True)
class Slot:
    """An io slot as a caller sees it."""
    slot: int
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int


@dataclass(frozen=True)
class Entry:
    name: str
    launches: range
    inputs: tuple[Slot, ...]  # the caller's, in slot order (state slots left out)
    outputs: tuple[Slot, ...]
    reads: tuple[tuple[int, int], ...]  # (state index, io slot that reads its current value)
    writes: tuple[tuple[int, int], ...]  # (state index, io slot that writes its next value)
    mirrors: tuple[tuple[int, int], ...]  # (state index, io slot of the rows' other copy)
    windows: tuple[tuple[int, int], ...]  # (state index, io slot reading the next value)
    stateful: bool  # reads or writes some state


class Graph:
    def __init__(self, blob: Blob):
        self.io: list[BufferSpec] = [*blob.inputs, *blob.outputs]
        self.n_inputs = len(blob.inputs)
        kinds = {Region.ARENA: Kind.ARENA, Region.WEIGHTS: Kind.WEIGHTS}
        self.launches = blob.launches
        self.bindings: list[tuple[Binding, ...]] = []
        self.sites: dict[int, list[tuple[int, int]]] = {}
        for i, ln in enumerate(blob.launches):
            args = []
            for j, bid in enumerate(ln.args):
                b = blob.buffers[bid]
                if b.region in kinds:
                    args.append(Binding(kinds[b.region], b.offset))
                else:
                    args.append(Binding(Kind.IO, b.slot))
                    self.sites.setdefault(b.slot, []).append((i, j))
            self.bindings.append(tuple(args))
        self.state: tuple[StateSpec, ...] = blob.state
        self.entries = [_entry(e, blob.state) for e in blob.entries]
        self.state_slots = {s for e in self.entries for pairs in
                            (e.reads, e.writes, e.mirrors, e.windows) for _, s in pairs}

    def address(self, binding: Binding, bases: dict[Kind, int], io: list[int]) -> int:
        """A binding as an address: `bases` holds the arena's and weights' base, `io` each
        slot's bound address, in the backend's own unit (pointer, GPU address, offset)."""
        return io[binding.at] if binding.kind is Kind.IO else bases[binding.kind] + binding.at

    def entry(self, name: str | None) -> Entry:
        """The entry called `name`; None: the blob's one entry (a typed error when it has
        several, listing them)."""
        if name is None:
            if len(self.entries) == 1:
                return self.entries[0]
            raise InputError(f"this blob has entries {[e.name for e in self.entries]}: name one "
                             f"(run(..., entry=NAME))")
        for e in self.entries:
            if e.name == name:
                return e
        raise InputError(f"unknown entry {name!r}; entries are {[e.name for e in self.entries]}")


def _entry(e, states: tuple[StateSpec, ...]) -> Entry:
    mine = {b.id for b in (*e.inputs, *e.outputs)}

    def bound(key: str) -> tuple[tuple[int, int], ...]:
        return tuple((k, b.slot) for k, s in enumerate(states) for b in getattr(s, key)
                     if b.id in mine)
    reads, writes, mirrors, windows = (bound(key) for key in ("reads", "writes", "mirrors",
                                                               "windows"))
    state = {slot for _, slot in (*reads, *writes, *mirrors, *windows)}
    slot = lambda b: Slot(b.slot, b.name, b.shape, b.dtype, b.nbytes)  # noqa: E731
    return Entry(e.name, e.launches, tuple(slot(b) for b in e.inputs if b.slot not in state),
                 tuple(slot(b) for b in e.outputs if b.slot not in state), reads, writes,
                 mirrors, windows, bool(state))
