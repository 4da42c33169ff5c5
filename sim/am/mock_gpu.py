"""The mock GPU's command processor: GPU memory, and PM4 executed from it.

`Memory` is the GPU's address space as the mock sees it: allocations at GPU virtual addresses,
backed by one host mapping; an access outside every allocation is a GpuFault (a page fault on
hardware). `CommandProcessor.run(address, dwords)` decodes a command buffer with am/pm4.py (any
malformed packet is a PacketError before anything runs), follows INDIRECT_BUFFER one level,
keeps the SH registers SET_SH_REG writes, and executes:
  DISPATCH_DIRECT: the kernel whose code COMPUTE_PGM_LO/HI points at is found the way a loader
    would, through the code object's dynamic symbols in GPU memory (am/elf.parse); its kernarg
    segment is read at the address in the user SGPRs; the hidden arguments must agree with the
    packet's group counts and COMPUTE_NUM_THREAD_*; and it runs as its OpenCL C (exported in the
    code object as `keel_source`) on PoCL, each pointer argument a sub-buffer of GPU memory from
    that address to the end of its allocation: exactly the buffers the packets bound.
  ACQUIRE_MEM: PoCL runs dispatches in order; nothing to wait for.
  DMA_DATA: copies between any two addresses (VRAM, or the host's DMA window).
  RELEASE_MEM: once every dispatch before it finished, writes its 64-bit value to its address,
    or (DATA_SEL 3) the GPU clock counter: the host's monotonic clock at 100 MHz. Any other
    DATA_SEL is a PacketError (am/pm4.py), as for every malformed packet.
No mock proves the ISA: the gfx1100 machine code in the code object is never executed here.

The PoCL executor is runner/cl.py's HostExecutor, shared with qcom's mock.
"""
from __future__ import annotations

import bisect
import mmap
import struct
import time

from am import elf, pm4
from runner import cl
from runner.errors import DeviceError
from runner.faults import bringup_from

GPU_BASE = 0x8000_0000_0000  # where the mock's GPU virtual addresses start
PAGE = 4096


def gpu_clock() -> int:
    """The mock's GPU clock counter: the host's monotonic clock at pm4.CLOCK_HZ."""
    return time.perf_counter_ns() // (1_000_000_000 // pm4.CLOCK_HZ)


class GpuFault(DeviceError):
    """What would be a GPU page fault: an access outside every allocation."""


MAP_NORESERVE = 0x4000  # Linux's flag (Python 3.11's mmap module does not name it)


