"""KGSL, the Adreno kernel driver's user interface (/dev/kgsl-3d0): ioctl numbers, argument structs
and a small handle that calls them.

The facts (struct layouts, ioctl numbers, flag bits) come from the public UAPI header
include/uapi/linux/msm_kgsl.h of Qualcomm's msm-4.9 kernel, which the comma 3X kernel
(commaai/agnos-kernel-sdm845) builds. tests/test_qcom_uapi.py checks every size, offset and number
below against that header compiled by clang; docs/qcom.md says how to re-check.

Every struct is spelled with fixed-width fields: the device is LP64 (arm64), where `unsigned long`,
`size_t` and pointers are 8 bytes, so the layouts hold on any 64-bit host that runs the mock.

`Kgsl` wraps one open device and a pluggable ioctl entry point: the kernel (`fcntl.ioctl`) or
`sim.qcom.mock_kgsl` when KEEL_KGSL=mock. Every failing ioctl raises DeviceError naming the ioctl,
the errno and what was asked.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import time
from ctypes import c_int32, c_uint32, c_uint64
from typing import NamedTuple

from runner.errors import DeviceError
from runner.simulators import simulator

DEVICE_PATH = "/dev/kgsl-3d0"
PAGE = 4096

# Adreno chip ids are core.major.minor.patch, one byte each. Only the Adreno 630 (6.3.0.x) has been
# validated; another chip may need other register programming, so it is refused, not guessed at.
VALIDATED_CHIPS = {0x06030000: "Adreno 630"}
CHIP_MASK = 0xFFFFFF00  # the patch byte (silicon stepping) does not change programming

# --- flag bits (msm_kgsl.h) ---
CONTEXT_NO_GMEM_ALLOC = 0x00000002
CONTEXT_PREAMBLE = 0x00000010
CONTEXT_PER_CONTEXT_TS = 0x00000040
CONTEXT_NO_FAULT_TOLERANCE = 0x00000200
CONTEXT_PRIORITY_SHIFT, CONTEXT_PRIORITY_MASK = 12, 0x0000F000
CONTEXT_TYPE_SHIFT, CONTEXT_TYPE_MASK = 20, 0x01F00000
CONTEXT_TYPE_CL = 2
CONTEXT_PREEMPT_STYLE_SHIFT, CONTEXT_PREEMPT_STYLE_MASK = 25, 0x0E000000
PREEMPT_RINGBUFFER, PREEMPT_FINEGRAIN = 1, 2
CONTEXT_INVALIDATE_ON_FAULT = 0x10000000

CMDLIST_IB = 0x00000001
MEMFLAGS_GPUREADONLY = 0x01000000
MEMFLAGS_USE_CPU_MAP = 0x10000000
MEMFLAGS_IOCOHERENT = 0x80000000
CACHEMODE_SHIFT, CACHEMODE_MASK = 26, 0x0C000000
CACHEMODE_WRITECOMBINE, CACHEMODE_UNCACHED, CACHEMODE_WRITETHROUGH, CACHEMODE_WRITEBACK = 0, 1, 2, 3
MEMTYPE_SHIFT, MEMTYPE_MASK = 8, 0x0000FF00
MEMTYPE_CL, MEMTYPE_COMMAND = 10, 16
MEMALIGN_SHIFT, MEMALIGN_MASK = 16, 0x00FF0000
USER_MEM_TYPE_ADDR = 2
USER_MEM_TYPE_DMABUF = 3  # also spelled USER_MEM_TYPE_ION: ION buffers are dma-bufs

PROP_DEVICE_INFO = 0x1
PROP_VERSION = 0x8
TIMESTAMP_CONSUMED, TIMESTAMP_RETIRED, TIMESTAMP_QUEUED = 1, 2, 3


# --- argument structs ---
class _Struct(ctypes.Structure):
    c_name = ""  # the header's struct name, for messages and the header-facts test

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n):#x}" for n, _ in self._fields_)
        return f"{self.c_name}({fields})"


def _struct(c_name: str, *fields) -> type:
    return type(c_name, (_Struct,), {"_fields_": list(fields), "c_name": c_name})


DevInfo = _struct("kgsl_devinfo", ("device_id", c_uint32), ("chip_id", c_uint32),
                  ("mmu_enabled", c_uint32), ("gmem_gpubaseaddr", c_uint64), ("gpu_id", c_uint32),
                  ("gmem_sizebytes", c_uint64))
Version = _struct("kgsl_version", ("drv_major", c_uint32), ("drv_minor", c_uint32),
                  ("dev_major", c_uint32), ("dev_minor", c_uint32))
GetProperty = _struct("kgsl_device_getproperty", ("type", c_uint32), ("value", c_uint64),
                      ("sizebytes", c_uint64))
WaitTimestamp = _struct("kgsl_device_waittimestamp_ctxtid", ("context_id", c_uint32),
                        ("timestamp", c_uint32), ("timeout", c_uint32))
ReadTimestamp = _struct("kgsl_cmdstream_readtimestamp_ctxtid", ("context_id", c_uint32),
                        ("type", c_uint32), ("timestamp", c_uint32))
DrawctxtCreate = _struct("kgsl_drawctxt_create", ("flags", c_uint32), ("drawctxt_id", c_uint32))
DrawctxtDestroy = _struct("kgsl_drawctxt_destroy", ("drawctxt_id", c_uint32))
MapUserMem = _struct("kgsl_map_user_mem", ("fd", c_int32), ("gpuaddr", c_uint64),
                     ("len", c_uint64), ("offset", c_uint64), ("hostptr", c_uint64),
                     ("memtype", c_uint32), ("flags", c_uint32))
GpuobjAlloc = _struct("kgsl_gpuobj_alloc", ("size", c_uint64), ("flags", c_uint64),
                      ("va_len", c_uint64), ("mmapsize", c_uint64), ("id", c_uint32),
                      ("metadata_len", c_uint32), ("metadata", c_uint64))
GpuobjFree = _struct("kgsl_gpuobj_free", ("flags", c_uint64), ("priv", c_uint64),
                     ("id", c_uint32), ("type", c_uint32), ("len", c_uint32))
GpuobjInfo = _struct("kgsl_gpuobj_info", ("gpuaddr", c_uint64), ("flags", c_uint64),
                     ("size", c_uint64), ("va_len", c_uint64), ("va_addr", c_uint64),
                     ("id", c_uint32))
GpuobjImport = _struct("kgsl_gpuobj_import", ("priv", c_uint64), ("priv_len", c_uint64),
                       ("flags", c_uint64), ("type", c_uint32), ("id", c_uint32))
ImportUseraddr = _struct("kgsl_gpuobj_import_useraddr", ("virtaddr", c_uint64))
ImportDmaBuf = _struct("kgsl_gpuobj_import_dma_buf", ("fd", c_int32))
CommandObject = _struct("kgsl_command_object", ("offset", c_uint64), ("gpuaddr", c_uint64),
                        ("size", c_uint64), ("flags", c_uint32), ("id", c_uint32))
CommandSyncpoint = _struct("kgsl_command_syncpoint", ("priv", c_uint64), ("size", c_uint64),
                           ("type", c_uint32))
GpuCommand = _struct("kgsl_gpu_command", ("flags", c_uint64), ("cmdlist", c_uint64),
                     ("cmdsize", c_uint32), ("numcmds", c_uint32), ("objlist", c_uint64),
                     ("objsize", c_uint32), ("numobjs", c_uint32), ("synclist", c_uint64),
                     ("syncsize", c_uint32), ("numsyncs", c_uint32), ("context_id", c_uint32),
                     ("timestamp", c_uint32))


# --- ioctl numbers: asm-generic/ioctl.h encoding, which arm64 and x86-64 share ---
IOC_TYPE = 0x09  # KGSL_IOC_TYPE
_WRITE, _READ = 1, 2  # _IOC_WRITE: user -> kernel; _IOC_READ: kernel -> user


class Ioctl(NamedTuple):
    name: str
    number: int
    struct: type


def ioc(direction: int, nr: int, size: int) -> int:
    return direction << 30 | size << 16 | IOC_TYPE << 8 | nr


def ioc_nr(number: int) -> int:
    return number & 0xFF


def ioc_size(number: int) -> int:
    return (number >> 16) & 0x3FFF


def _ioctl(name: str, direction: int, nr: int, struct: type) -> Ioctl:
    return Ioctl(name, ioc(direction, nr, ctypes.sizeof(struct)), struct)


GETPROPERTY = _ioctl("IOCTL_KGSL_DEVICE_GETPROPERTY", _READ | _WRITE, 0x02, GetProperty)
WAITTIMESTAMP_CTXTID = _ioctl("IOCTL_KGSL_DEVICE_WAITTIMESTAMP_CTXTID", _WRITE, 0x07, WaitTimestamp)
DRAWCTXT_CREATE = _ioctl("IOCTL_KGSL_DRAWCTXT_CREATE", _READ | _WRITE, 0x13, DrawctxtCreate)
DRAWCTXT_DESTROY = _ioctl("IOCTL_KGSL_DRAWCTXT_DESTROY", _WRITE, 0x14, DrawctxtDestroy)
MAP_USER_MEM = _ioctl("IOCTL_KGSL_MAP_USER_MEM", _READ | _WRITE, 0x15, MapUserMem)
READTIMESTAMP_CTXTID = _ioctl("IOCTL_KGSL_CMDSTREAM_READTIMESTAMP_CTXTID", _READ | _WRITE, 0x16,
                              ReadTimestamp)
GPUOBJ_ALLOC = _ioctl("IOCTL_KGSL_GPUOBJ_ALLOC", _READ | _WRITE, 0x45, GpuobjAlloc)
GPUOBJ_FREE = _ioctl("IOCTL_KGSL_GPUOBJ_FREE", _WRITE, 0x46, GpuobjFree)
GPUOBJ_INFO = _ioctl("IOCTL_KGSL_GPUOBJ_INFO", _READ | _WRITE, 0x47, GpuobjInfo)
GPUOBJ_IMPORT = _ioctl("IOCTL_KGSL_GPUOBJ_IMPORT", _READ | _WRITE, 0x48, GpuobjImport)
GPU_COMMAND = _ioctl("IOCTL_KGSL_GPU_COMMAND", _READ | _WRITE, 0x4A, GpuCommand)
IOCTLS = (GETPROPERTY, WAITTIMESTAMP_CTXTID, DRAWCTXT_CREATE, DRAWCTXT_DESTROY, MAP_USER_MEM,
          READTIMESTAMP_CTXTID, GPUOBJ_ALLOC, GPUOBJ_FREE, GPUOBJ_INFO, GPUOBJ_IMPORT, GPU_COMMAND)


def ts_reached(current: int, target: int) -> bool:
    """KGSL timestamps are u32 and wrap: `target` is reached when it is at most 2^31 behind."""
    return (current - target) & 0xFFFFFFFF < 0x80000000


class GpuObj(NamedTuple):
    id: int
    gpuaddr: int
    size: int
    mmapsize: int


class KernelDriver:
    """The real entry point: the device node, fcntl.ioctl and mmap."""
    compiler = "vendor"  # programs come from the vendor OpenCL compiler (qcom/program.py)

    def open(self, path: str) -> int:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def ioctl(self, fd: int, number: int, arg) -> None:
        fcntl.ioctl(fd, number, arg, True)

    def mmap(self, fd: int, length: int, offset: int) -> mmap.mmap:
        return mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                         offset=offset)

    def close(self, fd: int) -> None:
        os.close(fd)


def default_driver():
    """The kernel's driver, or the mock KGSL with KEEL_KGSL=mock (runner/simulators.py)."""
    mock = simulator("KEEL_KGSL")
    return mock() if mock else KernelDriver()


