"""AM: a user-space driver for a gfx11 GPU on any usbgpu.pci.PciDevice.

Bring-up (`Gpu.__init__`): read VRAM's size (RCC_CONFIG_MEMSIZE) and where it sits in the GPU's
address space, read IP discovery near the top of VRAM (through BAR0 resized to reach it, or
MM_INDEX/MM_DATA), check every firmware file the discovered IP versions need (am/firmware.py),
open NBIO's doorbell aperture, give the MM hub VM context 0 on a four-level page table
(am/vm.py) mapping the bridge's staging memory (its first page is the DMA window), bring the
firmware up through the PSP, which reads each image staged there (am/boot.py: bootloader
components, sOS, its ring, the TOC, SMU, TMR, PFP/ME/MEC/IMU/RLC, the RLC's autoload, MEC pipe
0's start), then the GC hub on the same table, one compute queue whose ring lives in the window,
the new tables cleared through the queue, and the GC hub's whole virtual range opened.

GPU virtual memory: everything the queue and the kernels touch (the ring and the window's words,
the code object, weights, arena, io buffers, kernargs, the indirect buffer) is at a virtual
address whose leaf names its VRAM page (2 MiB pages where an allocation allows, 4 KiB
elsewhere) or, for the staging memory, its system bus address. Only the tables themselves are
written through physical addresses (the system aperture onto the FB location). Every mapping
change is followed by a TLB invalidation (engine 17, as amdgpu does for its own mappings).

Everything the GPU reads from the host goes through the staging memory: each upload writes
the ring's next packets (up to 7 DMA_DATA from the payload to VRAM, or a graph submission), the
signal words and up to 512 KiB - 272 bytes of payload from the window's start (one window
write when it fits 4 KiB, else 64 KiB bulk writes); one doorbell write starts it; the host polls
the signal with one bridge read. So moving data costs a few USB commands per 64 KiB instead of
a PCIe write per dword through BAR0.

Beside the firmware (am/gc.py, amdgpu's order): NBIO's doorbell aperture and routing, the GC
hub's L1 TLB and L2, SH_MEM_CONFIG/BASES per VMID, and the queue mapped from its MQD. Not done
here (docs/amd.md): clock gating, golden registers; per-process VM contexts (VMID 1..15): one
context serves one model.
"""
from __future__ import annotations

import struct
import time

from am import boot, discovery, firmware, gc, mqd, pm4, regs, vm
from runner.device import wait_until
from runner.errors import DeviceError
from usbgpu.pci import PciDevice

# window layout: a 64-dword ring (a batch is at most 57 dwords), the signal and timeline words,
# then 3824 bytes of payload (93% of each 4 KiB window write)
RING_BYTES, SIGNAL_AT, TIMELINE_AT, PAYLOAD_AT = 256, 256, 264, 272
RING_DWORDS = RING_BYTES // 4
MAX_COPIES = 7  # DMA_DATA (7 dwords) per window write: 7 of them + RELEASE_MEM (8) fit the ring
DOORBELL = 0  # the queue's doorbell index (dwords into BAR2)
MEC_DOORBELLS = 0xF8  # CP_MEC_DOORBELL_RANGE_UPPER (bytes): doorbells the MEC listens to
# VRAM after am/boot.END: the queue's page (its MQD, then the read pointer report and write
# pointer poll words), its EOP buffer, the system aperture's default page and the protection
# fault's dummy page; then the page-table pool
MQD_AT, EOP_AT, SCRATCH_AT, DUMMY_AT = boot.END, boot.END + 4096, boot.END + 8192, boot.END + 12288
RPTR_AT = MQD_AT + 4 * mqd.DWORDS
PT_AT, PT_BYTES = 36 << 20, 4 << 20
HEAP_AT = PT_AT + PT_BYTES  # first VRAM offset the allocator hands out
PAGE = 4096
VM_AT, VM_BYTES = 0x2000_0000_0000, 1 << 40  # GPU virtual range (below the FB location)
BOOT_TIMEOUT_S = 5.0


def vram_size(pci: PciDevice) -> int:
    """VRAM's bytes, from RCC_CONFIG_MEMSIZE (MiB): read before anything is known of the GPU."""
    mib = pci.read32(5, 4 * regs.RCC_CONFIG_MEMSIZE)
    if mib in (0, 0xFFFFFFFF):
        raise DeviceError(f"RCC_CONFIG_MEMSIZE reads 0x{mib:x}: expected VRAM's size in MiB "
                          f"(is the GPU out of reset?)")
    return mib << 20


def discover(pci: PciDevice, vram_bytes: int) -> dict:
    """The IP discovery binary, DISCOVERY_TMR_OFFSET below the top of VRAM."""
    at = vram_bytes - discovery.DISCOVERY_TMR_OFFSET
    head = vram_read(pci, at, 12)
    return discovery.parse(vram_read(pci, at, 10 + struct.unpack_from("<H", head, 10)[0]))


