"""Mock queue device (device="mock"): the contract of a GPU or DSP queue, run on the host.

load() records the blob's replay table the way a command stream is recorded: per launch, an
argument array of pointers (arena + offset, weights + offset, io slot). A worker thread plays
submissions in order by calling the CPU program's `keel_launch(i, args)` for every launch of the
table, then signals the submission's timeline value. bind() patches only the argument entries of
that slot. So the mock exercises what a real queue backend depends on (the replay table, the
patching, an asynchronous timeline, bounded waits, recovery) with kernels whose results are the
CPU's, bit for bit.

Faults from KEEL_MOCK_FAULTS (runner/faults.py): hang@N, fault@N, slow@N:MS.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque

from runner.abi import LAUNCH
from runner.cpu import (CpuDevice, HostQueue, _symbol, ffi, host_memory, release_host_memory,
                        shutdown)
from runner.device import Span
from runner.errors import DeviceError
from runner.faults import FaultKind, from_env
from runner.graph import Kind

FAULTS_VAR = "KEEL_MOCK_FAULTS"
JOIN_S = 5.0  # a replay in flight when recover() stops the worker finishes within one run


class MockDevice(HostQueue):
    name = "mock"
    check_target = CpuDevice.check_target  # it runs the CPU targets' programs

    def open(self, blob) -> None:
        # a bad one fails the load
        faults = from_env(FAULTS_VAR, (FaultKind.HANG, FaultKind.FAULT, FaultKind.SLOW))
        self._arena, self._arena_ptr, self._weights_ptr, self._lib = host_memory(blob)
        self._launch = _symbol(self._lib, LAUNCH)
        self._faults = faults

    def record(self) -> None:
        """Per launch, its argument pointers, as a command stream holds addresses."""
        bases = {Kind.ARENA: self._arena_ptr, Kind.WEIGHTS: self._weights_ptr}
        table = [ffi.new("void *[]", [self.graph.address(b, bases, self.io_address)
                                      for b in args]) for args in self.graph.bindings]
        self._queue = Queue(self._launch, table, self._faults)
        self._finalizer = weakref.finalize(self, shutdown, [self._queue], self._lib)

    def patch(self, slot: int, address) -> None:
        table = self._queue.table
        for i, j in self.graph.sites.get(slot, ()):
            table[i][j] = address

    def kick(self, launches: range, deadline: float, value: int) -> None:
        self._queue.submit(launches)

    def completed(self) -> int:
        return self._queue.completed()

    def block(self, seconds: float) -> None:
        self._queue.block(seconds)

    def reset(self) -> None:
        self._queue.restart()

    def close(self) -> None:
        release_host_memory(self)  # stops the worker before the memory it replays into goes

    def set_profiling(self, on: bool) -> None:
        self._queue.stamps = [0] * (2 * len(self._queue.table)) if on else None

    def launch_times(self, launches: range) -> list[Span]:
        stamps = self._queue.stamps
        return [Span(i, 0, stamps[2 * i], stamps[2 * i + 1]) for i in launches]


class Queue:
    """The mock's hardware side: a timeline and a worker thread that replays submissions in
    order. It holds no reference to the device, so a dropped Model's device is collected and its
    finalizer stops the worker."""

    def __init__(self, launch, table: list, faults):
        self.launch, self.table, self.faults = launch, table, faults
        self.cond = threading.Condition()
        self.pending: deque[int] = deque()
        self.value = self.done = self.failed = 0
        self.gen = 0  # bumped by restart() and close(): a worker serves one generation
        self.stamps: list[int] | None = None  # per launch start, end (ns) when profiling
        self._start()

    def submit(self, launches: range) -> int:
        with self.cond:
            self.value += 1
            self.pending.append((self.value, launches))
            self.cond.notify_all()
        return self.value

    def completed(self) -> int:
        if self.failed:
            raise DeviceError(f"mock submission {self.failed}: device fault ({FAULTS_VAR})")
        return self.done

    def block(self, seconds: float) -> None:
        with self.cond:
            self.cond.wait(seconds)

    def _start(self) -> None:
        self.worker = threading.Thread(target=self._serve, args=(self.gen,), daemon=True,
                                       name="keel-mock")
        self.worker.start()

    def _serve(self, gen: int) -> None:
        stopped = lambda: self.gen != gen  # noqa: E731
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.pending or stopped())
                if stopped():
                    return
                value, launches = self.pending.popleft()
            fault = self.faults.at(value)
            kind = fault and fault.kind
            if kind in (FaultKind.HANG, FaultKind.SLOW):
                with self.cond:  # until restart(), or for the slow delay
                    wait = None if kind is FaultKind.HANG else fault.ms / 1000
                    if self.cond.wait_for(stopped, wait):
                        return
            if kind is not FaultKind.FAULT:
                self._replay(launches)
            with self.cond:
                if stopped():
                    return
                if kind is FaultKind.FAULT:
                    self.failed = value
                else:
                    self.done = value
                self.cond.notify_all()

    def _replay(self, launches: range) -> None:
        stamps, table = self.stamps, self.table  # profiling: the host clock around each launch,
        if stamps is None:  # as a GPU's timestamp packets bracket each dispatch
            for i in launches:
                self.launch(i, table[i])
            return
        for i in launches:
            args = table[i]
            stamps[2 * i] = time.perf_counter_ns()
            self.launch(i, args)
            stamps[2 * i + 1] = time.perf_counter_ns()

    def close(self) -> bool:
        """Stop the worker; a replay in flight finishes first (its kernels are bounded). True
        once it has stopped (runner/cpu.py: shutdown)."""
        with self.cond:
            self.gen += 1
            self.cond.notify_all()
        self.worker.join(JOIN_S)
        return not self.worker.is_alive()

    def restart(self) -> None:
        """Abandon a hung submission, retire what was queued, start a fresh worker."""
        self.close()
        self.pending.clear()
        self.failed, self.done = 0, self.value  # nobody waits on retired submissions
        self._start()
