"""The `dsp` device on a comma 3X's cDSP through FastRPC (dsp/fastrpc.py), proven on the hardware.

    python -m pytest -q -s tests/device/test_dsp.py

Skipped elsewhere; the same programs, runtime and device run under qemu-hexagon in
tests/test_dsp.py (KEEL_FASTRPC=mock). The skel library (dsp/skel.c) is served to the DSP from
memory by the host's reverse-RPC listener: built here if clang-19 is installed, else set
KEEL_DSP_SKEL to one built elsewhere with `python -m dsp.build` (docs/dsp.md).
"""
import os
import time

import numpy as np
import pytest

from dsp import fastrpc
from tests.deps import needs_hardware
from tests.graphs import assert_close, ort_run, random_feeds

pytestmark = needs_hardware("a Qualcomm device with FastRPC", None if os.path.exists(
    fastrpc.RPC_NODE) else f"{fastrpc.RPC_NODE} absent")
RUNS = 50


@pytest.mark.parametrize("name", ["int8", "conv"])
def test_model_matches_onnxruntime_on_the_cdsp_and_prints_latency(name, doctor_dsp, tmp_path,
                                                                  monkeypatch):
    from compiler.blob import write_blob
    from compiler.pipeline import compile_model
    from runner import Model
    from tests.test_dsp import conv_model, int8_model
    monkeypatch.delenv("KEEL_FASTRPC", raising=False)  # the hardware, never the mock
    model = {"int8": int8_model, "conv": conv_model}[name]()
    write_blob(compile_model(model, target="dsp"), tmp_path / "m.blob")
    m, feeds = Model.load(tmp_path / "m.blob"), random_feeds(model, seed=1)
    got, want = m.run(feeds), ort_run(model, feeds)
    for k in want:  # tests/test_dsp.py's bounds: exact for int8, float32 reordering otherwise
        if want[k].dtype.kind == "f":
            assert_close(got[k], want[k], 1e-4, 1e-6, f"{name} {k}")
        else:
            np.testing.assert_array_equal(got[k], want[k])
    t = time.perf_counter()
    for _ in range(RUNS):
        m.run(feeds)
    print(f"{name}: {(time.perf_counter() - t) / RUNS * 1e3:.3f} ms per run() on the cDSP")
