"""Entry points and persistent state, from the compiler's side: how they are declared (ONNX
metadata_props `keel.state`, compile_model's state=, tools/compile.py --state and --entry), what
is refused, and what the runner's Model API says about them. Every backend running them is
tests/test_device_contract.py's."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import helper

from compiler.errors import CompileError
from compiler.pipeline import compile_model
from runner import InputError, Model
from tests.graphs import compiled_blob, make_model

W = 4


def counter(init: np.ndarray | None = None, props: dict | None = None) -> onnx.ModelProto:
    """n_out = n + x; y = n_out. With `init`, n has an initializer: its initial value."""
    nodes = [helper.make_node("Add", ["n", "x"], ["n_out"]),
             helper.make_node("Identity", ["n_out"], ["y"])]
    m = make_model(nodes, [("x", (1, W), "float32"), ("n", (1, W), "float32")],
                   [("y", (1, W), "float32"), ("n_out", (1, W), "float32")],
                   {} if init is None else {"n": init})
    if props is not None:
        helper.set_model_props(m, props)
    return m


def test_state_from_metadata_props_leaves_the_io_and_starts_at_zeros():
    m = Model.load(compiled_blob(counter(props={"keel.state": json.dumps({"n": "n_out"})})))
    assert m.inputs.keys() == {"x"} and m.outputs.keys() == {"y"} and list(m.state) == ["n"]
    x = np.full((1, W), 0.5, np.float32)
    for k in range(1, 4):
        np.testing.assert_array_equal(m.run({"x": x})["y"], k * x)


def test_an_initializer_of_the_state_input_is_its_initial_value_and_reset_goes_back_to_it():
    init = np.arange(W, dtype=np.float32).reshape(1, W)
    m = Model.load(compiled_blob(counter(init), state={"n": "n_out"}))
    np.testing.assert_array_equal(m.state["n"], init)
    x = np.ones((1, W), np.float32)
    m.run({"x": x})
    np.testing.assert_array_equal(m.state["n"], init + 1)
    m.reset_state()
    np.testing.assert_array_equal(m.state["n"], init)


@pytest.mark.parametrize("state, props, message", [
    ({"n": "nope"}, None, r"state n=nope: expected an entry with input 'n' and one with output "
                          r"'nope'"),
    ({"x": "n_out"}, {"keel.state": json.dumps({"n": "n_out"})},
     r"state: each output replaces one input"),
    ({"n": "y"}, {"keel.state": json.dumps({"n": "n_out"})},
     r"state 'n': replaced by output 'y' in one entry and by 'n_out' in another"),
    (None, {"keel.state": "{not json"}, r"metadata_props keel.state: expected JSON"),
    (None, {"keel.state": json.dumps({"n": 3})}, r"keel.state: expected a JSON object of input"),
])
def test_bad_state_declarations_are_compile_errors(state, props, message):
    with pytest.raises(CompileError, match=message):
        compile_model(counter(props=props), state=state)


def test_a_state_pair_of_two_shapes_is_a_compile_error():
    nodes = [helper.make_node("ReduceSum", ["n"], ["n_out"], keepdims=1)]
    m = make_model(nodes, [("n", (2, W), "float32")], [("n_out", (1, 1), "float32")])
    with pytest.raises(CompileError, match=r"state n=n_out: the input and output must have one "
                                           r"dtype and shape"):
        compile_model(m, state={"n": "n_out"})


@pytest.mark.parametrize("entries", [{}, {"not an id": counter()}, {1: counter()},
                                     {"/abs": counter()}, {"x" * 65: counter()}])
def test_entry_names_follow_the_entry_name_rule(entries):
    with pytest.raises(CompileError, match="entries: expected at least one, each named by "):
        compile_model(entries)


def test_entries_have_their_own_io_names_and_the_default_entry_rules():
    m = Model.load(compiled_blob({"a": counter(), "b": counter()}, state={"n": "n_out"}))
    assert list(m.entries) == ["a", "b"]
    with pytest.raises(InputError, match=r"this blob has entries \['a', 'b'\]: name one"):
        m.inputs
    x = np.ones((1, W), np.float32)
    m.input_view("x", entry="b")[:] = 3 * x
    np.testing.assert_array_equal(m.run(entry="b")["y"], 3 * x)
    np.testing.assert_array_equal(m.run({"x": x}, entry="a")["y"], 4 * x)  # one state, shared
    with pytest.raises(InputError, match="unknown input 'z'; inputs are \\['x'\\]"):
        m.input_view("z", entry="a")


def test_the_cli_builds_entries_and_state(tmp_path):
    from tools.compile import main
    for name in ("a", "b"):
        onnx.save(counter(), tmp_path / f"{name}.onnx")
    out = tmp_path / "m.blob"
    assert main(["--entry", f"a={tmp_path / 'a.onnx'}", "--entry", f"b={tmp_path / 'b.onnx'}",
                 "--state", "n=n_out", "-o", str(out)]) == 0
    # read_blob, not Model.load: a Model that the pytest.raises below keep in a traceback cycle
    # until exit crashes the interpreter's last collection (so does main; see the report)
    from runner.blob import read_blob
    blob = read_blob(out)
    assert [e.name for e in blob.entries] == ["a", "b"] and [x.name for x in blob.state] == ["n"]
    with pytest.raises(SystemExit) as e:
        main(["--entry", f"a={tmp_path / 'a.onnx'}", str(tmp_path / "a.onnx"), "-o", str(out)])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["--state", "n", str(tmp_path / "a.onnx"), "-o", str(out)])
    assert e.value.code == 2
