"""device="amd" with KEEL_USB=mock: Model.load and run through usbgpu/ (libusb calls answered by
the mock ASM24xx) -> am/ (bring-up, DMA window, PM4 queue) -> the mock RX 7900 (PM4 decoded,
kernels' OpenCL C on PoCL), against onnxruntime; unplug, hang and firmware faults through
KEEL_MOCK_FAULTS; recovery after a replug.

What no mock proves: the gfx1100 ISA, that am/regs.py's header facts hold on silicon, the
real bridge firmware's behaviour and any timing; tests/device/test_usbgpu.py is for hardware.
"""
from __future__ import annotations

import re
import struct
import time

import numpy as np
import pytest

from am import firmware
from sim.am import standin
from sim.am.mock_device import IPS
from runner import Model
from runner.errors import ConfigError, DeviceError, DeviceTimeout
from runner.faults import parse
from tests.deps import needs, needs_tool, opencl_missing
from tests.graphs import assert_close, compiled_blob, ort_run, random_feeds, single_node_model
from sim.usb.mock import MockLibusb

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


# the stand-ins' images in load order (am/boot.py): bootloader KDB 1, SYS_DRV 2, sOS 3; the TOC 4;
# SMU 5; PFP code 6 and its 2 stacks 7-8; ME 9-11; MEC code 12 and its 4 stacks 13-16; IMU 17-18;
# RLC's 7 extra parts 19-25 and RLC_G 26
IMAGES = 26


@pytest.mark.parametrize("n, name", [(1, "psp_13_0_0_sos.bin (bootloader component 3)"),
                                     (3, "psp_13_0_0_sos.bin (bootloader component 1)"),
                                     (5, "smu_13_0_0.bin (type 18)"),
                                     (12, "gc_11_0_0_mec.bin (type 89)"),
                                     (16, "gc_11_0_0_mec.bin (type 97)"),
                                     (26, "gc_11_0_0_rlc.bin (type 8)")])
def test_every_firmware_image_loads_in_order_and_a_refusal_names_its_file(enclosure, monkeypatch,
                                                                         n, name):
    """All 26 images in amdgpu's order (the mock refuses any other: SMU before the TMR, the TMR
    the TOC's size, AUTOLOAD_RLC after RLC_G, IMU and MEC); the queue runs only after the MEC
    starts at its file's address. A refused image names its file and type."""
    from am import psp
    if n == 1:  # one clean load checks the whole sequence; the others only the refusal
        m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
        gpu = MockLibusb.shared().bridge.function
        assert gpu.psp.booted == [psp.KDB, psp.SYS_DRV, psp.SOS]
        assert gpu.psp.tmr[1] == standin.TOC_TMR_BYTES  # LOAD_TOC's answer, not the default
        assert gpu.firmware_loads == IMAGES and gpu.running
        assert {psp.SMU, psp.RLC_G, psp.IMU_I, psp.IMU_D, *psp.RS64["mec"], *psp.RS64["pfp"],
                *psp.RS64["me"], psp.RLC_P, psp.RLC_V, psp.RLC_IRAM} <= gpu.psp.loaded
        m.close()
        MockLibusb.forget()
    monkeypatch.setenv("KEEL_MOCK_FAULTS", f"fwerr@{n}")
    with pytest.raises(DeviceError, match=re.escape(f"PSP refused firmware {name}")):
        Model.load(compiled_blob(_model(), target="amd"), device="amd")
    gpu = MockLibusb.shared().bridge.function
    assert not gpu.running  # without its microcode the command processor runs nothing


def test_an_image_sent_as_the_wrong_type_is_refused(enclosure):
    """ME's file where PFP's should be: its parts carry ME's types, so the PSP (whose real
    counterpart checks signatures) refuses the first, naming the file and the type."""
    (enclosure / "gc_11_0_0_pfp.bin").write_bytes((enclosure / "gc_11_0_0_me.bin").read_bytes())
    with pytest.raises(DeviceError, match=r"refused firmware gc_11_0_0_pfp.bin \(type 87\)"):
        Model.load(compiled_blob(_model(), target="amd"), device="amd")


