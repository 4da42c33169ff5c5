"""device="amd" with KEEL_USB=mock: Model.load and run through usbgpu/ (libusb calls answered by
the mock ASM24xx) -> am/ (bring-up, DMA window, PM4 queue) -> the mock RX 7900 (PM4 decoded,
kernels' OpenCL C on PoCL), against onnxruntime; unplug, hang and firmware faults through
KEEL_MOCK_FAULTS; recovery after a replug.

What no mock proves: the gfx1100 ISA, the register offsets am/regs.py marks UNVERIFIED, the
real bridge firmware's behaviour and any timing; tests/device/test_usbgpu.py is for hardware.
"""
from __future__ import annotations

import struct
import time

import numpy as np
import pytest

from am import firmware, standin
from am.mock_device import IPS
from runner import Model
from runner.errors import ConfigError, DeviceError, DeviceTimeout
from runner.faults import parse
from tests.deps import needs, needs_tool, opencl_missing
from tests.graphs import assert_close, compiled_blob, ort_run, random_feeds, single_node_model
from usbgpu.mock import MockLibusb

pytestmark = [needs("pocl-opencl-icd", opencl_missing()), needs_tool("lld-19", "ld.lld-19")]
TIMEOUT_MS = 3000


def _model():
    w = np.random.default_rng(0).standard_normal((16, 8, 3, 3)).astype(np.float32)
    return single_node_model("Conv", [((1, 8, 16, 16), "float32"), w], {"pads": [1, 1, 1, 1]})


@pytest.fixture
def enclosure(tmp_path, monkeypatch):
    """A fresh mock enclosure, and stand-in firmware files (keel ships none) where
    KEEL_AMD_FIRMWARE points."""
    standin.write_all(tmp_path, {(ip.hw_id, ip.instance): ip for ip in IPS})
    monkeypatch.setenv("KEEL_USB", "mock")
    monkeypatch.setenv(firmware.ENV, str(tmp_path))
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)
    MockLibusb.forget()
    yield tmp_path
    MockLibusb.forget()


def _check(m, seed: int) -> None:
    feeds = random_feeds(_model(), seed=seed)
    # the same OpenCL C on PoCL as tests/test_opencl.py: only summation order differs (72 terms)
    assert_close(m.run(feeds, timeout_ms=TIMEOUT_MS)["y"], ort_run(_model(), feeds)["y"],
                 1e-5, 1e-5, f"conv seed {seed}")


def test_a_model_runs_through_usb_am_and_the_mock_gpu(enclosure):
    m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
    _check(m, 1)
    _check(m, 2)  # the recorded graph replayed with new inputs
    usb = MockLibusb.shared()
    gpu = usb.bridge.function
    assert gpu.submissions == 2 and gpu.cp.dispatches == 2 * len(m.device.blob.launches)
    m.close()


def test_unplug_mid_run_is_a_device_error_and_a_replug_recovers(enclosure, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "unplug@2")
    m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
    _check(m, 1)
    t = time.monotonic()
    with pytest.raises(DeviceError, match="no device|NO_DEVICE"):
        m.run(random_feeds(_model(), seed=2), timeout_ms=TIMEOUT_MS)
    assert time.monotonic() - t < TIMEOUT_MS / 1000  # reported, not waited out
    with pytest.raises(DeviceError):  # still unplugged: recover() cannot open it
        m.run(random_feeds(_model(), seed=2), timeout_ms=TIMEOUT_MS)
    MockLibusb.shared().replug()
    _check(m, 3)  # recover() brought the GPU up and reloaded the blob


def test_a_hung_queue_times_out_at_the_deadline_and_recovers(enclosure, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "hang@1")
    m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
    t = time.monotonic()
    with pytest.raises(DeviceTimeout):
        m.run(random_feeds(_model(), seed=1), timeout_ms=300)
    assert time.monotonic() - t >= 0.3
    _check(m, 4)


def test_a_refused_firmware_fails_the_load_naming_the_file(enclosure, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "fwerr@1")
    with pytest.raises(DeviceError, match="PSP refused firmware psp_13_0_0_sos.bin"):
        Model.load(compiled_blob(_model(), target="amd"), device="amd")


@pytest.mark.parametrize("n, name", [(2, "gc_11_0_0_rlc.bin"), (3, "gc_11_0_0_mec.bin")])
def test_rlc_and_mec_load_through_the_psp_ring_and_a_refusal_names_the_file(enclosure, monkeypatch,
                                                                           n, name):
    """After sOS (firmware load 1): SETUP_TMR, then LOAD_IP_FW of RLC (2) and MEC (3) through the
    GPCOM ring; the queue runs only once both are in. A refused load names its file."""
    from am import psp
    m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
    gpu = MockLibusb.shared().bridge.function
    assert gpu.psp.loaded == {psp.RLC_G, psp.RS64_MEC} and gpu.psp.tmr[1] == psp.TMR_BYTES
    assert gpu.firmware_loads == 3
    m.close()
    MockLibusb.forget()
    monkeypatch.setenv("KEEL_MOCK_FAULTS", f"fwerr@{n}")
    with pytest.raises(DeviceError, match=f"PSP refused firmware {name}"):
        Model.load(compiled_blob(_model(), target="amd"), device="amd")
    gpu = MockLibusb.shared().bridge.function
    assert not gpu.running  # without its microcode the command processor runs nothing


