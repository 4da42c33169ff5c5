"""Register facts am/ programs over BAR5 (MMIO), as dword addresses: the Linux amdgpu header's
offset plus the base of the segment its BASE_IDX names (soc21 IP offsets for gfx11: GC segment 0
at 0x1260, segment 1 at 0xA000; MP0 segment 0 at 0x16000).

The mock GPU (am/mock_device.py) answers at these same addresses, so a wrong value here is
invisible to CI: only tests/device/test_usbgpu.py on a real RX 7900 can catch it. Every offset
and bit here was checked against gc_11_0_0_offset.h/_sh_mask.h and mp_13_0_0_offset.h as
tinygrad's autogen/am/regs.py carries them (tinygrad a9069c17); what only hardware can confirm
is listed in docs/amd.md.
"""
from __future__ import annotations

GC_SEG0, GC_SEG1, MP0_SEG0 = 0x1260, 0xA000, 0x16000

# psp_v13_0.c / mp_13_0_0_offset.h: the PSP bootloader's mailbox. C2PMSG_35: command, and bit 31
# set when the bootloader is ready for the next one (the low 16 bits: its status, 0 = success);
# C2PMSG_36: the firmware's address >> 20; C2PMSG_81: the sOS version once it runs.
C2PMSG_35, C2PMSG_36, C2PMSG_81 = MP0_SEG0 + 0x63, MP0_SEG0 + 0x64, MP0_SEG0 + 0x91
BL_READY = 1 << 31
BL_LOAD_SOSDRV = 0x20000  # PSP_BL__LOAD_SOSDRV

# psp_v13_0.c's ring (GPCOM, "KM") once sOS runs: C2PMSG_64 takes GFX_CTRL_CMD_ID_INIT_GPCOM_RING
# after C2PMSG_69/70 (ring address lo/hi, a VMID 0 GPU address) and 71 (size in bytes) and answers
# with bit 31 (GFX_FLAG_RESPONSE) and a status in bits 15:0; C2PMSG_67 is the write pointer in
# dwords, modulo the ring. (MP0 C2PMSG_n is register 0x40 + n, as for 35/36/81 above.)
C2PMSG_64, C2PMSG_67 = MP0_SEG0 + 0x80, MP0_SEG0 + 0x83
C2PMSG_69, C2PMSG_70, C2PMSG_71 = MP0_SEG0 + 0x85, MP0_SEG0 + 0x86, MP0_SEG0 + 0x87
INIT_GPCOM_RING, DESTROY_RINGS = 0x20000, 0x30000  # psp_gfx_if.h GFX_CTRL_CMD_ID_*

# gc_11_0_0_offset.h (torvalds/linux 0e8655b4, addressBlock gc_gcvmsharedvcdec, BASE_IDX 0):
# where VRAM sits in the GPU's address space (set at POST, in 16 MiB units: base/top >> 24); the
# AGP aperture, which maps GPU addresses [BOT, TOP] (16 MiB units) to system bus addresses + BASE
# (4 MiB units) with no page table (BOT > TOP: closed); and the system aperture [LOW, HIGH]
# (256 KiB units, gfxhub_v3_0_init_system_aperture_regs: addr >> 18) inside which VMID 0 reaches
# the FB and AGP apertures physically
GCMC_VM_FB_LOCATION_BASE, GCMC_VM_FB_LOCATION_TOP = GC_SEG0 + 0x1678, GC_SEG0 + 0x1679
GCMC_VM_AGP_TOP, GCMC_VM_AGP_BOT, GCMC_VM_AGP_BASE = GC_SEG0 + 0x167A, GC_SEG0 + 0x167B, \
    GC_SEG0 + 0x167C
GCMC_VM_SYSTEM_APERTURE_LOW_ADDR, GCMC_VM_SYSTEM_APERTURE_HIGH_ADDR = GC_SEG0 + 0x167D, \
    GC_SEG0 + 0x167E

