"""The OpenCL 1.2 API through the ICD loader (libOpenCL), called with cffi in ABI mode: the
declarations and constants keel uses, and checked calls. Failed calls are DeviceError naming the
call and its error code; a missing loader or platform is a BlobError naming what to install.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys

import cffi
import numpy as np

from runner import cache
from runner.errors import BlobError, DeviceError

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
cl_int clEnqueueMarkerWithWaitList(cl_command_queue, cl_uint, const cl_event *, cl_event *);
cl_int clFlush(cl_command_queue);
cl_int clFinish(cl_command_queue);
cl_int clGetEventInfo(cl_event, cl_uint, size_t, void *, size_t *);
cl_int clGetEventProfilingInfo(cl_event, cl_uint, size_t, void *, size_t *);
cl_int clReleaseEvent(cl_event);
cl_event clCreateUserEvent(cl_context, cl_int *);
cl_int clSetUserEventStatus(cl_event, cl_int);
cl_int clReleaseMemObject(cl_mem);
cl_int clGetMemObjectInfo(cl_mem, cl_uint, size_t, void *, size_t *);
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
CL_MEM_READ_WRITE, CL_MEM_READ_ONLY, CL_MEM_USE_HOST_PTR, CL_MEM_COPY_HOST_PTR = \
    1 << 0, 1 << 2, 1 << 3, 1 << 5
CL_BUFFER_CREATE_TYPE_REGION = 0x1220
CL_RGBA, CL_HALF_FLOAT, CL_FLOAT, CL_MEM_OBJECT_IMAGE2D = 0x10B5, 0x10DD, 0x10DE, 0x10F1
CL_PROGRAM_BINARY_SIZES, CL_PROGRAM_BINARIES, CL_PROGRAM_BUILD_LOG = 0x1165, 0x1166, 0x1183
CL_EVENT_COMMAND_EXECUTION_STATUS = 0x11D3
CL_QUEUE_PROFILING_ENABLE, CL_PROFILING_COMMAND_START, CL_PROFILING_COMMAND_END = \
    1 << 1, 0x1282, 0x1283
CL_MEM_SIZE, CL_MEM_CONTEXT = 0x1102, 0x1106
CL_R, CL_UNSIGNED_INT8 = 0x10B0, 0x10DA
# per element dtype: (channel order, channel type, channels): float RGBA texels or R8 uint
IMAGE_FORMATS = {np.dtype("float32"): (CL_RGBA, CL_FLOAT, 4),
                 np.dtype("float16"): (CL_RGBA, CL_HALF_FLOAT, 4),
                 np.dtype("uint8"): (CL_R, CL_UNSIGNED_INT8, 1)}
BUILD_OPTIONS = b""  # IEEE semantics: no fast-relaxed-math (ONNX NaN/inf behaviour must hold)

_lib = None


def lib():
    """The ICD loader, opened once per process."""
    global _lib
    if _lib is None:
        _pocl_cache()
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


def _pocl_cache() -> None:
    """With keel's caches off (runner/cache.py), PoCL's is off too: it then builds kernels in a
    private folder instead of ~/.cache/pocl. PoCL reads these when its platform starts."""
    if cache.root() is None and "POCL_CACHE_DIR" not in os.environ:
        os.environ["POCL_CACHE_DIR"] = str(cache.workdir("pocl"))
        os.environ.setdefault("POCL_KERNEL_CACHE", "0")


def check(err: int, what: str) -> None:
    if err != CL_SUCCESS:
        raise DeviceError(f"OpenCL {what} failed with error {err}")


def create(fn, what: str, *args):
    """Call a clCreate* function whose last argument is the error code."""
    err = ffi.new("cl_int *")
    obj = fn(*args, err)
    check(err[0], what)
    return obj


def platform_devices() -> list[tuple[object, object]]:
    """(platform, device) pairs, GPUs first."""
    cl = lib()
    n = ffi.new("cl_uint *")
    err = cl.clGetPlatformIDs(0, ffi.NULL, n)
    if err == CL_PLATFORM_NOT_FOUND_KHR or (err == CL_SUCCESS and n[0] == 0):
        return []
    check(err, "clGetPlatformIDs")
    platforms = ffi.new("cl_platform_id[]", n[0])
    check(cl.clGetPlatformIDs(n[0], platforms, ffi.NULL), "clGetPlatformIDs")
    found = {CL_DEVICE_TYPE_GPU: [], CL_DEVICE_TYPE_ALL: []}
    for p in platforms:
        for kind in found:
            err = cl.clGetDeviceIDs(p, kind, 0, ffi.NULL, n)
            if err == CL_DEVICE_NOT_FOUND or n[0] == 0:
                continue
            check(err, "clGetDeviceIDs")
            devs = ffi.new("cl_device_id[]", n[0])
            check(cl.clGetDeviceIDs(p, kind, n[0], devs, ffi.NULL), "clGetDeviceIDs")
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
    except (BlobError, DeviceError) as e:
        return str(e)


def info_str(fn, obj, param: int) -> str:
    size = ffi.new("size_t *")
    check(fn(obj, param, 0, ffi.NULL, size), "get info")
    buf = ffi.new("char[]", size[0])
    check(fn(obj, param, size[0], buf, ffi.NULL), "get info")
    return ffi.string(buf).decode(errors="replace")


def info_uint(fn, obj, param: int, ctype: str = "cl_uint") -> int:
    out = ffi.new(f"{ctype} *")
    check(fn(obj, param, ffi.sizeof(ctype), out, ffi.NULL), "get info")
    return int(out[0])


# ---- programs: shared by runner/opencl.py and the mocks' executor --------------------------------
def build(ctx, dev, source: bytes, where: str):
    """A program built from OpenCL C for one device; BlobError with the build log and the kernels
    it points at when the build fails. `where` names the device for the message."""
    cl = lib()
    text = ffi.new("char[]", source)  # alive until the call returns: char *[] does not own it
    program = ffi.gc(create(cl.clCreateProgramWithSource, "clCreateProgramWithSource", ctx, 1,
                            ffi.new("char *[]", [text]), ffi.new("size_t[]", [len(source)])),
                     cl.clReleaseProgram)
    devs = ffi.new("cl_device_id[]", [dev])
    err = cl.clBuildProgram(program, 1, devs, BUILD_OPTIONS, ffi.NULL, ffi.NULL)
    if err != CL_SUCCESS:
        def build_info(prog, param, size, value, size_out):
            return cl.clGetProgramBuildInfo(prog, dev, param, size, value, size_out)
        log = info_str(build_info, program, CL_PROGRAM_BUILD_LOG)
        kernels = kernels_at(source.decode(errors="replace"), log)
        raise BlobError(f"OpenCL build failed (error {err}) on {where} in kernel(s) "
                        f"{kernels or ['?']}:\n{log.strip()}")
    return program


def binary(program) -> bytes | None:
    """The device binary of a built single-device program (CL_PROGRAM_BINARIES), or None when
    the driver has none to give."""
    cl = lib()
    size = ffi.new("size_t[1]")
    if cl.clGetProgramInfo(program, CL_PROGRAM_BINARY_SIZES, ffi.sizeof("size_t"), size,
                           ffi.NULL) != CL_SUCCESS or size[0] == 0:
        return None
    data = ffi.new("unsigned char[]", size[0])
    ptrs = ffi.new("unsigned char *[]", [data])
    if cl.clGetProgramInfo(program, CL_PROGRAM_BINARIES, ffi.sizeof(ptrs), ptrs,
                           ffi.NULL) != CL_SUCCESS:
        return None
    return bytes(ffi.buffer(data, size[0]))


def kernels_at(source: str, log: str) -> list[str]:
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


class HostExecutor:
    """OpenCL C run over host memory, for the mock GPUs (qcom, am): one context and in-order
    queue on the first platform device (PoCL in CI), programs built once per source, buffers
    that are the host memory itself (CL_MEM_USE_HOST_PTR: PoCL's CPU device computes in place).
    `who` names the user in errors."""

    def __init__(self, who: str):
        pairs = platform_devices()
        if not pairs:
            raise DeviceError(f"{who}: no OpenCL device to execute kernels ({INSTALL_HINT})")
        self.who, self.lib, self.dev = who, lib(), pairs[0][1]
        devs = ffi.new("cl_device_id[]", [self.dev])
        self.ctx = ffi.gc(create(self.lib.clCreateContext, "clCreateContext", ffi.NULL, 1, devs,
                                 ffi.NULL, ffi.NULL), self.lib.clReleaseContext)
        self.queue = ffi.gc(create(self.lib.clCreateCommandQueue, "clCreateCommandQueue",
                                   self.ctx, self.dev, 0), self.lib.clReleaseCommandQueue)
        self.programs: dict[bytes, object] = {}  # by sha256 of the source

    def program(self, source: bytes):
        key = hashlib.sha256(source).digest()
        if key not in self.programs:
            self.programs[key] = build(self.ctx, self.dev, source, self.who)
        return self.programs[key]

    def kernel(self, program, name: str):
        return ffi.gc(create(self.lib.clCreateKernel, f"clCreateKernel({name})", program,
                             name.encode()), self.lib.clReleaseKernel)

    def buffer(self, host, nbytes: int):
        """A buffer that is `nbytes` of host memory at `host` (an address or a cffi buffer)."""
        ptr = ffi.cast("void *", host) if isinstance(host, int) else host
        return ffi.gc(create(self.lib.clCreateBuffer, "clCreateBuffer", self.ctx,
                             CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR, nbytes, ptr),
                      self.lib.clReleaseMemObject)

    def sub(self, mem, origin: int, size: int):
        region = ffi.new("cl_buffer_region *", {"origin": origin, "size": size})
        return ffi.gc(create(self.lib.clCreateSubBuffer, "clCreateSubBuffer", mem,
                             CL_MEM_READ_WRITE, CL_BUFFER_CREATE_TYPE_REGION, region),
                      self.lib.clReleaseMemObject)

    def image(self, host: int, width: int, height: int, pitch: int, dtype):
        """A read-only image (RGBA float, or R8 uint for uint8) copied from `pitch`-texel rows of
        host memory at `host`."""
        dtype = np.dtype(dtype)
        order, channel, n = IMAGE_FORMATS[dtype]
        fmt = ffi.new("cl_image_format *", (order, channel))
        desc = ffi.new("cl_image_desc *")
        desc.image_type, desc.image_width, desc.image_height = \
            CL_MEM_OBJECT_IMAGE2D, width, height
        desc.image_row_pitch = pitch * n * dtype.itemsize
        return ffi.gc(create(self.lib.clCreateImage, "clCreateImage", self.ctx,
                             CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, fmt, desc,
                             ffi.cast("void *", host)), self.lib.clReleaseMemObject)

    def launch(self, kernel, mems: list, glob, local, name: str) -> None:
        """Enqueue `kernel` over 3-D sizes with `mems` as its arguments, in order."""
        for i, mem in enumerate(mems):
            check(self.lib.clSetKernelArg(kernel, i, ffi.sizeof("cl_mem"),
                                          ffi.new("cl_mem *", mem)), f"clSetKernelArg {name}[{i}]")
        check(self.lib.clEnqueueNDRangeKernel(self.queue, kernel, 3, ffi.NULL,
                                              ffi.new("size_t[3]", list(glob)),
                                              ffi.new("size_t[3]", list(local)), 0, ffi.NULL,
                                              ffi.NULL), f"enqueue {name}")

    def finish(self) -> None:
        check(self.lib.clFinish(self.queue), "clFinish")
