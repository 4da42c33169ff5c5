"""CPU device: the programs section is one shared object exporting keel_graph, keel_graph_mt and
(for profile(), runner/device.py) keel_profile and keel_ticks, as runner/keel_abi.h declares them,
loaded straight from memory and called once per submission, synchronously, inside submit().
Weights are a pointer into the blob's private copy (zero-copy, runner/blob.py read_blob); the
arena is a 64-byte aligned host array, on huge pages from 2 MiB up (runner.device.aligned_empty).

Threads: KEEL_THREADS (default: the cores this process may run on). With one thread the runner
calls keel_graph and starts no thread at all. With n > 1 it starts n-1 workers once, at load; each
submission wakes them and all n run keel_graph_mt together (cffi releases the GIL during the call).
A run is bounded by its deadline: a thread that waits at a barrier past it (a share that never
arrives) gives up, every later barrier passes, and the submission never completes, so wait()
raises DeviceTimeout and recover() gets the workers back (or replaces the pool). A worker whose
share raises sets the barrier's abort too: the submission fails (completed() is a DeviceError).

Faults (tests): KEEL_CPU_FAULTS's hang@N, fault@N and slow@N:MS (runner/faults.py) are injected
into the last worker's share of submission N (_inject), so each drives one of the paths above;
they need the pool, and a load on one thread with faults listed is a ConfigError. One thread
has no deadline: keel_graph runs to its end inside submit().
"""
from __future__ import annotations

import os
import platform
import tempfile
import threading
import time
import weakref

import cffi
import numpy as np

from runner import abi
from runner.abi import GRAPH as ENTRY, GRAPH_MT as ENTRY_MT, PROFILE
from runner.device import Span, aligned_empty
from runner.errors import AllocError, BlobError, ConfigError, DeviceError
from runner.faults import listed, var_of
from runner.host import HOSTS, cpu_flags, machine_targets, missing_flags
from runner.queue import Memory, QueueDevice

ffi = cffi.FFI()
ffi.cdef(abi.declarations() + "int sched_yield(void);\nint clock_gettime(int, keel_ts *);\n")


class HostQueue(QueueDevice):
    """A device whose memory is the host's (cpu, mock): every array maps, nothing is staged;
    an address is a cffi pointer."""

    def alloc(self, nbytes: int) -> Memory:
        mem = aligned_empty((max(nbytes, 1),), "uint8")
        mem[:] = 0
        return Memory(ffi.from_buffer("uint8_t[]", mem), mem, nbytes)

    def map_host(self, slot: int, array):
        return ffi.from_buffer(array)

    def device_address(self, slot: int, mem):
        raise DeviceError(f"device {self.name!r} has no device memory to bind to slot {slot}; "
                          f"bind a host array")


