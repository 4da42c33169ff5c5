"""ONNX conformance coverage: run tests/test_onnx_backend.py and tabulate the node tests per op.

    python tools/onnx_coverage.py [--out docs/onnx_coverage.md] [-- extra pytest args]

Prints a per-op table (passed, failed, excluded, and the reason for each exclusion or known
failure) and writes it as markdown. Known failures (XFAIL in the test file) count as failed; the
pass rate is passed / (passed + failed) over the in-scope node tests.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections import defaultdict  # noqa: E402

import pytest  # noqa: E402

TEST_FILE = "tests/test_onnx_backend.py"
NOTES = """\
## How values are computed

- float32 and float64 compute in their own precision; int32/int64 and the other integer types
  compute in their own width (integer Div truncates toward zero, Mod follows `fmod`).
- float16 is a storage type on CPU: every float16 operation is computed in float32 and rounded
  back to float16 after each op (compiler/codegen/transcendental.py `promote_half`); reductions
  accumulate in float32, and MatMul/Gemm/Conv on float16 sum exact float32 products and round
  once, as numpy and onnxruntime do.
- Transcendentals (exp, log, sin, erf, atan, ...) are polynomial lowerings with no libm; see
  compiler/codegen/transcendental.py for their accuracy bounds.
- Graph inputs that an op needs as values at compile time (a Reshape's shape, a reduction's
  axes, Pad's pads, TopK's k, ...) are bound as constants by the backend from the values each
  run receives (keel/backend.py); keel compiles static shapes.
- Ops that ONNX defines by a function body (Attention, the losses, RMSNormalization,
  RotaryEmbedding, ...) and that keel has no direct implementation of are built from that body.
- Control flow: `If` is built at compile time. A condition known then (a constant, a value
  computed from shapes, or an input frozen with `--input-value NAME=V` /
  `compile_model(input_values=...)`) builds only the branch it takes, so the branches may differ
  in anything. A condition known only at run time builds both branches and selects each output
  with a Where: both run, so their outputs must agree in shape and dtype, and otherwise the
  compile is refused with a CompileError naming the If node, its outputs' two shapes and the
  inputs its condition depends on. `Loop` and `Scan` are unrolled (compiler/onnx/control.py):
  a Loop whose trip count and per-iteration condition are known at compile time (a `for` loop,
  a Range's function body; a trip count from a graph input can be frozen with --input-value),
  and a Scan of opset 9 or later over its static scan axis, at most 1024 iterations each. A
  Loop whose condition is computed from run-time values, one beyond 1024 iterations, one that
  runs no iteration but has scan outputs, and Scan-8 (a batch axis and sequence_lens) are
  refused with a CompileError naming the node.
- Out of scope, and why: training ops; sequence/optional/map and string types; Scan-8;
  float8/int4/int2/float4/bfloat16 types; the ai.onnx.ml and preview domains; and ops whose
  output shape depends on input values (NonZero, Compress, Unique, NonMaxSuppression,
  ImageDecoder), since keel compiles static shapes.
"""


class Outcomes:
    """pytest plugin: the outcome of every test (works under pytest-xdist too)."""

    def __init__(self):
        self.result: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.rsplit("::", 1)[-1]
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            if hasattr(report, "wasxfail"):
                self.result[name] = "xfail"
            elif report.outcome == "skipped":
                self.result[name] = "skipped:" + str(report.longrepr[-1] if isinstance(
                    report.longrepr, tuple) else report.longrepr)
            else:
                self.result[name] = report.outcome


def tested_op(case, names: dict) -> str:
    """The op a node test is about: its only node, else the node whose name prefixes the test
    name; an *_expanded test belongs to the op of the test it expands."""
    base = re.sub(r"_expanded(_ver\d+)?$", "", case.name)
    if base != case.name and base in names:
        return tested_op(names[base], names)
    ops = [n.op_type for n in case.model.graph.node]
    if len(set(ops)) == 1:
        return ops[0]
    key = case.name[len("test_"):].replace("_", "").lower()
    return max(ops, key=lambda o: (key.startswith(o.lower()), len(o)))


def _tally(cases, names: dict, result: dict, suite) -> dict[str, dict]:
    """Per tested op: how many of its node tests passed, failed or were excluded, and why."""
    rows: dict[str, dict] = defaultdict(lambda: {"passed": 0, "failed": 0, "excluded": 0,
                                                 "reasons": set()})
    for case in cases:
        got = result.get(case.name + "_cpu")
        if got is None:
            continue
        row = rows[tested_op(case, names)]
        if got == "passed":
            row["passed"] += 1
        elif got.startswith("skipped"):
            row["excluded"] += 1
            row["reasons"].add("excluded: " + (suite.excluded_reason(case.name + "_cpu") or got))
        else:
            row["failed"] += 1
            why = suite.xfail_reason(case.name + "_cpu") if got == "xfail" else "FAILS (unexpected)"
            row["reasons"].add("fails: " + why)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/onnx_coverage.md")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args()
    from onnx.backend.test.loader import load_model_tests

    from tests import test_onnx_backend as suite
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = load_model_tests(kind="node")
    names = {c.name: c for c in cases}
    outcomes = Outcomes()
    start = time.time()
    pytest.main(["-q", "-p", "no:warnings", "-p", "no:cacheprovider", TEST_FILE,
                 "-k", "NodeModel or RealModel", *args.pytest_args], plugins=[outcomes])
    seconds = time.time() - start

    rows = _tally(cases, names, outcomes.result, suite)
    passed = sum(r["passed"] for r in rows.values())
    failed = sum(r["failed"] for r in rows.values())
    excluded = sum(r["excluded"] for r in rows.values())
    real = {k: v for k, v in outcomes.result.items() if k.startswith("test_") and
            k[:-len("_cpu")] not in names and k.endswith("_cpu")}

    command = "python tools/onnx_coverage.py" + (" -- " + " ".join(args.pytest_args)
                                                  if args.pytest_args else "")
    rate = 100.0 * passed / max(passed + failed, 1)
    lines = [
        "# ONNX conformance coverage",
        "",
        f"Generated by `{command}` (onnx {_onnx_version()}, {seconds:.0f} s).",
        "",
        f"**In-scope node tests: {passed} / {passed + failed} pass ({rate:.1f}%)**; "
        f"{excluded} node tests are out of scope (excluded, reasons below).",
        "",
        "Real-model tests (`light` models): "
        + ", ".join(f"{k[len('test_'):-len('_cpu')]} {v}" for k, v in sorted(real.items())),
        "",
        NOTES,
        "## Per op",
        "",
        "| op | passed | failed | excluded | notes |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for op in sorted(rows, key=str.lower):
        r = rows[op]
        notes = "; ".join(sorted(r["reasons"])).replace("|", "\\|")
        lines.append(f"| {op} | {r['passed']} | {r['failed']} | {r['excluded']} | {notes} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    return 0


def _onnx_version() -> str:
    import onnx
    return onnx.__version__


if __name__ == "__main__":
    sys.exit(main())
