"""PM4 type-3 packets for a gfx11 compute queue: the encoder am/ records with, and the decoder the
mock GPU executes from (it rejects what the command processor would not accept).

Facts from the Linux amdgpu sources (nvd.h, gfx_v11_0.c) and Mesa's sid.h:
  header = 3 << 30 | (body dwords - 1) << 16 | opcode << 8; bit 1 marks a compute-shader packet.
  SET_SH_REG (0x76): body[0] = register dword address - 0x2C00, then consecutive values.
  DISPATCH_DIRECT (0x15): work-groups x, y, z, then COMPUTE_DISPATCH_INITIATOR
    (bit 0 COMPUTE_SHADER_EN, bit 2 FORCE_START_AT_000, bit 15 CS_W32_EN for wave32 code).
  RELEASE_MEM (0x49, 7 body dwords on gfx10+): event (CACHE_FLUSH_AND_INV_TS_EVENT 0x14, index
    5) and cache actions; DATA_SEL (bits 31:29; 2 = 64-bit value, 3 = the 64-bit GPU clock
    counter: pm4_mec_release_mem's send_gpu_clock_counter) and DST_SEL (17:16, 0 = memory);
    address lo, hi; value lo, hi; interrupt context.
  ACQUIRE_MEM (0x58, 7 body dwords on gfx10+): coherence control, size lo/hi, base lo/hi, poll
    interval, GCR_CNTL (which caches to write back / invalidate).
  INDIRECT_BUFFER (0x3F): address lo (dword aligned), hi (16 bits), control = size in dwords
    (bits 19:0) | VALID (bit 23) | VMID (31:24).
  DMA_DATA (0x50, 6 body dwords): control (CP_SYNC bit 31; SRC_SEL 30:29 and DST_SEL 21:20,
    0 = an address), source lo, hi, destination lo, hi, command (BYTE_COUNT in bits 25:0).
  NOP (0x10): any body, skipped.
Compute registers (dword addresses, Mesa sid.h R_00B8xx / 4): listed in REGS.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

NOP, DISPATCH_DIRECT, INDIRECT_BUFFER, RELEASE_MEM, DMA_DATA, ACQUIRE_MEM, SET_SH_REG = \
    0x10, 0x15, 0x3F, 0x49, 0x50, 0x58, 0x76
NAMES = {NOP: "NOP", DISPATCH_DIRECT: "DISPATCH_DIRECT", INDIRECT_BUFFER: "INDIRECT_BUFFER",
         RELEASE_MEM: "RELEASE_MEM", DMA_DATA: "DMA_DATA", ACQUIRE_MEM: "ACQUIRE_MEM",
         SET_SH_REG: "SET_SH_REG"}
BODY = {DISPATCH_DIRECT: 4, INDIRECT_BUFFER: 3, RELEASE_MEM: 7, DMA_DATA: 6,
        ACQUIRE_MEM: 7}  # fixed sizes
SH_START, SH_END = 0x2C00, 0x3000
REGS = {"COMPUTE_DISPATCH_INITIATOR": 0x2E00, "COMPUTE_START_X": 0x2E04,
        "COMPUTE_NUM_THREAD_X": 0x2E07, "COMPUTE_PGM_LO": 0x2E0C, "COMPUTE_PGM_HI": 0x2E0D,
        "COMPUTE_PGM_RSRC1": 0x2E12, "COMPUTE_PGM_RSRC2": 0x2E13,
        "COMPUTE_RESOURCE_LIMITS": 0x2E15, "COMPUTE_TMPRING_SIZE": 0x2E18,
        "COMPUTE_PGM_RSRC3": 0x2E28, "COMPUTE_USER_DATA_0": 0x2E40}
USER_DATA_COUNT = 16
INIT_COMPUTE_SHADER_EN, INIT_FORCE_START_AT_000, INIT_CS_W32_EN = 1, 1 << 2, 1 << 15
EOP_EVENT, EOP_INDEX = 0x14, 5  # CACHE_FLUSH_AND_INV_TS_EVENT, end of pipe
DATA_SEL_64, DATA_SEL_CLOCK = 2, 3  # RELEASE_MEM: a 64-bit value; the 64-bit GPU clock counter
CLOCK_HZ = 100_000_000  # gfx11's GPU clock counter (tinygrad's AMD timestamps: 100 ticks per us)
IB_VALID = 1 << 23
DMA_CP_SYNC, DMA_MAX = 1 << 31, (1 << 26) - 1
# GCR_CNTL of ACQUIRE_MEM: invalidate and write back GL2, invalidate GLV/GLK/GLM/GL1 (what
# gfx_v11_0_emit_mem_sync asks for between dependent dispatches)
GCR_ALL = (1 << 8) | (1 << 9) | (1 << 14) | (1 << 15) | (1 << 4) | (1 << 2) | (1 << 3)


class PacketError(ValueError):
    """A malformed packet; the message names its dword offset and what was expected."""


def header(op: int, body: int, compute: bool = True) -> int:
    return 3 << 30 | (body - 1) << 16 | op << 8 | (2 if compute else 0)


def packet(op: int, *body: int) -> list[int]:
    return [header(op, len(body))] + [v & 0xFFFFFFFF for v in body]


def set_sh(reg: str, *values: int) -> list[int]:
    return packet(SET_SH_REG, REGS[reg] - SH_START, *values)


def dispatch(groups: tuple[int, int, int], wave32: bool = True) -> list[int]:
    init = INIT_COMPUTE_SHADER_EN | INIT_FORCE_START_AT_000 | (INIT_CS_W32_EN if wave32 else 0)
    return packet(DISPATCH_DIRECT, *groups, init)


def acquire_mem() -> list[int]:
    """Wait for earlier dispatches' writes and make them visible to the next (a barrier)."""
    return packet(ACQUIRE_MEM, 0, 0xFFFFFFFF, 0xFFFFFF, 0, 0, 0xA, GCR_ALL)


