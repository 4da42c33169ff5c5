"""The corpus of public models (tests/wild.py, docs/wild.md) against onnxruntime: each on the CPU,
and where it fits on OpenCL (PoCL), qcom (KEEL_KGSL=mock) and the emulated DSP
(KEEL_FASTRPC=mock). The models are fetched by scripts/fetch_wild.py (scripts/setup.sh runs it);
without them the tests skip locally and fail in CI, naming the script.

CI compiles the corpus for cpu-avx2 (the x86-64-v3 half of a `cpu` blob, as the ONNX node suite
does; tests/test_variants.py covers the two-variant blob, tools/wild.py measures it). Blobs are
cached by tests/graphs.py:compiled_blob. The other targets are `slow`, and CI runs them for the
light models only (tests/wild.py `light`); KEEL_WILD_ALL=1 runs every model on every target it
fits (33 runs, minutes of PoCL kernel builds and qemu). Each entry states its
tolerance and why (tests/wild.py); the feeds are the corpus's own (audio-scaled samples, pixel
ranges, byte values), two seeds on the CPU.
"""
from __future__ import annotations

import os
import re

import numpy as np
import onnx
import pytest

from compiler.errors import CompileError
from compiler.pipeline import compile_model
from dsp import build
from runner import Model
from tests.deps import needs, opencl_missing
from tests.graphs import assert_close, compiled_blob
from tests.wild import CORPUS, Entry, missing

ABSENT = missing()
ALL = os.environ.get("KEEL_WILD_ALL") == "1"  # every model on every target it fits
pytestmark = needs("the model corpus (python scripts/fetch_wild.py)",
                   f"not fetched: {', '.join(ABSENT)}" if ABSENT else None)
SUPPORTED = [e for e in CORPUS if not e.error]
KINDS = {"vision": ("vision", "classifier"), "OCR": ("OCR",), "audio": ("audio", "voice", "wake"),
         "detection": ("detection",), "recurrent": ("LSTM",)}
# the emulated devices, each with what it needs from the machine
DEVICES = {"opencl": ({}, [needs("pocl-opencl-icd", opencl_missing())]),
           "qcom": ({"KEEL_KGSL": "mock"}, [needs("pocl-opencl-icd", opencl_missing())]),
           "dsp": ({"KEEL_FASTRPC": "mock"}, [needs("qemu-user, clang-19, lld-19",
                                                    build.missing())])}


def _check(entry: Entry, target: str, seeds=(0,)) -> None:
    model = onnx.load(entry.path())
    m = Model.load(compiled_blob(model, target=target, **entry.compile_options()))
    import onnxruntime as ort
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    for seed in seeds:
        want = dict(zip(names, sess.run(names, entry.reference_feeds(seed))))
        got = m.run(entry.random_feeds(seed))
        for name in names:
            assert_close(got[name], want[name], entry.rtol, entry.atol,
                         f"{entry.name} {target} {name} (seed {seed})")
    m.close()


def test_the_corpus_covers_what_issue_35_asks():
    assert len(SUPPORTED) >= 12
    for kind, words in KINDS.items():
        assert any(any(w in e.kind for w in words) for e in SUPPORTED), kind
    assert sum(e.dynamic for e in SUPPORTED) >= 3
    assert sum(e.control_flow for e in SUPPORTED) >= 2
    assert len({e.wheel.package for e in CORPUS}) >= 6
    assert all(e.why_tolerance for e in SUPPORTED)


@pytest.mark.parametrize("entry", SUPPORTED, ids=lambda e: e.name)
def test_model_matches_onnxruntime_on_the_cpu(entry):
    _check(entry, "cpu-avx2", seeds=(0, 1))


@pytest.mark.slow
@pytest.mark.parametrize("entry,target", [
    pytest.param(e, t, id=f"{e.name}-{t}", marks=DEVICES[t][1])
    for e in SUPPORTED for t in e.targets if t != "cpu" and (e.light or ALL)])
def test_model_matches_onnxruntime_on(entry, target, monkeypatch):
    for var, value in DEVICES[target][0].items():
        monkeypatch.setenv(var, value)
    _check(entry, target)


@pytest.mark.parametrize("entry", [e for e in CORPUS if e.error], ids=lambda e: e.name)
def test_a_model_keel_cannot_support_fails_with_one_line_naming_the_op(entry):
    with pytest.raises(CompileError) as info:
        compile_model(str(entry.path()), "cpu-avx2", **entry.compile_options())
    message = str(info.value)
    assert "\n" not in message and re.search(entry.error, message), message
