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
import hashlib
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.cli import Parser  # noqa: E402

DEVICES = ("qcom", "dsp", "amd")
SIM_VARS = {"qcom": "KEEL_KGSL", "dsp": "KEEL_FASTRPC", "amd": "KEEL_USB"}
SOURCES = ("runner", "qcom", "dsp", "am", "usbgpu", "compiler", "tools")
DMESG = re.compile(r"(?<![a-z0-9])(kgsl|adreno|adsprpc|fastrpc|cdsp|smmu|ion|usb|uas|asm2[34]"
                   r"\w*|amdgpu|pcie\w*|avc)(?![a-z])", re.I)  # the kernel's lines about them
ERRNO = re.compile(r"\b(E[A-Z0-9]{2,})\b|errno (\d+)")  # kgsl.py's and fastrpc.py's spellings


class Failure(Exception):
    """A stage's own verdict: what it got instead, with its status and the next thing to check."""

    def __init__(self, got: str, status: str = "wrong", next_step: str = ""):
        super().__init__(got)
        self.status, self.next_step = status, next_step


@dataclass(frozen=True)
class Stage:
    name: str  # "<device>.<step>"
    expect: str
    run: Callable  # (Probe) -> what it measured (str)
    next: dict = field(default_factory=dict)  # status or message word -> next step; "" default
    deadline_s: float = 10.0
    needs: tuple = ()  # earlier stages of the device that must have passed (default: all)


class Probe:
    """What a stage sees: the device's shared state, and `call` to name the call it is in."""

    def __init__(self, state: dict):
        self.state, self.current = state, ""

    def call(self, name: str, fn, *args, **kwargs):
        self.current = name
        return fn(*args, **kwargs)


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


# ---- blobs the stages run -------------------------------------------------------------------

def blob(state: dict, name: str, make, target: str, **options) -> Path:
    """`make()`'s ONNX model compiled for `target`, cached under KEEL_CACHE_DIR/doctor by a hash
    of the model, target and options, and rebuilt when keel's sources changed; its hash is kept
    for the report."""
    import onnx  # noqa: F401  the compiler's dependency, needed only by stages that compile

    from compiler.blob import write_blob
    from compiler.pipeline import compile_model
    model = make()
    key = hashlib.sha256(model.SerializeToString() + repr((target, sorted(options.items())))
                         .encode()).hexdigest()
    folder = Path(os.environ.get("KEEL_CACHE_DIR") or Path.home() / ".cache" / "keel") / "doctor"
    path, sources = folder / f"{name}-{target}-{key[:16]}.blob", source_hash()
    stamp = path.with_suffix(".sources")  # one blob per model and target, rebuilt after edits
    if not path.exists() or not stamp.exists() or stamp.read_text() != sources:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        write_blob(compile_model(model, target=target, **options), tmp)
        os.replace(tmp, path)
        stamp.write_text(sources)
    state["blobs"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return path


def compare(got, want, rtol: float, atol: float, what: str) -> str:
    import numpy as np
    err = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) if got.size \
        else 0.0
    bound = atol + rtol * float(np.max(np.abs(want))) if want.size else atol
    if got.shape != want.shape or not err <= bound:
        raise Failure(f"{what}: max abs error {err:.3g} against the CPU build, bound {bound:.3g} "
                      f"(shape {got.shape}, expected {want.shape})", "wrong answer")
    return f"max abs error {err:.3g} (bound {bound:.3g})"


def against_cpu(p, name: str, make, target: str, device: str, rtol: float, atol: float,
                runs: int = 100, budget_s: float | None = None, **options) -> str:
    """A model on `device` against its CPU build, then its latency over `runs` runs (a fixed
    count: the simulators' faults are counted in submissions), or as many as fit in `budget_s`
    (one at least)."""
    import numpy as np

    from runner import Model
    state = p.state
    model, old = make(), state.pop("model", None)
    if old is not None:  # one model on the device at a time (the amd enclosure has one GPU)
        old.close()
    feeds = _feeds(model)
    want = Model.load(p.call("compile (CPU build)", blob, state, name, make, "cpu"),
                      device="cpu").run(feeds)
    path = p.call(f"compile ({target})", blob, state, name, make, target, **options)
    m = p.call(f"Model.load(device={device!r})", Model.load, path, device=device)
    state["close"].append(m.close)
    got = p.call("Model.run", m.run, feeds, timeout_ms=60_000)
    errs = [compare(got[k], want[k], rtol, atol, k) for k in want]
    times, end = [], time.monotonic() + (budget_s or float("inf"))
    while len(times) < runs and (not times or time.monotonic() < end):
        t = time.perf_counter()
        m.run(feeds, timeout_ms=60_000)
        times.append(time.perf_counter() - t)
    p99 = f", p99 {np.percentile(times, 99) * 1e3:.3f} ms" if len(times) >= 100 else ""
    return (f"{'; '.join(errs)}; latency median {np.median(times) * 1e3:.3f} ms{p99}, "
            f"max {max(times) * 1e3:.3f} ms over {len(times)} run{'s' * (len(times) > 1)}")


def _feeds(model) -> dict:
    import numpy as np
    from onnx import helper
    rng, out = np.random.default_rng(1), {}
    for v in model.graph.input:
        t = v.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        out[v.name] = (rng.integers(-100, 100, shape) if dtype.kind == "i" else
                       rng.standard_normal(shape)).astype(dtype)
    return out


