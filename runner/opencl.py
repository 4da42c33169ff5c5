"""OpenCL device: runs "opencl" (and "qcom") blobs on any OpenCL 1.2 platform through the ICD
loader (libOpenCL), called with cffi in ABI mode: no compiler, no pyopencl.

The programs section is one OpenCL C source holding every kernel. Its first line is
`// keel {"images": {buffer id: [width, height, pitch]}}`: the buffers kernels read as images.

Guarantees:
  * load() builds the program once per (device, driver, source) and caches the device binary in
    `cache_dir` (beside the blob; not on PoCL, which caches kernels itself); a stale or unreadable
    cache entry is rebuilt from source. A build failure raises BlobError with the build log and
    the kernel it points at. load() then runs the graph once, so drivers that compile kernels at
    their first enqueue (PoCL) do it inside load, not inside the first run's deadline.
  * every tensor is a sub-buffer of the arena or weights buffer (offsets are aligned by the
    compiler to the target's buffer_align); io slots are device buffers written/read per run.
  * submit() enqueues the whole graph on one in-order queue (input writes, kernels, output reads)
    and flushes; the fence polls the last command's event status, so wait() never blocks
    unbounded (runner.device.wait_until).
  * image buffers: with cl_khr_image2d_from_buffer the image aliases the buffer (zero copy, the
    Adreno path, hence the pitched rows); without it (PoCL) the image is its own allocation of
    `pitch` texels per row, filled by a buffer-to-image copy after the kernel that writes it
    (weights: once, at load).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import cffi
import numpy as np

from runner.device import Device, Fence
from runner.errors import BlobError

INSTALL_HINT = "apt-get install pocl-opencl-icd ocl-icd-libopencl1"
LIBRARIES = {"linux": ("libOpenCL.so.1", "libOpenCL.so", "/system/vendor/lib64/libOpenCL.so"),
             "darwin": ("/System/Library/Frameworks/OpenCL.framework/OpenCL",)}

ffi = cffi.FFI()
ffi.cdef("""
typedef int32_t cl_int; typedef uint32_t cl_uint; typedef uint64_t cl_ulong;
typedef cl_uint cl_bool; typedef cl_ulong cl_bitfield;
typedef struct _cl_platform_id *cl_platform_id; typedef struct _cl_device_id *cl_device_id;
typedef struct _cl_context *cl_context; typedef struct _cl_command_queue *cl_command_queue;
typedef struct _cl_mem *cl_mem; typedef struct _cl_program *cl_program;
typedef struct _cl_kernel *cl_kernel; typedef struct _cl_event *cl_event;
typedef struct { cl_uint image_channel_order; cl_uint image_channel_data_type; } cl_image_format;
typedef struct {
    cl_uint image_type; size_t image_width; size_t image_height; size_t image_depth;
    size_t image_array_size; size_t image_row_pitch; size_t image_slice_pitch;
    cl_uint num_mip_levels; cl_uint num_samples; cl_mem buffer;
} cl_image_desc;
typedef struct { size_t origin; size_t size; } cl_buffer_region;

cl_int clGetPlatformIDs(cl_uint, cl_platform_id *, cl_uint *);
cl_int clGetPlatformInfo(cl_platform_id, cl_uint, size_t, void *, size_t *);
cl_int clGetDeviceIDs(cl_platform_id, cl_bitfield, cl_uint, cl_device_id *, cl_uint *);
cl_int clGetDeviceInfo(cl_device_id, cl_uint, size_t, void *, size_t *);
cl_context clCreateContext(const intptr_t *, cl_uint, const cl_device_id *, void *, void *,
                           cl_int *);
cl_command_queue clCreateCommandQueue(cl_context, cl_device_id, cl_bitfield, cl_int *);
cl_mem clCreateBuffer(cl_context, cl_bitfield, size_t, void *, cl_int *);
cl_mem clCreateSubBuffer(cl_mem, cl_bitfield, cl_uint, const void *, cl_int *);
cl_mem clCreateImage(cl_context, cl_bitfield, const cl_image_format *, const cl_image_desc *,
                     void *, cl_int *);
