"""The firmware bring-up of a gfx11 GPU, in amdgpu's order (amdgpu_psp.c psp_hw_start and
psp_np_fw_load; psp_v13_0.c for the mailboxes; tinygrad's AM_PSP/AM_GFX do the same on an RX
7900 from user space):

 1. the PSP bootloader (C2PMSG_35/36): each component of the sOS file present, in psp.BOOT's
    order (key database, SPL, system driver, SOC/interface/debug/RAS drivers), then sOS, whose
    sign of life is C2PMSG_81 turning non-zero;
 2. sOS's GPCOM ring (C2PMSG_64/67/69-71);
 3. LOAD_TOC with the file's TOC component: the answer is the TMR size (else PSP_TMR_SIZE);
 4. the SMU firmware, then SETUP_TMR (amdgpu loads PMFW before the TMR when it manages the
    power states, as on SMU 13.0.0);
 5. LOAD_IP_FW per part of PFP, ME, MEC (RS64: code, then its data as every pipe's stack),
    IMU (IRAM, DRAM) and RLC (restore lists, IRAM/DRAM boot, RLC_P/V, then RLC_G);
 6. AUTOLOAD_RLC: the RLC copies the microcode out of the TMR into the engines; wait for
    RLC_RLCS_BOOTLOAD_STATUS.BOOTLOAD_COMPLETE;
 7. MEC pipe 0: program counter at the MEC file's ucode_start_addr, a reset pulse, unhalt.

The command processor runs nothing before step 7, so the images go where the PSP can read them
without it: the bridge's SRAM (usbgpu's staging memory, 64 KiB per bulk write), which the MM hub's
VM context 0 maps at the GPU address the driver calls its window (tinygrad's AM puts its USB
firmware buffer there too). Only the PSP's ring, command buffer and fence, a few dwords each,
go through BAR0 to VRAM, at MC addresses (FB location) the MM hub's system aperture reaches.
Every wait has its own BOOT_TIMEOUT_S, counted after the slow staging before it.
"""
from __future__ import annotations

import struct
import time

from am import firmware, psp, regs
from runner.device import wait_until
from runner.errors import DeviceError

PSP_AT = 2 << 20  # the GPCOM ring (4 KiB), then its command buffer and fence, a page each
RING_BYTES, PAGE = 4096, 4096
TMR_AT, TMR_MAX = 16 << 20, 0x1300000  # the trusted region (1 MiB aligned; tinygrad's maximum)
END = TMR_AT + TMR_MAX  # the first VRAM offset bring-up leaves alone
BOOT_TIMEOUT_S = 5.0