def release_mem(address: int, value: int) -> list[int]:
    """At end of pipe, with caches written back: write the 64-bit `value` to `address`."""
    if address % 8:
        raise ValueError(f"RELEASE_MEM address 0x{address:x} is not 8-byte aligned")
    return packet(RELEASE_MEM, EOP_EVENT | EOP_INDEX << 8, DATA_SEL_64 << 29,
                  address, address >> 32, value, value >> 32, 0)


def clock_to_mem(address: int) -> list[int]:
    """At end of pipe (everything before it finished): write the GPU clock counter (64-bit) to
    `address`, then a wait for that write (how tinygrad's HCQ timestamps a dispatch)."""
    if address % 8:
        raise ValueError(f"RELEASE_MEM address 0x{address:x} is not 8-byte aligned")
    return packet(RELEASE_MEM, EOP_EVENT | EOP_INDEX << 8, DATA_SEL_CLOCK << 29,
                  address, address >> 32, 0, 0, 0) + acquire_mem()


def indirect_buffer(address: int, dwords: int) -> list[int]:
    if address % 4 or not 0 < dwords < 1 << 20:
        raise ValueError(f"indirect buffer at 0x{address:x} of {dwords} dwords")
    return packet(INDIRECT_BUFFER, address, address >> 32 & 0xFFFF, dwords | IB_VALID)


def dma_data(src: int, dst: int, n: int) -> list[int]:
    """Copy n bytes from GPU address src to dst, finished before the next packet (CP_SYNC)."""
    if not 0 < n <= DMA_MAX:
        raise ValueError(f"DMA_DATA of {n} bytes; one packet moves 1..{DMA_MAX}")
    return packet(DMA_DATA, DMA_CP_SYNC, src, src >> 32, dst, dst >> 32, n)


def nop(dwords: int) -> list[int]:
    """Filler of `dwords` >= 2 dwords in total."""
    return packet(NOP, *[0] * (dwords - 1))


@dataclass(frozen=True)
class Packet:
    at: int  # dword offset in its buffer
    op: int
    body: tuple[int, ...]


def decode(words) -> list[Packet]:
    """Every packet of a command buffer; PacketError for the first malformed one."""
    out, i = [], 0
    while i < len(words):
        h = words[i]
        if h >> 30 != 3:
            raise PacketError(f"dword {i}: header 0x{h:08x} is not a type-3 packet")
        op, n = (h >> 8) & 0xFF, ((h >> 16) & 0x3FFF) + 1
        if op not in NAMES:
            raise PacketError(f"dword {i}: opcode 0x{op:02x} is not one of "
                              f"{', '.join(NAMES.values())}")
        if i + 1 + n > len(words):
            raise PacketError(f"dword {i}: {NAMES[op]} of {n} dwords runs past the buffer's "
                              f"{len(words)}")
        if op in BODY and n != BODY[op]:
            raise PacketError(f"dword {i}: {NAMES[op]} has {n} body dwords, expected {BODY[op]}")
        body = tuple(words[i + 1:i + 1 + n])
        _check(i, op, body)
        out.append(Packet(i, op, body))
        i += 1 + n
    return out


def _check(i: int, op: int, body: tuple[int, ...]) -> None:
    if op == SET_SH_REG and (len(body) < 2 or SH_START + body[0] + len(body) - 2 >= SH_END):
        raise PacketError(f"dword {i}: SET_SH_REG needs a register and a value inside "
                          f"0x{SH_START:x}..0x{SH_END:x}")
    if op == DISPATCH_DIRECT and (not body[3] & INIT_COMPUTE_SHADER_EN or 0 in body[:3]):
        raise PacketError(f"dword {i}: DISPATCH_DIRECT needs COMPUTE_SHADER_EN and non-zero "
                          f"group counts, got {body}")
    if op == INDIRECT_BUFFER and (body[0] % 4 or not body[2] & IB_VALID or
                                  not body[2] & 0xFFFFF):
        raise PacketError(f"dword {i}: INDIRECT_BUFFER needs a dword-aligned address, VALID and "
                          f"a size, got {[hex(b) for b in body]}")
    if op == DMA_DATA and (body[0] & (3 << 29 | 3 << 20) or not body[5] & DMA_MAX):
        raise PacketError(f"dword {i}: DMA_DATA must copy address to address, at least a byte, "
                          f"got control 0x{body[0]:08x} command 0x{body[5]:08x}")
    if op == RELEASE_MEM and (body[0] & 0x3F != EOP_EVENT or
                              (body[1] >> 29) not in (DATA_SEL_64, DATA_SEL_CLOCK) or body[2] % 8):
        raise PacketError(f"dword {i}: RELEASE_MEM must be an end-of-pipe 64-bit write (a value "
                          f"or the GPU clock counter) to an 8-byte aligned address, got "
                          f"{[hex(b) for b in body]}")


def words(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data[:len(data) // 4 * 4]))
