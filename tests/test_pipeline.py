"""runner/pipeline.py on two host devices (a mock queue, then the CPU): the link read where the
first stage wrote it, one frame per call, a hang in the first stage dropping exactly that frame
with the second stage's state untouched, and the typed errors. The qcom + amd pair (the
split modeld step) is tests/test_modeld_blob.py's."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from runner import DeviceTimeout, InputError, Model
from runner.pipeline import Pipeline
from tests.graphs import compiled_blob, make_model

W = 8


def doubler():
    """h = 2 x: the first stage, stateless (the warp's role)."""
    return make_model([helper.make_node("Add", ["x", "x"], ["h"])], [("x", (1, W), "float32")],
                      [("h", (1, W), "float32")])


def summer():
    """n_out = n + h, y = n_out, with n the state: the second stage (the queues' role)."""
    nodes = [helper.make_node("Add", ["n", "h"], ["n_out"]),
             helper.make_node("Identity", ["n_out"], ["y"])]
    return make_model(nodes, [("h", (1, W), "float32"), ("n", (1, W), "float32")],
                      [("y", (1, W), "float32"), ("n_out", (1, W), "float32")])


@pytest.fixture
def stages(monkeypatch):
    """(first on the mock device with KEEL_MOCK_FAULTS as the test set it, second on cpu)."""
    def load(faults: str = ""):
        monkeypatch.setenv("KEEL_MOCK_FAULTS", faults)
        first = Model.load(compiled_blob(doubler()), device="mock")
        monkeypatch.delenv("KEEL_MOCK_FAULTS")
        return first, Model.load(compiled_blob(summer(), state={"n": "n_out"}), device="cpu")
    return load


def frame(k: int) -> dict:
    return {"x": np.full((1, W), float(k), np.float32)}


def test_the_second_stage_reads_the_first_stages_output_where_it_lies(stages):
    first, second = stages()
    pipe = Pipeline([first, second])
    for k in (1, 2, 3):
        out = pipe.run(frame(k), ("main", "main"))
        assert list(out) == ["y"]  # h is linked: not an output of the frame
        np.testing.assert_array_equal(out["y"], np.full((1, W), float(k * (k + 1))))  # sum 2j
    h, mine = first.output_buffer("h"), second.graph.entry("main").inputs[0]
    # the CPU binds host memory: its slot for h is the mock's own output memory, not a copy
    assert second.device.bound[mine.slot] is h
    np.testing.assert_array_equal(h, np.full((1, W), 6.0))


def test_a_hang_in_the_first_stage_drops_that_frame_and_leaves_the_second_untouched(stages):
    first, second = stages("hang@2")
    pipe = Pipeline([first, second])
    pipe.run(frame(1), ("main", "main"))
    before, submitted = second.state["n"].copy(), second.device.value
    with pytest.raises(DeviceTimeout):
        pipe.run(frame(5), ("main", "main"), timeout_ms=100)
    assert second.device.value == submitted  # never submitted: the relay stopped at the hang
    np.testing.assert_array_equal(second.state["n"], before)
    out = pipe.run(frame(3), ("main", "main"))  # the first stage recovers; frame 5 is missing
    np.testing.assert_array_equal(out["y"], np.full((1, W), 2.0 * (1 + 3)))
    np.testing.assert_array_equal(second.state["n"], out["y"])


def test_an_output_buffer_bound_as_an_input_is_read_after_each_run_of_its_writer(stages):
    first, second = stages()
    second.bind_input("h", first.output_buffer("h"))
    for k in (4, 5):
        first.run(frame(k), out={"h": first.output_buffer("h")})
        out = second.run()  # h not fed: read where the first Model's run wrote it
    np.testing.assert_array_equal(out["y"], np.full((1, W), 18.0))


@pytest.mark.parametrize("feeds, entries, message", [
    ({"x": None, "h": None}, ("main", "main"), r"\['h'\] come from the stage before"),
    ({"z": None}, ("main", "main"), r"feeds names \['z'\]; expected names among \['x'\]"),
    ({"x": None}, ("main",), r"expected one entry per stage \(2\)"),
    ({"x": None}, ("main", "other"), r"unknown entry 'other'"),
])
def test_bad_frames_are_input_errors_before_anything_runs(stages, feeds, entries, message):
    first, second = stages()
    with pytest.raises(InputError, match=message):
        Pipeline([first, second]).run(feeds, entries)
    assert first.device.value == second.device.value == 0


def test_two_stages_returning_one_name_is_an_input_error(stages):
    _, second = stages()
    with pytest.raises(InputError, match=r"return outputs \['y', 'y'\]: expected distinct"):
        Pipeline([second, second]).run(frame(1), ("main", "main"))


def test_a_link_of_two_shapes_is_an_input_error(stages):
    first, _ = stages()
    nodes = [helper.make_node("Identity", ["h"], ["y"])]
    narrow = Model.load(compiled_blob(make_model(nodes, [("h", (1, W // 2), "float32")],
                                                 [("y", (1, W // 2), "float32")])))
    with pytest.raises(InputError, match=r"'main' writes 'h' as float32 \(1, 8\), 'main' reads "
                                         r"it as float32 \(1, 4\)"):
        Pipeline([first, narrow]).run(frame(1), ("main", "main"))


def test_a_forked_child_gets_a_clear_error_at_once(stages):
    """As Model.run: the devices' threads and queues stayed in the parent, so a frame in a
    forked child is refused before it takes any Model's lock (a parent's thread may hold one)."""
    import os
    pipe = Pipeline(list(stages()))
    pipe.run(frame(1), ("main", "main"))
    pid = os.fork()
    if pid == 0:
        try:
            pipe.run(frame(2), ("main", "main"))
            code = 3
        except Exception as e:
            code = 0 if "does not survive fork()" in str(e) and type(e).__name__ == \
                "DeviceError" else 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    np.testing.assert_array_equal(pipe.run(frame(2), ("main", "main"))["y"],
                                  np.full((1, W), 6.0))  # the parent goes on: 2 + 4
