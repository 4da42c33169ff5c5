"""openpilot's modeld step as ONNX graphs keel compiles into one blob (tools/compile_modeld.py).

Per camera resolution WxH two entry points, as openpilot's compile_modeld.py builds them
(openpilot keys them `[(W, H)]["warp_enqueue"]`; keel names them `WxH/warp_enqueue` and
`WxH/run_policy`: entry_name):
- `WxH/warp_enqueue` (a frame whose model run is skipped): frame, big_frame (the flat NV12
  uint8 buffers), tfm, big_tfm (3x3 inverse homographies) -> the frame queues shifted.
- `WxH/run_policy`: the same, plus desire (8,) and traffic_convention (2,) -> vision_out
  (1, N) and policy_out (1, M) float32, with the vision and policy models inlined.

The queues are state pairs (metadata_props `keel.state` = {input: output}): each entry's graph
reads the queue as an input and writes its successor as an output, and the runtime keeps the
successor for the next run. Each shift is written Concat(Slice(q, rows 1..), new) on axis 0, the
pattern a runtime can turn into a ring buffer. Queue shapes, sampling and the warp are
models/modeld_ref.py's (its docstring has the algorithm); the warp here is one Gather of all six
planes from the flat buffer, each plane with its own origin, first row and column, column step,
matrix and clip limits, rather than the reference's warp, deinterleave and cut.

The coordinates come from small integer constants (exact in fp16 too) and the fp32 transform
input; inside the one warp kernel a --float16 compile (half activations on GPUs) keeps that
arithmetic in fp32, since the transform is never half (compiler/codegen/half.py demotes only
what reads half). A coordinate realized in the arena would be stored as half: one consumer of
the warp keeps it inside its kernel.

split_entries builds the same step as two blobs for two devices, the warp apart.

The driver-monitoring blob has one entry per camera, `WxH/dmonitoring`: frame, tfm, calib ->
the DM model's `outputs`, the Y plane warped to the model's input size on the way.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler.target import get_target
from models.modeld_ref import UV_SCALE, Y_PHASES, Nv12, nv12_layout, queue_shapes

STATE_KEY = "keel.state"
MIN_OPSET = 13  # Slice, Reshape, Gather, Round, Max/Min as used here


@dataclass(frozen=True)
class Plane:
    """One warped plane: output pixel (i, j) samples the source at model coordinates
    (x0 + step*j, y0 + step*i) mapped by `matrix`, reading the NV12 buffer's byte at row
    row0 + row, column col0 + col*col_step (a row is the stride), with row, col clipped to the
    source's height and width."""
    matrix: int  # which of the warp's matrices (0: M_inv, 1: M_inv scaled for chroma)
    x0: int
    y0: int
    step: int
    row0: int
    col0: int
    col_step: int
    src_w: int
    src_h: int


def nv12_planes(nv12: Nv12) -> list[Plane]:
    """openpilot's six planes: the four Y phases at full resolution, then U and V."""
    w, h = nv12.width, nv12.height
    ys = [Plane(0, dx, dy, 2, 0, 0, 1, w, h) for dy, dx in Y_PHASES]
    return ys + [Plane(1, 0, 0, 1, nv12.y_height, c, 2, w // 2, h // 2) for c in (0, 1)]


class Graph:
    """Nodes, initializers and io of one entry graph; every method returns a value name.
    `prefix` names this entry's own values: entries of one blob share an initializer by its name
    (the inlined models' weights), so each entry's constants need names no other entry has."""

    def __init__(self, prefix: str = ""):
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self.prefix, self.n = prefix, 0

    def name(self, what: str) -> str:
        self.n += 1
        return f"{self.prefix}{what}_{self.n}"

    def input(self, name: str, dtype, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(shape)))
        return name

    def output(self, name: str, dtype, shape) -> None:
        self.outputs.append(helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(shape)))

    def const(self, value, what: str = "const") -> str:
        name = self.name(what)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        out = out or self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def reshape(self, x: str, shape, out: str | None = None) -> str:
        return self.op("Reshape", x, self.const(np.array(shape, np.int64), "shape"), out=out)

    def slice(self, x: str, start: int, end: int, step: int = 1, axis: int = 0) -> str:
        i64 = lambda v: self.const(np.array([v], np.int64), "slice")  # noqa: E731
        return self.op("Slice", x, i64(start), i64(end), i64(axis), i64(step))

    def model(self, name: str, opset: int, props: dict[str, str]) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs, self.inits)
        opsets = [helper.make_opsetid("", opset)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="keel.modeld",
                                  ir_version=helper.find_min_ir_version_for(opsets))
        helper.set_model_props(model, props)
        return model


