"""Programs for the qcom device: one GPU binary per kernel, what the recorder needs to know about
it (parameter kinds, instruction length, constant layout), and a cache bound to the chip id, the
driver version and the source hash.

Where binaries come from depends on the driver behind Kgsl (`driver.compiler`):
- "mock" (qcom/mock_kgsl.py): there is no Adreno ISA in CI. The mock's "binary" is, honestly,
  the kernel's OpenCL C (the program's shared preamble plus that one kernel) behind a header with
  the facts a parse of a vendor binary yields: the kernel name, each parameter's kind and whether
  the program computes in half. The mock GPU executes exactly that source for every dispatch
  that points at it.
- "vendor" (the kernel driver on a device): libOpenCL would build the program once and the
  binary would be parsed for ISA, register footprint and constant layout. That parser is not
  written yet (docs/qcom.md); load() says so instead of guessing at a format it cannot check.

Constant layout, both cases: parameter i sits in dwords 2i, 2i+1 of the kernel's constants: a
64-bit GPU address for a buffer, the texture slot for an image. The block is padded to vec4s.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import NamedTuple

from qcom.errors import DeviceError

MAGIC = b"KEELMCK1"
SHADER_UNIT = 128  # CP_LOAD_STATE6 loads shader code in 128-byte units
MAX_UNITS = 0x3FF  # its NUM_UNIT field is 10 bits
_KERNEL = re.compile(r"(?:__attribute__\(\(reqd_work_group_size\([^)]*\)\)\)\s*)?"
                     r"__kernel void (\w+)\(([^)]*)\)")


class Program(NamedTuple):
    kernel: str
    binary: bytes  # what is uploaded to the shader object (padded to SHADER_UNIT)
    params: tuple[str, ...]  # "buffer" or "image" per parameter
    half: bool  # computes in half (cl_khr_fp16)
    source: str  # the OpenCL C the mock executes; "" for vendor binaries

    @property
    def units(self) -> int:
        return len(self.binary) // SHADER_UNIT

    @property
    def const_vec4s(self) -> int:
        return -(-len(self.params) * 2 // 4)


def split(source: str) -> tuple[str, list[tuple[str, str, list[str]]]]:
    """(preamble, [(kernel, its text, parameter declarations)]) of one program source."""
    found = list(_KERNEL.finditer(source))
    if not found:
        raise DeviceError("program source holds no __kernel function")
    ends = [m.start() for m in found[1:]] + [len(source)]
    return source[:found[0].start()], [
        (m.group(1), source[m.start():end], [p.strip() for p in m.group(2).split(",")])
        for m, end in zip(found, ends)]


def mock_binary(kernel: str, source: str, params: list[str], half: bool) -> bytes:
    meta = json.dumps({"kernel": kernel, "params": params, "half": half}).encode()
    raw = MAGIC + struct.pack("<I", len(meta)) + meta + source.encode()
    raw += b"\0" * (-len(raw) % SHADER_UNIT)
    if len(raw) // SHADER_UNIT > MAX_UNITS:
        raise DeviceError(f"kernel {kernel}: {len(raw)} bytes of program is more than one "
                          f"CP_LOAD_STATE6 loads ({MAX_UNITS} units of {SHADER_UNIT})")
    return raw


def parse(binary: bytes) -> Program:
    """A Program from the bytes of a shader object; DeviceError for anything else."""
    if binary[:8] != MAGIC or len(binary) < 12:
        raise DeviceError(f"shader object starts with {bytes(binary[:8])!r}: not a keel mock "
                          f"binary ({MAGIC!r})")
    (n,) = struct.unpack_from("<I", binary, 8)
    meta = json.loads(bytes(binary[12:12 + n]))
    source = bytes(binary[12 + n:]).rstrip(b"\0").decode()
    return Program(meta["kernel"], bytes(binary), tuple(meta["params"]), meta["half"], source)


def mock_build(source: str) -> dict[str, Program]:
    """Per kernel: preamble + kernel text, with the facts a binary parse would give."""
    preamble, kernels = split(source)
    half = "cl_khr_fp16" in preamble
    out = {}
    for name, text, decls in kernels:
        params = ["image" if "image2d_t" in d else "buffer" for d in decls]
        out[name] = parse(mock_binary(name, preamble + text, params, half))
    return out


def build(source: str, compiler: str) -> dict[str, Program]:
    if compiler == "mock":
        return mock_build(source)
    raise DeviceError("qcom: building Adreno binaries needs the vendor compiler's binary parsed "
                      "(ISA, registers, constants), which keel does not do yet; run qcom blobs "
                      "with device='opencl' on this device (docs/qcom.md)")


def load(source: str, compiler: str, chip_id: int, driver: str, cache_dir: str | None):
    """Programs by kernel name, from the cache when its key (chip, driver, source) matches."""
    key = hashlib.sha256("\0".join([compiler, f"{chip_id:#x}", driver, source]).encode())
    path = Path(cache_dir) / f"qcom-{key.hexdigest()[:32]}.json" if cache_dir else None
    if path is not None and path.exists():
        try:
            blobs = json.loads(path.read_text())
            return {name: parse(bytes.fromhex(h)) for name, h in blobs.items()}
        except (OSError, ValueError, KeyError, DeviceError):
            pass  # unreadable or stale: rebuilt below
    progs = build(source, compiler)
    if path is not None:
        try:  # best effort: a read-only disk costs a rebuild next time
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({n: p.binary.hex() for n, p in progs.items()}))
            os.replace(tmp, path)
        except OSError:
            pass
    return progs
