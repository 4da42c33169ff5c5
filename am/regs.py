"""Register facts am/ programs over BAR5 (MMIO), as dword addresses: the Linux amdgpu header's
offset plus the base of the segment its BASE_IDX names (soc21 IP offsets for gfx11: GC segment 0
at 0x1260, segment 1 at 0xA000; MP0 segment 0 at 0x16000).

The mock GPU (sim/am/mock_device.py) answers at these same addresses, so a wrong value here is
invisible to CI: only tests/device/test_usbgpu.py on a real RX 7900 can catch it. Every offset
and bit here was checked against gc_11_0_0_offset.h/_sh_mask.h and mp_13_0_0_offset.h as
tinygrad's autogen/am/regs.py carries them (tinygrad a9069c17); what only hardware can confirm
is listed in docs/amd.md.
"""
from __future__ import annotations

from dataclasses import dataclass

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

# ---- the queue's MQD and the HQD registers amdgpu's gfx_v11_0_kiq_init_register programs from
# it (gc_11_0_0_offset.h, BASE_IDX 0; tinygrad autogen/am/regs.py gc_11_0_0 a9069c17 agrees).
# v11_structs.h struct v11_compute_mqd: 512 dwords; from dword 128 (cp_mqd_base_addr_lo) to 183
# (cp_hqd_pq_wptr_hi) it mirrors the registers CP_MQD_BASE_ADDR (0x1FA9) .. CP_HQD_PQ_WPTR_HI
# (0x1FE0) one to one (tinygrad's AM_GFX.setup_ring copies that range by this rule).
CP_MQD_BASE_ADDR, CP_MQD_BASE_ADDR_HI = GC_SEG0 + 0x1FA9, GC_SEG0 + 0x1FAA
CP_HQD_PERSISTENT_STATE = GC_SEG0 + 0x1FAD
CP_HQD_PIPE_PRIORITY, CP_HQD_QUEUE_PRIORITY = GC_SEG0 + 0x1FAE, GC_SEG0 + 0x1FAF
CP_HQD_PQ_RPTR_REPORT_ADDR, CP_HQD_PQ_RPTR_REPORT_ADDR_HI = GC_SEG0 + 0x1FB4, GC_SEG0 + 0x1FB5
CP_HQD_PQ_WPTR_POLL_ADDR, CP_HQD_PQ_WPTR_POLL_ADDR_HI = GC_SEG0 + 0x1FB6, GC_SEG0 + 0x1FB7
CP_HQD_IB_CONTROL, CP_HQD_DEQUEUE_REQUEST = GC_SEG0 + 0x1FBE, GC_SEG0 + 0x1FC1
CP_MQD_CONTROL = GC_SEG0 + 0x1FCB
CP_HQD_EOP_BASE_ADDR, CP_HQD_EOP_BASE_ADDR_HI = GC_SEG0 + 0x1FCE, GC_SEG0 + 0x1FCF
CP_HQD_EOP_CONTROL = GC_SEG0 + 0x1FD0
MQD_HQD_AT = 128  # the MQD dword mirroring CP_MQD_BASE_ADDR
# gc_11_0_0_sh_mask.h fields (as tinygrad's autogen carries them): CP_HQD_PQ_CONTROL QUEUE_SIZE
# 5:0, RPTR_BLOCK_SIZE 13:8, UNORD_DISPATCH 28, PRIV_STATE 30, KMD_QUEUE 31; CP_HQD_EOP_CONTROL
# EOP_SIZE 5:0; CP_HQD_PERSISTENT_STATE PRELOAD_SIZE 17:8; CP_HQD_IB_CONTROL MIN_IB_AVAIL_SIZE
# 21:20; CP_MQD_CONTROL VMID 3:0; CP_HQD_VMID VMID 3:0
PQ_RPTR_BLOCK_SHIFT, PQ_UNORD_DISPATCH, PQ_PRIV_STATE, PQ_KMD_QUEUE = 8, 1 << 28, 1 << 30, 1 << 31
PRELOAD_SIZE_SHIFT, MIN_IB_AVAIL_SHIFT = 8, 20

# ---- SH_MEM per VMID (gc_11_0_0_offset.h, BASE_IDX 1): selected through GRBM_GFX_CNTL's VMID
# (bits 7:4). gfx_v11_0.c DEFAULT_SH_MEM_CONFIG = ADDRESS_MODE 64 (bit 0 = 0) | ALIGNMENT_MODE
# UNALIGNED (3 << 2) | INITIAL_INST_PREFETCH 3 (<< 14); SH_MEM_BASES PRIVATE_BASE 15:0,
# SHARED_BASE 31:16 = the apertures' address >> 48 (gmc_v11_0: private 0x1000'0000'0000'0000,
# shared 0x2000'0000'0000'0000, 4 GiB each), as gfx_v11_0_constants_init writes them
SH_MEM_BASES, SH_MEM_CONFIG = GC_SEG1 + 0x09E3, GC_SEG1 + 0x09E4
GRBM_VMID_SHIFT = 4
SH_MEM_CONFIG_DEFAULT = 3 << 2 | 3 << 14
PRIVATE_APERTURE, SHARED_APERTURE, APERTURE_BYTES = 0x1000 << 48, 0x2000 << 48, 4 << 30
SH_MEM_BASES_DEFAULT = (SHARED_APERTURE >> 48) << 16 | PRIVATE_APERTURE >> 48

