"""The Device interface: the one contract every backend (CPU, KGSL, FastRPC, AM) implements.

A device runs one loaded graph: `alloc` the arena for intermediates, `upload` the read-only weights
(zero-copy where the hardware allows), `load` the compiled programs, then per inference `submit` the
io slot arrays (inputs, then outputs) as ONE submission and `wait` on the returned fence with a
deadline. `check_target` runs first and refuses blobs this device cannot run on this host.

Backends register in DEVICES by module path, so a backend's imports (ioctls, cffi builds) are only
paid when it is used.
"""
from __future__ import annotations

import importlib
import mmap
import os
import time
from typing import Callable

import numpy as np

from runner.errors import AllocError, DeviceTimeout

# blob target -> device that runs it
TARGETS = {"cpu": "cpu", "cpu-avx512": "cpu", "cpu-aarch64": "cpu", "cpu-arm64-apple": "cpu",
           "opencl": "opencl", "qcom": "opencl"}  # qcom: OpenCL C for Adreno, via libOpenCL
# device name -> "module:Class"
DEVICES = {"cpu": "runner.cpu:CpuDevice", "opencl": "runner.opencl:OpenCLDevice"}

MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 1e-3  # a fence that signals while we sleep costs at most this much latency


class Fence:
    """Completion of one submission."""

    def signalled(self) -> bool:
        raise NotImplementedError


class Device:
    name: str
    # where a backend may cache what it builds from this blob (OpenCL program binaries); set by
    # Model.load to "<blob>.clcache" beside the blob. None: no cache.
    cache_dir: str | None = None

    def check_target(self, target: str) -> None:
        """Raise BlobError unless this device can run blobs built for `target` on this host."""
        raise NotImplementedError

    def alloc(self, arena_bytes: int) -> None:
        raise NotImplementedError

    def upload(self, weights: memoryview) -> None:
        raise NotImplementedError

    def load(self, programs: memoryview, launches: list, buffers: dict) -> None:
        raise NotImplementedError

    def submit(self, io: list) -> Fence:
        """io: one contiguous array per io slot. The backend may use them until wait() returns."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the device holds of the blob (after a failed load); idempotent."""

    def wait(self, fence: Fence, timeout_ms: float) -> None:
        wait_until(fence.signalled, timeout_ms, f"{self.name} submission")


def get_device(name: str) -> Device:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; expected one of {sorted(DEVICES)}")
    module, cls = DEVICES[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def wait_until(done: Callable[[], bool], timeout_ms: float, what: str,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> None:
    """Poll `done` with growing but bounded sleeps until it is true or `timeout_ms` has passed."""
    if done():
        return
    deadline = clock() + timeout_ms / 1000
    nap = MIN_SLEEP_S
    while True:
        remaining = deadline - clock()
        if remaining <= 0:
            if done():  # it may have signalled while we slept past the deadline
                return
            raise DeviceTimeout(f"{what} not signalled within {timeout_ms} ms")
        sleep(min(nap, remaining))
        if done():
            return
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
        if nbytes > _physical_bytes():  # mapped lazily, it would "succeed", then OOM-kill a run
            raise MemoryError(f"more than this host's {_physical_bytes()} bytes of memory")
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