class CpuDevice(HostQueue):
    """Runs the graph inside submit() (kick), on the calling thread (and the pool's workers):
    the timeline is complete as soon as submit() returns, unless the run missed its deadline."""
    name = "cpu"

    def check_target(self, target: str) -> None:
        if target not in HOSTS:
            raise BlobError(f"device {self.name!r} runs targets {sorted(HOSTS)}, blob target is "
                            f"{target!r}")
        want, system, machine = HOSTS[target], platform.system(), platform.machine()
        if want.system != system or machine not in want.machines:
            raise BlobError(f"blob target {target!r} cannot run on this host: host target is "
                            f"{host_target()!r} ({system}/{machine})")
        missing = missing_flags(target, cpu_flags())
        if missing:
            raise BlobError(f"blob target {target!r} needs CPU features {missing}, "
                            f"which /proc/cpuinfo does not list")

    def open(self, blob) -> None:
        self._done, self._failed = 0, None  # _failed: why the submission after _done failed
        self._faults = listed(self.name)
        self._owned: list = []  # the pool; a list, so the finalizer sees one recover() replaces
        self._arena, self._arena_ptr, self._weights_ptr, self._lib = host_memory(blob)
        self._finalizer = weakref.finalize(self, shutdown, self._owned, self._lib)
        self._io_ptrs = ffi.new("void *[]", max(len(blob.inputs) + len(blob.outputs), 1))
        self._graph = _symbol(self._lib, ENTRY)
        self._n_launches, self._ticks = len(blob.launches), None
        self._sync1 = ffi.new("keel_sync *")  # one thread, a launch range or profiling
        self.threads, self._pool = threads_from_env(), None
        if self.threads > 1 and hasattr(self._lib, ENTRY_MT):
            self._new_pool()
        else:  # a single-threaded program runs as such
            self.threads = 1
        if self._faults is not None and self._pool is None:
            raise ConfigError(f"{var_of(self.name)} on device 'cpu' injects into a worker's "
                              f"share: it needs the worker pool (KEEL_THREADS >= 2), this load "
                              f"runs on one thread")

    def _new_pool(self) -> None:
        self._pool = Pool(self._lib.keel_graph_mt, self.threads)
        self._owned.append(self._pool)  # an abandoned pool's late worker is waited for too
        self._use_profile(getattr(self, "_ticks", None))

    def record(self) -> None:
        for slot, address in enumerate(self.io_address):
            self._io_ptrs[slot] = address

    def patch(self, slot: int, address) -> None:
        self._io_ptrs[slot] = address

    def kick(self, launches: range, deadline: float, value: int) -> None:
        if self._pool is None:
            if self._ticks is None and len(launches) == self._n_launches:
                self._graph(self._arena_ptr, self._weights_ptr, self._io_ptrs)
            else:  # a launch range or profiling: the one-thread share of the _mt entries
                self._kick_range(launches)
        else:
            pool = self._pool
            if not pool.run(self._arena_ptr, self._weights_ptr, self._io_ptrs, deadline,
                            (launches.start, launches.stop),
                            self._faults and self._faults.at(value)):
                if pool.error is not None:  # completed() says so
                    self._failed = f"cpu submission {value}: {pool.error}"
                return  # never completes: wait() raises DeviceTimeout
        self._done = value

    def _kick_range(self, launches: range) -> None:
        self._sync1.first, self._sync1.end = launches.start, launches.stop
        if self._ticks is None:
            self._lib.keel_graph_mt(self._arena_ptr, self._weights_ptr, self._io_ptrs, 0, 1,
                                    self._sync1)
        else:
            self._lib.keel_profile(self._arena_ptr, self._weights_ptr, self._io_ptrs, 0, 1,
                                   self._sync1, self._ticks)

    def completed(self) -> int:
        if self._failed is not None:
            raise DeviceError(self._failed)
        return self._done

    def reset(self) -> None:
        self._failed = None
        if self._pool is not None and not self._pool.reset():
            old = self._pool  # a worker that never came back is abandoned with its pool
            self._new_pool()
            if old.close(grace=0):
                self._owned.remove(old)

    def close(self) -> None:
        release_host_memory(self)

    def set_profiling(self, on: bool) -> None:
        """keel_profile in place of keel_graph_mt: every thread stores the cycle counter before
        and after each launch into its own row of `ticks`."""
        if not on:
            self._ticks = None
            self._use_profile(None)
            return
        if not hasattr(self._lib, PROFILE) or not hasattr(self._lib, abi.TICKS):
            raise DeviceError("this blob's program has no keel_profile entry point (compiled "
                              "by an older keel); recompile it to profile")
        self._ticks = ffi.new("unsigned long long[]", max(2 * self._n_launches * self.threads, 1))
        self._ns_per_tick = _ns_per_tick(self._lib.keel_ticks)
        self._use_profile(self._ticks)

    def _use_profile(self, ticks) -> None:
        if self._pool is not None:
            self._pool.profile = (self._lib.keel_profile, ticks, 2 * self._n_launches) \
                if ticks is not None else None

    def launch_times(self, launches: range) -> list[Span]:
        n, t = self._n_launches, self._ns_per_tick
        rows = [self._ticks[k * 2 * n:(k + 1) * 2 * n] for k in range(self.threads)]
        base = min(r[2 * i] for r in rows for i in launches) if len(launches) else 0
        return [Span(i, tid, round((r[2 * i] - base) * t), round((r[2 * i + 1] - base) * t))
                for tid, r in enumerate(rows) for i in launches]


def host_memory(blob) -> tuple:
    """What a host-memory device needs of a blob: (arena array, arena pointer, weights pointer,
    loaded programs). Weights are read in place, in the blob's private copy, which read_blob
    advises into huge pages (docs/perf.md, issue 33: what that copy costs a load)."""
    arena = aligned_empty((max(blob.arena_bytes, 1),), "uint8")
    lib = Library(blob.programs)
    # the weights through a numpy array, not the memoryview itself: a memoryview is collected
    # by the GC's clear pass, and a cffi pointer holding one, cleared after it in a dropped
    # Model's reference cycle (an exception's traceback makes one), crashed CPython's release
    weights = np.frombuffer(blob.weights, np.uint8)
    return arena, ffi.from_buffer("uint8_t[]", arena), ffi.from_buffer("uint8_t[]", weights), lib


