"""The microcode a gfx11 GPU needs before it runs anything, from the user's linux-firmware files.

File names follow amdgpu's: the IP block's name and the version IP discovery reports
(`amdgpu/psp_13_0_0_sos.bin` for MP0 13.0.0, `amdgpu/gc_11_0_0_mec.bin` for GC 11.0.0, ...).
The folder is KEEL_AMD_FIRMWARE, else /lib/firmware/amdgpu (Debian's firmware-amd-graphics; on
macOS copy the folder from a linux-firmware checkout and point KEEL_AMD_FIRMWARE at it).

Every file starts with amdgpu_ucode.h's common_firmware_header (32 bytes, little-endian):
u32 size_bytes, u32 header_size_bytes, u16 header_version_major, minor, u16 ip_version_major,
minor, u32 ucode_version, u32 ucode_size_bytes, u32 ucode_array_offset_bytes, u32 crc32.
A missing file or a header that does not describe the file is a ConfigError naming the file.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from am.discovery import Ip
from runner.errors import ConfigError

ENV = "KEEL_AMD_FIRMWARE"
DEFAULT_DIR = "/lib/firmware/amdgpu"
HEADER = struct.Struct("<IIHHHHIIII")
# per IP block (by its discovery name): the file stems amdgpu loads for it, the version's
# dotted numbers joined by "_" in place of {v}
FILES = {"MP0": ("psp_{v}_sos", "psp_{v}_ta"), "MP1": ("smu_{v}",),
         "GC": ("gc_{v}_pfp", "gc_{v}_me", "gc_{v}_mec", "gc_{v}_rlc", "gc_{v}_imu",
                "gc_{v}_mes_2", "gc_{v}_mes1"),
         "SDMA0": ("sdma_{v}",)}


@dataclass(frozen=True)
class Firmware:
    name: str
    ucode: bytes  # the microcode image the header points at
    version: int


def folder() -> Path:
    return Path(os.environ.get(ENV) or DEFAULT_DIR)


def required(ips: dict[tuple[int, int], Ip]) -> list[str]:
    """File names (without the folder) for the IP blocks discovered, instance 0 of each."""
    out = []
    for ip in sorted((ip for ip in ips.values() if ip.instance == 0), key=lambda i: i.hw_id):
        v = "_".join(map(str, ip.version))
        out += [f"{stem.format(v=v)}.bin" for stem in FILES.get(ip.name, ())]
    return out


def load(name: str, where: Path | None = None) -> Firmware:
    path = (where or folder()) / name
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"AMD firmware {name}: cannot read {path} ({e.strerror}); install "
                          f"linux-firmware's amdgpu/ folder or set {ENV} to where it is") from None
    if len(data) < HEADER.size:
        raise ConfigError(f"AMD firmware {path}: {len(data)} bytes, shorter than the "
                          f"{HEADER.size}-byte common firmware header")
    size, hsize, _, _, _, _, version, usize, uoff, _ = HEADER.unpack_from(data)
    if size != len(data) or hsize < HEADER.size or uoff + usize > len(data) or not usize:
        raise ConfigError(f"AMD firmware {path}: header says {size} bytes with microcode "
                          f"[{uoff}, {uoff + usize}), the file has {len(data)}; expected a "
                          f"linux-firmware amdgpu image")
    return Firmware(name, data[uoff:uoff + usize], version)


def load_all(ips: dict[tuple[int, int], Ip], where: Path | None = None) -> list[Firmware]:
    """Every file the GPU needs, checked up front: all missing names in one error."""
    names = required(ips)
    base = where or folder()
    missing = [n for n in names if not (base / n).is_file()]
    if missing:
        raise ConfigError(f"AMD firmware missing in {base}: {', '.join(missing)}; install "
                          f"linux-firmware's amdgpu/ folder or set {ENV} to where it is")
    return [load(n, base) for n in names]


def image(ucode: bytes, version: int = 1, header_size: int = HEADER.size) -> bytes:
    """A file in this format around `ucode` (tests and the mock build their stand-ins with it;
    keel ships no firmware)."""
    size = header_size + len(ucode)
    head = HEADER.pack(size, header_size, 1, 0, 0, 0, version, len(ucode), header_size, 0)
    return head.ljust(header_size, b"\0") + ucode
