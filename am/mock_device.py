"""The mock RX 7900 XTX behind the mock ASM24xx (KEEL_USB=mock): a PCI function whose BARs are
VRAM (BAR0), doorbells (BAR2) and registers (BAR5), with
  * the IP discovery binary DISCOVERY_TMR_OFFSET below the top of VRAM (am/discovery.py);
  * the PSP bootloader mailbox (a sOS load names firmware in VRAM), then sOS's GPCOM ring
    (`Psp`: SETUP_TMR, LOAD_IP_FW); until RLC and MEC microcode are loaded the command
    processor ignores its doorbell, as a GPU without firmware does nothing;
  * the MMU (`Space`): VM context 0's one-level GART page table, walked exactly as the
    GCVM_CONTEXT0_* registers program it, with a TLB the driver must invalidate; the system
    aperture onto VRAM at the FB location and the AGP aperture; any other address, an invalid
    PTE or a missing permission is a GpuFault naming the address;
  * one compute queue (CP_HQD_* registers): a doorbell write with the new write pointer runs the
    ring's packets up to it on am/mock_gpu.py's command processor (kernels on PoCL).
Faults (KEEL_MOCK_FAULTS, runner/faults.py) by submission, counted in doorbells that carry a
RELEASE_MEM: hang@N (the queue stops), unplug@N (the enclosure disappears from the USB bus),
fault@N (the submission's indirect buffer loses its GART mapping: a VM fault), fwerr@N (the Nth
firmware load is refused by the PSP). A fault inside the mock (a malformed
packet, an unmapped address) surfaces as GpuFault, a DeviceError, from the
USB call that rang the doorbell; hardware would stop the queue and the host would time out.
"""
from __future__ import annotations

import struct

import numpy as np

from am import discovery, pm4, psp, regs
from am.mock_gpu import GPU_BASE, PAGE, CommandProcessor, GpuFault, Memory
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
KINDS = ("hang", "unplug", "fwerr", "fault")  # read when the enclosure is made


