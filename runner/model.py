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

import numpy as np

from runner import cache
from runner.blob import Blob, read_blob
from runner.device import Device, get_device
from runner.errors import DeviceError, DeviceTimeout, InputError
from runner.slices import read_slices
from runner.targets import device_of

DEFAULT_TIMEOUT_MS = 2000


class Model:
    def __init__(self, blob: Blob, device: Device):
        self._sliced, self._slices = read_slices(blob.manifest, blob.outputs)
        self.blob, self.device = blob, device
        self.timeout_ms = DEFAULT_TIMEOUT_MS * device.deadline_scale
        self._in = [(b.name, b.shape, b.dtype) for b in blob.inputs]
        self._out = [(b.name, b.shape, b.dtype) for b in blob.outputs]
        self._slots = [device.io_buffer(i) for i in range(len(self._in))]
        self._bound_in = list(self._slots)  # what run() without feeds reads, per input
        # inputs with a default (an ONNX initializer that is also an input): what a run that
        # does not feed them reads; their slots start holding it
        self._defaults = {i: np.frombuffer(blob.weights, b.dtype, math.prod(b.shape),
                                           b.offset).reshape(b.shape)
                          for i, b in blob.defaults.items()}
        for i, default in self._defaults.items():
            self._slots[i][...] = default
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
    def inputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (shape, dtype) for name, shape, dtype in self._in}

    @property
    def outputs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {name: (shape, dtype) for name, shape, dtype in self._out}

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
        arr = _checked(f"out[{self._sliced!r}]", out.get(self._sliced),
                       *self.outputs[self._sliced])
        flat = arr.view()
        try:
            flat.shape = (-1,)  # raises rather than copy
        except AttributeError:
            raise InputError(f"out[{self._sliced!r}]: expected a C-contiguous array") from None
        return {name: flat[s] for name, s in self._slices.items()}

    def input_view(self, name: str) -> np.ndarray:
        """The array run() without feeds reads for this input (its own slot unless bind_input
        bound another): write into it, then run() without feeds."""
        return self._bound_in[self._input_index(name)]

    def bind_input(self, name: str, array: np.ndarray | None) -> None:
        """Bind an externally owned array (a camera frame) to an input, zero-copy, for every
        run() without feeds until bound again; None binds the model's own slot back."""
        i = self._input_index(name)
        if array is None:
            array = self._slots[i]
        _, shape, dtype = self._in[i]
        arr = _checked(f"bind_input({name!r})", array, shape, dtype)
        if not (arr.flags.c_contiguous and arr.flags.aligned):
            raise InputError(f"bind_input({name!r}): expected a C-contiguous, aligned array "
                             f"(binding is zero-copy), got c_contiguous={arr.flags.c_contiguous} "
                             f"aligned={arr.flags.aligned}")
        self._bound_in[i] = arr  # one store: a run binding now sees the old array or this one

    def _input_index(self, name: str) -> int:
        for i, (slot_name, _, _) in enumerate(self._in):
            if slot_name == name:
                return i
        raise InputError(f"unknown input {name!r}; inputs are {[n for n, _, _ in self._in]}")

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
            timeout_ms: float | None = None) -> dict[str, np.ndarray]:
        timeout_ms = _checked_timeout(self.timeout_ms if timeout_ms is None else timeout_ms)
        if os.getpid() != self._pid:  # the device's threads and queues stayed in the parent
            raise DeviceError(f"run() in process {os.getpid()} on a Model loaded in process "
                              f"{self._pid}: a device does not survive fork(); load the blob "
                              f"again in this process")
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
        plan = self._plan(feeds, out)  # raises before anything is written
        if self._broken:
            dev.recover()
            self._broken = False
        self._bind(plan)
        deadline = time.monotonic() + timeout_ms / 1000
        try:
            dev.wait(dev.submit(deadline), deadline)
        except DeviceTimeout as e:
            self._broken = True
            raise DeviceTimeout(f"{e} ({timeout_ms} ms after submit)") from None
        except BaseException:  # DeviceError, or an interrupt (KeyboardInterrupt) mid-run
            self._broken = True
            raise
        for scratch, arr in plan.staged:
            np.copyto(arr, scratch)
        return plan.results

    def _plan(self, feeds: dict | None, out: dict | None) -> "_Plan":
        """Check every feed and every out= array, and decide what each slot is bound to. An
        output whose array overlaps an input the run reads is computed into the model's own
        output slot and copied out after the run (`staged`): the recurrent
        run({"h": st}, out={"h_new": st}). Two outputs in one array cannot both be right: an
        InputError naming both."""
        plan = _Plan()
        self._plan_inputs(plan, feeds)
        self._plan_outputs(plan, out)
        written = [(name, dst) for name, dst, _ in plan.copies]
        for i, (name, dst, src) in enumerate(plan.copies):
            if any(_overlap(src, d) for n, d in written if n != name):
                plan.copies[i] = (name, dst, src.copy())  # read it before any copy writes
        for k, (name, arr) in enumerate(plan.inputs):
            if any(_overlap(arr, d) for n, d in written if n != name):
                plan.inputs[k] = (name, arr.copy())
        first_out = len(self._in)
        for j, (name, arr) in enumerate(plan.outputs):
            if name not in plan.given:
                continue
            other = next((o for o, _ in plan.outputs[:j]
                          if o in plan.given and _overlap(plan.results[o], arr)), None)
            if other is not None:
                raise InputError(f"out[{other!r}] and out[{name!r}] share memory: two outputs "
                                 f"cannot be written into one array")
            if any(_overlap(arr, a) for _, a in plan.inputs):
                scratch = self.device.io_buffer(first_out + j)
                plan.staged.append((scratch, arr))
                plan.outputs[j] = (name, scratch)
        return plan

    def _plan_inputs(self, plan: "_Plan", feeds) -> None:
        if feeds is None:
            plan.inputs = [(name, arr) for (name, _, _), arr in zip(self._in, self._bound_in)]
            return
        names = [n for n, _, _ in self._in]
        if not isinstance(feeds, Mapping):
            raise InputError(f"feeds: expected a dict {{input name: numpy.ndarray}} over inputs "
                             f"{names}, got {type(feeds).__name__}")
        for i, (name, shape, dtype) in enumerate(self._in):
            if name not in feeds and i in self._defaults:
                plan.inputs.append((name, self._defaults[i]))
                continue
            if name not in feeds:
                raise InputError(f"missing input {name!r} ({dtype} {shape}); "
                                 f"received {sorted(map(str, feeds))}")
            arr = _checked(f"input {name!r}", feeds[name], shape, dtype)
            if not (arr.flags.c_contiguous and arr.flags.aligned):
                plan.copies.append((name, self._slots[i], arr))
                arr = self._slots[i]
            plan.inputs.append((name, arr))
        extra = sorted(map(str, set(feeds) - set(names)))
        if extra:
            constants = sorted(set(extra) & set(self.meta.get("constant_inputs", ())))
            hint = f" ({constants}: initializers compiled as constants; compile with " \
                f"--overridable NAME to feed them)" if constants else ""
            raise InputError(f"unexpected inputs {extra}; inputs are {names}{hint}")

    def _plan_outputs(self, plan: "_Plan", out) -> None:
        names = [n for n, _, _ in self._out]
        if out is None:
            out = {}
        elif not isinstance(out, Mapping):
            raise InputError(f"out: expected a dict {{output name: numpy.ndarray}} over outputs "
                             f"{names}, got {type(out).__name__}")
        for name, shape, dtype in self._out:
            if name not in out:
                arr = np.empty(shape, dtype)
            else:
                plan.given.add(name)
                what = f"out[{name!r}]"
                arr = _checked(what, out[name], shape, dtype)
                flags = arr.flags
                if not (flags.c_contiguous and flags.aligned and flags.writeable):
                    raise InputError(f"{what}: expected a C-contiguous, aligned, writable array, "
                                     f"got c_contiguous={flags.c_contiguous} "
                                     f"aligned={flags.aligned} writeable={flags.writeable}")
            plan.outputs.append((name, arr))
            plan.results[name] = arr
        if len(plan.given) != len(out):
            extra = sorted(map(str, set(out) - set(names)))
            raise InputError(f"out has unknown outputs {extra}; outputs are {names}")

    def _bind(self, plan: "_Plan") -> None:
        """Carry out a checked plan: copy the feeds that cannot be bound, bind every slot."""
        for name, dst, src in plan.copies:
            np.copyto(dst, src)
        bind = self.device.bind
        for slot, (_, arr) in enumerate(plan.inputs + plan.outputs):
            bind(slot, arr)


@dataclass
class _Plan:
    """What one run binds, decided before anything is written."""
    inputs: list = field(default_factory=list)  # per input slot: (name, array bound)
    copies: list = field(default_factory=list)  # (input name, its own slot, feed to copy in)
    outputs: list = field(default_factory=list)  # per output slot: (name, array bound)
    given: set = field(default_factory=set)  # the output names out= provides
    staged: list = field(default_factory=list)  # (output slot, out= array): copied after
    results: dict = field(default_factory=dict)


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the byte ranges two arrays span meet: exact for contiguous arrays, cautious for
    strided ones (a copy too many, never a missed overlap)."""
    if not a.size or not b.size:
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


def _checked(what: str, arr, shape: tuple, dtype: np.dtype) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise InputError(f"{what}: expected numpy.ndarray {dtype} {shape}, "
                         f"got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise InputError(f"{what}: expected dtype {dtype}, got {arr.dtype}")
    if arr.shape != shape:
        raise InputError(f"{what}: expected shape {shape}, got {arr.shape}")
    return arr
