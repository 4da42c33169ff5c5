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

Deadlines: each run() waits at most `timeout_ms` (per call, else the Model's, checked when it is
set) from its submission, then raises DeviceTimeout. The Model's is DEFAULT_TIMEOUT_MS times its
device's deadline_scale (100 on the emulated DSP, KEEL_FASTRPC=mock; 1 elsewhere). After a
DeviceTimeout or DeviceError the next run() first recovers the device, then runs normally.

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
from operator import is_
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

_PROCESS = [os.getpid()]  # this process's id, kept by a fork hook: run() checks it per call
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _PROCESS.__setitem__(0, os.getpid()))


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
        self._only = self.graph.entries[0] if len(self.graph.entries) == 1 else None
        self._last: dict[str, tuple] = {}  # entry -> (binds after, inputs, out= arrays, staged)
        self._unfed: dict[str, tuple] = {}  # entry name -> (version, what a run without feeds
        self._bound_version = 0  # binds: its inputs' arrays); bind_input's count
        self._pid = os.getpid()  # a forked child must load again: run() checks

    @property
    def timeout_ms(self) -> float:
        """The deadline of a run() given none (ms); checked when set, so run() need not."""
        return self._timeout_ms

    @timeout_ms.setter
    def timeout_ms(self, value: float) -> None:
        self._timeout_ms = _checked_timeout(value)

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
        arr = _checked(out.get(self._sliced), spec.shape, spec.dtype, "out[{!r}]", self._sliced)
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
            self._bound_version += 1
            return
        if array is None:
            array = self._slots[s.slot]
        arr = _checked(array, s.shape, s.dtype, "bind_input({!r})", name)
        if not (arr.flags.c_contiguous and arr.flags.aligned):
            raise InputError(f"bind_input({name!r}): expected a C-contiguous, aligned array "
                             f"(binding is zero-copy), got c_contiguous={arr.flags.c_contiguous} "
                             f"aligned={arr.flags.aligned}")
        self._bound_in[s.slot] = arr  # one store: a run binding now sees the old array or this one
        self._bound_version += 1  # after it: a run that cached the old one sees the new count

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
        timeout_ms = self._timeout_ms if timeout_ms is None else _checked_timeout(timeout_ms)
        if _PROCESS[0] != self._pid:
            self._forked()
        e = self._only if entry is None and self._only is not None else self.graph.entry(entry)
        lock = self._lock
        if not lock.acquire(False) and not lock.acquire(timeout=timeout_ms / 1000):
            raise DeviceTimeout(f"another run() on this Model did not finish within "
                                f"{timeout_ms} ms")
        try:
            return self._run(e, feeds, out, timeout_ms)
        finally:
            lock.release()

    def _forked(self) -> None:
        """A run in a forked child: the device's threads and queues stayed in the parent (checked
        before the run lock, which a parent's thread may have held at fork)."""
        raise DeviceError(f"run() in process {os.getpid()} on a Model loaded in process "
                          f"{self._pid}: a device does not survive fork(); load the blob again "
                          f"in this process")

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
        if self._broken:
            self._recover_if_broken()
        self._bind(plan, e)
        if e.stateful:
            self._state.bind(e)
        if plan.copies:  # bound through copies: nothing a later run can reuse
            self._last.pop(e.name, None)
        elif plan.kept != self.device.binds:  # what a later run of the same arrays finds bound
            self._last[e.name] = (self.device.binds, plan.inputs, plan.given, plan.staged_at)
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
        InputError naming both.

        Which arrays overlap is a function of which arrays they are: each one bound is
        C-contiguous (checked), so it spans [its data pointer, + the slot's bytes), and an
        ndarray's data pointer never changes. So a run that binds the very arrays the entry's
        last binding bound (`_last`, which holds them, so no other array takes their ids)
        reuses its answer, and `kept` is the device's binds count after that binding; a run
        that copies a feed in (its slot is then written) decides afresh and records nothing."""
        plan = _Plan()
        if feeds is None:  # what bind_input bound (the same tuple until it binds again)
            unfed = self._unfed.get(e.name)
            if unfed is None or unfed[0] != self._bound_version:
                unfed = self._unfed[e.name] = \
                    self._bound_version, tuple(self._bound_in[s.slot] for s in e.inputs)
            plan.inputs = unfed[1]
        else:
            self._plan_inputs(plan, e, feeds)
        self._plan_outputs(plan, e, out)
        if plan.copies:
            return self._staged(plan, e, self._overlapping(plan, e))
        last = self._last.get(e.name)
        if last is not None and (plan.inputs is last[1] or _same(plan.inputs, last[1])) and \
                _same(plan.given, last[2]):
            plan.kept, plan.staged_at = last[0], last[3]
        else:
            plan.staged_at = self._overlapping(plan, e)
        return self._staged(plan, e, plan.staged_at) if plan.staged_at else plan

    def _overlapping(self, plan: "_Plan", e: Entry) -> tuple[int, ...]:
        """The outputs (positions in e.outputs) whose out= array overlaps an input the run
        reads; a feed that a copy into another input's slot would overwrite is read first (a
        copy of it is bound)."""
        written = [(name, dst) for name, dst, _ in plan.copies]
        for i, (name, dst, src) in enumerate(plan.copies):
            if any(_overlap(src, d) for n, d in written if n != name):
                plan.copies[i] = (name, dst, src.copy())  # read it before any copy writes
        for k, (s, arr) in enumerate(zip(e.inputs, plan.inputs)):
            if any(_overlap(arr, d) for n, d in written if n != s.name):
                plan.inputs[k] = arr.copy()
        staged, given = [], []
        for j, (s, arr) in enumerate(zip(e.outputs, plan.outputs)):
            if not any(arr is g for g in plan.given):
                continue
            other = next((o for o, g in given if _overlap(g, arr)), None)
            if other is not None:
                raise InputError(f"out[{other!r}] and out[{s.name!r}] share memory: two outputs "
                                 f"cannot be written into one array")
            given.append((s.name, arr))
            if any(_overlap(arr, a) for a in plan.inputs):
                staged.append(j)
        return tuple(staged)

    def _staged(self, plan: "_Plan", e: Entry, staged: tuple[int, ...]) -> "_Plan":
        """Outputs at `staged` computed into their own slots, copied out after the run."""
        plan.staged = []
        for j in staged:
            scratch = self.device.io_buffer(e.outputs[j].slot)
            plan.staged.append((scratch, plan.outputs[j]))
            plan.outputs[j] = scratch
        return plan

    def _plan_inputs(self, plan: "_Plan", e: Entry, feeds) -> None:
        if type(feeds) is not dict and not isinstance(feeds, Mapping):
            raise InputError(f"feeds: expected a dict {{input name: numpy.ndarray}} over inputs "
                             f"{[s.name for s in e.inputs]}, got {type(feeds).__name__}")
        plan.inputs, plan.copies, fed = [], [], 0
        for s in e.inputs:
            arr = feeds.get(s.name, _MISSING)
            if arr is _MISSING:
                if s.slot not in self._defaults:
                    raise InputError(f"missing input {s.name!r} ({s.dtype} {s.shape}); "
                                     f"received {sorted(map(str, feeds))}")
                arr = self._defaults[s.slot]
            else:
                fed += 1
                _checked(arr, s.shape, s.dtype, "input {!r}", s.name)
                flags = arr.flags
                if not (flags.c_contiguous and flags.aligned):
                    plan.copies.append((s.name, self._slots[s.slot], arr))
                    arr = self._slots[s.slot]
            plan.inputs.append(arr)
        if fed != len(feeds):
            self._unexpected([s.name for s in e.inputs], feeds)

    def _unexpected(self, names: list[str], feeds) -> None:
        extra = sorted(map(str, set(feeds) - set(names)))
        constants = sorted(set(extra) & set(self.meta.get("constant_inputs", ())))
        hint = f" ({constants}: initializers compiled as constants; compile with " \
            f"--overridable NAME to feed them)" if constants else ""
        raise InputError(f"unexpected inputs {extra}; inputs are {names}{hint}")

    def _plan_outputs(self, plan: "_Plan", e: Entry, out) -> None:
        if out is None:
            out = {}
        elif type(out) is not dict and not isinstance(out, Mapping):
            raise InputError(f"out: expected a dict {{output name: numpy.ndarray}} over outputs "
                             f"{[s.name for s in e.outputs]}, got {type(out).__name__}")
        for s in e.outputs:
            arr = out.get(s.name, _MISSING)
            if arr is _MISSING:
                arr = np.empty(s.shape, s.dtype)
                plan.fresh.append((s.slot, arr))
            else:
                _checked(arr, s.shape, s.dtype, "out[{!r}]", s.name)
                if not arr.flags.carray:  # C-contiguous, aligned and writable
                    flags = arr.flags
                    raise InputError(f"out[{s.name!r}]: expected a C-contiguous, aligned, "
                                     f"writable array, got c_contiguous={flags.c_contiguous} "
                                     f"aligned={flags.aligned} writeable={flags.writeable}")
                plan.given.append(arr)
            plan.outputs.append(arr)
            plan.results[s.name] = arr
        if len(plan.given) != len(out):
            names = [s.name for s in e.outputs]
            raise InputError(f"out has unknown outputs {sorted(map(str, set(out) - set(names)))}"
                             f"; outputs are {names}")

    def _bind(self, plan: "_Plan", e: Entry) -> None:
        """Carry out a checked plan: copy the feeds that cannot be bound, bind every slot. The
        arrays of a plan that binds what the entry's last binding bound, with no binding
        changed on the device since (`kept` is still its `binds` count), are bound already:
        only the fresh output arrays are left to bind."""
        for _, dst, src in plan.copies:
            np.copyto(dst, src)
        dev = self.device
        if plan.kept != dev.binds:
            _bind_all(dev, e.inputs, plan.inputs)
            _bind_all(dev, e.outputs, plan.outputs)
            return
        for slot, arr in plan.fresh:
            dev.bind(slot, arr)


class _Plan:
    """What one run binds, decided before anything is written: one array per input and per
    output of the entry, in its order. The class's empty tuples stand until a run has copies
    or staged outputs (a plan is made per run: kept cheap)."""
    copies: list | tuple = ()  # (input name, its own slot, feed to copy in)
    staged: list | tuple = ()  # (output slot, out= array): copied after
    kept = -1  # the device's binds count after the entry's last binding, when this plan's
    # inputs and out= arrays are the ones it bound; -1: they are not
    staged_at: tuple = ()  # the outputs (positions) staged: _overlapping's answer

    def __init__(self):
        self.inputs: list | tuple = ()  # the array each input slot is bound to
        self.outputs: list = []  # the array each output slot is bound to
        self.given: list = []  # the out= arrays, in output order
        self.fresh: list = []  # (slot, array) of each output out= does not give: new per run
        self.results: dict = {}


_MISSING = object()  # a name not in feeds or out (None could be a caller's wrong value)


def _bind_all(dev: Device, slots: tuple[Slot, ...], arrays) -> None:
    for s, arr in zip(slots, arrays):
        if isinstance(arr, DmaBuf):  # bound by bind_input: device memory
            dev.bind_device(s.slot, arr)
        else:
            dev.bind(s.slot, arr)


def _same(a, b) -> bool:
    """Whether two sequences hold the very same objects."""
    return len(a) == len(b) and all(map(is_, a, b))


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
    if (type(timeout_ms) is float or type(timeout_ms) is int) and 0 < timeout_ms <= MAX_TIMEOUT_MS:
        return timeout_ms  # the common case, without the abstract-class checks below
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


def _checked(arr, shape: tuple, dtype: np.dtype, what: str, name: str) -> np.ndarray:
    """arr, checked to be an ndarray of `shape` and `dtype`; else an InputError naming it
    (`what` formatted with `name`: made only then, since run() checks every array)."""
    if isinstance(arr, np.ndarray) and arr.dtype == dtype and arr.shape == shape:
        return arr
    what = what.format(name)
    if not isinstance(arr, np.ndarray):
        raise InputError(f"{what}: expected numpy.ndarray {dtype} {shape}, "
                         f"got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise InputError(f"{what}: expected dtype {dtype}, got {arr.dtype}")
    raise InputError(f"{what}: expected shape {shape}, got {arr.shape}")


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
