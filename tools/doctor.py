"""First contact with hardware: bring each device up layer by layer and name the step that fails.

    python tools/doctor.py [--device qcom|dsp|amd|all] [--json] [--bundle OUT.tar.gz]
                           [--keep-going]

Each device is a list of ordered stages (docs/doctor.md lists them). A stage is one small check
on one layer of the driver (qcom/kgsl.py, dsp/fastrpc.py, usbgpu/pci.py, am/driver.py, ...); it
prints what it expected, what it measured and how long it took. A failure names the stage, the
call, its errno or status, the expectation and what to check next. Every stage runs on a worker
thread with its own deadline, so a call that never returns is a failed stage, not a hung doctor
(and the rest of that device is skipped: its state is no longer trusted). The doctor stops at the
first failure unless --keep-going, which goes on with every stage whose prerequisites passed.
Exit status: 0 every stage passed, 1 a stage failed, 2 bad usage.

The simulators are chosen as everywhere else: KEEL_KGSL=mock, KEEL_FASTRPC=mock, KEEL_USB=mock.
Their bring-up faults (KEEL_MOCK_BRINGUP, runner/faults.py) and run-time faults (KEEL_MOCK_FAULTS)
are what tests/test_doctor.py injects to show each stage catching its own fault.
"""
from __future__ import annotations

import errno
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.cli import Parser  # noqa: E402
from tools.doctor_stages import Failure, Probe, Stage, source_hash, stages  # noqa: E402

DEVICES = ("qcom", "dsp", "amd")
SIM_VARS = {"qcom": "KEEL_KGSL", "dsp": "KEEL_FASTRPC", "amd": "KEEL_USB"}
DMESG = re.compile(r"(?<![a-z0-9])(kgsl|adreno|adsprpc|fastrpc|cdsp|smmu|ion|usb|uas|asm2[34]"
                   r"\w*|amdgpu|pcie\w*|avc)(?![a-z])", re.I)  # the kernel's lines about them
ERRNO = re.compile(r"\b(E[A-Z0-9]{2,})\b|errno (\d+)")  # kgsl.py's and fastrpc.py's spellings


# ---- running stages ---------------------------------------------------------------------------

def run_stage(stage: Stage, state: dict) -> dict:
    probe, box = Probe(state), {}

    def body():
        try:
            box["measured"] = stage.run(probe)
        except BaseException as e:  # noqa: BLE001 - every failure becomes the stage's verdict
            box["error"] = e

    worker = threading.Thread(target=body, daemon=True, name=f"doctor-{stage.name}")
    start = time.monotonic()
    worker.start()
    worker.join(stage.deadline_s)
    seconds = time.monotonic() - start
    row = {"stage": stage.name, "expected": stage.expect, "seconds": round(seconds, 6)}
    if worker.is_alive():
        return {**row, "status": "fail", "hung": True, "call": probe.current, "code": "TIMEOUT",
                "measured": f"no answer within the stage's {stage.deadline_s:g} s deadline",
                "next": _next(stage, "TIMEOUT", "")}
    if "error" not in box:
        return {**row, "status": "pass", "measured": str(box["measured"])}
    e = box["error"]
    code = e.status if isinstance(e, Failure) else _code(e)
    text = f"{type(e).__name__}: {e}" if not isinstance(e, Failure) else str(e)
    hint = e.next_step if isinstance(e, Failure) and e.next_step else _next(stage, code, text)
    out = {**row, "status": "fail", "call": probe.current, "code": code, "measured": text,
           "next": hint}
    if not isinstance(e, (Failure, OSError)) and type(e).__module__ == "builtins":
        out["traceback"] = "".join(traceback.format_exception(e))[-2000:]  # a doctor's own bug
    return out


def _code(e: BaseException) -> str:
    """The errno name (of an OSError, or the one a driver's DeviceError names), else the error's
    type (DeviceTimeout, ConfigError, ...)."""
    from runner.errors import DeviceError
    if isinstance(e, OSError) and e.errno:
        return errno.errorcode.get(e.errno, str(e.errno))
    m = ERRNO.search(str(e)) if isinstance(e, DeviceError) else None
    if m is None:
        return type(e).__name__
    return m.group(1) or errno.errorcode.get(int(m.group(2)), m.group(2))


def _next(stage: Stage, code: str, text: str) -> str:
    for key, hint in stage.next.items():
        if key and (key == code or key in text):
            return hint
    return stage.next.get("", "see docs/doctor.md for this stage")


def run_device(device: str, keep_going: bool, say, last: bool = True) -> tuple[list[dict], dict]:
    """The device's stage rows (without its last stage unless `last`), and the state they left:
    its properties and blob hashes."""
    stages_ = stages(device)[:None if last else -1]
    state = {"close": [], "properties": {}, "blobs": {}}
    rows, passed = [], set()
    try:
        for i, stage in enumerate(stages_):
            needs = stage.needs or tuple(s.name for s in stages_[:i])
            missing = [n for n in needs if n not in passed]
            if missing:
                row = {"stage": stage.name, "expected": stage.expect, "status": "skip",
                       "measured": f"not run: {missing[0]} did not pass", "seconds": 0.0}
            else:
                row = run_stage(stage, state)
            rows.append(row)
            say(row)
            if row["status"] == "pass":
                passed.add(stage.name)
            elif row.get("hung") or (row["status"] == "fail" and not keep_going):
                break
    finally:
        _close(state)
    return rows, state


