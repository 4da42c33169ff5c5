"""Stand-ins for openpilot's split driving models and its driver-monitoring model: openpilot's io
names, shapes and metadata format, a few thousand times less compute, random weights.

openpilot since 2025 ships the driving model in two parts, which `compile_modeld.py` joins into
one step (models/modeld_step.py):
- vision (`driving_vision.onnx`): `img`, `big_img` uint8 (1, 12, 128, 256), two frames of six
  (H/2, W/2) planes (the four Y phases, U, V) per camera -> `outputs` (1, N), cut by
  `output_slices`; its `hidden_state` slice (512) feeds the policy's feature queue.
- policy (`driving_policy.onnx`): `features_buffer` (1, 25, 512), `desire_pulse` (1, 25, 8),
  `traffic_convention` (1, 2) -> `outputs` (1, M), cut by `output_slices`.
- driver monitoring (`dmonitoring_model.onnx`): `input_img` uint8 (1, 1440*960), the Y plane
  warped to 1440x960, and `calib` (1, 3) -> `outputs` (1, 84 + 512): two DriverStateResults of
  41 floats, poor-vision and wheel-on-right logits, then 512 features (dmonitoringmodeld.py's
  DMonitoringModelResult).

Each carries `output_slices` in metadata_props as openpilot's exporter writes it (a base64 pickle;
models/openpilot.py: metadata_props). The layers are strided convs to a pooled feature, then
dense heads: enough to make every input byte matter, small enough to compile in seconds.

    python -m models.openpilot_split --vision V.onnx --policy P.onnx --dm DM.onnx [--float16]
"""
from __future__ import annotations

import argparse
import codecs
import math
import pickle

import numpy as np
import onnx

from models.blocks import GraphBuilder, gemm

IMG_SHAPE = (1, 12, 128, 256)
FEATURE_LEN, HISTORY_LEN, DESIRE_LEN = 512, 25, 8
VISION_INPUTS = {"img": (np.uint8, IMG_SHAPE), "big_img": (np.uint8, IMG_SHAPE)}
POLICY_INPUTS = {"features_buffer": (np.float32, (1, HISTORY_LEN, FEATURE_LEN)),
                 "desire_pulse": (np.float32, (1, HISTORY_LEN, DESIRE_LEN)),
                 "traffic_convention": (np.float32, (1, 2))}
VISION_HEADS = (("meta", 55), ("desire_pred", 32), ("pose", 12), ("wide_from_device_euler", 6),
                ("road_transform", 12), ("hidden_state", FEATURE_LEN))
POLICY_HEADS = (("plan", 4955), ("lane_lines", 528), ("lane_lines_prob", 8),
                ("road_edges", 264), ("lead", 102), ("lead_prob", 3), ("desire_state", 8))

DM_SIZE = (1440, 960)  # width, height: what dmonitoringmodeld warps the driver camera to
DM_INPUTS = {"input_img": (np.uint8, (1, DM_SIZE[0] * DM_SIZE[1])),
             "calib": (np.float32, (1, 3))}
DRIVER_STATE = 41  # floats in dmonitoringmodeld's DriverStateResult
DM_HEADS = (("driver_state_lhd", DRIVER_STATE), ("driver_state_rhd", DRIVER_STATE),
            ("poor_vision_prob", 1), ("wheel_on_right_prob", 1), ("hidden_state", FEATURE_LEN))

HIDDEN = 128


def slices_of(heads) -> dict[str, slice]:
    slices, start = {}, 0
    for name, n in heads:
        slices[name], start = slice(start, start + n, None), start + n
    return slices


def metadata(heads, checkpoint: str) -> dict[str, str]:
    """openpilot's metadata_props: `output_slices` as base64 text of the pickled dict."""
    pickled = codecs.encode(pickle.dumps(slices_of(heads)), "base64").decode()
    return {"output_slices": pickled, "model_checkpoint": checkpoint}


