"""Models whose weights live outside the ONNX file, and (opt-in) models of gigabytes
(docs/wild.md, "Big models").

The small external-data models run in CI. The gigabyte ones cannot be made cheap: generating,
compiling and loading 1.6-2.2 GB of weights takes minutes and up to 7 GB of memory on a 2-core
machine, so they run only with KEEL_BIG_MODELS=1 (tools/big_model.py makes the same models by
hand). Tolerance: a chain of float32 MatMuls summed in another order than onnxruntime's, on
unit-scale activations. 3 layers of 256 terms: rtol=1e-4, atol=1e-5. 33 layers of 4096 terms:
each layer's sums differ by ~sqrt(4096) float32 ulps, compounding through depth (measured: max
abs error 2.6e-5, 2026-11-26), so atol=1e-4 and rtol=1e-3.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from compiler.blob import write_blob
from compiler.errors import CompileError
from compiler.pipeline import compile_model
from runner import Model
from tests.graphs import assert_close
from tools.big_model import make

BIG = os.environ.get("KEEL_BIG_MODELS") == "1"
COMPILE = Path(__file__).parent.parent / "tools" / "compile.py"
needs_big = pytest.mark.skipif(not BIG, reason="opt-in: KEEL_BIG_MODELS=1 (minutes, GBs)")


def _matches_onnxruntime(onnx_path, blob_path, width: int, rtol=1e-4, atol=1e-5) -> None:
    x = np.random.default_rng(1).standard_normal((1, width)).astype(np.float32)
    m = Model.load(blob_path)
    got = next(iter(m.run({"x": x}).values()))
    m.close()
    want = ort.InferenceSession(str(onnx_path)).run(None, {"x": x})[0]
    assert_close(got, want, rtol=rtol, atol=atol)


def test_external_weights_compile_and_match_onnxruntime(tmp_path):
    path = tmp_path / "ext.onnx"
    make(str(path), layers=3, width=256, external=True)
    write_blob(compile_model(str(path), "cpu-avx2"), tmp_path / "ext.blob")
    _matches_onnxruntime(path, tmp_path / "ext.blob", 256)


def test_external_weights_cut_short_are_a_compile_error_naming_the_initializer(tmp_path):
    path = tmp_path / "ext.onnx"
    make(str(path), layers=2, width=64, external=True)
    with open(f"{path}.data", "r+b") as f:
        f.truncate(64 * 64 * 4 + 100)  # the second weight's bytes end early
    with pytest.raises(CompileError, match=r"w1"):
        compile_model(str(path), "cpu-avx2")


def _compile_peak_rss(onnx_path, blob_path) -> int:
    """The compile in a child process (tools/compile.py); its peak RSS in bytes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run([sys.executable, str(COMPILE), str(onnx_path), "-o", str(blob_path),
                    "--target", "cpu-avx2"], check=True, capture_output=True)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert peak > before, "another child had a higher peak: measure in a fresh process"
    return peak * 1024


@needs_big
def test_a_model_over_2_gb_of_external_weights_loads_compiles_and_runs(tmp_path):
    path = tmp_path / "big.onnx"
    make(str(path), layers=33, width=4096, external=True)
    assert os.path.getsize(f"{path}.data") > 2 ** 31
    _compile_peak_rss(path, tmp_path / "big.blob")
    _matches_onnxruntime(path, tmp_path / "big.blob", 4096, rtol=1e-3, atol=1e-4)


@needs_big
@pytest.mark.xfail(strict=True, reason="peak RSS is 2.08x the ONNX file (docs/wild.md): the "
                   "frontend's arrays and the weights region are alive at once; the issue asks "
                   "for 2x")
def test_a_1_5_gb_model_compiles_within_twice_its_size(tmp_path):
    path = tmp_path / "big.onnx"
    make(str(path), layers=24, width=4096, external=False)
    assert _compile_peak_rss(path, tmp_path / "big.blob") <= 2 * os.path.getsize(path)
