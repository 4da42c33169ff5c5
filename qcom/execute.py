"""How the mock GPU executes a dispatch: the kernel's OpenCL C, run on the host over the very bytes
of the GPU objects the stream bound.

One choice, made per program from its header (qcom/program.py): a program that computes in half
runs on qcom/hostcl.py's clang `_Float16` build, which rounds every operation to half as the
Adreno does (PoCL 3.1 has no cl_khr_fp16 and refuses such programs); every other program runs on
PoCL, with buffers created over the GPU objects' host memory (CL_MEM_USE_HOST_PTR: PoCL's CPU
device computes in place) and images copied from the pitched texels the descriptor names.

Programs are built in batches, before a submission executes: every program the submission loads
that is not built yet, grouped by preamble, becomes one library or one cl_program.

An argument is ("buffer", host address, bytes to the end of its GPU object) or ("image", host
address, Texture).
"""
from __future__ import annotations

import ctypes

import numpy as np

from qcom import hostcl
from qcom.program import Program, split

CL_MEM_USE_HOST_PTR = 1 << 3


class HostHalf:
    """Half programs: clang `_Float16` libraries, by program source."""

    def __init__(self):
        self.fns: dict[str, object] = {}

    def prepare(self, preamble: str, progs: list[Program]) -> None:
        lib = hostcl.build(preamble + "".join(split(p.source)[1][0][1] for p in progs))
        for p in progs:
            self.fns[p.source] = getattr(lib, f"run_{p.kernel}")

    def run(self, prog: Program, args: list, gs: list[int], ls: list[int]) -> None:
        keep, ptrs = [], []
        for kind, addr, what in args:
            if kind == "image":
                img = hostcl.Image(addr, what.width, what.height, what.pitch,
                                   what.dtype == np.float16)
                keep.append(img)
                addr = ctypes.addressof(img)
            ptrs.append(addr)
        self.fns[prog.source]((ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_int * 3)(*gs),
                              (ctypes.c_int * 3)(*ls))


class Pocl:
    """Float programs on PoCL, by program source."""

    def __init__(self):
        from runner import cl  # only a mock that runs float programs needs libOpenCL
        self.cl, self.ffi, self.lib = cl, cl.ffi, cl.lib()
        platform, self.dev = cl.platform_devices()[0]
        devs = self.ffi.new("cl_device_id[]", [self.dev])
        self.ctx = self.ffi.gc(cl.create(self.lib.clCreateContext, "clCreateContext", self.ffi.NULL,
                                         1, devs, self.ffi.NULL, self.ffi.NULL),
                               self.lib.clReleaseContext)
        self.queue = self.ffi.gc(cl.create(self.lib.clCreateCommandQueue, "clCreateCommandQueue",
                                           self.ctx, self.dev, 0), self.lib.clReleaseCommandQueue)
        self.kernels: dict[str, object] = {}

    def prepare(self, preamble: str, progs: list[Program]) -> None:
        cl, ffi, lib = self.cl, self.ffi, self.lib
        src = (preamble + "".join(split(p.source)[1][0][1] for p in progs)).encode()
        text = ffi.new("char[]", src)  # alive until the call returns: char *[] does not own it
        program = ffi.gc(cl.create(lib.clCreateProgramWithSource, "clCreateProgramWithSource",
                                   self.ctx, 1, ffi.new("char *[]", [text]),
                                   ffi.new("size_t[]", [len(src)])), lib.clReleaseProgram)
        cl.check(lib.clBuildProgram(program, 1, ffi.new("cl_device_id[]", [self.dev]),
                                    cl.BUILD_OPTIONS, ffi.NULL, ffi.NULL),
                 f"clBuildProgram (mock GPU, kernels {[p.kernel for p in progs]})")
        for p in progs:
            self.kernels[p.source] = ffi.gc(cl.create(lib.clCreateKernel, "clCreateKernel",
                                                      program, p.kernel.encode()),
                                            lib.clReleaseKernel)

    def _mem(self, kind: str, addr: int, what):
        cl, ffi, lib = self.cl, self.ffi, self.lib
        host = ffi.cast("void *", addr)
        if kind == "buffer":
            return cl.create(lib.clCreateBuffer, "clCreateBuffer", self.ctx,
                             cl.CL_MEM_READ_WRITE | CL_MEM_USE_HOST_PTR, what, host)
        fmt = ffi.new("cl_image_format *", (cl.CL_RGBA, cl.CHANNEL_TYPES[np.dtype(what.dtype)]))
        desc = ffi.new("cl_image_desc *")
        desc.image_type, desc.image_width, desc.image_height = \
            cl.CL_MEM_OBJECT_IMAGE2D, what.width, what.height
        desc.image_row_pitch = what.pitch * 4 * np.dtype(what.dtype).itemsize
        return cl.create(lib.clCreateImage, "clCreateImage", self.ctx,
                         cl.CL_MEM_READ_ONLY | cl.CL_MEM_COPY_HOST_PTR, fmt, desc, host)

    def run(self, prog: Program, args: list, gs: list[int], ls: list[int]) -> None:
        cl, ffi, lib = self.cl, self.ffi, self.lib
        kernel, mems = self.kernels[prog.source], []
        try:
            for i, arg in enumerate(args):
                mems.append(self._mem(*arg))
                cl.check(lib.clSetKernelArg(kernel, i, ffi.sizeof("cl_mem"),
                                            ffi.new("cl_mem *", mems[-1])), f"clSetKernelArg({i})")
            cl.check(lib.clEnqueueNDRangeKernel(self.queue, kernel, 3, ffi.NULL,
                                                ffi.new("size_t[]", gs), ffi.new("size_t[]", ls),
                                                0, ffi.NULL, ffi.NULL), f"enqueue {prog.kernel}")
            cl.check(lib.clFinish(self.queue), "clFinish")
        finally:
            for m in mems:
                lib.clReleaseMemObject(m)


class Executor:
    """Both executors behind one `prepare` (batch build) and `run` (one dispatch)."""

    def __init__(self):
        self._half, self._pocl = None, None

    def _for(self, prog: Program):
        if prog.half:
            self._half = self._half or HostHalf()
            return self._half
        self._pocl = self._pocl or Pocl()
        return self._pocl

    def _built(self, prog: Program) -> bool:
        ex = self._half if prog.half else self._pocl
        return ex is not None and prog.source in (ex.fns if prog.half else ex.kernels)

    def prepare(self, progs) -> None:
        groups: dict[tuple, list[Program]] = {}
        for p in {p.source: p for p in progs if not self._built(p)}.values():
            groups.setdefault((p.half, split(p.source)[0]), []).append(p)
        for (half, preamble), members in groups.items():
            self._for(members[0]).prepare(preamble, members)

    def run(self, prog: Program, args: list, gs: list[int], ls: list[int]) -> None:
        self._for(prog).run(prog, args, gs, ls)
