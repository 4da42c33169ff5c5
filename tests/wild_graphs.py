"""Models in the style of real exports: control flow (tests/test_control_flow.py) and dynamic
dims written as -1 (tests/test_dynamic_shapes.py)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from tests.graphs import make_model


def branch(name: str, nodes, outputs, initializers=()) -> "onnx.GraphProto":
    """An If branch: no inputs, outputs as (name, shape, dtype) tuples (shape None: unknown)."""
    outs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(d)),
                                          None if s is None else list(s))
            for n, s, d in outputs]
    inits = [helper.make_tensor(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape,
                                a.reshape(-1).tolist()) for n, a in dict(initializers).items()]
    return helper.make_graph(list(nodes), name, [], outs, inits)


def voice_activity(samples: int = 512, hidden: int = 16, seed: int = 0):
    """A voice-activity net in the style of silero's: audio [1, samples], the sample rate `sr`
    (int64 scalar) and a recurrent state [1, 1, hidden]. An If on `sr == 16000` picks the
    front end: a strided conv over windows of 256 samples at 16 kHz, of 128 at 8 kHz, so the
    two branches give different frame counts (only a frozen sr compiles). A GRU over the frames
    from the state, then a linear head and a sigmoid give the speech probability and the next
    state."""
    rng = np.random.default_rng(seed)
    w = lambda *s: (rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32)  # noqa: E731
    feat = 8
    then = branch("sr16k", [
        helper.make_node("Conv", ["audio3", "w16k"], ["frames16"], strides=[128])],
        [("frames16", None, np.float32)])
    other = branch("sr8k", [
        helper.make_node("Conv", ["audio3", "w8k"], ["frames8"], strides=[64])],
        [("frames8", None, np.float32)])
    nodes = [
        helper.make_node("Unsqueeze", ["input", "axis1"], ["audio3"]),
        helper.make_node("Equal", ["sr", "sr16000"], ["is16k"]),
        helper.make_node("If", ["is16k"], ["frames"], then_branch=then, else_branch=other,
                         name="front_end_if"),
        helper.make_node("Relu", ["frames"], ["act"]),
        helper.make_node("Transpose", ["act"], ["seq"], perm=[2, 0, 1]),  # [T, 1, feat]
        helper.make_node("GRU", ["seq", "gru_w", "gru_r", "gru_b", "", "state"], ["ys", "stateN"],
                         hidden_size=hidden, linear_before_reset=1),
        helper.make_node("MatMul", ["stateN", "head_w"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["prob"]),
        helper.make_node("Reshape", ["prob", "out_shape"], ["output"]),
    ]
    inits = {"axis1": np.array([1], np.int64), "sr16000": np.array(16000, np.int64),
             "w16k": w(feat, 1, 256), "w8k": w(feat, 1, 128),
             "gru_w": w(1, 3 * hidden, feat), "gru_r": w(1, 3 * hidden, hidden),
             "gru_b": np.zeros((1, 6 * hidden), np.float32), "head_w": w(hidden, 1),
             "out_shape": np.array([1, 1], np.int64)}
    return make_model(nodes, [("input", (1, samples), np.float32), ("sr", (), np.int64),
                              ("state", (1, 1, hidden), np.float32)],
                      [("output", (1, 1), np.float32), ("stateN", (1, 1, hidden), np.float32)],
                      inits, name="voice_activity")


def paddle_recognizer(classes: int = 11, seed: int = 0):
    """A text recognizer in the style of a PaddlePaddle export (PaddleOCR's rec models): image
    [-1, 3, 48, -1] with its dynamic batch and width written as dim_value = -1, a conv stem,
    a pool, the feature map reshaped to a sequence by a shape-derived Reshape ([0, -1, W]) and a
    per-column classifier with a softmax; the output's dynamic dims are -1 too."""
    rng = np.random.default_rng(seed)
    w = lambda *s: (rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype(np.float32)  # noqa: E731
    nodes = [
        helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["c"], pads=[1, 1, 1, 1],
                         strides=[2, 2], name="conv2d_0"),
        helper.make_node("Relu", ["c"], ["r"], name="relu_0"),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2],
                         name="pool2d_0"),
        helper.make_node("Shape", ["p"], ["p_shape"]),
        helper.make_node("Gather", ["p_shape", "last"], ["width"], axis=0),
        helper.make_node("Concat", ["zero_minus1", "width"], ["seq_shape"], axis=0),
        helper.make_node("Reshape", ["p", "seq_shape"], ["seq"], name="reshape2_0"),
        helper.make_node("Transpose", ["seq"], ["cols"], perm=[0, 2, 1], name="transpose2_0"),
        helper.make_node("MatMul", ["cols", "fc_w"], ["logits"], name="matmul_0"),
        helper.make_node("Softmax", ["logits"], ["softmax_0.tmp_0"], axis=-1, name="softmax_0"),
    ]
    inits = {"conv_w": w(8, 3, 3, 3), "conv_b": w(8), "last": np.array([3], np.int64),
             "zero_minus1": np.array([0, -1], np.int64), "fc_w": w(8 * 12, classes)}
    return make_model(nodes, [("x", (-1, 3, 48, -1), np.float32)],
                      [("softmax_0.tmp_0", (-1, -1, classes), np.float32)], inits, opset=11,
                      name="paddle_rec")
