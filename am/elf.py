"""Read an HSA code object (the `amd` target's programs section): its loadable segments, each
kernel's 64-byte descriptor and its metadata.

Facts from LLVM's AMDGPUUsage ("Code Object V5 Metadata", "Kernel Descriptor"):
  * the metadata is one msgpack map in an ELF note, owner "AMDGPU", type NT_AMDGPU_METADATA (32):
    `amdhsa.kernels` lists per kernel `.name`, `.symbol` ("<name>.kd"), `.kernarg_segment_size`,
    `.group_segment_fixed_size` (LDS bytes), `.private_segment_fixed_size`, `.vgpr_count`,
    `.sgpr_count`, `.wavefront_size` and `.args` (offset, size, value_kind; hidden_* are the
    implicit arguments the dispatcher fills);
  * the descriptor: u32 group_segment_fixed_size @0, u32 private_segment_fixed_size @4,
    u32 kernarg_size @8, i64 kernel_code_entry_byte_offset @16 (from the descriptor to the code),
    u32 COMPUTE_PGM_RSRC3 @44, RSRC1 @48, RSRC2 @52, u16 kernel code properties @56.
Anything else is a BlobError naming what is wrong.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from am import msgpack
from runner.errors import BlobError

NT_AMDGPU_METADATA = 32
EM_AMDGPU = 224
PT_LOAD = 1
SHT_NOTE, SHT_DYNSYM = 7, 11
SOURCE_SECTION = ".keel.opencl"  # compiler/toolchain.py attaches the OpenCL C under this name
KD_BYTES = 64


@dataclass(frozen=True)
class Arg:
    offset: int
    size: int
    kind: str  # value_kind: global_buffer, hidden_block_count_x, hidden_group_size_x, ...


@dataclass(frozen=True)
class Kernel:
    name: str
    kd: int  # virtual address of the kernel descriptor
    entry: int  # virtual address of the first instruction
    kernarg_size: int
    lds_bytes: int  # group segment
    scratch_bytes: int  # private segment per work item
    vgprs: int
    sgprs: int
    wave: int
    rsrc: tuple[int, int, int]  # COMPUTE_PGM_RSRC1, 2, 3
    args: tuple[Arg, ...]


@dataclass
class CodeObject:
    segments: list[tuple[int, bytes]]  # (virtual address, bytes incl. zero fill) of PT_LOADs
    kernels: dict[str, Kernel] = field(default_factory=dict)
    source: str = ""  # the OpenCL C it was compiled from ("" when absent)

    @property
    def size(self) -> int:
        return max((va + len(b) for va, b in self.segments), default=0)


def read(image: bytes) -> CodeObject:
    if image[:4] != b"\x7fELF" or len(image) < 64 or image[4:6] != b"\x02\x01":
        raise BlobError("amd programs: expected a little-endian ELF64 HSA code object")
    machine = struct.unpack_from("<H", image, 18)[0]
    if machine != EM_AMDGPU:
        raise BlobError(f"amd programs: ELF machine {machine}, expected EM_AMDGPU ({EM_AMDGPU})")
    sections = _sections(image)
    co = CodeObject(segments=_segments(image))
    meta = _metadata(image, sections)
    symbols = _symbols(image, sections)
    for k in meta.get("amdhsa.kernels", []):
        kd = symbols.get(k[".symbol"])
        if kd is None:
            raise BlobError(f"amd programs: kernel {k['.name']!r} has no symbol {k['.symbol']!r}")
        co.kernels[k[".name"]] = _kernel(image, co, k, kd)
    src = next((s for s in sections if s[0] == SOURCE_SECTION), None)
    if src is not None:
        co.source = image[src[2]:src[2] + src[3]].decode()
    return co


def _sections(image: bytes) -> list[tuple[str, int, int, int, int, int]]:
    """(name, type, file offset, size, address, link) per section header."""
    shoff, = struct.unpack_from("<Q", image, 40)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 58)
    if shoff + shnum * shentsize > len(image):
        raise BlobError("amd programs: section headers run past the end of the code object")
    raw = [struct.unpack_from("<IIQQQQII", image, shoff + i * shentsize) for i in range(shnum)]
    names = raw[shstrndx]
    out = []
    for name, typ, _, addr, off, size, link, _ in raw:
        start = names[4] + name
        out.append((image[start:image.index(b"\0", start)].decode(), typ, off, size, addr, link))
    return out


def _segments(image: bytes) -> list[tuple[int, bytes]]:
    phoff, = struct.unpack_from("<Q", image, 32)
    phentsize, phnum = struct.unpack_from("<HH", image, 54)
    out = []
    for i in range(phnum):
        typ, _, off, vaddr, _, filesz, memsz, _ = struct.unpack_from("<IIQQQQQQ", image,
                                                                    phoff + i * phentsize)
        if typ == PT_LOAD:
            out.append((vaddr, image[off:off + filesz] + bytes(memsz - filesz)))
    return out


def _metadata(image: bytes, sections) -> dict:
    for _, typ, off, size, _, _ in sections:
        pos = off
        while typ == SHT_NOTE and pos + 12 <= off + size:
            namesz, descsz, ntype = struct.unpack_from("<III", image, pos)
            name = image[pos + 12:pos + 12 + namesz].rstrip(b"\0")
            desc = pos + 12 + _align4(namesz)
            if name == b"AMDGPU" and ntype == NT_AMDGPU_METADATA:
                try:
                    return msgpack.unpack(image[desc:desc + descsz])
                except ValueError as e:
                    raise BlobError(f"amd programs: metadata note: {e}") from None
            pos = desc + _align4(descsz)
    raise BlobError("amd programs: no AMDGPU metadata note (NT_AMDGPU_METADATA)")


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _symbols(image: bytes, sections) -> dict[str, int]:
    for _, typ, off, size, _, link in sections:
        if typ == SHT_DYNSYM:
            strtab = sections[link][2]
            out = {}
            for pos in range(off, off + size, 24):
                name, _, _, _, value, _ = struct.unpack_from("<IBBHQQ", image, pos)
                out[image[strtab + name:image.index(b"\0", strtab + name)].decode()] = value
            return out
    raise BlobError("amd programs: no dynamic symbol table")


def _kernel(image: bytes, co: CodeObject, meta: dict, kd: int) -> Kernel:
    seg = next((b[kd - va:kd - va + KD_BYTES] for va, b in co.segments
                if va <= kd and kd + KD_BYTES <= va + len(b)), None)
    if seg is None:
        raise BlobError(f"amd programs: descriptor of {meta['.name']!r} at 0x{kd:x} is in no "
                        f"loadable segment")
    lds, scratch, kernarg = struct.unpack_from("<III", seg, 0)
    entry, = struct.unpack_from("<q", seg, 16)
    rsrc3, rsrc1, rsrc2 = struct.unpack_from("<III", seg, 44)
    if kernarg != meta[".kernarg_segment_size"] or lds != meta[".group_segment_fixed_size"]:
        raise BlobError(f"amd programs: {meta['.name']!r}: descriptor (kernarg {kernarg}, LDS "
                        f"{lds}) disagrees with its metadata ({meta['.kernarg_segment_size']}, "
                        f"{meta['.group_segment_fixed_size']})")
    args = tuple(Arg(a[".offset"], a[".size"], a[".value_kind"]) for a in meta.get(".args", []))
    return Kernel(meta[".name"], kd, kd + entry, kernarg, lds, scratch, meta[".vgpr_count"],
                  meta[".sgpr_count"], meta[".wavefront_size"], (rsrc1, rsrc2, rsrc3), args)
