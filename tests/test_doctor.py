"""tools/doctor.py on the simulators: every stage passes on the KGSL mock, the emulated DSP and the
mock USB GPU; and for each stage that has one, the fault it exists to catch, injected through the
simulator's own seam (KEEL_MOCK_BRINGUP, KEEL_MOCK_FAULTS, the firmware folder, PATH), is named
at exactly that stage with a non-zero exit and a JSON report."""
from __future__ import annotations

import json
import tarfile

import pytest

from sim.am import standin
from sim.am.mock_device import IPS
from tests.deps import needs_clang, needs_tool
from tools import doctor
from sim.usb.mock import MockLibusb

STAGES = {
    "qcom": ["open", "properties", "context", "memory", "nop", "deadline", "dispatch", "image",
             "model", "openpilot"],
    "dsp": ["node", "memory", "session", "invoke", "known_answer", "model"],
    "amd": ["usb", "pcie", "discovery", "firmware", "mm_hub", "psp", "gc_hub", "queue", "nop",
            "vram", "known_answer", "model"],
}


@pytest.fixture
def sims(tmp_path, monkeypatch):
    """Every device on its simulator, stand-in AMD firmware (keel ships none), no faults."""
    fw = tmp_path / "firmware"
    fw.mkdir()
    standin.write_all(fw, {(ip.hw_id, ip.instance): ip for ip in IPS})
    for var, value in (("KEEL_KGSL", "mock"), ("KEEL_FASTRPC", "mock"), ("KEEL_USB", "mock"),
                       ("KEEL_AMD_FIRMWARE", str(fw))):
        monkeypatch.setenv(var, value)
    for var in ("KEEL_MOCK_FAULTS", "KEEL_MOCK_BRINGUP"):
        monkeypatch.delenv(var, raising=False)
    MockLibusb.forget()  # a fresh enclosure reads the faults again
    yield fw
    MockLibusb.forget()


