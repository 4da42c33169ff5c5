"""The built-in example, end to end: generate the openpilot-shaped model, compile it to a blob,
load it with the runner, and compare outputs and latency with onnxruntime: both on one thread,
then both on every core this process may use.

  python tools/demo.py [--float16] [--runs N] [--out DIR] [--onnx MODEL]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

# the repository root, so the tool runs from a checkout without installing keel
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from compiler.blob import write_blob  # noqa: E402
from compiler.pipeline import compile_model  # noqa: E402
from models.openpilot import make_openpilot  # noqa: E402
from runner import Model  # noqa: E402


def feeds_for(model: Model, seed: int = 0) -> dict:
    """Camera frames are full-range uint8; the rest are unit-scale floats."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, dtype) in model.inputs.items():
        if dtype == np.uint8:
            out[name] = rng.integers(0, 256, shape, dtype=np.uint8)
        else:
            out[name] = rng.standard_normal(shape).astype(dtype)
    return out


def median_ms(fn, runs: int) -> float:
    fn()  # warm caches and lazy initialisation
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def thread_counts() -> list[int]:
    """1, then every core this process may run on (the runner's KEEL_THREADS default)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return sorted({1, n})


def load_keel(blob_path: str, threads: int) -> Model:
    """KEEL_THREADS is read once, at load: each thread count is its own Model."""
    old = os.environ.get("KEEL_THREADS")
    os.environ["KEEL_THREADS"] = str(threads)
    try:
        return Model.load(blob_path)
    finally:
        if old is None:
            del os.environ["KEEL_THREADS"]
        else:
            os.environ["KEEL_THREADS"] = old


def ort_session(onnx_path: str, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])


def plural(n: int) -> str:
    return f"{n} thread" if n == 1 else f"{n} threads"


def compare_latency(blob_path: str, onnx_path: str, feeds: dict, runs: int) -> None:
    for n in thread_counts():
        model, sess = load_keel(blob_path, n), ort_session(onnx_path, n)
        out = {name: np.empty(s, d) for name, (s, d) in model.outputs.items()}
        for name, a in feeds.items():
            model.input_view(name)[...] = a
        keel_ms = median_ms(lambda: model.run(out=out), runs)
        ort_ms = median_ms(lambda: sess.run(None, feeds), runs)
        # each side's own count: the runner may fall back to one thread
        print(f"latency   keel ({plural(model.device.threads)}) {keel_ms:.2f} ms, "
              f"onnxruntime ({plural(n)}) {ort_ms:.2f} ms, ratio {keel_ms / ort_ms:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--float16", action="store_true", help="fp16 weights, as openpilot ships them")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="keel-demo-"))
    ap.add_argument("--onnx", help="this model instead of the built-in example")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    onnx_path = os.path.join(args.out, "model.onnx")
    blob_path = os.path.join(args.out, "model.blob")

    if args.onnx:
        onnx_path, proto = args.onnx, onnx.load(args.onnx)
    else:
        proto = make_openpilot(float16=args.float16)
        onnx.save(proto, onnx_path)
        print(f"generated {onnx_path} ({os.path.getsize(onnx_path) / 2**20:.1f} MiB)")

    t = time.perf_counter()
    write_blob(compile_model(proto), blob_path)
    print(f"compiled  {blob_path} in {time.perf_counter() - t:.1f} s")

    t = time.perf_counter()
    model = load_keel(blob_path, 1)
    # a `cpu` blob holds every x86-64 level: say which one this host runs
    print(f"loaded    {model.blob.variant} in {(time.perf_counter() - t) * 1e3:.1f} ms")

    feeds = feeds_for(model)
    sess = ort_session(onnx_path, 1)
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    got = model.run(feeds)
    for name in want:
        err = np.abs(got[name].astype(np.float64) - want[name]).max()
        print(f"output    {name} {got[name].shape}: max abs error vs onnxruntime {err:.3g}")
    compare_latency(blob_path, onnx_path, feeds, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
