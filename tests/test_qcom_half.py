"""Item 8 of the qcom issue: the kernels keel renders for `--target qcom --float16`, executed with
IEEE half arithmetic (tests/halfhost.py: clang's _Float16, every operation rounded to half), so the
fp16 error the Adreno will show is measured, not guessed. Measured here (max abs error against
onnxruntime, fp16 weights and activations against fp32): conv_net 4.1e-3, mlp 1.2e-3,
softmax_rows 1.5e-4, openpilot-shaped 1.0e-2 on outputs up to 3.7, shufflenet 0; onnx's light
squeezenet overflows fp16 (its fp32 activations reach 1.4e10) and returns NaN, as it would on the
device. The openpilot-shaped model runs in half through device="qcom" on the mock KGSL
(tests/test_qcom_device.py, slow): the same kernels on the same executor, with the driver."""

import numpy as np
import onnx
import pytest
from onnx import helper

from compiler.pipeline import compile_model
from tests import halfhost
from tests.deps import needs_tool
from tests.graphs import assert_close, hostile_floats, make_model, ort_run, ulps
from tests.test_compiler import TRIG_EXACT, TRIG_ULPS, trig_model
from tests.test_opencl import LIGHT_DIR, conv_net, light_case, mlp, softmax_rows

pytestmark = needs_tool("clang-19", halfhost.CLANG)
HALF_MAX = 65504.0


def half_run(model, feeds, float16=True):
    return halfhost.run(compile_model(model, target="qcom", float16=float16), feeds)


def test_trig_and_hyperbolics_in_half_are_within_a_few_fp16_ulp_at_every_magnitude():
    """Adreno's kernels in half: sin and cos run whole in fp32 (codegen/half.py PROMOTE; the
    reduction's mul_hi in OpenCL's 64-bit long), so they are within an fp16 ulp up to 65504
    (measured 0.5). The ops around them run in half, each rounding by half an fp16 ulp: tan
    (one division) within 2 (measured 1.5), the hyperbolics' few half steps within 4 (measured
    3.2, Atanh)."""
    x = hostile_floats(np.float16)
    got = half_run(trig_model(x), {"x": x})
    for op in TRIG_ULPS:
        with np.errstate(all="ignore"):
            exact = TRIG_EXACT[op](x.astype(np.float64))
        err = ulps(got[op], exact)
        worst = int(np.argmax(err))
        bound = {"Sin": 1, "Cos": 1, "Tan": 2}.get(op, 4)
        assert err[worst] <= bound, (op, x[worst], got[op][worst], exact[worst])


def test_every_half_operation_rounds_to_half():
    """2048 + 1 + 1: each add rounds to half (2049 is not a half: ties to even, 2048), so the sum
    stays 2048; a float stand-in rounding once at the store would give 2050. The square of
    302 is past 65504 and overflows to inf."""
    nodes = [helper.make_node("Add", ["x", "a"], ["s"]), helper.make_node("Add", ["s", "a"], ["y"]),
             helper.make_node("Mul", ["y", "y"], ["z"])]
    model = make_model(nodes, [("x", (4,), "float16"), ("a", (4,), "float16")],
                       [("y", (4,), "float16"), ("z", (4,), "float16")])
    feeds = {"x": np.array([2048, 300, 100, 1], np.float16), "a": np.ones(4, np.float16)}
    got = half_run(model, feeds)
    assert "half v" in compile_model(model, target="qcom", float16=True).programs.decode()
    assert got["y"].tolist() == [2048, 302, 102, 3]
    assert got["z"].tolist() == [np.inf, np.inf, 10400, 9]  # 102 * 102 = 10404: a tie, to even
    x, a = feeds["x"], feeds["a"]  # numpy's float16 rounds each operation, to nearest even
    y = (x + a) + a
    with np.errstate(over="ignore"):
        assert np.array_equal(got["y"], y) and np.array_equal(got["z"], y * y)


def test_the_harness_runs_fp32_kernels_exactly():
    """The same harness on float kernels (images, launches, io slots) reproduces onnx's stored
    squeezenet output: what differs under --float16 is the arithmetic, not the harness."""
    model, feeds, want = light_case("squeezenet")
    got = list(half_run(model, feeds, float16=False).values())[0]
    assert_close(got, want, 1e-5, 1e-7, "squeezenet fp32 on the host harness")


@pytest.mark.parametrize("case,tol", [(conv_net, 1e-2), (mlp, 5e-3), (softmax_rows, 1e-3)])
def test_half_kernels_match_onnxruntime_within_fp16_error(case, tol):
    model, feeds = case(np.random.default_rng(3)) if case is not softmax_rows else case()
    got, want = half_run(model, feeds)["y"], ort_run(model, feeds)["y"]
    err = float(np.abs(got.astype(np.float64) - want).max())
    print(f"{case.__name__}: max abs fp16 error {err:.2e}")
    assert_close(got, want, tol, tol, f"{case.__name__} in half")


def test_shufflenet_matches_and_squeezenet_overflows_fp16():
    model, feeds, want = light_case("shufflenet")
    assert_close(list(half_run(model, feeds).values())[0], want, 5e-2, 5e-2, "shufflenet")
    model, feeds, _ = light_case("squeezenet")
    out = list(half_run(model, feeds).values())[0]
    assert not np.isfinite(out).all()
    # ...because its activations leave fp16's range, not because the harness is wrong
    m = onnx.load(str(LIGHT_DIR / "light_squeezenet.onnx"))
    m.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in ("r63",))
    import onnxruntime as ort
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    assert np.abs(sess.run(["r63"], feeds)[0]).max() > HALF_MAX
