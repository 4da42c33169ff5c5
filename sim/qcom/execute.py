"""How the mock GPU executes a dispatch: the kernel's OpenCL C, run on the host over the very bytes
of the GPU objects the stream bound.

One choice, made per program from its header (qcom/program.py): a program that computes in half
runs on sim/qcom/hostcl.py's clang `_Float16` build, which rounds every operation to half as the
Adreno does (PoCL 3.1 has no cl_khr_fp16 and refuses such programs); every other program runs on
PoCL, with buffers created over the GPU objects' host memory (CL_MEM_USE_HOST_PTR: PoCL's CPU
device computes in place) and images copied from the pitched texels the descriptor names.

Programs are built in batches, before a submission executes: every program the submission loads
that is not built yet, grouped by preamble, becomes one library or one cl_program.

An argument is (ParamKind.BUFFER, host address, bytes to the end of its GPU object) or
(ParamKind.IMAGE, host address, Texture).
"""
from __future__ import annotations

import ctypes

import numpy as np

from sim.qcom import hostcl
from qcom.program import ParamKind, Program, split


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
            if kind is ParamKind.IMAGE:
                img = hostcl.Image(addr, what.width, what.height, what.pitch,
                                   what.dtype == np.float16, what.dtype == np.uint8)
                keep.append(img)
                addr = ctypes.addressof(img)
            ptrs.append(addr)
        self.fns[prog.source]((ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_int * 3)(*gs),
                              (ctypes.c_int * 3)(*ls))


class Pocl:
    """Float programs on PoCL (runner/cl.py's HostExecutor), by program source."""

    def __init__(self):
        from runner import cl  # only a mock that runs float programs needs libOpenCL
        self.ex = cl.HostExecutor("qcom mock GPU")
        self.kernels: dict[str, object] = {}

    def prepare(self, preamble: str, progs: list[Program]) -> None:
        program = self.ex.program(
            (preamble + "".join(split(p.source)[1][0][1] for p in progs)).encode())
        for p in progs:
            self.kernels[p.source] = self.ex.kernel(program, p.kernel)

    def _mem(self, kind: ParamKind, addr: int, what):
        if kind is ParamKind.BUFFER:
            return self.ex.buffer(addr, what)
        return self.ex.image(addr, what.width, what.height, what.pitch, what.dtype)

    def run(self, prog: Program, args: list, gs: list[int], ls: list[int]) -> None:
        mems = [self._mem(*arg) for arg in args]  # released when dropped, after finish
        self.ex.launch(self.kernels[prog.source], mems, gs, ls, prog.kernel)
        self.ex.finish()


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
