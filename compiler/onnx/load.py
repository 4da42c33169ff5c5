"""ONNX -> tensor-level UOp graph, with the `onnx` package (protobuf is never parsed by hand).

Each ONNX op is one small function in compiler/onnx/ops/<topic>.py registered by name; this module handles
the graph: inputs and their static shapes, initializers, dtype mapping, unsupported-op reporting.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx
from onnx import numpy_helper

from compiler import cache
from compiler.errors import CompileError, StaticInputError
from compiler.ir.tensor import Tensor
from compiler.ir.uop import UOp
from compiler.onnx import ops  # noqa: F401  (registers every op into OPS)
from compiler.onnx.metadata import model_meta
from compiler.onnx.registry import MAX_OPSET, MIN_OPSET, ONNX_CODES, OPS, Ctx, onnx_dtype

MAX_ELEMENTS = 2**31 - 1

@dataclass
class Graph:
    inputs: list[tuple[str, UOp]]
    outputs: list[tuple[str, UOp]]
    meta: dict = field(default_factory=dict)
    # provenance: every top-level node as (name, op_type), and the node that first produced each
    # tensor (an Identity's output is its input's UOp, so it keeps the producer's index)
    nodes: list[tuple[str, str]] = field(default_factory=list)
    origins: dict[UOp, int] = field(default_factory=dict)
    # state pairs this model declares (metadata_props STATE_KEY): input -> output that replaces it
    state: dict[str, str] = field(default_factory=dict)
    # initial values: the initializers of state inputs (an input with a default value)
    defaults: dict[str, np.ndarray] = field(default_factory=dict)



def _load_proto(model) -> tuple[onnx.ModelProto, bytes | None]:
    """The model, and the file's bytes when they are the whole model (no external data): the
    checks then read those bytes instead of serializing the model again."""
    if isinstance(model, onnx.ModelProto):
        return model, None
    try:
        data = Path(model).read_bytes()
        proto = onnx.load_from_string(data)
        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
            return onnx.load(str(model)), None  # onnx finds the weights beside the file
        return proto, data
    except FileNotFoundError:
        raise CompileError(f"model file not found: {model}") from None
    except Exception as e:  # protobuf raises several unrelated types for garbage input
        raise CompileError(f"{model}: not a valid ONNX model ({type(e).__name__}: {e})") from None


def _well_formed(proto: onnx.ModelProto, source) -> None:
    """What every model needs before its ops can be listed (an empty or cut-off file parses as
    a model that lacks them): an IR version, the default domain's opset, graph outputs."""
    why = "it has no ir_version" if proto.ir_version < 1 else \
        "it has no opset_import for the default domain" if not any(
            o.domain in ("", "ai.onnx") for o in proto.opset_import) else \
        "its graph has no outputs" if not proto.graph.output else None
    if why:
        raise CompileError(f"{_where(source)}: not a valid ONNX model: {why}")


def _validate(proto: onnx.ModelProto, source, data: bytes | None) -> None:
    """onnx.checker, then type inference: what onnxruntime also refuses (dangling names, cycles,
    operand types that disagree...). `data`: the model's bytes, when they are at hand."""
    # The checker wants a type and a shape on every graph input and output; onnxruntime (and
    # keel, which infers them) accept neither. Lend them for the check, on a copy.
    io = (*proto.graph.input, *proto.graph.output)
    if any(_untyped(v) for v in io) or data is None:
        lent = onnx.ModelProto()
        lent.CopyFrom(proto)
        for v in (*lent.graph.input, *lent.graph.output):
            if not v.type.HasField("tensor_type") and not v.type.HasField("sequence_type"):
                v.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
            if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape"):
                v.type.tensor_type.shape.SetInParent()
        checked, inferred, size = lent, proto, proto.ByteSize()
    else:  # the file's own bytes: no copy, no serialization (a 76 MB model costs ~0.5 s each)
        checked, inferred, size = data, data, len(data)
        key = hashlib.sha256(onnx.__version__.encode() + b"\0" + data).hexdigest()
        if cache.get("valid", key) is not None:
            return  # these bytes passed before, with this onnx
    try:
        if size < 2**31:  # protobuf cannot serialize more: those skip the checker
            onnx.checker.check_model(checked)
            # not strict_mode: onnx's own inference fails on some valid models (the official
            # MeanVarianceNormalization test) that onnxruntime runs
            onnx.shape_inference.infer_shapes(inferred, check_type=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError) as e:
        raise CompileError(f"{_where(source)}: not a valid ONNX model: "
                           f"{str(e).splitlines()[0]}") from None
    if checked is data:
        cache.put("valid", key, b"")


