"""The soak harness catches what it claims to: on the mock device with the openpilot toy (the CI
version of tests/device/test_soak.py's hours-long run; about 15 s on 2 cores).

- KEEL_MOCK_FAULTS=hang@500: exactly one timeout, a recovery, every canary after it bit-exact.
- A leak and a latency drift injected through Soak's test hook (inside the timed run, like a
  runtime that leaked or slowed) turn the verdict to FAIL with the reason. Nothing is loosened:
  the bounds are the tool's defaults.
- The CLI: --json's keys, the JSONL log, the PNG, --serial on a pseudo-terminal, and a clear error
  without pyserial.
"""
import io
import json
import mmap
import os
import pty
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest

from models.openpilot import make_toy
from runner import Model
from tests.deps import needs, opencl_missing
from tests.graphs import compiled_blob
from tools.plot import COLORS
from tools.soak import BINS, Soak, drift, growth, percentile, reasons

ENV = {**os.environ, "PYTHONPATH": os.getcwd()}


@pytest.fixture(scope="module")
def blob():
    return str(compiled_blob(make_toy()))


def _events(log: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in log.getvalue().splitlines()]


def test_hang_at_500_one_timeout_recovered_canaries_match(blob, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "hang@500")
    log = io.StringIO()
    soak = Soak(Model.load(blob, device="mock"), runs=1000, canary_every=50, sample_s=0.05,
                timeout_ms=200, allow_faults=1, log=log)
    s = soak.run()
    assert (s["runs"], s["timeouts"], s["device_errors"], s["recovered"]) == (1000, 1, 0, 1)
    events = _events(log)
    assert [e["run"] for e in events if e["event"] == "timeout"] == [500]
    assert [e["run"] for e in events if e["event"] == "recovered"] == [501]
    after = [e for e in events if e["event"] == "canary" and e["run"] > 500]
    # 501 (straight after the fault), 550, ..., 950, and the last run
    assert [e["run"] for e in after] == [501] + list(range(550, 1000, 50)) + [1000]
    assert all(e["match"] for e in after) and s["canary_mismatches"] == 0
    # Windows of 100 sub-millisecond runs last a few ms: one preemption on a shared CI machine
    # decides their p99, so drift is judged on real soaks, not here. Everything else is clean.
    assert not [r for r in s["reasons"] if "drifted" not in r], s["reasons"]
    assert s["rss_growth_bytes"] < 1 << 20 and s["fd_growth"] == 0 and s["thread_growth"] == 0
    assert "1 timeout and 0 device errors (--allow-faults 0)" in \
        reasons(s, 4 << 20, allow_faults=0)


def test_injected_leak_fails_with_the_reason(blob):
    kept = []
    leak = 64 << 10

    def hook(i):
        # fresh pages from mmap, touched so they are resident: a heap allocation could reuse
        # pages an earlier test in this worker freed but kept resident, and RSS would not move
        m = mmap.mmap(-1, leak)
        m.write(b"\1" * leak)
        kept.append(m)

    soak = Soak(Model.load(blob, device="mock"), runs=1500, sample_s=0.01, hook=hook)
    s = soak.run()
    assert s["verdict"] == "FAIL"
    assert any(r.startswith("RSS grew") for r in s["reasons"]), s["reasons"]
    # the fitted trend spans the samples after warm-up: most of the 1500 leaks, not more
    assert 0.5 * 1500 * leak < s["rss_growth_bytes"] < 1.2 * 1500 * leak


def test_injected_drift_fails_with_the_reason(blob):
    runs = 300

    def hook(i):  # steady over the first half, then slower run by run, to +60 ms at the end:
        time.sleep(0.06 * max(0, 2 * i / runs - 1))  # far beyond a loaded machine's p99 noise

    s = Soak(Model.load(blob, device="mock"), runs=runs, hook=hook).run()
    assert s["verdict"] == "FAIL", s["drift"]
    assert any(r.startswith("latency p99 drifted") for r in s["reasons"]), s["reasons"]
    d = s["drift"]
    assert d["last_p99_ms"] > 50 and d["first_p99_ms"] < d["limit_ms"] < 40, d


def _png(path) -> np.ndarray:
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    pos, idat = 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()  # filter type 0 on every row
    return rows[:, 1:].reshape(h, w, 3)


