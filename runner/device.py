"""The Device contract (v3): what every backend (cpu, mock, opencl, qcom, dsp, amd) implements,
and what each call guarantees. Shaped after IREE's HAL: a device holds one loaded graph, io
slots are binding slots, a submission is a point on a timeline.

Every backend is a runner/queue.py QueueDevice: the generic half of this contract (binding,
staging of host arrays a device cannot map, the deadline wait, recovery, profiling spans) is
written there once, and a backend supplies only its hardware verbs (listed on QueueDevice).

  check_target(target)   raises BlobError unless this device can run `target` blobs on this host.
  load(blob)             once: the arena, the weights (zero-copy where the hardware allows), the
                         programs, and the whole graph recorded for replay (the blob's launch
                         table). Raises BlobError for what the blob asks and this device cannot do.
  io_buffer(slot)        the device-visible memory of io slot `slot` (inputs first, then outputs;
                         docs/blob.md) as a C-contiguous numpy array that lives as long as the
                         device. Slots start bound to it: writing it is writing what runs read.
  bind(slot, array)      bind host memory (C-contiguous, aligned, the slot's dtype and size) to a
                         slot for the following submissions. Rebinding the bound array is free;
                         a new one patches only the recorded addresses of that slot. The caller
                         keeps the array alive and untouched until the submission completes.
                         The array may be another device's io_buffer (the output of one stage
                         bound as the next stage's input, runner/pipeline.py), for any pair of
                         backends, with nothing written per pair: where the producer's io memory
                         is host-visible (cpu, mock, dsp; qcom: a KGSL object mapped into the
                         process) its io_buffer is that memory, which a device that maps host
                         memory reads where it lies and one that stages (amd, opencl) copies in
                         at submit straight from it (amd: the one transfer over USB the data has
                         to make). A producer whose io memory is not host-visible (amd, opencl)
                         copies its output into its io_buffer at wait first.
  bind_device(slot, mem) bind memory that already lives on the device (a camera frame in GPU
                         memory); what `mem` is belongs to the backend. Raises DeviceError where a
                         backend has no such memory.
  submit(deadline, launches=None)
                         one submission of the launches `launches` (a range of the replay table:
                         an entry point's, runner/graph.py; None: all of them); returns its
                         timeline value, which only grows (1, 2, ...). `deadline` is the absolute
                         time.monotonic() the caller will wait until; only a device that runs the
                         graph inside submit (CPU) uses it, to bound that run. Queue devices
                         return at once.
  completed()            the highest timeline value whose submission has completed, without
                         blocking; DeviceError when the submission after it failed.
  block(seconds)         block at most `seconds`, returning early where the device can signal
                         progress (wait() sleeps through it; default: time.sleep).
  wait(value, deadline)  returns once the submission with timeline `value` has completed; raises
                         DeviceTimeout if it has not by `deadline` (time.monotonic() seconds) and
                         DeviceError if it failed. Never blocks past the deadline by more than
                         scheduling noise: it blocks in slices of at most MAX_SLEEP_S, reads the
                         clock, and checks completion again after the deadline before calling a
                         timeout, so a submission that completed in time is never one.
  recover()              after a DeviceTimeout or DeviceError: abandon what is in flight and
                         rebuild the device state so the next submit() runs correctly. Bindings,
                         io buffers and weights survive.
  close()                releases everything; idempotent; the device is unusable afterwards.
  cache_dir              (attribute) where the backend may cache what it builds from this blob
                         (program binaries); set by Model.load before load(); None: no cache.

Persistent state (runner/state.py runs the ping-pong and the rings over these;
docs/ARCHITECTURE.md):
  alloc_state(nbytes)    device-resident memory for one half of a state (or a whole ring),
                         zero-filled, living as long as the device; what it is belongs to the
                         backend.
  state_part(mem, offset, nbytes)   `nbytes` of state memory `mem` from byte `offset` (a ring's
                         window or row block; offsets are multiples of the blob target's
                         buffer_align), usable wherever state memory is; made at load only.
  bind_states(binds)     bind each (io slot, state memory) pair for the following submissions,
                         in one call (every run binds its entry's state slots): patches only
                         the slots whose memory changed, copies nothing.
  state_view(mem)        a writable host view (uint8) of state memory, or None where the device
                         memory is not host-visible (then read_state / write_state copy).
  read_state(mem), write_state(mem, data)   copy a half out / in (bytes); only between runs.

Per-launch timing (tools/profile.py), optional: a backend without timestamps keeps the defaults,
which raise DeviceError.
  profile(on)            from the next submission on, time every launch (off: no cost at all).
                         The timestamps are the device's own: CPU cycle counters per thread,
                         OpenCL event profiling, a GPU ring's or DSP's timestamp packets.
  spans()                after wait() on a profiled submission: its launches as a list of Span
                         (launch index, lane, start and end in ns). A lane is one row of the
                         trace: a CPU thread, a queue or hardware ring. Times are on the device's
                         clock from any origin; only differences within one submission mean
                         something, and the host subtracts them from its own run latency to
                         report what no launch accounts for.

Backends register in DEVICES by module path, so a backend's imports (ioctls, cffi builds) are only
paid when it is used.
"""
from __future__ import annotations

import importlib
import mmap
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from runner.errors import AllocError, ConfigError, DeviceError, DeviceTimeout

