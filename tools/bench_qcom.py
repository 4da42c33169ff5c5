"""Host time per run of the qcom device on the mock KGSL: from the call of run() to the entry of
the GPU_COMMAND ioctl, the part of a run that is keel's own (binding, staging copies, the ring
entry, the ioctl's argument). What happens after the ioctl is the driver's and the GPU's.

    python tools/bench_qcom.py [--runs N] [--blob model.blob] [--stub]

Without --blob it compiles the openpilot-shaped model with --target qcom --float16 (about 40 s,
cached by tests/graphs.py:compiled_blob). The mock GPU runs no kernels in the timed runs, only the
CP's memory writes (the timeline word; the span ends before the GPU would start), so N can be
large; one executed run comes first.
Two cases: inputs written into the device's own slots (run() without feeds, outputs into bound
arrays: nothing to copy or patch) and feeds passed as fresh host arrays each run (staged: copied
into the slots before the ioctl).
--stub: the whole run() (submit, wait, retire) with the three KGSL ioctls a run makes stubbed
out: GPU_COMMAND retires at once and writes the timeline word the CP would, the timestamp read
and wait answer at once. What is left is keel's host overhead per run, nothing of the mock's.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from qcom import kgsl  # noqa: E402
from sim.qcom.mock_gpu import memory_writes  # noqa: E402
from runner import Model  # noqa: E402


def timed_model(path: str) -> tuple[Model, list]:
    """The model on the mock, and the list its GPU_COMMAND entries append perf_counter() to."""
    os.environ["KEEL_KGSL"] = "mock"
    m = Model.load(path, device="qcom")
    driver, stamps = m.device.kgsl.driver, []
    inner = driver.ioctl

    def ioctl(fd, number, arg):
        if number == kgsl.GPU_COMMAND.number:
            stamps.append(time.perf_counter())
        return inner(fd, number, arg)
    driver.ioctl = ioctl
    return m, stamps


def spans(m: Model, stamps: list, runs: int, feeds=None, out=None) -> np.ndarray:
    out_us = []
    for _ in range(runs):
        f = feeds() if feeds else None
        t0 = time.perf_counter()
        m.run(f, out=out)
        out_us.append((stamps[-1] - t0) * 1e6)
    return np.array(out_us)


def stub_ioctls(m: Model) -> None:
    """Every run's KGSL calls answered at once: the submission retires inside GPU_COMMAND."""
    driver, inner, ts = m.device.kgsl.driver, m.device.kgsl.driver.ioctl, [0]

    def ioctl(fd, number, arg):
        if number == kgsl.GPU_COMMAND.number:
            ts[0] += 1
            arg.timestamp = ts[0]
            m.device.timeline_word[0] = m.device.value + 1  # the ring entry's CP_MEM_WRITE
        elif number == kgsl.READTIMESTAMP_CTXTID.number:
            arg.timestamp = ts[0]
        elif number != kgsl.WAITTIMESTAMP_CTXTID.number:
            inner(fd, number, arg)
    driver.ioctl = ioctl


def median_run_us(m: Model, runs: int, out: dict) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        m.run(out=out)
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times)) / 1e3


def report(what: str, us: np.ndarray) -> None:
    print(f"{what}: median {np.median(us):.1f} us, p99 {np.percentile(us, 99):.1f} us, "
          f"max {us.max():.1f} us over {len(us)} runs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--blob", help="a --target qcom blob (default: openpilot-shaped, --float16)")
    ap.add_argument("--stub", action="store_true", help="time whole runs with the ioctls stubbed")
    args = ap.parse_args()
    path = args.blob
    if path is None:
        from models.openpilot import make_openpilot
        from tests.graphs import compiled_blob
        path = str(compiled_blob(make_openpilot(float16=True), "qcom", float16=True))
    m, stamps = timed_model(path)
    rng = np.random.default_rng(0)
    for name, (shape, dtype) in m.inputs.items():
        m.input_view(name)[:] = rng.standard_normal(shape).astype(dtype) if dtype.kind == "f" \
            else rng.integers(0, 256, shape).astype(dtype)
    out = {name: np.empty(shape, dtype) for name, (shape, dtype) in m.outputs.items()}
    t0 = time.perf_counter()
    m.run(out=out)  # executed once: the kernels are built and the stream is known good
    print(f"{path}: {len(m.blob.launches)} launches; one executed run on the mock "
          f"{time.perf_counter() - t0:.2f} s")
    if args.stub:
        stub_ioctls(m)
        print(f"run(out=out), inputs in the slots, ioctls stubbed: median "
              f"{median_run_us(m, args.runs, out):.1f} us over {args.runs} runs")
        return
    m.device.kgsl.driver.on_submit = memory_writes  # the CP's memory writes, no kernels
    report("run() to GPU_COMMAND, inputs in the slots", spans(m, stamps, args.runs, out=out))
    fresh = {n: np.array(m.input_view(n)) for n in m.inputs}
    us = spans(m, stamps, args.runs, feeds=lambda: {n: a.copy() for n, a in fresh.items()},
               out=out)
    how = "imported" if m.device.imported else "staged (copied)"
    report(f"run(feeds) to GPU_COMMAND, a fresh array per input per run, {how}", us)


if __name__ == "__main__":
    main()