cl_program clCreateProgramWithSource(cl_context, cl_uint, const char **, const size_t *,
                                     cl_int *);
cl_program clCreateProgramWithBinary(cl_context, cl_uint, const cl_device_id *, const size_t *,
                                     const unsigned char **, cl_int *, cl_int *);
cl_int clBuildProgram(cl_program, cl_uint, const cl_device_id *, const char *, void *, void *);
cl_int clGetProgramBuildInfo(cl_program, cl_device_id, cl_uint, size_t, void *, size_t *);
cl_int clGetProgramInfo(cl_program, cl_uint, size_t, void *, size_t *);
cl_kernel clCreateKernel(cl_program, const char *, cl_int *);
cl_int clSetKernelArg(cl_kernel, cl_uint, size_t, const void *);
cl_int clEnqueueNDRangeKernel(cl_command_queue, cl_kernel, cl_uint, const size_t *,
                              const size_t *, const size_t *, cl_uint, const cl_event *,
                              cl_event *);
cl_int clEnqueueWriteBuffer(cl_command_queue, cl_mem, cl_bool, size_t, size_t, const void *,
                            cl_uint, const cl_event *, cl_event *);
cl_int clEnqueueReadBuffer(cl_command_queue, cl_mem, cl_bool, size_t, size_t, void *, cl_uint,
                           const cl_event *, cl_event *);
cl_int clEnqueueCopyBufferToImage(cl_command_queue, cl_mem, cl_mem, size_t, const size_t *,
                                  const size_t *, cl_uint, const cl_event *, cl_event *);
