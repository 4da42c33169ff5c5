"""qcom/kgsl.py against the KGSL UAPI facts, as clang compiled them from the real header.

FACTS below were produced by tests/qcom_uapi_regen.py (probe: tests/qcom_uapi_probe.c), compiled
for aarch64-linux-gnu and x86_64-linux-gnu, which agreed, on 2026-11-24, from:
  include/uapi/linux/msm_kgsl.h of qualcomm-linux/kgsl@27cf0e4f402d9d569ef8f060d46cd5b0a97dc924
  (Qualcomm's KGSL driver, 2025-06-03; KGSL_VERSION 3.14 is frozen in the header).
The comma 3X kernel (commaai/agnos-kernel-sdm845) builds Qualcomm's msm-4.9 KGSL; its snapshot
was too large to bring here, and comma's tree shows no change to this header. Every declaration
the probe reads was compared by hand with the msm-4.9 header (arter97/caf_msm-4.9@0e64f387,
include/uapi/linux/msm_kgsl.h): identical, except that msm-4.9 spells `size_t`/`uint64_t` where the
newer header spells `__kernel_size_t`/`__u64`, the same types on arm64. A newer UAPI only adds
ioctls and flags; the ones keel uses have kept their numbers and layouts.
The dma-buf import facts (kgsl_gpuobj_import_dma_buf, KGSL_USER_MEM_TYPE_DMABUF) were added on
2026-11-26 from the same header and commit; msm-4.9's header declares them alike (`int fd`;
DMABUF = 3, the value it also names KGSL_USER_MEM_TYPE_ION).

To re-check against another copy of the header (say, the one on a comma device):
    KEEL_KGSL_HEADER=path/to/msm_kgsl.h pytest tests/test_qcom_uapi.py
"""
import ctypes
import os
import shutil

import pytest

from qcom import kgsl

