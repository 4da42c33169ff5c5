"""A stand-in for the KGSL kernel driver behind the same entry point as the real one (open, ioctl,
mmap, close), selected with KEEL_KGSL=mock.

It receives each ioctl as the kernel does: a request number and the packed argument bytes, with
user pointers inside them that it follows into this process's memory. What it checks, and where
it is stricter than the kernel (which dispatches on the ioctl's nr alone and copies the smaller of
the two sizes):
- an nr KGSL does not have: ENOTTY; an nr it has with another size or direction: EINVAL;
  an argument buffer shorter than the request says: EFAULT;
- getproperty sizes, context ids, object ids, page alignment of imported memory: EINVAL, as the
  kernel does; a dma-buf import of a closed fd: EBADF, of an fd that is no dma-buf or of 0
  bytes: EINVAL (a memfd stands in for the dma-buf: the mock has no exporter);
- every submitted indirect buffer is decoded with qcom.cmdstream.decode (parity, opcodes,
  registers, payload lengths, every GPU address inside an allocation, IB2s followed): anything
  malformed is EINVAL with the decoder's message, naming the packet;
- timestamps: a submission gets the context's next timestamp; waiting for one never queued is
  EINVAL, for one queued but not retired in time ETIMEDOUT, on a faulted context EDEADLK.

GPU memory is memfd-backed, so mmap() returns a second mapping of the very bytes the "GPU" sees.
Execution: `on_submit(packets, memory)` runs each decoded submission; by default that is
sim/qcom/mock_gpu.py's Gpu, which executes every dispatch's OpenCL C (PoCL, or clang `_Float16` for
half programs) over this memory. An on_submit that raises marks the context faulted, as a GPU
page fault does: later waits and submissions on it give EDEADLK with the reason.

Fault injection, per submission of this driver (counted from 1 across contexts), from
KEEL_MOCK_FAULTS with runner/faults.py's syntax: hang@N never retires (the dispatches do not
run), fault@N faults the context, slow@N:MS retires MS milliseconds late. `hang` and `delay_s`
do the same for every submission.

Bring-up faults (KEEL_MOCK_BRINGUP, runner/faults.py's SITES): kgsl.open=ERRNO fails open(),
kgsl.chip=ID reports another chip, kgsl.context=ERRNO, kgsl.alloc=ERRNO and kgsl.import=ERRNO
(dma-buf imports) fail those ioctls.
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import stat
import time
from dataclasses import dataclass
from typing import Callable

from qcom import cmdstream, kgsl
from sim.qcom.mock_gpu import Gpu, GpuFault
from runner.faults import FaultKind, bringup, bringup_errno, from_env

GPU_BASE = 0x1_0000_0000  # where the mock's GPU virtual addresses start
FAULTS_VAR = "KEEL_MOCK_FAULTS"  # the runtime core's variable: one syntax for every mock


def _fail(code: int, why: str):
    raise OSError(code, f"{os.strerror(code)}: {why}")


def _injected(site: str, what: str) -> None:
    code = bringup_errno(site)
    if code is not None:
        _fail(code, f"{what} (KEEL_MOCK_BRINGUP {site})")


@dataclass
class Obj:
    gpuaddr: int
    size: int
    flags: int
    view: object  # the host bytes the "GPU" reads and writes
    fd: int = -1  # the memfd behind an allocation or a dma-buf import; -1 for user memory
    imported: bool = False  # user memory or a dma-buf: KGSL does not mmap it again


class Memory:
    """GPU objects by id, with lookups by GPU address."""

    def __init__(self):
        self.objs, self.ids, self.next_addr = {}, itertools.count(1), GPU_BASE

    def add(self, size: int, flags: int, view, fd: int = -1, imported: bool = False) -> int:
        align = max(kgsl.PAGE, 1 << ((flags & kgsl.MEMALIGN_MASK) >> kgsl.MEMALIGN_SHIFT))
        addr = -(-self.next_addr // align) * align
        self.next_addr = addr + size + kgsl.PAGE  # a guard page between objects
        obj_id = next(self.ids)
        self.objs[obj_id] = Obj(addr, size, flags, view, fd, imported or fd < 0)
        return obj_id

    def spans(self) -> list[tuple[int, int]]:
        return [(o.gpuaddr, o.size) for o in self.objs.values()]

    def view(self, gpuaddr: int, nbytes: int) -> memoryview:
        for o in self.objs.values():
            if o.gpuaddr <= gpuaddr and gpuaddr + nbytes <= o.gpuaddr + o.size:
                start = gpuaddr - o.gpuaddr
                return memoryview(o.view).cast("B")[start:start + nbytes]  # ctypes views are '<c' 
        raise GpuFault(f"GPU access {gpuaddr:#x}+{nbytes} outside every allocation")

    def words(self, gpuaddr: int, dwords: int) -> memoryview:
        return self.view(gpuaddr, dwords * 4).cast("I")


class Context:
    def __init__(self, flags: int):
        self.flags, self.queued, self.faulted = flags, 0, ""  # faulted: why, once it has
        self.retire_at: dict[int, float] = {}  # timestamp -> monotonic time it retires; inf: hung
        self.blocked: dict[int, tuple] = {}  # timestamp -> (packets left at a wait, late by s)

    def retired(self) -> int:
        now, ts = time.monotonic(), 0
        for t in sorted(self.retire_at):  # retirement is in order
            if self.retire_at[t] > now:
                break
            ts = t
        for t in [t for t in self.retire_at if t < ts]:
            del self.retire_at[t]  # keep the newest retired one: a later wait may name it
        return ts


class MockKgsl:
    compiler = "mock"  # programs are keel's mock binaries: OpenCL C + metadata (qcom/program.py)

    def __init__(self, chip_id: int = 0x06030001, gpu_id: int = 630,
                 on_submit: Callable | None = None):
        chip = bringup("kgsl.chip")
        self.chip_id, self.gpu_id = int(chip, 16) if chip else chip_id, gpu_id
        self.on_submit = Gpu() if on_submit is None else on_submit
        self.hang, self.delay_s = False, 0.0
        self.faults = from_env(FAULTS_VAR, (FaultKind.HANG, FaultKind.FAULT, FaultKind.SLOW))
        self.count = 0  # submissions so far
        self.mem, self.contexts, self.ctx_ids = Memory(), {}, itertools.count(1)
        self.fds, self.submissions = set(), []
        self.dmabuf_imports = 0  # dma-buf imports so far: what zero-copy binding must keep at one
        self.handlers = {i.number: getattr(self, "_" + i.name.removeprefix("IOCTL_KGSL_").lower())
                         for i in kgsl.IOCTLS}
        self.by_nr = {kgsl.ioc_nr(i.number): i for i in kgsl.IOCTLS}

    # --- the entry point ---
    def open(self, path: str) -> int:
        _injected("kgsl.open", path)
        fd = 1000 + len(self.fds)
        self.fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        self.fds.discard(fd)

    def ioctl(self, fd: int, number: int, arg) -> None:
        if fd not in self.fds:
            _fail(errno.EBADF, f"fd {fd} is not an open KGSL device")
        known = self.by_nr.get(kgsl.ioc_nr(number))
        if known is None or (number >> 8) & 0xFF != kgsl.IOC_TYPE:
            _fail(errno.ENOTTY, f"no KGSL ioctl {number:#010x}")
        if number != known.number:
            _fail(errno.EINVAL, f"{number:#010x} has the nr of {known.name} but not its size or "
                  f"direction: expected {known.number:#010x} ({ctypes.sizeof(known.struct)} bytes)")
        size = ctypes.sizeof(known.struct)
        if memoryview(arg).nbytes < size:
            _fail(errno.EFAULT, f"{known.name}: argument of {memoryview(arg).nbytes} bytes, "
                  f"the kernel copies {size}")
        raw = (ctypes.c_char * size).from_buffer(arg)
        s = known.struct.from_buffer_copy(raw)
        self.handlers[number](s)
        if number >> 30 & 2:  # _IOC_READ: the kernel copies the struct back
            ctypes.memmove(raw, ctypes.addressof(s), ctypes.sizeof(s))

    def mmap(self, fd: int, length: int, offset: int) -> mmap.mmap:
        o = self.mem.objs.get(offset // kgsl.PAGE)
        if fd not in self.fds or o is None or offset % kgsl.PAGE:
            raise OSError(errno.EINVAL, f"no GPU object for mmap offset {offset:#x}")
        if o.imported:
            raise OSError(errno.EBUSY, "imported memory cannot be mapped again through KGSL")
        if length != o.size:
            raise OSError(errno.EINVAL, f"mmap of {length} bytes, object has {o.size}")
        return mmap.mmap(o.fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    # --- device ---
    def _device_getproperty(self, a) -> None:
        props = {kgsl.PROP_DEVICE_INFO: kgsl.DevInfo(chip_id=self.chip_id, gpu_id=self.gpu_id,
                                                     mmu_enabled=1),
                 kgsl.PROP_VERSION: kgsl.Version(drv_major=3, drv_minor=14, dev_major=3,
                                                 dev_minor=1)}
        value = props.get(a.type)
        if value is None or a.sizebytes != ctypes.sizeof(value):
            _fail(errno.EINVAL, f"property {a.type} with {a.sizebytes} bytes")
        if not a.value:
            _fail(errno.EFAULT, f"property {a.type} to a null pointer")
        ctypes.memmove(a.value, ctypes.addressof(value), ctypes.sizeof(value))

    # --- contexts ---
    def _context(self, ctx_id: int) -> Context:
        if ctx_id not in self.contexts:
            _fail(errno.EINVAL, f"no context {ctx_id}")
        return self.contexts[ctx_id]

    def _drawctxt_create(self, a) -> None:
        _injected("kgsl.context", "context creation")
        kind = (a.flags & kgsl.CONTEXT_TYPE_MASK) >> kgsl.CONTEXT_TYPE_SHIFT
        if kind not in (0, kgsl.CONTEXT_TYPE_CL):
            _fail(errno.EINVAL, f"context type {kind}: the mock runs compute (CL) contexts")
        a.drawctxt_id = next(self.ctx_ids)
        self.contexts[a.drawctxt_id] = Context(a.flags)

    def _drawctxt_destroy(self, a) -> None:
        self._context(a.drawctxt_id)
        del self.contexts[a.drawctxt_id]

    # --- memory ---
    def _gpuobj_alloc(self, a) -> None:
        _injected("kgsl.alloc", f"allocation of {a.size} bytes")
        if a.size == 0:
            _fail(errno.EINVAL, "allocation of 0 bytes")
        size = -(-a.size // kgsl.PAGE) * kgsl.PAGE
        fd = os.memfd_create("keel-mock-kgsl", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        view = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        a.id = self.mem.add(size, a.flags, view, fd)
        a.mmapsize, a.va_len = size, size

    def _obj(self, obj_id: int) -> Obj:
        if obj_id not in self.mem.objs:
            _fail(errno.EINVAL, f"no GPU object {obj_id}")
        return self.mem.objs[obj_id]

    def _gpuobj_free(self, a) -> None:
        o = self._obj(a.id)
        if a.flags:
            _fail(errno.EINVAL, f"free flags {a.flags:#x}: the mock frees immediately only")
        if o.fd >= 0:
            os.close(o.fd)
        del self.mem.objs[a.id]

    def _gpuobj_info(self, a) -> None:
        o = self._obj(a.id)
        a.gpuaddr, a.flags, a.size, a.va_len = o.gpuaddr, o.flags, o.size, o.size

    def _import(self, addr: int, size: int, flags: int) -> int:
        if not addr or addr % kgsl.PAGE or not size or size % kgsl.PAGE:
            _fail(errno.EINVAL, f"user memory {addr:#x}+{size} must be page-aligned and non-empty")
        return self.mem.add(size, flags, (ctypes.c_char * size).from_address(addr))

    def _gpuobj_import(self, a) -> None:
        if a.type not in (kgsl.USER_MEM_TYPE_ADDR, kgsl.USER_MEM_TYPE_DMABUF):
            _fail(errno.EOPNOTSUPP, f"import type {a.type}: KGSL imports user addresses "
                  f"({kgsl.USER_MEM_TYPE_ADDR}) and dma-bufs ({kgsl.USER_MEM_TYPE_DMABUF})")
        if not a.priv:
            _fail(errno.EINVAL, "import with a null priv pointer")
        if a.type == kgsl.USER_MEM_TYPE_DMABUF:
            self._import_dmabuf(a)
            return
        ua = kgsl.ImportUseraddr.from_address(a.priv)
        a.id = self._import(ua.virtaddr, a.priv_len, a.flags)  # priv_len is the mapping's size

    def _import_dmabuf(self, a) -> None:
        """As kgsl.c's _gpuobj_map_dma_buf: an empty priv_len copies nothing (EINVAL), a
        negative fd is EINVAL, dma_buf_get() of a closed fd EBADF and of a file that is no
        dma-buf EINVAL, a buffer of 0 bytes EINVAL. A memfd (any mmap-able regular file of whole
        pages) stands in for the dma-buf; its pages become the object's, shared, not copied."""
        _injected("kgsl.import", "dma-buf import")
        if a.priv_len == 0:
            _fail(errno.EINVAL, "dma-buf import with priv_len 0: nothing to copy")
        fd = kgsl.ImportDmaBuf.from_address(a.priv).fd
        if fd < 0:
            _fail(errno.EINVAL, f"dma-buf fd {fd}")
        try:
            st = os.fstat(fd)
        except OSError:
            _fail(errno.EBADF, f"fd {fd} is not open")
        if not stat.S_ISREG(st.st_mode):
            _fail(errno.EINVAL, f"fd {fd} is not a dma-buf (nor a memfd standing in for one)")
        if st.st_size == 0 or st.st_size % kgsl.PAGE:
            _fail(errno.EINVAL, f"dma-buf of {st.st_size} bytes: expected whole pages, at least "
                  f"one")
        own = os.dup(fd)  # the kernel keeps its own reference to the buffer, as this does
        view = mmap.mmap(own, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        a.id = self.mem.add(st.st_size, a.flags, view, own, imported=True)
        self.dmabuf_imports += 1

    def _map_user_mem(self, a) -> None:
        if a.memtype != kgsl.USER_MEM_TYPE_ADDR or a.offset:
            _fail(errno.EINVAL, f"memtype {a.memtype} offset {a.offset}: the mock maps user "
                  f"addresses at offset 0 only")
        a.gpuaddr = self._obj(self._import(a.hostptr, a.len, a.flags)).gpuaddr

    # --- submission and timestamps ---
    def _gpu_command(self, a) -> None:
        ctx = self._context(a.context_id)
        if ctx.faulted:
            _fail(errno.EDEADLK, f"context {a.context_id} faulted ({ctx.faulted}) and must be "
                  f"recreated")
        if a.cmdsize != ctypes.sizeof(kgsl.CommandObject) or not 1 <= a.numcmds <= 256:
            _fail(errno.EINVAL, f"cmdsize {a.cmdsize} numcmds {a.numcmds}: expected cmdsize "
                  f"{ctypes.sizeof(kgsl.CommandObject)} and 1..256 commands")
        if a.numsyncs or a.numobjs:
            _fail(errno.EINVAL, "sync points and object lists are not used by keel")
        cmds = (kgsl.CommandObject * a.numcmds).from_address(a.cmdlist)
        packets = [p for i, c in enumerate(cmds) for p in self._decode_ib(i, c)]
        ctx.queued += 1
        self.count += 1
        self.submissions.append((a.context_id, ctx.queued, packets))
        fault = self.faults.at(self.count)
        kind, delay = fault and fault.kind, fault.ms / 1000 if fault else 0.0
        rest = None
        try:
            if kind == "fault":
                raise GpuFault(f"injected page fault ({FAULTS_VAR} fault@{self.count})")
            if kind != "hang" and not self.hang and self.on_submit is not None:
                rest = self.on_submit(packets, self.mem)
        except Exception as e:  # noqa: BLE001 - whatever the GPU trips on loses the context
            ctx.faulted = f"{type(e).__name__}: {e}"
        if rest:
            ctx.blocked[ctx.queued] = (rest, self.delay_s + delay)
        hung = self.hang or kind == "hang" or bool(rest)
        ctx.retire_at[ctx.queued] = float("inf") if hung else \
            time.monotonic() + self.delay_s + delay
        a.timestamp = ctx.queued

    def _decode_ib(self, i: int, c) -> list:
        if c.flags != kgsl.CMDLIST_IB or c.size == 0 or c.size % 4:
            _fail(errno.EINVAL, f"command {i}: flags {c.flags:#x} size {c.size}: expected an IB "
                  f"(flags {kgsl.CMDLIST_IB}) of whole dwords")
        try:
            words = self.mem.words(c.gpuaddr, c.size // 4)
            return cmdstream.decode(words, self.mem.spans(), self.mem.words)
        except (cmdstream.StreamError, GpuFault) as e:
            _fail(errno.EINVAL, f"IB {i} at {c.gpuaddr:#x}: {e}")

    def _resume(self, ctx: Context) -> None:
        """Run blocked submissions on from their wait, in order, as far as the memory allows."""
        for ts in sorted(ctx.blocked):
            packets, late = ctx.blocked.pop(ts)
            try:
                rest = self.on_submit(packets, self.mem)
            except Exception as e:  # noqa: BLE001 - as in _gpu_command
                ctx.faulted, rest = f"{type(e).__name__}: {e}", None
            if rest:
                ctx.blocked[ts] = (rest, late)
                return
            ctx.retire_at[ts] = time.monotonic() + late

    def _cmdstream_readtimestamp_ctxtid(self, a) -> None:
        ctx = self._context(a.context_id)
        self._resume(ctx)
        kinds = {kgsl.TIMESTAMP_CONSUMED: ctx.retired, kgsl.TIMESTAMP_RETIRED: ctx.retired,
                 kgsl.TIMESTAMP_QUEUED: lambda: ctx.queued}
        if a.type not in kinds:
            _fail(errno.EINVAL, f"timestamp type {a.type}")
        a.timestamp = kinds[a.type]()

    def _device_waittimestamp_ctxtid(self, a) -> None:
        ctx = self._context(a.context_id)
        self._resume(ctx)
        if ctx.faulted:
            _fail(errno.EDEADLK, f"context {a.context_id} faulted: {ctx.faulted}")
        if not kgsl.ts_reached(ctx.queued, a.timestamp):
            _fail(errno.EINVAL, f"timestamp {a.timestamp} was never queued (last {ctx.queued})")
        timeout = a.timeout / 1000 if a.timeout else float("inf")  # 0 waits forever, as in KGSL
        until = min(ctx.retire_at.get(a.timestamp, 0), time.monotonic() + timeout)
        if not kgsl.ts_reached(ctx.retired(), a.timestamp):
            if until == float("inf"):
                _fail(errno.EDEADLK, "wait forever on a hung mock GPU would never return")
            time.sleep(max(0.0, until - time.monotonic()))
        if not kgsl.ts_reached(ctx.retired(), a.timestamp):
            _fail(errno.ETIMEDOUT, f"timestamp {a.timestamp} not retired in {a.timeout} ms")
