"""Programs for the qcom device: one GPU binary per kernel, and what the recorder needs to know
about it (parameter kinds, instruction length, constant layout).

Where binaries come from depends on the driver behind Kgsl (`driver.compiler`):
- "mock" (sim/qcom/mock_kgsl.py): there is no Adreno ISA in CI. The mock's "binary"
  (sim/qcom/program.py) is, honestly, the kernel's OpenCL C behind a header with the facts a
  parse of a vendor binary yields; the mock GPU executes exactly that source.
- "vendor" (the kernel driver on a device): libOpenCL builds each kernel once (runner/cl.py),
  and qcom/vendor.py parses the binary it returns for the ISA, register footprint, branch
  stack, local memory, parameter kinds and constant layout. libOpenCL is used at load only, and
  only on a cache miss.

Constant layout: mock, parameter i sits in dwords 2i, 2i+1 of the kernel's constants (a 64-bit
GPU address for a buffer, the texture slot for an image); vendor, a buffer sits where the binary
says and an image takes the next texture slot, in parameter order (`offsets[i]` is None). The
block is padded to whole units of CONST_ALIGN vec4s (HLSQ_CS_CNTL counts constants in fours).

Where a device's programs are built, cached and embedded is qcom/store.py.
"""
from __future__ import annotations

import re
from enum import StrEnum
from typing import NamedTuple

from runner.errors import DeviceError

SHADER_UNIT = 128  # CP_LOAD_STATE6 loads shader code in 128-byte units
MAX_UNITS = 0x3FF  # its NUM_UNIT field is 10 bits
CONST_ALIGN = 4  # vec4s: HLSQ_CS_CNTL's CONSTLEN has shr=2 (a6xx.xml)
_KERNEL = re.compile(r"(?:__attribute__\(\(reqd_work_group_size\([^)]*\)\)\)\s*)?"
                     r"__kernel void (\w+)\(([^)]*)\)")


class ParamKind(StrEnum):
    """How a kernel parameter is bound: a buffer address in the constants, or a texture slot."""
    BUFFER = "buffer"
    IMAGE = "image"

    @staticmethod
    def of(decl: str) -> "ParamKind":
        """The kind of an OpenCL C parameter declaration ("read_only image2d_t x", ...)."""
        return ParamKind.IMAGE if "image2d_t" in decl else ParamKind.BUFFER


class Regs(NamedTuple):
    """What SP_CS_CTRL_REG0 / SP_CS_UNKNOWN_A9B1 / SP_CS_OBJ_FIRST_EXEC_OFFSET take from a
    binary. The mock's binaries say 0 everywhere: the mock GPU runs OpenCL C, not registers."""
    full: int = 0  # full-precision register footprint
    half: int = 0  # half-precision register footprint
    branch: int = 0  # branch stack depth
    first: int = 0  # byte offset of the first instruction in the ISA
    shared: int = 0  # bytes of local (shared) memory


class Program(NamedTuple):
    kernel: str
    binary: bytes  # what is uploaded to the shader object (padded to SHADER_UNIT)
    params: tuple[ParamKind, ...]
    half: bool  # computes in half (cl_khr_fp16)
    source: str  # the OpenCL C the mock executes; "" for vendor binaries
    offsets: tuple = ()  # per parameter: its first constant dword, or None (next texture slot)
    regs: Regs = Regs()
    imms: tuple = ()  # (dword, value): constants the compiler placed for the driver to load

    @property
    def units(self) -> int:
        return len(self.binary) // SHADER_UNIT

    @property
    def const_vec4s(self) -> int:
        ends = [o + 2 for o in self.offsets if o is not None] + [d + 1 for d, _ in self.imms]
        return -(-max(ends, default=0) // (4 * CONST_ALIGN)) * CONST_ALIGN


def split(source: str) -> tuple[str, list[tuple[str, str, list[str]]]]:
    """(preamble, [(kernel, its text, parameter declarations)]) of one program source."""
    found = list(_KERNEL.finditer(source))
    if not found:
        raise DeviceError("program source holds no __kernel function")
    ends = [m.start() for m in found[1:]] + [len(source)]
    return source[:found[0].start()], [
        (m.group(1), source[m.start():end], [p.strip() for p in m.group(2).split(",")])
        for m, end in zip(found, ends)]
