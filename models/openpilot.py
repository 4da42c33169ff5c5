"""A stand-in for openpilot's driving model: same interface, same kinds of layers, random weights.

Interface (exactly openpilot's combined model): inputs `img`, `big_img` uint8 (1,12,128,256) (two
YUV420 frames of the road and wide cameras), `desire_pulse` (1,25,8), `traffic_convention` (1,2),
`action_t` (1,2), `features_buffer` (1,24,512), all float32; one output `outputs` float32
(1, 6504), cut into plan/lead/pose/... by `output_slices` in metadata_props, in openpilot's own
format (a base64 pickle of {name: slice}; see metadata_props()).

Structure: per camera an EfficientNet-B0 trunk (3x3 depthwise everywhere) on x/128 - 1, pooled to
1280 features; both projected to one 512-d token appended to the 24 past features -> a (1,25,512)
sequence; desire/traffic/action flattened, projected and added to every token with a learned
position embedding; two pre-norm transformer blocks (causal mask, 8 heads, GELU via Erf MLP);
final LayerNorm, the newest token through one small MLP per output head, heads concatenated.
About 1.4 GFLOP (see models/flops.py).

fp16 (`float16=True`): openpilot ships fp16 weights. onnxruntime 1.31's CPU provider has fp16
kernels only for a few movement ops and LayerNormalization; for Conv, MatMul, Gemm, Add, Mul,
Sigmoid, Erf, BatchNormalization, GlobalAveragePool and Softmax it silently inserts Casts and runs
fp32 (its InsertCastTransformer, which runs even with optimizations disabled), rounding to fp16
after every op. A fully fp16 graph (convert_float_to_float16 style) would therefore have no honest
fp16 reference. So every learned parameter is stored as an fp16 initializer followed by a Cast to
float32, and compute stays fp32: the same weights openpilot ships, with a reference ORT computes
exactly. Constants that are not learned (shapes, 1/128, the mask) stay exact.

    python -m models.openpilot -o openpilot.onnx [--float16] [--seed 0]
"""
from __future__ import annotations

import argparse
import codecs
import math
import pickle

import numpy as np
import onnx

from models import efficientnet
from models.blocks import GraphBuilder, gemm, layer_norm, transformer_block

INPUTS = {
    "img": (np.uint8, (1, 12, 128, 256)),
    "big_img": (np.uint8, (1, 12, 128, 256)),
    "desire_pulse": (np.float32, (1, 25, 8)),
    "traffic_convention": (np.float32, (1, 2)),
    "action_t": (np.float32, (1, 2)),
    "features_buffer": (np.float32, (1, 24, 512)),
}

# Output heads in output order, sized like openpilot's: plan = 5 hypotheses x (33 points x 15
# values x mean/std + 1 weight), lead = 2 x (6 steps x 4 x mean/std + 3), hidden_state = the
# 512-d feature openpilot feeds back through features_buffer.
HEADS = (("plan", 4955), ("lane_lines", 528), ("lane_lines_prob", 8), ("road_edges", 264),
         ("lead", 102), ("lead_prob", 3), ("desire_state", 8), ("meta", 50),
         ("desire_pred", 32), ("pose", 12), ("wide_from_device_euler", 6), ("sim_pose", 12),
         ("road_transform", 12), ("hidden_state", 512))
N_OUTPUTS = sum(n for _, n in HEADS)  # 6504

D_MODEL, HEADS_N, BLOCKS, HEAD_HIDDEN = 512, 8, 2, 256
SEQ = INPUTS["features_buffer"][1][1] + 1  # the past features plus the current frame's token


def output_slices() -> dict[str, slice]:
    """Each head's slice of the flattened output, in output order: openpilot's form."""
    slices, start = {}, 0
    for name, n in HEADS:
        slices[name] = slice(start, start + n, None)
        start += n
    return slices


def metadata_props() -> dict[str, str]:
    """What openpilot's exporter writes into metadata_props: `output_slices` as base64 text of
    the pickled {name: slice} dict (its modeld's get_model_metadata.py decodes it with
    pickle.loads(codecs.decode(value.encode(), "base64"))), and a `model_checkpoint` string."""
    pickled = codecs.encode(pickle.dumps(output_slices()), "base64").decode()
    return {"output_slices": pickled, "model_checkpoint": "keel-openpilot-stand-in"}


def camera_features(g: GraphBuilder, img: str) -> str:
    """uint8 frames -> x/128 - 1 in [-1, 1) -> EfficientNet trunk -> (1, 1280)."""
    x = g.op("Cast", img, to=onnx.TensorProto.FLOAT)
    x = g.op("Sub", g.op("Div", x, g.const(np.float32(128.0), "pixel_scale")),
             g.const(np.float32(1.0), "one"))
    features, _ = efficientnet.trunk(g, x, INPUTS["img"][1][1], kernel=3)
    return features


def unsqueeze_token(g: GraphBuilder, x: str) -> str:
    return g.op("Unsqueeze", x, g.const(np.array([1], np.int64), "token_axis"))


