"""What a gfx11 GPU needs beside its firmware before a compute queue runs a kernel, in amdgpu's
order (gfx_v11_0_hw_init after the RLC's autoload; register facts in am/regs.py):
  * NBIO's doorbell aperture (nbio_v4_3_enable_doorbell_aperture, from soc21_common_hw_init,
    before everything else) and the routing of doorbells to GC (nbio_v4_3_gc_doorbell_init);
  * the GC hub's L1 TLB and L2 (gfxhub_v3_0_gart_enable: init_tlb_regs, init_cache_regs,
    disable_identity_aperture, program_invalidation; the apertures and VM context 0 themselves
    are am/driver.py's, with its four-level table instead of amdgpu's flat GART);
  * SH_MEM_CONFIG / SH_MEM_BASES for every VMID (gfx_v11_0_constants_init; keel's kernels run
    on VMID 0, where amdgpu leaves SH_MEM_BASES alone, so VMID 0 gets the others' apertures);
  * the queue mapped from its MQD through the HQD registers (am/mqd.py;
    gfx_v11_0_kiq_init_register).
Each write goes through `gpu.wreg` (BAR5, or RSMU_INDEX/DATA beyond it).

Not written, because their offsets are not in the headers as we can read them (tinygrad's
autogen lacks them): CP_PQ_WPTR_POLL_CNTL.EN = 0 and CP_PQ_STATUS.DOORBELL_ENABLE = 1, which
kiq_init_register writes around the queue's registers (docs/amd.md: only hardware can tell).
"""
from __future__ import annotations

import time

from am import mqd, regs
from runner.device import wait_until

VMIDS = 16
DEQUEUE_TIMEOUT_S = 1.0


def rmw(gpu, reg: int, clear: int, set_: int) -> None:
    """A field update as amdgpu's REG_SET_FIELD sequences do: read, clear, set, write."""
    gpu.wreg(reg, gpu.reg(reg) & ~clear | set_)


def doorbell_aperture(gpu) -> None:
    rmw(gpu, regs.RCC_DOORBELL_APER_EN, 1, 1)


def gc_doorbells(gpu) -> None:
    gpu.wreg(regs.S2A_DOORBELL_ENTRY_0_CTRL, regs.S2A_GC_ENTRY_0)
    gpu.wreg(regs.S2A_DOORBELL_ENTRY_3_CTRL, regs.S2A_GC_ENTRY_3)


def tlb_and_l2(gpu, hub: regs.Hub) -> None:
    """init_tlb_regs and init_cache_regs' first register, the same fields on both hubs
    (gfxhub_v3_0.c, mmhub_v3_0.c). The MM hub's other L2 registers are left as they are: their
    offsets are not among the facts we can confirm."""
    rmw(gpu, hub.tlb_cntl, regs.TLB_CLEAR, regs.TLB_SET)
    rmw(gpu, hub.l2_cntl, regs.L2_CLEAR, regs.L2_SET)


def hub_caches(gpu, scratch: int, dummy: int) -> None:
    """The GC hub: the system aperture's default page (`scratch`, physical) and the protection
    fault's (`dummy`), the L1 TLB and L2 as gfxhub_v3_0 sets them, the identity aperture closed
    and invalidation engine 17's range the whole space."""
    gpu.wreg(regs.GCMC_VM_AGP_BASE, 0)
    gpu.wreg(regs.GCMC_VM_SYSTEM_APERTURE_DEFAULT_LSB, scratch >> 12 & 0xFFFFFFFF)
    gpu.wreg(regs.GCMC_VM_SYSTEM_APERTURE_DEFAULT_MSB, scratch >> 44)
    gpu.wreg(regs.GCVM_L2_FAULT_DEFAULT_LO, dummy >> 12 & 0xFFFFFFFF)
    gpu.wreg(regs.GCVM_L2_FAULT_DEFAULT_HI, dummy >> 44)
    rmw(gpu, regs.GCVM_L2_PROTECTION_FAULT_CNTL2, 0, regs.FAULT_PTE_READ_RETRY)
    tlb_and_l2(gpu, regs.GC_HUB)
    rmw(gpu, regs.GCVM_L2_CNTL2, 0, regs.L2_INVALIDATE)
    gpu.wreg(regs.GCVM_L2_CNTL3, regs.L2_CNTL3)
    gpu.wreg(regs.GCVM_L2_CNTL4, regs.L2_CNTL4)
    gpu.wreg(regs.GCVM_L2_CNTL5, regs.L2_CNTL5)
    low, offset = regs.GCVM_L2_CONTEXT1_IDENTITY_LOW_LO, regs.GCVM_L2_CONTEXT_IDENTITY_OFFSET_LO
    for reg, value in ((low, 0xFFFFFFFF), (low + 1, 0xF), (low + 2, 0), (low + 3, 0),
                       (offset, 0), (offset + 1, 0)):
        gpu.wreg(reg, value)
    gpu.wreg(regs.GCVM_INVALIDATE_ENG17_RANGE_LO, 0xFFFFFFFF)
    gpu.wreg(regs.GCVM_INVALIDATE_ENG17_RANGE_HI, 0x1F)


def sh_mem(gpu) -> None:
    for vmid in range(VMIDS):
        gpu.wreg(regs.GRBM_GFX_CNTL, vmid << regs.GRBM_VMID_SHIFT)
        gpu.wreg(regs.SH_MEM_CONFIG, regs.SH_MEM_CONFIG_DEFAULT)
        gpu.wreg(regs.SH_MEM_BASES, regs.SH_MEM_BASES_DEFAULT)
    gpu.wreg(regs.GRBM_GFX_CNTL, 0)


def map_queue(gpu, q: mqd.Queue, doorbells: int) -> list[int]:
    """The MQD written to VRAM through BAR0 at `q.mqd` (the queue cannot move data before it
    runs), then the HQD registers from it with ME 1 pipe 0 queue 0 selected; a queue still
    active (a warm recover()) is dequeued first, as kiq_init_register does. Returns the MQD."""
    m = mqd.build(q)
    gpu.bar0_write(q.mqd - gpu.fb, mqd.pack(m))
    gpu.bar0_write(q.eop - gpu.fb, bytes(mqd.HPD_BYTES))  # gfx_v11_0_mec_init clears it
    gpu.bar0_write(q.rptr - gpu.fb, bytes(16))  # the rptr report and wptr poll slots
    gpu.wreg(regs.CP_MEC_DOORBELL_RANGE_LOWER, 0)
    gpu.wreg(regs.CP_MEC_DOORBELL_RANGE_UPPER, doorbells)
    gpu.wreg(regs.GRBM_GFX_CNTL, regs.GRBM_ME1_PIPE0_QUEUE0)
    if gpu.reg(regs.CP_HQD_ACTIVE) & 1:
        gpu.wreg(regs.CP_HQD_DEQUEUE_REQUEST, 1)
        wait_until(lambda: not gpu.reg(regs.CP_HQD_ACTIVE) & 1,
                   time.monotonic() + DEQUEUE_TIMEOUT_S, "dequeue of the old compute queue")
        gpu.wreg(regs.CP_HQD_DEQUEUE_REQUEST, 0)
    for reg, value in mqd.registers(m):
        gpu.wreg(reg, value)
    gpu.wreg(regs.GRBM_GFX_CNTL, 0)
    return m
