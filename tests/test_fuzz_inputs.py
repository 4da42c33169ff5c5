"""The hostile-input fuzzer's CI mode (tests/fuzz_inputs.py; the long mode and its figures are in
docs/reliability.md). Each mutator runs in worker processes, so a segfault or a hang is reported
as the mutation that caused it instead of taking pytest down. KEEL_FUZZ_SEED picks other
mutations (default 0: the same ones every run)."""
from __future__ import annotations

import os

import pytest

from tests.fuzz_inputs import fuzz

SEED = int(os.environ.get("KEEL_FUZZ_SEED", "0"))

# (kind, mutations, outcomes that must occur): enough for each to reach past the first check
# (a resealed manifest that loads, an ONNX mutation that still compiles) in about 10 s each
CI = [("blob-raw", 300, ["typed BlobError"]),
      ("blob-header", 300, ["typed BlobError"]),
      ("blob-manifest", 300, ["typed BlobError", "loaded"]),
      ("onnx-bytes", 80, ["typed CompileError", "compiled, matches onnxruntime"]),
      ("onnx-graph", 40, ["typed CompileError"]),
      ("feeds", 10, ["ok"]),
      ("run-alias", 60, ["ok", "typed InputError"]),
      ("run-events", 15, ["ok"])]


@pytest.mark.parametrize("kind,count,expected", CI, ids=[c[0] for c in CI])
def test_mutations_give_correct_results_or_typed_errors(kind, count, expected):
    tally = fuzz(kind, count, SEED)
    assert tally["failures"] == [], f"replay: python -m tests.fuzz_inputs --kind {kind} " \
        f"--seed {SEED} --start <i> --count 1; failures: {tally['failures'][:5]}"
    answered = sum(v for k, v in tally.items() if k != "failures")
    assert answered == count, tally
    for outcome in expected:
        assert tally.get(outcome, 0) > 0, f"{kind}: no {outcome!r} outcome in {tally}"


def test_a_crashing_mutation_is_reported_not_fatal(monkeypatch):
    """The watchdog itself: a worker that dies mid-batch is a CRASH at the mutation it was on,
    and the batch goes on after it."""
    monkeypatch.setenv("KEEL_FUZZ_CRASH_AT", "3")
    tally = fuzz("blob-raw", 6, SEED)
    assert tally["failures"] == [(3, "CRASH (exit -11)")], tally
    assert sum(v for k, v in tally.items() if k not in ("failures", "CRASH")) == 5
