"""The 30-frame replay of a modeld pipeline blob against models/modeld_ref.py, shared by the
cpu, opencl, qcom and amd tests (tests/test_modeld_blob.py).

Per frame, with run_policy and warp_enqueue frames mixed (every fourth frame is skipped, as a
dropped camera frame is in modeld):
- frame queues: the old rows shifted by one, bit for bit; the new row equals the reference's
  warp except at pixels whose source coordinate lies within modeld_ref.NEAR px of a rounding
  boundary (counted, and bounded by NEAR_BOUND). The reference then adopts keel's new row, so
  everything after the warp sees the same pixels on both sides.
- feat_q: the old rows shifted bit for bit, the new row bit-equal to the run's own vision_out
  hidden_state slice; desire_q bit-equal to the reference's (data movement only).
- vision_out and policy_out within `tol` of onnxruntime's (the reference's models); the
  reference then adopts keel's feat_q, so a feature's rounding does not compound over frames.
A skipped frame leaves feat_q and desire_q untouched.
"""
from __future__ import annotations

import numpy as np

from models import modeld_ref as ref
from models.modeld_step import Spec, entry_name
from runner.pipeline import Pipeline
from tests.graphs import assert_close

MODEL_SIZE = (512, 256)
FS = 4
NEAR_BOUND = 0.01  # of a frame's pixels; ~4e-3 fall in two 1e-3 px bands (test_modeld_step.py)


def random_frame(rng, nv12, cam, skipped: bool) -> dict:
    feeds = {"frame": rng.integers(0, 256, nv12.size, dtype=np.uint8),
             "big_frame": rng.integers(0, 256, nv12.size, dtype=np.uint8),
             "tfm": ref.random_tfm(rng, cam, MODEL_SIZE),
             "big_tfm": ref.random_tfm(rng, cam, MODEL_SIZE)}
    if not skipped:
        feeds["desire"] = (rng.random(8) > 0.8).astype(np.float32)
        feeds["traffic_convention"] = np.eye(2, dtype=np.float32)[rng.integers(2)]
    return feeds


def reference(vision, policy) -> ref.Step:
    spec = Spec(vision, policy, MODEL_SIZE, FS)
    return ref.Step.zeros(ref.ort_runner(vision), ref.ort_runner(policy),
                          slice(*spec.vision_slices["hidden_state"]), FS, MODEL_SIZE,
                          spec.queues)


def state_copy(m) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in m.state.items()}


def replay(m, step: ref.Step, cam, frames: int, seed: int, tol: float,
           timeout_ms: float = 60000) -> dict:
    """Replay `frames` frames through Model `m` against the reference `step`; -> counts and
    every run's outputs (for the determinism checks)."""
    nv12 = ref.nv12_layout(*cam)
    rng = np.random.default_rng(seed)
    prev = state_copy(m)
    counts = {"frames": 0, "skipped": 0, "near": 0, "near_differ": 0, "pixels": 0}
    outputs = []
    for i in range(frames):
        skipped = i % 4 == 3
        feeds = random_frame(rng, nv12, cam, skipped)
        entry = entry_name(cam, "warp_enqueue" if skipped else "run_policy")
        out = m.run(feeds, entry=entry, timeout_ms=timeout_ms)
        now = state_copy(m)
        near = step.warp_enqueue(nv12, feeds["frame"], feeds["big_frame"], feeds["tfm"],
                                 feeds["big_tfm"])
        for k, q in enumerate(("img_q", "big_img_q")):
            assert np.array_equal(now[q][:-1], prev[q][1:]), (i, q)
            differ = now[q][-1] != step.queues[q][-1]
            assert not (differ & ~near[k]).any(), (i, q, int((differ & ~near[k]).sum()))
            counts["near"] += int(near[k].sum())
            counts["near_differ"] += int(differ.sum())
            counts["pixels"] += near[k].size
            assert near[k].mean() < NEAR_BOUND, (i, q)
            step.queues[q][-1] = now[q][-1]
        if skipped:
            for q in ("feat_q", "desire_q"):
                assert np.array_equal(now[q], prev[q]), (i, q)
            counts["skipped"] += 1
        else:
            want = step.infer(feeds["desire"], feeds["traffic_convention"])
            assert_close(out["vision_out"], want["vision_out"], tol, tol, f"frame {i} vision")
            assert_close(out["policy_out"], want["policy_out"], tol, tol, f"frame {i} policy")
            assert np.array_equal(now["feat_q"][:-1], prev["feat_q"][1:]), i
            assert np.array_equal(now["feat_q"][-1, 0], out["vision_out"][0, step.hidden_state])
            assert np.array_equal(now["desire_q"], step.queues["desire_q"]), i
            step.queues["feat_q"] = now["feat_q"].copy()
            outputs.append({k: v.copy() for k, v in out.items()})
        counts["frames"] += 1
        prev = now
    return {**counts, "outputs": outputs, "state": prev}


class TwoDevices:
    """models/modeld_step.py: split_entries's two blobs as one Model for replay(), run as a
    runner.pipeline.Pipeline: the warp blob's planes stay in its output memory and the model
    blob's runs read them from there (one frame is one Pipeline.run, one deadline)."""

    def __init__(self, warp, model):
        self.warp, self.model = warp, model
        self.pipe = Pipeline([warp, model])

    @property
    def state(self) -> dict:
        return self.model.state

    def run(self, feeds: dict, entry: str, timeout_ms: float) -> dict:
        cam, kind = entry.split("/")
        return self.pipe.run(feeds, (f"{cam}/warp", kind), timeout_ms=timeout_ms)
