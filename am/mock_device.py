"""The mock RX 7900 XTX behind the mock ASM24xx (KEEL_USB=mock): a PCI function whose BARs are
VRAM (BAR0), doorbells (BAR2) and registers (BAR5), with
  * the IP discovery binary DISCOVERY_TMR_OFFSET below the top of VRAM (am/discovery.py);
  * the PSP bootloader mailbox: a sOS load names firmware in VRAM; until one succeeded the
    command processor ignores its doorbell, as a GPU without firmware does nothing;
  * the address map: VRAM at the FB location, and the AGP aperture onto the bridge's DMA window
    (system memory); any other address is a GpuFault;
  * one compute queue (CP_HQD_* registers): a doorbell write with the new write pointer runs the
    ring's packets up to it on am/mock_gpu.py's command processor (kernels on PoCL).
Faults (KEEL_MOCK_FAULTS, runner/faults.py) by submission, counted in doorbells that carry a
RELEASE_MEM: hang@N (the queue stops), unplug@N (the enclosure disappears from the USB bus),
fwerr@N (the Nth firmware load is refused by the PSP). A fault inside the mock (a malformed
packet, an address outside VRAM and the aperture) surfaces as GpuFault, a DeviceError, from the
USB call that rang the doorbell; hardware would stop the queue and the host would time out.
"""
from __future__ import annotations

import struct

from am import discovery, pm4, regs
from am.mock_gpu import GPU_BASE, CommandProcessor, GpuFault, Memory
from runner.faults import from_env
from usbgpu.mock import Config, MockBridge, MockLibusb, Port

VRAM_BYTES = 512 << 20  # a 24 GiB card's first 512 MiB: what fits a test host's memory
DOORBELL_BYTES, MMIO_BYTES = 2 << 20, 1 << 20
AGP_GPU_BASE = 0x7000_0000_0000  # where the driver is expected to put the AGP aperture
IPS = [discovery.Ip(11, 0, (11, 0, 0), (regs.GC_SEG0, regs.GC_SEG1)),
       discovery.Ip(255, 0, (13, 0, 0), (regs.MP0_SEG0,)),
       discovery.Ip(1, 0, (13, 0, 0), (regs.MP0_SEG0,)),
       discovery.Ip(42, 0, (6, 0, 0), (regs.GC_SEG0,))]
FAULTS_VAR = "KEEL_MOCK_FAULTS"
KINDS = ("hang", "unplug", "fwerr")  # read when the enclosure is made (MockLibusb.forget())


class Space:
    """The GPU's addresses: VRAM at the FB location, system memory through the AGP aperture."""

    def __init__(self, gpu: "MockGpu"):
        self.gpu = gpu

    def _agp(self, va: int, n: int) -> int | None:
        r = self.gpu.regs
        bot, top = r.get(regs.GCMC_VM_AGP_BOT, 1) << 24, (r.get(regs.GCMC_VM_AGP_TOP, 0) + 1) << 24
        if bot <= va and va + n <= top:
            return va - bot + (r.get(regs.GCMC_VM_AGP_BASE, 0) << 22)
        return None

    def read(self, va: int, n: int) -> bytes:
        bus = self._agp(va, n)
        return self.gpu.vram.read(va, n) if bus is None else self.gpu.bridge.host_read(bus, n)

    def write(self, va: int, data: bytes) -> None:
        bus = self._agp(va, len(data))
        if bus is None:
            self.gpu.vram.write(va, data)
        else:
            self.gpu.bridge.host_write(bus, data)