class Space:
    """The GPU's addresses as VMID 0 sees them (gfxhub_v3_0.c's setup): a page inside VM context
    0's GART range [START, END] through its PTE in the one-level table at PAGE_TABLE_BASE; other
    addresses inside the system aperture [LOW, HIGH] reach VRAM at the FB location or system
    memory through the AGP aperture physically; anything else, an invalid PTE or one without the
    access's permission is a GpuFault naming the address. Translations are cached per page (a
    TLB) until the driver invalidates through GCVM_INVALIDATE_ENG17_REQ, as on hardware."""

    def __init__(self, gpu: "MockGpu"):
        self.gpu = gpu
        self.tlb: dict[int, int] = {}  # GART page -> its PTE (valid ones only)
        self.runs: dict[int, tuple[int, int]] = {}  # kernel buffer va -> (VRAM offset, bytes)

    def invalidate(self) -> None:
        self.tlb.clear()
        self.runs.clear()

    def _context(self) -> tuple[int, int, int] | None:
        """(first page, last page, table's VRAM offset) of an enabled context 0."""
        r = self.gpu.regs
        cntl = r.get(regs.GCVM_CONTEXT0_CNTL, 0)
        if not cntl & regs.CONTEXT_ENABLE:
            return None
        if cntl >> regs.CONTEXT_DEPTH_SHIFT & 3:
            raise GpuFault(f"GCVM_CONTEXT0_CNTL 0x{cntl:x}: a multi-level table; the mock walks "
                           f"PAGE_TABLE_DEPTH 0 (one level) only")
        base = self._pair(regs.GCVM_CONTEXT0_PT_BASE_LO)
        if not base & regs.PTE_VALID:
            raise GpuFault(f"GCVM_CONTEXT0_PAGE_TABLE_BASE 0x{base:x} is not a valid PDE")
        return (self._pair(regs.GCVM_CONTEXT0_PT_START_LO),
                self._pair(regs.GCVM_CONTEXT0_PT_END_LO), base & regs.PTE_ADDRESS)

    def _pair(self, lo: int) -> int:
        """A 64-bit value from a LO32 register and the HI32 one after it."""
        return self.gpu.regs.get(lo, 0) | self.gpu.regs.get(lo + 1, 0) << 32

    def translate(self, va: int, write: bool) -> tuple[bool, int]:
        """(system memory?, bus address or VRAM offset) of one byte's address."""
        ctx, page = self._context(), va >> 12
        if ctx is not None and ctx[0] <= page <= ctx[1]:
            pte = self.tlb.get(page)
            if pte is None:
                at = GPU_BASE + ctx[2] + 8 * (page - ctx[0])
                pte = struct.unpack("<Q", self.gpu.vram.read(at, 8))[0]
                if not pte & regs.PTE_VALID:
                    raise GpuFault(f"GPU page fault (VMID 0) at 0x{va:x}: GART page "
                                   f"{page - ctx[0]}'s PTE 0x{pte:x} is not valid")
                self.tlb[page] = pte
            if not pte & (regs.PTE_WRITEABLE if write else regs.PTE_READABLE):
                raise GpuFault(f"GPU protection fault (VMID 0) at 0x{va:x}: PTE 0x{pte:x} does not "
                               f"allow {'writing' if write else 'reading'}")
            return bool(pte & regs.PTE_SYSTEM), pte & regs.PTE_ADDRESS | va & 0xFFF
        r = self.gpu.regs
        if r.get(regs.GCMC_VM_SYSTEM_APERTURE_LOW_ADDR, 1) <= va >> 18 <= \
                r.get(regs.GCMC_VM_SYSTEM_APERTURE_HIGH_ADDR, 0):
            fb = r.get(regs.GCMC_VM_FB_LOCATION_BASE, 0) << 24
            if fb <= va < (r.get(regs.GCMC_VM_FB_LOCATION_TOP, 0) + 1) << 24:
                return False, va - fb
            bot = r.get(regs.GCMC_VM_AGP_BOT, 1) << 24
            if bot <= va < (r.get(regs.GCMC_VM_AGP_TOP, 0) + 1) << 24:
                return True, va - bot + (r.get(regs.GCMC_VM_AGP_BASE, 0) << 22)
        raise GpuFault(f"GPU page fault (VMID 0) at 0x{va:x}: outside the GART range and the FB "
                       f"and AGP apertures")

    def _pieces(self, va: int, n: int, write: bool):
        while n > 0:
            take = min(n, PAGE - va % PAGE)
            yield (*self.translate(va, write), take)
            va, n = va + take, n - take

    def read(self, va: int, n: int) -> bytes:
        return b"".join(self.gpu.bridge.host_read(a, k) if system else
                        self.gpu.vram.read(GPU_BASE + a, k)
                        for system, a, k in self._pieces(va, n, False))

    def write(self, va: int, data: bytes) -> None:
        at = 0
        for system, a, k in list(self._pieces(va, len(data), True)):
            if system:
                self.gpu.bridge.host_write(a, data[at:at + k])
            else:
                self.gpu.vram.write(GPU_BASE + a, data[at:at + k])
            at += k

    def run(self, va: int) -> tuple[int, int]:
        """A kernel's buffer at `va`: (VRAM offset, bytes) of the physically contiguous, readable
        and writeable VRAM pages from there (PoCL computes in one host range; hardware would
        translate each access, and fault at the first page outside the run)."""
        if va in self.runs:
            return self.runs[va]
        system, phys = self.translate(va, True)
        if system:
            raise GpuFault(f"kernel buffer at 0x{va:x} is system memory; the mock runs kernels on "
                           f"VRAM only")
        ctx, page = self._context(), va >> 12
        n = VRAM_BYTES - phys
        if ctx is not None and ctx[0] <= page <= ctx[1]:
            count = ctx[1] - page + 1
            ptes = np.frombuffer(self.gpu.vram.map, "<u8", count, ctx[2] + 8 * (page - ctx[0]))
            want = (phys & ~0xFFF) + PAGE * np.arange(count, dtype=np.uint64)
            flags = regs.PTE_VALID | regs.PTE_READABLE | regs.PTE_WRITEABLE | regs.PTE_SYSTEM
            ok = ((ptes & regs.PTE_ADDRESS) == want) & (ptes & flags == flags ^ regs.PTE_SYSTEM)
            pages = int(np.argmin(ok)) if not ok.all() else count
            n = min(n, pages * PAGE - va % PAGE)
        self.runs[va] = phys, n
        return phys, n


