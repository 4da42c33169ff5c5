"""Adreno 6xx programs from the vendor OpenCL compiler: build each kernel once through libOpenCL
(runner/cl.py) and parse the binary it returns (CL_PROGRAM_BINARIES) into a qcom Program.

The binary layout is not documented by Qualcomm. The offsets below are facts read from tinygrad's
QCOM backend (`tinygrad/runtime/ops_qcom.py`, `_parse_lib`, tinygrad@00517ee5), which runs on the
comma 3X; they are all little-endian u32:

  0x34            offset R of the register descriptor: R+0x14 full, R+0x18 half register footprint
  0xac, 0xb0      offset of the immediate-constant records, and whether there are any; a record
                  is 40 bytes: value at +0, dword offset at +16, 32-bit flag at +24 (else 16-bit)
  0xc0, 0x100     offset and size of the ISA (what SP_CS_OBJ_START points at)
  0x110           offset D of the shader descriptor:
                    D+0xc4 first instruction offset, D+0xc8 private memory bytes,
                    D+0xd8 local memory bytes, D+0xdc samplers (0 or 1),
                    D+0x108 branch stack * 2, D+0x158 the kernel's name (NUL-terminated)
  after the name  (4-aligned, then 8 bytes per sampler) parameter records of 8 u32: record
                  length (0 ends the list), 3: constant offset in dwords, 7: kind
                  (0 buffer, 1 texture, 2 image written by the kernel)

Every read is bounds-checked: a truncated or garbled binary is a DeviceError naming the field.
What the parse cannot check by itself (the meaning of these fields to the GPU) only hardware
proves: tests/device/test_qcom.py.
"""
from __future__ import annotations

import struct

from qcom.program import MAX_UNITS, SHADER_UNIT, ParamKind, Program, Regs, split
from runner.errors import DeviceError

KINDS = {0: ParamKind.BUFFER, 1: ParamKind.IMAGE}  # 2 (an image the kernel writes) keel never renders
RECORD = 32  # bytes of a parameter record's fixed part
IMM = 40  # bytes of an immediate-constant record


class _Reader:
    def __init__(self, lib: bytes, kernel: str):
        self.lib, self.kernel = lib, kernel

    def fail(self, field: str, why: str):
        raise DeviceError(f"vendor binary of kernel {self.kernel} ({len(self.lib)} bytes): "
                          f"{field} {why}")

    def u32(self, off: int, field: str) -> int:
        if not 0 <= off <= len(self.lib) - 4:
            self.fail(field, f"at {off:#x} lies outside the binary")
        return struct.unpack_from("<I", self.lib, off)[0]


def parse(lib: bytes, kernel: str, decls: list[str], half: bool = False) -> Program:
    """The Program in a vendor binary of one kernel whose parameter declarations are `decls`."""
    r = _Reader(bytes(lib), kernel)
    isa_at, isa_len = r.u32(0xC0, "ISA offset"), r.u32(0x100, "ISA size")
    if isa_len == 0 or isa_len % 4 or isa_at + isa_len > len(lib):
        r.fail("ISA", f"of {isa_len} bytes at {isa_at:#x}: expected whole dwords inside the "
                      f"binary")
    if -(-isa_len // SHADER_UNIT) > MAX_UNITS:
        r.fail("ISA size", f"{isa_len} is more than one CP_LOAD_STATE6 loads")
    d = r.u32(0x110, "shader descriptor offset")
    name_at = d + 0x158
    end = lib.find(b"\0", name_at) if name_at < len(lib) else -1
    if end < 0 or lib[name_at:end] != kernel.encode():
        r.fail("kernel name", f"at {name_at:#x} is {bytes(lib[name_at:name_at + 64])!r}, "
                              f"expected {kernel!r}")
    pvt, nsamp = r.u32(d + 0xC8, "private memory size"), r.u32(d + 0xDC, "sampler count")
    if pvt:
        r.fail("private memory size", f"is {pvt} bytes: keel allocates no private memory "
                                      f"(the kernel spills registers); expected 0")
    if nsamp > 1:
        r.fail("sampler count", f"is {nsamp}, expected 0 or 1")
    at = r.u32(0x34, "register descriptor offset")
    regs = Regs(full=r.u32(at + 0x14, "full registers"), half=r.u32(at + 0x18, "half registers"),
                branch=r.u32(d + 0x108, "branch stack") // 2,
                first=r.u32(d + 0xC4, "first instruction offset"),
                shared=r.u32(d + 0xD8, "local memory size"))
    params, offsets = _params(r, -(-(name_at + len(kernel)) // 4) * 4 + 8 * nsamp, decls)
    isa = bytes(lib[isa_at:isa_at + isa_len])
    return Program(kernel, isa + b"\0" * (-len(isa) % SHADER_UNIT), params,
                   half, "", offsets, regs, _imms(r, isa_at))


def _params(r: _Reader, at: int, decls: list[str]) -> tuple[tuple, tuple]:
    params, offsets = [], []
    while True:
        length = r.u32(at, f"parameter record {len(params)} length")
        if length == 0:
            break
        if length < RECORD:
            r.fail(f"parameter record {len(params)} length", f"is {length}, expected >= {RECORD}")
        kind = r.u32(at + 28, f"parameter record {len(params)} kind")
        if kind not in KINDS:
            r.fail(f"parameter record {len(params)} kind", f"is {kind}, expected 0 (buffer) or "
                                                           f"1 (read-only image)")
        params.append(KINDS[kind])
        offsets.append(r.u32(at + 12, f"parameter record {len(params) - 1} offset")
                       if kind == 0 else None)
        at += length
    want = [ParamKind.of(x) for x in decls]
    if params != want:
        r.fail("parameter records", f"say {list(map(str, params))}, the kernel's source "
                                    f"declares {list(map(str, want))}")
    return tuple(params), tuple(offsets)


def _imms(r: _Reader, isa_at: int) -> tuple:
    """(dword, value) per 32-bit immediate constant; 16-bit ones are refused."""
    if r.u32(0xB0, "constant count") == 0:
        return ()
    out, at = [], r.u32(0xAC, "constant records offset")
    while at + IMM <= isa_at:
        value, off, wide = r.u32(at, "constant value"), r.u32(at + 16, "constant offset"), \
            r.u32(at + 24, "constant width")
        if not wide:
            r.fail("constant width", f"at {at + 24:#x} is 16-bit: keel places 32-bit constants")
        out.append((off, value))
        at += IMM
    return tuple(out)


def build(source: str) -> dict[str, Program]:
    """Every kernel of a program source built by libOpenCL on this device, one program each
    (the binary describes one kernel), parsed."""
    from runner import cl
    ex = cl.HostExecutor("qcom vendor compiler")
    preamble, kernels = split(source)
    out = {}
    for name, text, decls in kernels:
        lib = cl.binary(ex.program((preamble + text).encode()))
        if lib is None:
            raise DeviceError(f"qcom: libOpenCL gave no binary for kernel {name}")
        out[name] = parse(lib, name, decls, "cl_khr_fp16" in preamble)
    return out