def warp(g: Graph, frame: str, tfm: str, nv12: Nv12, planes: list[Plane], out_w: int,
         out_h: int) -> str:
    """(len(planes), out_h, out_w) uint8 gathered from the flat NV12 `frame` (one Gather)."""
    n = len(planes)
    col = lambda f, dt: g.const(np.array([f(p) for p in planes], dt).reshape(n, 1, 1))  # noqa
    m_uv = g.op("Mul", tfm, g.const(UV_SCALE, "uv_scale"))
    stacked = g.op("Concat", *(g.reshape(m, [1, 3, 3]) for m in (tfm, m_uv)), axis=0)
    m = g.op("Gather", stacked, col(lambda p: p.matrix, np.int64), axis=0)  # (n, 1, 1, 3, 3)
    m = g.reshape(m, [n, 3, 3])
    coef = [[g.slice(g.slice(m, r, r + 1, axis=1), c, c + 1, axis=2) for c in range(3)]
            for r in range(3)]  # each (n, 1, 1)
    xs = np.array([[p.x0 + p.step * j for j in range(out_w)] for p in planes], np.int32)
    ys = np.array([[p.y0 + p.step * i for i in range(out_h)] for p in planes], np.int32)
    x = g.op("Cast", g.const(xs.reshape(n, 1, out_w), "warp_x"), to=TensorProto.FLOAT)
    y = g.op("Cast", g.const(ys.reshape(n, out_h, 1), "warp_y"), to=TensorProto.FLOAT)
    src = [g.op("Add", g.op("Add", g.op("Mul", row[0], x), g.op("Mul", row[1], y)), row[2])
           for row in coef]
    zero = g.const(np.float32(0), "zero")

    def index(s: str, limit) -> str:
        clipped = g.op("Min", g.op("Max", g.op("Round", g.op("Div", s, src[2])), zero),
                       col(limit, np.float32))
        return g.op("Cast", clipped, to=TensorProto.INT32)

    def clip(v: str, top: int) -> str:
        return g.op("Min", g.op("Max", v, g.const(np.int32(0), "zero")),
                    g.const(np.int32(top), "top"))

    xi, yi = index(src[0], lambda p: p.src_w - 1), index(src[1], lambda p: p.src_h - 1)
    # The buffer's (row, column), clipped once more to its rows and its stride: a no-op on the
    # values, and the bounds from which the compiler proves flat // stride = row and
    # flat % stride = column (compiler/ir/symbolic.py fold_divmod), so a frame read as an image
    # takes (column, row) without dividing (docs/modeld.md "The image coordinates without
    # division")
    rows = nv12.y_height + nv12.uv_height
    column = clip(g.op("Add", g.op("Mul", xi, col(lambda p: p.col_step, np.int32)),
                       col(lambda p: p.col0, np.int32)), nv12.stride - 1)
    row = clip(g.op("Add", yi, col(lambda p: p.row0, np.int32)), rows - 1)
    flat = g.op("Add", g.op("Mul", row, g.const(np.int32(nv12.stride), "stride")), column)
    return g.op("Gather", frame, flat, axis=0)


def shift(g: Graph, queue: str, shape: tuple, new: str) -> str:
    """queue[1:] + new on axis 0: the successor of a state queue, named queue + '_next'."""
    rest = g.slice(queue, 1, shape[0])
    return g.op("Concat", rest, g.reshape(new, [1, *shape[1:]]), axis=0, out=queue + "_next")