class Psp:
    """sOS's GPCOM ring (am/psp.py): created through C2PMSG_64/69/70/71, frames consumed up to
    each C2PMSG_67 write; SETUP_TMR, then LOAD_IP_FW of an image in GPU memory (VMID 0
    addresses through the MMU). A load without a TMR, an unaligned or empty image, erased
    memory or an injected fwerr is refused in the response's status; the fence is written
    either way. The command processor runs once RLC_G and RS64_MEC are loaded."""

    def __init__(self, gpu: "MockGpu"):
        self.gpu, self.ring, self.rptr, self.tmr = gpu, None, 0, None
        self.loaded: set[int] = set()

    def control(self, value: int) -> None:
        r = self.gpu.regs
        ok = value == regs.INIT_GPCOM_RING and self.gpu.sos and r.get(regs.C2PMSG_71, 0) and \
            r.get(regs.C2PMSG_71, 0) % psp.FRAME_BYTES == 0
        if ok:
            self.ring = (r.get(regs.C2PMSG_69, 0) | r.get(regs.C2PMSG_70, 0) << 32,
                         r[regs.C2PMSG_71])
            self.rptr = 0
        r[regs.C2PMSG_64] = regs.BL_READY | (0 if ok else psp.UNKNOWN_COMMAND)

    def doorbell(self, wptr: int) -> None:
        if self.ring is None:
            return  # no ring: nothing reads the write pointer
        base, size = self.ring
        space = self.gpu.space
        while self.rptr != wptr % (size // 4):
            f = psp.FRAME.unpack(space.read(base + 4 * self.rptr, psp.FRAME.size))
            cmd, fence = f[0] | f[1] << 32, f[3] | f[4] << 32
            buf = space.read(cmd, psp.CMD_BYTES)
            space.write(cmd + psp.RESP_AT, struct.pack("<I", self._execute(f[2], buf)))
            space.write(fence, struct.pack("<I", f[5]))
            self.rptr = (self.rptr + psp.FRAME_BYTES // 4) % (size // 4)

    def _execute(self, size: int, buf: bytes) -> int:
        head = psp.HEAD.unpack_from(buf)
        if size != psp.CMD_BYTES or head[0] != psp.CMD_BYTES or head[1] != psp.BUF_VERSION:
            return psp.UNKNOWN_COMMAND
        if head[2] == psp.SETUP_TMR:
            lo, hi, n = psp.SETUP.unpack_from(buf, psp.CMD_AT)[:3]
            ok = not (lo % PAGE or n % PAGE) and n
            self.tmr = (lo | hi << 32, n) if ok else None
            return 0 if ok else 0xFFFF
        if head[2] != psp.LOAD_IP_FW:
            return psp.UNKNOWN_COMMAND
        lo, hi, n, kind = psp.LOAD.unpack_from(buf, psp.CMD_AT)
        self.gpu.firmware_loads += 1
        fault = self.gpu.faults.at(self.gpu.firmware_loads)
        ok = self.tmr is not None and not lo % PAGE and n and \
            (fault is None or fault.kind != "fwerr") and any(self.gpu.space.read(lo | hi << 32, 16))
        if ok:
            self.loaded.add(kind)
        return 0 if ok else 0xFFFF


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
        self.space, self.psp, self.sos = Space(self), Psp(self), False
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
        if reg == regs.GCVM_INVALIDATE_ENG17_REQ:  # done at once: ACK has the VMIDs asked for
            if value & 1 and value & regs.INVALIDATE_ALL == regs.INVALIDATE_ALL:
                self.space.invalidate()
            self.regs[regs.GCVM_INVALIDATE_ENG17_ACK] = value & 0xFFFF
        if reg == regs.C2PMSG_35 and value == regs.BL_LOAD_SOSDRV:
            self.firmware_loads += 1
            fault = self.faults.at(self.firmware_loads)
            addr = self.regs.get(regs.C2PMSG_36, 0) << 20  # a GPU address, 1 MiB aligned
            inside = GPU_BASE <= addr < GPU_BASE + VRAM_BYTES
            ok = (fault is None or fault.kind != "fwerr") and inside and \
                any(self.vram.read(addr, 16))  # an image there, not erased VRAM
            self.regs[regs.C2PMSG_35] = regs.BL_READY | (0 if ok else 0xFFFF)
            self.regs[regs.C2PMSG_81] = 0x00300000 if ok else 0
            self.regs[regs.C2PMSG_64] = regs.BL_READY if ok else 0  # sOS: ready for its ring
            self.sos = self.sos or ok
        if reg == regs.C2PMSG_64:
            self.psp.control(value)
        if reg == regs.C2PMSG_67:
            self.psp.doorbell(value)
            self.running = self.sos and {psp.RLC_G, psp.RS64_MEC} <= self.psp.loaded

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
            self.cp = CommandProcessor(self.vram, self.space)
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
            if fault is not None and fault.kind == "fault":
                self._vm_fault(words)
        self.cp.execute(words)
        self.rptr = wptr
        r[regs.CP_HQD_PQ_RPTR] = wptr & 0xFFFFFFFF

    def reset(self) -> None:
        """Power lost (unplug): registers, firmware and queue state are gone; VRAM is kept, as
        nothing on the driver's side may rely on it either."""
        self.regs = self._initial()
        self.running, self.rptr, self.sos = False, 0, False
        self.psp = Psp(self)
        self.space.invalidate()

    def _vm_fault(self, words: list[int]) -> None:
        """fault@N: the submission's indirect buffer loses its first page's translation (its PTE
        cleared, the TLB entry dropped), so the fetch faults as a bad mapping would; the queue
        stops. Only a new bring-up (recover()) maps it again."""
        ib = next(p for p in pm4.decode(words) if p.op == pm4.INDIRECT_BUFFER)
        va = ib.body[0] | (ib.body[1] & 0xFFFF) << 32
        ctx = self.space._context()
        if ctx is not None and ctx[0] <= va >> 12 <= ctx[1]:
            self.vram.write(GPU_BASE + ctx[2] + 8 * ((va >> 12) - ctx[0]), bytes(8))
        self.space.invalidate()
        self.regs[regs.CP_HQD_ACTIVE] = 0

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
