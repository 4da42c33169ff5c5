"""The small PCI-device interface am/ drives a GPU through, and its USB implementation.

`PciDevice` is all am/ sees: config space, BAR memory, and a DMA window (host memory the device
reads and writes at a bus address). A Linux sysfs/VFIO transport can implement it later; am/ does
not care how the GPU is attached.

`UsbPci` brings the link up behind an ASM24xx (usbgpu/asm24.py) with plain PCI enumeration (PCI
Local Bus / PCI-to-PCI bridge specifications): walk from bus 0, give each bridge (header type 1)
its secondary and subordinate bus numbers, stop at the first display-class function (class 0x03);
then grow the BARs its Resizable BAR capability lists to their largest size, size every BAR
(write all ones, read the mask back), place 64-bit prefetchable ones from 32 GiB up (reached with
4-dword TLP headers: usbgpu/asm24.py) and the rest below 4 GiB, open every bridge's memory and
prefetchable windows over them, and enable memory decoding and bus mastering.
"""
from __future__ import annotations


from runner.errors import DeviceError
from runner.simulators import simulator
from usbgpu import asm24
from usbgpu.libusb import Usb, load

VENDOR, COMMAND, CLASS, HEADER_TYPE, BAR0 = 0x00, 0x04, 0x08, 0x0E, 0x10
BUSES, MEM_WINDOW, PREF_WINDOW, PREF_UPPER = 0x18, 0x20, 0x24, 0x28
CMD_MEMORY, CMD_MASTER = 0x2, 0x4
DISPLAY_CLASS = 0x03
MMIO_START = 0x1000_0000  # above the bridge's DMA window at 0x200000
PREF_START = 32 << 30  # 64-bit prefetchable BARs (tinygrad's USB setup puts them here too)
BAR_PREFETCH, PREF_64 = 0x8, 0x1  # a BAR's prefetchable bit; a window's 64-bit capability
EXT_CAPS, MAX_EXT_CAPS, EXT_CAP_REBAR = 0x100, 64, 0x15
REBAR_SIZE = 0x3F << 8  # a Resizable BAR control register's size field (2^n MiB)
MAX_DEPTH = 8


def open_lib():
    """The real library, or with KEEL_USB=mock the process's mock enclosure: a mock bridge with
    a mock GPU behind it (runner/simulators.py)."""
    mock = simulator("KEEL_USB")
    return mock() if mock else load()


