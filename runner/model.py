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
bind_input(name, DmaBuf(fd, offset, nbytes)) binds a camera buffer that is already device memory
(a VisionIPC ION / dma-buf fd; runner/dmabuf.py) where the device can import it (qcom): imported
once per fd, zero-copy, released at close().

openpilot output slices: when the model's ONNX carried openpilot's `output_slices`,
`output_slices` maps each name to a slice of the flattened output, and output_views(out) gives
named zero-copy views into preallocated outputs (take them once; every run rewrites them).

Entry points: a blob may hold several named graphs (Model.entries); run(feeds, entry=NAME) runs
one. With one entry, entry= may be left out; with several, leaving it out is an InputError
listing them. inputs, outputs, input_view and bind_input speak of the default entry the same way
(input_view and bind_input take entry= too).

State: Model.state maps each state's name to its value after the last completed run (a view of
device memory where it is host-visible); set_state and reset_state write it. A run that fails
leaves the state exactly as before it (runner/state.py).

Deadlines: each run() waits at most `timeout_ms` (per call, else the Model's) from its submission,
then raises DeviceTimeout. The Model's is DEFAULT_TIMEOUT_MS times its device's deadline_scale
(100 on the emulated DSP, KEEL_FASTRPC=mock; 1 elsewhere). After a DeviceTimeout or DeviceError the next run() first recovers the
device, then runs normally.

Threads: run() calls on one Model are serialized by a lock: a second caller waits for the first
(at most its own timeout_ms, then DeviceTimeout). A Model is never run by two threads at once.
"""
from __future__ import annotations

import math
import numbers
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from runner.cache import beside
from runner.blob import Blob, read_blob
from runner.device import Device, get_device
from runner.dmabuf import DmaBuf
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
        self.timeout_ms = DEFAULT_TIMEOUT_MS * device.deadline_scale
        self.graph = Graph(blob)
        self._slots = [device.io_buffer(i) for i in range(len(blob.inputs))]
        self._bound_in = list(self._slots)  # what run() without feeds reads, per input slot
        # inputs with a default (an ONNX initializer that is also an input): what a run that
        # does not feed them reads; their slots start holding it
        self._defaults = {i: np.frombuffer(blob.weights, b.dtype, math.prod(b.shape),
                                           b.offset).reshape(b.shape)
                          for i, b in blob.defaults.items()}
        for i, default in self._defaults.items():
            self._slots[i][...] = default
        self._state = States(self.graph, device, blob.weights)
        self._lock = threading.Lock()
        self._broken = False  # the last run failed: recover before the next one
        self._closed = False
        self._pid = os.getpid()  # a forked child must load again: run() checks

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
        dev.cache_dir = beside(path)
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
        the device's memory where it is host-visible (cpu, mock, qcom, dsp; a ring's is
        read-only), a read-only copy elsewhere (opencl, amd: write with set_state). Take it
        again after each run: a run moves the state to the other half of its ping-pong, or a
        ring's window on. After a failed run it is the state from before that run (the device
        is recovered first)."""
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
        bound another, or the DmaBuf it bound): write into it, then run() without feeds."""
        return self._bound_in[self._input(name, entry).slot]

    def bind_input(self, name: str, array: np.ndarray | DmaBuf | None,
                   entry: str | None = None) -> None:
        """Bind an externally owned array (a camera frame) to an input, zero-copy, for every
        run() without feeds until bound again; None binds the model's own slot back. A DmaBuf
        binds a dma-buf as device memory (the device imports it at the next run, once per fd:
        a refused import is the DeviceError of that run, with the kernel's errno)."""
        s = self._input(name, entry)
        if isinstance(array, DmaBuf):
            self._bound_in[s.slot] = _checked_dmabuf(f"bind_input({name!r})", array, s)
            return
        if array is None:
            array = self._slots[s.slot]
        arr = _checked(f"bind_input({name!r})", array, s.shape, s.dtype)
        if not (arr.flags.c_contiguous and arr.flags.aligned):
            raise InputError(f"bind_input({name!r}): expected a C-contiguous, aligned array "
                             f"(binding is zero-copy), got c_contiguous={arr.flags.c_contiguous} "
                             f"aligned={arr.flags.aligned}")
        self._bound_in[s.slot] = arr  # one store: a run binding now sees the old array or this one

    def output_buffer(self, name: str, entry: str | None = None) -> np.ndarray:
        """Output `name` (of `entry`) where this Model's device keeps it: its io memory, which
        is the device memory itself where that is host-visible (cpu, mock, dsp; qcom: a KGSL
        object mapped into the process), else the host array its wait() copies it into (amd,
        opencl). A run with out={name: output_buffer(name)} writes it there, and another
        Model's input bound to it (bind_input, or a feed) reads it there: the output of one
        device as the input of another, with no copy by the host where the memory is
        host-visible (runner/pipeline.py; Device.bind in runner/device.py)."""
        outputs = self.graph.entry(entry).outputs
        for s in outputs:
            if s.name == name:
                return self.device.io_buffer(s.slot)
        raise InputError(f"unknown output {name!r}; outputs are {[s.name for s in outputs]}")

    def _input(self, name: str, entry: str | None) -> Slot:
        inputs = self.graph.entry(entry).inputs
        for s in inputs:
            if s.name == name:
                return s
        raise InputError(f"unknown input {name!r}; inputs are {[s.name for s in inputs]}")

    def close(self) -> None:
        """Release the device now rather than when the Model is collected; idempotent. Waits
        for a run in flight (at most its timeout). In a forked child, which has no run in flight
        and whose lock a parent's thread may hold forever, it does not wait."""
        if os.getpid() != self._pid:
            self._closed = True
            return
        with self._lock:
            self._closed = True
            self.device.close()

    def run(self, feeds: dict | None = None, out: dict | None = None,
            timeout_ms: float | None = None, entry: str | None = None) -> dict[str, np.ndarray]:
        """entry: which entry point runs (Model.entries); None: the blob's only one."""
        timeout_ms = _checked_timeout(self.timeout_ms if timeout_ms is None else timeout_ms)
        if os.getpid() != self._pid:  # the device's threads and queues stayed in the parent
            raise DeviceError(f"run() in process {os.getpid()} on a Model loaded in process "
                              f"{self._pid}: a device does not survive fork(); load the blob "
                              f"again in this process")
        e = self.graph.entry(entry)
        if not self._lock.acquire(timeout=timeout_ms / 1000):
            raise DeviceTimeout(f"another run() on this Model did not finish within "
                                f"{timeout_ms} ms")
        try:
            return self._run(e, feeds, out, timeout_ms)
        finally:
            self._lock.release()

    def _run(self, e: Entry, feeds: dict | None, out: dict | None, timeout_ms: float) -> dict:
        plan = self._prepare(e, feeds, out)
        deadline = time.monotonic() + timeout_ms / 1000
        try:
            self.device.wait(self.device.submit(deadline, e.launches), deadline)
        except BaseException as err:  # DeviceError, or an interrupt (KeyboardInterrupt) mid-run
            self._failed(err, timeout_ms)
            raise
        return self._finish(e, plan)

    # A run in steps, so runner/pipeline.py can put another device's run between them: _prepare
    # (checks and bindings, no device work), submit and wait (a failure of either goes through
    # _failed), then _finish once the run completed.
    def _prepare(self, e: Entry, feeds: dict | None, out: dict | None) -> "_Plan":
        if self._closed:
            raise DeviceError("run() on a closed Model; load it again")
        plan = self._plan(e, feeds, out)  # raises before anything is written
        self._recover_if_broken()
        self._bind(plan)
        if e.stateful:
            self._state.bind(e)
        return plan

    def _failed(self, err: BaseException, timeout_ms: float) -> None:
        """A submission or its wait failed: the Model recovers before its next use. A timeout is
        raised again saying how long it waited; the caller re-raises anything else with a bare
        `raise` (raising `err` here would tie it, this frame and the Model into a cycle that
        only the garbage collector frees)."""
        self._broken = True
        if isinstance(err, DeviceTimeout):
            raise DeviceTimeout(f"{err} ({timeout_ms} ms after submit)") from None

    def _finish(self, e: Entry, plan: "_Plan") -> dict:
        """After the run completed: its state writes become the state, staged outputs land."""
        if e.stateful:
            self._state.commit(e)
        for scratch, arr in plan.staged:
            np.copyto(arr, scratch)
        return plan.results

    def _plan(self, e: Entry, feeds: dict | None, out: dict | None) -> "_Plan":
        """Check every feed and every out= array, and decide what each slot is bound to. An
        output whose array overlaps an input the run reads is computed into the model's own
        output slot and copied out after the run (`staged`): the recurrent
        run({"h": st}, out={"h_new": st}). Two outputs in one array cannot both be right: an
        InputError naming both."""
        plan = _Plan()
        self._plan_inputs(plan, e, feeds)
        self._plan_outputs(plan, e, out)
        written = [(name, dst) for name, dst, _ in plan.copies]
        for i, (name, dst, src) in enumerate(plan.copies):
            if any(_overlap(src, d) for n, d in written if n != name):
                plan.copies[i] = (name, dst, src.copy())  # read it before any copy writes
        for k, (slot, name, arr) in enumerate(plan.inputs):
            if any(_overlap(arr, d) for n, d in written if n != name):
                plan.inputs[k] = (slot, name, arr.copy())
        for j, (slot, name, arr) in enumerate(plan.outputs):
            if name not in plan.given:
                continue
            other = next((o for _, o, _ in plan.outputs[:j]
                          if o in plan.given and _overlap(plan.results[o], arr)), None)
            if other is not None:
                raise InputError(f"out[{other!r}] and out[{name!r}] share memory: two outputs "
                                 f"cannot be written into one array")
            if any(_overlap(arr, a) for _, _, a in plan.inputs):
                scratch = self.device.io_buffer(slot)
                plan.staged.append((scratch, arr))
                plan.outputs[j] = (slot, name, scratch)
        return plan

    def _plan_inputs(self, plan: "_Plan", e: Entry, feeds) -> None:
        if feeds is None:
            plan.inputs = [(s.slot, s.name, self._bound_in[s.slot]) for s in e.inputs]
            return
        names = [s.name for s in e.inputs]
        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds: expected a dict {{input name: numpy.ndarray}} over inputs "
                             f"{names}, got {type(feeds).__name__}")
        for s in e.inputs:
            if s.name not in feeds and s.slot in self._defaults:
                plan.inputs.append((s.slot, s.name, self._defaults[s.slot]))
                continue
            if s.name not in feeds:
                raise InputError(f"missing input {s.name!r} ({s.dtype} {s.shape}); "
                                 f"received {sorted(map(str, feeds))}")
            arr = _checked(f"input {s.name!r}", feeds[s.name], s.shape, s.dtype)
            if not (arr.flags.c_contiguous and arr.flags.aligned):
                plan.copies.append((s.name, self._slots[s.slot], arr))
                arr = self._slots[s.slot]
            plan.inputs.append((s.slot, s.name, arr))
        extra = sorted(map(str, set(feeds) - set(names)))
        if extra:
            constants = sorted(set(extra) & set(self.meta.get("constant_inputs", ())))
            hint = f" ({constants}: initializers compiled as constants; compile with " \
                f"--overridable NAME to feed them)" if constants else ""
            raise InputError(f"unexpected inputs {extra}; inputs are {names}{hint}")

    def _plan_outputs(self, plan: "_Plan", e: Entry, out) -> None:
        names = [s.name for s in e.outputs]
        if out is None:
            out = {}
        elif not isinstance(out, Mapping):
            raise InputError(f"out: expected a dict {{output name: numpy.ndarray}} over outputs "
                             f"{names}, got {type(out).__name__}")
        for s in e.outputs:
            if s.name not in out:
                arr = np.empty(s.shape, s.dtype)
            else:
                plan.given.add(s.name)
                what = f"out[{s.name!r}]"
                arr = _checked(what, out[s.name], s.shape, s.dtype)
                flags = arr.flags
                if not (flags.c_contiguous and flags.aligned and flags.writeable):
                    raise InputError(f"{what}: expected a C-contiguous, aligned, writable array, "
                                     f"got c_contiguous={flags.c_contiguous} "
                                     f"aligned={flags.aligned} writeable={flags.writeable}")
            plan.outputs.append((s.slot, s.name, arr))
            plan.results[s.name] = arr
        if len(plan.given) != len(out):
            extra = sorted(map(str, set(out) - set(names)))
            raise InputError(f"out has unknown outputs {extra}; outputs are {names}")

    def _bind(self, plan: "_Plan") -> None:
        """Carry out a checked plan: copy the feeds that cannot be bound, bind every slot."""
        for _, dst, src in plan.copies:
            np.copyto(dst, src)
        dev = self.device
        for slot, _, arr in plan.inputs + plan.outputs:
            if isinstance(arr, DmaBuf):  # bound by bind_input: device memory
                dev.bind_device(slot, arr)
            else:
                dev.bind(slot, arr)


