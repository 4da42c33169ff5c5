"""Quantized models for the DSP (docs/dsp.md): a float model through onnxruntime's
quantize_static, as issue 36 measures them: QDQ format, int8 weights per output channel, uint8
activations, calibrated on 8 seeded inputs. onnxruntime's pre-processing runs first (it folds
BatchNormalization into the convs, as exporters do; without it every BN stays a float op
between a DequantizeLinear and a QuantizeLinear).

- mobilenetv2: models/realworld.py's MobileNetV2 1.0 at 224 (`--size` for a smaller image).
- dm: models/dm.py's driver-monitoring-shaped model.

    python -m models.quantized NAME -o NAME.onnx [--size 224]

onnxruntime is a test and tool dependency, never the compiler's.
"""
from __future__ import annotations

import argparse
import tempfile

import numpy as np
import onnx

CALIBRATION_INPUTS = 8


def quantize(model: onnx.ModelProto, feeds: list[dict], activations: str = "uint8",
             pre_process: bool = True) -> onnx.ModelProto:
    """`model` quantized by onnxruntime's quantize_static, calibrated on `feeds`: QDQ format,
    int8 weights per output channel, `activations` ("uint8" or "int8"). `pre_process`: first
    onnxruntime's quant_pre_process, which folds BatchNormalizations into the convs."""
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Feeds(CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)
    with tempfile.TemporaryDirectory(prefix="keel-quant-") as d:
        onnx.save(model, f"{d}/float.onnx")
        source = f"{d}/float.onnx"
        if pre_process:
            quant_pre_process(source, f"{d}/pre.onnx", skip_symbolic_shape=True)
            source = f"{d}/pre.onnx"
        quantize_static(source, f"{d}/qdq.onnx", Feeds(), quant_format=QuantFormat.QDQ,
                        per_channel=True,
                        activation_type={"uint8": QuantType.QUInt8,
                                         "int8": QuantType.QInt8}[activations],
                        weight_type=QuantType.QInt8)
        return onnx.load(f"{d}/qdq.onnx")


def image(seed: int, size: int = 224) -> dict:
    """A standard-normal (1, 3, size, size) input for MobileNetV2, `input`."""
    return {"input": np.random.default_rng(seed).standard_normal((1, 3, size, size))
            .astype(np.float32)}


def dm_frame(seed: int) -> dict:
    """A DM-shaped model's inputs: a uniformly random uint8 frame and small calibration
    angles (radians)."""
    from models.dm import HEIGHT, WIDTH
    rng = np.random.default_rng(seed)
    return {"input_img": rng.integers(0, 256, (1, HEIGHT * WIDTH), dtype=np.uint8),
            "calib": (rng.standard_normal((1, 3)) * 0.1).astype(np.float32)}


def mobilenetv2(size: int = 224, classes: int = 1000) -> onnx.ModelProto:
    from models.realworld import make_mobilenetv2
    return quantize(make_mobilenetv2(size=size, classes=classes),
                    [image(k, size) for k in range(CALIBRATION_INPUTS)])


def dm() -> onnx.ModelProto:
    from models.dm import make_dm
    return quantize(make_dm(), [dm_frame(k) for k in range(CALIBRATION_INPUTS)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=["mobilenetv2", "dm"])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--size", type=int, default=224, help="mobilenetv2's image size")
    args = ap.parse_args()
    onnx.save(mobilenetv2(args.size) if args.name == "mobilenetv2" else dm(), args.output)


if __name__ == "__main__":
    main()
