"""FastRPC host side: the `dsp` device's transport on a comma 3X (SDM845, Hexagon 685 cDSP), raw
ioctls on /dev/adsprpc-smd from the msm-4.9 UAPI (drivers/char/adsprpc_shared.h; sizes, offsets
and numbers are checked against the compiled header in tests/test_dsp_uapi.py).

Per Model.load, once:
  1. open /dev/adsprpc-smd, FASTRPC_IOCTL_GETINFO(3): the session is the cDSP's (msm-4.9 has one
     node for every DSP; the domain is picked per fd).
  2. FASTRPC_IOCTL_INIT_ATTRS, FASTRPC_INIT_CREATE with the unsigned-module attribute: a user
     protection domain spawned from the DSP shell (fastrpc_shell_unsigned_3 where the firmware
     has it, else fastrpc_shell_3), the shell image handed over in ION memory. A device that
     refuses unsigned PDs fails here, with an error saying it needs a test signature.
  3. the shared buffer (weights, arena, io: dsp/device.py) is ION memory, shared as a dma-buf
     fd and mapped into the DSP's SMMU once with FASTRPC_IOCTL_MMAP.
  4. the reverse-RPC listener starts (dsp/listener.py): the PD's loader reads libraries from
     this process, which serves two from memory, SKEL (dsp/skel.c, built by dsp/build.py) and
     PROGRAMS (the blob's kernels).
  5. remotectl (handle 0) method 0 opens SKEL in the PD (its loader reads it through the
     listener); its method LOAD receives the buffer's layout, the launch table and the name
     PROGRAMS, which it dlopens (read through the listener again).
Per run(): one FASTRPC_IOCTL_INVOKE of method RUN with {seq, flags} in and the runtime's answer
out (dsp/skel.c), on a worker thread, so that wait() keeps its deadline: the ioctl blocks
until the DSP answers. recover() ends the PD (adsp_current_process exit, which also ends the
listener's wait), abandons the session (its fd) and builds a new one.
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
import threading
import time

from dsp.build import SKEL_NAME as SKEL, skel_so
from dsp.listener import CURRENT_PROCESS, EXIT, Listener, scalars
from runner.errors import DeviceError, DeviceTimeout

RPC_NODE, ION_NODE = "/dev/adsprpc-smd", "/dev/ion"
CDSP = 3  # FastRPC domain id: 0 aDSP, 1 mDSP, 2 sDSP, 3 cDSP
SHELLS = ("/dsp/cdsp/fastrpc_shell_unsigned_3", "/vendor/dsp/cdsp/fastrpc_shell_unsigned_3",
          "/dsp/cdsp/fastrpc_shell_3", "/vendor/dsp/cdsp/fastrpc_shell_3")
UNSIGNED_PD = 0x8  # FASTRPC_MODE_UNSIGNED_MODULE (adsprpc.c): spawn an unsigned user PD
PROGRAMS = "libkeel_programs.so"  # the name the listener serves the blob's programs under
STOP_S = 2.0  # the PD's exit, when a session is dropped
# dsp/graph_runner.h: an answer's head {seq, status, nticks, 0}; a profiled one then has
# 2 * MAX_WORKERS u64 per launch (each worker's cost and HVX count)
REPLY_HEAD, FLAG_PROFILE, MAX_WORKERS = 16, 1, 4
LOAD, RUN = 2, 3  # the skel's methods (0 and 1 are a handle interface's open and close)
LOAD_ERRORS = {1: "bad arguments", 2: f"dlopen of {PROGRAMS} failed",  # dsp/skel.c
               3: "keel_graph, keel_launch_part or keel_split missing",
               4: "a bad launch table", 5: "out of memory"}
# legacy ION (msm-4.9): allocate a handle, share it as a dma-buf fd; the system heap, cached
ION_SYSTEM_HEAP_ID, ION_FLAG_CACHED = 25, 1


def _iowr(kind: str, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord(kind) << 8) | nr


class RemoteBuf(ctypes.Structure):
    _fields_ = [("pv", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class RemoteDma(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("offset", ctypes.c_uint32)]


class RemoteArg(ctypes.Union):
    c_name = "remote_arg"
    _fields_ = [("buf", RemoteBuf), ("dma", RemoteDma), ("h", ctypes.c_uint32)]


class Invoke(ctypes.Structure):
    c_name = "fastrpc_ioctl_invoke"
    _fields_ = [("handle", ctypes.c_uint32), ("sc", ctypes.c_uint32),
                ("pra", ctypes.POINTER(RemoteArg))]


class Init(ctypes.Structure):
    c_name = "fastrpc_ioctl_init"
    _fields_ = [("flags", ctypes.c_uint32), ("file", ctypes.c_size_t),
                ("filelen", ctypes.c_uint32), ("filefd", ctypes.c_int32),
                ("mem", ctypes.c_size_t), ("memlen", ctypes.c_uint32), ("memfd", ctypes.c_int32)]


class InitAttrs(ctypes.Structure):
    c_name = "fastrpc_ioctl_init_attrs"
    _fields_ = [("init", Init), ("attrs", ctypes.c_int), ("siglen", ctypes.c_uint32)]


class Mmap(ctypes.Structure):
    c_name = "fastrpc_ioctl_mmap"
    _fields_ = [("fd", ctypes.c_int), ("flags", ctypes.c_uint32), ("vaddrin", ctypes.c_size_t),
                ("size", ctypes.c_size_t), ("vaddrout", ctypes.c_size_t)]


class IonAlloc(ctypes.Structure):  # msm-4.9 include/uapi/linux/ion.h (legacy ION)
    _fields_ = [("len", ctypes.c_size_t), ("align", ctypes.c_size_t),
                ("heap_id_mask", ctypes.c_uint), ("flags", ctypes.c_uint), ("handle", ctypes.c_int)]


class IonFd(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_int), ("fd", ctypes.c_int)]


IOCTLS = {"FASTRPC_IOCTL_INVOKE": _iowr("R", 1, ctypes.sizeof(Invoke)),
          "FASTRPC_IOCTL_MMAP": _iowr("R", 2, ctypes.sizeof(Mmap)),
          "FASTRPC_IOCTL_INIT_ATTRS": _iowr("R", 10, ctypes.sizeof(InitAttrs)),
          "FASTRPC_IOCTL_GETINFO": _iowr("R", 8, 4)}
INVOKE, MMAP, INIT_ATTRS, GETINFO = IOCTLS.values()
FASTRPC_INIT_CREATE = 1
ION_IOC_ALLOC, ION_IOC_SHARE = _iowr("I", 0, ctypes.sizeof(IonAlloc)), _iowr("I", 4, 8)


def _ioctl(fd: int, number: int, arg, what: str) -> None:
    try:
        fcntl.ioctl(fd, number, arg)
    except OSError as e:
        raise DeviceError(f"{what}: ioctl {number:#x} failed: {os.strerror(e.errno)} "
                          f"(errno {e.errno})") from None


def _call(rpc: int, handle: int, sc: int, ins: list[bytes], outs: list[int], what: str) \
        -> list[bytes]:
    """One FASTRPC_IOCTL_INVOKE: in buffers (bytes), out buffers (sizes); the out buffers' bytes.
    Every buffer is 8-byte aligned (the listener's payloads pad relative to their start)."""
    bufs = [(ctypes.c_uint64 * max(-(-n // 8), 1))() for n in [len(b) for b in ins] + outs]
    for buf, b in zip(bufs, ins):
        ctypes.memmove(buf, b, len(b))
    pra = (RemoteArg * len(bufs))()
    for a, buf, n in zip(pra, bufs, [len(b) for b in ins] + outs):
        a.buf.pv, a.buf.len = ctypes.addressof(buf) if n else None, n
    _ioctl(rpc, INVOKE, Invoke(handle=handle, sc=sc, pra=pra), what)
    return [bytes(b)[:n] for b, n in zip(bufs[len(ins):], outs)]


class Ion:
    """One ION buffer: allocated, shared as a dma-buf fd, mapped here."""

    def __init__(self, nbytes: int):
        if not os.path.exists(ION_NODE):
            raise DeviceError(f"{ION_NODE} absent: no ION allocator for the DSP's shared memory")
        self.ion = os.open(ION_NODE, os.O_RDONLY | os.O_CLOEXEC)
        alloc = IonAlloc(len=nbytes, align=4096, heap_id_mask=1 << ION_SYSTEM_HEAP_ID,
                         flags=ION_FLAG_CACHED)
        _ioctl(self.ion, ION_IOC_ALLOC, alloc, f"allocating {nbytes} bytes of ION memory")
        share = IonFd(handle=alloc.handle)
        _ioctl(self.ion, ION_IOC_SHARE, share, "sharing the ION buffer as a dma-buf fd")
        self.fd, self.nbytes = share.fd, nbytes
        self.map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # views still held: the mapping goes with them
            pass
        os.close(self.fd)
        os.close(self.ion)  # closing the client frees its handles


class FastRpcTransport:
    """What dsp/device.py needs of a transport (alloc, open, invoke, replies, block, restart,
    close), over FastRPC."""

    def __init__(self):
        if not os.path.exists(RPC_NODE):
            raise DeviceError(f"{RPC_NODE} absent: not a Qualcomm device with FastRPC; set "
                              f"KEEL_FASTRPC=mock to run the DSP program under qemu-hexagon")
        self.shm = self.rpc = self.listener = None
        self.done: list = []  # (session fd, (error, reply)) in completion order
        self.pending: list = []  # (seq, flags) not yet invoked
        self.worker = None  # the current session's invoking thread
        self.cond = threading.Condition()
        self.shell = next((p for p in SHELLS if os.path.exists(p)), None)
        if self.shell is None:
            raise DeviceError(f"no DSP shell among {SHELLS}: cannot spawn a cDSP process")

    def alloc(self, nbytes: int) -> mmap.mmap:
        self.shm = Ion(nbytes)
        return self.shm.map

    def open(self, programs, weights: int, arena: int, slots: list[int], table: bytes,
             deadline: float) -> None:
        self.load = (bytes(programs), weights, arena, slots, table)
        self.skel = skel_so().read_bytes()
        self._bounded(self._session, deadline, "opening the cDSP session")

    def _bounded(self, fn, deadline: float, what: str) -> None:
        """Run fn on a worker; DeviceTimeout if it has not returned by the deadline."""
        box: list = []
        worker = threading.Thread(target=lambda: box.append(_catch(fn)), daemon=True,
                                  name="keel-fastrpc")
        worker.start()
        worker.join(max(deadline - time.monotonic(), 0))
        if worker.is_alive():
            why = self.listener.why() if self.listener else ""
            raise DeviceTimeout(f"FastRPC: {what} did not finish by its deadline{why}")
        if box[0] is not None:
            raise box[0]

    def _session(self) -> None:
        programs, weights, arena, slots, table = self.load
        self.rpc = rpc = os.open(RPC_NODE, os.O_RDONLY | os.O_CLOEXEC)
        _ioctl(rpc, GETINFO, ctypes.c_uint32(CDSP), "selecting the cDSP")
        self._spawn()
        self.listener = Listener(lambda *a: _call(rpc, *a), self._heap,
                                 {SKEL: self.skel, PROGRAMS: programs})
        self.listener.start()
        m = Mmap(fd=self.shm.fd, flags=0, vaddrin=self.shm.addr, size=self.shm.nbytes)
        _ioctl(rpc, MMAP, m, "mapping the shared buffer into the cDSP")
        self.handle = self._open_skel()
        head = struct.pack(f"<{5 + len(slots)}I", m.vaddrout, self.shm.nbytes, weights, arena,
                           len(slots), *slots)
        (status,) = self._checked(self.handle, scalars(LOAD, 3, 1),
                                  [head, PROGRAMS.encode() + b"\0", table], [4],
                                  f"loading the programs in {SKEL}")
        code = struct.unpack("<i", status)[0]
        if code:
            what = LOAD_ERRORS.get(code, f"status {code}")
            raise DeviceError(f"{SKEL} could not load the programs ({PROGRAMS}): "
                              f"{what}{self.listener.why()}")

    def _checked(self, handle: int, sc: int, ins, outs, what: str) -> list[bytes]:
        """An invoke during the load: a failure names what the listener could not serve."""
        try:
            out = _call(self.rpc, handle, sc, ins, outs, what)
        except DeviceError as e:
            raise DeviceError(f"{e}{self.listener.why()}") from None
        if self.listener.error:  # what the DSP did without the answer is unknown: stop here
            raise DeviceError(f"{what}: {self.listener.error}")
        return out

    def _heap(self, flags: int, size: int) -> int:
        """The PD asks for heap (apps_mem): memory the driver maps for the DSP alone."""
        m = Mmap(fd=-1, flags=flags, vaddrin=0, size=size)
        _ioctl(self.rpc, MMAP, m, f"mapping {size} bytes of heap for the cDSP process")
        return m.vaddrout

    def _spawn(self) -> None:
        """An unsigned user PD from the DSP shell. Where the firmware only runs signed code the
        kernel or the shell refuses it: say so, rather than an errno."""
        image = open(self.shell, "rb").read()
        buf = ctypes.create_string_buffer(image, len(image))
        init = InitAttrs(init=Init(flags=FASTRPC_INIT_CREATE, file=ctypes.addressof(buf),
                                   filelen=len(image), filefd=-1), attrs=UNSIGNED_PD)
        try:
            fcntl.ioctl(self.rpc, INIT_ATTRS, init)
        except OSError as e:
            raise refused_pd(self.shell, e.errno) from None

    def _open_skel(self) -> int:
        uri = f"file:///{SKEL}?keel_dsp_skel_handle_invoke&_modver=1.0&_dom=cdsp\0".encode()
        out, err = self._checked(0, scalars(0, 2, 2), [struct.pack("<2I", len(uri), 256), uri],
                                 [8, 256], f"opening {SKEL}")
        handle, code = struct.unpack("<2I", out)
        if code:
            msg = err.split(b"\0", 1)[0].decode(errors="replace") or "no message"
            raise DeviceError(f"the cDSP could not open {SKEL} (error {code:#x}): {msg}"
                              f"{self.listener.why()}")
        return handle

    def invoke(self, seq: int, request: bytes) -> None:
        """Queue invoke `seq` (its RUN request, dsp/graph_runner.h); the session's worker thread
        makes the calls one at a time, in order (the DSP-side runtime runs one graph at a
        time)."""
        with self.cond:
            self.pending.append((seq, request))
            self.cond.notify_all()
            if self.worker is None:
                self.worker = threading.Thread(target=self._serve, args=(self.rpc,),
                                               daemon=True, name="keel-fastrpc")
                self.worker.start()

    def _serve(self, rpc: int) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.pending or self.rpc != rpc)
                if self.rpc != rpc:
                    return  # the session was abandoned (recover, close)
                seq, request = self.pending.pop(0)
            result = _catch(lambda: self._run(rpc, seq, request), value=True)
            with self.cond:
                self.done.append((rpc, result))
                self.cond.notify_all()

    def _run(self, rpc: int, seq: int, request: bytes) -> tuple:
        reply = REPLY_HEAD + profile_bytes(request)
        (out,) = _call(rpc, self.handle, scalars(RUN, 1, 1), [request], [reply],
                       f"invoke {seq}")
        _, status, n, _ = struct.unpack_from("<4I", out)
        return seq, status, list(struct.unpack_from(f"<{n}Q", out, 16))

    def replies(self) -> list:
        with self.cond:
            done, self.done = self.done, []
        out = []
        for rpc, (err, reply) in done:
            if rpc != self.rpc:  # an abandoned session's late answer
                continue
            if err is not None:
                raise err
            out.append(reply)
        return out

    def block(self, seconds: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.done, seconds)

    def restart(self, deadline: float) -> None:
        self._drop()
        self._bounded(self._session, deadline, "reopening the cDSP session")

    def _drop(self) -> None:
        """Abandon the session: the PD is told to exit (which ends the listener's wait), within
        STOP_S, then its fd is closed; an invoke still blocked in it returns into a session
        nobody reads."""
        with self.cond:
            rpc, self.rpc, self.worker, self.pending = self.rpc, None, None, []
            self.cond.notify_all()
        if rpc is None:
            return
        if self.listener is not None:
            self.listener.stop()
            end = threading.Thread(target=_catch, daemon=True, name="keel-fastrpc-exit", args=(
                lambda: _call(rpc, CURRENT_PROCESS, EXIT, [], [], "ending the cDSP process"),))
            end.start()
            end.join(STOP_S)
            self.listener = None
        os.close(rpc)

    def close(self) -> None:
        self._drop()
        if self.shm is not None:
            self.shm.close()
            self.shm = None


def refused_pd(shell: str, code: int) -> DeviceError:
    return DeviceError(
        f"the cDSP refused an unsigned protection domain from {shell} ({os.strerror(code)}, "
        f"errno {code}): this device's DSP firmware runs signed code only; it needs a test "
        f"signature (testsig-<serial>.so in /dsp) or firmware that allows unsigned PDs")


def _catch(fn, value: bool = False):
    """fn's exception (None if it returned), or (exception, result) when `value`."""
    try:
        result = fn()
    except Exception as e:  # handed to the waiting caller, which raises it
        return (e, None) if value else e
    return (None, result) if value else None


def profile_bytes(request: bytes) -> int:
    """The bytes of ticks a RUN request {seq, flags, first, end, ...} is answered with."""
    _, flags, first, end = struct.unpack_from("<4I", request)
    return 16 * MAX_WORKERS * (end - first) if flags & FLAG_PROFILE and end > first else 0
