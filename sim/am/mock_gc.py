"""The mock GPU's checks of what am/gc.py sets up, each where the hardware would need it:
  * a doorbell reaches the command processor only through an open doorbell aperture
    (RCC_DEV0_EPF0_RCC_DOORBELL_APER_EN) and an S2A entry routing it to GC as
    nbio_v4_3_gc_doorbell_init programs it; otherwise it is dropped, as hardware drops it, and
    the host sees its deadline pass;
  * the CP (GC hub) and the PSP (MM hub) touch memory only through an enabled L1 TLB (system access mode 3, advanced driver
    model, MTYPE UC) and L2 cache (gfxhub_v3_0's init_tlb_regs / init_cache_regs);
  * a queue is activated only if its MQD (read at CP_MQD_BASE_ADDR, as the CP reads it) is a
    v11 compute MQD naming itself, its EOP buffer is the 2 KiB amdgpu gives it, and every HQD
    register amdgpu's kiq_init_register writes holds the MQD's value;
  * a dispatch runs only on a VMID whose SH_MEM_CONFIG is 64-bit, unaligned, and whose
    SH_MEM_BASES put the private and shared apertures (4 GiB each) clear of each other and of
    the VM context's range.
Each refusal but the dropped doorbell is a GpuFault naming the register or field.
"""
from __future__ import annotations

from am import mqd, regs
from sim.am.mock_gpu import GpuFault

QUEUE = "compute queue (ME 1 pipe 0 queue 0)"


def doorbell_routed(r: dict[int, int]) -> bool:
    entry = r.get(regs.S2A_DOORBELL_ENTRY_0_CTRL, 0)
    fields = 1 | 0x1F << 1 | 0xF << 28  # ENABLE, AWID, AWADDR_31_28
    return bool(r.get(regs.RCC_DOORBELL_APER_EN, 0) & 1) and \
        entry & fields == regs.S2A_GC_ENTRY_0 & fields


def check_hub(r: dict[int, int], hub: regs.Hub) -> None:
    tlb = r.get(hub.tlb_cntl, 0)
    if tlb & regs.TLB_CLEAR != regs.TLB_SET:
        raise GpuFault(f"{hub.name}MC_VM_MX_L1_TLB_CNTL 0x{tlb:x}: expected the L1 TLB on, system "
                       f"access mode 3, the advanced driver model and MTYPE UC "
                       f"(0x{regs.TLB_SET:x})")
    l2 = r.get(hub.l2_cntl, 0)
    if l2 & (regs.L2_ENABLE | regs.L2_FRAGMENT) != regs.L2_ENABLE:
        raise GpuFault(f"{hub.name}VM_L2_CNTL 0x{l2:x}: expected the L2 cache on and fragment "
                       f"processing off")


def check_queue(r: dict[int, int], read) -> None:
    """`read(address, n)` reads GPU memory as the CP does (VMID 0)."""
    base = r.get(regs.CP_MQD_BASE_ADDR, 0) | r.get(regs.CP_MQD_BASE_ADDR_HI, 0) << 32
    m = mqd.unpack(read(base, 4 * mqd.DWORDS))
    bad = []
    if m[0] != mqd.HEADER:
        bad.append(f"MQD header 0x{m[0]:x}, expected 0x{mqd.HEADER:x}")
    own = m[mqd.at(regs.CP_MQD_BASE_ADDR)] | m[mqd.at(regs.CP_MQD_BASE_ADDR_HI)] << 32
    if own != base:
        bad.append(f"the MQD at 0x{base:x} names 0x{own:x} as its address")
    for reg in mqd.PROGRAMMED[:-1]:
        if r.get(reg, 0) != m[mqd.at(reg)]:
            bad.append(f"register 0x{reg:x} holds 0x{r.get(reg, 0):x}, its MQD field "
                       f"0x{m[mqd.at(reg)]:x}")
    eop = r.get(regs.CP_HQD_EOP_CONTROL, 0) & 0x3F
    if 4 << (eop + 1) != mqd.HPD_BYTES:
        bad.append(f"CP_HQD_EOP_CONTROL.EOP_SIZE {eop}: a {4 << (eop + 1)}-byte EOP buffer, "
                   f"expected {mqd.HPD_BYTES}")
    if r.get(regs.CP_HQD_VMID, 0) & 0xF or r.get(regs.CP_MQD_CONTROL, 0) & 0xF:
        bad.append("the queue or its MQD on a VMID other than 0 (the mock has context 0 only)")
    if bad:
        raise GpuFault(f"{QUEUE} refused at activation: " + "; ".join(bad))
    eop_at = (r.get(regs.CP_HQD_EOP_BASE_ADDR, 0) | r.get(regs.CP_HQD_EOP_BASE_ADDR_HI, 0) << 32)
    read(eop_at << 8, mqd.HPD_BYTES)  # a GpuFault if the EOP buffer is unmapped


def check_dispatch(sh_mem: dict[int, dict[int, int]], vmid: int, context) -> None:
    """`context`: the VM context's (first page, last page, ...) or None."""
    bank = sh_mem.get(vmid, {})
    cfg, bases = bank.get(regs.SH_MEM_CONFIG), bank.get(regs.SH_MEM_BASES)
    if cfg is None or bases is None:
        raise GpuFault(f"dispatch on VMID {vmid}: SH_MEM_CONFIG/SH_MEM_BASES never programmed "
                       f"for it (a kernel's flat addresses would have no apertures)")
    if cfg & 0xD != regs.SH_MEM_CONFIG_DEFAULT & 0xD:
        raise GpuFault(f"dispatch on VMID {vmid}: SH_MEM_CONFIG 0x{cfg:x}, expected 64-bit "
                       f"addressing and unaligned access (DEFAULT_SH_MEM_CONFIG 0x"
                       f"{regs.SH_MEM_CONFIG_DEFAULT:x})")
    spans = [((bases & 0xFFFF) << 48, "private"), ((bases >> 16) << 48, "shared")]
    if context is not None:
        spans.append((context[0] << 12, "VM context"))
    size = {"VM context": 0 if context is None else (context[1] - context[0] + 1) << 12}
    ranges = [(a, a + size.get(n, regs.APERTURE_BYTES), n) for a, n in spans]
    for i, (a0, a1, n) in enumerate(ranges):
        for b0, b1, o in ranges[i + 1:]:
            if a0 < b1 and b0 < a1:
                raise GpuFault(f"dispatch on VMID {vmid}: SH_MEM_BASES 0x{bases:x} puts the {n} "
                               f"range 0x{a0:x} over the {o} range 0x{b0:x}")
