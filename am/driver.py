"""AM: a user-space driver for a gfx11 GPU on any usbgpu.pci.PciDevice.

Bring-up (`Gpu.__init__`): read where VRAM sits in the GPU's address space, read IP discovery
near the top of VRAM through BAR0, check every firmware file the discovered IP versions need
(am/firmware.py), hand the PSP its sOS through the bootloader mailbox, enable the GART (VM
context 0 with a one-level page table in VRAM) with its first page on the bridge's DMA window,
start one compute queue whose ring lives in that window, clear the rest of the table through the
queue and open the whole GART range.

GPU virtual memory: everything the queue and the kernels touch (the ring and the window's slots,
the code object, weights, arena, io buffers, kernargs, the indirect buffer) is at a GART address
whose PTE names its VRAM page or, for the window, its system bus address. Only the page table
itself is written through a physical address (the system aperture onto the FB location). Every
mapping change is followed by a TLB invalidation (engine 17, as amdgpu does for the GART).

Everything the GPU reads from the host goes through the window, 4 KiB at a time: each window
write carries the ring's next packets (a DMA_DATA from the window's payload to VRAM, or a graph
submission), a signal slot, and the payload; one doorbell write starts it; the host polls the
signal with one bridge read. So moving data costs a few USB commands per 4 KiB instead of a PCIe
write per dword through BAR0.

Not done here (docs/amd.md): the PSP ring and the microcode loads after sOS (RLC, MEC, SDMA, SMU);
per-process VM contexts (VMID 1..15, multi-level tables): one GART serves one model.
"""
from __future__ import annotations

import struct
import time

import numpy as np

from am import discovery, firmware, pm4, psp, regs
from runner.device import wait_until
from runner.errors import DeviceError
from usbgpu.pci import PciDevice

# window layout: a 64-dword ring (a batch is at most 15 dwords), the signal and timeline slots,
# then 3824 bytes of payload (93% of each 4 KiB window write)
RING_BYTES, SIGNAL_AT, TIMELINE_AT, PAYLOAD_AT = 256, 256, 264, 272
RING_DWORDS = RING_BYTES // 4
DOORBELL = 0  # the queue's doorbell index (dwords into BAR2)
FIRMWARE_AT = 1 << 20  # VRAM offset of the PSP's sOS image (the mailbox takes address >> 20)
PT_AT = 8 << 20  # VRAM offset of the GART's page table (8 bytes per page: 1 MiB)
PSP_AT = 9 << 20  # the PSP's ring (4 KiB), then its command buffer and fence, a page each
PSP_RING_BYTES = 4096
TMR_AT = 12 << 20  # the PSP's trusted memory region (psp.TMR_BYTES)
IP_FW_AT, IP_FW_BYTES = 16 << 20, 8 << 20  # the copy of the image a LOAD_IP_FW names
HEAP_AT = 24 << 20  # first VRAM offset the allocator hands out
PAGE = 4096
GART_AT, GART_BYTES = 0x7FFF_0000_0000, 512 << 20  # GPU virtual range (below the FB location)
BOOT_TIMEOUT_S = 5.0


def discover(pci: PciDevice) -> dict:
    """The IP discovery binary, read through BAR0 DISCOVERY_TMR_OFFSET below its end (BAR0 must
    reach the top of VRAM: a resizable BAR, or the mock's small VRAM)."""
    at = pci.bars[0][1] - discovery.DISCOVERY_TMR_OFFSET
    head = bar0_read(pci, at, 12)
    return discovery.parse(bar0_read(pci, at, 10 + struct.unpack_from("<H", head, 10)[0]))


def bar0_read(pci: PciDevice, offset: int, n: int) -> bytes:
    return b"".join(struct.pack("<I", pci.read32(0, offset + i)) for i in range(0, n, 4))[:n]