def test_a_mec_started_elsewhere_never_runs_the_queue(enclosure, monkeypatch):
    """The MEC file's header names another start address: the MEC's program counter is not where
    its microcode begins, so the queue never answers and bring-up fails at its deadline."""
    import am.driver
    mec = bytearray((enclosure / "gc_11_0_0_mec.bin").read_bytes())
    struct.pack_into("<I", mec, firmware.HEADER.size + 4 * 5, standin.MEC_START + 0x100)
    (enclosure / "gc_11_0_0_mec.bin").write_bytes(bytes(mec))
    monkeypatch.setattr(am.driver, "BOOT_TIMEOUT_S", 0.3)
    with pytest.raises(DeviceTimeout, match="GPU queue"):
        Model.load(compiled_blob(_model(), target="amd"), device="amd")


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


def test_everything_runs_on_virtual_addresses_through_the_page_table(enclosure):
    from am import regs, vm
    from am.driver import VM_AT, VM_BYTES
    m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
    gpu = MockLibusb.shared().bridge.function
    cntl = gpu.regs[regs.GCVM_CONTEXT0_CNTL]
    assert cntl & regs.CONTEXT_ENABLE and cntl >> regs.CONTEXT_DEPTH_SHIFT & 3 == vm.DEPTH
    d = m.device
    ib = d.streams[range(len(m.blob.launches)), False][0]
    for va in (d.arena, d.weights, ib, d.gpu.window, *(mem.address for mem in d.io_memory)):
        assert VM_AT <= va < VM_AT + VM_BYTES  # virtual, not the FB location's physical
        _, leaf, _ = gpu.space.walk(va)  # PDB2 -> PDB1 -> PDB0 -> PTB in the mock's VRAM
        assert leaf & vm.VALID and leaf & vm.READABLE
    # the window is system memory: its leaf names the bridge's bus address
    _, leaf, size = gpu.space.walk(d.gpu.window)
    assert leaf & vm.SYSTEM and leaf & vm.ADDRESS == d.gpu.window_bus and size == vm.PAGE
    _check(m, 1)
    m.close()


def test_a_dispatch_reading_an_unmapped_page_faults_and_a_fresh_mapping_runs(enclosure):
    """The weights' first PTE cleared (and the TLB invalidated, as a driver changing a mapping
    must): the first dispatch that reads weights faults naming that address. recover() maps
    everything again and the model matches onnxruntime as before."""
    from am import regs
    from sim.am.mock_gpu import GPU_BASE
    m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
    _check(m, 1)
    gpu = MockLibusb.shared().bridge.function
    weights = m.device.weights
    gpu.vram.write(GPU_BASE + gpu.space.walk(weights)[0], bytes(8))
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
    ib = m.device.streams[range(len(m.blob.launches)), False][0]
    with pytest.raises(DeviceError, match=f"page fault.*0x{ib:x}"):
        m.run(random_feeds(_model(), seed=2), timeout_ms=TIMEOUT_MS)
    _check(m, 3)
    m.close()


def test_the_mqd_mirrors_the_hqd_registers_where_v11_structs_h_puts_them():
    """v11_compute_mqd: cp_mqd_base_addr_lo is dword 128, cp_hqd_active 130, cp_hqd_pq_control
    145, cp_hqd_eop_control 167, cp_hqd_pq_wptr_hi 183 (the struct's field order); the queue is
    programmed in kiq_init_register's order, activation last."""
    from am import mqd, regs
    assert [mqd.at(r) for r in (regs.CP_MQD_BASE_ADDR, regs.CP_HQD_ACTIVE, regs.CP_HQD_PQ_CONTROL,
                                regs.CP_HQD_EOP_CONTROL, regs.CP_HQD_PQ_WPTR_HI)] == \
        [128, 130, 145, 167, 183]
    q = mqd.Queue(0x8000_0230_0000, 0x2000_0000_0000, 256, 0x8000_0230_0800,
                  0x8000_0230_0808, 0x8000_0230_1000, 0)
    m = mqd.build(q)
    assert m[0] == 0xC0310800 and len(mqd.pack(m)) == 2048
    assert m[mqd.at(regs.CP_HQD_PQ_CONTROL)] & 0x3F == 5  # 64 dwords = 2^(5+1)
    assert m[mqd.at(regs.CP_HQD_EOP_CONTROL)] == 8  # 2 KiB = 2^(8+1) dwords
    assert m[mqd.at(regs.CP_HQD_EOP_BASE_ADDR)] == (q.eop >> 8) & 0xFFFFFFFF
    writes = mqd.registers(m)
    assert writes[-1] == (regs.CP_HQD_ACTIVE, 1) and writes[0][0] == regs.CP_HQD_EOP_BASE_ADDR


