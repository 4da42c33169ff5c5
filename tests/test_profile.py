"""tools/profile.py and the device timing hook (runner/device.py: profile, spans) on the light
net (tests/light_net.py, one cached compile per target): every launch timed on every backend,
the table's accounting, and a trace that Perfetto's JSON importer accepts. Timing *values* are
never asserted (docs/perf.md has them); what is asserted holds on any machine: structure,
ordering on one thread, and that the parts add up to the measured latency by construction."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner import DeviceError
from runner.device import Device
from tests.deps import needs, needs_tool, opencl_missing
from tests.graphs import compiled_blob
from tests.light_net import light_net
from tools import profile

TOOL = str(Path(__file__).resolve().parent.parent / "tools" / "profile.py")
KEYS = ("ph", "ts", "dur", "name", "pid", "tid")


@pytest.fixture(scope="module")
def cpu_blob():
    return str(compiled_blob(light_net()))


@pytest.fixture
def threads(monkeypatch):
    def set_threads(n: int):
        monkeypatch.setenv("KEEL_THREADS", str(n))
    return set_threads


def check_spans(prof: dict, lanes: set[int]) -> None:
    n = len(prof["blob"].launches)
    for _, latency, spans in prof["samples"]:
        assert sorted((s.lane, s.launch) for s in spans) == \
            sorted((lane, i) for lane in lanes for i in range(n))
        assert all(s.start_ns <= s.end_ns for s in spans)
        assert max(s.end_ns for s in spans) - min(s.start_ns for s in spans) <= latency


def test_one_cpu_thread_times_every_launch_back_to_back(cpu_blob, threads):
    threads(1)
    prof = profile.profile(cpu_blob, "cpu", runs=3, warmup=1)
    check_spans(prof, {0})
    for _, _, spans in prof["samples"]:  # in launch order, never overlapping
        assert all(a.end_ns <= b.start_ns for a, b in zip(spans, spans[1:]))
    s = profile.summarize(prof)
    assert [r["ns"] for r in s["launches"]] == sorted((r["ns"] for r in s["launches"]),
                                                      reverse=True)
    assert s["kernels_ns"] + s["gaps_ns"] + s["host_overhead_ns"] == pytest.approx(s["latency_ns"])
    assert s["unaccounted_ns"] == pytest.approx(s["latency_ns"] - s["kernels_ns"])
    convs = [r for r in s["launches"] if "Conv" in r["ops"]]
    assert convs and all(r["gflops"] > 0 and r["gbps"] > 0 for r in convs)


def test_every_cpu_thread_times_its_share_of_every_launch(cpu_blob, threads):
    threads(2)
    check_spans(profile.profile(cpu_blob, "cpu", runs=2, warmup=1), {0, 1})


def test_the_mock_queue_times_its_replay(cpu_blob):
    check_spans(profile.profile(cpu_blob, "mock", runs=2, warmup=1), {0})


@needs("pocl-opencl-icd", opencl_missing())
@pytest.mark.parametrize("device", ["qcom", pytest.param("amd", marks=needs_tool("lld-19",
                                                                                "ld.lld-19"))])
def test_gpu_streams_time_every_launch_with_the_counter_they_write(device, monkeypatch,
                                                                   tmp_path):
    """qcom (the mock KGSL) and amd (the mock enclosure): the profiled stream writes the GPU's
    counter around each launch (runner/queue.py turns the stamps into spans), back to back."""
    from am import firmware
    from sim.am import standin
    from sim.am.mock_device import IPS
    from sim.usb.mock import MockLibusb
    monkeypatch.setenv("KEEL_KGSL", "mock")
    monkeypatch.setenv("KEEL_USB", "mock")
    standin.write_all(tmp_path, {(ip.hw_id, ip.instance): ip for ip in IPS})  # keel ships none
    monkeypatch.setenv(firmware.ENV, str(tmp_path))
    MockLibusb.forget()
    prof = profile.profile(str(compiled_blob(light_net(), target=device)), device, runs=2,
                           warmup=1)
    MockLibusb.forget()
    check_spans(prof, {0})
    for _, _, spans in prof["samples"]:
        assert all(a.end_ns <= b.start_ns for a, b in zip(spans, spans[1:]))


@needs("pocl-opencl-icd", opencl_missing())
def test_opencl_event_profiling_times_every_launch():
    path = str(compiled_blob(light_net(), target="opencl"))
    check_spans(profile.profile(path, "opencl", runs=2, warmup=1), {0})


def test_a_device_without_timestamps_says_so():
    class Plain(Device):
        name = "plain"
    with pytest.raises(DeviceError, match="'plain' has no per-launch timestamps"):
        Plain().profile(True)


def test_cli_prints_the_table_and_writes_a_trace_perfetto_accepts(cpu_blob, tmp_path):
    out = tmp_path / "trace.json"
    env = {**os.environ, "KEEL_THREADS": "2"}
    proc = subprocess.run([sys.executable, TOOL, cpu_blob, "--runs", "2", "--trace", str(out)],
                          capture_output=True, text=True, env=env, check=True)
    assert "unaccounted" in proc.stdout and "Conv+BatchNormalization+Sigmoid+Mul" in proc.stdout
    events = json.loads(out.read_text())["traceEvents"]
    assert all(all(k in e for k in KEYS) for e in events)
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in events)
    slices = [e for e in events if e["ph"] == "X"]
    n_launch = len(json.loads(subprocess.run(
        [sys.executable, TOOL.replace("profile.py", "blobinfo.py"), cpu_blob, "--json"],
        capture_output=True, text=True, check=True).stdout)["launches"])
    # per run: one slice per launch per thread, plus run() and its host overhead
    assert len(slices) == 2 * (2 * n_launch + 2)
    assert sum(e["name"] == "host overhead" for e in slices) == 2
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"host", "cpu thread 0", "cpu thread 1"} <= names


@pytest.mark.slow
def test_openpilot_shaped_blob_prints_the_table_and_one_slice_per_launch(tmp_path):
    """The issue's bar, on the whole model; its blob is test_end_to_end's (same cache key)."""
    from models.openpilot import make_openpilot
    path = str(compiled_blob(make_openpilot(float16=False), float16=False))
    out = tmp_path / "op.json"
    proc = subprocess.run([sys.executable, TOOL, path, "--runs", "1", "--trace", str(out)],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "KEEL_THREADS": "1"})
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("device cpu") and "unaccounted" in lines[1]
    n_launch = len(lines) - 3  # two summary lines and the header, then one row per launch
    assert n_launch > 300 and "Conv+BatchNormalization+Sigmoid+Mul" in proc.stdout
    events = json.loads(out.read_text())["traceEvents"]
    assert all(all(k in e for k in KEYS) for e in events)
    kernels = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert len(kernels) == n_launch
