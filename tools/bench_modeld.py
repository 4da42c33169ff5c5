"""Time one modeld step: the pipeline blob's run_policy against the numpy + onnxruntime reference
(models/modeld_ref.py: the warp in numpy, vision and policy in onnxruntime).

    python tools/bench_modeld.py modeld.blob --vision-onnx V --policy-onnx P \\
        [--camera WxH] [--device D] [--runs N] [--json]

Both run the same random frames, transforms and desires, one after the other, after two warm-up
steps; the reference's onnxruntime sessions use their default threads (every core), keel its
default (KEEL_THREADS, every core). Reports the median and the minimum per step, warp included.
"""
from __future__ import annotations

import json
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from models import modeld_ref as ref  # noqa: E402
from models.modeld_step import Spec, entry_name, parse_size  # noqa: E402
from runner import Model  # noqa: E402
from tools.cli import Parser, positive_int, report, timed  # noqa: E402


def frames(nv12: ref.Nv12, cam: tuple, model_size: tuple, n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"frame": rng.integers(0, 256, nv12.size, dtype=np.uint8),
             "big_frame": rng.integers(0, 256, nv12.size, dtype=np.uint8),
             "tfm": ref.random_tfm(rng, cam, model_size),
             "big_tfm": ref.random_tfm(rng, cam, model_size),
             "desire": np.eye(8, dtype=np.float32)[i % 8],
             "traffic_convention": np.array([1, 0], np.float32)} for i in range(n)]


def bench(m: Model, vision: onnx.ModelProto, policy: onnx.ModelProto, camera: str,
          runs: int) -> dict:
    desc = json.loads(m.meta["metadata"]["modeld"])
    cam, size = parse_size(camera), tuple(desc["model_size"])
    nv12 = ref.nv12_layout(*cam)
    spec = Spec(vision, policy, size, desc["frame_skip"])
    step = ref.Step.zeros(ref.ort_runner(vision), ref.ort_runner(policy),
                          slice(*spec.vision_slices["hidden_state"]), spec.fs, size, spec.queues)
    inputs = frames(nv12, cam, size, 4)
    entry = entry_name(cam, "run_policy")
    out = {n: np.empty(s, d) for n, (s, d) in m.entries[entry].outputs.items()}
    k = iter(range(1 << 62))
    keel = timed(lambda: m.run(inputs[next(k) % 4], out=out, entry=entry), runs + 2)[2:]
    reference = timed(lambda: step.run_policy(nv12, **inputs[next(k) % 4]), runs + 2)[2:]
    ms = lambda t: {"median_ms": 1e3 * float(np.median(t)), "min_ms": 1e3 * min(t)}  # noqa
    return {"camera": camera, "runs": runs, "keel": ms(keel), "reference": ms(reference),
            "speedup": float(np.median(reference) / np.median(keel))}


def main() -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("blob")
    ap.add_argument("--vision-onnx", required=True)
    ap.add_argument("--policy-onnx", required=True)
    ap.add_argument("--camera", help="WxH (default: the blob's first camera)")
    ap.add_argument("--device")
    ap.add_argument("--runs", type=positive_int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    m = Model.load(args.blob, device=args.device)
    camera = args.camera or next(iter(json.loads(m.meta["metadata"]["modeld"])["cameras"]))
    r = bench(m, onnx.load(args.vision_onnx), onnx.load(args.policy_onnx), camera, args.runs)
    return report(r, args.json, lambda r: print(
        f"{r['camera']} run_policy, median (min) of {r['runs']}: keel "
        f"{r['keel']['median_ms']:.2f} ({r['keel']['min_ms']:.2f}) ms, numpy + onnxruntime "
        f"{r['reference']['median_ms']:.2f} ({r['reference']['min_ms']:.2f}) ms, "
        f"{r['speedup']:.1f}x"))


if __name__ == "__main__":
    sys.exit(main())
