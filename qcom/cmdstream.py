"""PM4 command streams for the Adreno 6xx command processor (CP): packet builders and a decoder.

A stream is a list of u32 words. Two packet kinds carry everything keel sends:
- type 4, a register write: header, then `count` values for registers reg, reg+1, ...
    bits 0-6 count | 7 odd parity of count | 8-25 register | 27 odd parity of register | 28-31 0x4
- type 7, an opcode: header, then `count` payload words
    bits 0-13 count | 15 odd parity of count | 16-22 opcode | 23 odd parity of opcode | 28-31 0x7
The parity bits let the CP catch a corrupted header before it runs it, so the decoder checks them
too (a bit flipped by a patching bug is caught here, not by a GPU hang).

Facts: header layout from Linux's adreno_pm4types.h (cp_type4_packet/cp_type7_packet) and Mesa's
freedreno_pm4.h. Registers from Mesa's src/freedreno/registers/adreno/a6xx.xml
(mirror/mesa@1b5e42ed, the A6XX variants: a7xx moved several of these); opcodes from its
adreno_pm4.xml (mirror/mesa@8334434e); payload layouts (CP_LOAD_STATE6, CP_EVENT_WRITE,
CP_WAIT_REG_MEM, CP_REG_TO_MEM) from adreno_pm4.xml in freedreno/envytools@d88cafa, the database
Mesa's grew from.
CP_INDIRECT_BUFFER's payload (address lo, hi, size in dwords) is the kernel's own use of it in the
a6xx ringbuffer code.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

TYPE4, TYPE7 = 0x4, 0x7

# type-7 opcodes keel's compute streams use
OPCODES = {
    "CP_NOP": 0x10, "CP_WAIT_MEM_WRITES": 0x12, "CP_WAIT_FOR_IDLE": 0x26, "CP_RUN_OPENCL": 0x31,
    "CP_EXEC_CS": 0x33, "CP_LOAD_STATE6_FRAG": 0x34, "CP_LOAD_STATE6": 0x36,
    "CP_WAIT_REG_MEM": 0x3C, "CP_MEM_WRITE": 0x3D, "CP_REG_TO_MEM": 0x3E,
    "CP_INDIRECT_BUFFER": 0x3F, "CP_EVENT_WRITE": 0x46, "CP_SET_MARKER": 0x65,
}
OPNAMES = {v: k for k, v in OPCODES.items()}

# a6xx registers a compute dispatch programs (dword offsets; Mesa's names, its 64-bit registers
# split into _LO/_HI dwords)
REGISTERS = {
    "SP_CS_CTRL_REG0": 0xA9B0, "SP_CS_UNKNOWN_A9B1": 0xA9B1, "SP_CS_BRANCH_COND": 0xA9B2,
    "SP_CS_OBJ_FIRST_EXEC_OFFSET": 0xA9B3,
    "SP_CS_OBJ_START_LO": 0xA9B4, "SP_CS_OBJ_START_HI": 0xA9B5,
    "SP_CS_PVT_MEM_PARAM": 0xA9B6, "SP_CS_PVT_MEM_ADDR_LO": 0xA9B7, "SP_CS_PVT_MEM_ADDR_HI": 0xA9B8,
    "SP_CS_PVT_MEM_SIZE": 0xA9B9, "SP_CS_TEX_COUNT": 0xA9BA, "SP_CS_CONFIG": 0xA9BB,
    "SP_CS_INSTRLEN": 0xA9BC, "SP_CS_PVT_MEM_HW_STACK_OFFSET": 0xA9BD,
    "SP_CS_TEX_SAMP_LO": 0xA9E2, "SP_CS_TEX_SAMP_HI": 0xA9E3,
    "SP_CS_TEX_CONST_LO": 0xA9E6, "SP_CS_TEX_CONST_HI": 0xA9E7,
    "SP_CS_IBO_LO": 0xA9F2, "SP_CS_IBO_HI": 0xA9F3, "SP_CS_IBO_COUNT": 0xAA00,
    "SP_MODE_CONTROL": 0xAB00, "SP_FLOAT_CNTL": 0xAE04, "SP_PERFCTR_ENABLE": 0xAE0F,
    "SP_PS_TP_BORDER_COLOR_BASE_ADDR_LO": 0xB180, "SP_PS_TP_BORDER_COLOR_BASE_ADDR_HI": 0xB181,
    "SP_TP_MODE_CNTL": 0xB309, "HLSQ_CS_CNTL": 0xB987,
    "HLSQ_CS_NDRANGE_0": 0xB990, "HLSQ_CS_NDRANGE_1": 0xB991, "HLSQ_CS_NDRANGE_2": 0xB992,
    "HLSQ_CS_NDRANGE_3": 0xB993, "HLSQ_CS_NDRANGE_4": 0xB994, "HLSQ_CS_NDRANGE_5": 0xB995,
    "HLSQ_CS_NDRANGE_6": 0xB996, "HLSQ_CS_CNTL_0": 0xB997, "HLSQ_CS_CNTL_1": 0xB998,
    "HLSQ_CS_KERNEL_GROUP_X": 0xB999, "HLSQ_CS_KERNEL_GROUP_Y": 0xB99A,
    "HLSQ_CS_KERNEL_GROUP_Z": 0xB99B, "HLSQ_INVALIDATE_CMD": 0xBB08,
}
REGNAMES = {v: k for k, v in REGISTERS.items()}
# 64-bit GPU addresses held in a LO/HI register pair, keyed by the LO register
ADDRESS_REGS = {REGISTERS[n + "_LO"]: n for n in
                ("SP_CS_OBJ_START", "SP_CS_PVT_MEM_ADDR", "SP_CS_TEX_SAMP", "SP_CS_TEX_CONST",
                 "SP_CS_IBO", "SP_PS_TP_BORDER_COLOR_BASE_ADDR")}

# enum values used in payloads
RM6_COMPUTE = 8  # CP_SET_MARKER mode
CACHE_FLUSH_TS, CACHE_FLUSH, CACHE_INVALIDATE = 4, 6, 49  # CP_EVENT_WRITE events
ST6_SHADER, ST6_CONSTANTS, ST6_UBO, ST6_IBO = 0, 1, 2, 3  # CP_LOAD_STATE6 state type
SS6_DIRECT, SS6_INDIRECT = 0, 2  # CP_LOAD_STATE6 state source
SB6_CS_TEX, SB6_CS_SHADER = 0x5, 0xD  # CP_LOAD_STATE6 state block (compute IBOs: ST6_IBO)
WAIT_POLL_MEMORY = 1 << 4  # CP_WAIT_REG_MEM dword 0
# CP_REG_TO_MEM dword 0: REG bits 0-17, CNT 18-29, 64B bit 30, ACCUMULATE bit 31 (Linux's
# a6xx_gpu.c get_stats_counter, which reads the counters below this way, CNT 2 with 64B)
REG_TO_MEM_64B, REG_TO_MEM_ACCUMULATE = 1 << 30, 1 << 31
# the 64-bit always-on counter (a6xx.xml reg64 0x0980), 19.2 MHz (Mesa turnip's timestamp
# period): what Mesa's and Linux's timestamps read
CP_ALWAYS_ON_COUNTER, ALWAYS_ON_HZ = 0x0980, 19_200_000


def odd_parity(value: int) -> int:
    """The bit that gives `value` plus the bit an odd number of ones."""
    for shift in (16, 8, 4):
        value ^= value >> shift
    return (0x9669 >> (value & 0xF)) & 1  # bit n of 0x9669: 1 when n has an even number of ones


def pkt4(reg: int, *values: int) -> list[int]:
    if not 1 <= len(values) <= 0x7F or not 0 <= reg <= 0x3FFFF:
        raise ValueError(f"type-4 write of {len(values)} values at register {reg:#x}: "
                         f"1..127 values, register below 0x40000")
    n = len(values)
    head = TYPE4 << 28 | odd_parity(reg) << 27 | reg << 8 | odd_parity(n) << 7 | n
    return [head, *(v & 0xFFFFFFFF for v in values)]


def pkt7(opcode: int, *payload: int) -> list[int]:
    if not 0 <= opcode <= 0x7F or len(payload) > 0x3FFF:
        raise ValueError(f"type-7 packet opcode {opcode:#x} with {len(payload)} words: "
                         f"opcode below 0x80, at most 16383 words")
    n = len(payload)
    head = TYPE7 << 28 | odd_parity(opcode) << 23 | opcode << 16 | odd_parity(n) << 15 | n
    return [head, *(v & 0xFFFFFFFF for v in payload)]


def counter_to_mem(address: int) -> list[int]:
    """CP_REG_TO_MEM of the always-on counter's two dwords, as one 64-bit write to `address`."""
    return pkt7(OPCODES["CP_REG_TO_MEM"], CP_ALWAYS_ON_COUNTER | 2 << 18 | REG_TO_MEM_64B,
                *lohi(address))


