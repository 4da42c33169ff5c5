"""Persistent state over device memory, bound per run so that a failed run leaves every state
exactly as before it (docs/ARCHITECTURE.md "Runtime"). Nothing is copied per run.

A state is a cycle of positions; at position p a run of an entry binds the io slot that reads
the state to `reading[p]`, the one that writes its next value to `writing[p]` (and a ring's
mirror slot to `mirroring[p]`); these are binding patch sites (runner/graph.py). p advances
only once the run has completed: a run that times out or fails never moves it, and nothing it
may have half-written is read at p.

  * ping-pong (any state): two halves; at p the current value is half p and the run writes
    half 1 - p (period 2).
  * ring (a queue of M rows that shifts k rows in per run, k | M; compiler/ring.py): one
    memory of 2L rows, L = M + k. Queue row t lives at cyclic row c = t mod L, stored twice,
    at rows c and c + L, so every window of M cyclic rows is contiguous: the value at
    position p is rows [w, w + M), w = p k (period L / k). A run writes only its k new rows,
    at the cyclic rows just past the window, (w + M) mod L, in both copies: neither is inside
    the window it reads, and the kept rows are already in place in the next window,
    w' = (w + k) mod L, which the run's readers of the shifted queue read (a window slot).
"""
from __future__ import annotations

import math

import numpy as np

from runner.graph import Entry, Graph


class States:
    def __init__(self, graph: Graph, device, weights: memoryview):
        self.specs, self.device = graph.state, device
        self.nbytes = [math.prod(s.shape) * s.dtype.itemsize for s in self.specs]
        self.rings, self.reading, self.writing, self.mirroring = [], [], [], []
        for s, n in zip(self.specs, self.nbytes):
            if s.step:
                ring, *positions = _ring(device, s.shape[0], s.step, n)
            else:
                halves = (device.alloc_state(n), device.alloc_state(n))
                ring, positions = None, (halves, halves[::-1], ())
            for into, p in zip((self.reading, self.writing, self.mirroring), positions):
                into.append(p)
            self.rings.append(ring)
        self.period = [len(r) for r in self.reading]
        self.slots = {e.name: _slots(e, self.reading, self.writing, self.mirroring)
                      for e in graph.entries}
        self.current = [0] * len(self.specs)
        self.init = [None if s.init is None else
                     bytes(weights[s.init.offset:s.init.offset + n])
                     for s, n in zip(self.specs, self.nbytes)]
        self.reset()

    def bind(self, entry: Entry) -> None:
        """Before a run of `entry`: its reads on the current value, its writes (and a ring's
        mirror) where the next one goes, a ring's window on that next value."""
        current = self.current
        self.device.bind_states([(slot, at[current[k]]) for slot, k, at in self.slots[entry.name]])

    def commit(self, entry: Entry) -> None:
        """After a completed run of `entry`: what it wrote is the state."""
        current, period = self.current, self.period
        for k, _ in entry.writes:
            current[k] = (current[k] + 1) % period[k]

    def reset(self) -> None:
        """Every state back to its initial value (zeros where the blob stores none)."""
        for k, (init, n) in enumerate(zip(self.init, self.nbytes)):
            self._write(k, init or bytes(n))

    def views(self) -> dict[str, np.ndarray]:
        """name -> the current value: a view of device memory where it is host-visible (a
        ring's is read-only: each row has two copies, write it with set()), else a read-only
        copy."""
        out = {}
        for k, s in enumerate(self.specs):
            mem = self.reading[k][self.current[k]]
            view = self.device.state_view(mem)
            if view is None:
                view = np.frombuffer(self.device.read_state(mem), np.uint8)  # read-only
            view = view[:self.nbytes[k]].view(s.dtype).reshape(s.shape)
            if s.step:
                view.flags.writeable = False
            out[s.name] = view
        return out

    def set(self, name: str, value: np.ndarray) -> None:
        k = next(k for k, s in enumerate(self.specs) if s.name == name)
        s = self.specs[k]
        self._write(k, np.ascontiguousarray(np.broadcast_to(value, s.shape), s.dtype).tobytes())

    def _write(self, k: int, data: bytes) -> None:
        """The value of state k: a ping-pong's current half; a ring's first window and its
        copy, from position 0 on."""
        ring = self.rings[k]
        if ring is None:
            self.device.write_state(self.reading[k][self.current[k]], data)
            return
        m, step = self.specs[k].shape[0], self.specs[k].step
        half = len(data) // m * (m + step)  # L rows
        image = bytearray(2 * half)
        image[:len(data)] = image[half:half + len(data)] = data
        self.device.write_state(ring, bytes(image))
        self.current[k] = 0


def _slots(e: Entry, reading: list, writing: list, mirroring: list) -> tuple:
    """Per io slot `e` binds to state: (slot, state index, the memory it is bound to at each
    position). A window reads the value the run writes: the one read at the next position."""
    ahead = [r[1:] + r[:1] for r in reading]
    return tuple((slot, k, at[k]) for pairs, at in ((e.reads, reading), (e.writes, writing),
                                                    (e.mirrors, mirroring), (e.windows, ahead))
                 for k, slot in pairs)


def _ring(device, m: int, k: int, nbytes: int) -> tuple:
    """(memory of 2L rows, per position: the window, the new rows, their copy). The new rows
    are the copy inside the next window, which the run's readers of the written value read (the
    mirror is written last, compiler/ring.py)."""
    row, rows = nbytes // m, m + k
    mem = device.alloc_state(2 * rows * row)
    part, starts = device.state_part, range(0, rows, k)
    windows = tuple(part(mem, w * row, nbytes) for w in starts)
    at = [(w + k) % rows + m - k for w in starts]  # the next window's last k rows
    news = tuple(part(mem, a * row, k * row) for a in at)
    copies = tuple(part(mem, (a - rows if a >= rows else a + rows) * row, k * row) for a in at)
    return mem, windows, news, copies
