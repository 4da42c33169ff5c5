"""The hours-long soak on a comma device: openpilot's model, modeld's way, for KEEL_SOAK_HOURS.

On the comma 3X, with a blob of the openpilot model compiled for it (cpu-aarch64, or qcom for the
GPU once its backend lands) and the serial console on the debug board's UART:

    python -m models.openpilot -o op.onnx
    python tools/compile.py op.onnx -o op.blob --target cpu-aarch64
    KEEL_SOAK_BLOB=op.blob KEEL_SOAK_HOURS=4 KEEL_SOAK_SERIAL=/dev/ttyUSB0 \\
        python -m pytest -q -s tests/device/test_soak.py

The same harness runs in CI for ~15 s on the mock device (tests/test_soak.py). Skipped elsewhere:
hours of a real device's clocks, memory and kernel are what this run is for.
"""
import json
import os
import platform
import subprocess
import sys

import pytest

from qcom import kgsl
from tests.deps import needs_hardware

BLOB = os.environ.get("KEEL_SOAK_BLOB")
pytestmark = [
    needs_hardware("a comma device", None if os.path.exists(kgsl.DEVICE_PATH) and
                   platform.machine() == "aarch64" else f"{kgsl.DEVICE_PATH} absent or not aarch64"),
    pytest.mark.skipif(not BLOB, reason="KEEL_SOAK_BLOB unset: name the openpilot blob to soak"),
    pytest.mark.timeout(0),  # hours by design: subprocess.run's timeout bounds it instead
]


def test_soak_holds_for_hours(tmp_path):
    hours = os.environ.get("KEEL_SOAK_HOURS", "4")
    cmd = [sys.executable, "tools/soak.py", BLOB, "--hours", hours, "--json",
           "--log", str(tmp_path / "soak.jsonl"), "--plot", str(tmp_path / "soak.png")]
    if os.environ.get("KEEL_SOAK_DEVICE"):
        cmd += ["--device", os.environ["KEEL_SOAK_DEVICE"]]
    if os.environ.get("KEEL_SOAK_SERIAL"):
        cmd += ["--serial", os.environ["KEEL_SOAK_SERIAL"]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=float(hours) * 3600 + 600,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    print(res.stdout, res.stderr, f"log and plot in {tmp_path}", sep="\n")
    s = json.loads(res.stdout)
    assert res.returncode == 0 and s["verdict"] == "OK", s["reasons"]
    assert s["timeouts"] == s["device_errors"] == s["canary_mismatches"] == 0
