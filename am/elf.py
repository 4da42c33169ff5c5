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
The reader walks only what a loader maps (program headers, PT_DYNAMIC's symbol and string
tables, PT_NOTE), through a function reading virtual addresses: the same code reads a file
(`read`) and a code object already in GPU memory (`parse`, the mock GPU's view). Anything else is
a BlobError naming what is wrong.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable

from am import msgpack
from runner.errors import BlobError

NT_AMDGPU_METADATA = 32
EM_AMDGPU = 224
PT_LOAD, PT_DYNAMIC, PT_NOTE = 1, 2, 4
DT_NULL, DT_HASH, DT_STRTAB, DT_SYMTAB = 0, 4, 5, 6
SOURCE_SYMBOL = "keel_source"  # compiler/toolchain.py exports the OpenCL C under this name
KD_BYTES = 64
# kernel code properties (descriptor bytes 56-57): which user SGPRs precede the kernarg pointer
USER_SGPRS = ((0, 4), (1, 2), (2, 2))  # (bit, SGPRs): private segment buffer, dispatch, queue ptr
KERNARG_PTR_BIT = 3

Reader = Callable[[int, int], bytes]  # (virtual address, size) -> bytes


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
    properties: int  # kernel code properties
    args: tuple[Arg, ...]

    @property
    def kernarg_sgpr(self) -> int:
        """The user SGPR (COMPUTE_USER_DATA_n) that receives the kernarg segment address."""
        if not self.properties >> KERNARG_PTR_BIT & 1:
            raise BlobError(f"kernel {self.name!r} does not take a kernarg segment pointer")
        return sum(n for bit, n in USER_SGPRS if self.properties >> bit & 1)


@dataclass
class CodeObject:
    segments: list[tuple[int, int, int]]  # PT_LOAD (virtual address, file size, memory size)
    kernels: dict[str, Kernel] = field(default_factory=dict)
    source: str = ""  # the OpenCL C it was compiled from ("" when absent)

    @property
    def size(self) -> int:
        return max((va + mem for va, _, mem in self.segments), default=0)


def read(image: bytes) -> CodeObject:
    """A code object file. Loading copies each PT_LOAD's file bytes to base + its address
    (`load_image`); everything else is read at virtual addresses through those segments."""
    segs = _program_headers(lambda off, n: image[off:off + n])
    def at(va: int, n: int) -> bytes:
        for vaddr, off, filesz, _ in segs[PT_LOAD]:
            if vaddr <= va and va + n <= vaddr + filesz:
                return image[off + va - vaddr:off + va - vaddr + n]
        raise BlobError(f"amd programs: {n} bytes at 0x{va:x} are in no loadable segment")
    return parse(at)


def load_image(image: bytes) -> list[tuple[int, bytes]]:
    """(virtual address, bytes with the zero fill) per PT_LOAD: what a loader copies."""
    return [(va, image[off:off + filesz] + bytes(mem - filesz))
            for va, off, filesz, mem in _program_headers(lambda o, n: image[o:o + n])[PT_LOAD]]


def parse(at: Reader) -> CodeObject:
    """A code object through `at` (virtual addresses; the file, or GPU memory at its base)."""
    segs = _program_headers(at)
    co = CodeObject(segments=[(va, fs, ms) for va, _, fs, ms in segs[PT_LOAD]])
    symbols = _symbols(at, segs[PT_DYNAMIC])
    meta = _metadata(at, segs[PT_NOTE])
    for k in meta.get("amdhsa.kernels", []):
        kd = symbols.get(k[".symbol"])
        if kd is None:
            raise BlobError(f"amd programs: kernel {k['.name']!r} has no symbol {k['.symbol']!r}")
        co.kernels[k[".name"]] = _kernel(at, k, kd[0])
    if SOURCE_SYMBOL in symbols:
        va, size = symbols[SOURCE_SYMBOL]
        co.source = at(va, size).rstrip(b"\0").decode("latin-1")
    return co


def _program_headers(at: Reader) -> dict[int, list[tuple[int, int, int, int]]]:
    """{PT_LOAD/PT_DYNAMIC/PT_NOTE: [(vaddr, file offset, file size, memory size)]}."""
    ident = at(0, 64)
    if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4:6] != b"\x02\x01":
        raise BlobError("amd programs: expected a little-endian ELF64 HSA code object")
    machine = struct.unpack_from("<H", ident, 18)[0]
    if machine != EM_AMDGPU:
        raise BlobError(f"amd programs: ELF machine {machine}, expected EM_AMDGPU ({EM_AMDGPU})")
    phoff, = struct.unpack_from("<Q", ident, 32)
    phentsize, phnum = struct.unpack_from("<HH", ident, 54)
    out = {PT_LOAD: [], PT_DYNAMIC: [], PT_NOTE: []}
    table = at(phoff, phentsize * phnum)
    for i in range(phnum):
        typ, _, off, vaddr, _, filesz, memsz, _ = struct.unpack_from("<IIQQQQQQ", table,
                                                                    i * phentsize)
        if typ in out:
            out[typ].append((vaddr, off, filesz, memsz))
    if not out[PT_LOAD] or out[PT_LOAD][0][:2] != (0, 0):
        raise BlobError("amd programs: the first loadable segment must map the ELF header at 0")
    return out