# VM context 0 (same header, gc_gcvml2vcdec and the registers after it): PAGE_TABLE_BASE_ADDR
# LO/HI32 = the root table's physical address | PDE valid (amdgpu_gmc_pd_addr;
# gmc_v11_0_get_vm_pde makes it physical), START/END_ADDR LO/HI32 = the range's first and last
# page (addr >> 12), CONTEXT0_CNTL ENABLE_CONTEXT (bit 0), PAGE_TABLE_DEPTH (bits 2:1),
# PAGE_TABLE_BLOCK_SIZE (6:3). Bit positions: gc_11_0_0_sh_mask.h as generated into tinygrad's
# autogen/am/regs.py (gc_11_0_0), which also confirms every offset in this file.
GCVM_CONTEXT0_CNTL = GC_SEG0 + 0x1688
GCVM_CONTEXT0_PT_BASE_LO, GCVM_CONTEXT0_PT_BASE_HI = GC_SEG0 + 0x16F3, GC_SEG0 + 0x16F4
GCVM_CONTEXT0_PT_START_LO, GCVM_CONTEXT0_PT_START_HI = GC_SEG0 + 0x1713, GC_SEG0 + 0x1714
GCVM_CONTEXT0_PT_END_LO, GCVM_CONTEXT0_PT_END_HI = GC_SEG0 + 0x1733, GC_SEG0 + 0x1734
CONTEXT_ENABLE, CONTEXT_DEPTH_SHIFT = 1, 1
# VRAM's physical base in the GPU's map (16 MiB units): what directory entries and PTEs add to a
# VRAM offset (gfxhub_v3_0_get_mc_fb_offset, vm_manager.vram_base_offset)
GCMC_VM_FB_OFFSET = GC_SEG0 + 0x15A7
# TLB invalidation through engine 17 (gmc_v11_0.c keeps it for the kernel's own mappings):
# REQ = 1 << vmid | INVALIDATE_L2_PTES, L2_PDE0, L2_PDE1, L2_PDE2, L1_PTES (bits 19..23); the
# flush is done when ACK has bit vmid set
GCVM_INVALIDATE_ENG17_REQ, GCVM_INVALIDATE_ENG17_ACK = GC_SEG0 + 0x16BC, GC_SEG0 + 0x16CE
INVALIDATE_ALL = 0x1F << 19

# the RLC's autoload (after the PSP's AUTOLOAD_RLC): RLC_RLCS_BOOTLOAD_STATUS.BOOTLOAD_COMPLETE
RLC_RLCS_BOOTLOAD_STATUS, BOOTLOAD_COMPLETE = GC_SEG1 + 0x4E82, 1 << 31
# the RS64 MEC (gfx_v11_0_config_mec_cache_rs64 / tinygrad's _config_mec): per pipe (chosen by
# GRBM_GFX_CNTL), PRGRM_CNTR_START/_HI = the firmware header's ucode_start_addr >> 2; then
# CP_MEC_RS64_CNTL pulses MEC_PIPE0_RESET (bit 16) and sets MEC_PIPE0_ACTIVE (26), clearing
# MEC_HALT (30)
CP_MEC_RS64_PRGRM_CNTR_START, CP_MEC_RS64_PRGRM_CNTR_START_HI = GC_SEG1 + 0x2900, \
    GC_SEG1 + 0x2938
CP_MEC_RS64_CNTL = GC_SEG1 + 0x2904
MEC_PIPE0_RESET, MEC_PIPE0_ACTIVE, MEC_HALT = 1 << 16, 1 << 26, 1 << 30

# gc_11_0_0_offset.h: the compute queue
# the CP_HQD_* registers mean is chosen by GRBM_GFX_CNTL (ME 1, pipe 0, queue 0 here)
GRBM_GFX_CNTL = GC_SEG1 + 0x0900
CP_HQD_ACTIVE, CP_HQD_VMID = GC_SEG0 + 0x1FAB, GC_SEG0 + 0x1FAC
CP_HQD_PQ_BASE, CP_HQD_PQ_BASE_HI, CP_HQD_PQ_RPTR = GC_SEG0 + 0x1FB1, GC_SEG0 + 0x1FB2, \
    GC_SEG0 + 0x1FB3
CP_HQD_PQ_DOORBELL_CONTROL, CP_HQD_PQ_CONTROL = GC_SEG0 + 0x1FB8, GC_SEG0 + 0x1FBA
CP_HQD_PQ_WPTR_LO, CP_HQD_PQ_WPTR_HI = GC_SEG0 + 0x1FDF, GC_SEG0 + 0x1FE0
GRBM_ME1_PIPE0_QUEUE0 = 1 << 2  # GRBM_GFX_CNTL: MEID 1 (bits 3:2), pipe 0, queue 0, VMID 0
DOORBELL_EN = 1 << 30  # CP_HQD_PQ_DOORBELL_CONTROL: DOORBELL_EN; DOORBELL_OFFSET (dwords) 27:2
# the doorbell range (byte offsets into the doorbell BAR, dword granular in bits 11:2) the MEC
# answers; outside it a doorbell write reaches no compute queue
CP_MEC_DOORBELL_RANGE_LOWER, CP_MEC_DOORBELL_RANGE_UPPER = GC_SEG0 + 0x1DFC, GC_SEG0 + 0x1DFD
