"""Register facts am/ programs over BAR5 (MMIO), as dword addresses: the Linux amdgpu header's
offset plus the base of the segment its BASE_IDX names (soc21 IP offsets for gfx11: GC segment 0
at 0x1260, segment 1 at 0xA000; MP0 segment 0 at 0x16000).

The mock GPU (am/mock_device.py) answers at these same addresses, so a wrong value here is
invisible to CI: only tests/device/test_usbgpu.py on a real RX 7900 can catch it. Values marked
UNVERIFIED were not checked against their header while this was written; docs/amd.md lists what
must be confirmed before a first hardware run.
"""
from __future__ import annotations

GC_SEG0, GC_SEG1, MP0_SEG0 = 0x1260, 0xA000, 0x16000

# psp_v13_0.c / mp_13_0_0_offset.h: the PSP bootloader's mailbox. C2PMSG_35: command, and bit 31
# set when the bootloader is ready for the next one (the low 16 bits: its status, 0 = success);
# C2PMSG_36: the firmware's address >> 20; C2PMSG_81: the sOS version once it runs.
C2PMSG_35, C2PMSG_36, C2PMSG_81 = MP0_SEG0 + 0x63, MP0_SEG0 + 0x64, MP0_SEG0 + 0x91
BL_READY = 1 << 31
BL_LOAD_SOSDRV = 0x20000  # PSP_BL__LOAD_SOSDRV

# gc_11_0_0_offset.h (UNVERIFIED): where VRAM sits in the GPU's address space (set at POST, in
# 16 MiB units: base/top >> 24) and the AGP aperture, which maps GPU addresses
# [BOT, TOP] (in 16 MiB units) to system bus addresses + BASE (in 4 MiB units) with no page table
GCMC_VM_FB_LOCATION_BASE, GCMC_VM_FB_LOCATION_TOP = GC_SEG0 + 0x1678, GC_SEG0 + 0x1679
GCMC_VM_AGP_TOP, GCMC_VM_AGP_BOT, GCMC_VM_AGP_BASE = GC_SEG0 + 0x167A, GC_SEG0 + 0x167B, \
    GC_SEG0 + 0x167C

# gc_11_0_0_offset.h (as quoted from that header in several public projects): the compute queue
# the CP_HQD_* registers mean is chosen by GRBM_GFX_CNTL (ME 1, pipe 0, queue 0 here)
GRBM_GFX_CNTL = GC_SEG1 + 0x0900
CP_HQD_ACTIVE, CP_HQD_VMID = GC_SEG0 + 0x1FAB, GC_SEG0 + 0x1FAC
CP_HQD_PQ_BASE, CP_HQD_PQ_BASE_HI, CP_HQD_PQ_RPTR = GC_SEG0 + 0x1FB1, GC_SEG0 + 0x1FB2, \
    GC_SEG0 + 0x1FB3
CP_HQD_PQ_DOORBELL_CONTROL, CP_HQD_PQ_CONTROL = GC_SEG0 + 0x1FB8, GC_SEG0 + 0x1FBA
CP_HQD_PQ_WPTR_LO, CP_HQD_PQ_WPTR_HI = GC_SEG0 + 0x1FDF, GC_SEG0 + 0x1FE0
GRBM_ME1_PIPE0_QUEUE0 = 1 << 2  # GRBM_GFX_CNTL: MEID 1 (bits 3:2), pipe 0, queue 0, VMID 0
DOORBELL_EN = 1 << 30  # CP_HQD_PQ_DOORBELL_CONTROL: DOORBELL_EN; DOORBELL_OFFSET (dwords) 27:2
