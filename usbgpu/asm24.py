"""The ASMedia ASM24xx USB-to-PCIe bridge (ASM2464PD) as a PCIe requester, from public facts.

Transport (USB Attached SCSI, UAS): interface 0 alternate setting 1, four bulk endpoints: command
out 0x04, status in 0x83, data in 0x81, data out 0x02; status and data use USB3 bulk streams,
the stream id being the command's tag. A command is a 32-byte Command IU (id 0x01, tag big-endian
at bytes 2-3, LUN 0, the CDB at 16); its answer is a Sense IU (id 0x03, tag at 2-3, SCSI status at
byte 6: 0 GOOD, 2 CHECK CONDITION).

Vendor CDBs of the bridge's firmware (tinygrad's usb.py, nimlgen/asm23_and_24's notes):
  E4 n a2 a1 a0 0   read n <= 255 bytes of the 8051's XDATA at 24-bit address a (data in)
  E5 v a2 a1 a0 0   write byte v to XDATA address a
  XDATA addresses are sent as (addr & 0x1FFFF) | 0x500000.
  8A 0 LBA(8) blocks(4) 0 0   SCSI WRITE(16) of 8 x 512 bytes: lands in the bridge's SRAM at XDATA
                      0xF000, which PCIe devices read at bus address 0x200000 (the DMA window).

PCIe requests go through XDATA registers: 0xB220 data (big-endian, shifted to the byte lane),
0xB218 address bits 31:0 and 0xB21C bits 63:32 (big-endian each), 0xB217 byte enables, 0xB210 TLP
fmt/type (0x00/0x40 memory read/write with a 3-dword header: 32-bit address, 0xB21C unused;
0x20/0x60 the same with a 4-dword header: 64-bit address, as tinygrad's pcie_mem_req sends every
memory request; 0x04/0x05 config read type 0/1, 0x44/0x45 config write), then 0x0F to 0xB254
starts it with 0x04 in 0xB296. keel sends the 3-dword form below 4 GiB (the PCIe base spec's
rule) and the 4-dword form above, where a resized VRAM BAR lives (usbgpu/pci.py). Posted writes
are not waited for. Otherwise 0xB296 bit 1 means done and bit 0 an error to clear (write 1) and
retry; the completion header is at 0xB22A (status in bits 15:13, byte count in 11:0) and 0xB284
bit 0 tells a config read's completion from a write's.
"""
from __future__ import annotations

import struct

from runner.errors import DeviceError
from usbgpu.libusb import ffi

EP_DATA_IN, EP_STATUS_IN, EP_DATA_OUT, EP_CMD_OUT = 0x81, 0x83, 0x02, 0x04
ALT_SETTING = 1
STREAMS = 16  # commands in flight per batch (stream ids 1..16)
# (vid, pid) the bridge enumerates with: ASMedia's stock ASM2464PD, then the id of tinygrad's
# public custom firmware; the first one present is opened
IDS = ((0x174C, 0x2464), (0x2D01, 0x3666))
IU_COMMAND, IU_SENSE = 0x01, 0x03
GOOD, CHECK_CONDITION = 0, 2
XDATA_READ, XDATA_WRITE, WRITE16 = 0xE4, 0xE5, 0x8A
XDATA_TAG = 0x500000
MAX_READ = 255
WINDOW_XDATA, WINDOW_BUS, WINDOW_BYTES = 0xF000, 0x200000, 4096
# The window is the first 4 KiB of a larger SRAM region the GPU reads from bus 0x200000: tinygrad's
# stock-firmware controller (tinygrad 770a5585, runtime/support/usb.py scsi_write and
# ops_amd.py's dma region 0x200000 + 0x80000) puts the PSP's firmware buffer there. A WRITE(16)
# of at most SMALL_WRITE bytes lands at the region's start (the window writes); a longer buffer
# goes as CHUNK-byte WRITE(16)s (the buffer zero-padded to whole chunks) that land one after
# another, followed by zeroing FILL_RESET..+3, which returns the fill to the start (keel zeroes
# it before the chunks too, so a write cut short cannot shift the next one).
# UNVERIFIED beyond tinygrad's use of it: what those XDATA bytes mean, and the region's size.
SRAM_BYTES, CHUNK, SMALL_WRITE, FILL_RESET = 0x80000, 0x10000, 0x4000, 0xCE40
# TLP registers in XDATA
REG_FMT, REG_BE, REG_ADDR, REG_ADDR_HI, REG_DATA = 0xB210, 0xB217, 0xB218, 0xB21C, 0xB220
REG_KICK, REG_STATUS, REG_COMPLETION, REG_CPL_FLAGS = 0xB254, 0xB296, 0xB22A, 0xB284
MEM_READ, MEM_WRITE, CFG_READ, CFG_WRITE = 0x00, 0x40, 0x04, 0x44
WIDE = 0x20  # fmt bit 5: a 4-dword header, whose address is 64 bits
RETRIES = 10
CPL_STATUS = {0: "successful", 1: "unsupported request", 2: "configuration retry", 4: "abort"}
# The stock firmware's version: 6 bytes of XDATA at FW_VERSION, shown as YYMMDD_CC_VV_VV (the
# `info` command of cyrozap's usb-to-pcie-re, ASM2x6x/tools/asm2x6x_tool.py, reads it so on
# ASM236x and ASM246x alike; docs/doctor.md). UNVERIFIED on a custom firmware, which need not
# keep it there.
FW_VERSION, FW_VERSION_BYTES = 0x07F0, 6
# After a WRITE(16) into the window tinygrad's controller rewrites these two XDATA locations
# (their meaning is not public; without them the next WRITE(16) is not accepted on hardware).
WINDOW_REARM = ((0x171, b"\xff\xff\xff"), (0xCE6E, b"\x00\x00"))