def _metadata(at: Reader, notes) -> dict:
    for va, _, size, _ in notes:
        data, pos = at(va, size), 0
        while pos + 12 <= size:
            namesz, descsz, ntype = struct.unpack_from("<III", data, pos)
            name = data[pos + 12:pos + 12 + namesz].rstrip(b"\0")
            desc = pos + 12 + _align4(namesz)
            if name == b"AMDGPU" and ntype == NT_AMDGPU_METADATA:
                try:
                    return msgpack.unpack(data[desc:desc + descsz])
                except ValueError as e:
                    raise BlobError(f"amd programs: metadata note: {e}") from None
            pos = desc + _align4(descsz)
    raise BlobError("amd programs: no AMDGPU metadata note (NT_AMDGPU_METADATA)")


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _symbols(at: Reader, dynamic) -> dict[str, tuple[int, int]]:
    """name -> (value, size) of the dynamic symbol table (DT_SYMTAB; its length from DT_HASH)."""
    if not dynamic:
        raise BlobError("amd programs: no PT_DYNAMIC (a code object is a shared object)")
    va, _, size, _ = dynamic[0]
    raw, tags = at(va, size), {}
    for pos in range(0, size - 15, 16):
        tag, value = struct.unpack_from("<qQ", raw, pos)
        if tag == DT_NULL:
            break
        tags[tag] = value
    if not {DT_HASH, DT_SYMTAB, DT_STRTAB} <= tags.keys():
        raise BlobError("amd programs: PT_DYNAMIC lacks DT_HASH, DT_SYMTAB or DT_STRTAB")
    count, = struct.unpack("<I", at(tags[DT_HASH] + 4, 4))  # nchain: one per symbol
    table, out = at(tags[DT_SYMTAB], 24 * count), {}
    for i in range(1, count):
        name, _, _, _, value, size = struct.unpack_from("<IBBHQQ", table, 24 * i)
        out[_cstr(at, tags[DT_STRTAB] + name)] = (value, size)
    return out


def _cstr(at: Reader, va: int) -> str:
    out = b""
    while b"\0" not in out:
        out += at(va + len(out), 1)
    return out[:-1].decode()


def _kernel(at: Reader, meta: dict, kd: int) -> Kernel:
    seg = at(kd, KD_BYTES)
    lds, scratch, kernarg = struct.unpack_from("<III", seg, 0)
    entry, = struct.unpack_from("<q", seg, 16)
    rsrc3, rsrc1, rsrc2 = struct.unpack_from("<III", seg, 44)
    props, = struct.unpack_from("<H", seg, 56)
    if kernarg != meta[".kernarg_segment_size"] or lds != meta[".group_segment_fixed_size"]:
        raise BlobError(f"amd programs: {meta['.name']!r}: descriptor (kernarg {kernarg}, LDS "
                        f"{lds}) disagrees with its metadata ({meta['.kernarg_segment_size']}, "
                        f"{meta['.group_segment_fixed_size']})")
    args = tuple(Arg(a[".offset"], a[".size"], a[".value_kind"]) for a in meta.get(".args", []))
    return Kernel(meta[".name"], kd, kd + entry, kernarg, lds, scratch, meta[".vgpr_count"],
                  meta[".sgpr_count"], meta[".wavefront_size"], (rsrc1, rsrc2, rsrc3), props, args)