FACTS = {
    'sizeof kgsl_devinfo': 40,
    'offsetof kgsl_devinfo.chip_id': 4,
    'offsetof kgsl_devinfo.gmem_gpubaseaddr': 16,
    'offsetof kgsl_devinfo.gpu_id': 24,
    'offsetof kgsl_devinfo.gmem_sizebytes': 32,
    'sizeof kgsl_version': 16,
    'offsetof kgsl_version.dev_minor': 12,
    'sizeof kgsl_device_getproperty': 24,
    'offsetof kgsl_device_getproperty.value': 8,
    'offsetof kgsl_device_getproperty.sizebytes': 16,
    'sizeof kgsl_device_waittimestamp_ctxtid': 12,
    'offsetof kgsl_device_waittimestamp_ctxtid.timeout': 8,
    'sizeof kgsl_cmdstream_readtimestamp_ctxtid': 12,
    'offsetof kgsl_cmdstream_readtimestamp_ctxtid.timestamp': 8,
    'sizeof kgsl_drawctxt_create': 8,
    'offsetof kgsl_drawctxt_create.drawctxt_id': 4,
    'sizeof kgsl_drawctxt_destroy': 4,
    'sizeof kgsl_map_user_mem': 48,
    'offsetof kgsl_map_user_mem.gpuaddr': 8,
    'offsetof kgsl_map_user_mem.len': 16,
    'offsetof kgsl_map_user_mem.offset': 24,
    'offsetof kgsl_map_user_mem.hostptr': 32,
    'offsetof kgsl_map_user_mem.memtype': 40,
    'offsetof kgsl_map_user_mem.flags': 44,
    'sizeof kgsl_gpuobj_alloc': 48,
    'offsetof kgsl_gpuobj_alloc.mmapsize': 24,
    'offsetof kgsl_gpuobj_alloc.id': 32,
    'offsetof kgsl_gpuobj_alloc.metadata': 40,
    'sizeof kgsl_gpuobj_free': 32,
    'offsetof kgsl_gpuobj_free.id': 16,
    'offsetof kgsl_gpuobj_free.len': 24,
    'sizeof kgsl_gpuobj_info': 48,
    'offsetof kgsl_gpuobj_info.gpuaddr': 0,
    'offsetof kgsl_gpuobj_info.size': 16,
    'offsetof kgsl_gpuobj_info.va_addr': 32,
    'offsetof kgsl_gpuobj_info.id': 40,
    'sizeof kgsl_gpuobj_import': 32,
    'offsetof kgsl_gpuobj_import.priv_len': 8,
    'offsetof kgsl_gpuobj_import.type': 24,
    'offsetof kgsl_gpuobj_import.id': 28,
    'sizeof kgsl_gpuobj_import_useraddr': 8,
    'sizeof kgsl_gpuobj_import_dma_buf': 4,
    'sizeof kgsl_command_object': 32,
    'offsetof kgsl_command_object.gpuaddr': 8,
    'offsetof kgsl_command_object.size': 16,
    'offsetof kgsl_command_object.flags': 24,
    'offsetof kgsl_command_object.id': 28,
    'sizeof kgsl_command_syncpoint': 24,
    'offsetof kgsl_command_syncpoint.type': 16,
    'sizeof kgsl_gpu_command': 64,
    'offsetof kgsl_gpu_command.cmdlist': 8,
    'offsetof kgsl_gpu_command.cmdsize': 16,
    'offsetof kgsl_gpu_command.numcmds': 20,
    'offsetof kgsl_gpu_command.objlist': 24,
    'offsetof kgsl_gpu_command.synclist': 40,
    'offsetof kgsl_gpu_command.numsyncs': 52,
    'offsetof kgsl_gpu_command.context_id': 56,
    'offsetof kgsl_gpu_command.timestamp': 60,
    'IOCTL_KGSL_DEVICE_GETPROPERTY': 0xc0180902,
    'IOCTL_KGSL_DEVICE_WAITTIMESTAMP_CTXTID': 0x400c0907,
    'IOCTL_KGSL_DRAWCTXT_CREATE': 0xc0080913,
    'IOCTL_KGSL_DRAWCTXT_DESTROY': 0x40040914,
    'IOCTL_KGSL_MAP_USER_MEM': 0xc0300915,
    'IOCTL_KGSL_CMDSTREAM_READTIMESTAMP_CTXTID': 0xc00c0916,
    'IOCTL_KGSL_GPUOBJ_ALLOC': 0xc0300945,
    'IOCTL_KGSL_GPUOBJ_FREE': 0x40200946,
    'IOCTL_KGSL_GPUOBJ_INFO': 0xc0300947,
    'IOCTL_KGSL_GPUOBJ_IMPORT': 0xc0200948,
    'IOCTL_KGSL_GPU_COMMAND': 0xc040094a,
    'KGSL_CONTEXT_NO_GMEM_ALLOC': 2,
    'KGSL_CONTEXT_PREAMBLE': 16,
    'KGSL_CONTEXT_PER_CONTEXT_TS': 64,
    'KGSL_CONTEXT_NO_FAULT_TOLERANCE': 0x200,
    'KGSL_CONTEXT_PRIORITY_MASK': 0xf000,
    'KGSL_CONTEXT_PRIORITY_SHIFT': 12,
    'KGSL_CONTEXT_TYPE_MASK': 0x1f00000,
    'KGSL_CONTEXT_TYPE_SHIFT': 20,
    'KGSL_CONTEXT_TYPE_CL': 2,
    'KGSL_CONTEXT_PREEMPT_STYLE_MASK': 0xe000000,
    'KGSL_CONTEXT_PREEMPT_STYLE_SHIFT': 25,
    'KGSL_CONTEXT_PREEMPT_STYLE_RINGBUFFER': 1,
    'KGSL_CONTEXT_PREEMPT_STYLE_FINEGRAIN': 2,
    'KGSL_CONTEXT_INVALIDATE_ON_FAULT': 0x10000000,
    'KGSL_CMDLIST_IB': 1,
    'KGSL_MEMFLAGS_GPUREADONLY': 0x1000000,
    'KGSL_MEMFLAGS_USE_CPU_MAP': 0x10000000,
    'KGSL_MEMFLAGS_IOCOHERENT': 0x80000000,
    'KGSL_CACHEMODE_MASK': 0xc000000,
    'KGSL_CACHEMODE_SHIFT': 26,
    'KGSL_CACHEMODE_WRITECOMBINE': 0,
    'KGSL_CACHEMODE_UNCACHED': 1,
    'KGSL_CACHEMODE_WRITETHROUGH': 2,
    'KGSL_CACHEMODE_WRITEBACK': 3,
    'KGSL_MEMTYPE_MASK': 0xff00,
    'KGSL_MEMTYPE_SHIFT': 8,
    'KGSL_MEMTYPE_CL': 10,
    'KGSL_MEMTYPE_COMMAND': 16,
    'KGSL_MEMALIGN_MASK': 0xff0000,
    'KGSL_MEMALIGN_SHIFT': 16,
    'KGSL_USER_MEM_TYPE_ADDR': 2,
    'KGSL_USER_MEM_TYPE_DMABUF': 3,
    'KGSL_PROP_DEVICE_INFO': 1,
    'KGSL_PROP_VERSION': 8,
    'KGSL_TIMESTAMP_CONSUMED': 1,
    'KGSL_TIMESTAMP_RETIRED': 2,
    'KGSL_TIMESTAMP_QUEUED': 3,
}


