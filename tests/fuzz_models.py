"""Seeded random graphs made of what real models are made of: convs of every kind (Winograd-
eligible, depthwise, strided, grouped, dilated, padded, 1x1), pooling, residual and squeeze-excite
blocks, Resize, Concat, Slice, Softmax, LayerNorm, Gather, and MatMul/Gemm with odd sizes.

A case is a spec, a JSON-able dict: `draw(seed)` makes one, `build(spec)` turns it into
(model, feeds). build() depends on the spec alone (its weights and feeds come from spec["seed"]),
so a spec stored in tests/corpus/ replays the same graph after draw() changes.

- spec["float16"]: weights are stored as float16 and Cast to float32 in the graph (the way
  openpilot ships them), and keel compiles with float16=True.
- spec["special"]: a share of every float feed is NaN, +-Inf, a denormal or a large value, so
  results are compared under onnxruntime's semantics for them.

Weights are scaled by 1/sqrt(fan-in), so activations stay O(1) through any chain of blocks and a
tolerance failure means a bug, not an unlucky blow-up.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.graphs import make_model

CONV_KINDS = ("winograd", "depthwise", "strided", "grouped", "dilated", "padded", "pointwise")
# NaN and Inf must come out where onnxruntime has them; a denormal may flush to zero (inside
# atol); LARGE stays finite through squares (LayerNorm's variance) and sums of many terms
LARGE = 1e4
SPECIAL = np.array([np.nan, np.inf, -np.inf, 1e-40, LARGE, -LARGE], np.float32)
SPECIAL_SHARE = 0.05
MAX_ELEMENTS = 40_000  # per tensor: big enough for Winograd (>= 32 tiles of >= 32 channels)


class Net:
    """The graph being built: nodes, weights and inputs, with shapes from onnx's inference."""

    def __init__(self, spec: dict):
        self.rng = np.random.default_rng(spec["seed"])
        self.float16 = spec["float16"]
        self.nodes, self.inits, self.inputs = [], [], []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.count = 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def input(self, shape, dtype=np.float32) -> str:
        name = self.fresh("in")
        self.inputs.append((name, tuple(shape), dtype))
        self.shapes[name] = tuple(shape)
        return name

    def const(self, value) -> str:
        name = self.fresh("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, shape, fan_in: int) -> str:
        w = (self.rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)
        if not self.float16:
            return self.const(w)
        return self.node("Cast", [self.const(w.astype(np.float16))], to=TensorProto.FLOAT)

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.fresh(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.shapes:
            inferred = onnx.shape_inference.infer_shapes(self.model([name]), strict_mode=True)
            for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
                dims = vi.type.tensor_type.shape.dim
                self.shapes[vi.name] = tuple(d.dim_value for d in dims)
        return self.shapes[name]

    def model(self, outputs: list[str]) -> onnx.ModelProto:
        outs = [(o, self.shapes.get(o), np.float32) for o in outputs]
        return make_model(self.nodes, self.inputs, outs, self.inits, name="fuzz")


# ---- blocks: draw(rng, shape) -> params or None (does not fit); emit(net, x, params) -> y ------

def _pick(rng, options):
    return options[int(rng.integers(len(options)))]


def _out(size: int, k: int, stride: int, dil: int, pad: int) -> int:
    return (size + pad - dil * (k - 1) - 1) // stride + 1


def draw_conv(rng, shape, kind=None) -> dict | None:
    n, c, h, w = shape
    kind = kind or _pick(rng, CONV_KINDS)
    p = dict(kind=kind, k=3, stride=1, dil=1, group=1, cout=_pick(rng, [8, 13, 16, 32, 48]),
             pads=[1, 1, 1, 1], bias=bool(rng.integers(2)),
             act=_pick(rng, ["none", "relu", "clip", "silu"]))
    if kind == "winograd":
        p.update(cout=_pick(rng, [32, 40, 64]), pads=[int(v) for v in rng.integers(0, 2, 4)])
        tiles = n * -(-(h + p["pads"][0] + p["pads"][2] - 2) // 2) \
            * -(-(w + p["pads"][1] + p["pads"][3] - 2) // 2)
        if c < 32 or tiles < 32:
            return None
    elif kind == "depthwise":
        p.update(group=c, cout=c, k=_pick(rng, [3, 5]), stride=_pick(rng, [1, 2]))
        p["pads"] = [p["k"] // 2] * 4
    elif kind == "strided":
        p.update(stride=2, k=_pick(rng, [2, 3]))
    elif kind == "grouped":
        groups = [g for g in (2, 4, 8) if c % g == 0]
        if not groups:
            return None
        p["group"] = _pick(rng, groups)
        p["cout"] = p["group"] * int(rng.integers(1, 5))
    elif kind == "dilated":
        p.update(dil=2, pads=[2, 2, 2, 2])
    elif kind == "padded":
        p["k"] = _pick(rng, [3, 5])
        p["pads"] = [int(v) for v in rng.integers(0, p["k"], 4)]
    else:
        p.update(k=1, pads=[0, 0, 0, 0])
    oh = _out(h, p["k"], p["stride"], p["dil"], p["pads"][0] + p["pads"][2])
    ow = _out(w, p["k"], p["stride"], p["dil"], p["pads"][1] + p["pads"][3])
    return p if oh >= 1 and ow >= 1 and n * p["cout"] * oh * ow <= MAX_ELEMENTS else None


def emit_conv(net: Net, x: str, p: dict) -> str:
    cin = net.shape(x)[1]
    fan_in = cin // p["group"] * p["k"] ** 2
    inputs = [x, net.weight((p["cout"], cin // p["group"], p["k"], p["k"]), fan_in)]
    if p["bias"]:
        inputs.append(net.weight((p["cout"],), 1))
    y = net.node("Conv", inputs, kernel_shape=[p["k"]] * 2, strides=[p["stride"]] * 2,
                 dilations=[p["dil"]] * 2, group=p["group"], pads=p["pads"])
    return activation(net, y, p["act"])


def activation(net: Net, x: str, act: str) -> str:
    if act == "relu":
        return net.node("Relu", [x])
    if act == "clip":
        return net.node("Clip", [x, net.const(np.float32(0)), net.const(np.float32(6))])
    if act == "silu":
        return net.node("Mul", [x, net.node("Sigmoid", [x])])
    return x


def draw_pool(rng, shape) -> dict | None:
    k = _pick(rng, [2, 3])
    p = dict(op=_pick(rng, ["MaxPool", "AveragePool"]), k=k, stride=_pick(rng, [1, 2]),
             pads=[int(v) for v in rng.integers(0, k, 4)], ceil=int(rng.integers(2)),
             include_pad=int(rng.integers(2)))
    fits = all(_out(d, k, 1, 1, p["pads"][i] + p["pads"][i + 2]) >= 1
               for i, d in enumerate(shape[2:]))
    return p if fits else None


def emit_pool(net: Net, x: str, p: dict) -> str:
    attrs = dict(kernel_shape=[p["k"]] * 2, strides=[p["stride"]] * 2, pads=p["pads"],
                 ceil_mode=p["ceil"])
    if p["op"] == "AveragePool":
        attrs["count_include_pad"] = p["include_pad"]
    return net.node(p["op"], [x], **attrs)


def draw_se(rng, shape) -> dict | None:
    return dict(ratio=_pick(rng, [2, 4]), gate=_pick(rng, ["Sigmoid", "HardSigmoid"]))


def emit_se(net: Net, x: str, p: dict) -> str:
    """Squeeze-excite: a per-channel gate from the image's mean, times the image."""
    c = net.shape(x)[1]
    r = max(c // p["ratio"], 1)
    s = net.node("GlobalAveragePool", [x])
    s = net.node("Relu", [net.node("Conv", [s, net.weight((r, c, 1, 1), c)])])
    s = net.node(p["gate"], [net.node("Conv", [s, net.weight((c, r, 1, 1), r)])])
    return net.node("Mul", [x, s])


def draw_residual(rng, shape) -> dict | None:
    return dict(k=_pick(rng, [1, 3]), act=_pick(rng, ["relu", "none"]))


def emit_residual(net: Net, x: str, p: dict) -> str:
    c, k = net.shape(x)[1], p["k"]
    pads = [k // 2] * 4
    h = net.node("Relu", [net.node("Conv", [x, net.weight((c, c, k, k), c * k * k)], pads=pads)])
    h = net.node("Conv", [h, net.weight((c, c, k, k), c * k * k)], pads=pads)
    return activation(net, net.node("Add", [h, x]), p["act"])


def draw_resize(rng, shape) -> dict | None:
    p = dict(scale=_pick(rng, [2.0, 0.5]), mode=_pick(rng, ["nearest", "linear"]),
             coord=_pick(rng, ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"]))
    if p["mode"] == "nearest" and p["coord"] == "align_corners":
        p["coord"] = "asymmetric"
    size = math.prod(shape) * p["scale"] ** 2
    return p if size <= MAX_ELEMENTS and min(shape[2:]) * p["scale"] >= 1 else None


def emit_resize(net: Net, x: str, p: dict) -> str:
    scales = net.const(np.array([1, 1, p["scale"], p["scale"]], np.float32))
    return net.node("Resize", [x, "", scales], mode=p["mode"],
                    coordinate_transformation_mode=p["coord"])


def draw_concat(rng, shape) -> dict | None:
    return dict(cout=_pick(rng, [3, 8, 16]), first=bool(rng.integers(2)))


def emit_concat(net: Net, x: str, p: dict) -> str:
    """x beside a projection of itself, along the channel (image) or last (matrix) axis."""
    shape = net.shape(x)
    if len(shape) == 4:
        other = net.node("Conv", [x, net.weight((p["cout"], shape[1], 1, 1), shape[1])])
        axis = 1
    else:
        other = net.node("MatMul", [x, net.weight((shape[-1], p["cout"]), shape[-1])])
        axis = -1
    parts = [other, x] if p["first"] else [x, other]
    return net.node("Concat", parts, axis=axis)


def draw_slice(rng, shape) -> dict | None:
    axis = int(rng.integers(len(shape) - 1, len(shape))) if len(shape) < 4 else \
        int(rng.integers(2, 4))
    d = shape[axis]
    step = _pick(rng, [1, 2, -1])
    start, end = sorted(int(v) for v in rng.integers(0, d + 1, 2))
    if step < 0:
        start, end = end - 1, start - 1 if start > 0 else -d - 1  # -d-1: through index 0
    n = len(range(d)[start:end:step])  # Python clamps as ONNX does
    return dict(axis=axis, start=start, end=end, step=step) if n >= 1 else None


def emit_slice(net: Net, x: str, p: dict) -> str:
    consts = [net.const(np.array([p[k]], np.int64)) for k in ("start", "end", "axis", "step")]
    return net.node("Slice", [x, *consts])


def draw_softmax(rng, shape) -> dict | None:
    return dict(axis=_pick(rng, [1, -1]))


def emit_softmax(net: Net, x: str, p: dict) -> str:
    return net.node("Softmax", [x], axis=p["axis"])


def draw_layernorm(rng, shape) -> dict | None:
    return dict(axis=_pick(rng, [-1, 1]), eps=_pick(rng, [1e-5, 1e-3]))


def emit_layernorm(net: Net, x: str, p: dict) -> str:
    shape = net.shape(x)
    norm = shape[p["axis"] % len(shape):]
    scale = net.node("Add", [net.weight(norm, 16), net.const(np.float32(1))])
    return net.node("LayerNormalization", [x, scale, net.weight(norm, 4)], axis=p["axis"],
                    epsilon=p["eps"])


def draw_matmul(rng, shape) -> dict | None:
    n = _pick(rng, [1, 3, 7, 17, 31, 65, 100])
    return dict(n=n) if math.prod(shape[:-1]) * n <= MAX_ELEMENTS else None


def emit_matmul(net: Net, x: str, p: dict) -> str:
    k = net.shape(x)[-1]
    return net.node("MatMul", [x, net.weight((k, p["n"]), k)])


def draw_gemm(rng, shape) -> dict | None:
    if len(shape) != 2:
        return None
    p = dict(n=_pick(rng, [1, 5, 17, 33, 63]), trans_a=int(rng.integers(2)),
             trans_b=int(rng.integers(2)), alpha=_pick(rng, [1.0, 0.5]),
             beta=_pick(rng, [1.0, 2.0]), bias=_pick(rng, ["none", "row", "full", "scalar"]))
    return p if shape[p["trans_a"]] * p["n"] <= MAX_ELEMENTS else None


def emit_gemm(net: Net, x: str, p: dict) -> str:
    m, k = net.shape(x)[::-1] if p["trans_a"] else net.shape(x)
    b = (p["n"], k) if p["trans_b"] else (k, p["n"])
    bias = {"none": None, "row": (p["n"],), "full": (m, p["n"]), "scalar": ()}[p["bias"]]
    inputs = [x, net.weight(b, k)] + ([] if bias is None else [net.weight(bias, 1)])
    return net.node("Gemm", inputs, transA=p["trans_a"], transB=p["trans_b"],
                    alpha=p["alpha"], beta=p["beta"])


def draw_attention(rng, shape) -> dict | None:
    return dict(scale=_pick(rng, [1.0, 0.25])) if shape[-2] <= 128 else None


def emit_attention(net: Net, x: str, p: dict) -> str:
    """softmax(x x^T * scale) x: a MatMul of two activations, a transposed operand."""
    rank = len(net.shape(x))
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    scores = net.node("MatMul", [x, net.node("Transpose", [x], perm=perm)])
    scores = net.node("Mul", [scores, net.const(np.float32(p["scale"]))])
    return net.node("MatMul", [net.node("Softmax", [scores], axis=-1), x])


def draw_gather(rng, shape) -> dict | None:
    axis = int(rng.integers(len(shape)))
    d = shape[axis]
    count = _pick(rng, [1, 3, max(d // 2, 1)])
    indices = [int(v) for v in rng.integers(-d, d, count)]  # negative: counted from the end
    scalar = count == 1 and len(shape) > 2 and bool(rng.integers(2))  # drops the axis
    return dict(axis=axis, indices=indices, scalar=scalar)


def emit_gather(net: Net, x: str, p: dict) -> str:
    idx = np.array(p["indices"][0] if p["scalar"] else p["indices"], np.int64)
    return net.node("Gather", [x, net.const(idx)], axis=p["axis"])


BLOCKS = {
    "conv": (draw_conv, emit_conv), "pool": (draw_pool, emit_pool), "se": (draw_se, emit_se),
    "residual": (draw_residual, emit_residual), "resize": (draw_resize, emit_resize),
    "concat": (draw_concat, emit_concat), "slice": (draw_slice, emit_slice),
    "softmax": (draw_softmax, emit_softmax), "layernorm": (draw_layernorm, emit_layernorm),
    "matmul": (draw_matmul, emit_matmul), "gemm": (draw_gemm, emit_gemm),
    "attention": (draw_attention, emit_attention), "gather": (draw_gather, emit_gather),
}
IMAGE_BLOCKS = ("conv", "conv", "conv", "pool", "se", "residual", "resize", "concat", "slice",
                "softmax", "layernorm", "gather")
MATRIX_BLOCKS = ("matmul", "matmul", "gemm", "attention", "layernorm", "softmax", "slice",
                 "concat", "gather")


# ---- cases ----------------------------------------------------------------------------------

def draw(seed: int) -> dict:
    """A spec. The seed picks the first conv's kind round-robin, so any run of len(CONV_KINDS)
    consecutive seeds covers every kind (Winograd with an input shape that is eligible)."""
    rng = np.random.default_rng([seed, 25])
    spec = dict(seed=seed, float16=bool(rng.integers(4) == 0), special=bool(rng.integers(4) == 0))
    if seed % 3 == 2:
        return _draw_matrix(rng, spec)
    kind = CONV_KINDS[seed % len(CONV_KINDS)]
    c = _pick(rng, [32, 48, 64]) if kind == "winograd" else _pick(rng, [3, 8, 16, 24, 32])
    hw = [int(v) for v in rng.integers(14, 21, 2)] if kind == "winograd" else \
        [int(v) for v in rng.integers(4, 19, 2)]
    spec.update(input=[int(rng.integers(1, 3)), c, *hw], tokens=None)
    first = draw_conv(rng, spec["input"], kind) or draw_conv(rng, spec["input"], "pointwise")
    spec["blocks"] = [["conv", first]]
    return _draw_rest(rng, spec, IMAGE_BLOCKS)


def _draw_matrix(rng, spec: dict) -> dict:
    dims = [int(rng.integers(1, 40)), _pick(rng, [1, 5, 16, 33, 64])]
    if rng.integers(2):
        dims.insert(0, int(rng.integers(1, 4)))
    tokens = int(rng.integers(2, 50)) if rng.integers(2) else None
    spec.update(input=dims, tokens=tokens, blocks=[])
    return _draw_rest(rng, spec, MATRIX_BLOCKS)


def _draw_rest(rng, spec: dict, kinds) -> dict:
    net = Net(spec)
    x = _emit_input(net, spec)
    for kind, p in spec["blocks"]:
        x = BLOCKS[kind][1](net, x, p)
    for _ in range(int(rng.integers(1, 5))):
        if len(net.shape(x)) != 4:  # a Gather dropped an image axis: matrix blocks from here
            kinds = MATRIX_BLOCKS
        kind = _pick(rng, kinds)
        p = BLOCKS[kind][0](rng, net.shape(x))
        if p is not None:
            spec["blocks"].append([kind, p])
            x = BLOCKS[kind][1](net, x, p)
    return spec


def _emit_input(net: Net, spec: dict) -> str:
    """The image or matrix input; with tokens, a matrix of embedding rows picked by int64 ids
    (negative ids count from the end, as ONNX Gather allows)."""
    if not spec["tokens"]:
        return net.input(spec["input"])
    *lead, dim = spec["input"]
    table = net.weight((spec["tokens"], dim), 1)
    return net.node("Gather", [table, net.input(lead, np.int64)], axis=0)


def build(spec: dict) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    net = Net(spec)
    x = _emit_input(net, spec)
    for kind, p in spec["blocks"]:
        x = BLOCKS[kind][1](net, x, p)
    net.shape(x)
    return net.model([x]), feeds(net, spec)


def feeds(net: Net, spec: dict) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([spec["seed"], 1])
    out = {}
    for name, shape, dtype in net.inputs:
        if dtype == np.int64:
            t = spec["tokens"]
            out[name] = rng.integers(-t, t, shape).astype(np.int64)
            continue
        x = rng.standard_normal(shape).astype(np.float32)
        if spec["special"]:
            hit = rng.random(shape) < SPECIAL_SHARE
            x[hit] = rng.choice(SPECIAL, int(hit.sum()))
        out[name] = x
    return out