def _untyped(v: onnx.ValueInfoProto) -> bool:
    """A graph input or output the checker would refuse for a missing type or shape."""
    t = v.type
    return not (t.HasField("tensor_type") or t.HasField("sequence_type")) or \
        (t.HasField("tensor_type") and not t.tensor_type.HasField("shape"))


def _where(source) -> str:
    return "model" if isinstance(source, onnx.ModelProto) else str(source)


def _opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return MIN_OPSET


def _input_shape(vi: onnx.ValueInfoProto, given: dict) -> tuple[int, ...]:
    dims = vi.type.tensor_type.shape.dim
    if vi.name in given:
        return _given_shape(vi, given[vi.name])
    shape = []
    for i, d in enumerate(dims):
        if d.HasField("dim_value") and d.dim_value >= 0:
            shape.append(d.dim_value)
        else:
            sym = d.dim_param or "?"
            raise CompileError(f"input {vi.name!r} has a dynamic dim {i} ({sym!r}); bind it with "
                               f"--input-shape {vi.name}=d0,d1,... "
                               f"(input_shapes={{'{vi.name}': ...}})")
    return _bounded(tuple(shape), f"input {vi.name!r}")


def _given_shape(vi: onnx.ValueInfoProto, shape) -> tuple[int, ...]:
    """A bound shape must keep the model's rank and its static dims."""
    shape, where = tuple(int(d) for d in shape), f"input {vi.name!r}"
    dims = vi.type.tensor_type.shape.dim
    if vi.type.tensor_type.HasField("shape") and len(dims) != len(shape):
        raise CompileError(f"{where}: --input-shape gives {len(shape)} dims {shape}, the model "
                           f"says {len(dims)}")
    for i, (d, n) in enumerate(zip(dims, shape)):
        if d.HasField("dim_value") and d.dim_value != n:
            raise CompileError(f"{where}: --input-shape gives dim {i} = {n}, the model says "
                               f"{d.dim_value}")
    return _bounded(shape, where)


def _bounded(shape: tuple[int, ...], where: str) -> tuple[int, ...]:
    """Kernels index with 32-bit ints (dtypes.index): no tensor may have 2**31 elements."""
    if any(d < 0 for d in shape) or math.prod(shape) > MAX_ELEMENTS:
        raise CompileError(f"{where}: shape {shape} has {math.prod(shape)} elements; keel "
                           f"supports non-negative dims and at most {MAX_ELEMENTS} elements")
    return shape


def check_supported(model: onnx.ModelProto, opset: int) -> None:
    """Every node keel cannot build, listed at once (node name and opset) before any is built.
    An op with an ONNX function body counts as supported: it is expanded into its body, whose
    ops are checked when it is built."""
    local = {(f.domain, f.name) for f in model.functions}
    bad = []
    for g_node in _all_nodes(model.graph):
        if not _known(g_node, opset, local):
            dom = f"{g_node.domain}." if g_node.domain not in ("", "ai.onnx") else ""
            name = g_node.name or "(unnamed)"
            bad.append(f"{dom}{g_node.op_type} (node {name!r}, opset {opset})")
    if bad:
        raise CompileError(f"{len(bad)} unsupported op(s):\n  " + "\n  ".join(bad))


def _known(node: onnx.NodeProto, opset: int, local: set) -> bool:
    if (node.domain, node.op_type) in local:
        return True
    if node.domain not in ("", "ai.onnx"):
        return False
    return node.op_type in OPS or _schema_with_function(node.op_type, opset) is not None


def _schema_with_function(op_type: str, opset: int):
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except (onnx.defs.SchemaError, TypeError):  # TypeError: an op_type that is not UTF-8 (bytes)
        return None
    return schema if schema.has_function or schema.has_context_dependent_function else None


def _all_nodes(graph: onnx.GraphProto):
    for n in graph.node:
        yield n


