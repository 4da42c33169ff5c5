"""An STFT / log-mel audio front end with a small keyword head: the shape of a wake-word or
voice-activity model's first stage, with random head weights.

Input `audio` (1, samples) float32 holds 16 kHz PCM at int16 scale (values up to +-32767), as
openWakeWord's melspectrogram model takes it. STFT (512-sample Hann frames every 160 samples,
ONNX's STFT op), power spectrum (re^2 + im^2), 32 mel bands (a triangular filter bank, an
initializer), log10 of the energies clipped below at 1e-10, scaled to dB / 10 + 2 as
openWakeWord does; output `mel` (1, frames, 32). A keyword head reads it: a conv over time,
ReLU, mean over time and a linear layer, output `score` (1, 4).

At int16 scale the spectrum reaches ~1e6 and its power ~1e12: far beyond half's 65504, so
`--float16` on a half-activation target overflows unless those tensors stay fp32 (--calibrate,
compiler/codegen/ranges.py). The dB values and the head fit half easily.

    python -m models.audio_frontend -o frontend.onnx [--samples 8000] [--calibration feeds.npz]
"""
from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import helper, numpy_helper

RATE, FRAME, STEP, MELS, CLASSES = 16000, 512, 160, 32, 4


def mel_filters(bins: int = FRAME // 2 + 1, mels: int = MELS, rate: int = RATE) -> np.ndarray:
    """(bins, mels) triangular filters, evenly spaced on the mel scale from 0 to rate / 2."""
    mel = lambda hz: 2595 * np.log10(1 + hz / 700)  # noqa: E731
    hz = lambda m: 700 * (10 ** (m / 2595) - 1)  # noqa: E731
    edges = hz(np.linspace(0, mel(rate / 2), mels + 2))
    freqs = np.linspace(0, rate / 2, bins)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    up, down = (freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)
    return np.maximum(0, np.minimum(up, down)).T.astype(np.float32)


def build(samples: int = 8000, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(FRAME) / FRAME)).astype(np.float32)
    inits = {
        "axis2": np.array([2], np.int64), "step": np.array(STEP, np.int64),
        "window": window, "frame": np.array(FRAME, np.int64), "last": np.array([-1], np.int64),
        "mel_w": mel_filters(), "floor": np.array(1e-10, np.float32),
        "ln10": np.array(np.log(10.0), np.float32), "two": np.array(2.0, np.float32),
        "conv_w": (rng.standard_normal((16, MELS, 3)) / np.sqrt(3 * MELS)).astype(np.float32),
        "conv_b": np.zeros(16, np.float32),
        "fc_w": (rng.standard_normal((16, CLASSES)) / 4).astype(np.float32),
    }
    nodes = [
        helper.make_node("Unsqueeze", ["audio", "axis2"], ["signal"]),
        helper.make_node("STFT", ["signal", "step", "window", "frame"], ["spectrum"],
                         onesided=1, name="stft"),
        helper.make_node("Mul", ["spectrum", "spectrum"], ["squares"], name="square"),
        helper.make_node("ReduceSum", ["squares", "last"], ["power"], keepdims=0, name="power"),
        helper.make_node("MatMul", ["power", "mel_w"], ["energy"], name="mel_filterbank"),
        helper.make_node("Max", ["energy", "floor"], ["clipped"], name="clip_floor"),
        helper.make_node("Log", ["clipped"], ["ln"], name="log"),
        # dB / 10 = log10(energy) = ln(energy) / ln(10), plus 2: openWakeWord's scaling
        helper.make_node("Div", ["ln", "ln10"], ["bels"], name="to_bels"),
        helper.make_node("Add", ["bels", "two"], ["mel"], name="offset"),
        helper.make_node("Transpose", ["mel"], ["mel_t"], perm=[0, 2, 1]),
        helper.make_node("Conv", ["mel_t", "conv_w", "conv_b"], ["conv"], pads=[1, 1],
                         name="head_conv"),
        helper.make_node("Relu", ["conv"], ["act"], name="head_relu"),
        helper.make_node("ReduceMean", ["act"], ["pooled"], axes=[2], keepdims=0,
                         name="head_pool"),
        helper.make_node("MatMul", ["pooled", "fc_w"], ["score"], name="head_fc"),
    ]
    frames = (samples - FRAME) // STEP + 1
    graph = helper.make_graph(
        nodes, "audio_frontend",
        [helper.make_tensor_value_info("audio", onnx.TensorProto.FLOAT, [1, samples])],
        [helper.make_tensor_value_info("mel", onnx.TensorProto.FLOAT, [1, frames, MELS]),
         helper.make_tensor_value_info("score", onnx.TensorProto.FLOAT, [1, CLASSES])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17)]
    return helper.make_model(graph, opset_imports=opsets,
                             ir_version=helper.find_min_ir_version_for(opsets))


def speech_like(samples: int = 8000, seed: int = 0, loudness: float = 0.5) -> np.ndarray:
    """(1, samples) int16-scale audio: a few harmonics of a gliding pitch with noise, at
    `loudness` of full scale."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / RATE
    pitch = 120 + 60 * rng.random() + 40 * t
    phase = 2 * np.pi * np.cumsum(pitch) / RATE
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    x = voice / np.abs(voice).max() + 0.05 * rng.standard_normal(samples)
    return (loudness * 32767 * x / np.abs(x).max()).astype(np.float32)[None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--calibration", metavar="FEEDS.npz",
                    help="also write 4 speech-like clips (each `audio` sample) for --calibrate")
    args = ap.parse_args()
    onnx.save(build(args.samples), args.output)
    if args.calibration:
        clips = np.stack([speech_like(args.samples, s, loud) for s, loud in
                          enumerate((0.1, 0.3, 0.6, 1.0))])
        np.savez(args.calibration, audio=clips)


if __name__ == "__main__":
    main()
