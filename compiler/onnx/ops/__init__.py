"""ONNX op implementations by topic; importing this package registers them all into OPS."""
from compiler.onnx.ops import (attention, elementwise, index, nn, quant, reduce,  # noqa: F401
                               resize, rnn, sample, shape, signal)
