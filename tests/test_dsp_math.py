"""The DSP's math (dsp/math.c, compiler/toolchain.py's import check) and its default deadline
under emulation, on the emulated DSP (KEEL_FASTRPC=mock).

Tolerances: the square roots are correctly rounded, so they are compared bit for bit with numpy's
(IEEE sqrt is exact to the last bit everywhere). The recurrent model runs float32 on the DSP's
scalar units, with exp-based sigmoid and tanh polynomials (compiler/codegen/transcendental.py, a
few ulp each) fed back through 16 time steps and a LayerNormalization; rtol=1e-4 with
atol=1e-5 is test_dsp.py's float bound with atol raised for outputs that pass through zero
(measured: max abs error 3.0e-7 on outputs up to 1.0 over five feeds, 2026-11-26).
"""
from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import helper

from compiler.errors import CompileError
from compiler.pipeline import compile_model
from dsp import build
from runner import Model
from runner.model import DEFAULT_TIMEOUT_MS
from runner.targets import DSP_C_LIBRARY
from tests.deps import needs
from tests.graphs import (assert_close, compiled_blob, hostile_floats, make_model, ort_run,
                          single_node_model)
from tests.test_compiler import check_trig, trig_model

pytestmark = [needs("qemu-user, clang-19, lld-19", build.missing()),
              pytest.mark.xdist_group("dsp")]


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    monkeypatch.setenv("KEEL_FASTRPC", "mock")
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)


def recurrent_model(steps: int = 16, feats: int = 24, hidden: int = 32) -> onnx.ModelProto:
    """LSTM -> LayerNormalization -> MatMul -> Sigmoid: a voice-activity net in small, whose
    normalization needs a square root the v65 has no instruction for."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B"], ["h", "h_last"], hidden_size=hidden),
             helper.make_node("Squeeze", ["h", "axes"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["n"], axis=-1),
             helper.make_node("MatMul", ["n", "w_out"], ["logit"]),
             helper.make_node("Sigmoid", ["logit"], ["y"])]
    inits = {"W": rng.standard_normal((1, 4 * hidden, feats)).astype(np.float32) * 0.3,
             "R": rng.standard_normal((1, 4 * hidden, hidden)).astype(np.float32) * 0.3,
             "B": rng.standard_normal((1, 8 * hidden)).astype(np.float32) * 0.1,
             "axes": np.array([1, 2], np.int64),
             "gamma": rng.uniform(0.5, 1.5, hidden).astype(np.float32),
             "beta": rng.standard_normal(hidden).astype(np.float32) * 0.1,
             "w_out": rng.standard_normal((hidden, 2)).astype(np.float32) * 0.5}
    return make_model(nodes, [("x", (steps, 1, feats), np.float32)],
                      [("y", (steps, 2), np.float32)], inits)


def test_recurrent_model_runs_at_the_default_deadline_and_matches_onnxruntime():
    model = recurrent_model()
    m = Model.load(compiled_blob(model, target="dsp"))
    assert m.timeout_ms == DEFAULT_TIMEOUT_MS * 100  # the emulated DSP's scaled default
    for seed in (1, 2):
        feeds = {"x": np.random.default_rng(seed).standard_normal((16, 1, 24)).astype(np.float32)}
        assert_close(m.run(feeds)["y"], ort_run(model, feeds)["y"], rtol=1e-4, atol=1e-5)
    m.close()


def _special(bits: int, dtype) -> np.ndarray:
    """Zeros, subnormals, ones, the largest finite, infinities, NaNs, negatives, then random bit
    patterns: every path of dsp/math.c's square roots."""
    info = np.finfo(dtype)
    edge = [0.0, -0.0, info.smallest_subnormal, info.smallest_subnormal * 3, info.tiny,
            info.tiny * 0.75, 1.0, 2.0, 4.0, 0.25, 3.0, info.max, np.inf, -np.inf, np.nan, -1.0,
            -info.smallest_subnormal]
    rng = np.random.default_rng(bits)
    uint = np.uint32 if bits == 32 else np.uint64
    random = rng.integers(0, 2 ** bits, 4096 - len(edge), dtype=uint).view(dtype)
    return np.concatenate([np.array(edge, dtype), np.abs(random)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_square_roots_are_correctly_rounded(dtype, tmp_path):
    """float32 Sqrt calls __hexagon_sqrtf, float64 Sqrt calls sqrt: both dsp/math.c's."""
    x = _special(np.dtype(dtype).itemsize * 8, dtype)
    model = single_node_model("Sqrt", [(x.shape, dtype)])
    got = Model.load(compiled_blob(model, target="dsp")).run({"x0": x})["y"]
    with np.errstate(invalid="ignore"):
        want = np.sqrt(x)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite].view(f"u{x.itemsize}"),
                                  want[finite].view(f"u{x.itemsize}"))


def test_trig_and_hyperbolics_are_within_a_few_ulp_at_every_magnitude():
    """The CPU's bounds (test_compiler.py TRIG_ULPS) on HVX: the Payne-Hanek reduction's high
    words come from vmpye/vmpyo (renderers/c.py vmulhi), its selects are vector muxes."""
    x = hostile_floats(np.float32)
    model = trig_model(x)
    m = Model.load(compiled_blob(model, target="dsp"))
    check_trig(x, m.run({"x": x}), ort_run(model, {"x": x}))


def test_an_op_the_dsp_runtime_cannot_run_is_a_compile_error_naming_it():
    model = single_node_model("Add", [((64,), np.float64), ((64,), np.float64)])
    with pytest.raises(CompileError, match=r"target 'dsp' cannot run float64 Add \(it calls "
                                           r"__hexagon_adddf3\): the DSP runtime does not "
                                           r"provide it"):
        compile_model(model, "dsp")


def test_the_emulated_runtime_provides_exactly_what_programs_may_import():
    """sim/dsp/runtime.c's LIBC table stands in for the DSP's C library: the compiler's check
    (runner/targets.py DSP_C_LIBRARY) must allow no more and no less than it resolves."""
    runtime = build.HERE.parent / "sim" / "dsp" / "runtime.c"
    table = runtime.read_text().split("LIBC[] = {")[1].split("};")[0]
    assert set(re.findall(r"EXPORT\((\w+)\)", table)) == DSP_C_LIBRARY