# ---- the GC hub's L2 and L1 TLB (gc_11_0_0_offset.h BASE_IDX 0; gfxhub_v3_0.c gart_enable)
GCVM_L2_CNTL, GCVM_L2_CNTL2, GCVM_L2_CNTL3 = GC_SEG0 + 0x15BC, GC_SEG0 + 0x15BD, GC_SEG0 + 0x15BE
GCVM_L2_CNTL4, GCVM_L2_CNTL5 = GC_SEG0 + 0x15D4, GC_SEG0 + 0x15DA
GCMC_VM_MX_L1_TLB_CNTL = GC_SEG0 + 0x167F
GCMC_VM_SYSTEM_APERTURE_DEFAULT_LSB, GCMC_VM_SYSTEM_APERTURE_DEFAULT_MSB = GC_SEG0 + 0x15A8, \
    GC_SEG0 + 0x15A9
GCVM_L2_PROTECTION_FAULT_CNTL2 = GC_SEG0 + 0x15C5
GCVM_L2_FAULT_DEFAULT_LO, GCVM_L2_FAULT_DEFAULT_HI = GC_SEG0 + 0x15CB, GC_SEG0 + 0x15CC
GCVM_L2_CONTEXT1_IDENTITY_LOW_LO, GCVM_L2_CONTEXT_IDENTITY_OFFSET_LO = GC_SEG0 + 0x15CE, \
    GC_SEG0 + 0x15D2  # LOW_ADDR LO/HI, HIGH_ADDR LO/HI (0x15CE-0x15D1), OFFSET LO/HI (0x15D2-3)
GCVM_INVALIDATE_ENG17_RANGE_LO, GCVM_INVALIDATE_ENG17_RANGE_HI = GC_SEG0 + 0x16F1, \
    GC_SEG0 + 0x16F2
# GCVM_L2_CNTL: ENABLE_L2_CACHE 0, ENABLE_L2_FRAGMENT_PROCESSING 1, ENABLE_DEFAULT_PAGE_OUT_TO_
# SYSTEM_MEMORY 11, L2_PDE0_CACHE_TAG_GENERATION_MODE 8, PDE_FAULT_CLASSIFICATION 18,
# CONTEXT1_IDENTITY_ACCESS_MODE 20:19, IDENTITY_MODE_FRAGMENT_SIZE 25:21
L2_ENABLE, L2_FRAGMENT, L2_PAGE_OUT = 1, 1 << 1, 1 << 11
L2_CLEAR = L2_FRAGMENT | 1 << 8 | 1 << 18 | 3 << 19 | 0x1F << 21
L2_SET = L2_ENABLE | L2_PAGE_OUT | 1 << 19
L2_INVALIDATE = 3  # GCVM_L2_CNTL2: INVALIDATE_ALL_L1_TLBS 0, INVALIDATE_L2_CACHE 1
# GCVM_L2_CNTL3 as gfxhub_v3_0 sets it without translate_further: BANK_SELECT 9 (5:0),
# L2_CACHE_BIGK_FRAGMENT_SIZE 6 (19:15); tinygrad also sets both associativity bits (31, 20),
# in place of the header's regGCVM_L2_CNTL3_DEFAULT, which we cannot read
L2_CNTL3 = 9 | 6 << 15 | 1 << 20 | 1 << 31
L2_CNTL4 = 1  # L2_CACHE_4K_PARTITION_COUNT 1 (tinygrad), VMC_TAP_PDE/PTE_REQUEST_PHYSICAL 0
L2_CNTL5 = 0x1FF << 5  # WALKER_PRIORITY_CLIENT_ID 0x1ff (tinygrad), SMALLK_FRAGMENT_SIZE 0
# GCMC_VM_MX_L1_TLB_CNTL: ENABLE_L1_TLB 0, SYSTEM_ACCESS_MODE 4:3 = 3, SYSTEM_APERTURE_UNMAPPED_
# ACCESS 5 = 0, ENABLE_ADVANCED_DRIVER_MODEL 6, ECO_BITS 10:7 = 0, MTYPE 13:11 = MTYPE_UC (3)
TLB_CLEAR = 0x3FFF
TLB_SET = 1 | 3 << 3 | 1 << 6 | 3 << 11
FAULT_PTE_READ_RETRY = 1 << 18  # GCVM_L2_PROTECTION_FAULT_CNTL2 ACTIVE_PAGE_MIGRATION_PTE_READ_RETRY

