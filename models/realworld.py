"""Real-world shapes the CPU planner was not tuned for, with seeded random weights.

- ocr: a CRNN-style text recognizer (PaddleOCR's 3x48x320 input): a VGG-like conv stack whose
  pools halve the height only after the first two, a height-collapsing pool, then a wide dense
  head over the 80 sequence steps to a 6625-character alphabet with Softmax.
- detector: a YOLO-like single-shot detector on a 256x448 frame: strided 3x3 convs with 1x1/3x3
  residual blocks down to /32, a top-down feature pyramid (nearest 2x Resize + Concat) and three
  heads of 3 anchors x (5 + 80 classes) channels at /8, /16 and /32.
- mobilenetv2: MobileNetV2 1.0 (Sandler et al. 2018): inverted residuals with ReLU6 and
  depthwise 3x3 convs at 112, 56, 28, 14 and 7 pixels, no squeeze-excite.
- mlp: a transformer MLP block, 128 tokens of 768: MatMul to 3072, GELU, MatMul back, residual.
- gemm: a batch of 64 rows through three fully connected layers (1024 -> 4096 -> 1024 -> 1000).

    python -m models.realworld NAME -o NAME.onnx [--seed 0]
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import onnx

from models.blocks import (SECOND_MOMENT, GraphBuilder, conv, conv_bn_act, gelu, gemm, linear,
                           mbconv)

OCR_STAGES = ((32, 1, (2, 2)), (64, 1, (2, 2)), (128, 2, (2, 1)), (256, 2, (2, 1)))
OCR_ALPHABET = 6625  # PaddleOCR's Chinese+English dictionary, plus the CTC blank


def make_ocr(seed: int = 0, channels: int = 3, height: int = 48, width: int = 320,
             alphabet: int = OCR_ALPHABET) -> onnx.ModelProto:
    """(1, channels, height, width) -> (1, width/4, alphabet) per-step character probabilities."""
    g = GraphBuilder(seed)
    h = g.input("image", np.float32, (1, channels, height, width))
    c = channels
    for cout, repeats, pool in OCR_STAGES:
        for _ in range(repeats):
            h = conv_bn_act(g, h, c, cout, 3, act="relu")
            c = cout
        h = g.op("MaxPool", h, kernel_shape=list(pool), strides=list(pool))
    rows, steps = height // 16, width // 4
    h = conv_bn_act(g, h, c, c, 3, act="relu")
    h = g.op("MaxPool", h, kernel_shape=[rows, 1], strides=[rows, 1])  # (1, c, 1, steps)
    seq = g.op("Transpose", g.op("Reshape", h, g.const(np.array([1, c, steps], np.int64),
                                                       "seq_shape")), perm=[0, 2, 1])
    hidden = g.op("Relu", linear(g, seq, c, c, gain=math.sqrt(2)))
    logits = linear(g, hidden, c, alphabet, gain=2.0)
    probs = g.op("Softmax", logits, axis=-1, out="probs")
    return g.model([(probs, np.float32, (1, steps, alphabet))], "ocr_recognizer",
                   doc=f"CRNN-style text recognizer, random weights, seed {seed}")


DETECTOR_STAGES = ((64, 2), (128, 2), (256, 1))  # (channels, residual blocks) at /8, /16, /32


def residual(g: GraphBuilder, x: str, c: int) -> str:
    """YOLO's backbone block: 1x1 to half the channels, 3x3 back, added to the input."""
    h = conv_bn_act(g, x, c, c // 2, 1)
    return g.op("Add", x, conv_bn_act(g, h, c // 2, c, 3, gamma=0.5))


def make_detector(seed: int = 0, height: int = 256, width: int = 448, classes: int = 80,
                  anchors: int = 3) -> onnx.ModelProto:
    """(1, 3, height, width) -> raw head maps at strides 8, 16 and 32."""
    g = GraphBuilder(seed)
    h = g.input("image", np.float32, (1, 3, height, width))
    h = conv_bn_act(g, conv_bn_act(g, h, 3, 16, 3, 2), 16, 32, 3, 2)
    h, c, levels = residual(g, h, 32), 32, []
    for cout, blocks in DETECTOR_STAGES:
        h = conv_bn_act(g, h, c, cout, 3, 2)
        for _ in range(blocks):
            h = residual(g, h, cout)
        levels.append(h)
        c = cout
    # top-down pyramid: each level gets the coarser one, reduced by a 1x1 and upsampled 2x
    pyramid, top, top_c = [conv_bn_act(g, levels[-1], c, c, 3)], levels[-1], c
    for feat, fc in zip(reversed(levels[:-1]), (128, 64)):
        up = g.op("Resize", conv_bn_act(g, top, top_c, fc, 1), "",
                  g.const(np.array([1, 1, 2, 2], np.float32), "scales"), mode="nearest")
        top, top_c = conv_bn_act(g, g.op("Concat", up, feat, axis=1), 2 * fc, fc, 3), fc
        pyramid.append(top)
    outputs, per_cell = [], anchors * (5 + classes)
    for level, (p, pc) in enumerate(zip(reversed(pyramid), (64, 128, 256))):
        stride = 8 << level
        out = conv(g, conv_bn_act(g, p, pc, pc, 3), pc, per_cell, 1, bias=True,
                   gain=1 / math.sqrt(SECOND_MOMENT["silu"]), out=f"head{stride}")
        outputs.append((out, np.float32, (1, per_cell, height // stride, width // stride)))
    return g.model(outputs, "detector", doc=f"YOLO-like detector, random weights, seed {seed}")


# (expand ratio, output channels, repeats, first stride) per stage, as in the paper's table 2.
MOBILENETV2_STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                      (6, 160, 3, 2), (6, 320, 1, 1))


def make_mobilenetv2(seed: int = 0, size: int = 224, classes: int = 1000) -> onnx.ModelProto:
    g = GraphBuilder(seed)
    h = conv_bn_act(g, g.input("input", np.float32, (1, 3, size, size)), 3, 32, 3, 2,
                    act="relu6")
    c = 32
    for expand, cout, repeats, stride in MOBILENETV2_STAGES:
        for i in range(repeats):
            h = mbconv(g, h, c, cout, expand, 3, stride if i == 0 else 1, se_ratio=0,
                       act="relu6")
            c = cout
    h = conv_bn_act(g, h, c, 1280, 1, act="relu6")
    features = g.op("Flatten", g.op("GlobalAveragePool", h), axis=1)
    logits = gemm(g, features, 1280, classes, gain=1.0, out="logits")
    return g.model([(logits, np.float32, (1, classes))], "mobilenetv2",
                   doc=f"MobileNetV2 1.0, random weights, seed {seed}")


def make_mlp(seed: int = 0, tokens: int = 128, d: int = 768, ratio: int = 4) -> onnx.ModelProto:
    g = GraphBuilder(seed)
    x = g.input("x", np.float32, (1, tokens, d))
    hidden = gelu(g, linear(g, x, d, d * ratio))
    y = linear(g, hidden, d * ratio, d, gain=0.5 / math.sqrt(SECOND_MOMENT["gelu"]))
    out = g.op("Add", x, y, out="y")
    return g.model([(out, np.float32, (1, tokens, d))], "transformer_mlp",
                   doc=f"transformer MLP block, random weights, seed {seed}")


def make_gemm(seed: int = 0, batch: int = 64, widths=(1024, 4096, 1024, 1000)) -> onnx.ModelProto:
    g = GraphBuilder(seed)
    h = g.input("x", np.float32, (batch, widths[0]))
    for i, (din, dout) in enumerate(zip(widths, widths[1:])):
        last = i == len(widths) - 2
        h = gemm(g, h, din, dout, gain=1.0 if last else math.sqrt(2), out="y" if last else None)
        h = h if last else g.op("Relu", h)
    return g.model([(h, np.float32, (batch, widths[-1]))], "gemm_batch",
                   doc=f"batched fully connected stack, random weights, seed {seed}")


MAKERS = {"ocr": make_ocr, "detector": make_detector, "mobilenetv2": make_mobilenetv2,
          "mlp": make_mlp, "gemm": make_gemm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(MAKERS))
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    onnx.save(MAKERS[args.name](seed=args.seed), args.output)


if __name__ == "__main__":
    main()
