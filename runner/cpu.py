"""CPU device: the programs section is one shared object exporting

    void keel_graph(uint8_t *arena, const uint8_t *weights, void *const *io);

loaded straight from memory and called once per submission, synchronously. Weights are a pointer
into the mapped blob (zero-copy); the arena is a 64-byte aligned host array.
"""
from __future__ import annotations

import os
import platform
import tempfile
import weakref
from dataclasses import dataclass

import cffi

from runner.device import Device, Fence, aligned_empty
from runner.errors import BlobError

ffi = cffi.FFI()
ffi.cdef("void keel_graph(uint8_t *arena, const uint8_t *weights, void *const *io);")


@dataclass(frozen=True)
class Host:
    system: str  # platform.system()
    machines: tuple[str, ...]  # platform.machine() spellings
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the code may use


HOSTS = {
    "cpu": Host("Linux", ("x86_64", "AMD64"),  # built with -march=x86-64-v3
                ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")),
    "cpu-aarch64": Host("Linux", ("aarch64", "arm64"), ()),
    "cpu-arm64-apple": Host("Darwin", ("arm64",), ()),
}


class _Done(Fence):
    def signalled(self) -> bool:
        return True


DONE = _Done()  # submissions run synchronously, so every fence is already signalled


class CpuDevice(Device):
    name = "cpu"

    def check_target(self, target: str) -> None:
        if target not in HOSTS:
            raise BlobError(f"device 'cpu' runs targets {sorted(HOSTS)}, blob target is {target!r}")
        want, system, machine = HOSTS[target], platform.system(), platform.machine()
        if want.system != system or machine not in want.machines:
            raise BlobError(f"blob target {target!r} cannot run on this host: host target is "
                            f"{host_target()!r} ({system}/{machine})")
        missing = [f for f in want.cpu_flags if f not in _cpu_flags(want.cpu_flags)]
        if missing:
            raise BlobError(f"blob target {target!r} needs CPU features {missing}, "
                            f"which /proc/cpuinfo does not list")

    def alloc(self, arena_bytes: int) -> None:
        self._arena = aligned_empty((max(arena_bytes, 1),), "uint8")
        self._arena_ptr = ffi.from_buffer("uint8_t[]", self._arena)

    def upload(self, weights: memoryview) -> None:
        self._weights_ptr = ffi.from_buffer("uint8_t[]", weights)  # keeps the mapping alive

    def load(self, programs: memoryview, launches: list, buffers: dict) -> None:
        n_io = sum(b.region in ("input", "output") for b in buffers.values())
        self._io_ptrs = ffi.new("void *[]", max(n_io, 1))
        self._bound = [None] * n_io  # the array behind each io pointer, kept alive
        lib, fd = _dlopen_from_memory(programs)
        weakref.finalize(self, _unload, lib, fd)
        try:
            self._graph = lib.keel_graph
        except AttributeError:
            raise BlobError("programs section does not export keel_graph") from None

    def submit(self, io: list) -> Fence:
        bound = self._bound
        for i, arr in enumerate(io):
            if arr is not bound[i]:
                self._io_ptrs[i] = ffi.from_buffer(arr)
                bound[i] = arr
        self._graph(self._arena_ptr, self._weights_ptr, self._io_ptrs)
        return DONE


def host_target() -> str:
    system, machine = platform.system(), platform.machine()
    names = [t for t, h in HOSTS.items() if h.system == system and machine in h.machines]
    return names[0] if names else f"none ({system}/{machine})"


def _cpu_flags(needed: tuple[str, ...]) -> set[str]:
    """Flags from /proc/cpuinfo; where that cannot be read, trust the target (assume `needed`)."""
    if not needed:
        return set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set(needed)


def _dlopen_from_memory(code: memoryview):
    """dlopen a shared object held in memory. Returns (lib, fd to close after dlclose, or None).

    A memfd stays open while the library is loaded: glibc matches already-loaded objects by path,
    so a reused /proc/self/fd/N name would hand back the previous model's code.
    """
    memfd = hasattr(os, "memfd_create")
    if memfd:
        fd = os.memfd_create("keel-programs", os.MFD_CLOEXEC)
        path = f"/proc/self/fd/{fd}"
    else:
        fd, path = tempfile.mkstemp(prefix="keel-", suffix=".so")
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(code)
        lib = ffi.dlopen(path)
    except OSError as e:
        os.close(fd)
        raise BlobError(f"programs section is not a shared object this host can load: {e}") \
            from None
    finally:
        if not memfd:
            os.unlink(path)  # the mapping outlives the name
    if memfd:
        return lib, fd
    os.close(fd)
    return lib, None


def _unload(lib, fd) -> None:
    ffi.dlclose(lib)
    if fd is not None:
        os.close(fd)
