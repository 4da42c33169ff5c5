"""The mock RX 7900 XTX behind the mock ASM24xx (KEEL_USB=mock): a PCI function whose BARs are
VRAM (BAR0), doorbells (BAR2) and registers (BAR5), with
  * the IP discovery binary DISCOVERY_TMR_OFFSET below the top of VRAM (am/discovery.py), VRAM's
    size in RCC_CONFIG_MEMSIZE, VRAM through BAR0 (256 MiB at power-on, grown by its Resizable
    BAR capability up to 32 GiB) or MM_INDEX/MM_INDEX_HI/MM_DATA;
  * the PSP (`Psp`): its bootloader mailbox taking the sOS file's components in order, then
    sOS's GPCOM ring (LOAD_TOC, SETUP_TMR, LOAD_IP_FW, AUTOLOAD_RLC), each image checked for
    the type it is loaded as; MEC pipe 0 (`_mec`) starts only after the RLC's autoload, at the
    MEC firmware's start address; until then the command processor ignores its doorbell, as a
    GPU without firmware does nothing;
  * the MMU (`Space`, one per hub: GC for the CP, MM for the PSP): VM context 0's page table
    (four levels, or one), walked exactly as the *VM_CONTEXT0_* registers program it, with a TLB
    the driver must invalidate; the system aperture onto VRAM at the FB location and the AGP
    aperture; any other address, an invalid entry or a missing permission is a GpuFault naming
    the address;
  * one compute queue (CP_HQD_* registers, mapped from its MQD: sim/am/mock_gc.py checks them
    against each other at activation): a doorbell write with the new write pointer, routed by
    NBIO, runs the ring's packets up to it on sim/am/mock_gpu.py's command processor (kernels on
    PoCL, each dispatch only with SH_MEM apertures for its VMID).
Faults (KEEL_MOCK_FAULTS, runner/faults.py) by submission, counted in doorbells that carry a
RELEASE_MEM: hang@N (the queue stops), unplug@N (the enclosure disappears from the USB bus),
fault@N (the submission's indirect buffer loses its mapping: a VM fault), fwerr@N (the Nth
firmware image is refused by the PSP). A fault inside the mock (a malformed
packet, an unmapped address) surfaces as GpuFault, a DeviceError, from the
USB call that rang the doorbell; hardware would stop the queue and the host would time out.
Bring-up faults (KEEL_MOCK_BRINGUP, runner/faults.py's SITES): amd.discovery=corrupt gives the IP
discovery table a wrong checksum, amd.tlb=mm (or gc) leaves that hub's TLB invalidations
unacknowledged, amd.queue=inactive ignores the queue's activation, amd.huge=alias maps every
4 KiB page of a 2 MiB leaf to the leaf's first page (a GPU that reads PDB0 leaves otherwise).
"""
from __future__ import annotations

import struct

from am import discovery, pm4, psp, regs, vm
from sim.am import mock_gc, standin
from sim.am.mock_gpu import GPU_BASE, PAGE, CommandProcessor, GpuFault, Memory
from runner.faults import FaultKind, bringup, from_env
from sim.usb.mock import Config, MockBridge, MockLibusb, Port

VRAM_BYTES = 24 << 30  # an RX 7900 XTX's; sparse host memory (sim/am/mock_gpu.py Memory)
# BAR0 comes up at 256 MiB; its Resizable BAR capability offers every power of two up to 32 GiB,
# the smallest that holds all of VRAM (usbgpu/pci.py grows it to the largest)
BAR0_BYTES, BAR0_SIZES = 256 << 20, tuple(1 << n for n in range(28, 36))
DOORBELL_BYTES, MMIO_BYTES = 2 << 20, 1 << 20
AGP_GPU_BASE = 0x7000_0000_0000  # where the driver is expected to put the AGP aperture
IPS = [discovery.Ip(11, 0, (11, 0, 0), (regs.GC_SEG0, regs.GC_SEG1)),
       discovery.Ip(255, 0, (13, 0, 0), (regs.MP0_SEG0,)),
       discovery.Ip(1, 0, (13, 0, 0), (regs.MP0_SEG0,)),
       discovery.Ip(42, 0, (6, 0, 0), (regs.GC_SEG0,))]