def shutdown(owned: list, lib: "Library") -> None:
    """A host device's finalizer (weakref.finalize: runs once, at close() or collection): stop
    the threads that run its code (they hold no reference to the device), then unload it.
    `owned`: everything that may run its code, each close() true once it has stopped."""
    stopped = [worker.close() for worker in owned]
    if all(stopped):  # else a thread still runs its code: leak it rather than crash
        lib.unload()


def release_host_memory(dev) -> None:
    """close() of a host device (idempotent): a failed load's traceback keeps the device alive in
    a cycle with the blob's mapping, which cannot be collected while views of it are exported."""
    finalizer = dev.__dict__.pop("_finalizer", None)
    if finalizer is not None:
        finalizer()
    lib = dev.__dict__.pop("_lib", None)
    if lib is not None:  # a load that failed before its finalizer existed
        lib.unload()
    for name in ("_weights_ptr", "_arena_ptr"):
        ptr = dev.__dict__.pop(name, None)
        if ptr is not None:
            ffi.release(ptr)


def _symbol(lib, name: str):
    try:
        return getattr(lib, name)
    except AttributeError:
        raise BlobError(f"programs section does not export {name}") from None


CALIBRATE_S = 0.02  # cycle counter against CLOCK_MONOTONIC: 1 us of jitter is 5e-5 of it


def _ns_per_tick(ticks) -> float:
    """The cycle counter's period (rdtsc: the nominal clock; cntvct: its own fixed rate)."""
    t0, c0 = time.perf_counter_ns(), ticks()
    time.sleep(CALIBRATE_S)
    t1, c1 = time.perf_counter_ns(), ticks()
    return (t1 - t0) / max(c1 - c0, 1)
GRACE_S = 1.0  # after a missed deadline, how long recover() gives a share to finish its kernel

try:  # the process's own C library, for sched_yield and clock_gettime in the barrier
    _LIBC = ffi.dlopen(None)
except OSError:
    _LIBC = None


def threads_from_env() -> int:
    text = os.environ.get("KEEL_THREADS", "").strip()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    if not text:
        return cores
    # ASCII digits only: int() also takes "1_0" and full-width digits
    n = int(text) if text.isascii() and text.isdigit() else 0
    most = max(MAX_THREADS_PER_CORE * cores, MIN_MAX_THREADS)
    if not 1 <= n <= most:
        raise ConfigError(f"KEEL_THREADS must be an integer in [1, {most}] ({MAX_THREADS_PER_CORE} "
                          f"per core this process may use), got {text!r}")
    return n


# the barrier spins: threads beyond the cores only wait for each other's time slices
MAX_THREADS_PER_CORE, MIN_MAX_THREADS = 4, 16