# device name -> "module:Class" (which device runs a blob of each target: runner/targets.py)
DEVICES = {"cpu": "runner.cpu:CpuDevice", "opencl": "runner.opencl:OpenCLDevice",
           "mock": "runner.mock:MockDevice",
           "qcom": "qcom.device:QcomDevice",  # KGSL direct (Adreno 630); KEEL_KGSL=mock in CI
           "amd": "am.device:AmdDevice",  # over usbgpu/; KEEL_USB=mock in CI
           "dsp": "dsp.device:DspDevice"}  # FastRPC; KEEL_FASTRPC=mock runs qemu-hexagon

MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 1e-3  # a submission that completes while we sleep costs at most this much latency


@dataclass(frozen=True)
class Span:
    """One launch of a profiled submission, as the device timed it."""
    launch: int  # index in the blob's replay table
    lane: int  # where it ran: CPU thread id, queue or ring number (one trace row each)
    start_ns: int
    end_ns: int


class Device:
    name: str
    # where a backend may cache what it builds from this blob (OpenCL program binaries); set by
    # Model.load to "<blob>.clcache" beside the blob (runner/cache.py: beside). None: no cache.
    cache_dir: str | None = None
    # a Model's default deadline is runner.model's DEFAULT_TIMEOUT_MS times this: an emulated
    # device (the DSP under qemu) runs far slower than the hardware the default is sized for
    deadline_scale: float = 1.0

    def check_target(self, target: str) -> None:
        raise NotImplementedError

    def load(self, blob) -> None:
        raise NotImplementedError

    def io_buffer(self, slot: int) -> np.ndarray:
        raise NotImplementedError

    def bind(self, slot: int, array: np.ndarray) -> None:
        raise NotImplementedError

    def bind_device(self, slot: int, mem) -> None:
        raise DeviceError(f"device {self.name!r} has no device memory to bind to slot {slot}; "
                          f"bind a host array")

    def submit(self, deadline: float, launches: range | None = None) -> int:
        raise NotImplementedError

    def completed(self) -> int:
        """The highest timeline value whose submission has completed; raises DeviceError when
        the submission after it failed."""
        raise NotImplementedError

    def wait(self, value: int, deadline: float) -> None:
        wait_until(lambda: self.completed() >= value, deadline,
                   f"{self.name} submission {value}", sleep=self.block)

    def block(self, seconds: float) -> None:
        """Block at most `seconds`, returning early where the device can signal completion."""
        time.sleep(seconds)

    def recover(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def alloc_state(self, nbytes: int):
        raise NotImplementedError

    def state_part(self, mem, offset: int, nbytes: int):
        raise NotImplementedError

    def bind_states(self, binds: list) -> None:
        raise NotImplementedError

    def state_view(self, mem) -> np.ndarray | None:
        raise NotImplementedError

    def read_state(self, mem) -> bytes:
        raise NotImplementedError

    def write_state(self, mem, data: bytes) -> None:
        raise NotImplementedError

    def profile(self, on: bool) -> None:
        raise DeviceError(f"device {self.name!r} has no per-launch timestamps")

    def spans(self) -> list[Span]:
        raise DeviceError(f"device {self.name!r} has no per-launch timestamps")


def get_device(name: str) -> Device:
    if not isinstance(name, str):
        raise ConfigError(f"device: expected a name, one of {sorted(DEVICES)}, got "
                          f"{type(name).__name__} {name!r}")
    if name not in DEVICES:
        raise ConfigError(f"unknown device {name!r}; expected one of {sorted(DEVICES)}")
    module, cls = DEVICES[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def wait_until(done: Callable[[], bool], deadline: float, what: str,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once `done()` is true; raise DeviceTimeout once `clock()` has passed `deadline`
    and `done()` is still false when checked after that clock reading. Blocks in growing slices,
    none past the deadline. The clock is read before the last check, never after: a completion
    that lands while we are descheduled between the two is seen, not called a timeout."""
    nap = MIN_SLEEP_S
    while not done():
        remaining = deadline - clock()
        if remaining <= 0:
            if done():
                return
            raise DeviceTimeout(f"{what} not complete by its deadline")
        sleep(min(nap, remaining))
        nap = min(nap * 2, MAX_SLEEP_S)


HUGE_PAGE = 2 << 20
HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE")  # Linux; elsewhere buffers stay on small pages


def aligned_empty(shape: tuple, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary.

    Arrays of HUGE_PAGE bytes or more start on a huge-page boundary of a mapping advised into
    transparent huge pages, where the OS offers them: kernels walk megabytes of activations, and
    on 4 KiB pages the TLB misses cost ResNet-50 about 4% of its time on x86."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    try:
        physical = _physical_bytes()
        if nbytes > physical:  # mapped lazily, it would "succeed", then OOM-kill a run
            raise MemoryError(f"more than this host's {physical} bytes of memory")
        if nbytes >= HUGE_PAGE and HUGE_PAGES:
            raw = np.frombuffer(_huge_mapping(nbytes + HUGE_PAGE), np.uint8)
            align = HUGE_PAGE
        else:
            raw = np.empty(nbytes + align, dtype=np.uint8)
    except (MemoryError, OSError) as e:  # numpy: MemoryError; mmap: OSError (ENOMEM)
        raise AllocError(f"cannot allocate {nbytes} bytes: {getattr(e, 'strerror', None) or e}") \
            from None
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX, or not reported: no bound
        return 2**63


def _huge_mapping(nbytes: int) -> mmap.mmap:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP disabled in this kernel: the mapping still works, on small pages
        pass
    return m