def test_cli_json_log_plot_and_serial(blob, tmp_path):
    master, slave = pty.openpty()
    port = os.ttyname(slave)
    stop = threading.Event()

    def console():  # the device's kernel log, a line every 20 ms
        while not stop.wait(0.02):
            os.write(master, b"[ 12.345] kgsl kgsl-3d0: GPU fault, ring hang detected\r\n")

    writer = threading.Thread(target=console, daemon=True)
    writer.start()
    log, png = tmp_path / "s.jsonl", tmp_path / "s.png"
    try:
        res = subprocess.run([sys.executable, "tools/soak.py", blob, "--device", "mock",
                              "--runs", "6000", "--windows", "3", "--sample-s", "0.05",
                              "--serial", port, "--log", str(log), "--plot", str(png), "--json"],
                             capture_output=True, text=True, env=ENV, timeout=120)
    finally:
        stop.set()
        writer.join()
        os.close(master)
        os.close(slave)
    assert res.returncode == 0, res.stdout + res.stderr
    s = json.loads(res.stdout)
    assert {"runs", "timeouts", "device_errors", "canary_mismatches", "rss_growth_bytes",
            "fd_growth", "p50_ms", "p99_ms", "verdict"} <= s.keys()
    assert s["verdict"] == "OK" and s["runs"] == 6000
    assert s["drift"] == {"checked": False, "reason": "3 latency windows; drift needs 4"}
    assert s["serial_lines"] >= 1 and s["serial_alerts"] == s["serial_lines"]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[0]["event"] == "start" and events[-1]["event"] == "summary"
    assert any(e["event"] == "serial" and "GPU fault" in e["line"] for e in events)
    img = _png(png)
    assert img.shape[1] == 720
    if s["plot_renderer"] == "numpy":  # the series are drawn in their colors
        assert (img == COLORS[0]).all(axis=2).sum() > 100


def test_serial_without_pyserial_is_a_clear_error(blob, tmp_path):
    code = ("import sys, runpy; sys.modules['serial'] = None; "
            f"sys.argv = ['soak.py', {blob!r}, '--device', 'mock', '--runs', '5', "
            f"'--serial', '/dev/null', '--log', {str(tmp_path / 'l.jsonl')!r}]; "
            "runpy.run_path('tools/soak.py', run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV,
                         timeout=60)
    assert res.returncode == 2 and "--serial needs pyserial (pip install pyserial)" in res.stderr


def test_statistics_the_verdict_rests_on():
    rng = np.random.default_rng(0)
    ms = rng.lognormal(1, 0.5, 20000)
    hist = np.zeros(len(BINS) + 1, np.int64)
    np.add.at(hist, np.searchsorted(BINS, ms), 1)
    for q in (50, 99):  # bins are 1% wide: the upper edge is within 1% above the true value
        assert np.percentile(ms, q) <= percentile(hist, q) <= 1.01 * np.percentile(ms, q)
    t = np.linspace(0, 100, 200)
    y = 5 * t + rng.normal(0, 20, t.size)
    y[150] += 1e6  # one wild sample moves a robust fit by nothing much
    assert 450 < growth(t, y) < 550
    assert growth(t, np.full(t.size, 7.0)) == 0
    steady = [{"p99_ms": 10 + x} for x in rng.normal(0, 0.3, 10)]
    assert drift(steady)["checked"] and not drift(steady)["drifted"]
    ramp = [{"p99_ms": 10 + 0.25 * k + x} for k, x in enumerate(rng.normal(0, 0.05, 10))]
    assert drift(ramp)["drifted"]  # +22% over the run, noise 0.05 ms


@needs("pocl-opencl-icd", opencl_missing())
def test_soak_runs_on_opencl():
    """Every device: the same harness on OpenCL (PoCL here), canaries bit-exact run after run."""
    m = Model.load(str(compiled_blob(make_toy(), target="opencl")), device="opencl")
    s = Soak(m, runs=200, canary_every=20, sample_s=0.05).run()
    assert (s["runs"], s["canaries"], s["canary_mismatches"]) == (200, 11, 0)
    assert s["timeouts"] == s["device_errors"] == 0 and s["fd_growth"] == 0