def run(capsys, *args) -> tuple[int, dict]:
    code = doctor.main([*args, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow
@needs_clang
@needs_tool("qemu-user", "qemu-hexagon")
def test_every_stage_passes_on_the_simulators_and_the_bundle_holds_the_report(sims, capsys,
                                                                                  tmp_path):
    out = tmp_path / "diag.tar.gz"
    code, rep = run(capsys, "--device", "all", "--bundle", str(out))
    bad = [r for r in rep["stages"] if r["status"] != "pass"]
    assert code == 0 and rep["ok"] and not bad, bad
    assert [r["stage"] for r in rep["stages"]] == [f"{d}.{s}" for d in STAGES for s in STAGES[d]]
    assert all(r["seconds"] >= 0 and r["measured"] and r["expected"] for r in rep["stages"])
    assert rep["properties"]["qcom"]["chip_id"] == "0x06030001"
    assert rep["properties"]["amd"]["pci_id"] == "1002:744c"
    with tarfile.open(out) as tar:
        names = {m.name.removeprefix("keel-doctor/") for m in tar.getmembers()}
        report = json.load(tar.extractfile("keel-doctor/report.json"))
    assert names == {"report.json", "os.txt", "dmesg.txt", "properties.json", "keel.json"}
    assert report["keel"]["source_sha256"] == doctor.source_hash()
    # relu_mul (qcom, amd), two_matmuls and openpilot (cpu, qcom), small_net (cpu, qcom, amd),
    # int8_fma (dsp), qdq_conv (cpu, dsp)
    assert len(report["blobs"]) == 12 and all(len(h) == 64 for h in report["blobs"].values())


# (device, stage, how the fault is injected, the status the report must name)
FAULTS = [
    ("qcom", "open", {"KEEL_MOCK_BRINGUP": "kgsl.open=ENOENT"}, "ENOENT"),
    ("qcom", "open", {"KEEL_MOCK_BRINGUP": "kgsl.open=EPERM"}, "EPERM"),
    ("qcom", "open", {"KEEL_MOCK_BRINGUP": "kgsl.open=EACCES"}, "EACCES"),
    ("qcom", "properties", {"KEEL_MOCK_BRINGUP": "kgsl.chip=0x06040001"}, "unvalidated chip"),
    ("qcom", "context", {"KEEL_MOCK_BRINGUP": "kgsl.context=EINVAL"}, "EINVAL"),
    ("qcom", "memory", {"KEEL_MOCK_BRINGUP": "kgsl.alloc=ENOMEM"}, "ENOMEM"),
    ("qcom", "memory", {"KEEL_MOCK_BRINGUP": "kgsl.import=EINVAL"}, "EINVAL"),  # the dma-buf
    ("qcom", "nop", {"KEEL_MOCK_FAULTS": "hang@2"}, "not retired"),  # qcom.memory submits 1
    ("qcom", "deadline", {"KEEL_MOCK_FAULTS": "slow@3:3000"}, "DeviceTimeout"),
    ("qcom", "dispatch", {"KEEL_MOCK_BRINGUP": "gpu.answer=wrong"}, "wrong answer"),
    ("qcom", "image", {"KEEL_MOCK_BRINGUP": "gpu.image=fault"}, "EDEADLK"),
    # wrong from the third dispatch of a submission on: only a graph that deep shows it
    ("qcom", "model", {"KEEL_MOCK_BRINGUP": "gpu.answer=wrong@3"}, "wrong answer"),
    # ... and from the seventh: only the openpilot-shaped model has more than six kernels
    ("qcom", "openpilot", {"KEEL_MOCK_BRINGUP": "gpu.answer=wrong@7"}, "wrong answer"),
    ("dsp", "memory", {"KEEL_MOCK_BRINGUP": "fastrpc.memory=ENOMEM"}, "ENOMEM"),
    ("dsp", "session", {"KEEL_MOCK_BRINGUP": "fastrpc.pd=EACCES"}, "EACCES"),
    ("dsp", "invoke", {"KEEL_MOCK_FAULTS": "hang@1"}, "DeviceTimeout"),
    ("dsp", "known_answer", {"KEEL_MOCK_BRINGUP": "fastrpc.answer=wrong"}, "wrong answer"),
    # each Model counts its own invokes: dsp.invoke makes 20, dsp.known_answer 1, dsp.model 101
    ("dsp", "model", {"KEEL_MOCK_FAULTS": "fault@21"}, "DeviceError"),
    ("amd", "usb", {"KEEL_MOCK_BRINGUP": "usb.device=absent"}, "DeviceError"),
    ("amd", "pcie", {"KEEL_MOCK_BRINGUP": "usb.link=down"}, "DeviceError"),
    ("amd", "discovery", {"KEEL_MOCK_BRINGUP": "amd.discovery=corrupt"}, "DeviceError"),
    ("amd", "mm_hub", {"KEEL_MOCK_BRINGUP": "amd.tlb=mm"}, "DeviceTimeout"),
    ("amd", "psp", {"KEEL_MOCK_FAULTS": "fwerr@1"}, "DeviceError"),
    ("amd", "gc_hub", {"KEEL_MOCK_BRINGUP": "amd.tlb=gc"}, "DeviceTimeout"),
    ("amd", "queue", {"KEEL_MOCK_BRINGUP": "amd.queue=inactive"}, "DeviceTimeout"),
    ("amd", "nop", {"KEEL_MOCK_FAULTS": "hang@1"}, "DeviceTimeout"),  # a NOP never retires
    ("amd", "vram", {"KEEL_MOCK_BRINGUP": "amd.huge=alias"}, "wrong memory"),
    ("amd", "known_answer", {"KEEL_MOCK_BRINGUP": "gpu.answer=wrong"}, "wrong answer"),
    # the enclosure counts IB submissions: amd.nop makes 1, amd.known_answer 1, amd.model the rest
    ("amd", "model", {"KEEL_MOCK_FAULTS": "fault@3"}, "GpuFault"),
]
NEXT = {"kgsl.open=ENOENT": "kgsl driver", "kgsl.open=EPERM": "udev rule",
        "kgsl.open=EACCES": "SELinux", "fastrpc.pd=EACCES": "testsig",
        "usb.link=down": "link behind the bridge is down", "kgsl.chip=0x06040001": "opencl",
        "amd.tlb=mm": "MM hub never acknowledged", "amd.tlb=gc": "GC hub never acknowledged",
        "amd.queue=inactive": "MEC is not running", "fastrpc.memory=ENOMEM": "ION system heap",
        "gpu.image=fault": "texture descriptor", "amd.huge=alias": "maps 2 MiB pages",
        "kgsl.import=EINVAL": "CONFIG_DMA_SHARED_BUFFER"}


def _check_named(rep: dict, device: str, stage: str, code: str) -> dict:
    rows = {r["stage"]: r for r in rep["stages"]}
    failed = [r for r in rep["stages"] if r["status"] == "fail"]
    assert [r["stage"] for r in failed] == [f"{device}.{stage}"], failed
    row = rows[f"{device}.{stage}"]
    before = STAGES[device][:STAGES[device].index(stage)]
    assert all(rows[f"{device}.{s}"]["status"] == "pass" for s in before)
    assert not rep["ok"] and rep["failed_stage"] == row["stage"]
    assert row["code"] == code, row
    assert row["call"] and row["next"] and row["expected"], row
    return row


@pytest.mark.parametrize("device, stage, env, code", [
    pytest.param(*f, id=f"{f[0]}.{f[1]}-{next(iter(f[2].values()))}",
                 marks=[needs_tool("qemu-user", "qemu-hexagon"), needs_clang]
                 if f[0] == "dsp" else []) for f in FAULTS])
def test_each_fault_is_named_at_its_own_stage(device, stage, env, code, sims, capsys,
                                              monkeypatch):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    status, rep = run(capsys, "--device", device)
    assert status == 1
    row = _check_named(rep, device, stage, code)
    hint = NEXT.get(env.get("KEEL_MOCK_BRINGUP", ""))
    assert hint is None or hint in row["next"], row["next"]
    if env.get("KEEL_MOCK_BRINGUP", "").startswith("kgsl.import"):
        assert row["call"] == "IOCTL_KGSL_GPUOBJ_IMPORT(dma-buf)", row  # not the other imports


def test_a_missing_firmware_file_is_named_at_the_firmware_stage(sims, capsys):
    (sims / "gc_11_0_0_mec.bin").unlink()
    status, rep = run(capsys, "--device", "amd")
    row = _check_named(rep, "amd", "firmware", "ConfigError")
    assert status == 1 and "gc_11_0_0_mec.bin" in row["measured"]
    assert "KEEL_AMD_FIRMWARE" in row["next"]


def test_a_missing_emulator_is_named_at_the_dsp_node_stage(sims, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no qemu-hexagon, no clang
    status, rep = run(capsys, "--device", "dsp")
    row = _check_named(rep, "dsp", "node", "ENOENT")
    assert status == 1 and "not found" in row["measured"]


def test_keep_going_runs_what_does_not_depend_on_the_failure_and_skips_the_rest(sims, capsys,
                                                                                 monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_BRINGUP", "kgsl.open=EPERM,usb.device=absent")
    status, rep = run(capsys, "--device", "all", "--keep-going")
    by = {r["stage"]: r for r in rep["stages"]}
    assert status == 1 and by["qcom.open"]["status"] == "fail"
    assert by["amd.usb"]["status"] == "fail"  # --keep-going went on to the next devices
    assert all(by[f"qcom.{s}"]["status"] == "skip" for s in STAGES["qcom"][1:])
    assert by["qcom.nop"]["measured"] == "not run: qcom.context did not pass"


@needs_clang
@needs_tool("qemu-user", "qemu-hexagon")
def test_keep_going_runs_the_stages_whose_prerequisites_passed(sims, capsys, monkeypatch):
    """A refused PD: the shared memory still checks out, the invoke (which needs the session) is
    skipped, and the model stages, which open sessions of their own, are refused too."""
    monkeypatch.setenv("KEEL_MOCK_BRINGUP", "fastrpc.pd=EACCES")
    status, rep = run(capsys, "--device", "dsp", "--keep-going")
    by = {r["stage"]: r["status"] for r in rep["stages"]}
    assert status == 1 and rep["failed_stage"] == "dsp.session"
    assert by == {"dsp.node": "pass", "dsp.memory": "pass", "dsp.session": "fail",
                  "dsp.invoke": "skip", "dsp.known_answer": "fail", "dsp.model": "fail"}


def test_a_stage_that_never_returns_fails_at_its_deadline():
    """The doctor's own guarantee: a call that blocks forever is a failed stage, on time."""
    import threading
    stage = doctor.Stage("x.block", "returns", lambda p: p.call("block", threading.Event().wait),
                         {"TIMEOUT": "look"}, deadline_s=0.2)
    row = doctor.run_stage(stage, {})
    assert row["status"] == "fail" and row["code"] == "TIMEOUT" and row["call"] == "block"
    assert row["hung"] and 0.2 <= row["seconds"] < 1.0 and row["next"] == "look"


def test_a_misspelt_fault_site_is_refused(sims, capsys, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_BRINGUP", "kgsl.opne=EPERM")
    status, rep = run(capsys, "--device", "qcom")
    row = _check_named(rep, "qcom", "open", "ConfigError")
    assert status == 1 and "kgsl.opne" in row["measured"]


def test_device_tests_are_skipped_with_the_doctors_reason(sims, monkeypatch):
    """tests/device/conftest.py's gate: the first failing stage before the model stage, with its
    call, status and next step, is the skip reason; a device whose earlier stages pass runs."""
    monkeypatch.setenv("KEEL_MOCK_BRINGUP", "kgsl.chip=0x06040001")
    reason = doctor.verdict("qcom")
    assert reason.startswith("doctor: qcom.properties failed") and "0x06040001" in reason
    assert "use device 'opencl'" in reason
    monkeypatch.setenv("KEEL_MOCK_BRINGUP", "gpu.answer=wrong")
    assert doctor.verdict("qcom").startswith("doctor: qcom.dispatch failed (Model.run: wrong")
    monkeypatch.delenv("KEEL_MOCK_BRINGUP")
    assert doctor.verdict("qcom") is None


def test_the_hardware_gate_names_the_missing_device_node(monkeypatch):
    """On a machine without an Adreno (every CI machine) the gate, which unsets KEEL_KGSL, stops
    at qcom.open with ENOENT."""
    import os

    from tests.device import conftest
    if os.path.exists("/dev/kgsl-3d0"):
        pytest.skip("this machine has a KGSL device: the gate would run the real doctor")
    monkeypatch.setenv("KEEL_KGSL", "mock")  # the gate must not use it
    monkeypatch.setattr(conftest, "_verdicts", {})
    with pytest.raises(pytest.skip.Exception, match=r"doctor: qcom.open failed \(open\(/dev/"
                       r"kgsl-3d0\): ENOENT\).*kgsl driver"):
        conftest.doctor_gate("qcom")


def test_amd_usb_reports_the_bridge_firmware_version(sims, capsys, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_BRINGUP", "usb.link=down")  # stop at the stage after amd.usb
    status, rep = run(capsys, "--device", "amd")
    row = {r["stage"]: r for r in rep["stages"]}["amd.usb"]
    assert status == 1 and row["status"] == "pass", row
    assert "firmware 261126_EE_00_01" in row["measured"]  # sim/usb/mock.py's MOCK_FW_VERSION
    assert rep["properties"]["amd"]["bridge_firmware"] == "261126_EE_00_01"
