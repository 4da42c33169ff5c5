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
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from compiler.blob import BlobWriter, write_blob
from compiler.errors import CompileError
from compiler.onnx import proto
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


# runs a tool's script and then reports the process's own peak RSS (VmHWM, since its exec).
# Not RUSAGE_CHILDREN: a forked child starts with its parent's high-water mark, and the test
# process has just generated the model (a 1.6 GB one peaks at several GB).
_PEAK = ("import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n"
         "    runpy.run_path(sys.argv[0], run_name='__main__')\nfinally:\n"
         "    print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')), "
         "file=sys.stderr)")


def _compile_peak_rss(onnx_path, blob_path, target="cpu-avx2") -> int:
    """The compile in a child process (tools/compile.py); its peak RSS in bytes."""
    done = subprocess.run([sys.executable, "-c", _PEAK, str(COMPILE), str(onnx_path), "-o",
                           str(blob_path), "--target", target], check=True,
                          capture_output=True, text=True)
    kib = done.stderr.strip().splitlines()[-1].split()[1]  # "VmHWM:   1858900 kB"
    return int(kib) * 1024


@needs_big
def test_a_model_over_2_gb_of_external_weights_loads_compiles_and_runs(tmp_path):
    path = tmp_path / "big.onnx"
    make(str(path), layers=33, width=4096, external=True)
    assert os.path.getsize(f"{path}.data") > 2 ** 31
    _compile_peak_rss(path, tmp_path / "big.blob")
    _matches_onnxruntime(path, tmp_path / "big.blob", 4096, rtol=1e-3, atol=1e-4)


@needs_big
@pytest.mark.parametrize("target", ["cpu-avx2", "cpu"])  # cpu: two variants, two packings
def test_a_1_5_gb_model_compiles_within_twice_its_size(tmp_path, target):
    path = tmp_path / "big.onnx"
    make(str(path), layers=24, width=4096, external=False)
    assert _compile_peak_rss(path, tmp_path / "big.blob", target) <= 2 * os.path.getsize(path)


def _streamed(onnx_path, blob_path) -> int:
    """Compile a model read as a big one (its weights mapped from its file) into a blob through
    the streaming writer (tools/compile.py's way); the compile's Python-heap peak in bytes."""
    tracemalloc.start()
    try:
        with BlobWriter(blob_path) as out:
            out.finish(compile_model(str(onnx_path), "cpu-avx2", writer=out))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_streaming_writers_peak_does_not_grow_with_the_weights(tmp_path, monkeypatch):
    # every model here is "big" (BIG_MODEL_BYTES lowered): its weights are mapped from the ONNX
    # file, each packed copy goes to the scratch file as it is made, the region is the blob
    # file; held in memory, the 8 layers' packed weights add 24 MiB over the 2 layers' (measured
    # with compile_model(path) and write_blob: 8 and 32 MiB; streamed: 4.3 and 4.2 MiB)
    monkeypatch.setattr(proto, "BIG_MODEL_BYTES", 1 << 20)
    peaks = {}
    for layers in (2, 8):
        path = tmp_path / f"m{layers}.onnx"
        make(str(path), layers=layers, width=1024, external=False)
        peaks[layers] = _streamed(path, tmp_path / f"m{layers}.blob")
        _matches_onnxruntime(path, tmp_path / f"m{layers}.blob", 1024)
    one_weight = 1024 * 1024 * 4
    assert peaks[8] - peaks[2] < one_weight, peaks
    assert not [p for p in tmp_path.iterdir() if ".spill" in p.name or ".tmp" in p.name]


def test_a_big_models_file_is_parsed_without_its_large_weights(tmp_path):
    path = tmp_path / "m.onnx"
    make(str(path), layers=2, width=1024, external=False)  # two 4 MiB weights
    data = path.read_bytes()
    stripped, where = proto._strip(data)
    lean, full = onnx.load_from_string(stripped), onnx.load_from_string(data)
    assert len(stripped) < len(data) - 2 * 4 * 1024 * 1024
    assert sorted(where) == [0, 1] and not any(t.raw_data for t in lean.graph.initializer)
    for i, t in enumerate(full.graph.initializer):
        start, size = where[i]
        assert data[start:start + size] == t.raw_data
        t.ClearField("raw_data")
    assert lean == full  # nothing else changed
