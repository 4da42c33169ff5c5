"""KEEL_USB=mock: libusb's functions over the same struct libusb_transfer bytes, answered by a mock
ASM24xx bridge with a PCIe hierarchy behind it.

`MockLibusb` implements the libusb calls usbgpu/libusb.py makes. Transfers queue until
libusb_handle_events_timeout_completed, which plays the UAS protocol as the bridge does: a Command
IU on endpoint 0x04 names a tag; the command runs once the transfers it needs on that stream
(data out for WRITE(16), data in for an XDATA read, and always status in) are submitted; each
completes with its status and length, and its callback is called. What hardware would refuse is
refused: an unknown CDB or an XDATA address without the 0x50 tag is CHECK CONDITION, a transfer
on another endpoint or stream is LIBUSB_ERROR_INVALID_PARAM, and after `unplug()` every call
fails with LIBUSB_ERROR_NO_DEVICE and pending transfers complete with LIBUSB_TRANSFER_NO_DEVICE.
`hang` stops answering (transfers time out in the host's deadline).

`MockBridge` holds the 8051's XDATA (registers, the 4 KiB DMA window at 0xF000) and turns TLP
register writes (armed by 0x0F in 0xB254, started by 0x04 in 0xB296) into config and memory
requests routed as PCIe does: a config request reaches bus N only through bridges whose
secondary..subordinate range holds N, memory requests only through bridges' memory windows into
an enabled BAR. `Port` is a PCI-to-PCI bridge; the function
at the end is any object with `config` (a `Config`) and `mem_read/mem_write(bar, offset, ...)`
(sim/am/mock_device.py's GPU; `Function` here for tests).

Bring-up faults (KEEL_MOCK_BRINGUP, runner/faults.py's SITES): usb.device=absent puts no bridge
on the bus; usb.link=down leaves the bridge's PCIe link untrained, so nothing past its own port
answers a config request.
"""
from __future__ import annotations

import struct
import time

from runner.errors import DeviceError
from runner.faults import bringup
import usbgpu.asm24 as asm24
from usbgpu.libusb import (CANCELLED, COMPLETED, ERROR_NO_DEVICE, NO_DEVICE, TRANSFER_BULK,
                           TRANSFER_BULK_STREAM, ffi)

ERROR_INVALID_PARAM, ERROR_NOT_FOUND = -2, -5
UR, SC = 1, 0  # completion status: unsupported request, successful
WINDOW_END = asm24.WINDOW_XDATA + asm24.WINDOW_BYTES


REBAR_AT = 0x100  # where a Config with resizable BARs puts that extended capability
EXT_CAP_REBAR = 0x15


def _mib_log2(size: int) -> int:
    """n for a size of 2^n MiB: how the Resizable BAR registers encode sizes."""
    return (size >> 20).bit_length() - 1