RENAMED = {"CONTEXT_PREEMPT_STYLE_RINGBUFFER": "PREEMPT_RINGBUFFER",
           "CONTEXT_PREEMPT_STYLE_FINEGRAIN": "PREEMPT_FINEGRAIN"}
STRUCTS = {s.c_name: s for s in vars(kgsl).values()
           if isinstance(s, type) and issubclass(s, kgsl._Struct) and s.c_name}
IOCTLS = {i.name: i for i in kgsl.IOCTLS}


def ours(key: str) -> int:
    """The value qcom/kgsl.py has for one recorded fact."""
    if key.startswith("sizeof "):
        return ctypes.sizeof(STRUCTS[key[7:]])
    if key.startswith("offsetof "):
        struct, field = key[9:].split(".")
        return getattr(STRUCTS[struct], field).offset
    if key.startswith("IOCTL_"):
        return IOCTLS[key].number
    name = key.removeprefix("KGSL_")
    return getattr(kgsl, RENAMED.get(name, name))


@pytest.mark.parametrize("key", sorted(FACTS))
def test_kgsl_py_matches_the_compiled_header(key):
    assert ours(key) == FACTS[key], f"{key}: qcom/kgsl.py has {ours(key)}, header {FACTS[key]}"


def test_every_struct_and_ioctl_in_kgsl_py_is_checked():
    assert {f"sizeof {n}" for n in STRUCTS} <= set(FACTS)
    assert set(IOCTLS) <= set(FACTS)


def test_every_field_offset_that_is_recorded_exists():
    offsets = [k for k in FACTS if k.startswith("offsetof ")]
    assert len(offsets) > 40
    for k in offsets:
        struct, field = k[9:].split(".")
        assert field in dict(STRUCTS[struct]._fields_), k


def test_ioctl_numbers_carry_the_struct_size():
    for i in kgsl.IOCTLS:
        assert kgsl.ioc_size(i.number) == ctypes.sizeof(i.struct), i.name
        assert (i.number >> 8) & 0xFF == 0x09, i.name  # KGSL_IOC_TYPE


@pytest.mark.skipif(not os.environ.get("KEEL_KGSL_HEADER"), reason="KEEL_KGSL_HEADER not set: "
                    "the recorded facts stand; set it to a copy of msm_kgsl.h to re-derive them")
@pytest.mark.skipif(not shutil.which("clang-19") or not shutil.which("llvm-objcopy-19"),
                    reason="needs clang-19 and llvm-objcopy-19")
def test_recorded_facts_match_the_given_header():
    from tests.qcom_uapi_regen import TARGETS, facts
    for target in TARGETS:
        assert facts(os.environ["KEEL_KGSL_HEADER"], target) == FACTS, target