def causal_mask(g: GraphBuilder) -> str:
    # -1e4 rather than -inf: what fp16 exporters emit, and exp() of it is exactly 0 in fp32.
    mask = np.triu(np.full((SEQ, SEQ), -1e4, np.float32), k=1)
    return g.const(mask.reshape(1, 1, SEQ, SEQ), "causal_mask")


def sequence(g: GraphBuilder, vision: list[str]) -> str:
    """(1, 25, 512): past features, then the current frame; plus conditioning and positions."""
    vis = gemm(g, g.op("Concat", *vision, axis=1), 2 * efficientnet.HEAD_CHANNELS, D_MODEL,
               gain=1 / math.sqrt(efficientnet.FEATURE_MOMENT))
    tokens = g.op("Concat", "features_buffer", unsqueeze_token(g, vis), axis=1)
    desire = g.op("Flatten", "desire_pulse", axis=1)
    cond = g.op("Concat", desire, "traffic_convention", "action_t", axis=1)
    n_cond = sum(math.prod(INPUTS[n][1][1:]) for n in ("desire_pulse", "traffic_convention",
                                                     "action_t"))
    cond = unsqueeze_token(g, gemm(g, cond, n_cond, D_MODEL, gain=0.5))
    positions = g.normal((1, SEQ, D_MODEL), 0.3, "pos_embedding")
    return g.op("Add", g.op("Add", tokens, cond), positions)


def heads(g: GraphBuilder, h: str) -> str:
    """One Gemm-ReLU-Gemm head per output slice, concatenated into `outputs`."""
    outs = []
    for _, n in HEADS:
        hidden = g.op("Relu", gemm(g, h, D_MODEL, HEAD_HIDDEN, gain=math.sqrt(2)))
        outs.append(gemm(g, hidden, HEAD_HIDDEN, n))
    return g.op("Concat", *outs, axis=1, out="outputs")


def make_openpilot(float16: bool = False, seed: int = 0) -> onnx.ModelProto:
    g = GraphBuilder(seed, fp16_weights=float16)
    for name, (dtype, shape) in INPUTS.items():
        g.input(name, dtype, shape)
    h = sequence(g, [camera_features(g, "img"), camera_features(g, "big_img")])
    mask = causal_mask(g)
    for _ in range(BLOCKS):
        h = transformer_block(g, h, SEQ, D_MODEL, HEADS_N, mask)
    newest = g.op("Gather", layer_norm(g, h, D_MODEL), g.const(np.int64(SEQ - 1), "newest"),
                  axis=1)
    out = heads(g, newest)
    precision = "fp16 weights" if float16 else "fp32 weights"
    return g.model([(out, np.float32, (1, N_OUTPUTS))], "openpilot_like",
                   doc=f"openpilot-shaped driving model, random {precision}, seed {seed}",
                   metadata=metadata_props())


# The toy: openpilot's io names, kinds and metadata format at a thousandth of the size, for fast
# tests of the modeld path (tools/modeld.py, tools/soak.py). Two heads: plan, and a hidden_state
# as wide as a features_buffer row, fed back by the replay loop.
TOY_INPUTS = {"img": (np.uint8, (1, 12, 8, 16)), "big_img": (np.uint8, (1, 12, 8, 16)),
              "desire_pulse": (np.float32, (1, 5, 8)), "features_buffer": (np.float32, (1, 4, 16))}
TOY_HEADS = (("plan", 40), ("hidden_state", 16))


def make_toy(seed: int = 0) -> onnx.ModelProto:
    g = GraphBuilder(seed)
    for name, (dtype, shape) in TOY_INPUTS.items():
        g.input(name, dtype, shape)
    pooled = [g.op("ReduceMean", g.op("Cast", cam, to=onnx.TensorProto.FLOAT), axes=[2, 3],
                   keepdims=0)
              for cam in ("img", "big_img")]
    flat = [g.op("Flatten", n, axis=1) for n in ("desire_pulse", "features_buffer")]
    x = g.op("Concat", *pooled, *flat, axis=1)
    n_in = 2 * 12 + 5 * 8 + 4 * 16
    n_out = sum(n for _, n in TOY_HEADS)
    h = g.op("Tanh", gemm(g, g.op("Div", x, g.const(np.float32(128.0), "scale")), n_in, n_out))
    slices, start = {}, 0
    for name, n in TOY_HEADS:
        slices[name], start = slice(start, start + n), start + n
    pickled = codecs.encode(pickle.dumps(slices), "base64").decode()
    return g.model([(g.op("Identity", h, out="outputs"), np.float32, (1, n_out))], "openpilot_toy",
                   doc=f"openpilot-shaped toy, seed {seed}", metadata={"output_slices": pickled})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--float16", action="store_true", help="fp16 weights (each Cast to fp32)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    onnx.save(make_openpilot(args.float16, args.seed), args.output)


if __name__ == "__main__":
    main()
