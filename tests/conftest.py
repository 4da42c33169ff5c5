"""Suite-wide policy: a fixed thread count, and no silent skips in CI (see tests/deps.py)."""
from __future__ import annotations

import os

import pytest

from tests.deps import CI, MISSING

# The runner's default is every core, which differs between machines: tests that care set
# KEEL_THREADS themselves (1 and 2), the rest run threaded at 2 on any machine.
os.environ["KEEL_THREADS"] = "2"
# keel.backend (the ONNX suite) compiles x86-64-v3 alone: the suite checks ops, not ISA levels,
# and a `cpu` blob (both levels) costs ~3x the compile of one cold (docs/perf.md, "One `cpu`
# blob"); tests/test_variants.py runs both levels against onnxruntime
os.environ["KEEL_BACKEND_TARGET"] = "cpu-avx2"
# every compile checks each stage's output and that no later stage changed it (compiler/spec.py)
os.environ.setdefault("KEEL_SPEC", "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI, a test skipped for a missing dependency fails, and its message names it."""
    report = (yield).get_result()
    if CI and report.skipped and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
        if MISSING in reason:
            report.outcome = "failed"
            report.longrepr = (f"CI refuses to skip: {reason.removeprefix('Skipped: ')} "
                               "(scripts/setup.sh installs it)")