def _model(nodes, inputs, outputs, inits=None, opset: int = 17):
    import numpy as np
    from onnx import helper, numpy_helper
    vi = lambda n, s, d: helper.make_tensor_value_info(  # noqa: E731
        n, helper.np_dtype_to_tensor_dtype(np.dtype(d)), s)
    graph = helper.make_graph(nodes, "doctor", [vi(*i) for i in inputs],
                              [vi(*o) for o in outputs],
                              [numpy_helper.from_array(a, n) for n, a in (inits or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def relu_mul():
    """y = relu(x) * x: one kernel, exact in fp32 and fp16, so its answer is known."""
    from onnx import helper
    return _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "x"],
                                                                            ["y"])],
                  [("x", (4, 64), "float32")], [("y", (4, 64), "float32")])


def small_net():
    """Conv (stride 2, padded) -> Relu -> Flatten -> Gemm -> Softmax: a float network in small,
    three kernels or more on every GPU target."""
    import numpy as np
    from onnx import helper
    rng = np.random.default_rng(0)
    return _model([helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1],
                                    strides=[2, 2]),
                   helper.make_node("Relu", ["c"], ["r"]),
                   helper.make_node("Flatten", ["r"], ["f"]),
                   helper.make_node("Gemm", ["f", "w2"], ["g"], transB=1),
                   helper.make_node("Softmax", ["g"], ["y"])],
                  [("x", (1, 3, 16, 16), "float32")], [("y", (1, 10), "float32")],
                  {"w1": rng.standard_normal((16, 3, 3, 3)).astype(np.float32) * 0.3,
                   "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
                   "w2": rng.standard_normal((10, 16 * 8 * 8)).astype(np.float32) * 0.05})


def two_matmuls():
    """MatMul -> Relu -> MatMul: on qcom its weights, and the intermediate one kernel writes and
    the next reads, are images."""
    import numpy as np
    from onnx import helper
    rng = np.random.default_rng(3)
    return _model([helper.make_node("MatMul", ["x", "w1"], ["h"]),
                   helper.make_node("Relu", ["h"], ["r"]),
                   helper.make_node("MatMul", ["r", "w2"], ["y"])],
                  [("x", (1, 64), "float32")], [("y", (1, 16), "float32")],
                  {"w1": rng.standard_normal((64, 256)).astype(np.float32) * 0.1,
                   "w2": rng.standard_normal((256, 16)).astype(np.float32) * 0.1})


def openpilot():
    from models.openpilot import make_openpilot
    return make_openpilot(float16=True)


def int8_fma(n: int = 4096):
    """max(a * b + c, a) on int8: wrapping int8 arithmetic, one HVX vector per 128 lanes."""
    import numpy as np
    from onnx import helper
    c = (np.arange(n) % 7 - 3).astype(np.int8)
    return _model([helper.make_node("Mul", ["a", "b"], ["p"]),
                   helper.make_node("Add", ["p", "c"], ["s"]),
                   helper.make_node("Max", ["s", "a"], ["y"])],
                  [("a", (n,), "int8"), ("b", (n,), "int8")], [("y", (n,), "int8")], {"c": c})


def qdq_conv():
    """DequantizeLinear -> Conv -> Relu -> QuantizeLinear on uint8: a quantizer's QDQ model in
    small, run in integers."""
    import numpy as np
    from onnx import helper
    rng = np.random.default_rng(2)
    f32 = lambda v: np.array(v, np.float32)  # noqa: E731
    nodes = [helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["x"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"]),
             helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "ys", "yz"], ["y"])]
    inits = {"xs": f32(0.02), "xz": np.uint8(128), "ws": f32(0.01), "wz": np.int8(0),
             "wq": rng.integers(-60, 60, (8, 4, 3, 3)).astype(np.int8),
             "ys": f32(0.05), "yz": np.uint8(0)}
    return _model(nodes, [("xq", (1, 4, 16, 16), "uint8")], [("y", (1, 8, 16, 16), "uint8")],
                  inits, opset=13)


def known_answer(p, device: str, target: str, make, want_fn) -> str:
    """The one-kernel model through the device's own load, submit and wait, equal to numpy."""
    import numpy as np

    from runner import Model
    path = p.call(f"compile ({target})", blob, p.state, make.__name__, make, target)
    m = p.call(f"Model.load(device={device!r})", Model.load, path, device=device)
    p.state["close"].append(m.close)
    p.state["model"] = m
    feeds = _feeds(make())
    got = p.call("Model.run", m.run, feeds, timeout_ms=10_000)["y"]
    want = want_fn(**feeds)
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    if bad.size:
        i = int(bad[0])
        raise Failure(f"{bad.size} of {want.size} values differ from numpy, first at {i}: got "
                      f"{got.reshape(-1)[i]!r}, expected {want.reshape(-1)[i]!r}", "wrong answer")
    return f"{want.size} values equal to numpy"


def relu_mul_answer(x):
    import numpy as np
    return np.maximum(x, 0) * x


def int8_fma_answer(a, b):
    import numpy as np
    c = (np.arange(a.size) % 7 - 3).astype(np.int8)
    return np.maximum(a * b + c, a)  # numpy's int8 arithmetic wraps, as the kernel's does


def stages(device: str) -> list[Stage]:
    from tools import doctor_stages  # the per-device lists, which import the helpers above
    return getattr(doctor_stages, device)()


# ---- the report and the bundle ------------------------------------------------------------------

def source_hash() -> str:
    """SHA-256 over keel's sources (path and bytes), so a report names the exact code it ran."""
    h = hashlib.sha256()
    for pkg in SOURCES:
        for p in sorted((ROOT / pkg).rglob("*")):
            if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


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
    from tools import doctor  # one module, whether run as a script or imported by the tests
    sys.exit(doctor.main())
