"""Run a keel blob: output summary, optional latency, optional comparison with onnxruntime.

    python tools/run.py model.blob [--inputs feeds.npz] [--bench N] [--check model.onnx]

Without --inputs, inputs are seeded random data: uint8 over the full range, other integers in
[0, 10), bool fair coin, floats uniform in [-1, 1).
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import io  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from runner import (BlobError, ConfigError, DeviceError, DeviceTimeout, InputError,  # noqa: E402
                    Model)
from runner.files import read_regular  # noqa: E402
from tools.cli import Parser, positive_int  # noqa: E402


class ToolError(Exception):
    pass


def random_feeds(inputs: dict, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, (shape, dtype) in inputs.items():
        if dtype == np.uint8:
            feeds[name] = rng.integers(0, 256, shape, dtype=np.uint8)
        elif dtype.kind in "iu":
            feeds[name] = rng.integers(0, 10, shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[name] = rng.uniform(-1, 1, shape).astype(dtype)
    return feeds


def load_feeds(path: str) -> dict[str, np.ndarray]:
    try:
        data = np.load(io.BytesIO(read_regular(path)))
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ToolError(f"inputs {path}: expected an .npz archive with one array per input "
                            f"name, got a single {type(data).__name__}")
        with data as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError) as e:
        raise ToolError(f"cannot read inputs {path}: {e}") from None


def frozen_feeds(meta: dict) -> dict[str, np.ndarray]:
    """The inputs the blob was compiled with frozen (--input-value), as feeds for the ONNX
    model it came from."""
    return {name: np.array(f["values"], f["dtype"]).reshape(f["shape"])
            for name, f in meta.get("frozen_inputs", {}).items()}


def bench(m: Model, feeds: dict, runs: int) -> None:
    """The modeld loop: inputs written into the slots, outputs into preallocated arrays."""
    for name, arr in feeds.items():
        m.input_view(name)[:] = arr
    out = {name: np.empty(shape, dtype) for name, (shape, dtype) in m.outputs.items()}
    times = np.empty(runs)
    for i in range(runs):
        t = time.perf_counter()
        m.run(out=out)
        times[i] = time.perf_counter() - t
    print(f"latency over {runs} runs: median {np.median(times) * 1e3:.4g} ms, "
          f"p99 {np.percentile(times, 99) * 1e3:.4g} ms")


def check(onnx_path: str, feeds: dict, results: dict) -> None:
    import onnxruntime as ort  # only this tool needs it, never the runner
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    try:
        model = read_regular(onnx_path)
    except OSError as e:
        raise ToolError(f"--check {e.filename}: {e.strerror}") from None
    try:
        sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        refs = dict(zip(names, sess.run(names, feeds)))
    except Exception as e:  # onnxruntime raises its own untyped errors
        raise ToolError(f"onnxruntime failed on {onnx_path}: {str(e).splitlines()[0]}") from None
    for name, got in results.items():
        if name not in refs:
            raise ToolError(f"output {name!r} not in {onnx_path}; it has {names}")
        if got.shape != refs[name].shape:
            raise ToolError(f"output {name!r}: keel gives shape {got.shape}, {onnx_path} gives "
                            f"{refs[name].shape}; is it the model this blob was compiled from?")
        ref = refs[name].astype(np.float64)
        err = np.abs(got.astype(np.float64) - ref)
        rel = err / np.maximum(np.abs(ref), 1e-6)
        print(f"check {name}: max abs err {err.max(initial=0):.3e}, "
              f"max rel err {rel.max(initial=0):.3e}")


def summary(results: dict) -> None:
    for name, arr in results.items():
        stats = (f"min {arr.min():.6g} max {arr.max():.6g} mean {arr.mean(dtype=np.float64):.6g}"
                 if arr.size else "empty")
        print(f"output {name}: {arr.dtype} {arr.shape} {stats}")


def main() -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("blob")
    ap.add_argument("--inputs", help=".npz with one array per input name")
    ap.add_argument("--bench", type=positive_int, metavar="N", help="time N runs")
    ap.add_argument("--check", metavar="MODEL.onnx", help="compare with onnxruntime")
    args = ap.parse_args()
    try:
        m = Model.load(args.blob)
        feeds = load_feeds(args.inputs) if args.inputs else random_feeds(m.inputs)
        results = m.run(feeds)
        summary(results)
        if args.bench:
            bench(m, feeds, args.bench)
        if args.check:
            check(args.check, {**feeds, **frozen_feeds(m.meta)}, results)
    except (BlobError, ConfigError, InputError, DeviceError, DeviceTimeout, ToolError) as e:
        print(f"run: {args.blob}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