class Memory:
    """`size` bytes of sparse host memory: an anonymous private map without swap reserved, so a
    24 GiB VRAM costs only the pages written (the kernel's overcommit heuristic refuses a plain
    map larger than RAM)."""

    def __init__(self, size: int):
        self.size = size
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        self.view = memoryview(self.map)
        self.starts: list[int] = []  # allocation start addresses, sorted (bump: in order)
        self.ends: list[int] = []
        self.top = GPU_BASE

    def alloc(self, n: int, align: int = PAGE) -> int:
        va = -(-self.top // align) * align
        if va + n > GPU_BASE + self.size:
            raise DeviceError(f"GPU memory: {n} bytes requested, {GPU_BASE + self.size - va} "
                              f"left of {self.size}")
        self.starts.append(va)
        self.ends.append(va + max(n, 1))
        self.top = va + max(n, 1)
        return va

    def extent(self, va: int, n: int = 1) -> int:
        """Bytes from `va` to the end of its allocation; GpuFault unless [va, va+n) is inside."""
        i = bisect.bisect_right(self.starts, va) - 1
        if i < 0 or va + n > self.ends[i]:
            raise GpuFault(f"GPU page fault: {n} bytes at 0x{va:x} outside every allocation")
        return self.ends[i] - va

    def read(self, va: int, n: int) -> bytes:
        self.extent(va, n)
        return bytes(self.view[va - GPU_BASE:va - GPU_BASE + n])

    def write(self, va: int, data: bytes) -> None:
        self.extent(va, len(data))
        self.view[va - GPU_BASE:va - GPU_BASE + len(data)] = data


class CommandProcessor:
    """`space` is every address the CP reaches (sim/am/mock_device.py's MMU: the GART, VRAM and
    system memory through apertures), with `run(va)` for a kernel buffer's VRAM range; `memory`
    the VRAM that kernels' buffers live in (without a `space`, its own addresses)."""

    def __init__(self, memory: Memory, space=None):
        self.mem = space or memory
        self.sh: dict[int, int] = {}
        self.pocl = Pocl(memory, getattr(space, "run", None))
        self.vram = memory
        self.code: dict[int, elf.CodeObject] = {}  # by base address
        self.dispatches = 0
        self.check = None  # called before each dispatch: the mock GPU's SH_MEM check
        # KEEL_MOCK_BRINGUP gpu.answer=wrong[@K]: flip the first output word of each dispatch
        # from the Kth of a doorbell's batch on
        self.wrong_from, self.nth = bringup_from("gpu.answer", "wrong"), 0

    def run(self, address: int, dwords: int, depth: int = 0) -> None:
        self.execute(pm4.words(self.mem.read(address, 4 * dwords)), depth)

    def execute(self, words: list[int], depth: int = 0) -> None:
        packets = pm4.decode(words)
        if not depth:
            self.nth = 0
        for p in packets:
            if p.op == pm4.SET_SH_REG:
                for i, v in enumerate(p.body[1:]):
                    self.sh[pm4.SH_START + p.body[0] + i] = v
            elif p.op == pm4.INDIRECT_BUFFER:
                if depth:
                    raise pm4.PacketError(f"dword {p.at}: INDIRECT_BUFFER inside an indirect "
                                          f"buffer; a compute queue chains one level")
                self.run(p.body[0] | (p.body[1] & 0xFFFF) << 32, p.body[2] & 0xFFFFF, 1)
            elif p.op == pm4.DISPATCH_DIRECT:
                if self.check is not None:
                    self.check()
                self._dispatch(p.body[:3])
            elif p.op == pm4.DMA_DATA:
                self.pocl.finish()  # CP_SYNC: earlier dispatches' writes land first
                src, dst = p.body[1] | p.body[2] << 32, p.body[3] | p.body[4] << 32
                n = p.body[5] & pm4.DMA_MAX
                self.mem.write(dst, self.mem.read(src, n))
                for base in [b for b in self.code if dst <= b < dst + n]:
                    del self.code[base]  # a new code object over an old one (a later load)
            elif p.op == pm4.RELEASE_MEM:
                self.pocl.finish()
                value = gpu_clock() if p.body[1] >> 29 == pm4.DATA_SEL_CLOCK else \
                    p.body[4] | p.body[5] << 32
                self.mem.write(p.body[2] | p.body[3] << 32, struct.pack("<Q", value))
        self.pocl.finish()

    def _reg(self, name: str, i: int = 0) -> int:
        return self.sh.get(pm4.REGS[name] + i, 0)

    def _dispatch(self, groups) -> None:
        entry = (self._reg("COMPUTE_PGM_LO") | self._reg("COMPUTE_PGM_HI") << 32) << 8
        co, base = self._code_object(entry)
        k = next((k for k in co.kernels.values() if base + k.entry == entry), None)
        if k is None:
            raise GpuFault(f"COMPUTE_PGM at 0x{entry:x} is no kernel's entry")
        local = tuple(self._reg("COMPUTE_NUM_THREAD_X", i) for i in range(3))
        at = k.kernarg_sgpr
        kernarg = self._reg("COMPUTE_USER_DATA_0", at) | \
            self._reg("COMPUTE_USER_DATA_0", at + 1) << 32
        args = self.mem.read(kernarg, k.kernarg_size)
        want = {f"hidden_block_count_{c}": g for c, g in zip("xyz", groups)}
        want |= {f"hidden_group_size_{c}": w for c, w in zip("xyz", local)}
        pointers = []
        for a in k.args:
            value = int.from_bytes(args[a.offset:a.offset + a.size], "little")
            if a.kind == "global_buffer":
                pointers.append(value)
            elif a.kind in want and value != want[a.kind]:
                raise GpuFault(f"{k.name}: kernarg {a.kind} is {value}, the dispatch says "
                               f"{want[a.kind]}")
        glob = tuple(g * w for g, w in zip(groups, local))
        self.pocl.run(co.source, k.name, pointers, glob, local)
        self.dispatches += 1
        self.nth += 1
        if self.wrong_from and self.nth >= self.wrong_from and pointers:
            self.pocl.finish()
            self.mem.write(pointers[0], bytes(b ^ 0xFF for b in self.mem.read(pointers[0], 4)))

    def _code_object(self, entry: int) -> tuple[elf.CodeObject, int]:
        """The code object holding `entry`: the ELF header on a page at or below it."""
        base = entry & ~(PAGE - 1)
        try:
            while base >= 0:
                if base in self.code:
                    return self.code[base], base
                if self.mem.read(base, 4) == b"\x7fELF":
                    self.code[base] = elf.parse(lambda va, n: self.mem.read(base + va, n))
                    return self.code[base], base
                base -= PAGE
        except GpuFault as e:  # walked off mapped memory: no ELF header below the entry
            raise GpuFault(f"COMPUTE_PGM at 0x{entry:x} is in no loaded code object ({e})") \
                from None
        raise GpuFault(f"COMPUTE_PGM at 0x{entry:x} is in no loaded code object")


class Pocl:
    """Dispatches as OpenCL kernels (runner/cl.py's HostExecutor) on buffers that are the GPU
    memory itself: each pointer argument a buffer over the host pages from its address to the end
    of its allocation (one buffer over all of a 24 GiB VRAM would exceed the OpenCL device's
    largest allocation)."""

    def __init__(self, memory: Memory, resolve=None):
        """`resolve(va)`: (offset into `memory`, bytes usable from there) of a kernel's buffer;
        by default `memory`'s own addresses, to the end of the allocation."""
        self.mem, self.ex = memory, cl.HostExecutor("mock GPU")
        self.resolve = resolve or (lambda va: (va - GPU_BASE, memory.extent(va)))
        self.host = cl.ffi.from_buffer(memory.map)  # pins the mapping the buffers compute in
        self.kernels: dict[tuple, object] = {}
        self.subs: dict[tuple[int, int], object] = {}

    def _sub(self, va: int):
        """A buffer on the page holding `va`'s offset, then a sub-buffer at the offset within
        that page (the alignment PoCL saw when one buffer held all the memory)."""
        off, n = self.resolve(va)
        if (off, n) not in self.subs:
            inside = off % PAGE
            page = self.ex.buffer(self.host + (off - inside), inside + n)
            self.subs[off, n] = page, self.ex.sub(page, inside, n) if inside else page
        return self.subs[off, n][1]

    def run(self, source: str, name: str, pointers: list[int], glob, local) -> None:
        program = self.ex.program(source.encode("latin-1"))
        if (id(program), name) not in self.kernels:
            self.kernels[id(program), name] = self.ex.kernel(program, name)
        self.ex.launch(self.kernels[id(program), name], [self._sub(va) for va in pointers],
                       glob, local, name)

    def finish(self) -> None:
        self.ex.finish()