cl_int clFlush(cl_command_queue);
cl_int clFinish(cl_command_queue);
cl_int clGetEventInfo(cl_event, cl_uint, size_t, void *, size_t *);
cl_int clReleaseEvent(cl_event);
cl_int clReleaseMemObject(cl_mem);
cl_int clReleaseKernel(cl_kernel);
cl_int clReleaseProgram(cl_program);
cl_int clReleaseCommandQueue(cl_command_queue);
cl_int clReleaseContext(cl_context);
""")

# the few constants used (cl.h)
CL_SUCCESS, CL_COMPLETE = 0, 0
CL_DEVICE_NOT_FOUND, CL_BUILD_PROGRAM_FAILURE, CL_PLATFORM_NOT_FOUND_KHR = -1, -11, -1001
CL_DEVICE_TYPE_GPU, CL_DEVICE_TYPE_ALL = 1 << 2, 0xFFFFFFFF
CL_PLATFORM_VERSION, CL_PLATFORM_NAME = 0x0901, 0x0902
CL_DEVICE_IMAGE_SUPPORT, CL_DEVICE_IMAGE2D_MAX_WIDTH, CL_DEVICE_IMAGE2D_MAX_HEIGHT = \
    0x1016, 0x1011, 0x1012
CL_DEVICE_MEM_BASE_ADDR_ALIGN, CL_DEVICE_NAME, CL_DEVICE_VERSION, CL_DRIVER_VERSION = \
    0x1019, 0x102B, 0x102F, 0x102D
CL_DEVICE_EXTENSIONS, CL_DEVICE_IMAGE_PITCH_ALIGNMENT = 0x1030, 0x104A
CL_DEVICE_IMAGE_BASE_ADDRESS_ALIGNMENT = 0x104B
CL_MEM_READ_WRITE, CL_MEM_READ_ONLY, CL_MEM_COPY_HOST_PTR = 1 << 0, 1 << 2, 1 << 5
CL_BUFFER_CREATE_TYPE_REGION = 0x1220
CL_RGBA, CL_HALF_FLOAT, CL_FLOAT, CL_MEM_OBJECT_IMAGE2D = 0x10B5, 0x10DD, 0x10DE, 0x10F1
CL_PROGRAM_BINARY_SIZES, CL_PROGRAM_BINARIES, CL_PROGRAM_BUILD_LOG = 0x1165, 0x1166, 0x1183
CL_EVENT_COMMAND_EXECUTION_STATUS = 0x11D3
CHANNEL_TYPES = {np.dtype("float32"): CL_FLOAT, np.dtype("float16"): CL_HALF_FLOAT}
BUILD_OPTIONS = b""  # IEEE semantics: no fast-relaxed-math (ONNX NaN/inf behaviour must hold)

_lib = None


def _library():
    global _lib
    if _lib is None:
        names = LIBRARIES.get(sys.platform, LIBRARIES["linux"])
        for name in names:
            try:
                _lib = ffi.dlopen(name)
                break
            except OSError:
                continue
        else:
            raise BlobError(f"no OpenCL ICD loader: could not load any of {list(names)}; "
                            f"install one and a platform ({INSTALL_HINT})")
    return _lib


def _check(err: int, what: str) -> None:
    if err != CL_SUCCESS:
        raise BlobError(f"OpenCL {what} failed with error {err}")


def _out(fn, what: str, *args):
    """Call a clCreate* function whose last argument is the error code."""
    err = ffi.new("cl_int *")
    obj = fn(*args, err)
    _check(err[0], what)
    return obj


def platform_devices() -> list[tuple[object, object]]:
    """(platform, device) pairs, GPUs first."""
    lib = _library()
    n = ffi.new("cl_uint *")
    err = lib.clGetPlatformIDs(0, ffi.NULL, n)
    if err == CL_PLATFORM_NOT_FOUND_KHR or (err == CL_SUCCESS and n[0] == 0):
        return []
    _check(err, "clGetPlatformIDs")
    platforms = ffi.new("cl_platform_id[]", n[0])
    _check(lib.clGetPlatformIDs(n[0], platforms, ffi.NULL), "clGetPlatformIDs")
    found = {CL_DEVICE_TYPE_GPU: [], CL_DEVICE_TYPE_ALL: []}
    for p in platforms:
        for kind in found:
            err = lib.clGetDeviceIDs(p, kind, 0, ffi.NULL, n)
            if err == CL_DEVICE_NOT_FOUND or n[0] == 0:
                continue
            _check(err, "clGetDeviceIDs")
            devs = ffi.new("cl_device_id[]", n[0])
            _check(lib.clGetDeviceIDs(p, kind, n[0], devs, ffi.NULL), "clGetDeviceIDs")
            found[kind] += [(p, d) for d in devs]
    seen, out = set(), []
    for pd in found[CL_DEVICE_TYPE_GPU] + found[CL_DEVICE_TYPE_ALL]:
        if pd[1] not in seen:
            seen.add(pd[1])
            out.append(pd)
    return out


def unavailable_reason() -> str | None:
    """Why no OpenCL device can be used here, or None when one can (for tests to skip on)."""
    try:
        return None if platform_devices() else f"no OpenCL platform/device ({INSTALL_HINT})"
    except BlobError as e:
        return str(e)


def _info_str(fn, obj, param: int) -> str:
    size = ffi.new("size_t *")
    _check(fn(obj, param, 0, ffi.NULL, size), "get info")
    buf = ffi.new("char[]", size[0])
    _check(fn(obj, param, size[0], buf, ffi.NULL), "get info")
    return ffi.string(buf).decode(errors="replace")


def _info_uint(fn, obj, param: int, ctype: str = "cl_uint") -> int:
    out = ffi.new(f"{ctype} *")
    _check(fn(obj, param, ffi.sizeof(ctype), out, ffi.NULL), "get info")
    return int(out[0])


class _EventFence(Fence):
    def __init__(self, event, keep: list):
        self.event, self.keep = event, keep  # host arrays the queued copies still use
        self.done = False

    def signalled(self) -> bool:
        if self.done:
            return True
        status = ffi.new("cl_int *")
        _check(_lib.clGetEventInfo(self.event, CL_EVENT_COMMAND_EXECUTION_STATUS,
                                   ffi.sizeof("cl_int"), status, ffi.NULL), "clGetEventInfo")
        if status[0] < 0:
            raise BlobError(f"OpenCL submission failed with execution status {status[0]}")
        if status[0] == CL_COMPLETE:
            self._release()
        return self.done

    def _release(self) -> None:
        if not self.done:
            self.done, self.keep = True, None
            _lib.clReleaseEvent(self.event)

    def __del__(self):
        if _lib is not None and not self.done:
            _lib.clReleaseEvent(self.event)


class _Done(Fence):
    def signalled(self) -> bool:
        return True


_DONE = _Done()


class OpenCLDevice(Device):
    name = "opencl"
    runs = ("opencl", "qcom")  # both render OpenCL C; qcom blobs use Adreno limits

    def __init__(self):
        lib = _library()
        pairs = platform_devices()
        if not pairs:
            raise BlobError(f"no OpenCL platform with a device found; install one "
                            f"({INSTALL_HINT})")
        self.platform, self.dev = pairs[0]
        self.lib = lib
        self.device_name = _info_str(lib.clGetDeviceInfo, self.dev, CL_DEVICE_NAME)
        self.driver = " ".join(_info_str(fn, obj, p) for fn, obj, p in (
            (lib.clGetPlatformInfo, self.platform, CL_PLATFORM_VERSION),
            (lib.clGetDeviceInfo, self.dev, CL_DEVICE_VERSION),
            (lib.clGetDeviceInfo, self.dev, CL_DRIVER_VERSION)))
        self.base_align = _info_uint(lib.clGetDeviceInfo, self.dev,
                                     CL_DEVICE_MEM_BASE_ADDR_ALIGN) // 8
        self.extensions = set(_info_str(lib.clGetDeviceInfo, self.dev,
                                        CL_DEVICE_EXTENSIONS).split())
        devs = ffi.new("cl_device_id[]", [self.dev])
        self.ctx = ffi.gc(_out(lib.clCreateContext, "clCreateContext", ffi.NULL, 1, devs,
                               ffi.NULL, ffi.NULL), lib.clReleaseContext)
        self.queue = ffi.gc(_out(lib.clCreateCommandQueue, "clCreateCommandQueue", self.ctx,
                                 self.dev, 0), lib.clReleaseCommandQueue)
        self.cache_dir = None
        self.inflight: list[_EventFence] = []
        # PoCL caches its compiled kernels itself (~/.cache/pocl), and asking it for a program
        # binary compiles every kernel a second time (for a generic work-group size), doubling
        # the first load; elsewhere (Adreno: seconds per build) the binary cache is the win.
        platform = _info_str(lib.clGetPlatformInfo, self.platform, CL_PLATFORM_NAME)
        self.cache_binaries = platform != "Portable Computing Language"

    # ---- Device interface -----------------------------------------------------------------------
    def check_target(self, target: str) -> None:
        if target not in self.runs:
            raise BlobError(f"device 'opencl' runs targets {list(self.runs)}, blob target is "
                            f"{target!r}")

    def alloc(self, arena_bytes: int) -> None:
        self.arena = self._buffer(CL_MEM_READ_WRITE, arena_bytes)
        self.arena_bytes = arena_bytes

    def upload(self, weights: memoryview) -> None:
        self.weights_bytes = len(weights)
        if len(weights) == 0:
            self.weights = self._buffer(CL_MEM_READ_ONLY, 0)
            return
        host = ffi.from_buffer("char[]", weights)
        self.weights = ffi.gc(_out(self.lib.clCreateBuffer, "clCreateBuffer (weights)",
                                   self.ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                                   len(weights), host), self.lib.clReleaseMemObject)

    def load(self, programs: memoryview, launches: list, buffers: dict) -> None:
        source = bytes(programs)
        images = _header(source)
        program, cache = self._program(source)
        self.mems = {b.id: self._tensor(b) for b in buffers.values()}
        self.io = sorted((b for b in buffers.values() if b.region in ("input", "output")),
                         key=lambda b: b.offset)
        self.images = {bid: self._image(buffers[bid], *layout) for bid, layout in images.items()}
        self.commands = []  # (kernel, global size, local size) or (image copy args)
        for bid, img in self.images.items():  # weights: filled once, here
            if img.copy is not None and buffers[bid].region == "weights":
                self._copy_to_image(img)
        _check(self.lib.clFinish(self.queue), "clFinish")
        for ln in launches:
            kernel = ffi.gc(_out(self.lib.clCreateKernel, f"clCreateKernel({ln.kernel})",
                                 program, ln.kernel.encode()), self.lib.clReleaseKernel)
            for i, bid in enumerate(ln.args):
                mem = self.images[bid].mem if i > 0 and bid in self.images else self.mems[bid]
                _check(self.lib.clSetKernelArg(kernel, i, ffi.sizeof("cl_mem"),
                                               ffi.new("cl_mem *", mem)),
                       f"clSetKernelArg({ln.kernel}, {i})")
            gs = ffi.new("size_t[]", list(ln.global_size))
            ls = ffi.NULL if ln.local_size is None else ffi.new("size_t[]", list(ln.local_size))
            self.commands.append((kernel, len(ln.global_size), gs, ls, ln.kernel))
            out = ln.args[0]
            if out in self.images and self.images[out].copy is not None:
                self.commands.append(self.images[out])
        # Run the graph once (on whatever the buffers hold): drivers that compile each kernel at
        # its first enqueue (PoCL) do it now, not inside the first run()'s deadline.
        self._enqueue_commands()
        _check(self.lib.clFinish(self.queue), "clFinish (warm-up run)")
        if cache is not None:
            self._save_binary(program, cache)

    def submit(self, io: list):
        lib, q = self.lib, self.queue
        for b, arr in zip(self.io, io):
            if b.region == "input" and b.nbytes:
                _check(lib.clEnqueueWriteBuffer(q, self.mems[b.id], 0, 0, b.nbytes,
                                                ffi.from_buffer(arr), 0, ffi.NULL, ffi.NULL),
                       f"write input {b.name!r}")
        self._enqueue_commands()
        # in-order queue: the last read completing means the whole submission has
        event = ffi.new("cl_event *")
        outputs = [(b, arr) for b, arr in zip(self.io, io) if b.region == "output" and b.nbytes]
        for j, (b, arr) in enumerate(outputs):
            last = j == len(outputs) - 1
            _check(lib.clEnqueueReadBuffer(q, self.mems[b.id], 0, 0, b.nbytes,
                                           ffi.from_buffer(arr), 0, ffi.NULL,
                                           event if last else ffi.NULL),
                   f"read output {b.name!r}")
        if not outputs:  # nothing to read back: finish here
            _check(lib.clFinish(q), "clFinish")
            return _DONE
        _check(lib.clFlush(q), "clFlush")
        fence = _EventFence(event[0], list(io))
        # the queue may still use the host arrays of a submission whose wait() timed out
        self.inflight = [f for f in self.inflight if not f.signalled()] + [fence]
        return fence

    def __del__(self):
        # in-flight commands write into host arrays and use the buffers released after this
        if getattr(self, "queue", None) is not None:
            self.lib.clFinish(self.queue)

    def _enqueue_commands(self) -> None:
        for cmd in self.commands:
            if isinstance(cmd, _Image):
                self._copy_to_image(cmd)
                continue
            kernel, dims, gs, ls, name = cmd
            _check(self.lib.clEnqueueNDRangeKernel(self.queue, kernel, dims, ffi.NULL, gs, ls, 0,
                                                   ffi.NULL, ffi.NULL), f"enqueue kernel {name}")

    # ---- memory -------------------------------------------------------------------------------
    def _buffer(self, flags: int, nbytes: int):
        return ffi.gc(_out(self.lib.clCreateBuffer, "clCreateBuffer", self.ctx, flags,
                           max(nbytes, 1), ffi.NULL), self.lib.clReleaseMemObject)

    def _tensor(self, b):
        if b.region in ("input", "output") or b.nbytes == 0:
            return self._buffer(CL_MEM_READ_WRITE, b.nbytes)
        parent = self.arena if b.region == "arena" else self.weights
        if b.offset % self.base_align:
            raise BlobError(f"buffer {b.id}: {b.region} offset {b.offset} is not a multiple of "
                            f"this device's {self.base_align}-byte base address alignment")
        region = ffi.new("cl_buffer_region *", (b.offset, b.nbytes))
        flags = CL_MEM_READ_WRITE if b.region == "arena" else CL_MEM_READ_ONLY
        return ffi.gc(_out(self.lib.clCreateSubBuffer, f"clCreateSubBuffer(buffer {b.id})",
                           parent, flags, CL_BUFFER_CREATE_TYPE_REGION, region),
                      self.lib.clReleaseMemObject)

    def _image(self, b, width: int, height: int, pitch: int) -> "_Image":
        if b.dtype not in CHANNEL_TYPES:
            raise BlobError(f"buffer {b.id}: images hold float16/float32, got {b.dtype}")
        texel = 4 * b.dtype.itemsize
        fmt = ffi.new("cl_image_format *", (CL_RGBA, CHANNEL_TYPES[b.dtype]))
        zero_copy = self._aliases(b, pitch * texel)
        desc = ffi.new("cl_image_desc *")
        desc.image_type, desc.image_height = CL_MEM_OBJECT_IMAGE2D, height
        if zero_copy:
            desc.image_width, desc.image_row_pitch, desc.buffer = width, pitch * texel, \
                self.mems[b.id]
        else:
            desc.image_width = pitch  # rows hold the padding too, so one copy moves them all
        limits = [_info_uint(self.lib.clGetDeviceInfo, self.dev, p, "size_t")
                  for p in (CL_DEVICE_IMAGE2D_MAX_WIDTH, CL_DEVICE_IMAGE2D_MAX_HEIGHT)]
        if desc.image_width > limits[0] or height > limits[1]:
            raise BlobError(f"buffer {b.id}: image {desc.image_width}x{height} exceeds this "
                            f"device's {limits[0]}x{limits[1]} limit")
        mem = ffi.gc(_out(self.lib.clCreateImage, f"clCreateImage(buffer {b.id})", self.ctx,
                          CL_MEM_READ_ONLY if b.region == "weights" else CL_MEM_READ_WRITE,
                          fmt, desc, ffi.NULL), self.lib.clReleaseMemObject)
        # copies read the parent buffer at the tensor's offset: PoCL 3.1 crashes copying from a
        # sub-buffer to an image
        parent = self.arena if b.region == "arena" else self.weights
        copy = None if zero_copy else (parent, b.offset, ffi.new("size_t[3]", [0, 0, 0]),
                                       ffi.new("size_t[3]", [pitch, height, 1]))
        return _Image(mem, copy)

    def _aliases(self, b, row_pitch: int) -> bool:
        """Can an image alias the buffer (cl_khr_image2d_from_buffer, pitch/base aligned)?"""
        if "cl_khr_image2d_from_buffer" not in self.extensions:
            return False
        get = self.lib.clGetDeviceInfo
        pitch_align = _info_uint(get, self.dev, CL_DEVICE_IMAGE_PITCH_ALIGNMENT)
        base_align = _info_uint(get, self.dev, CL_DEVICE_IMAGE_BASE_ADDRESS_ALIGNMENT)
        texel = 4 * b.dtype.itemsize
        # both limits are in pixels (texels)
        return (pitch_align == 0 or row_pitch % (pitch_align * texel) == 0) and \
            (base_align == 0 or b.offset % (base_align * texel) == 0)

    def _copy_to_image(self, img: "_Image") -> None:
        src, offset, origin, region = img.copy
        _check(self.lib.clEnqueueCopyBufferToImage(self.queue, src, img.mem, offset, origin, region,
                                                   0, ffi.NULL, ffi.NULL),
               "clEnqueueCopyBufferToImage")

    # ---- programs -----------------------------------------------------------------------------
    def _program(self, source: bytes):
        """(program, cache path to save its binary to, or None when it came from the cache)"""
        key = hashlib.sha256(b"\0".join([self.device_name.encode(), self.driver.encode(),
                                         BUILD_OPTIONS, source])).hexdigest()[:32]
        path = Path(self.cache_dir) / f"{key}.bin" if self.cache_dir and self.cache_binaries \
            else None
        if path is not None and path.exists():
            program = self._from_binary(path.read_bytes())
            if program is not None:
                return program, None
        return self._from_source(source), path  # saved after the warm-up run

    def _from_binary(self, binary: bytes):
        lib = self.lib
        devs = ffi.new("cl_device_id[]", [self.dev])
        size = ffi.new("size_t[]", [len(binary)])
        data = ffi.new("char[]", binary)
        ptrs = ffi.new("unsigned char *[]", [ffi.cast("unsigned char *", data)])
        status, err = ffi.new("cl_int *"), ffi.new("cl_int *")
        program = lib.clCreateProgramWithBinary(self.ctx, 1, devs, size, ptrs, status, err)
        if err[0] != CL_SUCCESS or status[0] != CL_SUCCESS:
            return None
        program = ffi.gc(program, lib.clReleaseProgram)
        if lib.clBuildProgram(program, 1, devs, BUILD_OPTIONS, ffi.NULL, ffi.NULL) != CL_SUCCESS:
            return None  # stale cache entry: rebuilt from source
        return program

    def _from_source(self, source: bytes):
        lib = self.lib
        text = ffi.new("char[]", source)
        ptrs = ffi.new("char *[]", [text])
        sizes = ffi.new("size_t[]", [len(source)])
        program = ffi.gc(_out(lib.clCreateProgramWithSource, "clCreateProgramWithSource",
                              self.ctx, 1, ptrs, sizes), lib.clReleaseProgram)
        devs = ffi.new("cl_device_id[]", [self.dev])
        err = lib.clBuildProgram(program, 1, devs, BUILD_OPTIONS, ffi.NULL, ffi.NULL)
        if err != CL_SUCCESS:
            def build_info(prog, param, size, value, size_out):
                return lib.clGetProgramBuildInfo(prog, self.dev, param, size, value, size_out)
            log = _info_str(build_info, program, CL_PROGRAM_BUILD_LOG)
            kernels = _kernels_at(source.decode(errors="replace"), log)
            raise BlobError(f"OpenCL build failed (error {err}) on {self.device_name!r} in "
                            f"kernel(s) {kernels or ['?']}:\n{log.strip()}")
        return program

    def _save_binary(self, program, path: Path) -> None:
        """Best effort: a read-only or full disk only costs a rebuild next time."""
        lib = self.lib
        size = ffi.new("size_t[1]")
        if lib.clGetProgramInfo(program, CL_PROGRAM_BINARY_SIZES, ffi.sizeof("size_t"), size,
                                ffi.NULL) != CL_SUCCESS or size[0] == 0:
            return
        data = ffi.new("unsigned char[]", size[0])
        ptrs = ffi.new("unsigned char *[]", [data])
        if lib.clGetProgramInfo(program, CL_PROGRAM_BINARIES, ffi.sizeof(ptrs), ptrs,
                                ffi.NULL) != CL_SUCCESS:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(ffi.buffer(data, size[0]))
            os.replace(tmp, path)
        except OSError:
            pass


class _Image:
    """An image param's memory object; `copy` is (buffer, offset, origin, region) when it does
    not alias its buffer and must be refreshed from it after every write."""

    def __init__(self, mem, copy):
        self.mem, self.copy = mem, copy


def _header(source: bytes) -> dict[int, tuple[int, int, int]]:
    first = source.split(b"\n", 1)[0]
    if not first.startswith(b"// keel "):
        raise BlobError("programs section: expected OpenCL C starting with a '// keel {...}' "
                        f"header line, got {first[:40]!r}")
    try:
        header = json.loads(first[len(b"// keel "):])
        return {int(k): tuple(map(int, v)) for k, v in header.get("images", {}).items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise BlobError(f"programs section: bad '// keel' header: {e}") from None


def _kernels_at(source: str, log: str) -> list[str]:
    """Kernel names whose source lines the build log's diagnostics point at."""
    starts = [(i + 1, m.group(1)) for i, line in enumerate(source.splitlines())
              for m in [re.search(r"__kernel void (\w+)\(", line)] if m]
    names = []
    lines = set()  # "file:LINE:COL: error: ..." (clang) or "error: file:LINE:COL: ..." (PoCL)
    for diag in log.splitlines():
        m = re.search(r":(\d+):\d+:", diag)
        if m and "error" in diag:
            lines.add(int(m.group(1)))
    for n in sorted(lines):
        owner = [name for start, name in starts if start <= n]
        if owner and owner[-1] not in names:
            names.append(owner[-1])
    return names
