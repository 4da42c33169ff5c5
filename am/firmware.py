"""The microcode a gfx11 GPU needs before it runs anything, from the user's linux-firmware files.

File names follow amdgpu's: the IP block's name and the version IP discovery reports
(`amdgpu/psp_13_0_0_sos.bin` for MP0 13.0.0, `amdgpu/gc_11_0_0_mec.bin` for GC 11.0.0, ...).
The folder is KEEL_AMD_FIRMWARE, else /lib/firmware/amdgpu (Debian's firmware-amd-graphics; on
macOS copy the folder from a linux-firmware checkout and point KEEL_AMD_FIRMWARE at it). A file
may be `name.bin.xz` (read with the standard library's lzma); `.bin.zst` files (Arch, newer
Fedora) must be unpacked first: Python has no zstd module before 3.14, and the error says how.

Every file starts with amdgpu_ucode.h's common_firmware_header (32 bytes, little-endian):
u32 size_bytes, u32 header_size_bytes, u16 header_version_major, minor, u16 ip_version_major,
minor, u32 ucode_version, u32 ucode_size_bytes, u32 ucode_array_offset_bytes, u32 crc32; then
u32 fields that depend on the file's kind and header version (amdgpu_ucode.h's structs, named
in HEADERS). Each file becomes `Part`s: bytes the PSP loads as one or more firmware types, cut
where amdgpu_ucode.c's amdgpu_ucode_init_single_fw cuts them:
  psp_firmware_header_v2_0/2_1 (sOS): u32 psp_fw_bin_count, [2.1: u32 aux index], then
    psp_fw_bin_desc {fw_type, fw_version, offset_bytes, size_bytes} per component, offsets
    from ucode_array_offset_bytes (psp_init_sos_base_fw); bootloader components + the TOC;
  smc_firmware_header_v1_0/2_0/2_1 (SMU): the common header's ucode, GFX_FW_TYPE_SMU;
  gfx_firmware_header_v2_0 (RS64 PFP/ME/MEC): code at ucode_array_offset_bytes with the v2
    ucode_size_bytes; the data (the pipes' stacks) at data_offset_bytes; ucode_start_addr;
  imu_firmware_header_v1_0: IRAM at ucode_array_offset_bytes, DRAM right after it;
  rlc_firmware_header_v2_0..2_4: RLC_G = the common ucode; 2.1 restore lists, 2.2 IRAM/DRAM
    boot, 2.3 RLC_P/RLC_V, 2.4 tap delays, each at its offset from the file's start (parts
    with size 0 are not loaded, as amdgpu skips them).
A missing file, or a header that does not describe the file, is a ConfigError naming the file
and what was expected.
"""
from __future__ import annotations

import lzma
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from am import psp
from am.discovery import Ip
from runner.errors import ConfigError

ENV = "KEEL_AMD_FIRMWARE"
DEFAULT_DIR = "/lib/firmware/amdgpu"
HEADER = struct.Struct("<IIHHHHIIII")
# per IP block (by its discovery name): the files keel loads, in load order within the block
# (amdgpu_ucode_id order); "{v}" is the version's numbers joined by "_". Not loaded: the TA
# (security apps), SDMA (keel moves data with the compute queue's DMA_DATA) and MES (the one
# queue is mapped through the HQD registers, as amdgpu maps its KIQ); docs/amd.md says why.
FILES = {"MP0": ("psp_{v}_sos",), "MP1": ("smu_{v}",),
         "GC": ("gc_{v}_pfp", "gc_{v}_me", "gc_{v}_mec", "gc_{v}_imu", "gc_{v}_rlc")}
MAX_PSP_BINS = 26  # amdgpu_ucode.h UCODE_MAX_PSP_PACKAGING: ((0x100 - 32 - 4) / 16) * 2
RLC_FIELDS = ("feature jt_offset jt_size sr_offset csd_offset scratch rl_size rlf_start "
              "rlfs_start so_start rlf_bytes rlf_off rl_bytes rl_off rlfs_bytes rlfs_off "
              "rls_bytes rls_off "  # 2.0
              "direct_len cntl_ver cntl_feat cntl_size cntl_off gpm_ver gpm_feat gpm_size "
              "gpm_off srm_ver srm_feat srm_size srm_off "  # 2.1
              "iram_size iram_off dram_size dram_off "  # 2.2
              "p_ver p_feat p_size p_off v_ver v_feat v_size v_off "  # 2.3
              "tg_size tg_off t0_size t0_off t1_size t1_off t2_size t2_off t3_size t3_off").split()