def pixels(g: GraphBuilder, img: str) -> str:
    """uint8 -> x/128 - 1, as openpilot's models normalise their input."""
    x = g.op("Cast", img, to=onnx.TensorProto.FLOAT)
    return g.op("Sub", g.op("Div", x, g.const(np.float32(128.0), "pixel_scale")),
                g.const(np.float32(1.0), "one"))


def patch_conv(g: GraphBuilder, x: str, cin: int, cout: int, k: int) -> str:
    """k x k conv with stride k (non-overlapping patches), bias, ReLU."""
    w = g.normal((cout, cin, k, k), math.sqrt(2 / (cin * k * k)), "conv_w")
    y = g.op("Conv", x, w, g.normal((cout,), 0.1, "conv_b"), kernel_shape=[k, k],
             strides=[k, k])
    return g.op("Relu", y)


def pooled(g: GraphBuilder, x: str, channels: tuple[int, ...], patches: tuple[int, ...]) -> str:
    for cin, cout, k in zip(channels, channels[1:], patches):
        x = patch_conv(g, x, cin, cout, k)
    return g.op("Flatten", g.op("GlobalAveragePool", x), axis=1)


def dense_heads(g: GraphBuilder, x: str, din: int, heads, name: str, what: str,
                seed: int) -> onnx.ModelProto:
    """ReLU MLP to the heads' `outputs` (1, sum of heads), with openpilot's metadata."""
    h = g.op("Relu", gemm(g, x, din, HIDDEN, gain=math.sqrt(2)))
    n = sum(n for _, n in heads)
    out = gemm(g, h, HIDDEN, n, out="outputs")
    return g.model([(out, np.float32, (1, n))], name,
                   doc=f"openpilot-shaped {what} model, seed {seed}",
                   metadata=metadata(heads, f"keel-{what}-stand-in"))


def _start(seed: int, float16: bool, inputs: dict) -> GraphBuilder:
    g = GraphBuilder(seed, fp16_weights=float16)
    for name, (dtype, shape) in inputs.items():
        g.input(name, dtype, shape)
    return g


def make_vision(float16: bool = False, seed: int = 0) -> onnx.ModelProto:
    g = _start(seed, float16, VISION_INPUTS)
    feats = [pooled(g, pixels(g, cam), (12, 16, 32), (4, 4)) for cam in VISION_INPUTS]
    return dense_heads(g, g.op("Concat", *feats, axis=1), 64, VISION_HEADS, "driving_vision",
                       "vision", seed)


def make_policy(float16: bool = False, seed: int = 1) -> onnx.ModelProto:
    g = _start(seed, float16, POLICY_INPUTS)
    history = g.op("ReduceMean", "features_buffer", axes=[1], keepdims=0)
    newest = g.op("Gather", "features_buffer", g.const(np.int64(HISTORY_LEN - 1), "newest"),
                  axis=1)
    desire = g.op("Flatten", "desire_pulse", axis=1)
    x = g.op("Concat", history, newest, desire, "traffic_convention", axis=1)
    din = 2 * FEATURE_LEN + HISTORY_LEN * DESIRE_LEN + 2
    return dense_heads(g, x, din, POLICY_HEADS, "driving_policy", "policy", seed)


def make_dmonitoring(float16: bool = False, seed: int = 2) -> onnx.ModelProto:
    g = _start(seed, float16, DM_INPUTS)
    w, h = DM_SIZE
    img = g.op("Reshape", "input_img", g.const(np.array([1, 1, h, w], np.int64), "dm_shape"))
    feats = pooled(g, pixels(g, img), (1, 8, 16), (8, 4))
    return dense_heads(g, g.op("Concat", feats, "calib", axis=1), 16 + 3, DM_HEADS,
                       "dmonitoring_model", "dmonitoring", seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vision")
    ap.add_argument("--policy")
    ap.add_argument("--dm")
    ap.add_argument("--float16", action="store_true", help="fp16 weights (each Cast to fp32)")
    args = ap.parse_args()
    for path, make in ((args.vision, make_vision), (args.policy, make_policy),
                       (args.dm, make_dmonitoring)):
        if path:
            onnx.save(make(args.float16), path)


if __name__ == "__main__":
    main()
