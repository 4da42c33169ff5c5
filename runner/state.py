"""Persistent state: the ping-pong over device memory that makes a failed run leave every state
exactly as before it (docs/ARCHITECTURE.md "State").

Each state has two halves of device memory (Device.alloc_state) and a current half p. A run of
an entry binds the io slot that reads the state to half p and the one that writes its next value
to half 1 - p (both are binding patch sites, runner/graph.py), and p flips only once the run has
completed. A run that times out or fails never flips p, so the state is the one before it; the
half it may have half-written is the next run's to overwrite. Nothing is copied per run.
"""
from __future__ import annotations

import math

import numpy as np

from runner.graph import Entry, Graph


class States:
    def __init__(self, graph: Graph, device, weights: memoryview):
        self.specs, self.device = graph.state, device
        self.nbytes = [math.prod(s.shape) * s.dtype.itemsize for s in self.specs]
        self.halves = [(device.alloc_state(n), device.alloc_state(n)) for n in self.nbytes]
        self.current = [0] * len(self.specs)
        self.init = [None if s.init is None else
                     bytes(weights[s.init.offset:s.init.offset + n])
                     for s, n in zip(self.specs, self.nbytes)]
        self.reset()

    def bind(self, entry: Entry) -> None:
        """Before a run of `entry`: its reads on the current halves, its writes on the others."""
        bind, halves, current = self.device.bind_state, self.halves, self.current
        for k, slot in entry.reads:
            bind(slot, halves[k][current[k]])
        for k, slot in entry.writes:
            bind(slot, halves[k][1 - current[k]])

    def commit(self, entry: Entry) -> None:
        """After a completed run of `entry`: what it wrote is the state."""
        for k, _ in entry.writes:
            self.current[k] ^= 1

    def reset(self) -> None:
        """Every state back to its initial value (zeros where the blob stores none)."""
        for k, (init, n) in enumerate(zip(self.init, self.nbytes)):
            self.device.write_state(self.halves[k][self.current[k]], init or bytes(n))

    def views(self) -> dict[str, np.ndarray]:
        """name -> the current value: a writable view of device memory where it is host-visible,
        else a read-only copy (write it with set())."""
        out = {}
        for k, s in enumerate(self.specs):
            mem = self.halves[k][self.current[k]]
            view = self.device.state_view(mem)
            if view is None:
                view = np.frombuffer(self.device.read_state(mem), np.uint8)  # read-only
            out[s.name] = view[:self.nbytes[k]].view(s.dtype).reshape(s.shape)
        return out

    def set(self, name: str, value: np.ndarray) -> None:
        k = next(k for k, s in enumerate(self.specs) if s.name == name)
        s = self.specs[k]
        data = np.ascontiguousarray(np.broadcast_to(value, s.shape), s.dtype).tobytes()
        self.device.write_state(self.halves[k][self.current[k]], data)