class MockGpu:
    def __init__(self):
        bars = {0: (VRAM_BYTES, 0xC), 2: (DOORBELL_BYTES, 0xC), 5: (MMIO_BYTES, 0)}
        self.config = Config(0x1002, 0x744C, 0x03, 0, bars)
        self.vram = Memory(VRAM_BYTES)
        self.vram.alloc(VRAM_BYTES)  # every VRAM address is mapped (the FB aperture)
        table = discovery.build(IPS)
        self.vram.write(GPU_BASE + VRAM_BYTES - discovery.DISCOVERY_TMR_OFFSET, table)
        self.regs = self._initial()
        self.bridge: MockBridge | None = None
        self.cp = None  # built at the first doorbell: PoCL is only loaded when something runs
        self.firmware_loads = self.submissions = 0
        self.running, self.rptr = False, 0
        self.faults = from_env(FAULTS_VAR, KINDS)

    # ---- BARs -----------------------------------------------------------------------------------
    def mem_read(self, bar: int, offset: int) -> int:
        if bar == 0:
            return struct.unpack("<I", self.vram.read(GPU_BASE + offset, 4))[0]
        return self.regs.get(offset // 4, 0) if bar == 5 else 0

    def mem_write(self, bar: int, offset: int, value: int, be: int) -> None:
        if be != 0xF:
            raise GpuFault(f"BAR{bar} write at 0x{offset:x} with byte enables {be:04b}; the GPU "
                           f"takes whole dwords")
        if bar == 0:
            self.vram.write(GPU_BASE + offset, struct.pack("<I", value))
        elif bar == 5:
            self._register(offset // 4, value)
        elif bar == 2:
            self._doorbell(offset // 4, value)

    def _register(self, reg: int, value: int) -> None:
        self.regs[reg] = value
        if reg == regs.CP_HQD_PQ_RPTR:  # the driver (re)starting the queue
            self.rptr = value
        if reg == regs.C2PMSG_35 and value == regs.BL_LOAD_SOSDRV:
            self.firmware_loads += 1
            fault = self.faults.at(self.firmware_loads)
            addr = self.regs.get(regs.C2PMSG_36, 0) << 20  # a GPU address, 1 MiB aligned
            inside = GPU_BASE <= addr < GPU_BASE + VRAM_BYTES
            ok = (fault is None or fault.kind != "fwerr") and inside and \
                any(self.vram.read(addr, 16))  # an image there, not erased VRAM
            self.regs[regs.C2PMSG_35] = regs.BL_READY | (0 if ok else 0xFFFF)
            self.regs[regs.C2PMSG_81] = 0x00300000 if ok else 0
            self.running = self.running or ok

    # ---- the compute queue ----------------------------------------------------------------------
    def _doorbell(self, index: int, wptr: int) -> None:
        r = self.regs
        ctl = r.get(regs.CP_HQD_PQ_DOORBELL_CONTROL, 0)
        if not (self.running and r.get(regs.CP_HQD_ACTIVE) and ctl & regs.DOORBELL_EN and
                (ctl >> 2) & 0x3FFFFFF == index):
            return  # no firmware, no active queue, or another doorbell: nothing listens
        size = 4 << ((r.get(regs.CP_HQD_PQ_CONTROL, 0) & 0x3F) + 1)  # bytes
        base = (r.get(regs.CP_HQD_PQ_BASE, 0) | r.get(regs.CP_HQD_PQ_BASE_HI, 0) << 32) << 8
        if self.cp is None:
            self.cp = CommandProcessor(self.vram, Space(self))
        n = wptr - self.rptr
        if not 0 <= n <= size // 4:
            raise GpuFault(f"doorbell write pointer {wptr} after {self.rptr}: expected at most "
                           f"one ring ({size // 4} dwords) ahead")
        words = [pm4.words(self.cp.mem.read(base + (i * 4) % size, 4))[0]
                 for i in range(self.rptr, wptr)] if n else []
        if pm4.INDIRECT_BUFFER in {p.op for p in pm4.decode(words)}:  # a graph submission
            self.submissions += 1
            fault = self.faults.at(self.submissions)
            if fault is not None and fault.kind == "hang":
                r[regs.CP_HQD_ACTIVE] = 0
                return
            if fault is not None and fault.kind == "unplug":
                self.usb.unplug()
                return
        self.cp.execute(words)
        self.rptr = wptr
        r[regs.CP_HQD_PQ_RPTR] = wptr & 0xFFFFFFFF

    def reset(self) -> None:
        """Power lost (unplug): registers, firmware and queue state are gone; VRAM is kept, as
        nothing on the driver's side may rely on it either."""
        self.regs = self._initial()
        self.running, self.rptr = False, 0

    @staticmethod
    def _initial() -> dict[int, int]:
        """What the registers hold after POST: the mailbox ready, VRAM's place in the map."""
        return {regs.C2PMSG_35: regs.BL_READY, regs.GCMC_VM_FB_LOCATION_BASE: GPU_BASE >> 24,
                regs.GCMC_VM_FB_LOCATION_TOP: (GPU_BASE + VRAM_BYTES - 1) >> 24}


def make_enclosure() -> MockLibusb:
    """The ASM2464 port, the Navi 31 switch's two ports, and the GPU, on a mock USB bus."""
    gpu = MockGpu()
    bridge = MockBridge([Port(0x1B21, 0x2461), Port(0x1002, 0x1478), Port(0x1002, 0x1479)], gpu)
    gpu.bridge = bridge
    gpu.usb = MockLibusb(bridge)
    gpu.usb.on_replug = gpu.reset
    return gpu.usb


MockLibusb.factory = make_enclosure  # KEEL_USB=mock opens this enclosure