class Pool:
    """n-1 worker threads that each run one share of keel_graph_mt per submission; the calling
    thread runs share 0. Workers sleep on a semaphore between submissions (no spinning while
    idle: modeld runs at 20 Hz). The barrier reads the deadline from `sync` (CLOCK_MONOTONIC)
    once it has spun long enough to yield.

    `running` (shares started and not back) is counted by the workers themselves, under `cond`:
    an exception in the calling thread (KeyboardInterrupt) cannot leave it wrong, so reset() and
    close() always know whether a worker still runs the program."""

    def __init__(self, graph_mt, nt: int):
        self.graph_mt, self.nt = graph_mt, nt
        self.sync = ffi.new("keel_sync *")
        if _LIBC is not None:
            self.sync.yield_fn, self.sync.clock_fn = _LIBC.sched_yield, _LIBC.clock_gettime
            self.sync.clock_id = time.CLOCK_MONOTONIC
        self.args: tuple = ()
        self.launches = (0, 0)  # the range sync holds
        self.profile = None  # set by CpuDevice.profile
        self.fault = None  # runner.faults.Fault injected into the last worker's share, this run
        self.error: str | None = None  # why a worker's share failed, this run
        self.stop = False
        self.cond = threading.Condition()
        self.running = 0
        self.start = [threading.Semaphore(0) for _ in range(nt - 1)]
        self.workers = []
        try:
            for tid in range(1, nt):
                self.workers.append(threading.Thread(target=self._work, args=(tid,), daemon=True,
                                                     name=f"keel-cpu-{tid}"))
                self.workers[-1].start()
        except RuntimeError as e:  # "can't start new thread": a process or memory limit
            self.workers.pop()
            self.close()
            raise AllocError(f"cannot start {nt - 1} worker threads (KEEL_THREADS={nt}): started "
                             f"{len(self.workers)}, then: {e}") from None

    def _work(self, tid: int) -> None:
        while True:
            self.start[tid - 1].acquire()
            if self.stop:
                return
            try:
                if self.fault is not None and tid == self.nt - 1:
                    _inject(self.fault, self.sync.deadline_ns)
                self._share(tid)
            except Exception as e:  # the other shares must not wait for this one at barriers
                self.error = f"worker {tid} failed: {type(e).__name__}: {e}"
                self.sync.abort = 1
            finally:
                with self.cond:
                    self.running -= 1
                    self.cond.notify_all()

    def run(self, arena, weights, io, deadline: float, launches: tuple, fault=None) -> bool:
        """Run every share of launches [first, end); False when the run missed its deadline or
        a worker's share failed (`error` says how): its results are garbage. `fault`: one of
        KEEL_CPU_FAULTS's, injected into the last worker's share (_inject)."""
        self.args, self.fault = (arena, weights, io), fault
        if launches != self.launches:  # two cffi stores per run cost more than the compare
            self.sync.first, self.sync.end = self.launches = launches
        # on CLOCK_MONOTONIC's own base: time.monotonic() has another one on macOS
        self.sync.deadline_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC) + \
            int((deadline - time.monotonic()) * 1e9)
        for s in self.start:
            with self.cond:
                self.running += 1
            s.release()
        self._share(0)  # returns once every share is done
        with self.cond:  # past the deadline: one last look; late shares may still run
            if not self.cond.wait_for(lambda: not self.running,
                                      max(deadline - time.monotonic(), 0)):
                return False
        return not self.sync.abort and self.error is None

    def _share(self, tid: int) -> None:
        if self.profile is None:
            self.graph_mt(*self.args, tid, self.nt, self.sync)
        else:  # (keel_profile, ticks, row length): each thread times into its own row
            fn, ticks, row = self.profile
            fn(*self.args, tid, self.nt, self.sync, ticks + tid * row)

    def reset(self) -> bool:
        """After a missed deadline or an interrupted run: True once every worker is back and
        the barrier is reset."""
        with self.cond:
            if not self.cond.wait_for(lambda: not self.running, GRACE_S):
                return False
        self.sync.count, self.sync.abort, self.error = 0, 0, None
        return True

    def close(self, grace: float = GRACE_S) -> bool:
        """Stop the workers; True once none of them runs the program any more (it may be
        unloaded), waiting at most `grace` seconds for each."""
        self.stop = True
        for s in self.start:
            s.release()
        for w in self.workers:
            w.join(grace)
        return not any(w.is_alive() for w in self.workers)


LATE_S = 0.05  # hang: how long after the deadline the stalled share arrives


def _inject(fault, deadline_ns: int) -> None:
    """A fault in the share of the worker that runs it, each through a path the pool has
    anyway: hang, the share arrives only after the run's deadline (every barrier gives up,
    the submission never completes: DeviceTimeout, then recover() waits for the late worker);
    slow, it arrives MS late (the barriers wait, the run completes late and right); fault, the
    worker raises (the other shares pass their barriers, completed() is a DeviceError)."""
    if fault.kind == "hang":
        late = deadline_ns - time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        time.sleep(max(late, 0) / 1e9 + LATE_S)
    elif fault.kind == "slow":
        time.sleep(fault.ms / 1000)
    else:
        raise DeviceError(f"injected ({var_of('cpu')})")


def host_target() -> str:
    """The narrowest CPU target this machine runs (its baseline)."""
    names = machine_targets()
    return names[0] if names else f"none ({platform.system()}/{platform.machine()})"


class Library:
    """A shared object held in memory, dlopen'ed through a memfd. The memfd stays open while the
    library is loaded: glibc matches already-loaded objects by path, so a reused
    /proc/self/fd/N name would hand back the previous model's code."""

    def __init__(self, code: memoryview):
        self.lib, self.fd = _dlopen_from_memory(code)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["lib"], name)

    def unload(self) -> None:
        """Idempotent. cffi's FFI.dlopen keeps every library it opened in private lists, ~6 KB
        per load that dlclose does not give back: drop ours from them too."""
        lib, self.lib = self.__dict__.get("lib"), None
        if lib is None:
            return
        ffi.dlclose(lib)
        with ffi._lock:
            i = next((i for i, x in enumerate(ffi._libraries) if x is lib), None)
            if i is not None:
                del ffi._libraries[i], ffi._function_caches[i]
        if self.fd is not None:
            os.close(self.fd)


def _dlopen_from_memory(code: memoryview):
    """-> (lib, fd to close after dlclose, or None)"""
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

