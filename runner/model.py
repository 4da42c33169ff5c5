"""Model: load a blob, bind inputs and outputs, run.

    m = Model.load("model.blob")
    m.input_view("img")[:] = frame            # or m.run({"img": frame, ...})
    out = {"outputs": np.empty(*m.outputs["outputs"])}
    m.run(out=out)                              # writes into out["outputs"], no copy

Inputs: arrays passed in `feeds` that are C-contiguous and aligned are bound directly (no copy);
others are copied into the model's own input slot. Outputs: arrays passed in `out` are written in
place; outputs not passed get a fresh array per run, which the next run never touches. Without
feeds, run() reads the input slots as they are (see input_view): they are the device's own io
memory (runner/device.py: io_buffer).

Deadlines: each run() waits at most `timeout_ms` (per call, else the Model's) from its submission,
then raises DeviceTimeout. After a DeviceTimeout or DeviceError the next run() first recovers the
device, then runs normally.

Threads: run() calls on one Model are serialized by a lock: a second caller waits for the first
(at most its own timeout_ms, then DeviceTimeout). A Model is never run by two threads at once.
"""
from __future__ import annotations

import math
import os
import threading
import time

import numpy as np

from runner.blob import Blob, read_blob
from runner.device import TARGETS, Device, get_device
from runner.errors import DeviceError, DeviceTimeout, InputError

DEFAULT_TIMEOUT_MS = 2000


class Model:
    def __init__(self, blob: Blob, device: Device):
        self.blob, self.device = blob, device
        self.timeout_ms = DEFAULT_TIMEOUT_MS
        self._in = [(b.name, b.shape, b.dtype) for b in blob.inputs]
        self._out = [(b.name, b.shape, b.dtype) for b in blob.outputs]
        self._slots = [device.io_buffer(i) for i in range(len(self._in))]
        self._lock = threading.Lock()
        self._broken = False  # the last run failed: recover before the next one
        self._closed = False

    @classmethod
    def load(cls, path, device: str | None = None) -> "Model":
        if not isinstance(path, (str, os.PathLike)):  # open(2) would take and close stderr
            raise TypeError(f"Model.load: expected a path (str or os.PathLike), got "
                            f"{type(path).__name__} {path!r}")
        blob = read_blob(path)
        dev = get_device(TARGETS[blob.target] if device is None else device)
        dev.check_target(blob.target)
        dev.cache_dir = f"{path}.clcache"
        try:
            dev.load(blob)
        except BaseException:
            # the traceback keeps `dev` alive in a cycle with the blob's mapping; let go of the
            # mapped buffers now, or collecting that cycle would fail on still-exported views
            dev.close()
            raise
        return cls(blob, dev)

    @property
    def inputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (shape, dtype) for name, shape, dtype in self._in}

    @property
    def outputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (shape, dtype) for name, shape, dtype in self._out}

    @property
    def meta(self) -> dict:
        return self.blob.manifest["meta"]

    def input_view(self, name: str) -> np.ndarray:
        """The input slot itself: write into it, then run() without feeds."""
        for (slot_name, _, _), slot in zip(self._in, self._slots):
            if slot_name == name:
                return slot
        raise InputError(f"unknown input {name!r}; inputs are {[n for n, _, _ in self._in]}")

    def close(self) -> None:
        """Release the device now rather than when the Model is collected; idempotent."""
        self._closed = True
        self.device.close()

    def run(self, feeds: dict | None = None, out: dict | None = None,
            timeout_ms: float | None = None) -> dict[str, np.ndarray]:
        timeout_ms = self.timeout_ms if timeout_ms is None else timeout_ms
        if not isinstance(timeout_ms, (int, float)) or isinstance(timeout_ms, bool) or \
                not 0 < timeout_ms < math.inf:
            raise InputError(f"timeout_ms: expected a positive finite number, got {timeout_ms!r}")
        if not self._lock.acquire(timeout=timeout_ms / 1000):
            raise DeviceTimeout(f"another run() on this Model did not finish within "
                                f"{timeout_ms} ms")
        try:
            return self._run(feeds, out, timeout_ms)
        finally:
            self._lock.release()

    def _run(self, feeds: dict | None, out: dict | None, timeout_ms: float) -> dict:
        dev = self.device
        if self._closed:
            raise DeviceError("run() on a closed Model; load it again")
        if self._broken:
            dev.recover()
            self._broken = False
        self._bind_feeds(feeds)
        results = self._bind_outputs(out)
        deadline = time.monotonic() + timeout_ms / 1000
        try:
            dev.wait(dev.submit(deadline), deadline)
        except DeviceTimeout as e:
            self._broken = True
            raise DeviceTimeout(f"{e} ({timeout_ms} ms after submit)") from None
        except DeviceError:
            self._broken = True
            raise
        return results

    def _bind_feeds(self, feeds: dict | None) -> None:
        bind = self.device.bind
        if feeds is None:
            for i, slot in enumerate(self._slots):
                bind(i, slot)
            return
        for i, (name, shape, dtype) in enumerate(self._in):
            if name not in feeds:
                raise InputError(f"missing input {name!r} ({dtype} {shape}); "
                                 f"received {sorted(feeds)}")
            arr = _checked(f"input {name!r}", feeds[name], shape, dtype)
            if not (arr.flags.c_contiguous and arr.flags.aligned):
                np.copyto(self._slots[i], arr)
                arr = self._slots[i]
            bind(i, arr)
        if len(feeds) != len(self._in):
            extra = sorted(set(feeds) - {name for name, _, _ in self._in})
            raise InputError(f"unexpected inputs {extra}; inputs are {[n for n, _, _ in self._in]}")

    def _bind_outputs(self, out: dict | None) -> dict[str, np.ndarray]:
        out = {} if out is None else out
        results, used = {}, 0
        for j, (name, shape, dtype) in enumerate(self._out, start=len(self._in)):
            if name not in out:
                arr = np.empty(shape, dtype)
            else:
                used += 1
                what = f"out[{name!r}]"
                arr = _checked(what, out[name], shape, dtype)
                flags = arr.flags
                if not (flags.c_contiguous and flags.aligned and flags.writeable):
                    raise InputError(f"{what}: expected a C-contiguous, aligned, writable array, "
                                     f"got c_contiguous={flags.c_contiguous} "
                                     f"aligned={flags.aligned} writeable={flags.writeable}")
            self.device.bind(j, arr)
            results[name] = arr
        if used != len(out):
            extra = sorted(set(out) - {name for name, _, _ in self._out})
            raise InputError(f"out has unknown outputs {extra}; "
                             f"outputs are {[n for n, _, _ in self._out]}")
        return results


def _checked(what: str, arr, shape: tuple, dtype: np.dtype) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise InputError(f"{what}: expected numpy.ndarray {dtype} {shape}, "
                         f"got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise InputError(f"{what}: expected dtype {dtype}, got {arr.dtype}")
    if arr.shape != shape:
        raise InputError(f"{what}: expected shape {shape}, got {arr.shape}")
    return arr
