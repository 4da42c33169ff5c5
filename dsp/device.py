"""Runner device "dsp": a `dsp` blob's graph runs on the Hexagon DSP, one invoke per submission.
It is runner/queue.py's queue device; this file is its verbs.

The device lays one shared buffer out as [weights | arena | memory that alloc() hands out: io
slots, staging copies, state halves], each part on a 128-byte boundary (HVX vector alignment),
hands it, the programs and the launch table to the DSP-side runtime once at load
(dsp/skel.c; under qemu, sim/dsp/runtime.c), and then only invokes: {sequence number, flags, launch range,
patches} out, {sequence number, status, per-kernel ticks} back. A patch rebinds an io slot to
other bytes of the shared buffer (a state's other half, a staging copy): the DSP side's io
pointers are its recorded graph, and a launch table argument names an io slot, never its
address. Host arrays are not ION memory, so runner/queue.py stages them (as a FastRPC client
copies a buffer that is not).

The transport is chosen by KEEL_FASTRPC: unset or "device", FastRPC on the comma device's cDSP
(dsp/fastrpc.py); "mock", the same runtime built for Linux and run under qemu-hexagon
(sim/dsp/mock.py). Faults from KEEL_MOCK_FAULTS (runner/faults.py) apply to the mock only: hang@N
makes the emulated DSP spin without answering, fault@N makes it answer with a failure, slow@N:MS
holds its answer back MS ms.

Threads (dsp/graph_runner.h, docs/dsp.md "Threads"): the runtime shares each launch whose
kernel splits between the cDSP's hardware threads (HVX kernels: its HVX contexts), one launch
after another; KEEL_DSP_SERIAL=1 at load, or the device's `serial = True` (read at each invoke),
runs everything on one thread.

Profiling: the runtime counts each worker's cost of each launch (the DSP's cycle counter; under
qemu, qemu's packet count, which it keeps per thread) and HVX instructions (qemu only).
`worker_ticks` holds them per worker; `last_ticks` per launch its critical path (its slowest
worker's cost: the launch ends when its last share does), then its HVX instructions (all
workers'). spans() turns costs into nanoseconds at the DSP's nominal clock, DSP_HZ, one lane per
worker, launches end to end: on qemu a cost model, not a latency.
"""
from __future__ import annotations

import math
import os
import struct
import time

import numpy as np

from runner.device import Span
from runner.errors import BlobError, DeviceError
from runner.faults import FaultKind, Faults, from_env
from runner.graph import Graph, Kind
from runner.queue import Memory, QueueDevice
from runner.simulators import simulator

TRANSPORT_VAR, FAULTS_VAR, SERIAL_VAR = "KEEL_FASTRPC", "KEEL_MOCK_FAULTS", "KEEL_DSP_SERIAL"
ALIGN = 128  # HVX vector: the runtime's loads of a buffer's first vector are aligned ones
# dsp/graph_runner.h, sim/dsp/runtime.c
FLAG_PROFILE, FLAG_HANG, FLAG_FAULT, FLAG_SERIAL = 1, 2, 4, 8
MAX_WORKERS = 4  # a profiled answer's rows: the cDSP's hardware threads
IO_ARG = 1 << 31  # a launch table word naming an io slot (dsp/graph_runner.h)
DSP_HZ = 960e6  # the cDSP's nominal clock: profile costs (cycles) as nanoseconds
LOAD_S = 60.0  # the runtime answers once its library is loaded (qemu start included)
# qemu-hexagon interprets every packet: a run takes one to two orders of magnitude longer than
# on the DSP, so under KEEL_FASTRPC=mock a Model's default deadline is this many times longer
# (docs/dsp.md, "Deadlines under emulation")
EMULATED_DEADLINE_SCALE = 100.0


