"""Runner benchmarks: Model.load time, host overhead per run(), cost of feeding inputs as a dict.

    python tools/bench_runner.py [--runs N] [--blob model.blob]

Host overhead = median wall time of run() minus median of a direct cffi call of keel_graph with the
same pointers, measured on a hand-written graph with openpilot's io signature and a trivial kernel
(tests/hand_graphs.py), so the kernel's own time does not drown the microseconds. --blob adds the
load time and latency of a real compiled blob.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from runner import Model  # noqa: E402
from runner.blob import read_blob  # noqa: E402
from tests.hand_graphs import openpilot_io_artifact, write  # noqa: E402


def median_us(fn, runs: int) -> float:
    for _ in range(min(runs, 100)):
        fn()
    times = np.empty(runs)
    clock = time.perf_counter_ns
    for i in range(runs):
        t = clock()
        fn()
        times[i] = clock() - t
    return float(np.median(times)) / 1e3


def bench_load(path: str, runs: int) -> None:
    size = os.path.getsize(path) / 2**20
    Model.load(path)  # warm the page cache
    cpu = time.process_time()
    read_ms = median_us(lambda: read_blob(path), runs) / 1e3
    cpu_ms = (time.process_time() - cpu) / (runs + min(runs, 100)) * 1e3
    load_ms = median_us(lambda: Model.load(path), runs) / 1e3
    print(f"  {size:6.1f} MiB blob: read_blob (validate + hash) {read_ms:7.2f} ms wall, "
          f"{cpu_ms:7.2f} ms cpu; Model.load {load_ms:7.2f} ms wall")


def bench_run(path: str, runs: int) -> None:
    m = Model.load(path)
    rng = np.random.default_rng(0)
    feeds = {name: rng.integers(0, 256, shape).astype(dt) for name, (shape, dt) in
             m.inputs.items()}
    for name, arr in feeds.items():
        m.input_view(name)[:] = arr
    out = {name: np.empty(shape, dt) for name, (shape, dt) in m.outputs.items()}
    m.run(out=out)
    dev = m.device
    graph, arena, weights, io = dev._graph, dev._arena_ptr, dev._weights_ptr, dev._io_ptrs
    direct = median_us(lambda: graph(arena, weights, io), runs)
    fortran = {name: np.asfortranarray(arr) for name, arr in feeds.items()}
    slots = [(m.input_view(name), arr) for name, arr in feeds.items()]

    def copy_then_run():
        for slot, arr in slots:
            np.copyto(slot, arr)
        m.run(out=out)
    cases = [("run(out=out), inputs in slots", lambda: m.run(out=out)),
             ("copy feeds into slots, then run(out=out)", copy_then_run),
             ("run(feeds, out=out), bound zero-copy", lambda: m.run(feeds, out=out)),
             ("run(feeds, out=out), copied (Fortran order)", lambda: m.run(fortran, out=out)),
             ("run(), fresh output arrays", lambda: m.run())]
    print(f"  direct cffi call of keel_graph: {direct:7.2f} us")
    for name, fn in cases:
        t = median_us(fn, runs)
        print(f"  {name:46s} {t:7.2f} us  (host overhead {t - direct:6.2f} us)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20000)
    ap.add_argument("--blob", help="also time loading and running this compiled blob")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small = write(openpilot_io_artifact(), os.path.join(tmp, "io.blob"))
        big = write(openpilot_io_artifact(weights_bytes=50 * 2**20), os.path.join(tmp, "big.blob"))
        print("Model.load, warm page cache (median):")
        bench_load(small, 50)
        bench_load(big, 10)
        print(f"run() on the openpilot io signature (median of {args.runs}):")
        bench_run(small, args.runs)
    if args.blob:
        print(f"{args.blob}:")
        bench_load(args.blob, 10)
        m = Model.load(args.blob)
        out = {name: np.empty(shape, dt) for name, (shape, dt) in m.outputs.items()}
        print(f"  run(out=out) median of 20: {median_us(lambda: m.run(out=out), 20) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
