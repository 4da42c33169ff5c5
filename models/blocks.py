"""Graph builder and the layers every test-model generator is made of.

`GraphBuilder` tracks nodes and initializers and hands out unique names; the layer functions
below (conv+bn+act, squeeze-excite, MBConv, bottleneck, linear, layer norm, attention, ...) are
the one place each structure is written, so resnet, efficientnet and openpilot differ only in how
they stack them.

Weights are random but behave like a trained net's, so activations stay O(1), no Sigmoid
saturates and nothing is constant enough to fold away:
- convs are He-init, dense layers LeCun-init with explicit gains where no norm layer follows;
- every BatchNorm's running statistics are calibrated: one onnxruntime pass over a seeded random
  input measures each BN input's mean and variance (with all earlier BNs already normalizing),
  as training would have. Without it a 16-block EfficientNet drifts to activations of 10+ and
  saturated squeeze-excite gates: 9-tap depthwise filters spread per-channel gains widely and
  SiLU, convex in the scale, compounds the spread stage after stage;
- residual branches enter at BN gain 0.5, so the trunk grows slowly with depth.
"""
from __future__ import annotations

import argparse
import collections
import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17  # LayerNormalization first appears in opset 17
# onnx 1.23 stamps IR 14 by default, which onnxruntime 1.31 rejects; opset 17 needs only IR 8.
IR_VERSION = helper.find_min_ir_version_for([helper.make_opsetid("", OPSET)])


class GraphBuilder:
    """Accumulates one ONNX graph. Every method returns the name(s) of the value(s) it made."""

    def __init__(self, seed: int = 0, fp16_weights: bool = False):
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        # openpilot ships fp16 weights; ORT's CPU provider has no fp16 Conv/MatMul/elementwise
        # kernels, so fp16 storage is followed by a Cast and the compute stays fp32.
        self.fp16_weights = fp16_weights
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        # BN node name -> (initializer index of its mean, of its var, channels)
        self.stats: dict[str, tuple[int, int, int]] = {}
        self._counts: collections.Counter = collections.Counter()

    def name(self, prefix: str) -> str:
        self._counts[prefix] += 1
        return f"{prefix}_{self._counts[prefix]}"

    def input(self, name: str, dtype, shape: tuple[int, ...]) -> str:
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        self.inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
        return name

    def const(self, value, prefix: str = "const") -> str:
        """An exact constant (shapes, scales, masks): never stored as fp16."""
        name = self.name(prefix)
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def param(self, value: np.ndarray, prefix: str) -> str:
        """A learned parameter: fp32, or fp16 storage plus a Cast when fp16_weights is set."""
        if not self.fp16_weights:
            return self.const(value.astype(np.float32), prefix)
        stored = self.const(value.astype(np.float16), prefix + "_fp16")
        return self.op("Cast", stored, to=TensorProto.FLOAT)

    def normal(self, shape: tuple[int, ...], std: float, prefix: str) -> str:
        return self.param(self.rng.standard_normal(shape) * std, prefix)

    def uniform(self, shape: tuple[int, ...], low: float, high: float, prefix: str) -> str:
        return self.param(self.rng.uniform(low, high, shape), prefix)

    def op(self, op_type: str, *inputs: str, outputs: int = 1, out: str | None = None, **attrs):
        """out names a single output (a graph output needs its interface name)."""
        base = self.name(op_type.lower())
        names = [out or base] if outputs == 1 else [f"{base}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=base, **attrs))
        return names[0] if outputs == 1 else names

    def model(self, outputs: list[tuple[str, object, tuple[int, ...]]], graph_name: str,
              doc: str = "", metadata: dict[str, str] | None = None) -> onnx.ModelProto:
        """The finished model, BN statistics calibrated. outputs: (name, numpy dtype, shape)."""
        out_infos = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(
            np.dtype(dt)), list(shape)) for n, dt, shape in outputs]
        if self.stats:
            calibrate_batch_norms(self)
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, out_infos,
                                  initializer=self.initializers, doc_string=doc)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  ir_version=IR_VERSION, producer_name="keel.models")
        helper.set_model_props(model, metadata or {})
        return model


# ---- BatchNorm calibration -----------------------------------------------------------------