def _up(n: int) -> int:
    return -(-max(n, 1) // ALIGN) * ALIGN


def launch_table(graph: Graph, weights: int, arena: int) -> bytes:
    """The blob's launch table for the runtime (u32 words): per launch, its argument count, then
    each argument: its byte offset in the shared buffer, or IO_ARG | its io slot."""
    base = {Kind.ARENA: arena, Kind.WEIGHTS: weights}
    words = []
    for args in graph.bindings:
        words.append(len(args))
        words += [IO_ARG | b.at if b.kind is Kind.IO else base[b.kind] + b.at for b in args]
    return struct.pack(f"<{len(words)}I", *words)


def transport():
    """FastRPC, or qemu-hexagon with KEEL_FASTRPC=mock (runner/simulators.py)."""
    mock = simulator(TRANSPORT_VAR)
    if mock:
        return mock()
    from dsp.fastrpc import FastRpcTransport
    return FastRpcTransport()


class DspDevice(QueueDevice):
    name = "dsp"
    serial = False  # every launch on one hardware thread (also KEEL_DSP_SERIAL=1)

    def check_target(self, target: str) -> None:
        if target != "dsp":
            raise BlobError(f"device 'dsp' runs target 'dsp' blobs, blob target is {target!r}")

    def open(self, blob) -> None:
        mock = simulator(TRANSPORT_VAR) is not None
        self._faults = from_env(FAULTS_VAR) if mock else Faults({})
        self.deadline_scale = EMULATED_DEADLINE_SCALE if mock else 1.0
        self._link = transport()
        self._programs = blob.programs
        io = sum(_up(b.nbytes) for b in (*blob.inputs, *blob.outputs))
        state = sum(_up(math.prod(s.shape) * s.dtype.itemsize) for s in blob.state)
        # io slots, a staging copy of each, two halves of each state
        self._weights, self._arena = 0, _up(len(blob.weights))
        self._free = self._arena + _up(blob.arena_bytes)
        self._shm = self._link.alloc(self._free + 2 * io + 2 * state)
        self._mem = np.frombuffer(self._shm, np.uint8)
        self._mem[:len(blob.weights)] = np.frombuffer(blob.weights, np.uint8)
        self._done = self._failed = 0
        self._due: dict[int, float] = {}  # seq -> when a slow@N fault lets its answer through
        self._ready: list = []  # answers read, in order: (due, seq, status, ticks)
        self._patches: dict[int, int] = {}  # slot -> offset, sent with the next invoke
        self._profiling = False
        self.serial = self.serial or os.environ.get(SERIAL_VAR) == "1"
        self.last_ticks: list[int] = []
        self.worker_ticks: list[list[int]] = []  # per worker, per launch: its share's cost

    def alloc(self, nbytes: int) -> Memory:
        at, self._free = self._free, self._free + _up(nbytes)
        if self._free > len(self._mem):
            raise DeviceError(f"dsp: the shared buffer's {len(self._mem)} bytes are all handed "
                              f"out; {nbytes} more asked")
        return Memory(at, self._mem[at:at + nbytes], nbytes)

    def map_host(self, slot: int, array):
        return None

    def record(self) -> None:
        self._link.open(self._programs, self._weights, self._arena, list(self.io_address),
                        launch_table(self.graph, self._weights, self._arena),
                        time.monotonic() + LOAD_S)

    def patch(self, slot: int, offset: int) -> None:
        self._patches[slot] = offset

    def kick(self, launches: range, deadline: float, value: int) -> None:
        fault = self._faults.at(value)
        flags = (FLAG_PROFILE if self._profiling else 0) | (FLAG_SERIAL if self.serial else 0)
        flags |= {FaultKind.HANG: FLAG_HANG,
                  FaultKind.FAULT: FLAG_FAULT}.get(fault and fault.kind, 0)
        if fault and fault.kind is FaultKind.SLOW:
            self._due[value] = time.monotonic() + fault.ms / 1000
        patches = [w for slot, offset in self._patches.items() for w in (slot, offset)]
        self._link.invoke(value, struct.pack(f"<{5 + len(patches)}I", value, flags,
                                             launches.start, launches.stop,
                                             len(self._patches), *patches))
        self._patches.clear()

    def completed(self) -> int:
        for seq, status, ticks in self._link.replies():  # in submission order
            self._ready.append((self._due.pop(seq, 0.0), seq, status, ticks))
        now = time.monotonic()
        while self._ready and self._ready[0][0] <= now:
            _, seq, status, ticks = self._ready.pop(0)
            if status:
                self._failed = seq
            else:
                self._done = seq
                self._read_ticks(ticks)
        if self._failed:
            raise DeviceError(f"dsp invoke {self._failed} failed on the DSP")
        return self._done

    def block(self, seconds: float) -> None:
        self._link.block(seconds)

    def reset(self) -> None:
        """Abandon what is in flight: the DSP session is torn down and opened again (the library
        loaded anew, with the io slots where they are now bound); the shared buffer, weights and
        state included, survives."""
        self._link.restart(time.monotonic() + LOAD_S)
        self._ready, self._due, self._patches = [], {}, dict(enumerate(self.io_address))
        self._failed, self._done = 0, self.value

    def close(self) -> None:
        link = self.__dict__.pop("_link", None)
        if link is not None:
            self.io_arrays = self.bound = self.io_memory = self.stages = []
            self._mem = None
            link.close()

    def set_profiling(self, on: bool) -> None:
        """Each invoke reads the DSP's counters around each worker's share of each launch:
        worker_ticks then holds each worker's costs; last_ticks per launch its critical path
        (the slowest worker's cost), then per launch its HVX instructions (all workers')."""
        self._profiling = on

    def _read_ticks(self, ticks: list[int]) -> None:
        """A profiled answer: per worker its costs, then per worker its HVX counts, each one per
        launch of the invoke (dsp/graph_runner.h)."""
        if not ticks:
            return
        n = len(ticks) // (2 * MAX_WORKERS)
        rows = [ticks[w * n:(w + 1) * n] for w in range(2 * MAX_WORKERS)]
        self.worker_ticks = rows[:MAX_WORKERS]
        self.last_ticks = [max(c) for c in zip(*rows[:MAX_WORKERS])] + \
            [sum(h) for h in zip(*rows[MAX_WORKERS:])]

    def launch_times(self, launches: range) -> list[Span]:
        """One span per worker's share, on that worker's lane; a launch starts when the one
        before it has ended on every worker."""
        spans, at = [], 0
        for k, i in enumerate(launches):
            costs = [round(row[k] * 1e9 / DSP_HZ) for row in self.worker_ticks]
            spans += [Span(i, w, at, at + c) for w, c in enumerate(costs) if c]
            at += max(costs, default=0)
        return spans