def lohi(addr: int) -> tuple[int, int]:
    return addr & 0xFFFFFFFF, addr >> 32


class StreamError(ValueError):
    """A malformed stream: says which packet, at which dword, and what is wrong."""


class Packet(NamedTuple):
    index: int  # packet number within its buffer
    at: int  # dword offset of the header
    kind: int  # TYPE4 or TYPE7
    code: int  # register (type 4) or opcode (type 7)
    payload: tuple
    ib: int = 0  # nesting level: 0 for the submitted buffer, 1 inside a CP_INDIRECT_BUFFER

    @property
    def name(self) -> str:
        return REGNAMES[self.code] if self.kind == TYPE4 else OPNAMES[self.code]


def _header(word: int, index: int, at: int) -> tuple[int, int, int]:
    """(kind, code, count) of one header word, or StreamError naming what is wrong."""
    where = f"packet {index} (dword {at}, header {word:#010x})"
    kind = word >> 28
    if kind == TYPE4:
        count, reg = word & 0x7F, (word >> 8) & 0x3FFFF
        if word & (1 << 26):
            raise StreamError(f"{where}: type-4 header has reserved bit 26 set")
        if (word >> 7) & 1 != odd_parity(count) or (word >> 27) & 1 != odd_parity(reg):
            raise StreamError(f"{where}: bad parity in type-4 header (count {count}, "
                              f"register {reg:#x})")
        if count == 0:
            raise StreamError(f"{where}: type-4 write of zero registers")
        return kind, reg, count
    if kind == TYPE7:
        count, op = word & 0x3FFF, (word >> 16) & 0x7F
        if word & (1 << 14 | 0xF << 24):
            raise StreamError(f"{where}: type-7 header has reserved bits set")
        if (word >> 15) & 1 != odd_parity(count) or (word >> 23) & 1 != odd_parity(op):
            raise StreamError(f"{where}: bad parity in type-7 header (opcode {op:#x}, "
                              f"count {count})")
        return kind, op, count
    raise StreamError(f"{where}: packet type {kind} is not 4 or 7")


