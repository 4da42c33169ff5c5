"""ResNet-50 v1 classifier with random He-init weights (torchvision topology, stride on the 3x3).

Stem conv 7x7/2 + BN + ReLU + MaxPool 3x3/2, bottleneck stages of 3, 4, 6, 3 blocks (widths 64,
128, 256, 512, expansion 4), global average pool, fully connected to 1000 classes.

    python -m models.resnet -o resnet50.onnx [--size 224] [--batch 1] [--seed 0]
"""
from __future__ import annotations

import numpy as np
import onnx

from models.blocks import GraphBuilder, bottleneck, conv_bn_act, gemm, image_net_cli

# (bottleneck width, blocks, first stride) per stage.
RESNET50_STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))


def make_resnet50(seed: int = 0, batch: int = 1, size: int = 224,
                  classes: int = 1000) -> onnx.ModelProto:
    g = GraphBuilder(seed)
    x = g.input("input", np.float32, (batch, 3, size, size))
    h = conv_bn_act(g, x, 3, 64, 7, stride=2, act="relu")
    h = g.op("MaxPool", h, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c = 64
    for width, blocks, stride in RESNET50_STAGES:
        for i in range(blocks):
            h = bottleneck(g, h, c, width, stride if i == 0 else 1)
            c = width * 4
    features = g.op("Flatten", g.op("GlobalAveragePool", h), axis=1)
    logits = gemm(g, features, c, classes, gain=1.0, out="logits")
    return g.model([(logits, np.float32, (batch, classes))], "resnet50",
                   doc=f"ResNet-50 v1, random weights, seed {seed}")


def main() -> None:
    image_net_cli(make_resnet50, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
