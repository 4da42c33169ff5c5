"""The emulated DSP (KEEL_FASTRPC=mock): sim/dsp/runtime.c built as a static Hexagon v65 Linux
program and run under qemu-hexagon, with the real HVX and scalar-FP kernels of the blob.

How it stands in for FastRPC (dsp/fastrpc.py):
  shared buffer   a memfd both sides map MAP_SHARED (FastRPC: an ION / dma-buf buffer mapped
                  into the DSP's SMMU once, at load);
  session + load  one qemu-hexagon process per load, started with the programs and the buffer's
                  layout (FastRPC: open the session, dlopen the graph in the user PD);
  invoke          8 bytes {seq, flags} on its stdin, the answer on its stdout (FastRPC: one
                  FASTRPC_IOCTL_INVOKE carrying the same two words as scalars);
  recover         kill the process and start another (FastRPC: close the session, open again).
The kernels, the buffer layout and the numerics are the DSP's; what differs is the transport, and
time: qemu does not model the DSP's cycles, so a profiled invoke reports qemu's packet counts (and
HVX instruction counts) per kernel instead: the cost model's signal, not a latency.

Bring-up faults (KEEL_MOCK_BRINGUP, runner/faults.py's SITES): fastrpc.pd=ERRNO refuses the
session as FastRPC refuses an unsigned PD; fastrpc.memory=ERRNO fails the shared buffer's
allocation as ION's would; fastrpc.answer=wrong flips the first byte of the last
io slot in every answer after the load's (a wrong known answer).
"""
from __future__ import annotations

import mmap
import os
import select
import struct
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

from dsp import build
from runner.errors import DeviceError, DeviceTimeout
from runner.faults import bringup, bringup_errno

QEMU = "qemu-hexagon"
RUNTIME_C = Path(__file__).with_name("runtime.c")
# KEEL_QEMU: per-kernel costs from qemu's packet and HVX counters instead of the cycle counter
RUNTIME = ("--target=hexagon-unknown-linux-musl", *build.HVX, "-static", "-DKEEL_QEMU")
REPLY = struct.Struct("<4I")  # seq, status, nticks, 0 (runtime.c Reply); then nticks u64
STOP_S = 2.0


class QemuTransport:
    """The shared buffer and the programs are memfds the qemu process inherits, as FastRPC maps
    dma-buf fds: nothing is left behind in the file system, whatever happens to the process."""

    def __init__(self):
        self.procs: list = []  # the running process, if any (a list the finalizer shares)
        self.buf = b""
        self.shm = None
        self.last_slot = None  # fastrpc.answer=wrong: the io slot every answer corrupts
        self.fds: list[int] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.fds)

    @property
    def proc(self):
        return self.procs[0]

    def alloc(self, nbytes: int) -> mmap.mmap:
        refused = bringup_errno("fastrpc.memory")
        if refused is not None:
            raise DeviceError(f"allocating {nbytes} bytes of shared memory: "
                              f"{os.strerror(refused)} (errno {refused}) (KEEL_MOCK_BRINGUP "
                              f"fastrpc.memory)")
        fd = _memfd("keel-dsp-shared", nbytes)
        self.shm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        self.shm_fd, self.shm_bytes = fd, nbytes
        self.fds.append(fd)
        return self.shm

    def open(self, programs, weights: int, arena: int, slots: list[int], table: bytes,
             deadline: float) -> None:
        """Start the DSP side on `programs`; `table` is the launch table (runtime.c)."""
        refused = bringup_errno("fastrpc.pd")
        if refused is not None:
            from dsp.fastrpc import refused_pd
            raise refused_pd(f"{QEMU} (KEEL_MOCK_BRINGUP fastrpc.pd)", refused)
        self.last_slot = slots[-1] if bringup("fastrpc.answer") == "wrong" else None
        so, tab = _memfd("keel-dsp-programs", 0), _memfd("keel-dsp-table", 0)
        self.fds += [so, tab]
        os.write(so, programs)
        os.write(tab, table)
        self.argv = [QEMU, str(runtime_elf()), str(so), str(len(programs)), str(self.shm_fd),
                     str(self.shm_bytes), str(tab), str(len(table)), str(weights), str(arena),
                     *map(str, slots)]
        self._start(deadline)

    def _start(self, deadline: float) -> None:
        self.buf = b""
        self.err = tempfile.TemporaryFile(prefix="keel-dsp-stderr-")
        fds = (int(self.argv[2]), self.shm_fd, int(self.argv[6]))
        self.procs[:] = [subprocess.Popen(self.argv, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=self.err, pass_fds=fds)]
        os.set_blocking(self.proc.stdout.fileno(), False)
        while True:  # the first answer (seq 0) says the library is loaded
            if self.replies():
                return
            if time.monotonic() > deadline:
                _stop(self.procs, [])
                raise DeviceTimeout(f"{QEMU}: the DSP runtime did not load the programs in time")
            self.block(0.05)

    def invoke(self, seq: int, request: bytes) -> None:
        """Send invoke `seq`: its RUN request as dsp/graph_runner.h lays it out."""
        try:
            os.write(self.proc.stdin.fileno(), request)
        except (BrokenPipeError, OSError) as e:
            raise DeviceError(f"{QEMU}: the DSP runtime is gone ({e}); {self._why()}") from None

    def replies(self) -> list[tuple[int, int, list[int]]]:
        """Answers read so far, without blocking: (seq, status, ticks)."""
        try:
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            chunk = None
        if chunk == b"":
            raise DeviceError(f"{QEMU}: the DSP runtime exited; {self._why()}")
        self.buf += chunk or b""
        out = []
        while len(self.buf) >= REPLY.size:
            seq, status, n, _ = REPLY.unpack_from(self.buf)
            end = REPLY.size + 8 * n
            if len(self.buf) < end:
                break
            out.append((seq, status, list(struct.unpack_from(f"<{n}Q", self.buf, REPLY.size))))
            if seq and self.last_slot is not None:
                self.shm[self.last_slot] ^= 0xFF
            self.buf = self.buf[end:]
        return out

    def block(self, seconds: float) -> None:
        select.select([self.proc.stdout], [], [], seconds)

    def _why(self) -> str:
        code = self.proc.poll() if self.procs else None
        self.err.seek(0)
        err = self.err.read().decode(errors="replace").strip()
        return f"exit status {code}: {err or 'no message'}"

    def restart(self, deadline: float) -> None:
        _stop(self.procs, [])
        self._start(deadline)

    def close(self) -> None:
        self._finalizer()
        if self.shm is not None:
            try:
                self.shm.close()
            except BufferError:  # io views still held by the caller: unmapped when they go
                pass
            self.shm = None


def _memfd(name: str, nbytes: int) -> int:
    fd = os.memfd_create(name, 0)  # inherited by the qemu process through pass_fds
    os.ftruncate(fd, nbytes)
    return fd


def _stop(procs: list, fds: list) -> None:
    """End the process this transport started (a hung DSP does not stop by itself), then close
    the memfds. Also the finalizer: a Model dropped without close() leaves nothing running."""
    for proc in procs:
        proc.stdin.close()
        try:
            proc.wait(0.2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_S)
        proc.stdout.close()
    procs.clear()
    for fd in fds:
        os.close(fd)
    fds.clear()


def runtime_elf() -> Path:
    """runtime.c (which includes dsp/skel.c) built for qemu-hexagon."""
    why = build.missing()
    if why:
        raise DeviceError(f"KEEL_FASTRPC=mock needs {why}")
    return build.build("runtime", RUNTIME_C, RUNTIME)