def split(words: Sequence[int], ib: int = 0) -> list[Packet]:
    """Cut a stream into packets, checking headers, lengths and that every name is known."""
    out, at = [], 0
    while at < len(words):
        index, head = len(out), int(words[at])
        kind, code, count = _header(head, index, at)
        where = f"packet {index} (dword {at})"
        if at + 1 + count > len(words):
            raise StreamError(f"{where}: {count} payload words run past the end of the "
                              f"{len(words)}-dword buffer")
        if kind == TYPE7 and code not in OPNAMES:
            raise StreamError(f"{where}: unknown type-7 opcode {code:#x}")
        if kind == TYPE4:
            unknown = [r for r in range(code, code + count) if r not in REGNAMES]
            if unknown:
                raise StreamError(f"{where}: type-4 write to register {unknown[0]:#x}, which is "
                                  f"not in qcom's a6xx register table")
        payload = tuple(int(w) for w in words[at + 1:at + 1 + count])
        out.append(Packet(index, at, kind, code, payload, ib))
        at += 1 + count
    return out


# --- what each opcode's payload must hold, and which GPU memory it touches ---
PAYLOAD = {  # opcode name -> (fewest words, most words); None: no limit
    "CP_NOP": (0, None), "CP_WAIT_MEM_WRITES": (0, 0), "CP_WAIT_FOR_IDLE": (0, 0),
    "CP_RUN_OPENCL": (1, 1), "CP_EXEC_CS": (4, 4), "CP_LOAD_STATE6_FRAG": (1, None),
    "CP_LOAD_STATE6": (1, None), "CP_WAIT_REG_MEM": (6, 6), "CP_MEM_WRITE": (3, None),
    "CP_REG_TO_MEM": (3, 3), "CP_INDIRECT_BUFFER": (3, 3), "CP_EVENT_WRITE": (1, 4),
    "CP_SET_MARKER": (1, 1),
}
# CP_LOAD_STATE6 unit sizes in bytes, by (state block, state type): shader code comes in
# 128-byte units, constants in vec4s, texture/IBO descriptors are 16 dwords, samplers 4, UBOs 2
STATE_UNIT = {(SB6_CS_SHADER, ST6_SHADER): 128, (SB6_CS_SHADER, ST6_CONSTANTS): 16,
              (SB6_CS_SHADER, ST6_UBO): 8, (SB6_CS_SHADER, ST6_IBO): 64,
              (SB6_CS_TEX, ST6_SHADER): 16, (SB6_CS_TEX, ST6_CONSTANTS): 64}


def _addr(p: tuple, lo: int) -> int:
    return p[lo] | p[lo + 1] << 32