def sample_skip(g: Graph, queue: str, shape: tuple, fs: int) -> str:
    rows = g.slice(queue, 0, shape[0], fs)
    return g.reshape(rows, [1, -(-shape[0] // fs) * shape[1], *shape[2:]])


def sample_desire(g: Graph, queue: str, shape: tuple, fs: int) -> str:
    """The max over each window of fs rows, as fs strided slices (opset-independent)."""
    pooled = g.op("Max", *(g.slice(queue, k, shape[0], fs) for k in range(fs)))
    return g.reshape(pooled, [1, shape[0] // fs, shape[2]])


def inline(g: Graph, model: onnx.ModelProto, prefix: str, feeds: dict[str, str]) -> list[str]:
    """Append `model`'s nodes and initializers, its values renamed under `prefix` and its inputs
    bound to `feeds`; -> its output names."""
    graph = model.graph
    for node in graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute):
            raise ValueError(f"{graph.name}: node {node.name!r} ({node.op_type}) has a "
                             f"subgraph; the modeld step inlines flat graphs only")
    rename = lambda v: feeds.get(v) or (prefix + v if v else v)  # noqa: E731
    for t in graph.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(t)
        copy.name = prefix + t.name
        g.inits.append(copy)
    for node in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = prefix + node.name
        copy.input[:] = [rename(v) for v in node.input]
        copy.output[:] = [rename(v) for v in node.output]
        g.nodes.append(copy)
    return [rename(o.name) for o in graph.output]


def io_shapes(model: onnx.ModelProto, which: str) -> dict[str, tuple[tuple[int, ...], int]]:
    vis = model.graph.input if which == "inputs" else model.graph.output
    inits = {t.name for t in model.graph.initializer}
    shapes = {}
    for v in vis:
        if v.name in inits:
            continue
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1
                     for d in v.type.tensor_type.shape.dim)
        if any(d < 1 for d in dims):
            raise ValueError(f"{model.graph.name}: {which[:-1]} {v.name!r} has a symbolic or "
                             f"unknown dim {dims}; the modeld step needs static shapes")
        shapes[v.name] = (dims, v.type.tensor_type.elem_type)
    return shapes


def output_slices(model: onnx.ModelProto) -> dict[str, list[int]]:
    """openpilot's output_slices of a model's one output, as {name: [start, stop]}."""
    from compiler.onnx.metadata import KEY, output_slices as decode
    props = {p.key: p.value for p in model.metadata_props}
    outs = io_shapes(model, "outputs")
    if KEY not in props:
        raise ValueError(f"{model.graph.name}: no {KEY} in metadata_props (openpilot's exporter "
                         f"writes it; the step needs the vision model's hidden_state slice)")
    got = decode(props[KEY], [(n, s) for n, (s, _) in outs.items()])
    return {name: [start, stop] for name, start, stop, step in got["slices"]}


def opset_of(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def entry_name(cam: tuple[int, int], kind: str) -> str:
    """A blob entry's name, openpilot's own `WxH/kind` (1928x1208/run_policy)."""
    return f"{cam[0]}x{cam[1]}/{kind}"


def parse_size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    if not (w.isdigit() and h.isdigit() and int(w) > 0 and int(h) > 0):
        raise ValueError(f"expected a size WxH such as 512x256, got {text!r}")
    return int(w), int(h)


@dataclass
class Spec:
    """What the step needs to know of its two models, checked once."""
    vision: onnx.ModelProto
    policy: onnx.ModelProto
    model_size: tuple[int, int]
    fs: int

    def __post_init__(self):
        if self.fs < 1:
            raise ValueError(f"frame skip: expected >= 1, got {self.fs}")
        opsets = {opset_of(self.vision), opset_of(self.policy)}
        if len(opsets) > 1 or min(opsets) < MIN_OPSET:
            raise ValueError(f"vision and policy models must share one default-domain opset "
                             f">= {MIN_OPSET}; got vision {opset_of(self.vision)}, policy "
                             f"{opset_of(self.policy)}")
        self.opset = opsets.pop()
        self.vision_in = io_shapes(self.vision, "inputs")
        self.policy_in = io_shapes(self.policy, "inputs")
        self.vision_out = io_shapes(self.vision, "outputs")
        self.policy_out = io_shapes(self.policy, "outputs")
        self.vision_slices = output_slices(self.vision)
        self.policy_slices = output_slices(self.policy)
        w, h = self.model_size
        img = self.vision_in.get("img", ((),))[0]
        frames = img[1] // 6 if len(img) == 4 and img[1] % 6 == 0 else 2  # 6 planes a frame
        want = {"img": ((1, 6 * frames, h // 2, w // 2), TensorProto.UINT8)}
        want["big_img"] = want["img"]
        if self.vision_in != want:
            raise ValueError(f"vision inputs: expected img, big_img uint8 (1, 6 * frames, "
                             f"{h // 2}, {w // 2}) for model size {w}x{h}, got "
                             f"{self._shown(self.vision_in)}")
        for name in ("features_buffer", "desire_pulse", "traffic_convention"):
            if name not in self.policy_in:
                raise ValueError(f"policy inputs: expected {name}, got "
                                 f"{self._shown(self.policy_in)}")
        if len(self.vision_out) != 1 or len(self.policy_out) != 1:
            raise ValueError("vision and policy models must each have one output")
        if "hidden_state" not in self.vision_slices:
            raise ValueError(f"vision output_slices: expected hidden_state, got "
                             f"{list(self.vision_slices)}")
        start, stop = self.vision_slices["hidden_state"]
        fb = self.policy_in["features_buffer"][0]
        if stop - start != fb[2]:
            raise ValueError(f"vision hidden_state has {stop - start} values; the policy's "
                             f"features_buffer {fb} expects {fb[2]}")
        self.queues = queue_shapes(want["img"][0], fb, self.policy_in["desire_pulse"][0], self.fs)

    @staticmethod
    def _shown(shapes: dict) -> str:
        return ", ".join(f"{n} {helper.tensor_dtype_to_np_dtype(t)} {s}"
                         for n, (s, t) in shapes.items())

    def meta(self, cams: list[tuple[int, int]]) -> dict[str, str]:
        """The blob's description of the step (metadata_props, carried into the blob's meta)."""
        model = lambda m, io, sl: {  # noqa: E731
            "input_shapes": {n: list(s) for n, (s, _) in io_shapes(m, "inputs").items()},
            "output_slices": sl}
        desc = {"frame_skip": self.fs, "model_size": list(self.model_size),
                "cameras": {f"{w}x{h}": nv12_layout(w, h)._asdict() for w, h in cams},
                "queues": {n: list(s) for n, (s, _) in self.queues.items()},
                "vision": model(self.vision, self.vision_in, self.vision_slices),
                "policy": model(self.policy, self.policy_in, self.policy_slices)}
        return {"modeld": json.dumps(desc)}


CAMERAS = (("frame", "tfm", "planes", "img_q"), ("big_frame", "big_tfm", "big_planes", "big_img_q"))


def warped(g: Graph, nv12: Nv12, spec: Spec) -> list[str]:
    """Both cameras' NV12 frames and transforms as inputs; -> their six warped planes each."""
    w, h = spec.model_size
    for frame, tfm, _, _ in CAMERAS:
        g.input(frame, np.uint8, (nv12.size,))
        g.input(tfm, np.float32, (3, 3))
    return [warp(g, frame, tfm, nv12, nv12_planes(nv12), w // 2, h // 2)
            for frame, tfm, _, _ in CAMERAS]


def planes_in(g: Graph, spec: Spec) -> list[str]:
    """Both cameras' warped planes as inputs (warped on another device: split_entries)."""
    shape = spec.queues["img_q"][0][1:]
    return [g.input(planes, np.uint8, shape) for _, _, planes, _ in CAMERAS]


def _frames(g: Graph, spec: Spec, new: list[str]) -> list[str]:
    """Enqueue both cameras' new planes; -> the sampled (img, big_img)."""
    sampled = []
    for rows, (_, _, _, q) in zip(new, CAMERAS):
        shape, dtype = spec.queues[q]
        g.input(q, dtype, shape)
        queue = shift(g, q, shape, rows)
        g.output(queue, dtype, shape)
        sampled.append(sample_skip(g, queue, shape, spec.fs))
    return sampled


def warp_only(nv12: Nv12, spec: Spec, cams) -> onnx.ModelProto:
    """The warp alone, its planes as outputs: the first stage of a two-device pipeline."""
    name = entry_name((nv12.width, nv12.height), "warp")
    g = Graph(name + "/")
    for rows, (_, _, planes, _) in zip(warped(g, nv12, spec), CAMERAS):
        g.op("Identity", rows, out=planes)
        g.output(planes, np.uint8, spec.queues["img_q"][0][1:])
    return g.model(name, spec.opset, spec.meta(cams))


def warp_enqueue(name: str, source, spec: Spec, cams) -> onnx.ModelProto:
    """`source(g)` declares the inputs and returns both cameras' new planes."""
    g = Graph(name + "/")
    _frames(g, spec, source(g))
    state = {q: q + "_next" for q in ("img_q", "big_img_q")}
    return g.model(name, spec.opset, {STATE_KEY: json.dumps(state), **spec.meta(cams)})


def run_policy(name: str, source, spec: Spec, cams) -> onnx.ModelProto:
    g = Graph(name + "/")
    img, big_img = _frames(g, spec, source(g))
    g.input("desire", np.float32, (spec.policy_in["desire_pulse"][0][2],))
    g.input("traffic_convention", np.float32, (math.prod(spec.policy_in["traffic_convention"][0]),))
    extra = {n: s for n, s in spec.policy_in.items()
             if n not in ("features_buffer", "desire_pulse", "traffic_convention")}
    for name, (shape, dtype) in extra.items():
        g.input(name, helper.tensor_dtype_to_np_dtype(dtype), shape)
    (vision,) = inline(g, spec.vision, "vision/", {"img": img, "big_img": big_img})
    vision_shape = spec.vision_out[next(iter(spec.vision_out))][0]
    vision_out = g.op("Cast", vision, to=TensorProto.FLOAT, out="vision_out")
    g.output(vision_out, np.float32, vision_shape)
    queues = {}
    for q in ("feat_q", "desire_q"):
        queues[q] = spec.queues[q]
        g.input(q, queues[q][1], queues[q][0])
    start, stop = spec.vision_slices["hidden_state"]
    flat = g.reshape(vision_out, [1, -1])
    feat = shift(g, "feat_q", queues["feat_q"][0], g.slice(flat, start, stop, axis=1))
    desire = shift(g, "desire_q", queues["desire_q"][0], "desire")
    feeds = {"features_buffer": sample_skip(g, feat, queues["feat_q"][0], spec.fs),
             "desire_pulse": sample_desire(g, desire, queues["desire_q"][0], spec.fs),
             "traffic_convention": g.reshape("traffic_convention",
                                             list(spec.policy_in["traffic_convention"][0]))}
    (policy,) = inline(g, spec.policy, "policy/", feeds)
    policy_shape = spec.policy_out[next(iter(spec.policy_out))][0]
    g.output(g.op("Cast", policy, to=TensorProto.FLOAT, out="policy_out"), np.float32,
             policy_shape)
    for q, name in (("feat_q", feat), ("desire_q", desire)):
        g.output(name, queues[q][1], queues[q][0])
    state = {q: q + "_next" for q in ("img_q", "big_img_q", "feat_q", "desire_q")}
    return g.model(name, spec.opset, {STATE_KEY: json.dumps(state), **spec.meta(cams)})


def step_entries(vision: onnx.ModelProto, policy: onnx.ModelProto, model_size: tuple[int, int],
                 cams: list[tuple[int, int]], fs: int) -> dict[str, onnx.ModelProto]:
    """{'WxH/warp_enqueue': graph, 'WxH/run_policy': graph} for each camera resolution."""
    spec = Spec(vision, policy, model_size, fs)
    entries = {}
    for cam in cams:
        source = lambda g, nv12=nv12_layout(*cam): warped(g, nv12, spec)  # noqa: E731
        for kind, build in (("warp_enqueue", warp_enqueue), ("run_policy", run_policy)):
            entries[entry_name(cam, kind)] = build(entry_name(cam, kind), source, spec, cams)
    return entries


def frame_images(cams: list[tuple[int, int]], target: str) -> dict | None:
    """compile_model's `image_inputs` for the camera frames on a target that reads images by
    default (qcom; None elsewhere): each NV12 buffer read as an R8 image of `stride` texels by
    y_height + uv_height rows (its Y, then its interleaved UV rows), so the warp's gather goes
    through the GPU's texture path (docs/modeld.md "The warp's gather")."""
    if not get_target(target).images:
        return None
    sizes = {}
    for cam in cams:
        nv12 = nv12_layout(*cam)
        sizes[nv12.size] = (nv12.stride, nv12.y_height + nv12.uv_height)
    return {name: sizes for name in ("frame", "big_frame")}


def split_entries(vision: onnx.ModelProto, policy: onnx.ModelProto, model_size: tuple[int, int],
                  cams: list[tuple[int, int]], fs: int) -> tuple[dict, dict]:
    """The step as two blobs for two devices (openpilot's WARP_DEV: the warp on the Adreno, the
    models on the USB GPU): ({'WxH/warp': frames -> planes, big_planes}, {'warp_enqueue',
    'run_policy': planes, big_planes (, desire, traffic_convention) -> as step_entries'}). The
    model blob is the same for every camera; the queues are its state."""
    spec = Spec(vision, policy, model_size, fs)
    warps = {entry_name(cam, "warp"): warp_only(nv12_layout(*cam), spec, cams) for cam in cams}
    source = lambda g: planes_in(g, spec)  # noqa: E731
    models = {kind: build(kind, source, spec, cams)
              for kind, build in (("warp_enqueue", warp_enqueue), ("run_policy", run_policy))}
    return warps, models


def dm_entries(dm: onnx.ModelProto, cams: list[tuple[int, int]]) -> dict[str, onnx.ModelProto]:
    """{'WxH/dmonitoring': graph} per driver camera resolution: the Y plane warped to the DM
    model's `input_img` size (its width and height from the model's metadata or, as openpilot's,
    1440x960), then the model."""
    ins = io_shapes(dm, "inputs")
    if opset_of(dm) < MIN_OPSET:
        raise ValueError(f"DM model: expected default-domain opset >= {MIN_OPSET}, got "
                         f"{opset_of(dm)}")
    if set(ins) != {"input_img", "calib"} or ins["input_img"][1] != TensorProto.UINT8:
        raise ValueError(f"DM model inputs: expected input_img uint8 and calib, got "
                         f"{Spec._shown(ins)}")
    from models.openpilot_split import DM_SIZE
    dm_w, dm_h = DM_SIZE
    if ins["input_img"][0] != (1, dm_w * dm_h):
        raise ValueError(f"DM input_img: expected (1, {dm_w * dm_h}) for {dm_w}x{dm_h}, got "
                         f"{ins['input_img'][0]}")
    (out_name, (out_shape, _)), = io_shapes(dm, "outputs").items()
    entries = {}
    for w, h in cams:
        nv12 = nv12_layout(w, h)
        g = Graph(entry_name((w, h), "dmonitoring") + "/")
        g.input("frame", np.uint8, (nv12.size,))
        g.input("tfm", np.float32, (3, 3))
        g.input("calib", np.float32, ins["calib"][0])
        y = Plane(0, 0, 0, 1, 0, 0, 1, w, h)
        img = g.reshape(warp(g, "frame", "tfm", nv12, [y], dm_w, dm_h), [1, dm_w * dm_h],
                        out="input_img")  # named as the DM model's input: tests read it
        (out,) = inline(g, dm, "dm/", {"input_img": img, "calib": "calib"})
        g.output(g.op("Cast", out, to=TensorProto.FLOAT, out="outputs"), np.float32, out_shape)
        slices = {"output_slices": output_slices(dm), "cameras": {f"{w}x{h}": nv12._asdict()}}
        name = entry_name((w, h), "dmonitoring")
        entries[name] = g.model(name, opset_of(dm), {"dmonitoring": json.dumps(slices)})
    return entries