class Config:
    """A config space: bytes, a per-byte writable mask, and BAR sizes (write all ones, read the
    size mask back). `resizable` {BAR index: sizes it offers}: a Resizable BAR extended capability
    (PCIe base spec 7.8.6) at REBAR_AT, whose control register's size field changes that BAR's
    size (a size it does not offer is ignored, and a resize clears the BAR's address)."""

    def __init__(self, vid: int, did: int, cls: int, header: int, bars: dict[int, tuple] = None,
                 resizable: dict[int, tuple[int, ...]] = None):
        self.data, self.writable = bytearray(4096), bytearray(4096)
        struct.pack_into("<HH", self.data, 0, vid, did)
        self.data[0x0B], self.data[0x0E] = cls, header
        self.writable[0x04:0x06] = b"\xff\xff"
        self.bars = dict(bars or {})  # index -> (size, flags): flags 0xC = 64-bit prefetchable
        for i, (size, flags) in self.bars.items():
            struct.pack_into("<I", self.data, 0x10 + 4 * i, flags)
            if flags & 4:
                self.writable[0x14 + 4 * i:0x18 + 4 * i] = b"\xff" * 4
        if header == 1:  # bus numbers, memory and prefetchable windows (64-bit capable)
            self.writable[0x18:0x1B] = b"\xff" * 3
            self.writable[0x20:0x30] = b"\xff" * 16
            self.writable[0x24] = self.writable[0x26] = 0xF0
            self.data[0x24] = self.data[0x26] = 1
        self.resizable = dict(resizable or {})
        if self.resizable:  # header (id, version 1, no next), then a capability and control per BAR
            struct.pack_into("<I", self.data, REBAR_AT, EXT_CAP_REBAR | 1 << 16)
        for k, (i, sizes) in enumerate(self.resizable.items()):
            at = REBAR_AT + 8 * k
            struct.pack_into("<I", self.data, at + 4, sum(1 << 4 + _mib_log2(s) for s in sizes))
            ctrl = i | len(self.resizable) << 5 | _mib_log2(self.bars[i][0]) << 8
            struct.pack_into("<I", self.data, at + 8, ctrl)

    def read(self, reg: int) -> int:
        return struct.unpack_from("<I", self.data, reg & ~3)[0]

    def write(self, reg: int, value: int, be: int) -> None:
        base = reg & ~3
        for i in range(4):
            if be >> i & 1:
                self.data[base + i] = (self.data[base + i] & ~self.writable[base + i]) | (
                    (value >> 8 * i) & self.writable[base + i])
        for i, (size, flags) in self.bars.items():
            if base == 0x10 + 4 * i:  # the address bits above the BAR's size, then its flags
                struct.pack_into("<I", self.data, base, (value & ~(size - 1) & 0xFFFFFFF0) | flags)
            if base == 0x14 + 4 * i and flags & 4:  # the upper half, above the size too
                high_mask = ~(size - 1) >> 32 & 0xFFFFFFFF
                struct.pack_into("<I", self.data, base, value & high_mask)
        for k, (i, sizes) in enumerate(self.resizable.items()):
            if base == REBAR_AT + 8 + 8 * k and be & 2:
                self._resize(i, sizes, 1 << 20 + (value >> 8 & 0x3F))

    def _resize(self, i: int, sizes, size: int) -> None:
        if size in sizes and size != self.bars[i][0]:
            self.bars[i] = (size, self.bars[i][1])
            struct.pack_into("<II", self.data, 0x10 + 4 * i, self.bars[i][1], 0)
            k = list(self.resizable).index(i)
            ctrl = self.read(REBAR_AT + 8 + 8 * k) & ~0x3F00 | _mib_log2(size) << 8
            struct.pack_into("<I", self.data, REBAR_AT + 8 + 8 * k, ctrl)

    def bar(self, i: int) -> tuple[int, int]:
        size, flags = self.bars[i]
        lo, hi = struct.unpack_from("<II", self.data, 0x10 + 4 * i)
        return ((lo & ~0xF) | ((hi << 32) if flags & 4 else 0)), size

    @property
    def command(self) -> int:
        return struct.unpack_from("<H", self.data, 4)[0]


class Port:
    """A PCI-to-PCI bridge (header type 1): forwards by bus number, its memory window (32-bit)
    and its prefetchable window (64-bit: the base and limit's upper halves at 0x28 and 0x2C)."""

    def __init__(self, vid: int, did: int):
        self.config = Config(vid, did, 0x06, 1)

    def routes_bus(self, bus: int) -> bool:
        sec, sub = self.config.data[0x19], self.config.data[0x1A]
        return sec <= bus <= sub

    def routes_mem(self, addr: int) -> bool:
        if not self.config.command & 2:
            return False
        base, limit = struct.unpack_from("<HH", self.config.data, 0x20)
        if (base >> 4) << 20 <= addr < ((limit >> 4) + 1) << 20:
            return True
        base, limit, base_hi, limit_hi = struct.unpack_from("<HHII", self.config.data, 0x24)
        return (base_hi << 32 | (base >> 4) << 20) <= addr < \
            (limit_hi << 32 | ((limit >> 4) + 1) << 20)


