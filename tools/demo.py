"""The built-in example, end to end: generate the openpilot-shaped model, compile it to a blob,
load it with the runner, and compare latency and outputs with onnxruntime (1 thread).

  python tools/demo.py [--float16] [--runs N] [--out DIR]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--float16", action="store_true", help="fp16 weights, as openpilot ships them")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="keel-demo-"))
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    onnx_path, blob_path = os.path.join(args.out, "model.onnx"), os.path.join(args.out, "model.blob")

    proto = make_openpilot(float16=args.float16)
    onnx.save(proto, onnx_path)
    print(f"generated {onnx_path} ({os.path.getsize(onnx_path) / 2**20:.1f} MiB)")

    t = time.perf_counter()
    write_blob(compile_model(proto), blob_path)
    print(f"compiled  {blob_path} in {time.perf_counter() - t:.1f} s")

    t = time.perf_counter()
    model = Model.load(blob_path)
    print(f"loaded    in {(time.perf_counter() - t) * 1e3:.1f} ms")

    feeds = feeds_for(model)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    got = model.run(feeds)
    for name in want:
        err = np.abs(got[name].astype(np.float64) - want[name]).max()
        print(f"output    {name} {got[name].shape}: max abs error vs onnxruntime {err:.3g}")

    out = {n: np.empty(s, d) for n, (s, d) in model.outputs.items()}
    for n, a in feeds.items():
        model.input_view(n)[...] = a
    keel_ms = median_ms(lambda: model.run(out=out), args.runs)
    ort_ms = median_ms(lambda: sess.run(None, feeds), args.runs)
    print(f"latency   keel {keel_ms:.2f} ms, onnxruntime (1 thread) {ort_ms:.2f} ms, "
          f"ratio {keel_ms / ort_ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
