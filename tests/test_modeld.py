"""The modeld path: external uint8 frames bound without a copy, histories updated in place, and
tools/modeld.py's replay loop, which survives an injected hang and counts it as a dropped frame.
On the openpilot toy (models/openpilot.py: make_toy): openpilot's io names at toy sizes.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from models.openpilot import make_toy
from runner import InputError, Model
from tests.graphs import compiled_blob
from tools.modeld import Feeder, replay



@pytest.fixture(scope="module")
def blob():
    return str(compiled_blob(make_toy()))


def _feeds(m, seed):
    rng = np.random.default_rng(seed)
    return {n: (rng.integers(0, 256, s) if d == np.uint8 else rng.standard_normal(s)).astype(d)
            for n, (s, d) in m.inputs.items()}


def test_bound_frames_are_read_in_place(blob):
    m = Model.load(blob, device="mock")
    feeds = _feeds(m, 0)
    frame = np.empty_like(feeds["img"])  # owned by "the vision pipeline"
    m.bind_input("img", frame)
    assert m.input_view("img") is frame
    for name, arr in feeds.items():
        if name != "img":
            m.input_view(name)[:] = arr
    out = {"outputs": np.empty((1, 56), np.float32)}
    for seed in (1, 2):  # the model reads whatever the frame holds at run time: no copy was taken
        frame[:] = _feeds(m, seed)["img"]
        m.run(out=out)
        want = m.run({**feeds, "img": frame.copy()})["outputs"]
        assert np.array_equal(out["outputs"], want)  # same kernels, same bytes: bit-exact
    m.bind_input("img", None)  # back to the model's own slot
    assert m.input_view("img") is not frame
    with pytest.raises(InputError, match="C-contiguous"):
        m.bind_input("img", np.empty((1, 12, 16, 8), np.uint8).transpose(0, 1, 3, 2))
    with pytest.raises(InputError, match="expected dtype uint8"):
        m.bind_input("img", np.empty((1, 12, 8, 16), np.float32))
    with pytest.raises(InputError, match="unknown input 'nope'"):
        m.bind_input("nope", frame)


def test_feeder_shifts_histories_and_feeds_back_hidden_state(blob):
    m = Model.load(blob, device="cpu")
    feed = Feeder(m)
    fb = m.input_view("features_buffer")
    for i in range(3):
        before = fb.copy()
        feed.before(i)
        m.run(out=feed.out)
        feed.after()
        assert np.array_equal(fb[0, :-1], before[0, 1:])
        assert np.array_equal(fb[0, -1], feed.out["outputs"][0, 40:56])  # hidden_state's slice
        assert m.input_view("desire_pulse")[0, -1].argmax() == i % 8


def test_replay_survives_a_hang_as_one_dropped_frame(blob, monkeypatch, capsys):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "hang@7")
    m = Model.load(blob, device="mock")
    # 10 Hz: the hung run times out at 100 ms, one period; the next frame is then due, not late
    s = replay(m, hz=10, frames=20, timeout_ms=100, budget_ms=100)
    assert (s["frames"], s["timeouts"], s["device_errors"], s["dropped"]) == (20, 1, 0, 1)
    assert s["processed"] == 19 and s["p50_ms"] is not None
    assert "frame 6: dropped, DeviceTimeout" in capsys.readouterr().err  # frame 6 = submission 7


def test_cli_reports_json(blob):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "KEEL_THREADS": "1"}
    res = subprocess.run([sys.executable, "tools/modeld.py", blob, "--hz", "100", "--frames",
                          "30", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert s["frames"] == 30 and s["processed"] + s["dropped"] == 30
    assert {"p50_ms", "p99_ms", "max_ms", "over_budget", "dropped", "lagging"} <= s.keys()
    bad = subprocess.run([sys.executable, "tools/modeld.py", blob, "--device", "nope"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "unknown device 'nope'" in bad.stderr
