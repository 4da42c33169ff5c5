"""EfficientNet-B0-like classifier with random weights, and the trunk openpilot's generator reuses.

Topology of B0 (Tan & Le 2019): stem conv 3x3/2, 16 MBConv blocks with depthwise 3x3 and 5x5
convs and squeeze-excite, head conv 1x1 to 1280, global pool, fully connected to 1000 classes.
SiLU is written x*Sigmoid(x). Drop-connect and dropout are training-only and absent.

    python -m models.efficientnet -o efficientnet.onnx [--size 224] [--batch 1] [--seed 0]
"""
from __future__ import annotations

import numpy as np
import onnx

from models.blocks import GraphBuilder, conv_bn_act, gemm, image_net_cli, mbconv

# (expand ratio, output channels, repeats, first stride, depthwise kernel) per stage.
B0_STAGES = ((1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 40, 2, 2, 5), (6, 80, 3, 2, 3),
             (6, 112, 3, 1, 5), (6, 192, 4, 2, 5), (6, 320, 1, 1, 3))
STEM_CHANNELS = 32
HEAD_CHANNELS = 1280
FEATURE_MOMENT = 0.2  # E[x^2] of the pooled head features (measured): sets the next layer's gain


def trunk(g: GraphBuilder, x: str, cin: int, stages=B0_STAGES,
          kernel: int | None = None) -> tuple[str, int]:
    """Stem, MBConv stages and head conv; returns the (batch, HEAD_CHANNELS) pooled features.

    kernel overrides every stage's depthwise kernel size (openpilot's trunk uses 3x3 throughout).
    """
    h = conv_bn_act(g, x, cin, STEM_CHANNELS, 3, stride=2)
    c = STEM_CHANNELS
    for expand, cout, repeats, stride, k in stages:
        for i in range(repeats):
            h = mbconv(g, h, c, cout, expand, kernel or k, stride if i == 0 else 1)
            c = cout
    h = conv_bn_act(g, h, c, HEAD_CHANNELS, 1)
    return g.op("Flatten", g.op("GlobalAveragePool", h), axis=1), HEAD_CHANNELS


def make_efficientnet(seed: int = 0, size: int = 224, batch: int = 1,
                      classes: int = 1000) -> onnx.ModelProto:
    g = GraphBuilder(seed)
    x = g.input("input", np.float32, (batch, 3, size, size))
    features, c = trunk(g, x, 3)
    logits = gemm(g, features, c, classes, gain=1 / np.sqrt(FEATURE_MOMENT), out="logits")
    return g.model([(logits, np.float32, (batch, classes))], "efficientnet_b0",
                   doc=f"EfficientNet-B0-like, random weights, seed {seed}")


def main() -> None:
    image_net_cli(make_efficientnet, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
