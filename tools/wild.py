"""The corpus of public models (tests/wild.py) measured: docs/wild.md's table.

  python tools/wild.py [--models NAME,...] [--runs 20] [--no-bench]

Fetch the corpus first (`python scripts/fetch_wild.py`). For each model: its op types, the
`cpu` compile's wall time (with whatever KEEL_CACHE_DIR holds: give an empty one for a cold
compile), keel's max abs error against onnxruntime on the corpus feeds, and, unless --no-bench,
median ms a run of keel and of onnxruntime, both at 1 thread, in interleaved blocks (as
tools/bench.py). A model keel refuses prints its one-line error instead. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from compiler.blob import write_blob  # noqa: E402
from compiler.errors import CompileError  # noqa: E402
from compiler.pipeline import compile_model  # noqa: E402
from runner import Model  # noqa: E402
from tests.wild import BY_NAME, CORPUS, Entry  # noqa: E402
from tools.bench import BLOCK, ORT_SPIN_S, machine  # noqa: E402
from tools.cli import timed  # noqa: E402


def op_types(entry: Entry) -> str:
    counts = collections.Counter(n.op_type for n in onnx.load(entry.path()).graph.node)
    return ", ".join(sorted(counts))


def max_error(got: dict, want: dict) -> float:
    return max(float(np.abs(got[k].astype(np.float64) - want[k].astype(np.float64)).max())
               for k in want)


def measure(entry: Entry, runs: int, bench: bool) -> dict:
    row = {"name": entry.name, "wheel": entry.wheel.spec, "ops": op_types(entry)}
    os.environ["KEEL_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="keel-wild-") as tmp:
        t = time.perf_counter()
        try:
            art = compile_model(str(entry.path()), "cpu", **entry.compile_options())
        except CompileError as e:
            return {**row, "error": str(e).splitlines()[0]}
        row["compile_s"] = time.perf_counter() - t
        write_blob(art, f"{tmp}/m.blob")
        model = Model.load(f"{tmp}/m.blob")
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
    sess = ort.InferenceSession(str(entry.path()), so, providers=["CPUExecutionProvider"])
    feeds, keel_feeds = entry.reference_feeds(), entry.random_feeds()
    names = [o.name for o in sess.get_outputs()]
    want = dict(zip(names, sess.run(names, feeds)))
    row["max_err"] = max_error(model.run(keel_feeds), want)
    if bench:
        for n, a in keel_feeds.items():
            model.input_view(n)[...] = a
        out = {n: np.empty(s, d) for n, (s, d) in model.outputs.items()}
        keel, ref = [], []
        for _ in range(max(runs // BLOCK, 1)):
            time.sleep(ORT_SPIN_S)
            keel += timed(lambda: model.run(out=out), BLOCK)
            ref += timed(lambda: sess.run(names, feeds), BLOCK)
        row["keel_ms"], row["ort_ms"] = statistics.median(keel) * 1e3, statistics.median(ref) * 1e3
    model.close()
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| model | wheel | ops | compile (s) | max abs err | keel ms | ort ms | ort/keel |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['wheel']} | {r['ops']} | refused: "
                         f"`{r['error']}` | | | | |")
            continue
        speed = (f"{r['keel_ms']:.2f} | {r['ort_ms']:.2f} | {r['ort_ms'] / r['keel_ms']:.2f}"
                 if "keel_ms" in r else "| |")
        lines.append(f"| {r['name']} | {r['wheel']} | {r['ops']} | {r['compile_s']:.1f} | "
                     f"{r['max_err']:.2g} | {speed} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="all", help="comma-separated corpus names, or all")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--no-bench", action="store_true", help="compile and check only")
    args = ap.parse_args(argv)
    names = [e.name for e in CORPUS] if args.models == "all" else args.models.split(",")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown models {unknown}; the corpus has {sorted(BY_NAME)}")
    absent = [n for n in names if not BY_NAME[n].path().is_file()]
    if absent:
        print(f"not fetched: {absent}; run python scripts/fetch_wild.py", file=sys.stderr)
        return 2
    print(f"# {machine()}", flush=True)
    rows = []
    for n in names:
        rows.append(measure(BY_NAME[n], args.runs, not args.no_bench))
        print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