class Function:
    """A PCI function with memory BARs backed by bytearrays (for tests; the GPU behind the
    bridge is sim/am/mock_device.py's)."""

    def __init__(self, vid: int, did: int, cls: int, bars: dict[int, tuple]):
        self.config = Config(vid, did, cls, 0, bars)
        self.memory = {i: bytearray(size) for i, (size, _) in bars.items()}

    def mem_read(self, bar: int, offset: int) -> int:
        return struct.unpack_from("<I", self.memory[bar], offset)[0]

    def mem_write(self, bar: int, offset: int, value: int, be: int) -> None:
        for i in range(4):
            if be >> i & 1:
                self.memory[bar][offset + i] = (value >> 8 * i) & 0xFF

MOCK_FW_VERSION = bytes.fromhex("261126ee0001")  # shown as 261126_EE_00_01


class MockBridge:
    """The ASM24xx: XDATA, vendor CDBs, and a TLP engine over `ports` (bus 0, 1, ...) and the
    function at the end of them."""

    def __init__(self, ports: list[Port], function):
        self.xdata = bytearray(0x20000)
        at = asm24.FW_VERSION  # a version no ASMedia firmware has: the mock's own
        self.xdata[at:at + asm24.FW_VERSION_BYTES] = MOCK_FW_VERSION
        self.sram = bytearray(asm24.SRAM_BYTES)  # its first 4 KiB are XDATA 0xF000 (the window)
        self.fill = 0  # where the next long WRITE(16) lands (asm24.SRAM_BYTES's note)
        self.ports, self.function = ports, function
        self.dropped_writes = 0  # posted writes nothing claimed (hardware drops them too)
        self.link_down = bringup("usb.link") == "down"

    def execute(self, cdb: bytes, data_out: bytes | None) -> tuple[bytes, int]:
        """(data in, SCSI status) for one CDB."""
        op = cdb[0]
        if op in (asm24.XDATA_READ, asm24.XDATA_WRITE):
            arg, a2, a1, pad = struct.unpack_from(">BBHB", cdb, 1)
            if a2 & 0xFE != asm24.XDATA_TAG >> 16 or pad or any(cdb[6:]):
                return b"", asm24.CHECK_CONDITION
            addr = (a2 << 16 | a1) & 0x1FFFF
            if op == asm24.XDATA_READ:
                if not 0 < arg <= asm24.MAX_READ:
                    return b"", asm24.CHECK_CONDITION
                if asm24.WINDOW_XDATA <= addr < WINDOW_END:
                    at = addr - asm24.WINDOW_XDATA
                    return bytes(self.sram[at:min(at + arg, asm24.WINDOW_BYTES)]), asm24.GOOD
                return bytes(self.xdata[addr:addr + arg]), asm24.GOOD
            if addr == asm24.REG_STATUS:
                self._status_write(arg)
            else:
                self.xdata[addr] = arg
            reset = asm24.FILL_RESET
            if reset <= addr < reset + 4 and not any(self.xdata[reset:reset + 4]):
                self.fill = 0
            return b"", asm24.GOOD
        if op == asm24.WRITE16 and data_out is not None:
            return b"", self._write16(cdb, data_out)
        return b"", asm24.CHECK_CONDITION

    def _write16(self, cdb: bytes, data: bytes) -> int:
        """A short write lands at the SRAM's start; a CHUNK-byte one at the fill, which moves on
        past it (and back to the start when FILL_RESET..+3 are zeroed)."""
        _, _, lba, blocks, _, _ = struct.unpack(">BBQIBB", cdb)
        n = blocks * 512
        if lba or not n or n != len(data) or (n > asm24.SMALL_WRITE and n != asm24.CHUNK):
            return asm24.CHECK_CONDITION
        at = 0 if n <= asm24.SMALL_WRITE else self.fill
        if at + n > asm24.SRAM_BYTES:
            return asm24.CHECK_CONDITION
        self.sram[at:at + n] = data
        if n > asm24.SMALL_WRITE:
            self.fill += n
        return asm24.GOOD

    # ---- the device side of the DMA window: bus master reads and writes -----------------------
    def host_read(self, bus_addr: int, n: int) -> bytes:
        off = self._window_offset(bus_addr, n)
        return bytes(self.sram[off:off + n])

    def host_write(self, bus_addr: int, data: bytes) -> None:
        off = self._window_offset(bus_addr, len(data))
        self.sram[off:off + len(data)] = data

    def _window_offset(self, bus_addr: int, n: int) -> int:
        off = bus_addr - asm24.WINDOW_BUS
        if not self.function.config.command & 4:
            raise PermissionError("DMA by a function without bus mastering enabled")
        if not 0 <= off <= asm24.SRAM_BYTES - n:
            raise ValueError(f"DMA to bus address 0x{bus_addr:x}+{n}: outside the bridge's "
                             f"SRAM 0x{asm24.WINDOW_BUS:x}+{asm24.SRAM_BYTES}")
        return off

    # ---- TLPs -----------------------------------------------------------------------------------
    def _status_write(self, v: int) -> None:
        """0x04 starts the request armed by 0x0F in the kick register; 0x01 clears an error."""
        x = self.xdata
        if v == 0x04 and x[asm24.REG_KICK] == 0x0F:
            x[asm24.REG_KICK], x[asm24.REG_STATUS] = 0, 0
            self._tlp()
        elif v == 0x01:
            x[asm24.REG_STATUS] &= ~1
        else:
            x[asm24.REG_STATUS] = v

    def _tlp(self) -> None:
        x = self.xdata
        fmt, be = x[asm24.REG_FMT], x[asm24.REG_BE]
        addr, high = struct.unpack_from(">II", x, asm24.REG_ADDR)
        value, = struct.unpack_from(">I", x, asm24.REG_DATA)
        is_cfg, write = fmt & 0xBE == asm24.CFG_READ, bool(fmt & 0x40)
        is_mem = not fmt & ~(asm24.WIDE | asm24.MEM_WRITE)
        if is_mem and fmt & asm24.WIDE:  # the 4-dword header: 0xB21C is the address's top half
            addr |= high << 32
        status, data = self._config(fmt, addr, value, be) if is_cfg else \
            self._memory(addr, value, be, write) if is_mem else (UR, None)
        if fmt & ~asm24.WIDE == asm24.MEM_WRITE:
            self.dropped_writes += status != SC
            return
        count = 4 if is_cfg else bin(be).count("1")
        struct.pack_into(">H", x, asm24.REG_COMPLETION, status << 13 | count)
        x[asm24.REG_CPL_FLAGS] = int(is_cfg and not write)
        if data is not None:
            struct.pack_into(">I", x, asm24.REG_DATA, data)
        x[asm24.REG_STATUS] = 2

    def _target(self, bus: int):
        """The config space at `bus` (device 0), if the bridges above route there."""
        chain = self.ports + [self.function]
        if bus > 0 and self.link_down:
            return None
        if bus >= len(chain) or not all(p.routes_bus(bus) for p in self.ports[:bus]):
            return None
        return chain[bus]

    def _config(self, fmt: int, addr: int, value: int, be: int) -> tuple[int, int | None]:
        bus, dev, reg = addr >> 24, (addr >> 19) & 0x1F, addr & 0xFFF
        node = self._target(bus) if dev == 0 and (addr >> 16) & 7 == 0 else None
        if node is None or (fmt & 1) != (bus > 0):  # type 0 only on bus 0, type 1 beyond
            return UR, None
        if fmt & 0x40:
            node.config.write(reg, value, be)
            return SC, None
        return SC, node.config.read(reg)

    def _memory(self, addr: int, value: int, be: int, write: bool) -> tuple[int, int | None]:
        if not all(p.routes_mem(addr) for p in self.ports):
            return UR, None
        cfg = self.function.config
        for i in cfg.bars:
            base, size = cfg.bar(i)
            if cfg.command & 2 and base <= addr < base + size:
                if write:
                    self.function.mem_write(i, addr - base, value, be)
                    return SC, None
                return SC, self.function.mem_read(i, addr - base)
        return UR, None


