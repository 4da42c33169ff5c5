"""IP discovery: which IP blocks the GPU has, their versions and register bases, from the binary
table the GPU keeps near the top of VRAM (Linux amdgpu discovery.h / amdgpu_discovery.c).

  binary_header: u32 signature 0x28211407, u16 version major, minor, u16 checksum (a 16-bit byte
    sum of the `size` bytes after it), u16 size, then table_info {u16 offset, checksum, size,
    padding} per table; table 0 is the IP discovery table.
  ip_discovery_header: u32 "IPDS", u16 version, u16 size, u32 id, u16 num_dies, die_info[16]
    {u16 die_id, u16 die_offset}, u16 flags (bit 0: 64-bit base addresses).
  die_header: u16 die_id, u16 num_ips; then per IP: u16 hw_id, u8 instance, u8 num_base_address,
    u8 major, minor, revision, u8 sub_revision:4 | variant:4, and the base addresses (u32 each).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from runner.errors import DeviceError

BINARY_SIGNATURE, IPDS_SIGNATURE = 0x28211407, 0x53445049  # discovery.h
DISCOVERY_TMR_OFFSET = 64 << 10  # discovery.h: the binary starts this far below the top of VRAM
# soc15_hw_ip.h hardware ids of the blocks keel needs firmware for
HW_IDS = {1: "MP1", 11: "GC", 42: "SDMA0", 255: "MP0"}
HEADER = struct.Struct("<IHHHH")
TABLE_INFO = struct.Struct("<HHHH")
TOTAL_TABLES = 6
IPDS = struct.Struct("<IHHIH")
MAX_DIES = 16
IP = struct.Struct("<HBBBBBB")


@dataclass(frozen=True)
class Ip:
    hw_id: int
    instance: int
    version: tuple[int, int, int]
    bases: tuple[int, ...]

    @property
    def name(self) -> str:
        return HW_IDS.get(self.hw_id, f"hw{self.hw_id}")


def parse(data: bytes) -> dict[tuple[int, int], Ip]:
    """{(hw_id, instance): Ip}; DeviceError naming what does not hold."""
    sig, _, _, checksum, size = HEADER.unpack_from(data, 0)
    if sig != BINARY_SIGNATURE:
        raise DeviceError(f"IP discovery: signature 0x{sig:08x}, expected "
                          f"0x{BINARY_SIGNATURE:08x} (is the GPU's VRAM initialised?)")
    _checksum(data, 10, size, checksum, "binary")
    offset, tchecksum, tsize, _ = TABLE_INFO.unpack_from(data, HEADER.size)
    _checksum(data, offset, tsize, tchecksum, "IP discovery table")
    sig, _, _, _, dies = IPDS.unpack_from(data, offset)
    if sig != IPDS_SIGNATURE or not 0 < dies <= MAX_DIES:
        raise DeviceError(f"IP discovery table: signature 0x{sig:08x} with {dies} dies, "
                          f"expected 0x{IPDS_SIGNATURE:08x} with 1..{MAX_DIES}")
    flags_at = offset + IPDS.size + 4 * MAX_DIES
    wide = struct.unpack_from("<H", data, flags_at)[0] & 1
    out = {}
    for d in range(dies):
        _, die_offset = struct.unpack_from("<HH", data, offset + IPDS.size + 4 * d)
        _, n = struct.unpack_from("<HH", data, die_offset)
        at = die_offset + 4
        for _ in range(n):
            hw, inst, nbase, major, minor, rev, _ = IP.unpack_from(data, at)
            fmt = f"<{nbase}{'Q' if wide else 'I'}"
            bases = struct.unpack_from(fmt, data, at + IP.size)
            out[hw, inst] = Ip(hw, inst, (major, minor, rev), bases)
            at += IP.size + struct.calcsize(fmt)
    return out


def _checksum(data: bytes, at: int, n: int, want: int, what: str) -> None:
    if at + n > len(data):
        raise DeviceError(f"IP discovery {what}: {n} bytes at {at} run past the {len(data)} read")
    got = sum(data[at:at + n]) & 0xFFFF
    if got != want:
        raise DeviceError(f"IP discovery {what}: checksum 0x{got:04x}, header says 0x{want:04x}")


def build(ips: list[Ip]) -> bytes:
    """The binary for `ips` on one die: what the mock GPU keeps at the top of its VRAM."""
    body = b"".join(IP.pack(ip.hw_id, ip.instance, len(ip.bases), *ip.version, 0) +
                    struct.pack(f"<{len(ip.bases)}I", *ip.bases) for ip in ips)
    table_at = HEADER.size + TABLE_INFO.size * TOTAL_TABLES
    die_at = table_at + IPDS.size + 4 * MAX_DIES + 2
    table = IPDS.pack(IPDS_SIGNATURE, 4, 0, 0, 1) + struct.pack("<HH", 0, die_at) + \
        bytes(4 * (MAX_DIES - 1)) + b"\0\0" + struct.pack("<HH", 0, len(ips)) + body
    infos = TABLE_INFO.pack(table_at, sum(table) & 0xFFFF, len(table), 0) + \
        bytes(TABLE_INFO.size * (TOTAL_TABLES - 1))
    after = infos + table
    after = struct.pack("<H", 2 + len(after)) + after  # the checksum covers the size field on
    return struct.pack("<IHHH", BINARY_SIGNATURE, 1, 0, sum(after) & 0xFFFF) + after