def test_missing_firmware_names_the_files_and_the_setting(enclosure):
    (enclosure / "gc_11_0_0_mec.bin").unlink()
    with pytest.raises(ConfigError, match="gc_11_0_0_mec.bin.*KEEL_AMD_FIRMWARE"):
        Model.load(compiled_blob(_model(), target="amd"), device="amd")


def test_a_fault_kind_the_amd_mock_does_not_inject_is_refused(enclosure, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "slow@1:5")
    with pytest.raises(ValueError, match="does not inject slow"):
        Model.load(compiled_blob(_model(), target="amd"), device="amd")
    # and the host mock (runner/mock.py) refuses the kinds only the amd mock injects
    with pytest.raises(ValueError, match="does not inject unplug"):
        parse("unplug@2", "KEEL_MOCK_FAULTS", ("hang", "fault", "slow"))


@pytest.mark.slow
@pytest.mark.timeout(1800)  # PoCL compiles the whole model; 76 MB of weights cross the window
def test_openpilot_through_usb_matches_onnxruntime(enclosure):
    """fp32: the same OpenCL C on the same PoCL as tests/test_opencl.py's openpilot test, so the
    same tolerance and reasoning: only summation order differs from onnxruntime."""
    from models.openpilot import make_openpilot
    model = make_openpilot()
    m = Model.load(compiled_blob(model, target="amd"), device="amd")
    feeds = random_feeds(model, seed=0)
    assert_close(m.run(feeds, timeout_ms=600_000)["outputs"], ort_run(model, feeds)["outputs"],
                 1e-3, 1e-4, "openpilot over usb")


def _pte_at(gpu, va: int) -> int:
    """VRAM offset of the PTE that maps `va`, read from the registers the driver programmed."""
    from am import regs
    r = gpu.regs
    start = r[regs.GCVM_CONTEXT0_PT_START_LO] | r[regs.GCVM_CONTEXT0_PT_START_HI] << 32
    end = r[regs.GCVM_CONTEXT0_PT_END_LO] | r[regs.GCVM_CONTEXT0_PT_END_HI] << 32
    assert start <= va >> 12 <= end, f"0x{va:x} is outside the GART range"
    base = (r[regs.GCVM_CONTEXT0_PT_BASE_LO] | r[regs.GCVM_CONTEXT0_PT_BASE_HI] << 32) & ~0xFFF
    return base + 8 * ((va >> 12) - start)


def test_everything_runs_on_gart_addresses_through_the_page_table(enclosure):
    from am import regs
    from am.driver import GART_AT, GART_BYTES
    from am.mock_gpu import GPU_BASE
    m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
    gpu = MockLibusb.shared().bridge.function
    assert gpu.regs[regs.GCVM_CONTEXT0_CNTL] & regs.CONTEXT_ENABLE
    d = m.device
    for va in (d.arena, d.weights, d.ib, d.gpu.window, *(va for va, _ in d.slots.values())):
        assert GART_AT <= va < GART_AT + GART_BYTES  # virtual, not the FB location's physical
        pte = struct.unpack("<Q", gpu.vram.read(GPU_BASE + _pte_at(gpu, va), 8))[0]
        assert pte & regs.PTE_VALID and pte & regs.PTE_READABLE
    # the window is system memory: its PTE names the bridge's bus address
    pte = struct.unpack("<Q", gpu.vram.read(GPU_BASE + _pte_at(gpu, d.gpu.window), 8))[0]
    assert pte & regs.PTE_SYSTEM and pte & regs.PTE_ADDRESS == d.gpu.window_bus
    _check(m, 1)
    m.close()


def test_a_dispatch_reading_an_unmapped_page_faults_and_a_fresh_mapping_runs(enclosure):
    """The weights' first PTE cleared (and the TLB invalidated, as a driver changing a mapping
    must): the first dispatch that reads weights faults naming that address. recover() maps
    everything again and the model matches onnxruntime as before."""
    from am import regs
    from am.mock_gpu import GPU_BASE
    m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
    _check(m, 1)
    gpu = MockLibusb.shared().bridge.function
    weights = m.device.weights
    gpu.vram.write(GPU_BASE + _pte_at(gpu, weights), bytes(8))
    gpu.mem_write(5, 4 * regs.GCVM_INVALIDATE_ENG17_REQ, 1 | regs.INVALIDATE_ALL, 0xF)
    t = time.monotonic()
    with pytest.raises(DeviceError, match=f"page fault.*0x{weights:x}"):
        m.run(random_feeds(_model(), seed=2), timeout_ms=TIMEOUT_MS)
    assert time.monotonic() - t < TIMEOUT_MS / 1000  # reported, not waited out
    _check(m, 3)  # recover(): a new bring-up wrote the table again
    m.close()


def test_an_injected_vm_fault_is_a_device_error_and_recover_brings_the_model_back(
        enclosure, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "fault@2")
    m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
    _check(m, 1)
    ib = m.device.ib
    with pytest.raises(DeviceError, match=f"page fault.*0x{ib:x}"):
        m.run(random_feeds(_model(), seed=2), timeout_ms=TIMEOUT_MS)
    _check(m, 3)
    m.close()
