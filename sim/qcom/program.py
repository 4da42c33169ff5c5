"""The mock KGSL's program binaries (qcom/program.py says where binaries come from): there is no
Adreno ISA in CI, so a mock "binary" is, honestly, the kernel's OpenCL C (the program's shared
preamble plus that one kernel) behind a header with the facts a parse of a vendor binary yields:
the kernel name, each parameter's kind and whether the program computes in half. The mock GPU
(sim/qcom/mock_gpu.py) executes exactly that source for every dispatch that points at it.
"""
from __future__ import annotations

import json
import struct

from runner.errors import DeviceError
from qcom.program import MAX_UNITS, SHADER_UNIT, ParamKind, Program, split

MAGIC = b"KEELMCK1"


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
    params = tuple(map(ParamKind, meta["params"]))
    return Program(meta["kernel"], bytes(binary), params, meta["half"], source,
                   tuple(2 * i for i in range(len(params))))


def mock_build(source: str) -> dict[str, Program]:
    """Per kernel: preamble + kernel text, with the facts a binary parse would give."""
    preamble, kernels = split(source)
    half = "cl_khr_fp16" in preamble
    out = {}
    for name, text, decls in kernels:
        params = [ParamKind.of(d) for d in decls]
        out[name] = parse(mock_binary(name, preamble + text, params, half))
    return out