# u32 fields after the common header, per (kind, major, minor)
HEADERS = {("sos", 2, 0): ("count",), ("sos", 2, 1): ("count", "aux"),
           ("smu", 1, 0): ("start",), ("smu", 2, 0): ("start", "ppt_off", "ppt_size"),
           ("smu", 2, 1): ("start", "ppt_count", "ppt_entry_off"),
           ("gfx", 2, 0): ("feature", "size", "offset", "data_size", "data_off", "start_lo",
                           "start_hi"),
           ("imu", 1, 0): ("iram_size", "iram_off", "dram_size", "dram_off"),
           **{("rlc", 2, m): tuple(RLC_FIELDS[:n]) for m, n in
              ((0, 18), (1, 31), (2, 35), (3, 43), (4, 53))}}
RLC_PARTS = (("cntl", psp.RLC_RESTORE_LIST_SRM_CNTL), ("gpm", psp.RLC_RESTORE_LIST_GPM_MEM),
             ("srm", psp.RLC_RESTORE_LIST_SRM_MEM), ("iram", psp.RLC_IRAM),
             ("dram", psp.RLC_DRAM_BOOT), ("p", psp.RLC_P), ("v", psp.RLC_V),
             ("tg", psp.GLOBAL_TAP_DELAYS), ("t0", psp.SE0_TAP_DELAYS),
             ("t1", psp.SE1_TAP_DELAYS), ("t2", psp.SE2_TAP_DELAYS), ("t3", psp.SE3_TAP_DELAYS))


@dataclass(frozen=True)
class Part:
    kinds: tuple[int, ...]  # the firmware types these bytes are loaded as (one load each)
    data: bytes


@dataclass(frozen=True)
class Firmware:
    name: str
    version: int  # the common header's ucode_version
    parts: tuple[Part, ...]
    start: int = 0  # RS64 engines: the byte address their program counter starts at


def folder() -> Path:
    return Path(os.environ.get(ENV) or DEFAULT_DIR)


def required(ips: dict[tuple[int, int], Ip]) -> list[str]:
    """File names (without the folder) for the IP blocks discovered, instance 0 of each."""
    out = []
    for ip in sorted((ip for ip in ips.values() if ip.instance == 0), key=lambda i: i.hw_id):
        v = "_".join(map(str, ip.version))
        out += [f"{stem.format(v=v)}.bin" for stem in FILES.get(ip.name, ())]
    return out


def kind_of(name: str) -> str:
    """Which header a file has, from its name: sos, smu, gfx (PFP/ME/MEC), imu or rlc."""
    role = name.removesuffix(".bin").rsplit("_", 1)[-1]
    if name.startswith("smu_"):
        return "smu"
    return "gfx" if role in ("pfp", "me", "mec") else role


def find(base: Path, name: str) -> Path | None:
    """`name`, else `name`.xz (how Debian and Fedora ship linux-firmware), in `base`."""
    return next((p for p in (base / name, base / f"{name}.xz") if p.is_file()), None)


def load(name: str, where: Path | None = None) -> Firmware:
    path = find(where or folder(), name) or (where or folder()) / name
    try:
        data = path.read_bytes()
        if path.suffix == ".xz":
            data = lzma.decompress(data, lzma.FORMAT_XZ)
    except OSError as e:
        raise ConfigError(f"AMD firmware {name}: cannot read {path} ({e.strerror}); install "
                          f"linux-firmware's amdgpu/ folder or set {ENV} to where it is") from None
    except lzma.LZMAError as e:
        raise ConfigError(f"AMD firmware {name}: {path} is not a valid .xz file ({e})") from None
    return parse(name, data, str(path))