class Psp:
    def __init__(self, gpu, fws: list[firmware.Firmware]):
        self.gpu, self.fws = gpu, {firmware.kind_of(f.name): f for f in fws}
        self.gc = [f for f in fws if f.name.startswith("gc_")]  # PFP, ME, MEC, IMU, RLC
        self.wptr = self.fence = 0

    def bring_up(self) -> None:
        sos = self.fws["sos"]
        for kind, cmd in psp.BOOT if not self.gpu.reg(regs.C2PMSG_81) else ():
            part = next((p for p in sos.parts if p.kinds[0] == kind), None)
            if part is not None:  # (a running sOS, after recover(), is kept, as amdgpu does)
                self._bootloader(sos.name, kind, cmd, part.data)
        self._ring()
        toc = next((p.data for p in sos.parts if p.kinds[0] == psp.TOC_BIN), None)
        tmr = self._toc(sos.name, toc) if toc is not None else psp.TMR_BYTES
        self._load(self.fws["smu"])
        at = self.gpu.fb + TMR_AT
        self.command(psp.SETUP_TMR, psp.SETUP.pack(at & 0xFFFFFFFF, at >> 32, tmr,
                                                   psp.VIRT_PHY_ADDR, TMR_AT, 0), "TMR")
        for fw in self.gc:
            self._load(fw)
        self.command(psp.AUTOLOAD_RLC, b"", "RLC autoload")
        self._wait(lambda: self.gpu.reg(regs.RLC_RLCS_BOOTLOAD_STATUS) & regs.BOOTLOAD_COMPLETE,
                   "RLC autoload")
        self._start_mec(next(f for f in self.gc if f.name.endswith("_mec.bin")))

    def _bootloader(self, name: str, kind: int, cmd: int, data: bytes) -> None:
        what = f"firmware {name} (bootloader component {kind})"
        if len(data) > psp.BL_IMAGE_BYTES:
            raise DeviceError(f"AMD {what}: {len(data)} bytes; the bootloader takes at most "
                              f"{psp.BL_IMAGE_BYTES}")
        self._ready(regs.C2PMSG_35, what)
        at = self._stage(data, what)
        self.gpu.wreg(regs.C2PMSG_36, at >> 20 & 0xFFFFFFFF)
        self.gpu.wreg(regs.C2PMSG_35, cmd)
        if kind == psp.SOS:  # alive once C2PMSG_81 (sOS's version) is set; a bootloader
            # ready again with an error status has refused it: no need to wait any longer
            def settled() -> bool:
                bl = self.gpu.reg(regs.C2PMSG_35)
                return bool(self.gpu.reg(regs.C2PMSG_81) or bl & regs.BL_READY and bl & 0xFFFF)
            self._wait(settled, what, fail=False)
            status = self.gpu.reg(regs.C2PMSG_35) & 0xFFFF
            ok = bool(self.gpu.reg(regs.C2PMSG_81))
        else:
            status = self._ready(regs.C2PMSG_35, what) & 0xFFFF
            ok = not status
        if not ok:
            raise DeviceError(f"PSP refused {what} (bootloader status 0x{status:04x}); is it the "
                              f"file for this GPU?")

    def _ring(self) -> None:
        """psp_v13_0_ring_create: wait for sOS, ring address and size, INIT_GPCOM_RING (a ring
        left from an earlier bring-up destroyed first, as tinygrad's _ring_create does)."""
        if self.gpu.reg(regs.C2PMSG_71):
            self.gpu.wreg(regs.C2PMSG_64, regs.DESTROY_RINGS)
        self._ready(regs.C2PMSG_64, "sOS ring interface")
        ring = self.gpu.fb + PSP_AT
        self.gpu.wreg(regs.C2PMSG_69, ring & 0xFFFFFFFF)
        self.gpu.wreg(regs.C2PMSG_70, ring >> 32)
        self.gpu.wreg(regs.C2PMSG_71, RING_BYTES)
        self.gpu.wreg(regs.C2PMSG_64, regs.INIT_GPCOM_RING)
        status = self._ready(regs.C2PMSG_64, "GPCOM ring creation") & 0xFFFF
        if status:
            raise DeviceError(f"PSP refused its GPCOM ring at 0x{ring:x} (status 0x{status:04x})")

    def _toc(self, name: str, toc: bytes) -> int:
        at = self._stage(toc, f"the TOC of {name}")
        resp = self.command(psp.LOAD_TOC, psp.TOC.pack(at & 0xFFFFFFFF, at >> 32, len(toc)),
                            f"the TOC of {name}")
        size = struct.unpack_from("<I", resp, 16)[0]  # psp_gfx_resp.tmr_size
        if not 0 < size <= TMR_MAX or size % PAGE:
            raise DeviceError(f"PSP: LOAD_TOC of {name} asks for a {size}-byte TMR; expected "
                              f"whole pages up to {TMR_MAX}")
        return size

    def _load(self, fw: firmware.Firmware) -> None:
        """One LOAD_IP_FW per type of each part, the part staged once."""
        for part in fw.parts:
            at = self._stage(part.data, f"firmware {fw.name}")
            for kind in part.kinds:
                self.command(psp.LOAD_IP_FW, psp.LOAD.pack(at & 0xFFFFFFFF, at >> 32,
                                                           len(part.data), kind),
                             f"firmware {fw.name} (type {kind})")

    def _stage(self, data: bytes, what: str) -> int:
        """`data` into the staging memory (the bridge's SRAM, in 64 KiB bulk writes), which the
        PSP reads through the MM hub at the GPU's VM_AT (1 MiB aligned, as C2PMSG_36 needs);
        returns that address."""
        room = self.gpu.pci.staging[1]
        if len(data) > room:
            raise DeviceError(f"AMD {what}: a {len(data)}-byte image, more than the {room}-byte "
                              f"staging memory the PSP reads images from")
        self.gpu.pci.stage(data)
        return self.gpu.window

    def command(self, cmd_id: int, body: bytes, what: str) -> bytes:
        """One command buffer and one ring frame (psp_ring_cmd_submit); wait for its fence; the
        response (psp_gfx_resp) once its status is 0."""
        gpu, cmd_at, fence_at = self.gpu, PSP_AT + RING_BYTES, PSP_AT + RING_BYTES + PAGE
        # the whole buffer once (VRAM holds garbage); then only the head and body, whose bytes
        # past the longest command stay zero (CMD_HEAD_BYTES dwords instead of 256 per command)
        gpu.bar0_write(cmd_at, psp.command(cmd_id, body)[:None if not self.fence else
                                                         psp.CMD_HEAD_BYTES])
        self.fence += 1
        ring_dw = RING_BYTES // 4
        gpu.bar0_write(PSP_AT + 4 * (self.wptr % ring_dw),
                       psp.frame(gpu.fb + cmd_at, gpu.fb + fence_at, self.fence))
        self.wptr = (self.wptr + psp.FRAME_BYTES // 4) % ring_dw
        gpu.wreg(regs.C2PMSG_67, self.wptr)
        self._wait(lambda: gpu.pci.read32(0, fence_at) == self.fence, f"PSP ({what})")
        resp = b"".join(struct.pack("<I", gpu.pci.read32(0, cmd_at + psp.RESP_AT + i))
                        for i in range(0, 20, 4))
        status = struct.unpack_from("<I", resp)[0]
        if status:
            raise DeviceError(f"PSP refused {what} (status 0x{status:08x}); is it the file for "
                              f"this GPU?")
        return resp

    def _start_mec(self, mec: firmware.Firmware) -> None:
        gpu = self.gpu
        gpu.wreg(regs.GRBM_GFX_CNTL, regs.GRBM_ME1_PIPE0_QUEUE0)
        gpu.wreg(regs.CP_MEC_RS64_PRGRM_CNTR_START, mec.start >> 2 & 0xFFFFFFFF)
        gpu.wreg(regs.CP_MEC_RS64_PRGRM_CNTR_START_HI, mec.start >> 34)
        gpu.wreg(regs.GRBM_GFX_CNTL, 0)
        cntl = gpu.reg(regs.CP_MEC_RS64_CNTL)
        gpu.wreg(regs.CP_MEC_RS64_CNTL, cntl | regs.MEC_PIPE0_RESET)
        gpu.wreg(regs.CP_MEC_RS64_CNTL, (cntl & ~(regs.MEC_PIPE0_RESET | regs.MEC_HALT)) |
                 regs.MEC_PIPE0_ACTIVE)

    def _ready(self, reg: int, what: str) -> int:
        box = [0]

        def ready() -> bool:
            box[0] = self.gpu.reg(reg)
            return bool(box[0] & regs.BL_READY)
        self._wait(ready, f"PSP ({what})")
        return box[0]

    def _wait(self, cond, what: str, fail: bool = True) -> bool:
        try:
            wait_until(cond, time.monotonic() + BOOT_TIMEOUT_S, what)
        except TimeoutError:
            if not fail:
                return False
            raise DeviceError(f"{what}: no answer within {BOOT_TIMEOUT_S} s") from None
        return True