FAULTS_VAR = "KEEL_MOCK_FAULTS"
# read when the enclosure is made
KINDS = (FaultKind.HANG, FaultKind.UNPLUG, FaultKind.FWERR, FaultKind.FAULT)


class Space:
    """The GPU's addresses as VMID 0 sees them (gfxhub_v3_0.c's setup): an address inside VM
    context 0's range [START, END] through the tables at PAGE_TABLE_BASE, walked as
    GCVM_CONTEXT0_CNTL's PAGE_TABLE_DEPTH says (am/vm.py: 0 = one flat table, 3 = PDB2 -> PDB1
    -> PDB0 -> PTB, a PDE_PTE leaf at PDB1/PDB0 mapping 1 GiB/2 MiB); other addresses inside the
    system aperture [LOW, HIGH] reach VRAM at the FB location or system memory through the AGP
    aperture physically; anything else, an invalid entry on the way or a leaf without the
    access's permission is a GpuFault naming the address (and the level). Translations are
    cached per 4 KiB page (a TLB) until the driver invalidates through
    GCVM_INVALIDATE_ENG17_REQ, as on hardware. Stricter than hardware: a leaf whose address is
    not aligned to its page size, or a PDE_PTE leaf at the root, is a fault too."""

    LEVELS = ("PDB2", "PDB1", "PDB0", "PTB")

    def __init__(self, gpu: "MockGpu", hub: regs.Hub = regs.GC_HUB):
        self.gpu, self.hub = gpu, hub
        self.tlb: dict[int, int] = {}  # page -> a 4 KiB leaf for it (valid ones only)
        self.runs: dict[int, tuple[int, int]] = {}  # kernel buffer va -> (VRAM offset, bytes)

    def invalidate(self) -> None:
        self.tlb.clear()
        self.runs.clear()

    def _context(self) -> tuple[int, int, int, int] | None:
        """(first page, last page, root table's physical address, depth) of context 0."""
        r, h = self.gpu.regs, self.hub
        cntl = r.get(h.cntl, 0)
        if not cntl & regs.CONTEXT_ENABLE:
            return None
        depth, block = cntl >> regs.CONTEXT_DEPTH_SHIFT & 3, cntl >> 3 & 0xF
        if depth not in (0, 3) or block:
            raise GpuFault(f"{h.name}VM_CONTEXT0_CNTL 0x{cntl:x}: PAGE_TABLE_DEPTH {depth}, "
                           f"BLOCK_SIZE {block}; the mock walks depth 0 or 3 with block size 0")
        base = self._pair(h.pt_base)
        if not base & vm.VALID:
            raise GpuFault(f"{h.name}VM_CONTEXT0_PAGE_TABLE_BASE 0x{base:x} is not a valid PDE")
        return self._pair(h.pt_start), self._pair(h.pt_end), base & vm.ADDRESS, depth

    def _pair(self, lo: int) -> int:
        """A 64-bit value from a LO32 register and the HI32 one after it."""
        return self.gpu.regs.get(lo, 0) | self.gpu.regs.get(lo + 1, 0) << 32

    def _vram(self, phys: int) -> int:
        """A physical VRAM address's offset into VRAM (GCMC_VM_FB_OFFSET is VRAM's start)."""
        return phys - (self.gpu.regs.get(self.hub.fb_offset, 0) << 24)

    def walk(self, va: int) -> tuple[int, int, int]:
        """(VRAM offset of the leaf entry, the leaf, the bytes it maps) for `va` inside the
        context's range; a GpuFault at the first invalid entry."""
        start, _, table, depth = self._context()
        rel = va - (start << 12)
        for lv in range(depth + 1):
            at = self._vram(table) + 8 * vm.index(rel, lv, depth)
            e = struct.unpack("<Q", self.gpu.vram.read(GPU_BASE + at, 8))[0]
            name = self.LEVELS[lv + 3 - depth]
            if not e & vm.VALID:
                raise GpuFault(f"GPU page fault (VMID 0) at 0x{va:x}: the {name} entry 0x{e:x} "
                               f"is not valid")
            size = 1 << 12 + 9 * (depth - lv)
            if lv == depth or e & vm.PDE_PTE:
                if lv < depth and (lv == 0 or e & vm.ADDRESS & size - 1):
                    raise GpuFault(f"GPU page fault (VMID 0) at 0x{va:x}: {name} leaf 0x{e:x} "
                                   f"is at the root or not aligned to its {size >> 10} KiB")
                return at, e, size
            table = e & vm.ADDRESS

    def translate(self, va: int, write: bool) -> tuple[bool, int]:
        """(system memory?, bus address or VRAM offset) of one byte's address."""
        ctx, page = self._context(), va >> 12
        if ctx is not None and ctx[0] <= page <= ctx[1]:
            leaf = self.tlb.get(page)
            if leaf is None:
                _, e, size = self.walk(va)
                inside = 0 if self.gpu.huge_alias else va & size - 1 & ~0xFFF
                leaf = e & ~vm.ADDRESS | (e & vm.ADDRESS) + inside
                self.tlb[page] = leaf
            if not leaf & (vm.WRITEABLE if write else vm.READABLE):
                raise GpuFault(f"GPU protection fault (VMID 0) at 0x{va:x}: leaf 0x{leaf:x} does "
                               f"not allow {'writing' if write else 'reading'}")
            addr = leaf & vm.ADDRESS | va & 0xFFF
            return bool(leaf & vm.SYSTEM), addr if leaf & vm.SYSTEM else self._vram(addr)
        r, h = self.gpu.regs, self.hub
        if r.get(h.sys_low, 1) <= va >> 18 <= r.get(h.sys_high, 0):
            fb = r.get(h.fb_base, 0) << 24
            if fb <= va < (r.get(h.fb_base + 1, 0) + 1) << 24:
                return False, va - fb
            bot = r.get(h.agp_bot, 1) << 24
            if bot <= va < (r.get(h.agp_top, 0) + 1) << 24:
                return True, va - bot + (r.get(h.agp_base, 0) << 22)
        raise GpuFault(f"GPU page fault ({h.name} hub, VMID 0) at 0x{va:x}: outside the VM "
                       f"context's range and the FB and AGP apertures")

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
        and writeable VRAM from there, leaf by leaf to the first that breaks the run (PoCL
        computes in one host range; hardware would translate each access, and fault at the
        first page outside the run)."""
        if va in self.runs:
            return self.runs[va]
        system, phys = self.translate(va, True)
        if system:
            raise GpuFault(f"kernel buffer at 0x{va:x} is system memory; the mock runs kernels on "
                           f"VRAM only")
        top = self.gpu.vram_bytes
        ctx, n = self._context(), top - phys
        if ctx is not None and ctx[0] <= va >> 12 <= ctx[1]:
            at, want, need = va, phys, vm.VALID | vm.READABLE | vm.WRITEABLE
            while at >> 12 <= ctx[1] and want < top:
                try:
                    _, e, size = self.walk(at)
                except GpuFault:
                    break
                if e & need != need or e & vm.SYSTEM or \
                        self._vram(e & vm.ADDRESS) + at % size != want:
                    break
                at, want = at + size - at % size, want + size - at % size
            n = min(n, at - va)
        self.runs[va] = phys, n
        return phys, n


class Psp:
    """The PSP as a driver meets it. The bootloader (C2PMSG_35/36) takes the sOS file's
    components in psp.BOOT's order, each once, the system driver before sOS; sOS sets C2PMSG_81
    and opens C2PMSG_64 for its GPCOM ring (C2PMSG_64/69/70/71), whose frames are consumed up to
    each C2PMSG_67 write: LOAD_TOC (answers the TMR size), SETUP_TMR (1 MiB aligned, at least
    the TOC's size, after the SMU firmware), LOAD_IP_FW (after the TMR, except the SMU's),
    AUTOLOAD_RLC (once RLC_G, IMU and RS64 MEC with its stack are in; then
    RLC_RLCS_BOOTLOAD_STATUS says complete). Every image must carry the type it is loaded as
    (sim/am/standin.py's tag: the real PSP checks a signature); the PSP reads and writes through
    the MM hub's VM context 0 (its system aperture onto VRAM, its page table onto the bridge's
    SRAM, where the images are staged), with that hub's TLB and L2 on. A refusal is a non-zero status; an injected fwerr@N refuses
    the Nth firmware image (bootloader components and LOAD_IP_FW alike)."""

    def __init__(self, gpu: "MockGpu"):
        self.gpu, self.ring, self.rptr = gpu, None, 0
        self.booted: list[int] = []
        self.toc = self.tmr = None
        self.loaded: set[int] = set()

    def _read(self, addr: int, n: int) -> bytes | None:
        """What the PSP reads at `addr` through the MM hub (None: it cannot reach it)."""
        mock_gc.check_hub(self.gpu.regs, regs.MM_HUB)
        try:
            return self.gpu.mm.read(addr, n)
        except (GpuFault, ValueError):
            return None

    def _image(self, addr: int, n: int, kind: int) -> bool:
        """An image of `kind` at `addr` (counted for fwerr@N)."""
        self.gpu.firmware_loads += 1
        fault = self.gpu.faults.at(self.gpu.firmware_loads)
        data = self._read(addr, max(n, 32))
        return (fault is None or fault.kind is not FaultKind.FWERR) and data is not None and \
            kind in standin.tagged(data)

    def bootloader(self, cmd: int) -> None:
        r, order = self.gpu.regs, [k for k, _ in psp.BOOT]
        kind = {c: k for k, c in psp.BOOT}.get(cmd)
        ok = kind is not None and not self.gpu.sos and kind not in self.booted and \
            all(order.index(b) < order.index(kind) for b in self.booted) and \
            (kind != psp.SOS or psp.SYS_DRV in self.booted) and \
            self._image(r.get(regs.C2PMSG_36, 0) << 20, 32, kind)
        if ok:
            self.booted.append(kind)
        r[regs.C2PMSG_35] = regs.BL_READY | (0 if ok else 0xFFFF)
        if ok and kind == psp.SOS:
            r[regs.C2PMSG_81], r[regs.C2PMSG_64] = 0x00300000, regs.BL_READY
            self.gpu.sos = True

    def control(self, value: int) -> None:
        r = self.gpu.regs
        if value == regs.DESTROY_RINGS and self.gpu.sos:
            self.ring, r[regs.C2PMSG_71], r[regs.C2PMSG_64] = None, 0, regs.BL_READY
            return
        size = r.get(regs.C2PMSG_71, 0)
        ok = value == regs.INIT_GPCOM_RING and self.gpu.sos and size and \
            size % psp.FRAME_BYTES == 0
        if ok:
            self.ring, self.rptr = (r.get(regs.C2PMSG_69, 0) | r.get(regs.C2PMSG_70, 0) << 32,
                                    size), 0
        r[regs.C2PMSG_64] = regs.BL_READY | (0 if ok else psp.UNKNOWN_COMMAND)

    def doorbell(self, wptr: int) -> None:
        if self.ring is None:
            return  # no ring: nothing reads the write pointer
        base, size = self.ring
        while self.rptr != wptr % (size // 4):
            f = psp.FRAME.unpack(self._read(base + 4 * self.rptr, psp.FRAME.size) or
                                 bytes(psp.FRAME.size))
            cmd, fence = f[0] | f[1] << 32, f[3] | f[4] << 32
            buf = self._read(cmd, psp.CMD_BYTES)
            if buf is None or self._read(fence, 4) is None:
                raise GpuFault(f"PSP frame names command 0x{cmd:x} and fence 0x{fence:x}; "
                               f"expected addresses the MM hub maps")
            status, tmr_size = self._execute(f[2], buf)
            self.gpu.mm.write(cmd + psp.RESP_AT, struct.pack("<4xIIII", 0, 0, 0, tmr_size))
            self.gpu.mm.write(cmd + psp.RESP_AT, struct.pack("<I", status))
            self.gpu.mm.write(fence, struct.pack("<I", f[5]))
            self.rptr = (self.rptr + psp.FRAME_BYTES // 4) % (size // 4)

    def _execute(self, size: int, buf: bytes) -> tuple[int, int]:
        """(status, tmr_size) of one command buffer."""
        head = psp.HEAD.unpack_from(buf)
        if size != psp.CMD_BYTES or head[0] != psp.CMD_BYTES or head[1] != psp.BUF_VERSION:
            return psp.UNKNOWN_COMMAND, 0
        if head[2] == psp.LOAD_TOC:
            lo, hi, n = psp.TOC.unpack_from(buf, psp.CMD_AT)
            ok = self._image(lo | hi << 32, n, psp.TOC_BIN)
            self.toc = standin.TOC_TMR_BYTES if ok else None
            return (0, self.toc) if ok else (0xFFFF, 0)
        if head[2] == psp.SETUP_TMR:
            lo, hi, n = psp.SETUP.unpack_from(buf, psp.CMD_AT)[:3]
            ok = not (lo % psp.TMR_ALIGN or n % PAGE) and n >= (self.toc or 1) and \
                psp.SMU in self.loaded
            self.tmr = (lo | hi << 32, n) if ok else None
            return (0 if ok else 0xFFFF), 0
        if head[2] == psp.AUTOLOAD_RLC:
            ok = self.tmr is not None and psp.AUTOLOAD_NEEDS <= self.loaded
            if ok:
                self.gpu.regs[regs.RLC_RLCS_BOOTLOAD_STATUS] = regs.BOOTLOAD_COMPLETE
            return (0 if ok else 0xFFFF), 0
        if head[2] != psp.LOAD_IP_FW:
            return psp.UNKNOWN_COMMAND, 0
        lo, hi, n, kind = psp.LOAD.unpack_from(buf, psp.CMD_AT)
        ok = (self.tmr is not None or kind == psp.SMU) and not lo % PAGE and n and \
            self._image(lo | hi << 32, n, kind)
        if ok:
            self.loaded.add(kind)
        return (0 if ok else 0xFFFF), 0


class MockGpu:
    """`vram_bytes` of VRAM (RCC_CONFIG_MEMSIZE says how much, in MiB) behind a BAR0 of
    `bar0_bytes` that the Resizable BAR capability grows up to the smallest power of two
    holding VRAM."""

    def __init__(self, vram_bytes: int = VRAM_BYTES, bar0_bytes: int = BAR0_BYTES):
        self.vram_bytes, self.bar0_bytes = vram_bytes, bar0_bytes
        self.config = self._config()
        self.vram = Memory(vram_bytes)
        self.vram.alloc(vram_bytes)  # every VRAM address is mapped (the FB aperture)
        table = discovery.build(IPS)
        if bringup("amd.discovery") == "corrupt":
            table = table[:-1] + bytes([table[-1] ^ 0xFF])
        self.vram.write(GPU_BASE + vram_bytes - discovery.DISCOVERY_TMR_OFFSET, table)
        self.regs = self._initial(vram_bytes)
        self.bridge: MockBridge | None = None
        self.space, self.mm = Space(self, regs.GC_HUB), Space(self, regs.MM_HUB)
        self.psp, self.sos = Psp(self), False
        self.cp = None  # built at the first doorbell: PoCL is only loaded when something runs
        self.firmware_loads = self.submissions = 0
        self.running, self.rptr, self.mec_pc, self.mec_latched = False, 0, 0, None
        self.sh_mem: dict[int, dict[int, int]] = {}  # VMID -> SH_MEM_CONFIG/BASES
        self.faults = from_env(FAULTS_VAR, KINDS)
        self.stuck_tlb = (bringup("amd.tlb") or "").upper()  # the hub whose TLB never acks
        self.dead_queue = bringup("amd.queue") == "inactive"
        self.huge_alias = bringup("amd.huge") == "alias"

    # ---- BARs -----------------------------------------------------------------------------------
    def mem_read(self, bar: int, offset: int) -> int:
        if bar == 0:
            return struct.unpack("<I", self.vram.read(GPU_BASE + self._vram(offset), 4))[0]
        if bar != 5:
            return 0
        reg = offset // 4
        if reg == regs.RSMU_DATA:  # the register RSMU_INDEX names (a byte address)
            reg = self.regs.get(regs.RSMU_INDEX, 0) // 4
        if reg == regs.RCC_CONFIG_MEMSIZE:
            return self.vram_bytes >> 20
        if reg == regs.MM_DATA:
            return struct.unpack("<I", self.vram.read(GPU_BASE + self._indexed(), 4))[0]
        if reg in (regs.SH_MEM_CONFIG, regs.SH_MEM_BASES):
            return self.sh_mem.get(self._vmid(), {}).get(reg, 0)
        if reg == regs.MM_HUB.inv_sem:
            return 1  # the semaphore is free: one driver, one engine
        return self.regs.get(reg, 0)

    def _indexed(self) -> int:
        """The VRAM offset MM_INDEX/MM_INDEX_HI name for MM_DATA."""
        index = self.regs.get(regs.MM_INDEX, 0)
        if not index & regs.MM_APERTURE:
            raise GpuFault(f"MM_DATA with MM_INDEX 0x{index:x}: the mock serves the memory "
                           f"aperture (bit 31) only")
        return self._vram(index & 0x7FFFFFFF | self.regs.get(regs.MM_INDEX_HI, 0) << 31)

    def _vram(self, offset: int) -> int:
        """A BAR0 offset's VRAM offset: a BAR0 grown past VRAM has nothing behind the rest."""
        if offset + 4 > self.vram_bytes:
            raise GpuFault(f"BAR0 offset 0x{offset:x} is past the {self.vram_bytes >> 20} MiB "
                           f"of VRAM")
        return offset

    def _vmid(self) -> int:
        return self.regs.get(regs.GRBM_GFX_CNTL, 0) >> regs.GRBM_VMID_SHIFT & 0xF

    def mem_write(self, bar: int, offset: int, value: int, be: int) -> None:
        if be != 0xF:
            raise GpuFault(f"BAR{bar} write at 0x{offset:x} with byte enables {be:04b}; the GPU "
                           f"takes whole dwords")
        if bar == 0:
            self.vram.write(GPU_BASE + self._vram(offset), struct.pack("<I", value))
        elif bar == 5:
            self._register(offset // 4, value)
        elif bar == 2:
            self._doorbell(offset // 4, value)

    def _register(self, reg: int, value: int) -> None:
        if reg == regs.RSMU_DATA:
            reg = self.regs.get(regs.RSMU_INDEX, 0) // 4
        if reg == regs.MM_DATA:
            self.vram.write(GPU_BASE + self._indexed(), struct.pack("<I", value))
            return
        if regs.CP_MQD_BASE_ADDR <= reg <= regs.CP_HQD_PQ_WPTR_HI and \
                self.regs.get(regs.GRBM_GFX_CNTL, 0) != regs.GRBM_ME1_PIPE0_QUEUE0:
            return  # another queue's bank: not the one the mock's doorbell serves
        if reg in (regs.SH_MEM_CONFIG, regs.SH_MEM_BASES):  # banked per VMID
            self.sh_mem.setdefault(self._vmid(), {})[reg] = value
            return
        if reg == regs.CP_HQD_ACTIVE and self.dead_queue:
            return
        if reg == regs.CP_HQD_ACTIVE and value & 1 and not self.regs.get(reg, 0) & 1:
            mock_gc.check_queue(self.regs, self.space.read)  # the CP reads the MQD to map it
        if reg == regs.CP_HQD_DEQUEUE_REQUEST and value & 0xF:
            self.regs[regs.CP_HQD_ACTIVE] = 0
        self.regs[reg] = value
        if reg == regs.CP_HQD_PQ_RPTR:  # the driver (re)starting the queue
            self.rptr = value
        for space in (self.space, self.mm):  # done at once: ACK has the VMIDs asked for
            if reg == space.hub.inv_req and space.hub.name != self.stuck_tlb:
                if value & 1 and value & regs.INVALIDATE_ALL == regs.INVALIDATE_ALL:
                    space.invalidate()
                self.regs[space.hub.inv_ack] = value & 0xFFFF
        if reg == regs.C2PMSG_35:
            self.psp.bootloader(value)
        if reg == regs.C2PMSG_64:
            self.psp.control(value)
        if reg == regs.C2PMSG_67:
            self.psp.doorbell(value)
        self._mec(reg, value)

    def _mec(self, reg: int, value: int) -> None:
        """MEC pipe 0 runs once the RLC's autoload is complete and CP_MEC_RS64_CNTL releases it
        (active, not halted) after a reset pulse that latched the program counter at the MEC
        firmware's start (PRGRM_CNTR_START, written with ME 1 pipe 0 selected)."""
        r = self.regs
        selected = r.get(regs.GRBM_GFX_CNTL, 0) == regs.GRBM_ME1_PIPE0_QUEUE0
        if reg in (regs.CP_MEC_RS64_PRGRM_CNTR_START, regs.CP_MEC_RS64_PRGRM_CNTR_START_HI) \
                and selected:
            hi = reg == regs.CP_MEC_RS64_PRGRM_CNTR_START_HI
            self.mec_pc = self.mec_pc & (0xFFFFFFFF << 32 if not hi else 0xFFFFFFFF) | \
                value << (32 if hi else 0)
        if reg != regs.CP_MEC_RS64_CNTL:
            return
        if value & regs.MEC_PIPE0_RESET:
            self.mec_latched = self.mec_pc if r.get(regs.RLC_RLCS_BOOTLOAD_STATUS, 0) & \
                regs.BOOTLOAD_COMPLETE else None
        self.running = self.sos and self.mec_latched == standin.MEC_START >> 2 and \
            value & regs.MEC_PIPE0_ACTIVE and not value & (regs.MEC_HALT | regs.MEC_PIPE0_RESET)

    # ---- the compute queue ----------------------------------------------------------------------
    def _doorbell(self, index: int, wptr: int) -> None:
        r = self.regs
        ctl = r.get(regs.CP_HQD_PQ_DOORBELL_CONTROL, 0)
        lower, upper = (r.get(reg, 0) & 0xFFC for reg in (regs.CP_MEC_DOORBELL_RANGE_LOWER,
                                                          regs.CP_MEC_DOORBELL_RANGE_UPPER))
        if not (mock_gc.doorbell_routed(r) and self.running and r.get(regs.CP_HQD_ACTIVE) and
                ctl & regs.DOORBELL_EN and (ctl >> 2) & 0x3FFFFFF == index and
                lower <= 4 * index <= upper):
            return  # no aperture or routing, no firmware, no active queue, or not its doorbell
        mock_gc.check_hub(r, regs.GC_HUB)
        size = 4 << ((r.get(regs.CP_HQD_PQ_CONTROL, 0) & 0x3F) + 1)  # bytes
        base = (r.get(regs.CP_HQD_PQ_BASE, 0) | r.get(regs.CP_HQD_PQ_BASE_HI, 0) << 32) << 8
        if self.cp is None:
            self.cp = CommandProcessor(self.vram, self.space)
            self.cp.check = lambda: mock_gc.check_dispatch(
                self.sh_mem, self.regs.get(regs.CP_HQD_VMID, 0) & 0xF, self.space._context())
        n = wptr - self.rptr
        if not 0 <= n <= size // 4:
            raise GpuFault(f"doorbell write pointer {wptr} after {self.rptr}: expected at most "
                           f"one ring ({size // 4} dwords) ahead")
        words = [pm4.words(self.cp.mem.read(base + (i * 4) % size, 4))[0]
                 for i in range(self.rptr, wptr)] if n else []
        if pm4.INDIRECT_BUFFER in {p.op for p in pm4.decode(words)}:  # a graph submission
            self.submissions += 1
            fault = self.faults.at(self.submissions)
            if fault is not None and fault.kind is FaultKind.HANG:
                r[regs.CP_HQD_ACTIVE] = 0
                return
            if fault is not None and fault.kind is FaultKind.UNPLUG:
                self.usb.unplug()
                return
            if fault is not None and fault.kind is FaultKind.FAULT:
                self._vm_fault(words)
        self.cp.execute(words)
        self.rptr = wptr
        r[regs.CP_HQD_PQ_RPTR] = wptr & 0xFFFFFFFF
        report = r.get(regs.CP_HQD_PQ_RPTR_REPORT_ADDR, 0) | \
            r.get(regs.CP_HQD_PQ_RPTR_REPORT_ADDR_HI, 0) << 32
        self.space.write(report, struct.pack("<I", wptr % (size // 4)))  # the CP reports it

    def _config(self) -> Config:
        """Config space as at power-on: BARs unplaced, BAR0 at its boot size."""
        bars = {0: (self.bar0_bytes, 0xC), 2: (DOORBELL_BYTES, 0xC), 5: (MMIO_BYTES, 0)}
        sizes = tuple(s for s in BAR0_SIZES if s < 2 * self.vram_bytes)
        return Config(0x1002, 0x744C, 0x03, 0, bars, {0: sizes})

    def reset(self) -> None:
        """Power lost (unplug): config space (BAR0's size and every BAR's place), registers,
        firmware and queue state are gone; VRAM is kept, as nothing on the driver's side may
        rely on it either."""
        self.config = self._config()
        self.regs, self.sh_mem = self._initial(self.vram_bytes), {}
        self.running, self.rptr, self.sos = False, 0, False
        self.mec_pc, self.mec_latched = 0, None
        self.psp = Psp(self)
        self.space.invalidate()
        self.mm.invalidate()

    def _vm_fault(self, words: list[int]) -> None:
        """fault@N: the submission's indirect buffer loses its first page's translation (its PTE
        cleared, the TLB entry dropped), so the fetch faults as a bad mapping would; the queue
        stops. Only a new bring-up (recover()) maps it again."""
        ib = next(p for p in pm4.decode(words) if p.op == pm4.INDIRECT_BUFFER)
        va = ib.body[0] | (ib.body[1] & 0xFFFF) << 32
        ctx = self.space._context()
        if ctx is not None and ctx[0] <= va >> 12 <= ctx[1]:
            self.vram.write(GPU_BASE + self.space.walk(va)[0], bytes(8))
        self.space.invalidate()
        self.regs[regs.CP_HQD_ACTIVE] = 0

    @staticmethod
    def _initial(vram_bytes: int) -> dict[int, int]:
        """What the registers hold after POST: the mailbox ready, VRAM's place in the map."""
        r = {regs.C2PMSG_35: regs.BL_READY}
        for hub in (regs.GC_HUB, regs.MM_HUB):
            r[hub.fb_base], r[hub.fb_base + 1] = GPU_BASE >> 24, (GPU_BASE + vram_bytes - 1) >> 24
        return r


def make_enclosure(**gpu_args) -> MockLibusb:
    """The ASM2464 port, the Navi 31 switch's two ports, and the GPU (MockGpu's arguments), on a
    mock USB bus."""
    gpu = MockGpu(**gpu_args)
    bridge = MockBridge([Port(0x1B21, 0x2461), Port(0x1002, 0x1478), Port(0x1002, 0x1479)], gpu)
    gpu.bridge = bridge
    gpu.usb = MockLibusb(bridge)
    gpu.usb.on_replug = gpu.reset
    return gpu.usb


def enclosure() -> MockLibusb:
    """The process's one mock enclosure, which KEEL_USB=mock opens (runner/simulators.py)."""
    return MockLibusb.shared(make_enclosure)