# errno.errorcode keeps the last alias defined; the kernel's headers say these
_ERRNAMES = {errno.EDEADLK: "EDEADLK", errno.EOPNOTSUPP: "EOPNOTSUPP", errno.EAGAIN: "EAGAIN"}


def _errname(code: int) -> str:
    return _ERRNAMES.get(code) or errno.errorcode.get(code, f"errno {code}")


class Kgsl:
    """One open KGSL device. Methods are the ioctls keel uses, each with its failure named."""

    def __init__(self, driver=None, path: str = DEVICE_PATH):
        self.driver = driver if driver is not None else default_driver()
        self.path = path
        try:
            self.fd = self.driver.open(path)
        except OSError as e:
            hint = "; no KGSL here: KEEL_KGSL=mock runs the simulator, Model.load(path, " \
                "device='opencl') the vendor OpenCL path" if e.errno == errno.ENOENT else ""
            raise DeviceError(f"open({path}) failed: {_errname(e.errno)} ({e.strerror}){hint}") \
                from e

    def call(self, ioctl: Ioctl, arg, asked: str):
        """Run one ioctl on `arg` (changed in place, as the kernel writes back) and return it."""
        try:
            self.driver.ioctl(self.fd, ioctl.number, arg)
        except OSError as e:
            err = DeviceError(f"{ioctl.name} failed with {_errname(e.errno)} ({e.strerror}) "
                              f"asking to {asked}")
            err.errno = e.errno
            raise err from e
        return arg

    def close(self) -> None:
        if self.fd is not None:
            self.driver.close(self.fd)
            self.fd = None

    # --- device ---
    def _property(self, kind: int, value: _Struct, asked: str):
        prop = GetProperty(type=kind, value=ctypes.addressof(value), sizebytes=ctypes.sizeof(value))
        self.call(GETPROPERTY, prop, asked)
        return value

    def devinfo(self) -> DevInfo:
        return self._property(PROP_DEVICE_INFO, DevInfo(), "read the device info")

    def version(self) -> Version:
        return self._property(PROP_VERSION, Version(), "read the driver version")

    def check_chip(self) -> DevInfo:
        """The device info, or DeviceError if this chip has not been validated."""
        info = self.devinfo()
        if info.chip_id & CHIP_MASK not in VALIDATED_CHIPS:
            known = ", ".join(f"{n} ({c:#010x})" for c, n in VALIDATED_CHIPS.items())
            raise DeviceError(f"{self.path}: chip id {info.chip_id:#010x} (gpu_id {info.gpu_id}) "
                              f"is not validated for keel's qcom backend; validated: {known}")
        return info

    # --- contexts ---
    @staticmethod
    def context_flags(priority: int = 8, preempt: int = PREEMPT_RINGBUFFER) -> int:
        """OpenCL-type context without GMEM (compute never bins), the kernel's preamble, no replay
        after a fault (keel recovers itself), and a priority: 0 is the highest, 15 the lowest, so
        modeld runs at one the UI can preempt."""
        if not 0 <= priority <= 15:
            raise ValueError(f"KGSL context priority must be 0..15, got {priority}")
        return (CONTEXT_NO_GMEM_ALLOC | CONTEXT_PREAMBLE | CONTEXT_NO_FAULT_TOLERANCE
                | CONTEXT_TYPE_CL << CONTEXT_TYPE_SHIFT | priority << CONTEXT_PRIORITY_SHIFT
                | preempt << CONTEXT_PREEMPT_STYLE_SHIFT)

    def context_create(self, priority: int = 8, preempt: int = PREEMPT_RINGBUFFER) -> int:
        flags = self.context_flags(priority, preempt)
        arg = self.call(DRAWCTXT_CREATE, DrawctxtCreate(flags=flags),
                        f"create a context with flags {flags:#010x}")
        return arg.drawctxt_id

    def context_destroy(self, ctx: int) -> None:
        self.call(DRAWCTXT_DESTROY, DrawctxtDestroy(drawctxt_id=ctx), f"destroy context {ctx}")

    # --- memory ---
    def alloc(self, size: int, flags: int = CACHEMODE_WRITECOMBINE << CACHEMODE_SHIFT) -> GpuObj:
        arg = self.call(GPUOBJ_ALLOC, GpuobjAlloc(size=size, flags=flags),
                        f"allocate {size} bytes with flags {flags:#x}")
        info = self.info(arg.id)
        return GpuObj(arg.id, info.gpuaddr, info.size, arg.mmapsize)

    def info(self, obj_id: int) -> GpuobjInfo:
        return self.call(GPUOBJ_INFO, GpuobjInfo(id=obj_id), f"describe GPU object {obj_id}")

    def free(self, obj_id: int) -> None:
        self.call(GPUOBJ_FREE, GpuobjFree(id=obj_id), f"free GPU object {obj_id}")

    def mmap(self, obj: GpuObj) -> mmap.mmap:
        """The CPU view of an object: KGSL selects it by id through the mmap offset (id pages)."""
        try:
            return self.driver.mmap(self.fd, obj.mmapsize, obj.id * PAGE)
        except OSError as e:
            raise DeviceError(f"mmap of GPU object {obj.id} ({obj.mmapsize} bytes) failed with "
                              f"{_errname(e.errno)} ({e.strerror})") from e

    def import_user(self, addr: int, size: int, flags: int = 0) -> GpuObj:
        """Map `size` bytes of this process at `addr` (both page-aligned) for the GPU, zero-copy."""
        ua = ImportUseraddr(virtaddr=addr)
        arg = GpuobjImport(priv=ctypes.addressof(ua), priv_len=size, flags=flags,
                           type=USER_MEM_TYPE_ADDR)
        self.call(GPUOBJ_IMPORT, arg, f"import {size} bytes of user memory at {addr:#x}")
        info = self.info(arg.id)
        return GpuObj(arg.id, info.gpuaddr, info.size, 0)

    def import_dmabuf(self, fd: int, flags: int = 0) -> GpuObj:
        """Map the whole dma-buf behind `fd` (an ION buffer: a camera frame) for the GPU,
        zero-copy. KGSL holds its own reference: the object outlives `fd` until free()."""
        buf = ImportDmaBuf(fd=fd)
        arg = GpuobjImport(priv=ctypes.addressof(buf), priv_len=ctypes.sizeof(buf), flags=flags,
                           type=USER_MEM_TYPE_DMABUF)
        self.call(GPUOBJ_IMPORT, arg, f"import the dma-buf of fd {fd}")
        info = self.info(arg.id)
        return GpuObj(arg.id, info.gpuaddr, info.size, 0)

    # --- submission and timestamps ---
    def submit(self, ctx: int, ibs: list[tuple[int, int]]) -> int:
        """Queue indirect buffers [(gpuaddr, bytes)] on context `ctx`; returns their timestamp."""
        cmds = (CommandObject * len(ibs))(*[CommandObject(gpuaddr=a, size=n, flags=CMDLIST_IB)
                                            for a, n in ibs])
        arg = GpuCommand(cmdlist=ctypes.addressof(cmds), cmdsize=ctypes.sizeof(CommandObject),
                         numcmds=len(ibs), context_id=ctx)
        sizes = ", ".join(f"{a:#x}+{n}" for a, n in ibs)
        return self.call(GPU_COMMAND, arg, f"submit IBs [{sizes}] on context {ctx}").timestamp

    def read_timestamp(self, ctx: int, kind: int = TIMESTAMP_RETIRED) -> int:
        arg = self.call(READTIMESTAMP_CTXTID, ReadTimestamp(context_id=ctx, type=kind),
                        f"read timestamp type {kind} of context {ctx}")
        return arg.timestamp

    def wait(self, ctx: int, timestamp: int, timeout_ms: int) -> bool:
        """Block up to timeout_ms for `timestamp` to retire; False when it did not in time."""
        if timeout_ms <= 0:  # KGSL reads a timeout of 0 as "wait forever"
            raise ValueError(f"KGSL wait timeout must be at least 1 ms, got {timeout_ms}")
        arg = WaitTimestamp(context_id=ctx, timestamp=timestamp, timeout=timeout_ms)
        try:
            self.driver.ioctl(self.fd, WAITTIMESTAMP_CTXTID.number, arg)
        except OSError as e:
            if e.errno == errno.ETIMEDOUT:
                return False
            raise DeviceError(f"{WAITTIMESTAMP_CTXTID.name} failed with {_errname(e.errno)} "
                              f"({e.strerror}) asking to wait {timeout_ms} ms for timestamp "
                              f"{timestamp} of context {ctx}") from e
        return True
