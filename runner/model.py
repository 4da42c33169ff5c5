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

External inputs (modeld's camera frames, owned by the vision pipeline): bind_input(name, arr)
binds a C-contiguous aligned array to an input for every run() without feeds, with no copy, until
it is bound again (None: back to the model's own slot). The Model keeps a reference to it.

openpilot output slices: when the model's ONNX carried openpilot's `output_slices`,
`output_slices` maps each name to a slice of the flattened output, and output_views(out) gives
named zero-copy views into preallocated outputs (take them once; every run rewrites them).

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
from typing import NamedTuple

import numpy as np

from runner import cache
from runner.blob import Blob, read_blob
from runner.device import Device, get_device
from runner.errors import DeviceError, DeviceTimeout, InputError
from runner.graph import Entry, Graph, Slot
from runner.slices import read_slices
from runner.state import States
from runner.targets import device_of

DEFAULT_TIMEOUT_MS = 2000


class Model:
    def __init__(self, blob: Blob, device: Device):
        self._sliced, self._slices = read_slices(blob.manifest, blob.outputs)
        self.blob, self.device = blob, device
        self.timeout_ms = DEFAULT_TIMEOUT_MS
        self.graph = Graph(blob)
        self._slots = [device.io_buffer(i) for i in range(len(blob.inputs))]
        self._bound_in = list(self._slots)  # what run() without feeds reads, per input slot
        self._state = States(self.graph, device, blob.weights)
        self._lock = threading.Lock()
        self._broken = False  # the last run failed: recover before the next one
        self._closed = False

    @classmethod
    def load(cls, path, device: str | None = None, variant: str | None = None) -> "Model":
        """variant: which of the blob's variants to run (a `cpu` blob: cpu-avx2 or cpu-avx512);
        None: the best this host runs, or KEEL_CPU_VARIANT's (runner/host.py)."""
        if not isinstance(path, (str, os.PathLike)):  # open(2) would take and close stderr
            raise TypeError(f"Model.load: expected a path (str or os.PathLike), got "
                            f"{type(path).__name__} {path!r}")
        blob = read_blob(path, variant)
        dev = get_device(device_of(blob.variant) if device is None else device)
        dev.check_target(blob.variant)
        dev.cache_dir = cache.beside(path)
        try:
            dev.load(blob)
            return cls(blob, dev)
        except BaseException:
            # the traceback keeps `dev` alive in a cycle with the blob's mapping; let go of the
            # mapped buffers now, or collecting that cycle would fail on still-exported views
            dev.close()
            raise

    @property
    def entries(self) -> dict[str, EntryInfo]:
        """name -> its inputs and outputs ({name: (shape, dtype)}, state left out), in blob
        order; the first is the default when it is the only one."""
        return {e.name: EntryInfo(_io(e.inputs), _io(e.outputs)) for e in self.graph.entries}

    @property
    def inputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """The entry's inputs (the default entry's: an InputError when the blob has several)."""
        return _io(self.graph.entry(None).inputs)

    @property
    def outputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return _io(self.graph.entry(None).outputs)

    @property
    def state(self) -> dict[str, np.ndarray]:
        """name -> the state's current value (as of the last completed run): a writable view of
        the device's memory where it is host-visible (cpu, mock, qcom, dsp), a read-only copy
        elsewhere (opencl, amd: write with set_state). Take it again after each run: a run
        moves the state to the other half of its ping-pong. After a failed run it is the state
        from before that run (the device is recovered first)."""
        with self._lock:
            self._recover_if_broken()
            return self._state.views()

    def set_state(self, name: str, value) -> None:
        """Write a state's current value (any device); value broadcasts to its shape."""
        if name not in {s.name for s in self.graph.state}:
            raise InputError(f"unknown state {name!r}; states are "
                             f"{[s.name for s in self.graph.state]}")
        with self._lock:
            self._recover_if_broken()
            self._state.set(name, value)

    def reset_state(self) -> None:
        """Every state back to its initial value (the blob's, or zeros)."""
        with self._lock:
            self._recover_if_broken()
            self._state.reset()

    def _recover_if_broken(self) -> None:
        """After a DeviceTimeout or DeviceError: recover the device before it is used again."""
        if self._closed:
            raise DeviceError("a closed Model; load it again")
        if self._broken:
            self.device.recover()
            self._broken = False

    @property
    def meta(self) -> dict:
        return self.blob.manifest["meta"]

    @property
    def output_slices(self) -> dict[str, slice]:
        """openpilot's {name: slice} over the flattened output; {} when the model has none."""
        return dict(self._slices)

    def output_views(self, out: dict) -> dict[str, np.ndarray]:
        """{name: out[output].reshape(-1)[slice]} as views: no copy, valid for every later run
        that writes into the same `out` (run(out=out))."""
        if self._sliced is None:
            raise InputError("this model has no output_slices (its ONNX metadata_props had none)")
        spec = next(b for b in self.blob.outputs if b.name == self._sliced)
        arr = _checked(f"out[{self._sliced!r}]", out.get(self._sliced), spec.shape, spec.dtype)
        flat = arr.view()
        try:
            flat.shape = (-1,)  # raises rather than copy
        except AttributeError:
            raise InputError(f"out[{self._sliced!r}]: expected a C-contiguous array") from None
        return {name: flat[s] for name, s in self._slices.items()}

    def input_view(self, name: str, entry: str | None = None) -> np.ndarray:
        """The array run() without feeds reads for this input (its own slot unless bind_input
        bound another): write into it, then run() without feeds."""
        return self._bound_in[self._input(name, entry).slot]

    def bind_input(self, name: str, array: np.ndarray | None, entry: str | None = None) -> None:
        """Bind an externally owned array (a camera frame) to an input, zero-copy, for every
        run() without feeds until bound again; None binds the model's own slot back."""
        s = self._input(name, entry)
        if array is None:
            array = self._slots[s.slot]
        arr = _checked(f"bind_input({name!r})", array, s.shape, s.dtype)
        if not (arr.flags.c_contiguous and arr.flags.aligned):
            raise InputError(f"bind_input({name!r}): expected a C-contiguous, aligned array "
                             f"(binding is zero-copy), got c_contiguous={arr.flags.c_contiguous} "
                             f"aligned={arr.flags.aligned}")
        self._bound_in[s.slot] = arr  # one store: a run binding now sees the old array or this one

    def _input(self, name: str, entry: str | None) -> Slot:
        inputs = self.graph.entry(entry).inputs
        for s in inputs:
            if s.name == name:
                return s
        raise InputError(f"unknown input {name!r}; inputs are {[s.name for s in inputs]}")

    def close(self) -> None:
        """Release the device now rather than when the Model is collected; idempotent."""
        self._closed = True
        self.device.close()

    def run(self, feeds: dict | None = None, out: dict | None = None,
            timeout_ms: float | None = None, entry: str | None = None) -> dict[str, np.ndarray]:
        """entry: which entry point runs (Model.entries); None: the blob's only one."""
        timeout_ms = self.timeout_ms if timeout_ms is None else timeout_ms
        if not isinstance(timeout_ms, (int, float)) or isinstance(timeout_ms, bool) or \
                not 0 < timeout_ms < math.inf:
            raise InputError(f"timeout_ms: expected a positive finite number, got {timeout_ms!r}")
        e = self.graph.entry(entry)
        if not self._lock.acquire(timeout=timeout_ms / 1000):
            raise DeviceTimeout(f"another run() on this Model did not finish within "
                                f"{timeout_ms} ms")
        try:
            return self._run(e, feeds, out, timeout_ms)
        finally:
            self._lock.release()

    def _run(self, e: Entry, feeds: dict | None, out: dict | None, timeout_ms: float) -> dict:
        dev = self.device
        if self._closed:
            raise DeviceError("run() on a closed Model; load it again")
        if self._broken:
            self._recover_if_broken()
        self._bind_feeds(e, feeds)
        results = self._bind_outputs(e, out)
        if e.stateful:
            self._state.bind(e)
        deadline = time.monotonic() + timeout_ms / 1000
        try:
            dev.wait(dev.submit(deadline, e.launches), deadline)
        except DeviceTimeout as err:
            self._broken = True
            raise DeviceTimeout(f"{err} ({timeout_ms} ms after submit)") from None
        except DeviceError:
            self._broken = True
            raise
        if e.stateful:
            self._state.commit(e)
        return results

    def _bind_feeds(self, e: Entry, feeds: dict | None) -> None:
        bind = self.device.bind
        if feeds is None:
            for s in e.inputs:
                bind(s.slot, self._bound_in[s.slot])
            return
        for s in e.inputs:
            if s.name not in feeds:
                raise InputError(f"missing input {s.name!r} ({s.dtype} {s.shape}); "
                                 f"received {sorted(feeds)}")
            arr = _checked(f"input {s.name!r}", feeds[s.name], s.shape, s.dtype)
            if not (arr.flags.c_contiguous and arr.flags.aligned):
                np.copyto(self._slots[s.slot], arr)
                arr = self._slots[s.slot]
            bind(s.slot, arr)
        if len(feeds) != len(e.inputs):
            extra = sorted(set(feeds) - {s.name for s in e.inputs})
            raise InputError(f"unexpected inputs {extra}; inputs are {[s.name for s in e.inputs]}")

    def _bind_outputs(self, e: Entry, out: dict | None) -> dict[str, np.ndarray]:
        out = {} if out is None else out
        results, used = {}, 0
        for s in e.outputs:
            if s.name not in out:
                arr = np.empty(s.shape, s.dtype)
            else:
                used += 1
                what = f"out[{s.name!r}]"
                arr = _checked(what, out[s.name], s.shape, s.dtype)
                flags = arr.flags
                if not (flags.c_contiguous and flags.aligned and flags.writeable):
                    raise InputError(f"{what}: expected a C-contiguous, aligned, writable array, "
                                     f"got c_contiguous={flags.c_contiguous} "
                                     f"aligned={flags.aligned} writeable={flags.writeable}")
            self.device.bind(s.slot, arr)
            results[s.name] = arr
        if used != len(out):
            extra = sorted(set(out) - {s.name for s in e.outputs})
            raise InputError(f"out has unknown outputs {extra}; "
                             f"outputs are {[s.name for s in e.outputs]}")
        return results


class EntryInfo(NamedTuple):
    inputs: dict  # name -> (shape, dtype)
    outputs: dict


def _io(slots) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {s.name: (s.shape, s.dtype) for s in slots}


def _checked(what: str, arr, shape: tuple, dtype: np.dtype) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise InputError(f"{what}: expected numpy.ndarray {dtype} {shape}, "
                         f"got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise InputError(f"{what}: expected dtype {dtype}, got {arr.dtype}")
    if arr.shape != shape:
        raise InputError(f"{what}: expected shape {shape}, got {arr.shape}")
    return arr