def parse(name: str, data: bytes, where: str = "") -> Firmware:
    """The file's parts, every size and offset checked against the file."""
    what = f"AMD firmware {where or name}"
    if len(data) < HEADER.size:
        raise ConfigError(f"{what}: {len(data)} bytes, shorter than the {HEADER.size}-byte "
                          f"common firmware header")
    size, hsize, major, minor, _, _, version, usize, uoff, _ = HEADER.unpack_from(data)
    kind = kind_of(name)
    fields = HEADERS.get((kind, major, minor))
    if fields is None:
        known = ", ".join(f"{a}.{b}" for k, a, b in HEADERS if k == kind)
        raise ConfigError(f"{what}: header version {major}.{minor}; expected {known} for a "
                          f"{kind} file (amdgpu_ucode.h)")
    need = HEADER.size + 4 * len(fields)
    if size != len(data) or not need <= hsize <= len(data) or uoff + usize > len(data) or \
            not usize:
        raise ConfigError(f"{what}: header says {size} bytes ({hsize}-byte header, microcode "
                          f"[{uoff}, {uoff + usize})), the file has {len(data)}; expected a "
                          f"linux-firmware amdgpu image with at least a {need}-byte header")
    h = dict(zip(fields, struct.unpack_from(f"<{len(fields)}I", data, HEADER.size)))

    def cut(off: int, n: int, part: str) -> bytes:
        if not n or off + n > len(data):
            raise ConfigError(f"{what}: {part} at [{off}, {off + n}) of a {len(data)}-byte "
                              f"file; expected a non-empty range inside it")
        return data[off:off + n]
    parts, start = PARSERS[kind](name, data, h, uoff, usize, cut, what)
    return Firmware(name, version, tuple(parts), start)


def _sos(name, data, h, uoff, usize, cut, what):
    n = h["count"]
    at = HEADER.size + 4 * (2 if "aux" in h else 1)
    if not 0 < n <= MAX_PSP_BINS or at + 16 * n > len(data):
        raise ConfigError(f"{what}: {n} psp_fw_bin descriptors; expected 1..{MAX_PSP_BINS} "
                          f"inside the file")
    parts = []
    for i in range(n):
        kind, _, off, size = struct.unpack_from("<4I", data, at + 16 * i)
        parts.append(Part((kind,), cut(uoff + off, size, f"psp_fw_bin {i} (type {kind})")))
    have = {p.kinds[0] for p in parts}
    if not {psp.SYS_DRV, psp.SOS} <= have:
        raise ConfigError(f"{what}: components {sorted(have)}; expected at least the system "
                          f"driver ({psp.SYS_DRV}) and sOS ({psp.SOS}) (psp_fw_type)")
    return parts, 0


def _smu(name, data, h, uoff, usize, cut, what):
    return [Part((psp.SMU,), cut(uoff, usize, "SMU microcode"))], 0


def _gfx(name, data, h, uoff, usize, cut, what):
    kinds = psp.RS64[name.removesuffix(".bin").rsplit("_", 1)[-1]]
    return [Part(kinds[:1], cut(uoff, h["size"], "RS64 code")),
            Part(kinds[1:], cut(h["data_off"], h["data_size"], "RS64 data (stacks)"))], \
        h["start_lo"] | h["start_hi"] << 32


def _imu(name, data, h, uoff, usize, cut, what):
    i = h["iram_size"]
    return [Part((psp.IMU_I,), cut(uoff, i, "IMU IRAM")),
            Part((psp.IMU_D,), cut(uoff + i, h["dram_size"], "IMU DRAM"))], 0


def _rlc(name, data, h, uoff, usize, cut, what):
    parts = [Part((kind,), cut(h[f"{p}_off"], h[f"{p}_size"], f"RLC {p}"))
             for p, kind in RLC_PARTS if h.get(f"{p}_size")]
    return parts + [Part((psp.RLC_G,), cut(uoff, usize, "RLC_G microcode"))], 0


PARSERS = {"sos": _sos, "smu": _smu, "gfx": _gfx, "imu": _imu, "rlc": _rlc}


def load_all(ips: dict[tuple[int, int], Ip], where: Path | None = None) -> list[Firmware]:
    """Every file the GPU needs, checked up front: all missing names in one error."""
    names = required(ips)
    base = where or folder()
    missing = [n for n in names if not find(base, n)]
    zst = [n for n in missing if (base / f"{n}.zst").is_file()]
    if zst:
        raise ConfigError(f"AMD firmware in {base} is zstd-compressed ({zst[0]}.zst, ...): Python "
                          f"has no zstd module before 3.14; unpack them once with "
                          f"'zstd -d --rm {base}/*.bin.zst' (or copy the folder elsewhere and set "
                          f"{ENV})")
    if missing:
        raise ConfigError(f"AMD firmware missing in {base}: {', '.join(missing)}; install "
                          f"linux-firmware's amdgpu/ folder or set {ENV} to where it is")
    return [load(n, base) for n in names]
