"""ONNX op implementations by topic; importing this package registers them all into OPS."""
from compiler.onnx.ops import (attention, core, index, quant, resize, rnn,  # noqa: F401
                               sample, signal)