class Gpu:
    def __init__(self, pci: PciDevice, fw_dir=None):
        self.pci = pci
        self.window_bus, self.window_bytes = pci.window
        self.vram_bytes = pci.bars[0][1]
        self.fb = self.reg(regs.GCMC_VM_FB_LOCATION_BASE) << 24
        self.ips = discover(pci)
        fws = firmware.load_all(self.ips, fw_dir)
        self._boot_psp(fws)
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        self.pt = self.fb + PT_AT  # the page table through the system aperture
        self.window, self.gart_top, self.top = GART_AT, GART_AT + PAGE, HEAP_AT
        self._start_vm(deadline)
        self._load_ip_firmware(fws)
        self.wptr, self.seq = 0, 0
        self.seen = {SIGNAL_AT: 0, TIMELINE_AT: 0}  # what the window's u64 slots hold
        self._start_queue()
        self._clear_table(deadline)

    # ---- registers and VRAM through BARs --------------------------------------------------------
    def reg(self, r: int) -> int:
        return self.pci.read32(5, 4 * r)

    def wreg(self, r: int, value: int) -> None:
        self.pci.write32(5, 4 * r, value)

    def _bar0_write(self, offset: int, data: bytes) -> None:
        data = data.ljust(-(-len(data) // 4) * 4, b"\0")
        for i in range(0, len(data), 4):
            self.pci.write32(0, offset + i, struct.unpack_from("<I", data, i)[0])

    def _boot_psp(self, fws: list) -> None:
        """sOS through the bootloader mailbox: image in VRAM, address >> 20, command, ready."""
        sos = next(f for f in fws if f.name.endswith("_sos.bin"))
        ready = time.monotonic() + BOOT_TIMEOUT_S
        self._psp_ready(regs.C2PMSG_35, f"bootloader, {sos.name}", ready)
        self._bar0_write(FIRMWARE_AT, sos.ucode)
        self.wreg(regs.C2PMSG_36, (self.fb + FIRMWARE_AT) >> 20 & 0xFFFFFFFF)
        self.wreg(regs.C2PMSG_35, regs.BL_LOAD_SOSDRV)
        ready = time.monotonic() + BOOT_TIMEOUT_S  # counted after the image's slow staging
        status = self._psp_ready(regs.C2PMSG_35, f"bootloader, {sos.name}", ready) & 0xFFFF
        if status or not self.reg(regs.C2PMSG_81):
            raise DeviceError(f"PSP refused firmware {sos.name} (bootloader status 0x{status:04x}, "
                              f"sOS version {self.reg(regs.C2PMSG_81):#x}); is it the file for "
                              f"this GPU?")

    def _load_ip_firmware(self, fws: list) -> None:
        """psp_v13_0_ring_create, SETUP_TMR, then one LOAD_IP_FW per image psp.FW_TYPES names.
        The command processor runs nothing before its microcode, so every byte goes through BAR0
        (one PCIe write per dword) and every address is VRAM's physical one (FB location). Each
        wait has its own BOOT_TIMEOUT_S, counted after the slow staging before it."""
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        self._psp_ready(regs.C2PMSG_64, "sOS ring interface", deadline)
        ring = self.fb + PSP_AT
        self.wreg(regs.C2PMSG_69, ring & 0xFFFFFFFF)
        self.wreg(regs.C2PMSG_70, ring >> 32)
        self.wreg(regs.C2PMSG_71, PSP_RING_BYTES)
        self.wreg(regs.C2PMSG_64, regs.INIT_GPCOM_RING)
        status = self._psp_ready(regs.C2PMSG_64, "GPCOM ring creation", deadline) & 0xFFFF
        if status:
            raise DeviceError(f"PSP refused its GPCOM ring at 0x{ring:x} (status 0x{status:04x})")
        self.psp_wptr = self.psp_fence = 0
        tmr = self.fb + TMR_AT
        self._psp_command(psp.SETUP_TMR, psp.SETUP.pack(tmr & 0xFFFFFFFF, tmr >> 32,
                                                        psp.TMR_BYTES, 0, 0, 0), "TMR")
        v = "_".join(map(str, next(ip.version for ip in self.ips.values() if ip.name == "GC")))
        for stem, kind in psp.FW_TYPES.items():
            name = f"{stem.format(v=v)}.bin"
            fw = next(f for f in fws if f.name == name)
            if len(fw.ucode) > IP_FW_BYTES:
                raise DeviceError(f"AMD firmware {name}: {len(fw.ucode)} bytes of microcode, "
                                  f"more than the {IP_FW_BYTES}-byte staging area")
            self._bar0_write(IP_FW_AT, fw.ucode)
            at = self.fb + IP_FW_AT
            self._psp_command(psp.LOAD_IP_FW, psp.LOAD.pack(at & 0xFFFFFFFF, at >> 32,
                                                            len(fw.ucode), kind),
                              f"firmware {name}")

    def _psp_command(self, cmd_id: int, body: bytes, what: str) -> None:
        """One command buffer and one ring frame (psp_ring_cmd_submit); wait for its fence, then
        its response's status."""
        cmd, fence = self.fb + PSP_AT + PSP_RING_BYTES, self.fb + PSP_AT + PSP_RING_BYTES + PAGE
        self._bar0_write(PSP_AT + PSP_RING_BYTES, psp.command(cmd_id, body))
        self.psp_fence += 1
        ring_dw = PSP_RING_BYTES // 4
        self._bar0_write(PSP_AT + 4 * (self.psp_wptr % ring_dw),
                         psp.frame(cmd, fence, self.psp_fence))
        self.psp_wptr = (self.psp_wptr + psp.FRAME_BYTES // 4) % ring_dw
        self.wreg(regs.C2PMSG_67, self.psp_wptr)
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        fence_at = PSP_AT + PSP_RING_BYTES + PAGE
        try:
            wait_until(lambda: self.pci.read32(0, fence_at) == self.psp_fence, deadline,
                       f"PSP ({what})")
        except TimeoutError:
            raise DeviceError(f"PSP did not answer within {BOOT_TIMEOUT_S} s ({what})") from None
        status = self.pci.read32(0, PSP_AT + PSP_RING_BYTES + psp.RESP_AT)
        if status:
            raise DeviceError(f"PSP refused {what} (status 0x{status:08x}); is it the file for "
                              f"this GPU?")

    def _psp_ready(self, reg: int, what: str, deadline: float) -> int:
        box = [0]

        def ready() -> bool:
            box[0] = self.reg(reg)
            return bool(box[0] & regs.BL_READY)
        try:
            wait_until(ready, deadline, f"PSP ({what})")
        except TimeoutError:
            raise DeviceError(f"PSP not ready within {BOOT_TIMEOUT_S} s ({what})") from None
        return box[0]

    def _start_vm(self, deadline: float) -> None:
        """gfxhub_v3_0's GART setup for VMID 0: AGP closed, the system aperture on VRAM only, a
        one-level table whose first PTE (written through BAR0) maps the DMA window, and a GART
        range of that one page until the rest of the table is known to be clear."""
        if self.window_bus % PAGE or self.window_bytes > PAGE:
            raise DeviceError(f"DMA window at bus 0x{self.window_bus:x} of {self.window_bytes} "
                              f"bytes: expected one aligned {PAGE}-byte page")
        window = self.window_bus | regs.PTE_SYSTEM | regs.PTE_SNOOPED | regs.PTE_RWX
        self._bar0_write(PT_AT, struct.pack("<Q", window))
        self.wreg(regs.GCMC_VM_AGP_BOT, 0xFFFFFF)  # BOT above TOP: no AGP aperture
        self.wreg(regs.GCMC_VM_AGP_TOP, 0)
        self.wreg(regs.GCMC_VM_SYSTEM_APERTURE_LOW_ADDR, self.fb >> 18)
        self.wreg(regs.GCMC_VM_SYSTEM_APERTURE_HIGH_ADDR, (self.fb + self.vram_bytes - 1) >> 18)
        # the table's physical address: its VRAM offset (GCMC_VM_FB_OFFSET is 0 on a discrete
        # card, an assumption only hardware confirms), with the PDE's valid bit
        self.wreg(regs.GCVM_CONTEXT0_PT_BASE_LO, PT_AT | regs.PTE_VALID)
        self.wreg(regs.GCVM_CONTEXT0_PT_BASE_HI, 0)
        self._gart_pages(1)
        self.wreg(regs.GCVM_CONTEXT0_CNTL, regs.CONTEXT_ENABLE)  # PAGE_TABLE_DEPTH 0
        self._flush_tlb(deadline)

    def _gart_pages(self, n: int) -> None:
        first, last = GART_AT >> 12, (GART_AT >> 12) + n - 1
        self.wreg(regs.GCVM_CONTEXT0_PT_START_LO, first & 0xFFFFFFFF)
        self.wreg(regs.GCVM_CONTEXT0_PT_START_HI, first >> 32)
        self.wreg(regs.GCVM_CONTEXT0_PT_END_LO, last & 0xFFFFFFFF)
        self.wreg(regs.GCVM_CONTEXT0_PT_END_HI, last >> 32)

    def _flush_tlb(self, deadline: float) -> None:
        self.wreg(regs.GCVM_INVALIDATE_ENG17_REQ, 1 | regs.INVALIDATE_ALL)  # VMID 0
        wait_until(lambda: self.reg(regs.GCVM_INVALIDATE_ENG17_ACK) & 1, deadline,
                   "GART TLB invalidation")

    def _clear_table(self, deadline: float) -> None:
        """Zero every PTE after the window's (VRAM holds garbage after power-up): one window of
        zeros, then DMA_DATA copies that double the cleared part; then open the whole range."""
        n, room = GART_BYTES // PAGE * 8 - 8, (self.window_bytes - PAYLOAD_AT) // 8 * 8
        done = min(room, n)
        self.upload(self.pt + 8, bytes(done), deadline)
        copies = []
        while done < n:
            k = min(done, n - done)
            copies.append(pm4.dma_data(self.pt + 8, self.pt + 8 + done, k))
            done += k
        for i in range(0, len(copies), 7):  # 7 DMA_DATA + RELEASE_MEM fit the ring
            self.post(sum(copies[i:i + 7], []), b"", deadline)
        self._gart_pages(GART_BYTES // PAGE)
        self._flush_tlb(deadline)

    def _start_queue(self) -> None:
        self.wreg(regs.GRBM_GFX_CNTL, regs.GRBM_ME1_PIPE0_QUEUE0)
        self.wreg(regs.CP_HQD_ACTIVE, 0)
        ring = self.window >> 8
        self.wreg(regs.CP_HQD_PQ_BASE, ring & 0xFFFFFFFF)
        self.wreg(regs.CP_HQD_PQ_BASE_HI, ring >> 32)
        self.wreg(regs.CP_HQD_PQ_CONTROL, RING_DWORDS.bit_length() - 2)  # log2(dwords) - 1
        self.wreg(regs.CP_HQD_PQ_RPTR, 0)
        self.wreg(regs.CP_HQD_PQ_WPTR_LO, 0)
        self.wreg(regs.CP_HQD_PQ_WPTR_HI, 0)
        self.wreg(regs.CP_HQD_PQ_DOORBELL_CONTROL, regs.DOORBELL_EN | DOORBELL << 2)
        self.wreg(regs.CP_HQD_ACTIVE, 1)

    # ---- VRAM, mapped through the GART --------------------------------------------------------
    def alloc(self, n: int, deadline: float) -> int:
        """`n` bytes of VRAM at a new GART address: its PTEs written through the queue, the TLB
        invalidated."""
        pages = max(1, -(-n // PAGE))
        phys = -(-self.top // PAGE) * PAGE
        if phys + pages * PAGE > self.vram_bytes - (1 << 20):  # the discovery table's megabyte
            raise DeviceError(f"VRAM: {n} bytes do not fit "
                              f"({self.vram_bytes - (1 << 20) - phys} left)")
        va = self.gart_top
        if va + pages * PAGE > GART_AT + GART_BYTES:
            raise DeviceError(f"GART: {n} bytes do not fit in its {GART_BYTES >> 20} MiB "
                              f"({GART_AT + GART_BYTES - va} bytes left)")
        ptes = (phys + PAGE * np.arange(pages, dtype=np.uint64)) | np.uint64(regs.PTE_RWX)
        self.upload(self.pt + 8 * ((va - GART_AT) // PAGE), ptes.astype("<u8").tobytes(), deadline)
        self._flush_tlb(deadline)
        self.top, self.gart_top = phys + pages * PAGE, va + pages * PAGE
        return va

    # ---- the window: packets + signal + payload, one doorbell, one poll -------------------------
    def post(self, packets: list[int], payload: bytes, deadline: float) -> None:
        """Run `packets` from the ring with `payload` at the window's PAYLOAD_AT; returns once the
        RELEASE_MEM they end with has written the window's signal."""
        self.seq += 1
        self.launch(packets + pm4.release_mem(self.window + SIGNAL_AT, self.seq), payload)
        wait_until(lambda: self._read(SIGNAL_AT) >= self.seq, deadline, "GPU queue")

    def launch(self, packets: list[int], payload: bytes = b"") -> None:
        """Write `packets` at the ring's write pointer (wrapping at its end) and ring the
        doorbell; the window's signal and timeline slots keep the values last seen."""
        if len(packets) > RING_DWORDS:
            raise ValueError(f"{len(packets)} dwords of packets; the ring holds {RING_DWORDS}")
        ring = [0] * RING_DWORDS  # the CP reads only from its read to its write pointer
        for i, w in enumerate(packets):
            ring[(self.wptr + i) % RING_DWORDS] = w
        slots = struct.pack("<QQ", self.seen[SIGNAL_AT], self.seen[TIMELINE_AT])
        self.wptr += len(packets)
        self.pci.dma_put(struct.pack(f"<{RING_DWORDS}I", *ring) +
                         slots.ljust(PAYLOAD_AT - SIGNAL_AT, b"\0") + payload,
                         then=(2, 4 * DOORBELL, self.wptr))

    def _read(self, at: int) -> int:
        self.seen[at] = struct.unpack("<Q", self.pci.dma_get(at, 8))[0]
        return self.seen[at]

    def timeline(self) -> int:
        """The last timeline value a graph submission's RELEASE_MEM wrote (window slot)."""
        return self._read(TIMELINE_AT)

    def upload(self, va: int, data, deadline: float) -> None:
        room = self.window_bytes - PAYLOAD_AT
        view = memoryview(data).cast("B")
        for off in range(0, len(view), room):
            part = bytes(view[off:off + room])
            self.post(pm4.dma_data(self.window + PAYLOAD_AT, va + off, len(part)), part, deadline)

    def download(self, va: int, out: memoryview, deadline: float) -> None:
        room = self.window_bytes - PAYLOAD_AT
        for off in range(0, len(out), room):
            n = min(room, len(out) - off)
            self.post(pm4.dma_data(va + off, self.window + PAYLOAD_AT, n), b"", deadline)
            out[off:off + n] = self.pci.dma_get(PAYLOAD_AT, n)

    def close(self) -> None:
        self.pci.close()