class MockLibusb:
    """The libusb functions usbgpu/libusb.py calls, over one mock bridge."""
    _shared = None

    def __init__(self, bridge: MockBridge, ids=asm24.IDS[0]):
        self.bridge, self.ids = bridge, ids
        self.plugged, self.hang, self.opened = True, False, False
        self.pending: list = []
        self.streams: dict[int, int] = {}
        self.owned: dict[int, object] = {}  # transfers alive, by address
        self.transfers = 0  # completed, as the host counts them
        self.bytes = 0  # their payload bytes, both ways (the host's count must agree)
        self.on_replug = None  # what else power-cycles with the enclosure (the GPU behind it)
        self.absent = bringup("usb.device") == "absent"

    @classmethod
    def shared(cls, build=None) -> "MockLibusb":
        """The process's one mock enclosure (KEEL_USB=mock), made by `build` on first use
        (sim/am/mock_device.py: enclosure)."""
        if cls._shared is None:
            if build is None:
                raise DeviceError("KEEL_USB=mock: no mock enclosure was opened yet")
            cls._shared = build()
        return cls._shared

    @classmethod
    def forget(cls) -> None:
        """Drop the process's enclosure: the next open builds a fresh one (and reads
        KEEL_MOCK_FAULTS again)."""
        cls._shared = None

    def unplug(self) -> None:
        self.plugged = False

    def replug(self) -> None:
        self.plugged, self.opened, self.pending = True, False, []
        if self.on_replug is not None:
            self.on_replug()

    # ---- device handling ------------------------------------------------------------------------
    def libusb_init(self, ctxp) -> int:
        ctxp[0] = ffi.cast("libusb_context *", 0x1000)
        return 0

    def libusb_exit(self, ctx) -> None:
        pass

    def libusb_open_device_with_vid_pid(self, ctx, vid: int, pid: int):
        if not self.plugged or self.absent or (vid, pid) != self.ids:
            return ffi.NULL
        self.opened = True
        return ffi.cast("libusb_device_handle *", 0x2000)

    def libusb_close(self, handle) -> None:
        self.opened = False

    def libusb_kernel_driver_active(self, handle, iface: int) -> int:
        return 0 if self.plugged else ERROR_NO_DEVICE

    def libusb_detach_kernel_driver(self, handle, iface: int) -> int:
        return 0 if self.plugged else ERROR_NO_DEVICE

    def libusb_claim_interface(self, handle, iface: int) -> int:
        return (0 if iface == 0 else ERROR_NOT_FOUND) if self.plugged else ERROR_NO_DEVICE

    def libusb_release_interface(self, handle, iface: int) -> int:
        return 0 if self.plugged else ERROR_NO_DEVICE

    def libusb_set_interface_alt_setting(self, handle, iface: int, alt: int) -> int:
        if not self.plugged:
            return ERROR_NO_DEVICE
        return 0 if (iface, alt) == (0, asm24.ALT_SETTING) else ERROR_NOT_FOUND

    def libusb_alloc_streams(self, handle, n: int, eps, n_eps: int) -> int:
        return min(n, 32) if self.plugged else ERROR_NO_DEVICE

    # ---- transfers ---------------------------------------------------------------------------
    def libusb_alloc_transfer(self, iso: int):
        t = ffi.new("struct libusb_transfer *")
        self.owned[int(ffi.cast("uintptr_t", t))] = t
        return t

    def libusb_free_transfer(self, t) -> None:
        key = int(ffi.cast("uintptr_t", t))
        self.owned.pop(key, None)
        self.streams.pop(key, None)

    def libusb_transfer_set_stream_id(self, t, stream: int) -> None:
        self.streams[int(ffi.cast("uintptr_t", t))] = stream

    def libusb_submit_transfer(self, t) -> int:
        if not self.plugged:
            return ERROR_NO_DEVICE
        stream = self.streams.get(int(ffi.cast("uintptr_t", t)), 0)
        kind = TRANSFER_BULK_STREAM if t.endpoint in (asm24.EP_DATA_IN, asm24.EP_DATA_OUT,
                                                      asm24.EP_STATUS_IN) else TRANSFER_BULK
        if t.endpoint not in (asm24.EP_DATA_IN, asm24.EP_DATA_OUT, asm24.EP_STATUS_IN,
                              asm24.EP_CMD_OUT) or t.type != kind or \
                (kind == TRANSFER_BULK_STREAM) != (0 < stream <= asm24.STREAMS) or t.length < 0:
            return ERROR_INVALID_PARAM
        self.pending.append(t)
        return 0

    def libusb_cancel_transfer(self, t) -> int:
        if t in self.pending:
            self._complete(t, CANCELLED)
        return 0

    def libusb_handle_events_timeout_completed(self, ctx, tv, completed) -> int:
        if not self.plugged:
            for t in list(self.pending):
                self._complete(t, NO_DEVICE)
            return 0
        if self.hang:
            time.sleep(min(tv.tv_sec + tv.tv_usec * 1e-6, 0.01))
            return 0
        self._play()
        return 0

    def _complete(self, t, status: int, data: bytes = b"") -> None:
        self.pending.remove(t)
        if data:
            ffi.memmove(t.buffer, data, len(data))
        t.actual_length = len(data) if t.endpoint & 0x80 else \
            (t.length if status == COMPLETED else 0)
        t.status = status
        self.transfers += status == COMPLETED
        self.bytes += t.actual_length if status == COMPLETED else 0
        t.callback(t)

    def _on(self, ep: int, stream: int):
        return next((t for t in self.pending if t.endpoint == ep and
                     self.streams.get(int(ffi.cast("uintptr_t", t)), 0) == stream), None)

    def _play(self) -> None:
        """Run every command whose transfers are all submitted, in submission order."""
        for cmd in [t for t in self.pending if t.endpoint == asm24.EP_CMD_OUT]:
            iu = bytes(ffi.buffer(cmd.buffer, cmd.length))
            tag = struct.unpack_from(">H", iu, 2)[0] if len(iu) == 32 else 0
            cdb = iu[16:]
            data_out = self._on(asm24.EP_DATA_OUT, tag)
            status = self._on(asm24.EP_STATUS_IN, tag)
            data_in = self._on(asm24.EP_DATA_IN, tag)
            if status is None or (cdb[0] == asm24.WRITE16 and data_out is None) or \
                    (cdb[0] == asm24.XDATA_READ and data_in is None):
                continue  # waits for the rest of its transfers, as the bridge does
            out = bytes(ffi.buffer(data_out.buffer, data_out.length)) if data_out else None
            result, scsi = self.bridge.execute(cdb, out) if iu[0] == asm24.IU_COMMAND else \
                (b"", asm24.CHECK_CONDITION)
            self._complete(cmd, COMPLETED)
            if data_out is not None:
                self._complete(data_out, COMPLETED)
            if data_in is not None:
                self._complete(data_in, COMPLETED, result[:data_in.length])
            sense = bytes([asm24.IU_SENSE, 0]) + struct.pack(">H", tag) + bytes([0, 0, scsi])
            self._complete(status, COMPLETED, sense.ljust(16, b"\0"))

