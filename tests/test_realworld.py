"""The real-world bench generators (models/realworld.py): valid ONNX at full size, and keel's
blob of each, at a reduced size with the same features, matches onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from models.flops import count_flops
from models.realworld import MAKERS, make_detector, make_gemm, make_mlp, make_mobilenetv2, make_ocr
from tests.graphs import _load_at, assert_close, compiled_blob, ort_run, random_feeds

# (bench name, output shapes, GFLOP range) at the sizes tools/bench.py runs
FULL = {"ocr": ({"probs": (1, 80, 6625)}, (1.5, 2.5)),
        "detector": ({"head8": (1, 255, 32, 56), "head16": (1, 255, 16, 28),
                      "head32": (1, 255, 8, 14)}, (1.5, 2.5)),
        "mobilenetv2": ({"logits": (1, 1000)}, (0.5, 0.7)),
        "mlp": ({"y": (1, 128, 768)}, (1.1, 1.3)),
        "gemm": ({"y": (64, 1000)}, (1.1, 1.3))}


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_each_generator_builds_a_valid_model_with_live_activations(name):
    model = MAKERS[name]()
    onnx.checker.check_model(model, full_check=True)
    shapes, (low, high) = FULL[name]
    assert low <= count_flops(model)["total"] / 1e9 <= high
    outputs = ort_run(model, random_feeds(model, seed=0))
    assert {k: v.shape for k, v in outputs.items()} == shapes
    for k, v in outputs.items():
        assert np.isfinite(v).all(), f"{name} {k}: non-finite"
        if name == "ocr":  # probabilities: each step sums to 1, and is not uniform
            assert np.allclose(v.sum(-1), 1, atol=1e-4)
            assert v.max(-1).mean() > 20 / v.shape[-1], "flat: the logits carry no signal"
        else:  # seeded weights at trained-like scales: O(1) outputs, nothing saturated or dead
            rms = float(np.sqrt(np.mean(v.astype(np.float64) ** 2)))
            assert 0.1 < rms < 10, f"{name} {k}: rms {rms:.3g}, expected O(1)"


# Reduced sizes that keep what each model is in the bench for: an odd alphabet (197: padded
# columns, 1.6M multiply-adds) over a non-square image, 255-channel heads (the finest padded),
# depthwise stages at several sizes, exact GELU, a dense layer to an odd width (padded).
SMALL = {"ocr": lambda: make_ocr(height=32, width=128, alphabet=197),
         "detector": lambda: make_detector(height=64, width=96),
         "mobilenetv2": lambda: make_mobilenetv2(size=64, classes=100),
         "mlp": lambda: make_mlp(tokens=16, d=64),
         "gemm": lambda: make_gemm(batch=16, widths=(64, 256, 512, 202))}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)  # whole nets: 10-20 s
                                  if n in ("ocr", "detector", "mobilenetv2") else n
                                  for n in sorted(SMALL)])
def test_keel_matches_onnxruntime_on_each_generator(name):
    model = SMALL[name]()
    feeds = random_feeds(model, seed=1)
    got = _load_at(compiled_blob(model, target="cpu"), None).run(feeds)
    # fp32 sums of up to 2304 products (3x3 over 256 channels) and Winograd's regrouping of
    # them, in another order than onnxruntime's MLAS, through up to 17 layers on O(1)
    # activations: a few e-6 measured at full size (docs/perf.md); 1e-4 leaves room for the
    # order alone and catches any wrong index, which moves outputs by O(1)
    for k, want in ort_run(model, feeds).items():
        assert_close(got[k], want, rtol=1e-4, atol=1e-4, what=f"{name} {k}")