def load_onnx(model, input_shapes: dict, float16: bool = False, winograd: bool = False,
              pad_columns: int = 0, state_inputs: frozenset = frozenset(),
              prefix: str = "", other_shapes: bool = False) -> Graph:
    """state_inputs: input names that are state (docs/blob.md) even where an initializer gives
    them a default value, which is then their initial value. prefix: put before every input's
    name inside the IR, so the inputs of several models compiled into one blob stay distinct
    tensors. other_shapes: input_shapes may name inputs of other models (entries) too."""
    proto, data = _load_proto(model)
    _well_formed(proto, model)
    opset = _opset(proto)
    if not MIN_OPSET <= opset <= MAX_OPSET + 7:  # newer opsets are accepted op by op
        raise CompileError(f"opset {opset} is outside the supported range {MIN_OPSET}..{MAX_OPSET}")
    check_supported(proto, opset)
    _validate(proto, model, data)
    unknown = set(input_shapes) - {i.name for i in proto.graph.input}
    if other_shapes:
        input_shapes = {k: v for k, v in input_shapes.items() if k not in unknown}
    elif unknown:
        raise CompileError(f"--input-shape names unknown input(s) {sorted(unknown)}; inputs are "
                           f"{[i.name for i in proto.graph.input]}")
    vals: dict[str, Tensor | None] = {"": None}
    props = {p.key: p.value for p in proto.metadata_props}
    pairs = state_pairs(props.get(STATE_KEY))
    state_inputs = state_inputs | set(pairs)
    defaults = {}
    for init in proto.graph.initializer:
        onnx_dtype(init.data_type, f"initializer {init.name!r}")
        try:
            if init.name in state_inputs:
                defaults[init.name] = numpy_helper.to_array(init)
            else:
                vals[init.name] = Tensor.weight(numpy_helper.to_array(init))
        except (ValueError, TypeError) as e:  # its data does not fill its dims
            raise CompileError(f"initializer {init.name!r}: {e}") from None
    inputs = []
    for vi in proto.graph.input:
        if vi.name in vals:
            continue  # an initializer with a default value: a constant of the model
        if not vi.type.HasField("tensor_type"):
            raise CompileError(f"input {vi.name!r} is not a tensor; "
                               "keel supports tensor inputs only")
        dt = onnx_dtype(vi.type.tensor_type.elem_type, f"input {vi.name!r}")
        t = Tensor.input(prefix + vi.name, _input_shape(vi, input_shapes), dt)
        vals[vi.name] = t
        inputs.append((vi.name, t.uop))
    functions = {(f.domain, f.name): f for f in proto.functions}
    _build(proto.graph.node, vals, Ctx(opset, float16=float16, winograd=winograd,
                                            pad_columns=pad_columns), functions)
    outputs = []
    for vi in proto.graph.output:
        if vals.get(vi.name) is None:
            raise CompileError(f"graph output {vi.name!r} is not produced by any node")
        outputs.append((vi.name, vals[vi.name].uop))
    meta = model_meta({k: v for k, v in props.items() if k != STATE_KEY},
                      [(name, tuple(u.shape)) for name, u in outputs])
    return Graph(inputs, outputs, {"opset": opset, **meta}, *_origins(proto.graph.node, vals),
                 pairs, defaults)


STATE_KEY = "keel.state"  # metadata_props: JSON {"input": "output", ...}, docs/blob.md "state"


def state_pairs(text: str | None) -> dict[str, str]:
    """metadata_props[STATE_KEY] -> {state input: the output that replaces it after a run}."""
    if text is None:
        return {}
    try:
        pairs = json.loads(text)
    except ValueError as e:
        raise CompileError(f"metadata_props {STATE_KEY}: expected JSON, got {text[:80]!r} ({e})") \
            from None
    if type(pairs) is not dict or not all(type(k) is str and type(v) is str and k and v
                                          for k, v in pairs.items()):
        raise CompileError(f"metadata_props {STATE_KEY}: expected a JSON object of input name -> "
                           f"output name strings, got {text[:80]!r}")
    return pairs


def node_name(node: onnx.NodeProto, i: int) -> str:
    """A node's name, or (names are optional in ONNX) its first output's, or its index."""
    return node.name or next((o for o in node.output if o), f"#{i}")


def _origins(nodes, vals: dict) -> tuple[list[tuple[str, str]], dict[UOp, int]]:
    """Which node each tensor came from, for provenance in the blob (pipeline.provenance)."""
    origins: dict[UOp, int] = {}
    for i, n in enumerate(nodes):
        for name in n.output:
            if isinstance(vals.get(name), Tensor):
                origins.setdefault(vals[name].uop, i)
    return [(node_name(n, i), n.op_type) for i, n in enumerate(nodes)], origins


