"""A light real network for the tools' tests (bisect, profile, blobinfo): a conv + BN + SiLU
stem, an MBConv block with squeeze-excite, a 1x1 head conv, global pooling and a classifier, 27
ONNX nodes. Built from the same layers as the EfficientNet and openpilot generators."""
from __future__ import annotations

import numpy as np
import onnx

from models.blocks import GraphBuilder, conv_bn_act, gemm, mbconv


def light_net(size: int = 16) -> onnx.ModelProto:
    g = GraphBuilder(seed=3)
    x = g.input("image", np.float32, (1, 3, size, size))
    h = conv_bn_act(g, x, 3, 8, 3, stride=2)
    h = mbconv(g, h, 8, 8, 1, 3, 1)
    h = conv_bn_act(g, h, 8, 16, 1)
    f = g.op("Flatten", g.op("GlobalAveragePool", h), axis=1)
    return g.model([(gemm(g, f, 16, 10, out="logits"), np.float32, (1, 10))], "light",
                   doc="light net for the tools' tests")
