"""Runner device "dsp": a `dsp` blob's graph runs on the Hexagon DSP, one invoke per submission.

The device lays one shared buffer out as [weights | arena | io slot 0 | io slot 1 | ...], each part
on a 128-byte boundary (HVX vector alignment), hands it and the programs to the DSP-side runtime
once at load (dsp/runtime.c), and then only invokes: {sequence number, flags} out, {sequence
number, status, per-kernel ticks} back. io slots are views of that buffer (io_buffer); a slot bound
to other host memory is copied in at submit (inputs) or out at completion (outputs), as a FastRPC
client copies a buffer that is not ION memory.

The transport is chosen by KEEL_FASTRPC: unset or "device", FastRPC on the comma device's cDSP
(dsp/fastrpc.py); "mock", the same runtime built for Linux and run under qemu-hexagon
(dsp/mock.py). Faults from KEEL_MOCK_FAULTS (runner/faults.py) apply to the mock only: hang@N makes
the emulated DSP spin without answering, fault@N makes it answer with a failure, slow@N:MS holds
its answer back MS ms.
"""
from __future__ import annotations

import os
import struct
import time

import numpy as np

from runner.device import Device, wait_until
from runner.errors import BlobError, ConfigError, DeviceError
from runner.faults import Faults, from_env

TRANSPORT_VAR, FAULTS_VAR = "KEEL_FASTRPC", "KEEL_MOCK_FAULTS"
ALIGN = 128  # HVX vector: the runtime's loads of a buffer's first vector are aligned ones
FLAG_PROFILE, FLAG_HANG, FLAG_FAULT = 1, 2, 4  # dsp/runtime.c
LOAD_S = 60.0  # the runtime answers once its library is loaded (qemu start included)


def layout(blob) -> tuple[int, int, list[int], int]:
    """(weights offset, arena offset, io slot offsets, total bytes) of the shared buffer."""
    up = lambda n: -(-max(n, 1) // ALIGN) * ALIGN  # noqa: E731
    specs = sorted((*blob.inputs, *blob.outputs), key=lambda b: b.offset)
    at, arena = up(len(blob.weights)), 0
    arena, at = at, at + up(blob.arena_bytes)
    slots = []
    for b in specs:
        slots.append(at)
        at += up(int(np.prod(b.shape)) * np.dtype(b.dtype).itemsize)
    return 0, arena, slots, at


def launch_table(blob, weights: int, arena: int, slots: list[int]) -> bytes:
    """The blob's launch table for the runtime's profiled invokes: per launch, its argument count,
    then each argument's byte offset in the shared buffer (u32 words)."""
    base = {"arena": arena, "weights": weights}
    words = []
    for ln in blob.launches:
        words.append(len(ln.args))
        for bid in ln.args:
            b = blob.buffers[bid]
            words.append(base[b.region] + b.offset if b.region in base else slots[b.offset])
    return struct.pack(f"<{len(words)}I", *words)


def transport():
    kind = os.environ.get(TRANSPORT_VAR, "device").strip() or "device"
    if kind == "mock":
        from dsp.mock import QemuTransport
        return QemuTransport()
    if kind == "device":
        from dsp.fastrpc import FastRpcTransport
        return FastRpcTransport()
    raise ConfigError(f"{TRANSPORT_VAR} must be 'device' (FastRPC) or 'mock' (qemu-hexagon), "
                      f"got {kind!r}")


class DspDevice(Device):
    name = "dsp"
    # ask the runtime for per-kernel costs: last_ticks then holds, per launch, its cycles (qemu:
    # packets), then per launch its HVX instructions (qemu only)
    profile = False

    def check_target(self, target: str) -> None:
        if target != "dsp":
            raise BlobError(f"device 'dsp' runs target 'dsp' blobs, blob target is {target!r}")

    def load(self, blob) -> None:
        mock = os.environ.get(TRANSPORT_VAR, "").strip() == "mock"
        self._faults = from_env(FAULTS_VAR) if mock else Faults({})
        self._link = transport()
        weights, arena, slots, total = layout(blob)
        self._shm = self._link.alloc(total)
        mem = np.frombuffer(self._shm, np.uint8)
        mem[weights:weights + len(blob.weights)] = np.frombuffer(blob.weights, np.uint8)
        specs = sorted((*blob.inputs, *blob.outputs), key=lambda b: b.offset)
        self._views = [mem[o:o + int(np.prod(b.shape)) * np.dtype(b.dtype).itemsize]
                       .view(b.dtype).reshape(b.shape) for o, b in zip(slots, specs)]
        self._bound = list(self._views)
        self._inputs = len(blob.inputs)
        self._value = self._done = self._failed = 0
        self._due: dict[int, float] = {}  # seq -> when a slow@N fault lets its answer through
        self._ready: list = []  # answers read, in order: (due, seq, status, ticks)
        self.last_ticks: list[int] = []
        self._link.open(blob.programs, weights, arena, slots, launch_table(blob, weights, arena,
                                                                           slots),
                        time.monotonic() + LOAD_S)

    def io_buffer(self, slot: int) -> np.ndarray:
        return self._views[slot]

    def bind(self, slot: int, array: np.ndarray) -> None:
        self._bound[slot] = array

    def submit(self, deadline: float, launches: range | None = None) -> int:
        self._value += 1
        for view, arr in zip(self._views[:self._inputs], self._bound):
            if arr is not view:
                np.copyto(view, arr)
        fault = self._faults.at(self._value)
        flags = FLAG_PROFILE if self.profile else 0
        flags |= {"hang": FLAG_HANG, "fault": FLAG_FAULT}.get(fault and fault.kind, 0)
        if fault and fault.kind == "slow":
            self._due[self._value] = time.monotonic() + fault.ms / 1000
        self._link.invoke(self._value, flags)
        return self._value

    def completed(self) -> int:
        for seq, status, ticks in self._link.replies():  # in submission order
            self._ready.append((self._due.pop(seq, 0.0), seq, status, ticks))
        now = time.monotonic()
        while self._ready and self._ready[0][0] <= now:
            _, seq, status, ticks = self._ready.pop(0)
            self._finish(seq, status, ticks)
        if self._failed:
            raise DeviceError(f"dsp invoke {self._failed} failed on the DSP")
        return self._done

    def _finish(self, seq: int, status: int, ticks: list[int]) -> None:
        if status:
            self._failed = seq
            return
        for view, arr in zip(self._views[self._inputs:], self._bound[self._inputs:]):
            if arr is not view:
                np.copyto(arr, view)
        self._done, self.last_ticks = seq, ticks

    def block(self, seconds: float) -> None:
        self._link.block(seconds)

    def wait(self, value: int, deadline: float) -> None:
        wait_until(lambda: self.completed() >= value, deadline, f"dsp invoke {value}",
                   sleep=self.block)

    def recover(self) -> None:
        """Abandon what is in flight: the DSP session is torn down and opened again (the library
        loaded anew); the shared buffer, weights included, survives."""
        self._link.restart(time.monotonic() + LOAD_S)
        self._ready, self._due = [], {}
        self._failed, self._done = 0, self._value

    def close(self) -> None:
        link = self.__dict__.pop("_link", None)
        if link is not None:
            self._views = self._bound = []
            link.close()