def vram_read(pci: PciDevice, offset: int, n: int) -> bytes:
    """VRAM through BAR0 where it reaches (a BAR0 resized to all of VRAM: usbgpu/pci.py), else
    through MM_INDEX/MM_DATA (a card whose BAR0 could not grow keeps 256 MiB)."""
    if offset + n <= pci.bars[0][1]:
        return b"".join(struct.pack("<I", pci.read32(0, offset + i)) for i in range(0, n, 4))[:n]
    words = []
    for at in range(offset, offset + n, 4):
        pci.write32(5, 4 * regs.MM_INDEX, at & 0x7FFFFFFF | regs.MM_APERTURE)
        pci.write32(5, 4 * regs.MM_INDEX_HI, at >> 31)
        words.append(struct.pack("<I", pci.read32(5, 4 * regs.MM_DATA)))
    return b"".join(words)[:n]


class Gpu:
    # the bring-up in order; tools/doctor.py runs them one at a time (steps=()) to name the one
    # that fails
    STEPS = ("discovery", "firmware", "mm_hub", "psp", "gc_hub", "queue")

    def __init__(self, pci: PciDevice, fw_dir=None, steps=STEPS):
        self.pci, self.fw_dir = pci, fw_dir
        self.window_bus, self.window_bytes = pci.window
        self.vram_bytes = vram_size(pci)
        self.fb = self.reg(regs.GCMC_VM_FB_LOCATION_BASE) << 24
        self.phys = self.reg(regs.GCMC_VM_FB_OFFSET) << 24  # VRAM offset 0's physical address
        self.window, self.va_top, self.top = VM_AT, VM_AT + pci.staging[1], HEAP_AT
        for name in steps:
            self.step(name)

    def step(self, name: str) -> None:
        {"discovery": self._discovery, "firmware": self._firmware, "mm_hub": self._mm_hub,
         "psp": self._psp, "gc_hub": self._gc_hub, "queue": self._queue}[name]()

    def _discovery(self) -> None:
        self.ips = discover(self.pci, self.vram_bytes)

    def _firmware(self) -> None:
        """Every file the discovered IP versions need, read and parsed before the GPU is touched."""
        self.fws = firmware.load_all(self.ips, self.fw_dir)

    def _mm_hub(self) -> None:
        gc.doorbell_aperture(self)
        self._start_mm(time.monotonic() + BOOT_TIMEOUT_S)

    def _psp(self) -> None:
        boot.Psp(self, self.fws).bring_up()

    def _gc_hub(self) -> None:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        self._context0(regs.GC_HUB, self.pci.staging[1] // PAGE)
        gc.hub_caches(self, self.phys + SCRATCH_AT, self.phys + DUMMY_AT)
        self._flush_tlb(deadline, regs.GC_HUB)
        gc.sh_mem(self)
        gc.gc_doorbells(self)

    def _queue(self) -> None:
        """The compute queue mapped from its MQD, then the page tables written so far cleared
        and filled through it and the GC hub's whole range opened."""
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        self.wptr, self.seq = 0, 0
        self.seen = {SIGNAL_AT: 0, TIMELINE_AT: 0}  # what the window's u64 words hold
        self.queue = mqd.Queue(self.fb + MQD_AT, self.window, RING_BYTES, self.fb + RPTR_AT,
                               self.fb + RPTR_AT + 8, self.fb + EOP_AT, DOORBELL)
        gc.map_queue(self, self.queue, MEC_DOORBELLS)
        self.put([(self.fb + off, data) for off, data in self.vm.fresh()], deadline)
        self._range(regs.GC_HUB, VM_BYTES // PAGE)
        self._flush_tlb(deadline, regs.GC_HUB)

    # ---- registers and VRAM through BARs --------------------------------------------------------
    def reg(self, r: int) -> int:
        if r >= regs.MMIO_DWORDS:  # beyond BAR5: through NBIO's index/data pair
            self.pci.write32(5, 4 * regs.RSMU_INDEX, 4 * r)
            r = regs.RSMU_DATA
        return self.pci.read32(5, 4 * r)

    def wreg(self, r: int, value: int) -> None:
        if r >= regs.MMIO_DWORDS:
            self.pci.write32(5, 4 * regs.RSMU_INDEX, 4 * r)
            r = regs.RSMU_DATA
        self.pci.write32(5, 4 * r, value)

    def bar0_write(self, offset: int, data: bytes) -> None:
        data = data.ljust(-(-len(data) // 4) * 4, b"\0")
        for i in range(0, len(data), 4):
            self.pci.write32(0, offset + i, struct.unpack_from("<I", data, i)[0])

    def _start_mm(self, deadline: float) -> None:
        """Before the PSP (amdgpu's gmc hw_init, tinygrad's AM_GMC): the four-level table whose
        first entries map the staging memory (the bridge's SRAM, the window its first page) at
        VM_AT, written through BAR0, and VM context 0 of the MM hub on it, with a range of just
        those pages until the rest of the tables is known to be clear. The PSP reads every
        firmware image there (am/boot.py); the GC hub gets the same table after the RLC's
        autoload, which resets the GC hub."""
        bus, size = self.pci.staging
        if bus != self.window_bus or bus % PAGE or size % PAGE or self.window_bytes > PAGE:
            raise DeviceError(f"DMA window 0x{self.window_bus:x}+{self.window_bytes}, staging "
                              f"0x{bus:x}+{size}: expected one aligned page at the staging "
                              f"memory's start")
        self.vm = vm.PageTable(VM_AT, PT_AT, PT_BYTES, self.phys)
        self.vm.map(VM_AT, bus, size, vm.SYSTEM | vm.SNOOPED | vm.RWX)
        for off, data in self.vm.spans(new_too=True):
            self.bar0_write(off, data)
        self._context0(regs.MM_HUB, size // PAGE)
        gc.tlb_and_l2(self, regs.MM_HUB)
        self._flush_tlb(deadline, regs.MM_HUB)

    def _context0(self, hub: regs.Hub, pages: int) -> None:
        """gfxhub/mmhub_v3_0_gart_enable's apertures and context 0 (init_gart_aperture_regs,
        init_system_aperture_regs, enable_system_domain), on keel's four-level table: AGP
        closed, the system aperture on VRAM only, the range `pages` from VM_AT."""
        self.wreg(hub.agp_bot, 0xFFFFFF)  # BOT above TOP: no AGP aperture
        self.wreg(hub.agp_top, 0)
        self.wreg(hub.sys_low, self.fb >> 18)
        self.wreg(hub.sys_high, (self.fb + self.vram_bytes - 1) >> 18)
        root = self.phys + self.vm.root | vm.VALID
        self.wreg(hub.pt_base, root & 0xFFFFFFFF)
        self.wreg(hub.pt_base + 1, root >> 32)
        self._range(hub, pages)
        depth = vm.DEPTH << regs.CONTEXT_DEPTH_SHIFT  # PAGE_TABLE_BLOCK_SIZE 0
        self.wreg(hub.cntl, regs.CONTEXT_ENABLE | depth)

    def _range(self, hub: regs.Hub, pages: int) -> None:
        first, last = VM_AT >> 12, (VM_AT >> 12) + pages - 1
        self.wreg(hub.pt_start, first & 0xFFFFFFFF)
        self.wreg(hub.pt_start + 1, first >> 32)
        self.wreg(hub.pt_end, last & 0xFFFFFFFF)
        self.wreg(hub.pt_end + 1, last >> 32)

    def _flush_tlb(self, deadline: float, hub: regs.Hub = regs.GC_HUB) -> None:
        """Engine 17, VMID 0 (gmc_v11_0_flush_vm_hub: the MM hub's semaphore taken around it)."""
        if hub.inv_sem is not None:
            wait_until(lambda: self.reg(hub.inv_sem) & 1, deadline, f"{hub.name} hub semaphore")
        self.wreg(hub.inv_req, 1 | regs.INVALIDATE_ALL)
        wait_until(lambda: self.reg(hub.inv_ack) & 1, deadline,
                   f"{hub.name} hub TLB invalidation")
        if hub.inv_sem is not None:
            self.wreg(hub.inv_sem, 0)

    # ---- VRAM, mapped through the page table --------------------------------------------------
    def alloc(self, n: int, deadline: float) -> int:
        """`n` bytes of VRAM at a new virtual address (both 2 MiB aligned from 2 MiB up, so whole
        2 MiB pages map through PDB0 leaves): the table changes written through the queue, the
        TLB invalidated."""
        align = vm.HUGE if n >= vm.HUGE else PAGE
        size = max(1, -(-n // PAGE)) * PAGE
        phys, va = -(-self.top // align) * align, -(-self.va_top // align) * align
        if phys + size > self.vram_bytes - (1 << 20):  # the discovery table's megabyte
            raise DeviceError(f"VRAM: {n} bytes do not fit "
                              f"({self.vram_bytes - (1 << 20) - phys} left)")
        if va + size > VM_AT + VM_BYTES:
            raise DeviceError(f"GPU virtual memory: {n} bytes do not fit in its "
                              f"{VM_BYTES >> 30} GiB ({VM_AT + VM_BYTES - va} bytes left)")
        self.vm.map(va, self.phys + phys, size, vm.RWX)
        self.put([(self.fb + off, data) for off, data in self.vm.fresh() + self.vm.spans()],
                 deadline)
        self._flush_tlb(deadline)
        self.top, self.va_top = phys + size, va + size
        return va

    # ---- the window: packets + signal + payload, one doorbell, one poll -------------------------
    def post(self, packets: list[int], payload: list, deadline: float) -> None:
        """Run `packets` from the ring with `payload` (bytes-like pieces, end to end) at the
        window's PAYLOAD_AT; returns once the RELEASE_MEM they end with has written the window's
        signal."""
        self.seq += 1
        self.launch(packets + pm4.release_mem(self.window + SIGNAL_AT, self.seq), payload)
        wait_until(lambda: self._read(SIGNAL_AT) >= self.seq, deadline,
                   "GPU queue (compute, ME 1 pipe 0 queue 0)")

    def launch(self, packets: list[int], payload: list = ()) -> None:
        """Write `packets` at the ring's write pointer (wrapping at its end) and ring the
        doorbell; the window's signal and timeline words keep the values last seen. The payload
        pieces go to the bridge as they are (views of the caller's memory: a plane bound from
        another device's mapping is read from there, once, into the USB transfers)."""
        if len(packets) > RING_DWORDS:
            raise ValueError(f"{len(packets)} dwords of packets; the ring holds {RING_DWORDS}")
        ring = [0] * RING_DWORDS  # the CP reads only from its read to its write pointer
        for i, w in enumerate(packets):
            ring[(self.wptr + i) % RING_DWORDS] = w
        words = struct.pack("<QQ", self.seen[SIGNAL_AT], self.seen[TIMELINE_AT])
        self.wptr += len(packets)
        data = [struct.pack(f"<{RING_DWORDS}I", *ring) + words.ljust(PAYLOAD_AT - SIGNAL_AT, b"\0"),
                *payload]
        if sum(map(len, data)) <= self.window_bytes:  # one window write, the doorbell with it
            self.pci.dma_put(b"".join(data), then=(2, 4 * DOORBELL, self.wptr))
        else:  # the staging memory from the window on: 64 KiB bulk writes, then the doorbell
            self.pci.stage(data)
            self.pci.write32(2, 4 * DOORBELL, self.wptr)

    def _read(self, at: int) -> int:
        self.seen[at] = struct.unpack("<Q", self.pci.dma_get(at, 8))[0]
        return self.seen[at]

    def timeline(self) -> int:
        """The last timeline value a graph submission's RELEASE_MEM wrote (a window word)."""
        return self._read(TIMELINE_AT)

    def upload(self, va: int, data, deadline: float) -> None:
        self.put([(va, memoryview(data).cast("B"))], deadline)

    def put(self, pieces, deadline: float) -> None:
        """Copy each (GPU address, bytes) piece into GPU memory: the pieces packed into writes
        of the staging memory (the window and the SRAM after it, mapped from VM_AT) of up to
        MAX_COPIES DMA_DATA each (8-byte aligned in the payload)."""
        for packets, payload in self._batches(pieces):
            self.post(packets, payload, deadline)

    def put_then(self, pieces, packets: list[int], deadline: float) -> None:
        """put(pieces), then `packets`, which start without a wait: they go in the last batch's
        doorbell, after its copies (DMA_DATA finishes before the next packet). A graph's
        inputs and its launch are then one staging write and one doorbell."""
        batches = list(self._batches(pieces)) or [([], [])]
        for copies, payload in batches[:-1]:
            self.post(copies, payload, deadline)
        copies, payload = batches[-1]
        if len(copies) + len(packets) > RING_DWORDS:
            self.post(copies, payload, deadline)
            copies, payload = [], []
        self.launch(copies + packets, payload)

    def _batches(self, pieces):
        """(DMA_DATA packets, payload pieces) per write of the staging memory."""
        room = self.pci.staging[1] - PAYLOAD_AT
        packets, payload, size = [], [], 0  # payload: views of `pieces`, and alignment gaps
        for va, data in pieces:
            view = memoryview(data).cast("B")
            while len(view):
                at = -(-size // 8) * 8
                k = min(len(view), room - at)
                if k <= 0 or len(packets) >= MAX_COPIES * 7:
                    yield packets, payload
                    packets, payload, size = [], [], 0
                    continue
                payload += [bytes(at - size), view[:k]]
                packets += pm4.dma_data(self.window + PAYLOAD_AT + at, va, k)
                view, va, size = view[k:], va + k, at + k
        if packets:
            yield packets, payload

    def download(self, va: int, out: memoryview, deadline: float) -> None:
        room = self.window_bytes - PAYLOAD_AT
        for off in range(0, len(out), room):
            n = min(room, len(out) - off)
            self.post(pm4.dma_data(va + off, self.window + PAYLOAD_AT, n), [], deadline)
            out[off:off + n] = self.pci.dma_get(PAYLOAD_AT, n)

    def close(self) -> None:
        self.pci.close()