def _close(state: dict) -> None:
    """Release what the stages opened, newest first, each bounded (a hung device cannot hold the
    doctor at exit)."""
    for fn in reversed(state["close"]):
        t = threading.Thread(target=lambda f=fn: _quiet(f), daemon=True)
        t.start()
        t.join(5.0)


def _quiet(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - closing a device that failed: nothing more to learn
        pass


def verdict(device: str) -> str | None:
    """Why `device`'s model tests cannot mean anything here: the doctor's first failing stage
    before the last one (the biggest model, which the model tests themselves run), with its
    call, status and next step; None when every earlier stage passed."""
    rows = run_device(device, keep_going=False, say=lambda row: None, last=False)[0]
    bad = next((r for r in rows if r["status"] == "fail"), None)
    if bad is None:
        return None
    return (f"doctor: {bad['stage']} failed ({bad.get('call') or '-'}: {bad.get('code')}): "
            f"{bad['measured']}; next: {bad.get('next')}")



def keel_version() -> str:
    m = re.search(r"^version\s*=\s*(\S+)", (ROOT / "setup.cfg").read_text(), re.M)
    commit = _run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"])
    return f"{m.group(1) if m else '?'} ({commit.strip() or 'no git'})"


def _run(argv: list[str], timeout: float = 5.0) -> str:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return p.stdout if p.returncode == 0 else f"{argv[0]}: exit {p.returncode}: " \
            f"{p.stderr.strip()[:300]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{argv[0]}: {e}"


def report(rows: list[dict], devices: list[str], properties: dict, blobs: dict) -> dict:
    failed = next((r for r in rows if r["status"] == "fail"), None)
    return {"ok": failed is None and bool(rows), "failed_stage": failed and failed["stage"],
            "devices": devices, "stages": rows,
            "simulators": {d: os.environ.get(v, "") for d, v in SIM_VARS.items()},
            "keel": {"version": keel_version(), "source_sha256": source_hash()},
            "host": {"platform": platform.platform(), "machine": platform.machine(),
                     "python": platform.python_version()},
            "properties": properties, "blobs": blobs}


def bundle(path: Path, rep: dict) -> None:
    """What a tester far away sends back: the report, the OS, the kernel's log lines about the
    devices, the device properties, keel's version and source hash, the blobs' hashes."""
    import io
    dmesg = _run(["dmesg"])
    files = {
        "report.json": json.dumps(rep, indent=1),
        "os.txt": "\n".join([f"uname: {' '.join(platform.uname())}",
                             _read("/proc/version"), _read("/etc/os-release"),
                             f"python {sys.version}"]),
        "dmesg.txt": "\n".join(ln for ln in dmesg.splitlines() if DMESG.search(ln))
                     or f"no line of dmesg names kgsl, adsprpc, usb, amdgpu, ...: {dmesg[:300]}",
        "properties.json": json.dumps(rep["properties"], indent=1),
        "keel.json": json.dumps({**rep["keel"], "blobs": rep["blobs"],
                                 "env": {k: v for k, v in os.environ.items()
                                         if k.startswith("KEEL_")}}, indent=1),
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"keel-doctor/{name}")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        return f"{path}: {e.strerror}"


def show(row: dict) -> None:
    mark = {"pass": "pass", "fail": "FAIL", "skip": "skip"}[row["status"]]
    print(f"[{mark}] {row['stage']:<22} {row['seconds']:8.3f} s  expected: {row['expected']}")
    print(f"       {'':<22} {'':10}  measured: {row['measured']}")
    if row["status"] == "fail":
        print(f"       {'':<22} {'':10}  call: {row['call'] or '-'}  status: {row['code']}")
        print(f"       {'':<22} {'':10}  next: {row['next']}")
    sys.stdout.flush()


def main(argv=None) -> int:
    p = Parser(prog="doctor.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=[*DEVICES, "all"], default="all")
    p.add_argument("--json", action="store_true", help="print the report as JSON only")
    p.add_argument("--bundle", type=Path, metavar="OUT.tar.gz",
                   help="write the report and diagnostics into a tarball")
    p.add_argument("--keep-going", action="store_true",
                   help="run every stage whose prerequisites passed, not just up to a failure")
    args = p.parse_args(argv)
    devices = list(DEVICES) if args.device == "all" else [args.device]
    rows: list[dict] = []
    properties, blobs = {}, {}
    for d in devices:
        if not args.json:
            sim = os.environ.get(SIM_VARS[d], "")
            print(f"== {d} ({f'{SIM_VARS[d]}={sim}' if sim else 'hardware'})")
        got, state = run_device(d, args.keep_going, (lambda r: None) if args.json else show)
        rows += got
        properties[d] = state["properties"]
        blobs.update(state["blobs"])
        if any(r["status"] == "fail" for r in rows) and not args.keep_going:
            break
    rep = report(rows, devices, properties, blobs)
    if args.bundle:
        bundle(args.bundle, rep)
    if args.json:
        print(json.dumps(rep, indent=1))
    else:
        last = rep["failed_stage"]
        print(f"doctor: {'every stage passed' if rep['ok'] else f'failed at {last}'}"
              f"{f'; bundle {args.bundle}' if args.bundle else ''}")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
