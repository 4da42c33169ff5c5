"""ONNX -> tensor-level UOp graph, with the `onnx` package (protobuf is never parsed by hand).

Each ONNX op is one small function in compiler/onnx/ops/<topic>.py registered by name; this module handles
the graph: inputs and their static shapes, initializers, dtype mapping, unsupported-op reporting.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from onnx import numpy_helper

from compiler.errors import CompileError, StaticInputError
from compiler.ir.interp import evaluate
from compiler.ir.tensor import Tensor
from compiler.ir.uop import UOp
from compiler.onnx import ops  # noqa: F401  (registers every op into OPS)
from compiler.onnx.control import CONTROL, Body
from compiler.onnx.metadata import model_meta
from compiler.onnx.proto import read_model, validate, initializer_array, well_formed
from compiler.onnx.registry import (MAX_OPSET, MIN_OPSET, ONNX_CODES, OPS, Choice, Ctx,
                                    onnx_dtype)


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
    # inputs with an initializer compiled --overridable: its data, what a run that does not
    # feed it reads
    input_defaults: dict[str, object] = field(default_factory=dict)
    # the products an algorithm may build another way for a target, in the order they were built
    # (compiler/algorithms.py)
    choices: list[Choice] = field(default_factory=list)



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
        if static_dim(d) is not None:
            shape.append(d.dim_value)
        else:
            sym = d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?")
            raise CompileError(f"input {vi.name!r} has a dynamic dim {i} ({sym!r}); bind it with "
                               f"--input-shape {vi.name}=d0,d1,... "
                               f"(input_shapes={{'{vi.name}': ...}})")
    return _bounded(tuple(shape), f"input {vi.name!r}")


def static_dim(d: onnx.TensorShapeProto.Dimension) -> int | None:
    """A dim's size, or None when it is dynamic: a symbol, no value at all, or a negative
    value (PaddlePaddle's exporter writes a dynamic dim as dim_value = -1)."""
    return d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None


def _given_shape(vi: onnx.ValueInfoProto, shape) -> tuple[int, ...]:
    """A bound shape must keep the model's rank and its static dims."""
    shape, where = tuple(int(d) for d in shape), f"input {vi.name!r}"
    dims = vi.type.tensor_type.shape.dim
    if vi.type.tensor_type.HasField("shape") and len(dims) != len(shape):
        raise CompileError(f"{where}: --input-shape gives {len(shape)} dims {shape}, the model "
                           f"says {len(dims)}")
    for i, (d, n) in enumerate(zip(dims, shape)):
        if static_dim(d) not in (None, n):
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
        # one line, however many: a tool's or a log's reader sees every op at once
        raise CompileError(f"{len(bad)} unsupported op(s): " + "; ".join(bad))


def _known(node: onnx.NodeProto, opset: int, local: set) -> bool:
    if (node.domain, node.op_type) in local:
        return True
    if node.domain not in ("", "ai.onnx"):
        return False
    return node.op_type in OPS or node.op_type in CONTROL or \
        _schema_with_function(node.op_type, opset) is not None


def _schema_with_function(op_type: str, opset: int):
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except (onnx.defs.SchemaError, TypeError):  # TypeError: an op_type that is not UTF-8 (bytes)
        return None
    return schema if schema.has_function or schema.has_context_dependent_function else None


def _all_nodes(graph: onnx.GraphProto):
    """Every node, those of subgraphs (If branches, Loop and Scan bodies) included."""
    for n in graph.node:
        yield n
        for a in n.attribute:
            for g in (a.g,) if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                yield from _all_nodes(g)


def load_onnx(model, input_shapes: dict, float16: bool = False,
              input_values: dict | None = None, narrow_pad_divisor: int = 16, hvx: bool = False,
              overridable: tuple = (), state_inputs: frozenset = frozenset(),
              prefix: str = "", other_shapes: bool = False) -> Graph:
    """input_values: {input name: value}, inputs frozen to constants (they leave the blob's
    inputs, and what depends on them folds, an If's condition included).
    overridable: graph inputs that also have an initializer to keep as inputs with that
    default (onnxruntime's overridable initializers); the others are constants of the model,
    which shapes may depend on and kernels may pack.
    state_inputs: input names that are state (docs/blob.md) even where an initializer gives
    them a default value, which is then their initial value. prefix: put before every input's
    name inside the IR, so the inputs of several models compiled into one blob stay distinct
    tensors. other_shapes: input_shapes may name inputs of other models (entries) too."""
    proto, opset, in_file = _checked_model(model)
    names = {i.name for i in proto.graph.input}
    input_values = input_values or {}
    if other_shapes:  # several entries: each takes what names its own inputs
        input_shapes = {k: v for k, v in input_shapes.items() if k in names}
        input_values = {k: v for k, v in input_values.items() if k in names}
        overridable = tuple(n for n in overridable if n in names)
    for flag, given in (("--input-shape", input_shapes), ("--input-value", input_values)):
        if set(given) - names:
            raise CompileError(f"{flag} names unknown input(s) {sorted(set(given) - names)}; "
                               f"inputs are {[i.name for i in proto.graph.input]}")
    vals: dict[str, Tensor | None] = {"": None}
    props = {p.key: p.value for p in proto.metadata_props}
    pairs = state_pairs(props.get(STATE_KEY))
    _initializers(proto.graph, vals, {i: (str(model), *at) for i, at in in_file.items()})
    # a state input's initializer is its initial value, not a constant of the model
    defaults = {n: np.ascontiguousarray(evaluate(vals.pop(n).uop))
                for n in sorted(state_inputs | set(pairs)) if n in vals}
    with_init = [vi.name for vi in proto.graph.input if vi.name in vals]
    if set(overridable) - set(with_init):
        raise CompileError(f"--overridable names {sorted(set(overridable) - set(with_init))}, "
                           f"which are not graph inputs with an initializer; those are "
                           f"{with_init}")
    inputs, input_defaults = _inputs(proto.graph, vals, input_shapes, input_values, overridable,
                                     prefix)
    ctx = Ctx(opset, float16=float16, hvx=hvx, narrow_pad_divisor=narrow_pad_divisor)
    _build(proto.graph.node, vals, ctx, {(f.domain, f.name): f for f in proto.functions})
    outputs = _outputs(proto.graph, vals)
    meta = model_meta({k: v for k, v in props.items() if k != STATE_KEY},
                      [(name, tuple(u.shape)) for name, u in outputs])
    frozen = {n: {"dtype": str(a.dtype), "shape": list(a.shape), "values": a.reshape(-1).tolist()}
              for n, a in ((n, evaluate(vals[n].uop)) for n in input_values)}
    if frozen:  # what the model's own inputs were frozen to: tools feed onnxruntime the same
        meta["frozen_inputs"] = frozen
    constants = [name for name in with_init if name not in overridable]
    meta = {**meta, "constant_inputs": constants} if constants else meta
    return Graph(inputs, outputs, {"opset": opset, **meta}, *_origins(proto.graph.node, vals),
                 pairs, defaults, input_defaults, ctx.choices)


def _checked_model(model) -> tuple[onnx.ModelProto, int, dict]:
    """The model, read and checked (well formed, an opset in range, every op supported), its
    opset, and where its large weights lie in the file (proto.py)."""
    proto, data, in_file = read_model(model)
    well_formed(proto, model)
    opset = _opset(proto)
    if not MIN_OPSET <= opset <= MAX_OPSET + 7:  # newer opsets are accepted op by op
        raise CompileError(f"opset {opset} is outside the supported range {MIN_OPSET}..{MAX_OPSET}")
    check_supported(proto, opset)
    validate(proto, model, data)
    return proto, opset, in_file  # the file's bytes go: freed before the weights are built


def _inputs(graph: onnx.GraphProto, vals: dict, shapes: dict, values: dict, overridable: tuple,
            prefix: str) -> tuple[list, dict]:
    """The graph's inputs as tensors into `vals`: a frozen one (--input-value) a constant, one
    with an initializer a constant unless overridable (then an input with it as default)."""
    inputs, defaults = [], {}
    for vi in graph.input:
        if vi.name in values:  # frozen: a constant, so branches on it fold
            vals[vi.name] = Tensor.weight(_frozen(vi, values[vi.name], shapes))
            continue
        if vi.name in vals:
            if vi.name not in overridable:
                continue  # a constant of the model
            default = np.ascontiguousarray(evaluate(vals[vi.name].uop))
            t = Tensor.input(prefix + vi.name, tuple(default.shape), vals[vi.name].dtype)
            vals[vi.name], defaults[vi.name] = t, default
            inputs.append((vi.name, t.uop))
            continue
        if not vi.type.HasField("tensor_type"):
            raise CompileError(f"input {vi.name!r} is not a tensor; "
                               "keel supports tensor inputs only")
        dt = onnx_dtype(vi.type.tensor_type.elem_type, f"input {vi.name!r}")
        t = Tensor.input(prefix + vi.name, _input_shape(vi, shapes), dt)
        vals[vi.name] = t
        inputs.append((vi.name, t.uop))
    return inputs, defaults


def _outputs(graph: onnx.GraphProto, vals: dict) -> list[tuple[str, UOp]]:
    outputs = []
    for vi in graph.output:
        if vals.get(vi.name) is None:
            raise CompileError(f"graph output {vi.name!r} is not produced by any node")
        if all(vi.name != name for name, _ in outputs):  # one listed twice is one output
            outputs.append((vi.name, vals[vi.name].uop))
    return outputs


def _initializers(graph: onnx.GraphProto, vals, in_file: dict | None = None) -> None:
    """A graph's (or a subgraph's) initializers into `vals`, as weights; in_file: {index:
    (path, offset)} of those mapped from the model file."""
    for i, init in enumerate(graph.initializer):
        onnx_dtype(init.data_type, f"initializer {init.name!r}")
        try:
            vals[init.name] = Tensor.weight(initializer_array(init, (in_file or {}).get(i)))
        except (ValueError, TypeError) as e:  # its data does not fill its dims
            raise CompileError(f"initializer {init.name!r}: {e}") from None


def _frozen(vi: onnx.ValueInfoProto, value, given: dict) -> np.ndarray:
    """An input's --input-value as an array of the input's dtype and shape (a dynamic dim's
    size from --input-shape, or from the value: a scalar input takes one number, a vector any
    count)."""
    where = f"input {vi.name!r}: --input-value"
    if not vi.type.HasField("tensor_type"):
        raise CompileError(f"{where}: the input is not a tensor")
    dt = np.dtype(onnx_dtype(vi.type.tensor_type.elem_type, f"input {vi.name!r}").name)
    value = np.asarray(value)
    exact = value.astype(dt)
    if not np.array_equal(exact.astype(value.dtype), value, equal_nan=value.dtype.kind == "f"):
        raise CompileError(f"{where} {value.reshape(-1).tolist()} is not exactly a {dt} value")
    dims = vi.type.tensor_type.shape.dim
    shape = tuple(given[vi.name]) if vi.name in given else \
        tuple(static_dim(d) for d in dims) if vi.type.tensor_type.HasField("shape") else None
    if shape is not None and None in shape:  # dynamic dims: only a vector's follows the value
        shape = (exact.size,) if len(shape) == 1 else None
    if shape is None or math.prod(shape) != exact.size:
        raise CompileError(f"{where} gives {exact.size} value(s), the input's shape is "
                           f"{_dims_text(dims)}; give its shape with --input-shape")
    return exact.reshape(shape)


def _dims_text(dims) -> str:
    return "(" + ", ".join(str(static_dim(d)) if static_dim(d) is not None else
                           repr(d.dim_param or "?") for d in dims) + ")"


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
        if local is None and node.domain in ("", "ai.onnx") and node.op_type in CONTROL:
            outs = CONTROL[node.op_type](Body(ctx, vals, functions, _build_graph), args)
        elif local is None and node.domain in ("", "ai.onnx") and node.op_type in OPS:
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


def _build_graph(graph: onnx.GraphProto, env, ctx: Ctx, functions: dict) -> None:
    """A subgraph (an If branch, a Loop or Scan body) into `env`: its initializers, its nodes."""
    _initializers(graph, env)
    _build(graph.node, env, ctx, functions)


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