def test_a_queue_whose_registers_disagree_with_its_mqd_is_refused(enclosure, monkeypatch):
    """The MQD in VRAM says another ring size than CP_HQD_PQ_CONTROL: the mock CP, reading the
    MQD at activation as the hardware does, refuses the queue naming the register."""
    from am import mqd, regs
    pack = mqd.pack

    def corrupt(m):
        m = list(m)
        m[mqd.at(regs.CP_HQD_PQ_CONTROL)] ^= 1
        return pack(m)
    monkeypatch.setattr(mqd, "pack", corrupt)
    with pytest.raises(DeviceError, match=r"ME 1 pipe 0 queue 0\) refused at activation: "
                                          rf"register 0x{regs.CP_HQD_PQ_CONTROL:x} holds"):
        Model.load(compiled_blob(_model(), target="amd"), device="amd")


@pytest.mark.parametrize("step", ["doorbell_aperture", "gc_doorbells"])
def test_a_doorbell_nbio_does_not_route_is_lost_and_the_deadline_names_the_queue(
        enclosure, monkeypatch, step):
    """Without NBIO's doorbell aperture (or the S2A entry routing doorbells to GC) the first
    doorbell never reaches the CP: the wait for its signal ends at the deadline, naming the
    queue."""
    import am.driver
    import am.gc
    monkeypatch.setattr(am.gc, step, lambda gpu: None)
    monkeypatch.setattr(am.driver, "BOOT_TIMEOUT_S", 0.3)
    with pytest.raises(DeviceTimeout, match=r"GPU queue \(compute, ME 1 pipe 0 queue 0\)"):
        Model.load(compiled_blob(_model(), target="amd"), device="amd")


def test_the_cp_refuses_memory_without_the_gc_hubs_tlb_and_l2(enclosure, monkeypatch):
    import am.gc
    monkeypatch.setattr(am.gc, "hub_caches", lambda gpu, scratch, dummy: None)
    with pytest.raises(DeviceError, match="GCMC_VM_MX_L1_TLB_CNTL 0x0: expected the L1 TLB on"):
        Model.load(compiled_blob(_model(), target="amd"), device="amd")


@pytest.mark.parametrize("bases, message", [
    (None, "SH_MEM_CONFIG/SH_MEM_BASES never programmed"),
    (0x10001000, "puts the private range 0x1000000000000000 over the shared")],
    ids=["unset", "overlapping"])
def test_a_dispatch_without_sh_mem_apertures_is_refused(enclosure, monkeypatch, bases, message):
    """Loading moves data only (no dispatch), so it succeeds; the first run's first dispatch is
    refused: SH_MEM never written, or its private and shared apertures on top of each other."""
    import am.gc
    from am import regs
    if bases is None:
        monkeypatch.setattr(am.gc, "sh_mem", lambda gpu: None)
    else:
        monkeypatch.setattr(regs, "SH_MEM_BASES_DEFAULT", bases)
    m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
    with pytest.raises(DeviceError, match=re.escape(message)):
        m.run(random_feeds(_model(), seed=1), timeout_ms=TIMEOUT_MS)


def test_firmware_reaches_the_psp_through_the_bridges_sram_not_bar0(tmp_path, monkeypatch):
    """Stand-ins whose 26 parts are 48 KiB each (1.2 MB): the PSP reads each from the bridge's
    SRAM through the MM hub, so bring-up sends far fewer bridge commands than the 7 or more a
    BAR0 dword costs (one per image dword would be 320k commands)."""
    standin.write_all(tmp_path, {(ip.hw_id, ip.instance): ip for ip in IPS}, n=48 << 10)
    monkeypatch.setenv("KEEL_USB", "mock")
    monkeypatch.setenv(firmware.ENV, str(tmp_path))
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)
    MockLibusb.forget()
    try:
        m = Model.load(compiled_blob(_model(), target="amd"), device="amd")
        _check(m, 1)
        assert m.device.gpu.pci.bridge.commands_sent < 40_000
    finally:
        MockLibusb.forget()


def test_the_psp_reads_nothing_through_an_mm_hub_without_its_tlb(enclosure, monkeypatch):
    import am.gc
    monkeypatch.setattr(am.gc, "tlb_and_l2", lambda gpu, hub: None)
    with pytest.raises(DeviceError, match="MMMC_VM_MX_L1_TLB_CNTL 0x0: expected the L1 TLB on"):
        Model.load(compiled_blob(_model(), target="amd"), device="amd")
