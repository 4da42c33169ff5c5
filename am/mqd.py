"""The compute queue's MQD (memory queue descriptor): v11_structs.h's struct v11_compute_mqd,
filled as amdgpu's gfx_v11_0_compute_mqd_init fills it, and the HQD registers programmed from it
in the order gfx_v11_0_kiq_init_register writes them (amdgpu maps its KIQ this way, and keel's
one queue is mapped the same way: no MES, no MAP_QUEUES packet).

The MQD is 512 dwords; dwords MQD_HQD_AT.. mirror the registers CP_MQD_BASE_ADDR.. one to one
(am/regs.py), so a field's dword is its register's offset from CP_MQD_BASE_ADDR plus 128. The
CP saves queue state there when a queue is preempted; the mock GPU reads it at activation and
refuses a queue whose registers disagree with it (sim/am/mock_device.py).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from am import regs

DWORDS = 512
HEADER = 0xC0310800  # mqd->header
HPD_BYTES = 2048  # GFX11_MEC_HPD_SIZE: the EOP buffer
# v11_structs.h dwords: compute_pipelinestat_enable, compute_static_thread_mgmt_se0..3,
# compute_misc_reserved
PIPELINESTAT, STATIC_SE0_3, MISC_RESERVED = 11, (23, 24, 26, 27), 32


@dataclass(frozen=True)
class Queue:
    """Where the queue's pieces live (GPU addresses, VMID 0) and its doorbell (dwords)."""
    mqd: int
    ring: int
    ring_bytes: int
    rptr: int  # where the CP reports its read pointer (rptr_gpu_addr)
    wptr: int  # where it would poll the write pointer (polling stays off)
    eop: int
    doorbell: int


def at(reg: int) -> int:
    """The MQD dword that mirrors HQD register `reg`."""
    return regs.MQD_HQD_AT + reg - regs.CP_MQD_BASE_ADDR


def build(q: Queue) -> list[int]:
    """gfx_v11_0_compute_mqd_init with amdgpu_ring_init_mqd's properties for a kernel ring of
    normal priority (pipe and queue priority 0), active as the register-mapped KIQ is. Fields
    amdgpu read-modify-writes from a register start from 0 here (UNVERIFIED: a reset value
    other than 0 would survive in amdgpu's MQD and not in ours)."""
    m = [0] * DWORDS
    m[0], m[PIPELINESTAT], m[MISC_RESERVED] = HEADER, 1, 7
    for i in STATIC_SE0_3:
        m[i] = 0xFFFFFFFF
    fields = {
        regs.CP_HQD_EOP_BASE_ADDR: q.eop >> 8 & 0xFFFFFFFF,
        regs.CP_HQD_EOP_BASE_ADDR_HI: q.eop >> 40,
        regs.CP_HQD_EOP_CONTROL: (HPD_BYTES // 4).bit_length() - 2,  # 2^(EOP_SIZE+1) dwords
        regs.CP_HQD_PQ_DOORBELL_CONTROL: regs.DOORBELL_EN | q.doorbell << 2,
        regs.CP_MQD_BASE_ADDR: q.mqd & 0xFFFFFFFC,
        regs.CP_MQD_BASE_ADDR_HI: q.mqd >> 32,
        regs.CP_MQD_CONTROL: 0,  # VMID 0
        regs.CP_HQD_PQ_BASE: q.ring >> 8 & 0xFFFFFFFF,
        regs.CP_HQD_PQ_BASE_HI: q.ring >> 40,
        # QUEUE_SIZE: 2^(n+1) dwords; RPTR_BLOCK_SIZE from AMDGPU_GPU_PAGE_SIZE (4096) / 4
        regs.CP_HQD_PQ_CONTROL: ((q.ring_bytes // 4).bit_length() - 2 |
                                 ((4096 // 4).bit_length() - 2) << regs.PQ_RPTR_BLOCK_SHIFT |
                                 regs.PQ_UNORD_DISPATCH | regs.PQ_PRIV_STATE |
                                 regs.PQ_KMD_QUEUE),
        regs.CP_HQD_PQ_RPTR_REPORT_ADDR: q.rptr & 0xFFFFFFFC,
        regs.CP_HQD_PQ_RPTR_REPORT_ADDR_HI: q.rptr >> 32 & 0xFFFF,
        regs.CP_HQD_PQ_WPTR_POLL_ADDR: q.wptr & 0xFFFFFFFC,
        regs.CP_HQD_PQ_WPTR_POLL_ADDR_HI: q.wptr >> 32 & 0xFFFF,
        regs.CP_HQD_VMID: 0,
        regs.CP_HQD_PERSISTENT_STATE: 0x55 << regs.PRELOAD_SIZE_SHIFT,
        regs.CP_HQD_IB_CONTROL: 3 << regs.MIN_IB_AVAIL_SHIFT,
        regs.CP_HQD_ACTIVE: 1,
    }
    for reg, value in fields.items():
        m[at(reg)] = value
    return m


# gfx_v11_0_kiq_init_register's order (a queue still active is dequeued first: am/driver.py);
# the read pointer is written too, as tinygrad's copy of the whole range does, so a queue mapped
# again after a hang starts at the ring's start
PROGRAMMED = (regs.CP_HQD_EOP_BASE_ADDR, regs.CP_HQD_EOP_BASE_ADDR_HI, regs.CP_HQD_EOP_CONTROL,
              regs.CP_HQD_PQ_DOORBELL_CONTROL, regs.CP_MQD_BASE_ADDR, regs.CP_MQD_BASE_ADDR_HI,
              regs.CP_MQD_CONTROL, regs.CP_HQD_PQ_BASE, regs.CP_HQD_PQ_BASE_HI,
              regs.CP_HQD_PQ_CONTROL, regs.CP_HQD_PQ_RPTR_REPORT_ADDR,
              regs.CP_HQD_PQ_RPTR_REPORT_ADDR_HI, regs.CP_HQD_PQ_WPTR_POLL_ADDR,
              regs.CP_HQD_PQ_WPTR_POLL_ADDR_HI, regs.CP_HQD_PQ_DOORBELL_CONTROL,
              regs.CP_HQD_PQ_RPTR, regs.CP_HQD_PQ_WPTR_LO, regs.CP_HQD_PQ_WPTR_HI,
              regs.CP_HQD_VMID,
              regs.CP_HQD_PERSISTENT_STATE, regs.CP_HQD_ACTIVE)


def registers(m: list[int]) -> list[tuple[int, int]]:
    """(register, value) writes that map the queue `m` describes, activation last."""
    return [(r, m[at(r)]) for r in PROGRAMMED]


def pack(m: list[int]) -> bytes:
    return struct.pack(f"<{DWORDS}I", *m)


def unpack(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{DWORDS}I", data))
