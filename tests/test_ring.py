"""Shifting queues as rings (compiler/ring.py, runner/state.py): which state pairs the compiler
makes rings and how their readers in the same run are ordered, and on every backend: 1,000
runs bit-exact against numpy (the window wraps around the ring hundreds of times), a hang that
leaves the queues as before and the run after it continuing, a run whose kernels wrote their
rows before it failed, reset_state and set_state. The same contract for ping-pong state is
tests/test_device_contract.py's."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import helper

from compiler.pipeline import compile_model
from runner import DeviceError, DeviceTimeout, Model
from tests.graphs import compiled_blob, make_model
from tests.test_device_contract import (FAULTS, MARKS, SLOW_MS, TARGETS, _inject,  # noqa: F401
                                        firmware_dir, simulators)

M, W = 6, 32  # rows of 32 float32: 128 bytes, every target's buffer alignment
RUNS, HANG_AT = 1000, 500
i64 = lambda *v: np.array(v, np.int64)  # noqa: E731


def queues(width: int = W, rows: int = M, k2: int = 2, new_first: bool = False):
    """q: k=1 (x's rows, through a Relu), r: k=k2 (x2 as fed), both shifted as openpilot writes
    its histories; y and z sample the shifted queues every other row (modeld's frame skip), in
    the same run; acc_out = acc + x is a state that is no queue."""
    shift = (lambda tail, new, out: helper.make_node("Concat", [new, tail], [out], axis=0)) \
        if new_first else (lambda tail, new, out: helper.make_node("Concat", [tail, new], [out],
                                                                   axis=0))
    nodes = [helper.make_node("Relu", ["x"], ["new"]),
             helper.make_node("Slice", ["q", "one", "rows", "zero"], ["q_tail"]),
             shift("q_tail", "new", "q_out"),
             helper.make_node("Slice", ["q_out", "one", "rows", "zero", "two"], ["y"]),
             helper.make_node("Slice", ["r", "k2", "rows", "zero"], ["r_tail"]),
             shift("r_tail", "x2", "r_out"),
             helper.make_node("Slice", ["r_out", "zero", "rows", "zero", "two"], ["z"]),
             helper.make_node("Add", ["acc", "x"], ["acc_out"])]
    m = make_model(nodes, [("x", (1, width), "float32"), ("x2", (k2, width), "float32"),
                           ("q", (rows, width), "float32"), ("r", (rows, width), "float32"),
                           ("acc", (1, width), "float32")],
                   [("y", (rows // 2, width), "float32"), ("z", (rows // 2, width), "float32"),
                    ("q_out", (rows, width), "float32"), ("r_out", (rows, width), "float32"),
                    ("acc_out", (1, width), "float32")],
                   {"one": i64(1), "two": i64(2), "k2": i64(k2), "rows": i64(rows),
                    "zero": i64(0)})
    helper.set_model_props(m, {"keel.state": json.dumps({"q": "q_out", "r": "r_out",
                                                         "acc": "acc_out"})})
    return m


def _steps(model) -> dict[str, int]:
    return {s.name: s.step for s in compile_model(model).state}


def test_shifting_queues_become_rings_and_other_state_stays_ping_pong():
    assert _steps(queues()) == {"q": 1, "r": 2, "acc": 0}
    m = Model.load(compiled_blob(queues()))
    assert m.inputs.keys() == {"x", "x2"} and m.outputs.keys() == {"y", "z"}
    ring = {s.name: s for s in m.blob.state}["r"]
    assert [b.shape for b in (*ring.writes, *ring.mirrors)] == [(2, W)] * 2  # the new rows only
    assert m.blob.manifest["variants"][0]["state"][2].keys() == {"name", "reads", "writes",
                                                                  "init"}  # acc: no "ring"
    # y and z read the shifted queues through their windows, after a barrier past the writes
    # of the rows those windows hold (the three buffers are one memory, compiler/ring.py)
    for s in m.blob.state[:2]:
        assert [b.shape for b in s.windows] == [(M, W)]
        ring_ids = {b.id for b in (*s.writes, *s.mirrors)}
        dirty = False
        for ln in m.blob.launches:
            dirty = dirty and not ln.barrier
            assert not (dirty and s.windows[0].id in ln.args), (s.name, ln.kernel)
            dirty = dirty or ln.args[0] in ring_ids


@pytest.mark.parametrize("model, steps", [
    (queues(width=4), {"q": 0, "r": 0}),  # k rows of 16 and 32 bytes: not whole alignments
    (queues(k2=4), {"q": 1, "r": 0}),  # k = 4 does not divide M = 6
    (queues(new_first=True), {"q": 0, "r": 0}),  # Concat(new, Slice(...)): not a shift
])
def test_queues_a_ring_cannot_hold_stay_ping_pong(model, steps):
    assert _steps(model) == {**steps, "acc": 0}


def _load(device: str) -> Model:
    m = Model.load(compiled_blob(queues(), target=TARGETS[device]), device=device)
    m.timeout_ms = SLOW_MS
    return m


class Numpy:
    """The reference: what the blob computes, in numpy."""

    def __init__(self):
        self.q, self.r, self.acc = np.zeros((M, W), np.float32), np.zeros((M, W), np.float32), \
            np.zeros((1, W), np.float32)

    def run(self, x, x2) -> dict:
        self.q = np.concatenate([self.q[1:], np.maximum(x, 0)])
        self.r = np.concatenate([self.r[2:], x2])
        self.acc = self.acc + x
        return {"y": self.q[1::2], "z": self.r[0::2]}

    def check(self, m: Model, what: str) -> None:
        state = m.state
        for name in ("q", "r", "acc"):
            np.testing.assert_array_equal(state[name], getattr(self, name), err_msg=what)


def _feeds(rng) -> dict:
    return {"x": rng.standard_normal((1, W)).astype(np.float32),
            "x2": rng.standard_normal((2, W)).astype(np.float32)}


@pytest.mark.parametrize("device", [pytest.param(d, marks=MARKS[d] + [pytest.mark.slow])
                                    for d in MARKS])
def test_rings_run_1000_times_bit_exact_survive_a_hang_and_reset(device, monkeypatch):
    """Bit-exact: a Relu, an add and row copies. q's ring has 7 windows, r's 4: 1,000 runs
    wrap around them 142 and 250 times."""
    faults = device in FAULTS
    if faults:
        _inject(monkeypatch, device, f"hang@{HANG_AT}")
    m, ref, rng = _load(device), Numpy(), np.random.default_rng(5)
    for i in range(1, RUNS + 1):
        feeds = _feeds(rng)
        if faults and i == HANG_AT:
            with pytest.raises(DeviceTimeout):
                m.run(feeds, timeout_ms=100)
        else:
            want, got = ref.run(**feeds), m.run(feeds)
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} run {i}")
        ref.check(m, f"run {i}")
    m.reset_state()
    ref = Numpy()
    ref.check(m, "after reset_state")
    m.set_state("r", np.arange(M * W, dtype=np.float32).reshape(M, W))
    ref.r = np.arange(M * W, dtype=np.float32).reshape(M, W)
    for i in range(9):  # past a wrap of both rings
        feeds = _feeds(rng)
        np.testing.assert_array_equal(m.run(feeds)["z"], ref.run(**feeds)["z"])
        ref.check(m, f"run {i} after set_state")


@pytest.mark.parametrize("device", [pytest.param(d, marks=MARKS[d]) for d in MARKS])
def test_a_run_that_wrote_its_rows_then_failed_leaves_the_queues_as_before(device):
    """The worst failure for a ring: every kernel ran, so the new rows and their mirror are in
    the ring's memory, and then the run is reported failed. The queues read as before it,
    and the next run shifts into them as if the failed one never happened."""
    m, ref, rng = _load(device), Numpy(), np.random.default_rng(6)
    for i in range(3):
        feeds = _feeds(rng)
        m.run(feeds)
        ref.run(**feeds)
    dev, states = m.device, m._state
    ring = states.rings[[s.name for s in states.specs].index("r")]
    memory = dev.read_state(ring)
    wait = dev.wait

    def wait_then_fail(value, deadline):
        wait(value, deadline)
        raise DeviceError("injected: the run completed, then failed")
    dev.wait = wait_then_fail
    with pytest.raises(DeviceError, match="injected"):
        m.run({"x": np.full((1, W), 7, np.float32), "x2": np.full((2, W), 7, np.float32)})
    del dev.wait  # the class's again: no cycle through the device's own dict
    assert dev.read_state(ring) != memory  # the failed run's rows did land, outside the window
    ref.check(m, "after the failed run")
    for i in range(8):
        feeds = _feeds(rng)
        want, got = ref.run(**feeds), m.run(feeds)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name} run {i}")
        ref.check(m, f"run {i} after the failed one")


def test_a_rings_state_view_is_its_window_read_only_on_host_memory():
    m, ref = _load("cpu"), Numpy()
    feeds = _feeds(np.random.default_rng(7))
    m.run(feeds)
    ref.run(**feeds)
    view = m.state["q"]
    ring = m._state.rings[0]
    assert np.shares_memory(view, ring.view) and not view.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 1
    assert m.state["acc"].flags.writeable  # ping-pong: a writable view, as before
    ref.check(m, "after one run")


@pytest.mark.parametrize("device", ["cpu", "mock"])
def test_new_rows_may_read_the_queue_and_y_may_also_be_an_ordinary_output(device):
    """new = q[-1] + x (N reads the window it shifts), and Identity(q_out) is an output too:
    that output is copied from Y's window after the new row is in."""
    nodes = [helper.make_node("Slice", ["q", "last", "rows", "zero"], ["q_last"]),
             helper.make_node("Add", ["q_last", "x"], ["new"]),
             helper.make_node("Slice", ["q", "one", "rows", "zero"], ["q_tail"]),
             helper.make_node("Concat", ["q_tail", "new"], ["q_out"], axis=0),
             helper.make_node("Identity", ["q_out"], ["q_copy"])]
    model = make_model(nodes, [("x", (1, W), "float32"), ("q", (M, W), "float32")],
                       [("q_copy", (M, W), "float32"), ("q_out", (M, W), "float32")],
                       {"one": i64(1), "last": i64(M - 1), "rows": i64(M), "zero": i64(0)})
    helper.set_model_props(model, {"keel.state": json.dumps({"q": "q_out"})})
    m = Model.load(compiled_blob(model, target=TARGETS[device]), device=device)
    assert [s.step for s in m.blob.state] == [1] and m.outputs.keys() == {"q_copy"}
    q, rng = np.zeros((M, W), np.float32), np.random.default_rng(8)
    for i in range(2 * (M + 1) + 1):  # twice round the ring
        x = rng.standard_normal((1, W)).astype(np.float32)
        q = np.concatenate([q[1:], q[-1:] + x])
        np.testing.assert_array_equal(m.run({"x": x})["q_copy"], q, err_msg=f"run {i}")
        np.testing.assert_array_equal(m.state["q"], q, err_msg=f"run {i}")