def _load_state(p: tuple) -> list[tuple[int, int, str]]:
    block, kind, src, units = (p[0] >> 18) & 0xF, (p[0] >> 14) & 3, (p[0] >> 16) & 3, p[0] >> 22
    if src != SS6_INDIRECT:
        return []
    if len(p) != 3:
        raise ValueError(f"indirect load takes 3 words, got {len(p)}")
    if (block, kind) not in STATE_UNIT:
        raise ValueError(f"state block {block:#x} with state type {kind} is not one qcom loads")
    return [(_addr(p, 1), units * STATE_UNIT[block, kind], "state source")]


def _memory(name: str, p: tuple) -> list[tuple[int, int, str]]:
    """(gpuaddr, bytes, what) for every GPU address in one type-7 payload."""
    if name.startswith("CP_LOAD_STATE6"):
        return _load_state(p)
    if name == "CP_INDIRECT_BUFFER":
        return [(_addr(p, 0), p[2] * 4, "indirect buffer")]
    if name == "CP_MEM_WRITE":
        return [(_addr(p, 0), (len(p) - 2) * 4, "write destination")]
    if name == "CP_REG_TO_MEM":
        return [(_addr(p, 1), max((p[0] >> 18) & 0xFFF, 1) * 4, "register copy destination")]
    if name == "CP_WAIT_REG_MEM" and p[0] & WAIT_POLL_MEMORY:
        return [(_addr(p, 1), 4, "polled word")]
    if name == "CP_EVENT_WRITE" and len(p) == 4:
        return [(_addr(p, 1), 4, "event write destination")]
    if name == "CP_EVENT_WRITE" and len(p) != 1:
        raise ValueError(f"takes 1 word, or 4 with an address and a value, got {len(p)}")
    return []


def _reg_memory(pk: Packet) -> list[tuple[int, int, str]]:
    """GPU addresses a type-4 write sets; 0 means unbound and is allowed."""
    out, regs = [], range(pk.code, pk.code + len(pk.payload))
    for lo, name in ADDRESS_REGS.items():
        if (lo in regs) != (lo + 1 in regs):
            raise ValueError(f"writes only half of the address pair {name}_LO/HI")
        if lo in regs and _addr(pk.payload, lo - pk.code):
            out.append((_addr(pk.payload, lo - pk.code), 1, name))
    return out


def _check(pk: Packet, spans: list[tuple[int, int]]) -> list[tuple[int, int, str]]:
    if pk.kind == TYPE4:
        touched = _reg_memory(pk)
    else:
        least, most = PAYLOAD[pk.name]
        if len(pk.payload) < least or (most is not None and len(pk.payload) > most):
            raise ValueError(f"payload of {len(pk.payload)} words, expected "
                             f"{least}..{'' if most is None else most}")
        touched = _memory(pk.name, pk.payload)
    for addr, size, what in touched:
        if not any(base <= addr and addr + size <= base + n for base, n in spans):
            raise ValueError(f"{what} {addr:#x}+{size} lies outside every allocation")
    return touched


def decode(words: Sequence[int], allocations, read: Callable[[int, int], Sequence[int]] = None,
           ib: int = 0) -> list[Packet]:
    """Every packet of a stream in execution order, checked: headers and parity, known opcodes and
    registers, payload lengths, and every GPU address inside one of `allocations` ((gpuaddr,
    bytes) pairs). With `read(gpuaddr, dwords)`, CP_INDIRECT_BUFFER targets are decoded too (one
    level: the CP runs IB1 from the ring and IB2 from IB1, no deeper)."""
    spans, out = [(int(a), int(n)) for a, n in allocations], []
    for pk in split(words, ib):
        try:
            touched = _check(pk, spans)
        except ValueError as e:
            raise StreamError(f"{'IB2 ' if ib else ''}packet {pk.index} (dword {pk.at}, "
                              f"{pk.name}): {e}") from None
        out.append(pk)
        if pk.kind == TYPE7 and pk.name == "CP_INDIRECT_BUFFER" and read is not None:
            if ib:
                raise StreamError(f"IB2 packet {pk.index} (dword {pk.at}): an indirect buffer "
                                  f"inside an indirect buffer goes deeper than the CP's IB2")
            out += decode(read(touched[0][0], pk.payload[2]), spans, read, ib + 1)
    return out


def format_stream(packets: list[Packet]) -> str:
    """One line per register written or opcode run, indented by indirect-buffer level."""
    lines = []
    for pk in packets:
        pad, tag = "  " * pk.ib, f"#{pk.index:<3} @{pk.at:<5}"
        if pk.kind == TYPE4:
            lines += [f"{pad}{tag} {REGNAMES[pk.code + i]} = {v:#x}"
                      for i, v in enumerate(pk.payload)]
        else:
            lines.append(f"{pad}{tag} {pk.name} " + " ".join(f"{v:#x}" for v in pk.payload))
    return "\n".join(lines)
