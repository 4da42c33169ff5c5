"""Runner benchmarks: Model.load time, host overhead per run(), cost of feeding inputs as a dict.

    python tools/bench_runner.py [--runs N] [--loads N] [--blob model.blob]

Load time: min and median wall time of 2 x `--loads` Model.load calls after a warm-up load (so the
page cache is warm), the CPU time per load (above the wall time when hashing runs on several
threads), and the hash-verification share: the wall time of checking every SHA-256 alone (the
manifest digest, the file digest and every section chunk, on the same threads load uses) over the
load time. On a machine shared with other jobs, the rounds that began with every core idle (from
/proc/stat, sampled 0.2 s before each round) are reported apart: they are the figure for an idle
machine; the minimum over all rounds is the next best.

Host overhead = median wall time of run() minus median of a direct cffi call of keel_graph with the
same pointers, measured on a hand-written graph with openpilot's io signature and a trivial kernel
(tests/hand_graphs.py), so the kernel's own time does not drown the microseconds. The mock device's
run() (a worker thread replays the launch table and signals the timeline) is timed beside it. --blob adds the
load time and latency of a real compiled blob.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import hashlib  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from runner import Model  # noqa: E402
from runner.blob import HEADER, _ChunkCheck, file_sha256, read_blob  # noqa: E402
from runner.format import variant_sections  # noqa: E402
from tests.hand_graphs import openpilot_io_artifact, write  # noqa: E402

REPO = sys.path[0]


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


def idle_cores(dt: float = 0.2) -> float:
    """Cores left idle by every process on the machine over the next `dt` seconds (Linux);
    nan where /proc/stat cannot be read."""
    def snap():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks)  # idle + iowait, total
    try:
        idle0, total0 = snap()
        time.sleep(dt)
        idle1, total1 = snap()
    except (OSError, ValueError, IndexError):
        return float("nan")
    return (os.cpu_count() or 1) * (idle1 - idle0) / max(total1 - total0, 1)


def times_ms(fns: dict, runs: int, idle: list | None = None) -> dict[str, np.ndarray]:
    """Wall times (ms) of each function, called in turn `runs` times after one warm-up call each,
    so that on a shared machine they all see the same background load. With `idle`, each round
    starts by appending the machine's idle cores (idle_cores) to it."""
    times = {name: np.empty(runs) for name in fns}
    for name, fn in fns.items():
        fn()  # warm-up: page cache, imports, first-call costs
    for i in range(runs):
        if idle is not None:
            idle.append(idle_cores())
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name][i] = time.perf_counter() - t
    return {name: t * 1e3 for name, t in times.items()}


def verify_hashes(blob) -> int:
    """Every SHA-256 check load makes, alone: what the format costs over parsing. Returns the
    number of threads that hashed."""
    data = blob.weights.obj  # the mapped file
    m_offset, m_size = HEADER.unpack_from(data)[5:7]
    hashlib.sha256(memoryview(data)[m_offset:m_offset + m_size]).digest()
    table = {s["name"]: s for s in blob.manifest["sections"]}
    file_sha256(data, [(s["offset"], s["size"]) for s in table.values()])
    # the loaded variant's sections: what load hashes
    with _ChunkCheck(memoryview(data), [table[n] for n in variant_sections(blob.variant)]) \
            as chunks:
        chunks.finish()
    return chunks.threads


def first_load_ms(path: str, tries: int = 3) -> str:
    """Fresh processes: importing the runner, then the first Model.load (which imports the device
    backend): what a process pays once at startup. Minimum of `tries`."""
    script = ("import time; t = time.perf_counter(); from runner import Model; "
              "u = time.perf_counter(); Model.load(%r); v = time.perf_counter(); "
              "print((u - t) * 1e3, (v - u) * 1e3)" % path)
    best = None
    for _ in range(tries):
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                              text=True)
        if proc.returncode:
            return proc.stderr.strip().splitlines()[-1]
        got = [float(x) for x in proc.stdout.split()]
        best = got if best is None else [min(a, b) for a, b in zip(best, got)]
    return (f"import runner {best[0]:.0f} ms, then first Model.load {best[1]:.1f} ms "
            f"(min of {tries})")


def bench_load(path: str, runs: int) -> None:
    size = os.path.getsize(path) / 2**20
    blob = read_blob(path)
    cpu = time.process_time()
    load = times_ms({"load": lambda: Model.load(path)}, runs)["load"]
    cpu_ms = (time.process_time() - cpu) / (runs + 1) * 1e3
    idle: list[float] = []
    t = times_ms({"load": lambda: Model.load(path), "read": lambda: read_blob(path),
                  "hashes": lambda: verify_hashes(blob)}, runs, idle)
    med = np.median(np.concatenate([load, t["load"]]))
    print(f"  {size:6.1f} MiB blob, {2 * runs} loads: Model.load min "
          f"{min(load.min(), t['load'].min()):6.2f} median {med:6.2f} ms wall, "
          f"{cpu_ms:6.2f} ms cpu per load")
    cores = os.cpu_count() or 1
    quiet = np.array(idle) >= cores - 0.2
    if quiet.any():
        print(f"{'':17s}in the {quiet.sum()} of {runs} rounds that began with all {cores} cores "
              f"idle: min {t['load'][quiet].min():6.2f} median {np.median(t['load'][quiet]):6.2f} "
              f"ms")
    else:
        print(f"{'':17s}no round began with all {cores} cores idle (median idle "
              f"{np.median(idle):.1f} cores)")
    print(f"{'':17s}of which read_blob (map + validate) min {t['read'].min():6.2f} median "
          f"{np.median(t['read']):6.2f} ms")
    share = np.median(t["hashes"] / t["load"])
    print(f"{'':17s}hash verification alone min {t['hashes'].min():6.2f} median "
          f"{np.median(t['hashes']):6.2f} ms: {share:4.0%} of load (median ratio, same rounds; "
          f"threads hashing: {verify_hashes(blob)})")


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
    mock = Model.load(path, device="mock")  # a queue device: submit, worker thread, signal, wait
    print(f"  {'device=mock: run(out=out), inputs in slots':46s} "
          f"{median_us(lambda: mock.run(out=out), runs // 10):7.2f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20000)
    ap.add_argument("--loads", type=int, default=20, help="Model.load calls timed per blob")
    ap.add_argument("--blob", help="also time loading and running this compiled blob")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small = write(openpilot_io_artifact(), os.path.join(tmp, "io.blob"))
        big = write(openpilot_io_artifact(weights_bytes=50 * 2**20), os.path.join(tmp, "big.blob"))
        print("Model.load, warm page cache:")
        bench_load(small, max(args.loads, 50))
        bench_load(big, args.loads)
        print(f"run() on the openpilot io signature (median of {args.runs}):")
        bench_run(small, args.runs)
    if args.blob:
        print(f"{args.blob}:")
        print(f"  fresh process: {first_load_ms(os.path.abspath(args.blob))}")
        bench_load(args.blob, args.loads)
        m = Model.load(args.blob)
        out = {name: np.empty(shape, dt) for name, (shape, dt) in m.outputs.items()}
        print(f"  run(out=out) median of 20: {median_us(lambda: m.run(out=out), 20) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
