"""CPU device: the programs section is one shared object exporting

    void keel_graph(uint8_t *arena, const uint8_t *weights, void *const *io);
    void keel_graph_mt(uint8_t *arena, const uint8_t *weights, void *const *io,
                       int tid, int nt, keel_sync *sync);

loaded straight from memory and called once per submission, synchronously. Weights are a pointer
into the mapped blob (zero-copy); the arena is a 64-byte aligned host array, on huge pages from
2 MiB up (runner.device.aligned_empty).

Threads: KEEL_THREADS (default: the cores this process may run on). With one thread the runner
calls keel_graph and starts no thread at all. With n > 1 it starts n-1 workers once, at load; each
submission wakes them and all n run keel_graph_mt together (cffi releases the GIL during the call).
"""
from __future__ import annotations

import os
import platform
import tempfile
import threading
import weakref
from dataclasses import dataclass

import cffi

from runner.device import Device, Fence, aligned_empty
from runner.errors import BlobError, ConfigError

ffi = cffi.FFI()
ffi.cdef("""
typedef struct { int count, sense; int (*yield_fn)(void); } keel_sync;
int sched_yield(void);
void keel_graph(uint8_t *arena, const uint8_t *weights, void *const *io);
void keel_graph_mt(uint8_t *arena, const uint8_t *weights, void *const *io, int tid, int nt,
                   keel_sync *sync);
""")


@dataclass(frozen=True)
class Host:
    system: str  # platform.system()
    machines: tuple[str, ...]  # platform.machine() spellings
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags the code may use


HOSTS = {
    "cpu": Host("Linux", ("x86_64", "AMD64"),  # built with -march=x86-64-v3
                ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")),
    "cpu-avx512": Host("Linux", ("x86_64", "AMD64"),  # built with -march=x86-64-v4
                       ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe",
                        "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
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
        # read in place, on the blob mapping's small pages: copying them into huge pages gains
        # ResNet-50 ~4% per run but costs every load ~15 ms (openpilot: 73 MiB, no run gain)
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
        self.threads = threads_from_env()
        self._run = self._graph  # decided once here, not per submission
        if self.threads > 1:
            try:
                graph_mt = lib.keel_graph_mt
            except AttributeError:  # a single-threaded program: run it as such
                self.threads = 1
            else:
                pool = Pool(graph_mt, self.threads)
                weakref.finalize(self, pool.close)
                self._run = pool.run

    def close(self) -> None:
        for name in ("_weights_ptr", "_arena_ptr"):
            ptr = self.__dict__.pop(name, None)
            if ptr is not None:
                ffi.release(ptr)

    def submit(self, io: list) -> Fence:
        bound = self._bound
        for i, arr in enumerate(io):
            if arr is not bound[i]:
                self._io_ptrs[i] = ffi.from_buffer(arr)
                bound[i] = arr
        self._run(self._arena_ptr, self._weights_ptr, self._io_ptrs)
        return DONE


try:  # the process's own C library, for sched_yield in the barrier
    _LIBC = ffi.dlopen(None)
except OSError:
    _LIBC = None


def threads_from_env() -> int:
    text = os.environ.get("KEEL_THREADS", "").strip()
    if not text:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"KEEL_THREADS must be a positive integer, got {text!r}")
    return n


class Pool:
    """n-1 worker threads that each run one share of keel_graph_mt per submission; the calling
    thread runs share 0. Workers sleep on a semaphore between submissions (no spinning while
    idle: modeld runs at 20 Hz)."""

    def __init__(self, graph_mt, nt: int):
        self.graph_mt, self.nt = graph_mt, nt
        self.sync = ffi.new("keel_sync *")
        self.sync.yield_fn = _LIBC.sched_yield if _LIBC is not None else ffi.NULL
        self.args: tuple = ()
        self.stop = False
        self.start = [threading.Semaphore(0) for _ in range(nt - 1)]
        self.done = threading.Semaphore(0)
        self.workers = [threading.Thread(target=self._work, args=(tid,), daemon=True,
                                         name=f"keel-cpu-{tid}") for tid in range(1, nt)]
        for w in self.workers:
            w.start()

    def _work(self, tid: int) -> None:
        while True:
            self.start[tid - 1].acquire()
            if self.stop:
                return
            self.graph_mt(*self.args, tid, self.nt, self.sync)
            self.done.release()

    def run(self, *args) -> None:
        self.args = args
        for s in self.start:
            s.release()
        self.graph_mt(*args, 0, self.nt, self.sync)  # returns once every share is done
        for _ in self.start:
            self.done.acquire()  # workers are back on their semaphores: args may change

    def close(self) -> None:
        self.stop = True
        for s in self.start:
            s.release()


def _machine_targets() -> list[str]:
    """Targets for this OS and machine, narrow to wide (the order HOSTS lists them)."""
    system, machine = platform.system(), platform.machine()
    return [t for t, h in HOSTS.items() if h.system == system and machine in h.machines]


def host_target() -> str:
    names = _machine_targets()
    return names[0] if names else f"none ({platform.system()}/{platform.machine()})"


def best_host_target() -> str:
    """The widest CPU target this host runs: its CPU flags decide between ISA levels."""
    names = [t for t in _machine_targets()
             if all(f in _cpu_flags(HOSTS[t].cpu_flags) for f in HOSTS[t].cpu_flags)]
    return names[-1] if names else host_target()


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