def command_iu(tag: int, cdb: bytes) -> bytes:
    if len(cdb) > 16:
        raise ValueError(f"CDB of {len(cdb)} bytes; a Command IU holds 16")
    return bytes([IU_COMMAND, 0]) + struct.pack(">H", tag) + bytes(12) + cdb.ljust(16, b"\0")


def xdata_cdb(op: int, arg: int, addr: int) -> bytes:
    a = (addr & 0x1FFFF) | XDATA_TAG
    return struct.pack(">BBBHB", op, arg, a >> 16, a & 0xFFFF, 0)


def mem_fmt(address: int, write: bool) -> int:
    """A memory request's fmt/type: the 4-dword header (64-bit address) at 4 GiB and above."""
    if not 0 <= address < 1 << 64:
        raise ValueError(f"PCIe memory address 0x{address:x} is not 64 bits")
    return (MEM_WRITE if write else MEM_READ) | (WIDE if address >> 32 else 0)


class Bridge:
    """Commands to one ASM24xx over `usb` (usbgpu.libusb.Usb or anything with its run())."""

    def __init__(self, usb, timeout_s: float = 1.0):
        self.usb, self.timeout_s = usb, timeout_s
        self.cache: dict[int, bytes] = {}  # TLP register -> the bytes we last wrote there
        self.commands_sent = 0  # CDBs, for tools/bench_amd_load.py
        self.bufs = [(ffi.new("unsigned char[32]"), ffi.new("unsigned char[64]"),
                      ffi.new(f"unsigned char[{CHUNK}]")) for _ in range(STREAMS)]

    def commands(self, cmds: list[tuple[bytes, int, bytes | None]]) -> list[bytes]:
        """Run (cdb, bytes to read, bytes to write) commands, STREAMS at a time; the data read
        by each. DeviceError for a command the bridge refused (CHECK CONDITION)."""
        out = []
        for cdb, n_in, data in cmds:  # each stream's buffer holds one CHUNK
            if n_in > CHUNK or (data is not None and len(data) > CHUNK):
                raise ValueError(f"CDB {cdb.hex()} moves {max(n_in, len(data or b''))} bytes; "
                                 f"a command moves at most {CHUNK}")
        self.commands_sent += len(cmds)
        for at in range(0, len(cmds), STREAMS):
            chunk = cmds[at:at + STREAMS]
            batch = []
            for slot, (cdb, n_in, data) in enumerate(chunk):
                cmd, stat, dbuf = self.bufs[slot]
                tag = slot + 1
                ffi.memmove(cmd, command_iu(tag, cdb), 32)
                batch += [(EP_STATUS_IN, tag, stat, 64), (EP_CMD_OUT, 0, cmd, 32)]
                if n_in:
                    batch.append((EP_DATA_IN, tag, dbuf, n_in))
                if data is not None:
                    ffi.memmove(dbuf, data, len(data))
                    batch.append((EP_DATA_OUT, tag, dbuf, len(data)))
            self.usb.run(batch, self.timeout_s)
            for slot, (cdb, n_in, _) in enumerate(chunk):
                cmd, stat, dbuf = self.bufs[slot]
                iu = bytes(ffi.buffer(stat, 8))
                if iu[0] != IU_SENSE or iu[2:4] != struct.pack(">H", slot + 1) or iu[6] != GOOD:
                    raise DeviceError(f"bridge refused CDB {cdb.hex()}: sense IU {iu.hex()}, "
                                      f"expected id 03, tag {slot + 1}, status GOOD")
                out.append(bytes(ffi.buffer(dbuf, n_in)) if n_in else b"")
        return out

    # ---- the 8051's XDATA ---------------------------------------------------------------------
    def write(self, addr: int, data: bytes) -> None:
        self.commands(self._writes([(addr, data)], cached=False))

    def read(self, addr: int, n: int) -> bytes:
        sizes = [(o, min(MAX_READ, n - o)) for o in range(0, n, MAX_READ)]
        return b"".join(self.commands([(xdata_cdb(XDATA_READ, k, addr + o), k, None)
                                       for o, k in sizes]))

    def firmware_version(self) -> str:
        return "{:02X}{:02X}{:02X}_{:02X}_{:02X}_{:02X}".format(
            *self.read(FW_VERSION, FW_VERSION_BYTES))

    # ---- the DMA window -------------------------------------------------------------------------
    def window_write(self, data: bytes, then: tuple[int, int] | None = None) -> None:
        """Put up to 4 KiB where PCIe devices read bus address WINDOW_BUS; `then` = (address,
        value): a posted 32-bit memory write (a doorbell) issued after it in the same batch."""
        if len(data) > WINDOW_BYTES:
            raise ValueError(f"window write of {len(data)} bytes; the window is {WINDOW_BYTES}")
        cdb = struct.pack(">BBQIBB", WRITE16, 0, 0, WINDOW_BYTES // 512, 0, 0)
        ops = [(cdb, 0, data.ljust(WINDOW_BYTES, b"\0"))] + self._writes(WINDOW_REARM, cached=False)
        if then is not None:
            ops += self._tlp_ops(mem_fmt(then[0], True), then[0], then[1], 4)
        self.commands(ops)

    def sram_write(self, data) -> None:
        """Put up to SRAM_BYTES where PCIe devices read bus address WINDOW_BUS onwards: CHUNK
        bytes per WRITE(16), each followed by the window's re-arm writes, between fill resets.
        `data`: bytes, or a list of bytes-like pieces laid end to end; a chunk that lies inside
        one piece is a view of it, so its bytes are copied once, into the transfer buffer."""
        pieces = [memoryview(p).cast("B") for p in (data if isinstance(data, list) else [data])]
        total = sum(map(len, pieces))
        if total > SRAM_BYTES:
            raise ValueError(f"SRAM write of {total} bytes; the region is {SRAM_BYTES}")
        if total <= SMALL_WRITE:
            data = b"".join(pieces)
            data = data.ljust(-(-len(data) // 512) * 512, b"\0")
            self.commands([(struct.pack(">BBQIBB", WRITE16, 0, 0, len(data) // 512, 0, 0), 0,
                            data)] + self._writes(WINDOW_REARM, cached=False))
            return
        pieces.append(memoryview(bytes(-total % CHUNK)))  # zero-padded to whole chunks
        cdb = struct.pack(">BBQIBB", WRITE16, 0, 0, CHUNK // 512, 0, 0)
        # the fill reset before as well: a write cut short (an unplug, a timeout) must not leave
        # the next one starting where it stopped
        ops = self._writes([(FILL_RESET, bytes(4))], cached=False)
        for chunk in _chunks(pieces, CHUNK):
            ops += [(cdb, 0, chunk)] + self._writes(WINDOW_REARM, cached=False)
        self.commands(ops + self._writes([(FILL_RESET, bytes(4))], cached=False))

    def window_read(self, offset: int, n: int) -> bytes:
        return self.read(WINDOW_XDATA + offset, n)

    # ---- PCIe -----------------------------------------------------------------------------------
    def tlp(self, fmt: int, address: int, value: int | None = None, size: int = 4,
            tries: int = RETRIES) -> int | None:
        """One PCIe request of 1-4 bytes within a dword; a read's value. A request the link
        failed is reissued, `tries` times at most."""
        self.commands(self._tlp_ops(fmt, address, value, size))
        if fmt & ~WIDE == MEM_WRITE:
            return None  # posted
        self.cache.pop(REG_DATA, None)  # the completion's data lands there
        return self._completion(fmt, address, value, size, tries)

    def _tlp_ops(self, fmt: int, address: int, value: int | None, size: int) -> list:
        lane = address & 3
        if not 0 < size <= 4 - lane:
            raise ValueError(f"PCIe request of {size} bytes at byte {lane} crosses a dword")
        regs = [] if value is None else [(REG_DATA, struct.pack(">I", value << (8 * lane)))]
        regs += [(REG_ADDR, struct.pack(">I", address & 0xFFFFFFFC)),
                 (REG_ADDR_HI, struct.pack(">I", address >> 32)),
                 (REG_BE, bytes([((1 << size) - 1) << lane])), (REG_FMT, bytes([fmt]))]
        return self._writes(regs, cached=True) + \
            self._writes([(REG_KICK, b"\x0f"), (REG_STATUS, b"\x04")], cached=False)

    def _writes(self, regs, cached: bool) -> list:
        """E5 commands writing each (address, bytes); with `cached`, bytes the TLP registers
        already hold (as last written by us) are skipped."""
        ops = []
        for a, v in regs:
            old = self.cache.get(a) if cached else None
            for i, b in enumerate(v):
                if old is None or old[i] != b:
                    ops.append((xdata_cdb(XDATA_WRITE, b, a + i), 0, None))
            if cached:
                self.cache[a] = v
        return ops

    def _completion(self, fmt: int, address: int, value, size: int, tries: int) -> int | None:
        for _ in range(RETRIES):
            stat = self.read(REG_STATUS, 1)[0]
            if stat & 2:
                break
            if stat & 1:  # the request failed on the link: clear and reissue
                self.write(REG_STATUS, b"\x01")
                if tries <= 1:
                    raise DeviceError(f"PCIe request 0x{fmt:02x} at 0x{address:x}: failed on "
                                      f"the link {RETRIES} times")
                return self.tlp(fmt, address, value, size, tries - 1)
        else:
            raise DeviceError(f"PCIe request 0x{fmt:02x} at 0x{address:x}: no completion after "
                              f"{RETRIES} polls of 0x{REG_STATUS:x}")
        cpl, = struct.unpack(">H", self.read(REG_COMPLETION, 2))
        status = cpl >> 13
        if status:
            raise DeviceError(f"PCIe request 0x{fmt:02x} at 0x{address:x}: completion status "
                              f"{CPL_STATUS.get(status, status)}, expected successful")
        if value is not None:
            return None
        data, = struct.unpack(">I", self.read(REG_DATA, 4))
        return (data >> (8 * (address & 3))) & ((1 << (8 * size)) - 1)

    def config(self, bus: int, dev: int, fn: int, reg: int, value: int | None = None,
               size: int = 4) -> int | None:
        """Config space access; type 1 (forwarded by bridges) for any bus past the first."""
        fmt = (CFG_WRITE if value is not None else CFG_READ) | int(bus > 0)
        return self.tlp(fmt, (bus << 24) | (dev << 19) | (fn << 16) | (reg & 0xFFF), value, size)

    def mem(self, address: int, value: int | None = None, size: int = 4) -> int | None:
        return self.tlp(mem_fmt(address, value is not None), address, value, size)


def _chunks(pieces: list[memoryview], size: int):
    """The pieces' bytes, end to end, cut into `size`-byte chunks: a view where a chunk lies
    inside one piece, else the parts joined."""
    parts, have = [], 0
    for p in pieces:
        while len(p):
            k = min(len(p), size - have)
            parts.append(p[:k])
            p, have = p[k:], have + k
            if have == size:
                yield parts[0] if len(parts) == 1 else b"".join(parts)
                parts, have = [], 0
    if have:
        yield b"".join(parts)
