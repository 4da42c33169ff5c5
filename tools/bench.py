"""keel against onnxruntime, side by side in one run, on the built-in models.

  python tools/bench.py [--models openpilot,openpilot-fp16,resnet50,efficientnet | all |
                         ocr,detector,mobilenetv2,mlp,gemm]
                        [--threads 1,2] [--runs 30] [--target TARGET] [--cache DIR]

For each model and thread count it times keel (`Model.run` with inputs in place and preallocated
outputs) and onnxruntime (`intra_op_num_threads` = the same count, default optimizations) in
alternating blocks of runs, so both see the same machine load, and reports medians. GFLOP counts Conv,
MatMul and Gemm multiply-adds (models/flops.py) as a direct conv does them: nominal, since keel's
Winograd convs do fewer, so a model with them can show a rate no kernel reaches (the same count
serves both columns, so the ratio is unaffected); % of peak is against this machine's measured
FMA throughput per thread (a register-only microbenchmark built with keel's own toolchain).
The default target is `cpu`, a user's default: one blob holding the x86-64-v3 and -v4 builds, of
which the runner loads the widest this host runs (cpu-avx512 where /proc/cpuinfo lists AVX-512),
as onnxruntime dispatches on the host's widest vectors too.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

# the repository root, so the tool runs from a checkout without installing keel
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import cffi  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from compiler.blob import write_blob  # noqa: E402
from compiler.pipeline import compile_model  # noqa: E402
from compiler.target import get_target  # noqa: E402
from compiler.toolchain import build_shared  # noqa: E402
from models.efficientnet import make_efficientnet  # noqa: E402
from models.flops import count_flops  # noqa: E402
from models.openpilot import make_openpilot  # noqa: E402
from models.realworld import MAKERS as REAL_WORLD  # noqa: E402
from models.resnet import make_resnet50  # noqa: E402
from runner import Model  # noqa: E402
from runner import cache  # noqa: E402
from runner.host import choose  # noqa: E402
from tools.cli import timed  # noqa: E402

MODELS = {
    "openpilot": lambda: make_openpilot(),
    "openpilot-fp16": lambda: make_openpilot(float16=True),
    "resnet50": lambda: make_resnet50(),
    "efficientnet": lambda: make_efficientnet(),
    # shapes nobody tuned for (models/realworld.py): not in the default set, name them
    **{name: make for name, make in REAL_WORLD.items()},
}
DEFAULT_MODELS = "openpilot,openpilot-fp16,resnet50,efficientnet"

# Blocks of runs alternate between keel and onnxruntime, so both see the same machine load;
# not single runs, because onnxruntime's intra-op threads spin for a while after each run and
# would take the cores keel's next run needs.
BLOCK = 5
ORT_SPIN_S = 0.05
PEAK_CHAINS = 12  # independent FMA chains: enough to cover FMA latency on every current core


def peak_source(vector_bytes: int) -> str:
    lanes = vector_bytes // 4
    decl = "".join(f"  v a{i} = b * {i + 1}.0f;\n" for i in range(PEAK_CHAINS))
    body = "".join(f"    a{i} = a{i} * b + c;\n" for i in range(PEAK_CHAINS))
    total = " + ".join(f"a{i}" for i in range(PEAK_CHAINS))
    return (f"typedef float v __attribute__((vector_size({vector_bytes})));\n"
            f"float keel_peak(long iters, float seed) {{\n"
            f"  v b = (v){{}} + seed, c = (v){{}} + 1e-7f;\n{decl}"
            f"  for (long i = 0; i < iters; i++) {{\n{body}  }}\n"
            f"  v t = {total};\n  float s = 0;\n"
            f"  for (int i = 0; i < {lanes}; i++) s += t[i];\n  return s;\n}}\n")


@functools.lru_cache(maxsize=None)
def peak_lib(target: str):
    """The microbenchmark, built once per target (a loaded library's file must not change)."""
    ffi = cffi.FFI()
    ffi.cdef("float keel_peak(long iters, float seed);")
    with tempfile.NamedTemporaryFile(suffix=".so", delete=False) as f:
        f.write(build_shared(peak_source(get_target(target).vector_bytes), target))
    lib = ffi.dlopen(f.name)
    os.unlink(f.name)  # the mapping outlives the name
    return lib


def measure_peak(target: str, threads: int, iters: int = 20_000_000, tries: int = 3) -> float:
    """GFLOP/s of `threads` threads each running independent vector FMA chains: the best of
    `tries`, as a peak should be (one try on a shared VM once read 2-thread peak at 70%)."""
    tgt, lib = get_target(target), peak_lib(target)
    lib.keel_peak(1000, 0.999)  # warm up clocks and page in the code
    best = math.inf
    for _ in range(tries):
        workers = [threading.Thread(target=lib.keel_peak, args=(iters, 0.999))
                   for _ in range(threads)]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t)
    flops = threads * iters * PEAK_CHAINS * (tgt.vector_bytes // 4) * 2
    return flops / best / 1e9


def feeds_for(inputs: dict, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {n: rng.integers(0, 256, s, dtype=np.uint8) if d == np.uint8
            else rng.standard_normal(s).astype(d) for n, (s, d) in inputs.items()}


def prepare(name: str, target: str, cache: str) -> tuple[str, str]:
    """The model (generated once, cached) and its blob (compiled now)."""
    onnx_path = os.path.join(cache, f"{name}.onnx")
    blob_path = os.path.join(cache, f"{name}.{target}.blob")
    if not os.path.exists(onnx_path):
        onnx.save(MODELS[name](), onnx_path)
    write_blob(compile_model(onnx_path, target=target), blob_path)  # never time a stale compiler
    return onnx_path, blob_path


def bench(onnx_path: str, blob_path: str, threads: int, runs: int) -> tuple[float, float, float]:
    """Median ms of keel and onnxruntime over interleaved rounds, and keel's max abs error."""
    os.environ["KEEL_THREADS"] = str(threads)
    model = Model.load(blob_path)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
    feeds = feeds_for(model.inputs)
    for n, a in feeds.items():
        model.input_view(n)[...] = a
    out = {n: np.empty(s, d) for n, (s, d) in model.outputs.items()}
    want = sess.run(None, feeds)
    model.run(out=out)
    err = max(float(np.abs(out[o.name].astype(np.float64) - w).max())
              for o, w in zip(sess.get_outputs(), want))
    keel, ref = [], []
    for _ in range(max(runs // BLOCK, 1)):
        time.sleep(ORT_SPIN_S)  # let onnxruntime's idle workers stop spinning on our cores
        keel += timed(lambda: model.run(out=out), BLOCK)
        ref += timed(lambda: sess.run(None, feeds), BLOCK)
    return statistics.median(keel) * 1e3, statistics.median(ref) * 1e3, err


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name}, {cores} cores available, onnxruntime {ort.__version__}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODELS,
                    help=f"comma-separated, of: {', '.join(MODELS)}; 'all' for every one")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--target", default="cpu",
                    help="default cpu: every x86-64 level in one blob, the runner picks")
    ap.add_argument("--cache", default=str(cache.workdir("bench")),
                    help="where the models and blobs are kept (runner/cache.py's bench/ folder)")
    args = ap.parse_args(argv)
    names = list(MODELS) if args.models == "all" else args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; expected some of {', '.join(MODELS)}")
    os.makedirs(args.cache, exist_ok=True)
    threads = [int(t) for t in args.threads.split(",")]
    # the build the runner loads here (KEEL_CPU_VARIANT forces one): its vectors set the peak
    running = choose(list(get_target(args.target).variants) or [args.target])
    peak = {t: measure_peak(running, t) for t in threads}
    print(f"machine: {machine()}")
    print(f"target: {args.target}, running {running}; measured peak: "
          + ", ".join(f"{peak[t]:.0f} GFLOP/s at {t} thread(s)" for t in threads))
    print("| model | threads | keel ms | onnxruntime ms | keel/ort | GFLOP | keel GFLOP/s "
          "| % of peak | max abs err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        onnx_path, blob_path = prepare(name, args.target, args.cache)
        gflop = count_flops(onnx.load(onnx_path))["total"] / 1e9
        for t in threads:
            k, r, err = bench(onnx_path, blob_path, t, args.runs)
            rate = gflop / (k / 1e3)
            print(f"| {name} | {t} | {k:.2f} | {r:.2f} | {k / r:.2f} | {gflop:.2f} | {rate:.1f} "
                  f"| {100 * rate / peak[t]:.0f}% | {err:.2g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
