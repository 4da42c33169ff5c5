"""Stand-in firmware files for the mock GPU (keel ships no firmware): the same headers as the
linux-firmware files am/firmware.py reads, around payloads that say what they are.

Each part's payload starts with TAG and a 128-bit mask of the firmware types it may be loaded
as. The mock PSP refuses a load whose payload does not carry its type, as the real PSP refuses
an image whose signature does not verify: so a part sent as the wrong type, or a load from the
wrong address, fails in CI as it would on hardware.
"""
from __future__ import annotations

import struct
from pathlib import Path

from am import firmware, psp

TAG = b"KEELFW\0\0"
TOC_TMR_BYTES = 5 << 20  # what the mock's LOAD_TOC answers (not amdgpu's 4 MiB default)
MEC_START = 0x10000  # the RS64 engines' ucode_start_addr in the stand-ins
PAD = 256  # where the payloads start (the headers are smaller)


def payload(kinds, n: int = 64) -> bytes:
    mask = sum(1 << k for k in kinds)
    return (TAG + mask.to_bytes(16, "little")).ljust(n, b"\xA5")


def tagged(data: bytes) -> set[int]:
    """The firmware types a payload may be loaded as (empty: not a stand-in payload)."""
    if data[:len(TAG)] != TAG:
        return set()
    mask = int.from_bytes(data[len(TAG):len(TAG) + 16], "little")
    return {k for k in range(128) if mask >> k & 1}


def _file(major: int, minor: int, fields: list[int], ucode: bytes, extra: bytes = b"",
          version: int = 1) -> bytes:
    """Common header + u32 fields, the microcode at PAD and `extra` right after it."""
    size = PAD + len(ucode) + len(extra)
    head = firmware.HEADER.pack(size, PAD, major, minor, 0, 0, version, len(ucode), PAD, 0)
    return (head + struct.pack(f"<{len(fields)}I", *fields)).ljust(PAD, b"\0") + ucode + extra


def sos(components=(psp.KDB, psp.SYS_DRV, psp.TOC_BIN, psp.SOS), n: int = 64) -> bytes:
    blobs = [payload((k,), n) for k in components]
    descs, off = [], 0
    for k, b in zip(components, blobs):
        descs += [k, 1, off, len(b)]
        off += len(b)
    return _file(2, 0, [len(components), *descs], b"".join(blobs))


def rs64(role: str, n: int = 64) -> bytes:
    code, stack = payload(psp.RS64[role][:1], n), payload(psp.RS64[role][1:], n)
    return _file(2, 0, [1, len(code), PAD, len(stack), PAD + len(code), MEC_START, 0],
                 code, stack)


def imu(n: int = 64) -> bytes:
    i, d = payload((psp.IMU_I,), n), payload((psp.IMU_D,), n)
    return _file(1, 0, [len(i), PAD, len(d), PAD + len(i)], i, d)


def rlc(n: int = 64) -> bytes:
    """rlc_firmware_header_v2_3: RLC_G plus restore lists, IRAM/DRAM boot and RLC_P/V."""
    g = payload((psp.RLC_G,), n)
    parts = [payload((kind,), n) for _, kind in firmware.RLC_PARTS[:7]]
    h = dict.fromkeys(firmware.RLC_FIELDS[:43], 0)
    at = PAD + len(g)
    for (name, _), p in zip(firmware.RLC_PARTS, parts):
        h[f"{name}_size"], h[f"{name}_off"] = len(p), at
        at += len(p)
    return _file(2, 3, list(h.values()), g, b"".join(parts))


def image(name: str, n: int = 64) -> bytes:
    """The stand-in for `name`, each part's payload `n` bytes."""
    kind = firmware.kind_of(name)
    if kind == "gfx":
        return rs64(name.removesuffix(".bin").rsplit("_", 1)[-1], n)
    if kind == "smu":
        return _file(2, 0, [0, 0, 0], payload((psp.SMU,), n))
    return {"sos": sos, "imu": imu, "rlc": rlc}[kind](n=n)


def write_all(folder: Path, ips, n: int = 64) -> list[str]:
    """A stand-in for every file `ips` need, in `folder`; returns their names."""
    names = firmware.required(ips)
    for name in names:
        (folder / name).write_bytes(image(name, n))
    return names