class PciDevice:
    """Config space, BAR memory and the DMA window of one PCI function."""
    bars: dict[int, tuple[int, int]]  # BAR index -> (bus address, size)
    window: tuple[int, int]  # DMA window: (bus address the device uses, bytes)
    staging: tuple[int, int]  # host memory from the window's start, filled whole by stage()

    def cfg_read(self, reg: int, size: int = 4) -> int:
        raise NotImplementedError

    def cfg_write(self, reg: int, value: int, size: int = 4) -> None:
        raise NotImplementedError

    def read32(self, bar: int, offset: int) -> int:
        raise NotImplementedError

    def write32(self, bar: int, offset: int, value: int) -> None:
        raise NotImplementedError

    def dma_put(self, data: bytes, then: tuple[int, int, int] | None = None) -> None:
        """Fill the DMA window (from its start) with `data`, at most window[1] bytes; then, if
        given, write32(*then) (a doorbell) ordered after it."""
        raise NotImplementedError

    def dma_get(self, offset: int, n: int) -> bytes:
        raise NotImplementedError

    def stage(self, data) -> None:
        """Fill the staging memory from its start with `data` (bytes, or a list of bytes-like
        pieces laid end to end; at most staging[1] bytes) in as few bulk transfers as the
        transport allows; it overwrites the window."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class UsbPci(PciDevice):
    def __init__(self, timeout_s: float = 1.0, lib=None):
        lib = lib or open_lib()
        self.usb = _open(lib)
        self.bridge = asm24.Bridge(self.usb, timeout_s)
        self.window = (asm24.WINDOW_BUS, asm24.WINDOW_BYTES)
        self.staging = (asm24.WINDOW_BUS, asm24.SRAM_BYTES)
        try:
            self.bus, self.path = self._enumerate()
            self.bars = self._assign_bars()
        except Exception:
            self.close()
            raise

    def cfg_read(self, reg: int, size: int = 4) -> int:
        return self.bridge.config(self.bus, 0, 0, reg, None, size)

    def cfg_write(self, reg: int, value: int, size: int = 4) -> None:
        self.bridge.config(self.bus, 0, 0, reg, value, size)

    def read32(self, bar: int, offset: int) -> int:
        return self.bridge.mem(self._address(bar, offset))

    def write32(self, bar: int, offset: int, value: int) -> None:
        self.bridge.mem(self._address(bar, offset), value & 0xFFFFFFFF)

    def dma_put(self, data: bytes, then: tuple[int, int, int] | None = None) -> None:
        self.bridge.window_write(data, None if then is None else
                                 (self._address(then[0], then[1]), then[2] & 0xFFFFFFFF))

    def dma_get(self, offset: int, n: int) -> bytes:
        return self.bridge.window_read(offset, n)

    def stage(self, data) -> None:
        self.bridge.sram_write(data)

    def close(self) -> None:
        self.usb.close()

    def _address(self, bar: int, offset: int) -> int:
        base, size = self.bars[bar]
        if not 0 <= offset <= size - 4:
            raise DeviceError(f"BAR{bar} offset 0x{offset:x} outside its {size} bytes")
        return base + offset

    def _enumerate(self) -> tuple[int, list[int]]:
        """(bus of the GPU, buses of the bridges above it), assigning bus numbers on the way."""
        bus, path = 0, []
        for _ in range(MAX_DEPTH):
            vid = self.bridge.config(bus, 0, 0, VENDOR, None, 2)
            if vid == 0xFFFF:
                break
            if self.bridge.config(bus, 0, 0, CLASS + 3, None, 1) == DISPLAY_CLASS:
                return bus, path
            if self.bridge.config(bus, 0, 0, HEADER_TYPE, None, 1) & 0x7F != 1:
                break
            # primary = bus, secondary = bus + 1, subordinate = 0xFF until the walk ends
            self.bridge.config(bus, 0, 0, BUSES, bus | (bus + 1) << 8 | 0xFF << 16)
            path.append(bus)
            bus += 1
        raise DeviceError(f"no display-class PCI function behind the bridge (walked buses "
                          f"0..{bus}); is the GPU powered and seated?")

    def _assign_bars(self) -> dict[int, tuple[int, int]]:
        """Each memory BAR sized (write all ones, read the mask back; BAR0 first grown to the
        largest size its Resizable BAR capability offers) and placed: 64-bit prefetchable ones
        (VRAM, doorbells) from PREF_START up, the rest from MMIO_START below 4 GiB."""
        self._resize_bars()
        bars, at, i = {}, {False: MMIO_START, True: PREF_START}, 0
        while i < 6:
            reg = BAR0 + 4 * i
            old = self.cfg_read(reg)
            wide = (old >> 1) & 3 == 2
            self.cfg_write(reg, 0xFFFFFFFF)
            mask = self.cfg_read(reg) & ~0xF
            if wide:
                self.cfg_write(reg + 4, 0xFFFFFFFF)
                mask |= self.cfg_read(reg + 4) << 32
            size = (~mask + 1) & ((1 << (64 if wide else 32)) - 1) if mask else 0
            if size and not old & 1:  # memory BARs only (I/O space is not reachable over USB)
                high = wide and bool(old & BAR_PREFETCH)
                base = -(-at[high] // size) * size
                if not high and base + size > 1 << 32:
                    raise DeviceError(f"BAR{i} of {size >> 20} MiB does not fit below 4 GiB")
                self.cfg_write(reg, base & 0xFFFFFFFF | (old & 0xF))
                if wide:
                    self.cfg_write(reg + 4, base >> 32)
                bars[i] = (base, size)
                at[high] = base + size
            i += 2 if wide else 1
        self._open_windows(at[False], at[True])
        self.cfg_write(COMMAND, CMD_MEMORY | CMD_MASTER, 2)
        return bars

    def _resize_bars(self) -> None:
        """Every BAR the Resizable BAR extended capability lists, set to the largest size it
        offers (tinygrad's setup_pci_bars does the same): a 24 GiB card's VRAM BAR is 256 MiB
        until resized, and am/ reads IP discovery at the top of VRAM through it when it reaches
        (else through MM_INDEX/MM_DATA, three requests a dword)."""
        at = EXT_CAPS
        for _ in range(MAX_EXT_CAPS):
            head = self.cfg_read(at)
            if head in (0, 0xFFFFFFFF):
                return
            if head & 0xFFFF == EXT_CAP_REBAR:
                for k in range(self.cfg_read(at + 8) >> 5 & 7):
                    cap, ctrl = self.cfg_read(at + 4 + 8 * k), self.cfg_read(at + 8 + 8 * k)
                    largest = (cap >> 4).bit_length() - 1  # bit 4 + n: 2^n MiB
                    if largest >= 0:
                        self.cfg_write(at + 8 + 8 * k, ctrl & ~REBAR_SIZE | largest << 8)
            at = head >> 20 & 0xFFC
            if at < EXT_CAPS:
                return

    def _open_windows(self, low_end: int, high_end: int) -> None:
        """Every bridge above the GPU forwards [MMIO_START, low_end) through its memory window
        and [PREF_START, high_end) through its 64-bit prefetchable window (1 MiB units: base
        and limit's address bits 31:20 in bits 15:4, bits 63:32 in the upper registers; a
        window with nothing in it closed, its base above its limit)."""
        lo, hi = MMIO_START >> 20, (low_end - 1) >> 20
        mem = lo << 4 | hi << 20 if low_end > MMIO_START else 0xFFF0
        plo, phi = PREF_START >> 20, (high_end - 1) >> 20
        pref = (plo & 0xFFF) << 4 | PREF_64 | ((phi & 0xFFF) << 4 | PREF_64) << 16 \
            if high_end > PREF_START else 0xFFF0 | PREF_64
        for bus in self.path:
            self.bridge.config(bus, 0, 0, MEM_WINDOW, mem)
            self.bridge.config(bus, 0, 0, PREF_WINDOW, pref)
            self.bridge.config(bus, 0, 0, PREF_UPPER, plo >> 12)
            self.bridge.config(bus, 0, 0, PREF_UPPER + 4, phi >> 12 if high_end > PREF_START
                               else 0)
            self.bridge.config(bus, 0, 0, COMMAND, CMD_MEMORY | CMD_MASTER, 2)


def _open(lib) -> Usb:
    errors = []
    for vid, pid in asm24.IDS:
        try:
            return Usb(lib, vid, pid, asm24.ALT_SETTING,
                       (asm24.EP_DATA_OUT, asm24.EP_DATA_IN, asm24.EP_STATUS_IN), asm24.STREAMS)
        except DeviceError as e:
            errors.append(str(e))
    raise DeviceError("no ASM24xx bridge: " + "; ".join(errors))
