"""dsp/fastrpc.py against the FastRPC UAPI facts, as clang compiled them from the real header.

FACTS below were produced with tests/qcom_uapi_regen.py's `facts` and tests/dsp_uapi_probe.c,
compiled for aarch64-linux-gnu and x86_64-linux-gnu, which agreed, on 2026-11-24, from:
  drivers/char/adsprpc_shared.h of android-linux-stable/msm-4.9, commit
  0b6b8011bd22ebfb9eb09ca0eceedc6205436402 (Qualcomm's msm-4.9 FastRPC driver, "Copyright (c)
  2012-2018"), a local copy of its macros and declarations as read from the code index (the
  smq_* message structs and inline helpers, which no ioctl carries, left out).
The comma 3X kernel (commaai/agnos-kernel-sdm845) builds this msm-4.9 driver for SDM845; its
snapshot (1.4 GB) was too large to bring here, so the header came from the msm-4.9 tree it
derives from. To re-check against another copy (say, the one in comma's kernel):
    KEEL_ADSPRPC_HEADER=path/to/adsprpc_shared.h pytest tests/test_dsp_uapi.py
ION (legacy, msm-4.9 include/uapi/linux/ion.h) is not in this header: its two ioctls are checked
for the struct sizes they encode.
"""
import ctypes
import os
import shutil

import pytest

from dsp import fastrpc

FACTS = {
    'sizeof remote_arg': 16,
    'sizeof remote_buf': 16,
    'offsetof remote_buf.len': 8,
    'sizeof fastrpc_ioctl_invoke': 16,
    'offsetof fastrpc_ioctl_invoke.sc': 4,
    'offsetof fastrpc_ioctl_invoke.pra': 8,
    'sizeof fastrpc_ioctl_invoke_fd': 24,
    'offsetof fastrpc_ioctl_invoke_fd.fds': 16,
    'sizeof fastrpc_ioctl_invoke_attrs': 32,
    'offsetof fastrpc_ioctl_invoke_attrs.attrs': 24,
    'sizeof fastrpc_ioctl_init': 40,
    'offsetof fastrpc_ioctl_init.file': 8,
    'offsetof fastrpc_ioctl_init.filelen': 16,
    'offsetof fastrpc_ioctl_init.filefd': 20,
    'offsetof fastrpc_ioctl_init.mem': 24,
    'offsetof fastrpc_ioctl_init.memlen': 32,
    'offsetof fastrpc_ioctl_init.memfd': 36,
    'sizeof fastrpc_ioctl_init_attrs': 48,
    'offsetof fastrpc_ioctl_init_attrs.attrs': 40,
    'offsetof fastrpc_ioctl_init_attrs.siglen': 44,
    'sizeof fastrpc_ioctl_mmap': 32,
    'offsetof fastrpc_ioctl_mmap.flags': 4,
    'offsetof fastrpc_ioctl_mmap.vaddrin': 8,
    'offsetof fastrpc_ioctl_mmap.size': 16,
    'offsetof fastrpc_ioctl_mmap.vaddrout': 24,
    'sizeof fastrpc_ioctl_munmap': 16,
    'offsetof fastrpc_ioctl_munmap.size': 8,
    'FASTRPC_IOCTL_INVOKE': 0xc0105201,
    'FASTRPC_IOCTL_MMAP': 0xc0205202,
    'FASTRPC_IOCTL_MUNMAP': 0xc0105203,
    'FASTRPC_IOCTL_INVOKE_FD': 0xc0185204,
    'FASTRPC_IOCTL_INIT': 0xc0285206,
    'FASTRPC_IOCTL_INVOKE_ATTRS': 0xc0205207,
    'FASTRPC_IOCTL_GETINFO': 0xc0045208,
    'FASTRPC_IOCTL_INIT_ATTRS': 0xc030520a,
    'FASTRPC_INIT_ATTACH': 0,
    'FASTRPC_INIT_CREATE': 1,
    'REMOTE_SCALARS_MAKE(2, 1, 1)': 0x2010100,
    'REMOTE_SCALARS_MAKE(0, 2, 2)': 0x20200,
    'REMOTE_SCALARS_MAKE(1, 1, 2)': 0x1010200,
}

STRUCTS = {s.c_name: s for s in vars(fastrpc).values()
           if isinstance(s, type) and issubclass(s, (ctypes.Structure, ctypes.Union))
           and getattr(s, "c_name", None)}
STRUCTS["remote_buf"] = fastrpc.RemoteBuf


def test_every_struct_fastrpc_py_passes_has_the_header_size_and_offsets():
    for name, s in STRUCTS.items():
        assert ctypes.sizeof(s) == FACTS[f"sizeof {name}"], name
        for field, _ in s._fields_:
            key = f"offsetof {name}.{field}"
            if key in FACTS:
                assert getattr(s, field).offset == FACTS[key], key
    init = STRUCTS["fastrpc_ioctl_init"]
    for field in ("file", "filelen", "filefd", "mem", "memlen", "memfd"):
        assert getattr(init, field).offset == FACTS[f"offsetof fastrpc_ioctl_init.{field}"]


def test_ioctl_numbers_and_constants_match_the_header():
    assert fastrpc.IOCTLS and all(fastrpc.IOCTLS[k] == FACTS[k] for k in fastrpc.IOCTLS)
    assert fastrpc.FASTRPC_INIT_CREATE == FACTS["FASTRPC_INIT_CREATE"]
    for key in [k for k in FACTS if k.startswith("REMOTE_SCALARS_MAKE")]:
        method, ins, outs = map(int, key[len("REMOTE_SCALARS_MAKE("):-1].split(","))
        assert fastrpc.scalars(method, ins, outs) == FACTS[key], key


def test_legacy_ion_ioctls_encode_their_struct_sizes():
    # _IOWR('I', nr, struct): size in bits 16..29; ion_allocation_data is 32 bytes on LP64
    # (two size_t, three 4-byte fields, padding), ion_fd_data 8
    assert fastrpc.ION_IOC_ALLOC == 0xc0204900 and fastrpc.ION_IOC_SHARE == 0xc0084904
    assert ctypes.sizeof(fastrpc.IonAlloc) == 32 and ctypes.sizeof(fastrpc.IonFd) == 8


def test_off_a_qualcomm_device_the_transport_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(fastrpc, "RPC_NODE", "/nonexistent/adsprpc-smd")
    with pytest.raises(fastrpc.DeviceError, match="adsprpc-smd absent: .* KEEL_FASTRPC=mock"):
        fastrpc.FastRpcTransport()


@pytest.mark.skipif(not os.environ.get("KEEL_ADSPRPC_HEADER"), reason="KEEL_ADSPRPC_HEADER not "
                    "set: the recorded facts stand; set it to a copy of adsprpc_shared.h")
@pytest.mark.skipif(not shutil.which("clang-19") or not shutil.which("llvm-objcopy-19"),
                    reason="needs clang-19 and llvm-objcopy-19")
def test_recorded_facts_match_the_given_header():
    from tests.qcom_uapi_regen import TARGETS, facts
    probe = os.path.join(os.path.dirname(__file__), "dsp_uapi_probe.c")
    for target in TARGETS:
        assert facts(os.environ["KEEL_ADSPRPC_HEADER"], target, probe,
                     "adsprpc_shared.h") == FACTS, target

# the session's ioctl sequence, against a mock driver and PD: tests/test_dsp_listener.py