def _build(nodes, vals: dict, base: Ctx, functions: dict) -> None:
    """Build `nodes` in order, reading and writing tensors by name in `vals`. `base`: the
    options every node's Ctx shares."""
    for node in nodes:
        ctx = replace(base, node=node)
        args = [vals.get(n) if n else None for n in node.input]
        missing = [n for n in node.input if n and n not in vals]
        if missing:
            raise CompileError(f"{ctx.where()}: input(s) {missing} are not produced by any node")
        local = functions.get((node.domain, node.op_type))
        if local is None and node.domain in ("", "ai.onnx") and node.op_type in OPS:
            try:
                outs = OPS[node.op_type](ctx, args, attrs(node))
            except CompileError:
                raise
            except (ValueError, IndexError, KeyError, TypeError, AssertionError) as e:
                raise CompileError(f"{ctx.where()}: {type(e).__name__}: {e}") from e
        else:
            outs = _expand_function(ctx, args, local, functions)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        for name, t in zip(node.output, outs):
            if name:
                vals[name] = t
                if isinstance(t, Tensor):
                    _bounded(t.shape, f"{ctx.where()}: output {name!r}")


def _expand_function(ctx: Ctx, args: list, local, functions: dict) -> list:
    """An op defined by an ONNX function (a schema's body, or one of the model's functions):
    build its body with the node's inputs bound to the formal inputs."""
    node = ctx.node
    fn = local if local is not None else _function_body(ctx, args)
    if fn is None:
        raise CompileError(f"{ctx.where()}: unsupported op")
    given = {a.name: a for a in node.attribute}
    if local is None:  # schema defaults for attributes the node leaves out
        schema = onnx.defs.get_schema(node.op_type, ctx.opset, "")
        for name, a in schema.attributes.items():
            if name not in given and a.default_value.name:
                given[name] = a.default_value
    else:
        for a in fn.attribute_proto:
            given.setdefault(a.name, a)
    body = [_bind_attrs(n, given) for n in fn.node]
    env: dict = {"": None}
    env.update({formal: t for formal, t in zip(fn.input, args)})
    opset = next((o.version for o in fn.opset_import if o.domain in ("", "ai.onnx")), ctx.opset)
    try:
        _build(body, env, replace(ctx, opset=opset), functions)
    except StaticInputError as e:
        raise StaticInputError(f"{ctx.where()}, expanded from its ONNX function: {e}",
                               e.inputs) from None
    except CompileError as e:
        raise CompileError(f"{ctx.where()}, expanded from its ONNX function: {e}") from None
    return [env.get(formal) for formal in fn.output]


def _function_body(ctx: Ctx, args: list) -> onnx.FunctionProto | None:
    schema = _schema_with_function(ctx.node.op_type, ctx.opset)
    if schema is None:
        return None
    fn = onnx.FunctionProto()
    versions = [v for v in schema.function_opset_versions if v <= ctx.opset]
    if versions:
        fn.ParseFromString(schema.get_function_with_opset_version(max(versions)))
        return fn
    versions = [v for v in schema.context_dependent_function_opset_versions if v <= ctx.opset]
    if not versions:
        return None
    types = [onnx.helper.make_tensor_type_proto(ONNX_CODES[t.dtype], t.shape).SerializeToString()
             if t is not None else onnx.TypeProto().SerializeToString() for t in args]
    fn.ParseFromString(schema.get_context_dependent_function_with_opset_version(
        max(versions), ctx.node.SerializeToString(), types))
    return fn


def _bind_attrs(node: onnx.NodeProto, given: dict) -> onnx.NodeProto:
    """A body node with attribute references (ref_attr_name) replaced by the caller's values."""
    if not any(a.ref_attr_name for a in node.attribute):
        return node
    out = onnx.NodeProto()
    out.CopyFrom(node)
    del out.attribute[:]
    for a in node.attribute:
        if not a.ref_attr_name:
            out.attribute.append(a)
        elif a.ref_attr_name in given:
            bound = onnx.AttributeProto()
            bound.CopyFrom(given[a.ref_attr_name])
            bound.name = a.name
            out.attribute.append(bound)
    return out


def attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, onnx.TensorProto):
            v = numpy_helper.to_array(v)
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [x.decode() for x in v]
        out[a.name] = v
    return out
