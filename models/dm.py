"""A driver-monitoring-shaped model: openpilot's DM interface with a small CNN trunk and seeded
random weights, for the DSP (docs/dsp.md, "A DM-shaped model").

Inputs as openpilot feeds its DM model: `input_img`, uint8 (1, 1440*960), one camera frame's
luma, and `calib`, float32 (1, 3), the device's calibration angles. Output `outputs`, float32
(1, 84 + 512): an 84-value head (openpilot's DM outputs) and the 512 features it is read from.

The frame is read as an image of integers: DequantizeLinear(scale 1/255) is the model's first
op, so a quantizer keeps it uint8 and the first conv multiplies the camera's bytes directly
(a float Cast and scale over 1.4 M pixels would run on the DSP's scalar FP unit). Trunk: an 8x8
stride-8 stem to 180x120, three 3x3 stride-2 convs to 23x15, global average pool, a 512-wide
fully connected layer; the head reads the features and the calibration.

    python -m models.dm -o dm.onnx [--seed 0]
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import onnx

from models.blocks import GraphBuilder, conv, gemm

HEIGHT, WIDTH = 1440, 960
HEAD, FEATURES = 84, 512
TRUNK = (32, 64, 128)  # channels of the 3x3 stride-2 convs after the stem's 16


def make_dm(seed: int = 0) -> onnx.ModelProto:
    g = GraphBuilder(seed)
    img = g.input("input_img", np.uint8, (1, HEIGHT * WIDTH))
    calib = g.input("calib", np.float32, (1, 3))
    frame = g.op("Reshape", img, g.const(np.array([1, 1, HEIGHT, WIDTH], np.int64), "shape"))
    x = g.op("DequantizeLinear", frame, g.const(np.float32(1 / 255), "scale"),
             g.const(np.uint8(0), "zero_point"))
    w = g.normal((16, 1, 8, 8), 2 * math.sqrt(2) / 8, "stem_w")  # pixels in [0, 1]: mean 1/2
    h = g.op("Relu", g.op("Conv", x, w, g.normal((16,), 0.1, "stem_b"), kernel_shape=[8, 8],
                          strides=[8, 8]))
    c = 16
    for cout in TRUNK:
        h = g.op("Relu", conv(g, h, c, cout, 3, 2, bias=True))
        c = cout
    pooled = g.op("Flatten", g.op("GlobalAveragePool", h), axis=1)
    features = g.op("Relu", gemm(g, pooled, c, FEATURES, gain=math.sqrt(2)))
    head = gemm(g, g.op("Concat", features, calib, axis=1), FEATURES + 3, HEAD, gain=1.0)
    out = g.op("Concat", head, features, axis=1, out="outputs")
    return g.model([(out, np.float32, (1, HEAD + FEATURES))], "dm_shaped",
                   doc=f"driver-monitoring-shaped CNN, random weights, seed {seed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    onnx.save(make_dm(args.seed), args.output)


if __name__ == "__main__":
    main()
