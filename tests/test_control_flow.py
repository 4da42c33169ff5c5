"""ONNX control flow (compiler/onnx/control.py). If: folded when its condition is known at compile
time (a constant, a value computed from shapes, an input frozen with --input-value), both
branches run and selected when they agree in shape, refused by node name otherwise. Loop and
Scan: unrolled when their iterations are known at compile time, refused by node name otherwise.
Every result is compared with onnxruntime: float32 at 1e-5 relative + 1e-6 absolute (the same
ops in the same order, a GRU's sigmoids and tanh through keel's polynomials, a few ulp
apart)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from compiler.errors import CompileError
from compiler.pipeline import compile_model
from runner import Model
from tests.wild_graphs import branch, voice_activity
from tests.graphs import assert_close, keel_load, keel_run, make_model, ort_run

REPO = Path(__file__).resolve().parent.parent
TARGET = "cpu-avx2"  # one variant: these check the frontend, not ISA levels
RTOL, ATOL = 1e-5, 1e-6


def _check(model, feeds, keel_feeds=None, **compile_kwargs):
    want = ort_run(model, feeds)
    got = keel_run(model, feeds if keel_feeds is None else keel_feeds, TARGET, **compile_kwargs)
    for name, w in want.items():
        assert_close(got[name], w, RTOL, ATOL, name)


def _if_model(cond_nodes, cond_inputs, then, other, x_shape=(2, 3), out_shape=None, inits=()):
    nodes = [*cond_nodes, helper.make_node("If", ["cond"], ["y"], then_branch=then,
                                           else_branch=other, name="the_if")]
    return make_model(nodes, [("x", x_shape, np.float32), *cond_inputs],
                      [("y", out_shape, np.float32)], dict(inits), opset=17)


def _relu_or_neg(extra: float = 0.0):
    """Branches over the outer x, same shape: Relu(x) * 2 / -x + c (c a branch initializer)."""
    then = branch("then", [helper.make_node("Relu", ["x"], ["r"]),
                           helper.make_node("Add", ["r", "r"], ["t"])], [("t", None, np.float32)])
    other = branch("else", [helper.make_node("Neg", ["x"], ["n"]),
                            helper.make_node("Add", ["n", "c"], ["e"])], [("e", None, np.float32)],
                   {"c": np.array([extra], np.float32)})
    return then, other


@pytest.mark.parametrize("flag", [True, False])
def test_if_on_a_constant_builds_only_the_branch_it_takes(flag):
    then = branch("then", [helper.make_node("Relu", ["x"], ["t"])], [("t", None, np.float32)])
    # the untaken branch would be refused if built: its output has another shape
    other = branch("else", [helper.make_node("Flatten", ["x"], ["e"], axis=0)],
                   [("e", None, np.float32)])
    model = _if_model([helper.make_node("Constant", [], ["cond"], value=helper.make_tensor(
        "v", onnx.TensorProto.BOOL, [], [flag]))], [], then, other)
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    _check(model, {"x": x})


def test_if_on_a_shape_folds_with_the_bound_dims():
    """A wake-word head's `if batch == 1: squeeze` on a dynamic batch dim: bound by
    --input-shape, the condition is computed from shapes and folds, so the branches may differ in
    rank."""
    then = branch("squeeze", [helper.make_node("Squeeze", ["x", "zero"], ["t"])],
                  [("t", None, np.float32)], {"zero": np.array([0], np.int64)})
    other = branch("keep", [helper.make_node("Identity", ["x"], ["e"])], [("e", None, np.float32)])
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "zero_i"], ["batch"], axis=0),
             helper.make_node("Equal", ["batch", "one"], ["cond"])]
    model = _if_model(nodes, [], then, other, x_shape=("batch", 5),
                      inits={"zero_i": np.array(0, np.int64), "one": np.array(1, np.int64)})
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 5)).astype(np.float32)
        want = ort_run(model, {"x": x})["y"]
        got = keel_run(model, {"x": x}, TARGET, input_shapes={"x": (batch, 5)})["y"]
        assert got.shape == ((5,) if batch == 1 else (batch, 5))
        assert_close(got, want, RTOL, ATOL)


def test_if_on_a_run_time_value_runs_both_same_shaped_branches_and_selects():
    then, other = _relu_or_neg(0.5)
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"])]
    model = _if_model(nodes, [], then, other, inits={"zero": np.array(0, np.float32)})
    loaded = keel_load(model, TARGET)[0]
    for sign in (1, -1):  # one blob, each branch taken once
        x = sign * np.abs(np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32))
        assert_close(loaded.run({"x": x})["y"], ort_run(model, {"x": x})["y"], RTOL, ATOL)


def test_if_on_a_bool_input_is_a_select_and_nested_ifs_see_every_outer_scope():
    inner_then, inner_else = _relu_or_neg(1.0)
    inner = helper.make_node("If", ["c2"], ["inner_y"], then_branch=inner_then,
                             else_branch=inner_else, name="inner_if")
    then = branch("outer_then", [inner], [("inner_y", None, np.float32)])
    other = branch("outer_else", [helper.make_node("Sigmoid", ["x"], ["e"])],
                   [("e", None, np.float32)])
    model = _if_model([], [("cond", (), np.bool_), ("c2", (1,), np.bool_)], then, other)
    x = np.random.default_rng(2).standard_normal((2, 3)).astype(np.float32)
    m = keel_load(model, TARGET)[0]
    for c1 in (True, False):
        for c2 in (True, False):
            feeds = {"x": x, "cond": np.array(c1), "c2": np.array([c2])}
            assert_close(m.run(feeds)["y"], ort_run(model, feeds)["y"], RTOL, ATOL,
                         f"cond={c1}, c2={c2}")


def test_if_with_differently_shaped_branches_on_a_run_time_value_is_refused_by_name():
    model = voice_activity()
    with pytest.raises(CompileError) as e:
        compile_model(model, TARGET)
    text = str(e.value)
    for words in ("If node 'front_end_if'", "['sr']", "(1, 8, 3)", "(1, 8, 7)",
                  "--input-value"):
        assert words in text, text


def test_if_whose_untaken_branch_cannot_build_for_these_shapes_says_to_freeze_the_input():
    """silero's VAD: the 8 kHz branch does not build for 16 kHz frame sizes. With a run-time
    condition both branches must build, so the refusal names the If, the branch and why."""
    then = branch("then", [helper.make_node("Reshape", ["x", "s6"], ["t"])],
                  [("t", None, np.float32)], {"s6": np.array([6], np.int64)})
    other = branch("else", [helper.make_node("Reshape", ["x", "s16"], ["e"])],
                   [("e", None, np.float32)], {"s16": np.array([16], np.int64)})
    model = _if_model([], [("cond", (), np.bool_)], then, other)
    with pytest.raises(CompileError) as e:
        compile_model(model, TARGET)
    for words in ("If node 'the_if'", "['cond']", "its else_branch does not build here",
                  "--input-value"):
        assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("sr", [16000, 8000])
def test_voice_activity_net_folds_its_sample_rate_if_with_input_value(sr, tmp_path):
    """The whole user path: tools/compile.py --input-value sr=..., then the runner; the blob no
    longer takes `sr`."""
    model = voice_activity()
    onnx.save(model, tmp_path / "vad.onnx")
    blob = tmp_path / "vad.blob"
    proc = subprocess.run([sys.executable, "tools/compile.py", tmp_path / "vad.onnx", "-o", blob,
                           "--target", TARGET, "--input-value", f"sr={sr}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    m = Model.load(blob)
    assert set(m.inputs) == {"input", "state"}
    rng = np.random.default_rng(sr)
    feeds = {"input": rng.standard_normal((1, 512)).astype(np.float32),
             "state": rng.standard_normal((1, 1, 16)).astype(np.float32)}
    got = m.run(feeds)
    want = ort_run(model, {**feeds, "sr": np.array(sr, np.int64)})
    for name, w in want.items():
        assert_close(got[name], w, RTOL, ATOL, name)


@pytest.mark.parametrize("values,words", [
    ({"sr": [1, 2]}, ["input 'sr'", "2 value(s)", "shape is ()"]),
    ({"sr": 16000.5}, ["input 'sr'", "not exactly a int64"]),
    ({"rate": 16000}, ["--input-value names unknown input(s) ['rate']"])])
def test_bad_input_values_name_the_input_and_what_it_takes(values, words):
    with pytest.raises(CompileError) as e:
        compile_model(voice_activity(), TARGET, input_values=values)
    assert all(w in str(e.value) for w in words), str(e.value)


def _doubling_loop(cond_out: str = "cond_in"):
    """Loop(M=3): acc = acc + acc + i each iteration, scanning out each acc; the body's
    condition is `cond_out` (its cond input, or a run-time test)."""
    body = helper.make_graph(
        [helper.make_node("Greater", ["acc_in", "limit"], ["big"]),
         helper.make_node("Not", ["big"], ["small"]),
         helper.make_node("Identity", [cond_out], ["cond_out"]),
         helper.make_node("Cast", ["i"], ["i_f"], to=onnx.TensorProto.FLOAT),
         helper.make_node("Add", ["acc_in", "acc_in"], ["twice"]),
         helper.make_node("Add", ["twice", "i_f"], ["acc_out"]),
         helper.make_node("Identity", ["acc_out"], ["scanned"])], "body",
        [helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", onnx.TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("scanned", onnx.TensorProto.FLOAT, [2])])
    return make_model([helper.make_node("Loop", ["n", "", "x"], ["y", "ys"], body=body,
                                        name="doubling_loop")],
                      [("x", (2,), np.float32)], [("y", (2,), np.float32),
                                                  ("ys", (3, 2), np.float32)],
                      {"n": np.array(3, np.int64), "limit": np.array(1e6, np.float32)})


def test_a_loop_of_known_trip_count_is_unrolled():
    _check(_doubling_loop(), {"x": np.array([1.5, -2.0], np.float32)})


def test_a_loop_whose_condition_is_computed_at_run_time_is_refused_by_name():
    with pytest.raises(CompileError, match=r"Loop node 'doubling_loop' \(opset 17\): its body's "
                                           r"condition depends on run-time values"):
        compile_model(_doubling_loop("small"), TARGET)


@pytest.mark.parametrize("reverse", [0, 1])
def test_a_scan_is_unrolled_over_its_axis(reverse):
    """A running sum over axis 1 of x, forward or backward, with each step's state scanned out
    along axis 1 (a GRU-free recurrence, as Scan-based exports write it)."""
    body = helper.make_graph(
        [helper.make_node("Add", ["sum_in", "next"], ["sum_out"]),
         helper.make_node("Tanh", ["sum_out"], ["scan_out"])], "body",
        [helper.make_tensor_value_info("sum_in", onnx.TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("next", onnx.TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("sum_out", onnx.TensorProto.FLOAT, [3]),
         helper.make_tensor_value_info("scan_out", onnx.TensorProto.FLOAT, [3])])
    node = helper.make_node("Scan", ["init", "x"], ["y", "z"], body=body, num_scan_inputs=1,
                            scan_input_axes=[1], scan_input_directions=[reverse],
                            scan_output_axes=[1], name="running_sum")
    model = make_model([node], [("init", (3,), np.float32), ("x", (3, 5), np.float32)],
                       [("y", (3,), np.float32), ("z", (3, 5), np.float32)])
    rng = np.random.default_rng(reverse)
    _check(model, {"init": rng.standard_normal(3).astype(np.float32),
                   "x": rng.standard_normal((3, 5)).astype(np.float32)})


def test_a_loop_beyond_the_unroll_limit_is_refused_naming_the_node():
    model = _doubling_loop()
    model.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(np.array(5000, np.int64),
                                                                      "n"))
    with pytest.raises(CompileError, match=r"Loop node 'doubling_loop' \(opset 17\): 5000 "
                                           r"iterations; keel unrolls at most 1024"):
        compile_model(model, TARGET)