@dataclass
class _Plan:
    """What one run binds, decided before anything is written."""
    inputs: list = field(default_factory=list)  # per input: (slot, name, array bound)
    copies: list = field(default_factory=list)  # (input name, its own slot, feed to copy in)
    outputs: list = field(default_factory=list)  # per output: (slot, name, array bound)
    given: set = field(default_factory=set)  # the output names out= provides
    staged: list = field(default_factory=list)  # (output slot, out= array): copied after
    results: dict = field(default_factory=dict)


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the byte ranges two arrays span meet: exact for contiguous arrays, cautious for
    strided ones (a copy too many, never a missed overlap). A DmaBuf is device memory that no
    host array can alias."""
    if isinstance(a, DmaBuf) or isinstance(b, DmaBuf) or not a.size or not b.size:
        return False
    (lo_a, hi_a), (lo_b, hi_b) = _span(a), _span(b)
    return lo_a < hi_b and lo_b < hi_a


def _span(a: np.ndarray) -> tuple[int, int]:
    lo = hi = a.__array_interface__["data"][0]
    for n, step in zip(a.shape, a.strides):
        if step < 0:
            lo += (n - 1) * step
        else:
            hi += (n - 1) * step
    return lo, hi + a.itemsize


# 31 years: what threading's lock waits (OverflowError beyond TIMEOUT_MAX) and the CPU pool's
# nanosecond deadline (a C long long) both hold
MAX_TIMEOUT_MS = min(threading.TIMEOUT_MAX * 1000, 1e12)


def _checked_timeout(timeout_ms) -> float:
    if isinstance(timeout_ms, (bool, np.bool_)) or not isinstance(timeout_ms, numbers.Real) or \
            not 0 < timeout_ms <= MAX_TIMEOUT_MS:
        raise InputError(f"timeout_ms: expected a positive finite number at most "
                         f"{MAX_TIMEOUT_MS:.6g}, got {timeout_ms!r}")
    return timeout_ms.item() if isinstance(timeout_ms, np.generic) else timeout_ms


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


def _checked_dmabuf(what: str, buf: DmaBuf, spec: Slot) -> DmaBuf:
    """The input's size and dtype; natural alignment, as bind() asks of host arrays."""
    for attr in ("fd", "offset", "nbytes"):
        value = getattr(buf, attr)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise InputError(f"{what}: DmaBuf.{attr} must be an integer >= 0, got {value!r}")
    if np.dtype(buf.dtype) != spec.dtype:
        raise InputError(f"{what}: expected dtype {spec.dtype}, the DmaBuf holds "
                         f"{np.dtype(buf.dtype)}")
    if buf.nbytes != spec.nbytes:
        raise InputError(f"{what}: expected {spec.nbytes} bytes ({spec.dtype} {spec.shape}), the "
                         f"DmaBuf has {buf.nbytes}")
    if buf.offset % spec.dtype.itemsize:
        raise InputError(f"{what}: DmaBuf.offset {buf.offset} is not a multiple of "
                         f"{spec.dtype.itemsize} ({spec.dtype})")
    return buf
