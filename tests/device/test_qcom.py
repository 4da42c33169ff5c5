"""KGSL on a comma 3X (/dev/kgsl-3d0): the UAPI and the packet format, proven on the hardware.

    KEEL_KGSL= python -m pytest -q tests/device/test_qcom.py

Skipped elsewhere. The same calls run against qcom/mock_kgsl.py in tests/test_qcom_mock.py; here
the kernel and the CP answer instead, so a wrong struct layout, ioctl number or packet header shows
up as an errno or a value the GPU did not write. The whole-model runs and latency comparison of
the issue's item 9 come with the qcom device backend.
"""
import ctypes
import mmap
import os
import time

import pytest

from qcom import kgsl
from qcom.cmdstream import OPCODES, decode, lohi, pkt7

pytestmark = pytest.mark.skipif(not os.path.exists(kgsl.DEVICE_PATH),
                                reason=f"{kgsl.DEVICE_PATH} absent: not a Qualcomm Adreno device")


@pytest.fixture
def dev(monkeypatch):
    monkeypatch.delenv("KEEL_KGSL", raising=False)  # the kernel, never the mock
    k = kgsl.Kgsl()
    yield k
    k.close()


def test_the_chip_is_a_validated_adreno_630(dev):
    info = dev.check_chip()
    version = dev.version()
    print(f"chip {info.chip_id:#010x} gpu_id {info.gpu_id} driver {version.drv_major}."
          f"{version.drv_minor} device {version.dev_major}.{version.dev_minor}")
    assert info.gpu_id == 630


def _write_and_check(dev, ctx, target_addr, view):
    """Submit CP_MEM_WRITE of a marker to target_addr; wait; read it back through `view`."""
    marker = 0x6B65656C  # "keel"
    words = (pkt7(OPCODES["CP_MEM_WRITE"], *lohi(target_addr), marker)
             + pkt7(OPCODES["CP_WAIT_MEM_WRITES"]) + pkt7(OPCODES["CP_WAIT_FOR_IDLE"]))
    ib = dev.alloc(4096)
    decode(words, [(ib.gpuaddr, ib.size), (target_addr, 4)])  # the mock would accept it too
    ibmap = dev.mmap(ib)
    ibmap[:4 * len(words)] = b"".join(w.to_bytes(4, "little") for w in words)
    ts = dev.submit(ctx, [(ib.gpuaddr, 4 * len(words))])
    assert dev.wait_until(ctx, ts, time.monotonic() + 1.0), "a 3-packet IB did not retire in 1 s"
    assert int.from_bytes(view[:4], "little") == marker
    dev.free(ib.id)


def test_the_gpu_runs_a_packet_stream_and_writes_memory(dev):
    ctx = dev.context_create()
    try:
        target = dev.alloc(4096)
        _write_and_check(dev, ctx, target.gpuaddr, dev.mmap(target))
        assert kgsl.ts_reached(dev.read_timestamp(ctx), 1)
    finally:
        dev.context_destroy(ctx)


def test_imported_user_memory_is_written_in_place(dev):
    host = mmap.mmap(-1, 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(host))
    ctx = dev.context_create()
    try:
        obj = dev.import_user(addr, 4096)
        _write_and_check(dev, ctx, obj.gpuaddr, host)
    finally:
        dev.context_destroy(ctx)


def test_a_timestamp_never_submitted_is_refused(dev):
    ctx = dev.context_create()
    try:
        with pytest.raises(kgsl.DeviceError, match="EINVAL"):
            dev.wait(ctx, 1000, 10)
    finally:
        dev.context_destroy(ctx)