def calibration_feeds(inputs: list[onnx.ValueInfoProto], seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs like tests feed: uint8 over the full range, floats standard normal."""
    rng = np.random.default_rng((seed, 1))
    feeds = {}
    for vi in inputs:
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if dtype == np.uint8:
            feeds[vi.name] = rng.integers(0, 256, shape, dtype=np.uint8)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _layer_stats_graph(g: GraphBuilder) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto],
                                                list[str]]:
    """g's nodes with every BN normalizing by its input's own mean and variance.

    The statistics are rounded to fp16 inside the graph, and each BN uses the rounded values:
    they are exactly what the model stores, so the model reproduces this graph bit for bit on
    the calibration input instead of drifting by compounded rounding errors. fp16 storage also
    keeps the fp16-weight variant's BN statistics exact, and makes the stored bytes the same on
    CPUs whose kernels sum in another order, unless a value lands within ~1e-7 of an fp16
    rounding midpoint. Returns nodes, extra initializers, and the (mean, var) names per BN."""
    nodes, shapes, stat_names = [], {}, []
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    for node in g.nodes:
        if node.name in g.stats:
            x, n, c = node.input[0], node.name, g.stats[node.name][2]
            shape = shapes.setdefault(c, numpy_helper.from_array(np.array([c], np.int64),
                                                                 f"calibration_shape_{c}"))
            nodes += [
                helper.make_node("ReduceMean", [x], [n + "_m"], keepdims=0),
                helper.make_node("Sub", [x, n + "_m"], [n + "_d"]),
                helper.make_node("Mul", [n + "_d", n + "_d"], [n + "_d2"]),
                helper.make_node("ReduceMean", [n + "_d2"], [n + "_v"], keepdims=0),
            ]
            for stat in ("_m", "_v"):
                nodes += [
                    helper.make_node("Cast", [n + stat], [n + stat + "16"], to=f16),
                    helper.make_node("Cast", [n + stat + "16"], [n + stat + "r"], to=f32),
                    helper.make_node("Expand", [n + stat + "r", shape.name], [n + stat + "c"]),
                ]
            node = helper.make_node("BatchNormalization",
                                    [*node.input[:3], n + "_mc", n + "_vc"], node.output,
                                    name=n, epsilon=1e-5)
            stat_names += [n + "_mr", n + "_vr"]
        nodes.append(node)
    return nodes, list(shapes.values()), stat_names


def calibrate_batch_norms(g: GraphBuilder) -> None:
    """Set every BN's running mean/var to its input's statistics on calibration_feeds.

    One scalar per layer, pooled over channels and positions, not per channel: a 1x1 feature
    map at batch 1 has no per-channel variance to measure, and a per-channel estimate from a few
    positions divides by noise. Per-channel variety comes from the random scale and bias."""
    try:
        import onnxruntime as ort  # only generating a model with BatchNorm needs it
    except ImportError as e:
        raise ImportError("calibrating BatchNorm statistics needs onnxruntime "
                          "(pip install onnxruntime, or the 'test' extra)") from e

    nodes, extra, stat_names = _layer_stats_graph(g)
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in stat_names]
    graph = helper.make_graph(nodes, "calibration", g.inputs, outputs, g.initializers + extra)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              ir_version=IR_VERSION)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3  # the replaced stat initializers are unused here, by design
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    feeds = calibration_feeds(g.inputs, g.seed)
    values = dict(zip(stat_names, session.run(stat_names, feeds)))
    for bn, (mean_index, var_index, c) in g.stats.items():
        mean, var = values[bn + "_mr"], values[bn + "_vr"]
        if not (np.isfinite(mean) and np.isfinite(var) and var > 0):
            raise ValueError(f"BatchNorm {bn}: calibrated mean {mean}, var {var}; "
                             "expected finite, var > 0")
        _replace_initializer(g, mean_index, np.full(c, mean))
        _replace_initializer(g, var_index, np.full(c, var))


def _replace_initializer(g: GraphBuilder, index: int, value: np.ndarray) -> None:
    old = g.initializers[index]
    dtype = helper.tensor_dtype_to_np_dtype(old.data_type)
    g.initializers[index] = numpy_helper.from_array(value.astype(dtype), old.name)


# ---- activations ---------------------------------------------------------------------------

def silu(g: GraphBuilder, x: str) -> str:
    # Written as x*Sigmoid(x), as exporters emit it: the compiler must fuse it, not pattern on it.
    return g.op("Mul", x, g.op("Sigmoid", x))


def gelu(g: GraphBuilder, x: str) -> str:
    """Exact GELU as torch exports it: 0.5*x*(1+Erf(x/sqrt2))."""
    erf = g.op("Erf", g.op("Div", x, g.const(np.float32(math.sqrt(2.0)), "sqrt2")))
    one_plus = g.op("Add", erf, g.const(np.float32(1.0), "one"))
    return g.op("Mul", g.op("Mul", x, g.const(np.float32(0.5), "half")), one_plus)


def relu6(g: GraphBuilder, x: str) -> str:
    """min(max(x, 0), 6) as torch exports it: Clip with constant bounds (MobileNetV2)."""
    return g.op("Clip", x, g.const(np.float32(0.0), "zero"), g.const(np.float32(6.0), "six"))


ACTIVATIONS = {"relu": lambda g, x: g.op("Relu", x), "silu": silu, "gelu": gelu, "relu6": relu6}

# E[act(z)^2] for z ~ N(0,1): the gain 1/sqrt(.) keeps the next layer's input variance at 1.
# relu6 clips only past 6 sigma, so it is relu's.
SECOND_MOMENT = {"relu": 0.5, "silu": 0.357, "gelu": 0.426, "relu6": 0.5}


# ---- convolutional blocks ------------------------------------------------------------------

def conv(g: GraphBuilder, x: str, cin: int, cout: int, k: int, stride: int = 1,
         groups: int = 1, bias: bool = False, gain: float = math.sqrt(2),
         out: str | None = None) -> str:
    """kxk conv with 'same' padding, He-init (gain sqrt2) unless told otherwise."""
    fan_in = cin // groups * k * k
    w = g.normal((cout, cin // groups, k, k), gain / math.sqrt(fan_in), "conv_w")
    inputs = [x, w] + ([g.normal((cout,), 0.1, "conv_b")] if bias else [])
    pad = k // 2
    return g.op("Conv", *inputs, kernel_shape=[k, k], strides=[stride, stride],
                pads=[pad, pad, pad, pad], group=groups, out=out)


def batch_norm(g: GraphBuilder, x: str, c: int, gamma: float = 1.0) -> str:
    """Inference BatchNorm after a conv; its mean/var are calibrated when the model is built."""
    scale = g.uniform((c,), 0.8 * gamma, 1.2 * gamma, "bn_scale")
    shift = g.normal((c,), 0.2 * gamma, "bn_bias")
    mean = g.param(np.zeros(c), "bn_mean")
    mean_index = len(g.initializers) - 1
    var = g.param(np.ones(c), "bn_var")
    var_index = len(g.initializers) - 1
    y = g.op("BatchNormalization", x, scale, shift, mean, var, epsilon=1e-5)
    g.stats[g.nodes[-1].name] = (mean_index, var_index, c)
    return y


def conv_bn_act(g: GraphBuilder, x: str, cin: int, cout: int, k: int, stride: int = 1,
                groups: int = 1, act: str | None = "silu", gamma: float = 1.0) -> str:
    """Conv -> BN -> activation; gamma scales the BN output (below 1 on residual branches)."""
    y = batch_norm(g, conv(g, x, cin, cout, k, stride, groups), cout, gamma)
    return ACTIVATIONS[act](g, y) if act else y


def squeeze_excite(g: GraphBuilder, x: str, c: int, c_reduced: int) -> str:
    """GlobalAveragePool -> 1x1 conv -> SiLU -> 1x1 conv -> Sigmoid -> channel scale."""
    pooled = g.op("GlobalAveragePool", x)
    # Pooled SiLU outputs have E[x^2] ~ 0.1 on large maps, ~0.4 on 1x1 maps: gain 1.5 keeps the
    # gates spread (std ~0.1-0.2, not a near-constant 0.5) without saturating on small maps.
    hidden = silu(g, conv(g, pooled, c, c_reduced, 1, bias=True, gain=1.5))
    gate = g.op("Sigmoid", conv(g, hidden, c_reduced, c, 1, bias=True,
                                gain=1 / math.sqrt(SECOND_MOMENT["silu"])))
    return g.op("Mul", x, gate)


def mbconv(g: GraphBuilder, x: str, cin: int, cout: int, expand: int, k: int, stride: int,
           se_ratio: float = 0.25, act: str = "silu") -> str:
    """EfficientNet's inverted residual: expand 1x1, depthwise kxk, squeeze-excite, project 1x1.
    MobileNetV2's is the same with se_ratio 0 (no squeeze-excite) and act relu6."""
    mid = cin * expand
    h = conv_bn_act(g, x, cin, mid, 1, act=act) if expand != 1 else x
    h = conv_bn_act(g, h, mid, mid, k, stride, groups=mid, act=act)
    if se_ratio:
        h = squeeze_excite(g, h, mid, max(1, int(cin * se_ratio)))
    residual = stride == 1 and cin == cout
    h = conv_bn_act(g, h, mid, cout, 1, act=None, gamma=0.5 if residual else 1.0)
    return g.op("Add", x, h) if residual else h


def bottleneck(g: GraphBuilder, x: str, cin: int, width: int, stride: int) -> str:
    """ResNet v1 bottleneck: 1x1 -> 3x3 (stride here, as torchvision) -> 1x1, + shortcut."""
    cout = width * 4
    h = conv_bn_act(g, x, cin, width, 1, act="relu")
    h = conv_bn_act(g, h, width, width, 3, stride, act="relu")
    h = conv_bn_act(g, h, width, cout, 1, act=None, gamma=0.5)
    shortcut = x
    if stride != 1 or cin != cout:
        shortcut = conv_bn_act(g, x, cin, cout, 1, stride, act=None)
    return g.op("Relu", g.op("Add", h, shortcut))


# ---- dense and transformer blocks ----------------------------------------------------------

def linear(g: GraphBuilder, x: str, din: int, dout: int, gain: float = 1.0) -> str:
    """x @ W + b on the last axis of a tensor of any rank (MatMul + Add, as torch exports)."""
    w = g.normal((din, dout), gain / math.sqrt(din), "linear_w")
    return g.op("Add", g.op("MatMul", x, w), g.normal((dout,), 0.05, "linear_b"))


def gemm(g: GraphBuilder, x: str, din: int, dout: int, gain: float = 1.0,
         out: str | None = None) -> str:
    """A 2-D fully connected layer as one Gemm with a transposed weight, as torch exports it."""
    w = g.normal((dout, din), gain / math.sqrt(din), "gemm_w")
    return g.op("Gemm", x, w, g.normal((dout,), 0.05, "gemm_b"), transB=1, out=out)


def layer_norm(g: GraphBuilder, x: str, d: int) -> str:
    scale = g.uniform((d,), 0.8, 1.2, "ln_scale")
    return g.op("LayerNormalization", x, scale, g.normal((d,), 0.05, "ln_bias"), axis=-1,
                epsilon=1e-5)


def self_attention(g: GraphBuilder, x: str, seq: int, d: int, heads: int,
                   mask: str | None = None) -> str:
    """Multi-head self attention on (1, seq, d); mask is added to the (1, h, seq, seq) scores."""
    hd = d // heads
    split = g.const(np.array([1, seq, heads, hd], np.int64), "heads_shape")

    def project(perm: list[int]) -> str:
        return g.op("Transpose", g.op("Reshape", linear(g, x, d, d), split), perm=perm)

    q = project([0, 2, 1, 3])  # (1, h, seq, hd)
    k = project([0, 2, 3, 1])  # (1, h, hd, seq): K^T directly, as exporters fold the transpose
    v = project([0, 2, 1, 3])
    scores = g.op("Mul", g.op("MatMul", q, k), g.const(np.float32(1 / math.sqrt(hd)), "scale"))
    if mask is not None:
        scores = g.op("Add", scores, mask)
    ctx = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
    merged = g.op("Reshape", g.op("Transpose", ctx, perm=[0, 2, 1, 3]),
                  g.const(np.array([1, seq, d], np.int64), "merge_shape"))
    return linear(g, merged, d, d, gain=0.5)


def transformer_block(g: GraphBuilder, x: str, seq: int, d: int, heads: int,
                      mask: str | None = None, mlp_ratio: int = 4) -> str:
    """Pre-norm block: x + attn(LN(x)), then + MLP(LN(.)) with a GELU hidden layer."""
    x = g.op("Add", x, self_attention(g, layer_norm(g, x, d), seq, d, heads, mask))
    hidden = gelu(g, linear(g, layer_norm(g, x, d), d, d * mlp_ratio))
    mlp = linear(g, hidden, d * mlp_ratio, d, gain=0.5 / math.sqrt(SECOND_MOMENT["gelu"]))
    return g.op("Add", x, mlp)


def image_net_cli(make, description: str) -> None:
    """`python -m models.NAME -o OUT.onnx [--size N] [--batch N] [--seed N]`: one CLI for the
    image classifiers, which all take (seed, batch, size)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    onnx.save(make(seed=args.seed, batch=args.batch, size=args.size), args.output)
