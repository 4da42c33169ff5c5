"""fp16 safety (compiler/codegen/ranges.py): `--calibrate` keeps in fp32 every tensor that sample
inputs push beyond half's safe range, with the kernels that would compute such values in half;
without calibration, `--float16` says ranges are unchecked.

The STFT/log-mel front end (models/audio_frontend.py, int16-scale audio) overflows half in its
spectrum and mel energies: `--target qcom --float16` returns NaN, and with --calibrate matches
fp32 within fp16 tolerance, run in IEEE half (tests/halfhost.py: clang's _Float16, as the mock
KGSL executes half programs; PoCL has no cl_khr_fp16) and through device="qcom" on the mock KGSL.
Tolerance: 1e-3 relative + 2e-2 absolute on outputs up to ~15: half's spacing there is 2^-7 =
7.8e-3, and the dB values pass through a few half roundings (the log's result stored, the
offset, the head conv's inputs); measured 2.3e-3 (mel) and 5.5e-3 (score)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from compiler.blob import write_blob
from compiler.errors import CompileError
from compiler.pipeline import compile_model
from models import audio_frontend
from runner import Model
from tests import halfhost
from tests.deps import needs_tool
from tests.graphs import assert_close, keel_run, make_model, ort_run
from tests.test_opencl import light_case, needs_opencl

REPO = Path(__file__).resolve().parent.parent
RTOL, ATOL = 1e-3, 2e-2
needs_half_host = needs_tool("clang-19", halfhost.CLANG)


def _calibration() -> dict:
    clips = [audio_frontend.speech_like(8000, seed, loud)
             for seed, loud in enumerate((0.1, 0.3, 0.6, 1.0))]
    return {"audio": np.stack(clips)}


@pytest.fixture(scope="module")
def front_end():
    """(model, a clip none of the calibration samples is, onnxruntime's fp32 outputs)."""
    model = audio_frontend.build()
    feeds = {"audio": audio_frontend.speech_like(8000, seed=7, loudness=0.8)}
    return model, feeds, ort_run(model, feeds)


@needs_half_host
def test_front_end_in_half_overflows_without_calibration(front_end):
    model, feeds, _ = front_end
    art = compile_model(model, "qcom", float16=True)
    assert art.meta["fp16_ranges"] == {"calibrated": False, "samples": 0, "safe_max": 2.0 ** 14,
                                       "kernels_fp32": 0, "kept_fp32": []}
    got = halfhost.run(art, feeds)
    assert np.isnan(got["mel"]).any() and np.isnan(got["score"]).all()


@needs_half_host
def test_front_end_with_calibration_keeps_the_spectrum_in_fp32_and_matches_fp32(front_end):
    model, feeds, want = front_end
    art = compile_model(model, "qcom", float16=True, calibration=_calibration())
    report = art.meta["fp16_ranges"]
    assert report["calibrated"] and report["samples"] == 4
    kept = {(k["node"], k["op_type"]) for k in report["kept_fp32"]}
    assert kept == {("stft", "STFT"), ("mel_filterbank", "MatMul")}
    assert all(k["largest"] > 2.0 ** 14 for k in report["kept_fp32"])
    # the log-mel and the head stay half: only what overflows is kept
    arena = [b for b in art.buffers if b.region == "arena" and b.dtype.startswith("float")]
    assert sum(b.dtype == "float32" for b in arena) == len(report["kept_fp32"])
    assert sum(b.dtype == "float16" for b in arena) >= 4
    got = halfhost.run(art, feeds)
    for name in want:
        assert_close(got[name], want[name], RTOL, ATOL, f"{name}, fp16 with --calibrate")


@needs_half_host
@needs_opencl
def test_calibrated_front_end_through_the_qcom_device_on_the_mock_kgsl(front_end, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("KEEL_KGSL", "mock")
    model, feeds, want = front_end
    write_blob(compile_model(model, "qcom", float16=True, calibration=_calibration()),
               tmp_path / "fe.blob")
    got = Model.load(tmp_path / "fe.blob", device="qcom").run(feeds)
    for name in want:
        assert_close(got[name], want[name], RTOL, ATOL, f"{name}, qcom mock")


def _square_mean_model():
    """y = (mean(r^2) + max(r)) / 1000, r = relu(x @ w): r reaches several hundred and is
    stored in half (two kernels read it), its square some hundred thousand: the product inside
    the mean, computed in half from two half operands, overflows; the mean itself fits once
    divided."""
    w = np.full((64, 32), 8.0, np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Mul", ["r", "r"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["m"], axes=[1], keepdims=0),
             helper.make_node("ReduceMax", ["r"], ["top"], axes=[1], keepdims=0),
             helper.make_node("Add", ["m", "top"], ["s"]),
             helper.make_node("Div", ["s", "k"], ["y"])]
    return make_model(nodes, [("x", (8, 64), np.float32)], [("y", (8,), np.float32)],
                      {"w": w, "k": np.array(1000.0, np.float32)})


@needs_half_host
def test_a_product_beyond_half_inside_a_reduction_computes_in_fp32():
    model = _square_mean_model()
    x = np.abs(np.random.default_rng(0).standard_normal((8, 64))).astype(np.float32)
    want = ort_run(model, {"x": x})["y"]
    plain = halfhost.run(compile_model(model, "qcom", float16=True), {"x": x})["y"]
    assert np.isinf(plain).all()
    art = compile_model(model, "qcom", float16=True, calibration={"x": x[None] * 1.1})
    assert art.meta["fp16_ranges"]["kernels_fp32"] >= 1
    assert_close(halfhost.run(art, {"x": x})["y"], want, 2e-3, 1e-2, "mean of squares")


@needs_half_host
def test_onnx_light_squeezenet_runs_in_half_with_calibration():
    """onnx's light squeezenet (random weights) drives its activations to ~1e10: in half every
    output is NaN (docs/qcom.md). Calibrated on its one shipped input (the only sample there
    is), 20 of its tensors stay fp32 and its output is onnx's stored one."""
    model, feeds, want = light_case("squeezenet")
    ((name, x),) = feeds.items()
    (plain,) = halfhost.run(compile_model(model, "qcom", float16=True), feeds).values()
    assert np.isnan(plain).all()
    art = compile_model(model, "qcom", float16=True, calibration={name: x})
    assert len(art.meta["fp16_ranges"]["kept_fp32"]) == 20
    (got,) = halfhost.run(art, feeds).values()
    assert_close(got, want, 1e-3, 1e-7, "squeezenet fp16 with --calibrate")


def test_a_weight_beyond_half_stays_fp32_without_calibration():
    """Weights are known: one holding 1e5 would be stored as inf in half."""
    w = np.array([1e5, 2.0, -3e5, 0.5], np.float32)
    model = make_model([helper.make_node("Mul", ["x", "w"], ["y"])],
                       [("x", (4,), np.float32)], [("y", (4,), np.float32)], {"w": w})
    art = compile_model(model, "cpu-avx2", float16=True)
    (weight,) = [b for b in art.buffers if b.region == "weights"]
    assert weight.dtype == "float32"
    x = np.ones(4, np.float32)
    assert_close(keel_run(model, {"x": x}, "cpu-avx2", float16=True)["y"], w * x, 0, 0)


def test_bad_calibration_data_names_the_input_and_the_shape():
    model = audio_frontend.build()
    with pytest.raises(CompileError, match=r"calibration data has no input\(s\) \['audio'\]"):
        compile_model(model, "qcom", float16=True, calibration={"wave": np.zeros((1, 8000))})
    with pytest.raises(CompileError, match=r"input 'audio': shape \(2, 7999\), expected "
                                           r"\(1, 8000\) or \(samples, \*\(1, 8000\)\)"):
        compile_model(model, "qcom", float16=True, calibration={"audio": np.zeros((2, 7999))})


def test_compile_cli_says_ranges_are_unchecked_or_which_tensors_stay_fp32(tmp_path):
    subprocess.run([sys.executable, "-m", "models.audio_frontend", "-o", tmp_path / "fe.onnx",
                    "--calibration", tmp_path / "cal.npz"], cwd=REPO, check=True, timeout=120)
    base = [sys.executable, "tools/compile.py", tmp_path / "fe.onnx", "-o", tmp_path / "fe.blob",
            "--target", "qcom", "--float16"]
    plain = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    assert "fp16: activation ranges are unchecked (no --calibrate)" in plain.stderr
    cal = subprocess.run(base + ["--calibrate", tmp_path / "cal.npz"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert cal.returncode == 0, cal.stderr
    assert "fp16: ranges calibrated on 4 sample(s): 4 tensor(s) beyond +-16384 stay fp32" in \
        cal.stderr
    assert "STFT node 'stft': largest |x|" in cal.stderr
    assert "MatMul node 'mel_filterbank': largest |x|" in cal.stderr
    bad = subprocess.run(base[:-1] + ["--calibrate", tmp_path / "cal.npz"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--calibrate needs --float16" in bad.stderr
    cpu = subprocess.run(base[:5] + ["--target", "cpu-avx2", "--float16", "--calibrate",
                                     tmp_path / "cal.npz"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert cpu.returncode == 0 and "--target cpu-avx2 keeps activations in fp32" in cpu.stderr


@pytest.mark.slow
def test_openpilot_shaped_model_stays_all_fp16_with_calibration():
    """Its values stay far inside half's range wherever half compute would compute them (a
    SiLU's exp passes 2^14, but exp and the division after it compute in fp32 anyway)."""
    from models.openpilot import INPUTS, make_openpilot
    rng = np.random.default_rng(0)
    cal = {name: np.stack([rng.integers(0, 256, shape).astype(dtype) if dtype == np.uint8
                           else rng.standard_normal(shape).astype(dtype) for _ in range(2)])
           for name, (dtype, shape) in INPUTS.items()}
    art = compile_model(make_openpilot(float16=True), "qcom", float16=True, calibration=cal)
    report = art.meta["fp16_ranges"]
    assert report["calibrated"] and report["kept_fp32"] == [] and report["kernels_fp32"] == 0
    floats = [b for b in art.buffers if b.region in ("arena", "weights")
              and b.dtype.startswith("float")]
    assert floats and all(b.dtype == "float16" for b in floats)