# ---- NBIO 4.3 doorbell routing (nbio_v4_3.c; nbio_4_3_0_offset.h as tinygrad's autogen carries
# it; segment bases NBIO 1: 0x14, 2: 0xD20, 3: 0x10400 as for GC above: UNVERIFIED until a 7900's
# discovery table is read). RCC_DEV0_EPF0_RCC_DOORBELL_APER_EN.BIF_DOORBELL_APER_EN (bit 0)
# opens the doorbell BAR (nbio_v4_3_enable_doorbell_aperture); S2A_DOORBELL_ENTRY_0/3_CTRL route
# doorbells to GC (nbio_v4_3_gc_doorbell_init: 0x30000007 and 0x3000000d = ENABLE, AWID 3 / 6,
# AWADDR_31_28 3). The S2A registers lie beyond BAR5's 1 MiB, so they are written through
# BIF_BX_PF0_RSMU_INDEX/DATA (byte address, then value), as amdgpu's pcie_wreg does
NBIO_SEG1, NBIO_SEG2, NBIO_SEG3 = 0x14, 0xD20, 0x10400
RCC_DOORBELL_APER_EN = NBIO_SEG2 + 0xC0
S2A_DOORBELL_ENTRY_0_CTRL, S2A_DOORBELL_ENTRY_3_CTRL = NBIO_SEG3 + 0x4F7640, NBIO_SEG3 + 0x4F7643
S2A_GC_ENTRY_0, S2A_GC_ENTRY_3 = 0x30000007, 0x3000000D
RSMU_INDEX, RSMU_DATA = NBIO_SEG1 + 0x0, NBIO_SEG1 + 0x1
MMIO_DWORDS = (1 << 20) // 4  # BAR5's registers; the rest only through RSMU_INDEX/DATA
# VRAM's size in MiB, at a fixed dword offset on every SOC15 part: read before IP discovery is
# (amdgpu_discovery.c mmRCC_CONFIG_MEMSIZE, tinygrad's AMDev._run_discovery)
RCC_CONFIG_MEMSIZE = 0xDE3
# VRAM through an index/data pair, for what BAR0 does not reach (amdgpu_device_mm_access): the
# byte address's bits 30:0 in MM_INDEX with bit 31 set (the memory aperture), bits 63:31 in
# MM_INDEX_HI, then MM_DATA reads or writes that dword
MM_INDEX, MM_DATA, MM_INDEX_HI, MM_APERTURE = 0x0, 0x1, 0x6, 1 << 31

# ---- the two VM hubs, as the driver and the mock MMU address them. The GC hub serves the
# command processor and shaders; the MM hub serves the PSP (and SDMA, display, media), which
# reads the firmware images from the bridge's SRAM through VM context 0 (tinygrad maps its
# USB firmware buffer the same way; amdgpu programs both hubs' context 0, mmhub_v3_0.c and
# gfxhub_v3_0.c). mmhub_3_0_0_offset.h (BASE_IDX 0) as tinygrad's autogen carries it; the
# segment base 0x1A000 (MMHUB_BASE__INST0_SEG0) is fixed like GC's (UNVERIFIED the same way).
MM_SEG0 = 0x1A000


@dataclass(frozen=True)
class Hub:
    name: str
    fb_base: int  # *MC_VM_FB_LOCATION_BASE, TOP right after it
    agp_top: int  # AGP_TOP, AGP_BOT, AGP_BASE, SYSTEM_APERTURE_LOW_ADDR, _HIGH_ADDR follow
    fb_offset: int
    tlb_cntl: int  # *MC_VM_MX_L1_TLB_CNTL
    l2_cntl: int
    cntl: int  # *VM_CONTEXT0_CNTL
    pt_base: int  # PAGE_TABLE_BASE_ADDR_LO32 (HI32 next); START and END at +0x20 and +0x40
    inv_req: int
    inv_ack: int
    inv_sem: int | None  # the MM hub's invalidation semaphore (gmc_v11_0_flush_vm_hub)

    @property
    def agp_bot(self) -> int:
        return self.agp_top + 1

    @property
    def agp_base(self) -> int:
        return self.agp_top + 2

    @property
    def sys_low(self) -> int:
        return self.agp_top + 3

    @property
    def sys_high(self) -> int:
        return self.agp_top + 4

    @property
    def pt_start(self) -> int:
        return self.pt_base + 0x20

    @property
    def pt_end(self) -> int:
        return self.pt_base + 0x40


GC_HUB = Hub("GC", GCMC_VM_FB_LOCATION_BASE, GCMC_VM_AGP_TOP, GCMC_VM_FB_OFFSET,
             GCMC_VM_MX_L1_TLB_CNTL, GCVM_L2_CNTL, GCVM_CONTEXT0_CNTL, GCVM_CONTEXT0_PT_BASE_LO,
             GCVM_INVALIDATE_ENG17_REQ, GCVM_INVALIDATE_ENG17_ACK, None)
MM_HUB = Hub("MM", MM_SEG0 + 0x8EC, MM_SEG0 + 0x8EE, MM_SEG0 + 0x8D7, MM_SEG0 + 0x8F3,
             MM_SEG0 + 0x700, MM_SEG0 + 0x740, MM_SEG0 + 0x7AB, MM_SEG0 + 0x774, MM_SEG0 + 0x786,
             MM_SEG0 + 0x762)
