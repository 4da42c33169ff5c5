"""What a shifting queue in state costs per run on the CPU: as a ping-pong state the run copies
the N - k kept rows (Y = Concat(Slice(X, k on), new rows)); as a ring (compiler/ring.py,
runner/state.py) it writes only the k new rows and their mirror (docs/perf.md "Issue 32").

    python tools/bench_state.py [--rows 99] [--width 512] [--runs 2000]

Four blobs of the same shape (openpilot's feature history: 99 rows of 512 float32 by default),
each run() timed (median): the queue as state made a ring (what the compiler does), the same
blob compiled with ring detection off (ping-pong: the kept rows copied by the kernel every run),
the same graph without the queue (only the new row computed: the floor a ring approaches), and
the queue as an ordinary input and output (the host feeds it back: the copy out and in that
state avoids).
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402
from onnx import helper  # noqa: E402

from compiler.blob import write_blob  # noqa: E402
from compiler.pipeline import compile_model  # noqa: E402
from runner import Model  # noqa: E402
from tests.graphs import make_model  # noqa: E402


def queue_model(rows: int, width: int, state: bool):
    nodes = [helper.make_node("Relu", ["x"], ["new"]),
             helper.make_node("Slice", ["q", "one", "rows", "zero"], ["q_tail"]),
             helper.make_node("Concat", ["q_tail", "new"], ["q_out"], axis=0)]
    m = make_model(nodes, [("x", (1, width), "float32"), ("q", (rows, width), "float32")],
                   [("q_out", (rows, width), "float32")],
                   {"one": np.array([1], np.int64), "rows": np.array([rows], np.int64),
                    "zero": np.array([0], np.int64)})
    if state:
        helper.set_model_props(m, {"keel.state": json.dumps({"q": "q_out"})})
    return m


def new_row_only(width: int):
    return make_model([helper.make_node("Relu", ["x"], ["new"])],
                      [("x", (1, width), "float32")], [("new", (1, width), "float32")])


def median_us(fn, runs: int) -> float:
    for _ in range(min(runs, 100)):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t)
    return float(np.median(times)) / 1e3


def load(model, tmp: str, name: str, rings: bool = True) -> Model:
    """rings=False: every state stays ping-pong (ring detection answers none)."""
    path = os.path.join(tmp, f"{name}.blob")
    with nullcontext() if rings else mock.patch("compiler.pipeline.find_rings", lambda *a: {}):
        write_blob(compile_model(model), path)
    return Model.load(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=99)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--runs", type=int, default=2000)
    args = ap.parse_args()
    x = np.ones((1, args.width), np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        ring = load(queue_model(args.rows, args.width, True), tmp, "ring")
        state = load(queue_model(args.rows, args.width, True), tmp, "state", rings=False)
        row = load(new_row_only(args.width), tmp, "row")
        assert [s.step for s in ring.blob.state] == [1] and \
            [s.step for s in state.blob.state] == [0]
        host = load(queue_model(args.rows, args.width, False), tmp, "host")
        q = np.zeros((args.rows, args.width), np.float32)
        out = {"q_out": np.empty_like(q)}
        kb = args.rows * args.width * 4 / 1024
        print(f"queue of {args.rows} x {args.width} float32 ({kb:.0f} KiB), median of "
              f"{args.runs} runs, KEEL_THREADS={os.environ.get('KEEL_THREADS', 'all')}:")
        print(f"  state, ring (new row and its mirror written)  "
              f"{median_us(lambda: ring.run({'x': x}), args.runs):8.2f} us")
        print(f"  state, ping-pong (kept rows copied in the run) "
              f"{median_us(lambda: state.run({'x': x}), args.runs):8.2f} us")
        print(f"  new row only (no queue at all)                "
              f"{median_us(lambda: row.run({'x': x}), args.runs):8.2f} us")

        def fed_back():
            host.run({"x": x, "q": q}, out=out)
            np.copyto(q, out["q_out"])
        print(f"  queue as io, fed back by the host             "
              f"{median_us(fed_back, args.runs):8.2f} us")


if __name__ == "__main__":
    main()
