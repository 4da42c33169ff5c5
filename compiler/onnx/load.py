"""ONNX -> tensor-level UOp graph, with the `onnx` package (protobuf is never parsed by hand).

Each ONNX op is one small function in compiler/onnx/ops/<topic>.py registered by name; this module handles
the graph: inputs and their static shapes, initializers, dtype mapping, unsupported-op reporting.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import mmap
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from compiler import cache
from compiler.errors import CompileError, StaticInputError
from compiler.ir.interp import evaluate
from compiler.ir.tensor import Tensor
from compiler.ir.uop import UOp
from compiler.onnx import ops  # noqa: F401  (registers every op into OPS)
from compiler.onnx.control import CONTROL, Body
from compiler.onnx.metadata import model_meta
from compiler.onnx.registry import MAX_OPSET, MIN_OPSET, ONNX_CODES, OPS, Ctx, onnx_dtype

from runner.files import open_regular

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



# a model past this size is checked on a copy without its large initializers (_lent): the
# checker and shape inference would each hold another copy of the weights
BIG_MODEL_BYTES, BIG_TENSOR_BYTES = 256 << 20, 1 << 20


def _load_proto(model) -> tuple[onnx.ModelProto, bytes | None, dict]:
    """The model, the file's bytes when they are the whole model (no external data): the
    checks then read those bytes instead of serializing the model again, and where a big
    model's large initializers lie in its file ({index: (offset, length)}, _strip)."""
    if isinstance(model, onnx.ModelProto):
        return model, None, {}
    try:
        in_file: dict = {}
        with open(open_regular(model), "rb") as f:
            small = os.fstat(f.fileno()).st_size <= BIG_MODEL_BYTES
            if small:
                data = f.read()
            else:  # big: parsed without its weights, mapped from the file when built (_weight)
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    data, in_file = _strip(m)
        proto = onnx.load_from_string(data)
        if _external(proto):
            # the weights stay in their files, mapped when built (_weight): a model over 2 GB
            # must keep them there (protobuf holds at most 2 GB), and none is copied
            proto = onnx.load(str(model), load_external_data=False)
            for t in proto.graph.initializer:
                for entry in t.external_data:
                    if entry.key == "location":
                        entry.value = str(Path(model).parent / entry.value)
            return proto, None, {}
        # a big model's checks read a copy without its weights (_lent)
        return proto, (data if small else None), in_file
    except FileNotFoundError:
        raise CompileError(f"model file not found: {model}") from None
    except OSError as e:  # a FIFO, a directory, a NUL in the path: refused before any read
        raise CompileError(f"model {e.filename or model}: {e.strerror or e}") from None
    except Exception as e:  # protobuf raises several unrelated types for garbage input
        raise CompileError(f"{model}: not a valid ONNX model ({type(e).__name__}: {e})") from None


def _strip(data) -> tuple[bytes, dict[int, tuple[int, int]]]:
    """The model file's bytes without the raw_data of its initializers over BIG_TENSOR_BYTES,
    and where each of those lies in the file: {initializer index: (offset, length)}. Works on
    the protobuf wire format (ModelProto.graph is field 7, GraphProto.initializer 5,
    TensorProto.raw_data 9) and reads only the headers of the fields it leaves out."""
    found, count = {}, itertools.count()

    def tensor(p: int, q: int) -> bytes:
        i, parts = next(count), []
        for field, key, start, end in _wire(data, p, q):
            if field == (9, 2) and end - start > BIG_TENSOR_BYTES:
                found[i] = (start, end - start)
            else:
                parts.append(data[key:end])
        return b"".join(parts)

    def rebuilt(p: int, q: int, number: int, inner) -> bytes:
        parts = []
        for field, key, start, end in _wire(data, p, q):
            if field == (number, 2):
                body = inner(start, end)
                parts += [_varint_bytes(number << 3 | 2), _varint_bytes(len(body)), body]
            else:
                parts.append(data[key:end])
        return b"".join(parts)

    return rebuilt(0, len(data), 7, lambda p, q: rebuilt(p, q, 5, tensor)), found


def _wire(data, pos: int, end: int):
    """The fields of the message in data[pos:end]: ((number, wire type), where its key starts,
    where its value starts, where it ends)."""
    while pos < end:
        key_at = pos
        key, pos = _varint(data, pos)
        kind = key & 7
        if kind == 2:
            size, pos = _varint(data, pos)
            stop = pos + size
        elif kind in (0, 1, 5):
            stop = _varint(data, pos)[1] if kind == 0 else pos + (8 if kind == 1 else 4)
        else:
            raise ValueError(f"protobuf wire type {kind} at byte {key_at}")
        if stop > end:
            raise ValueError(f"protobuf field at byte {key_at} runs past its message")
        yield (key >> 3, kind), key_at, pos, stop
        pos = stop


def _varint(data, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if b < 0x80:
            return value, pos


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _external(proto: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)


def _weight(init: onnx.TensorProto, in_file: tuple[str, int, int] | None = None) -> np.ndarray:
    """An initializer's values; those in an external file, or at in_file's (path, offset,
    length) of the model file, mapped read-only, not read."""
    if init.data_location == onnx.TensorProto.EXTERNAL:
        where = {e.key: e.value for e in init.external_data}
    elif in_file is not None:
        where = dict(zip(("location", "offset", "length"), in_file))
    else:
        return numpy_helper.to_array(init)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
    shape, offset = tuple(init.dims), int(where.get("offset", 0))
    nbytes = math.prod(shape) * dtype.itemsize
    if dtype.hasobject or int(where.get("length", nbytes)) != nbytes:
        raise ValueError(f"external data of {where.get('length')} bytes for {dtype} {shape}")
    if nbytes == 0:
        return np.zeros(shape, dtype)
    try:
        return np.memmap(where["location"], dtype, "r", offset, shape)
    except (OSError, KeyError) as e:
        raise ValueError(f"external data {where.get('location')!r}: {e}") from None


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
        lent = _lent(proto)
        for v in (*lent.graph.input, *lent.graph.output):
            if not v.type.HasField("tensor_type") and not v.type.HasField("sequence_type"):
                v.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
            if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape"):
                v.type.tensor_type.shape.SetInParent()
        # a big model's inference on the whole would copy it twice
        checked, inferred, size = lent, lent if _big(proto) else proto, lent.ByteSize()
    else:  # the file's own bytes: no copy, no serialization (a 76 MB model costs ~0.5 s each)
        checked, inferred, size = data, data, len(data)
        key = hashlib.sha256(onnx.__version__.encode() + b"\0" + data).hexdigest()
        if cache.get("valid", key) is not None:
            return  # these bytes passed before, with this onnx
    try:
        if size < 2**31:  # protobuf cannot serialize more: those skip the checker
            # external weights: the checker finds their files beside the model's own file
            on_disk = _external(proto) and not isinstance(source, onnx.ModelProto)
            onnx.checker.check_model(str(source) if on_disk else checked)
            # not strict_mode: onnx's own inference fails on some valid models (the official
            # MeanVarianceNormalization test) that onnxruntime runs
            onnx.shape_inference.infer_shapes(inferred, check_type=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError) as e:
        raise CompileError(f"{_where(source)}: not a valid ONNX model: "
                           f"{str(e).splitlines()[0]}") from None
    if checked is data:
        cache.put("valid", key, b"")


def _lent(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model for the checks; a big model's large initializers become typed graph
    inputs in it, so the checks see the same names, types and shapes without another copy of
    the weights (shape inference reads only small ones' values: shapes, axes)."""
    lent = onnx.ModelProto()
    if not _big(proto):
        lent.CopyFrom(proto)
        return lent
    for f, v in proto.ListFields():
        if f.name != "graph":
            _copy_field(lent, f, v)
    inputs = {i.name for i in proto.graph.input}
    for f, v in proto.graph.ListFields():
        if f.name != "initializer":
            _copy_field(lent.graph, f, v)
    for t in proto.graph.initializer:
        if _nbytes(t) <= BIG_TENSOR_BYTES:
            lent.graph.initializer.append(t)
        elif t.name not in inputs:
            lent.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type,
                                                                      t.dims))
    return lent


def _nbytes(t: onnx.TensorProto) -> int:
    """An initializer's size from its dims (protobuf's ByteSize would serialize it to tell)."""
    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    return math.prod(t.dims) * itemsize


def _big(proto: onnx.ModelProto) -> bool:
    return sum(map(_nbytes, proto.graph.initializer)) > BIG_MODEL_BYTES


def _copy_field(dst, f, value) -> None:
    if f.is_repeated:
        getattr(dst, f.name).extend(value)
    elif f.type == f.TYPE_MESSAGE:
        getattr(dst, f.name).CopyFrom(value)
    else:
        setattr(dst, f.name, value)


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


def load_onnx(model, input_shapes: dict, float16: bool = False, winograd: bool = False,
              pad_columns: int = 0, input_values: dict | None = None,
              narrow_pad_divisor: int = 16, hvx: bool = False,
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
    proto, data, in_file = _load_proto(model)
    _well_formed(proto, model)
    opset = _opset(proto)
    if not MIN_OPSET <= opset <= MAX_OPSET + 7:  # newer opsets are accepted op by op
        raise CompileError(f"opset {opset} is outside the supported range {MIN_OPSET}..{MAX_OPSET}")
    check_supported(proto, opset)
    _validate(proto, model, data)
    del data  # the file's bytes, as large as the weights: freed before the weights are built
    input_values = input_values or {}
    names = {i.name for i in proto.graph.input}
    if other_shapes:  # several entries: each takes what names its own inputs
        input_shapes = {k: v for k, v in input_shapes.items() if k in names}
        input_values = {k: v for k, v in input_values.items() if k in names}
        overridable = tuple(n for n in overridable if n in names)
    for flag, given in (("--input-shape", input_shapes), ("--input-value", input_values)):
        unknown = set(given) - names
        if unknown:
            raise CompileError(f"{flag} names unknown input(s) {sorted(unknown)}; inputs are "
                               f"{[i.name for i in proto.graph.input]}")
    vals: dict[str, Tensor | None] = {"": None}
    props = {p.key: p.value for p in proto.metadata_props}
    pairs = state_pairs(props.get(STATE_KEY))
    state_inputs = state_inputs | set(pairs)
    _initializers(proto.graph, vals, {i: (str(model), *at) for i, at in in_file.items()})
    # a state input's initializer is its initial value, not a constant of the model
    defaults = {n: np.ascontiguousarray(evaluate(vals.pop(n).uop))
                for n in sorted(state_inputs) if n in vals}
    with_init = [vi.name for vi in proto.graph.input if vi.name in vals]
    unknown = sorted(set(overridable) - set(with_init))
    if unknown:
        raise CompileError(f"--overridable names {unknown}, which are not graph inputs with an "
                           f"initializer; those are {with_init}")
    inputs, input_defaults = [], {}
    for vi in proto.graph.input:
        if vi.name in input_values:  # frozen: a constant, so branches on it fold
            vals[vi.name] = Tensor.weight(_frozen(vi, input_values[vi.name], input_shapes))
            continue
        if vi.name in vals:
            if vi.name not in overridable:
                continue  # a constant of the model
            default = np.ascontiguousarray(evaluate(vals[vi.name].uop))
            t = Tensor.input(prefix + vi.name, tuple(default.shape), vals[vi.name].dtype)
            vals[vi.name], input_defaults[vi.name] = t, default
            inputs.append((vi.name, t.uop))
            continue
        if not vi.type.HasField("tensor_type"):
            raise CompileError(f"input {vi.name!r} is not a tensor; "
                               "keel supports tensor inputs only")
        dt = onnx_dtype(vi.type.tensor_type.elem_type, f"input {vi.name!r}")
        t = Tensor.input(prefix + vi.name, _input_shape(vi, input_shapes), dt)
        vals[vi.name] = t
        inputs.append((vi.name, t.uop))
    functions = {(f.domain, f.name): f for f in proto.functions}
    _build(proto.graph.node, vals, Ctx(opset, float16=float16, winograd=winograd,
                                            pad_columns=pad_columns,
                                            narrow_pad_divisor=narrow_pad_divisor, hvx=hvx),
           functions)
    outputs = []
    for vi in proto.graph.output:
        if vals.get(vi.name) is None:
            raise CompileError(f"graph output {vi.name!r} is not produced by any node")
        if all(vi.name != name for name, _ in outputs):  # one listed twice is one output
            outputs.append((vi.name, vals[vi.name].uop))
    meta = model_meta({k: v for k, v in props.items() if k != STATE_KEY},
                      [(name, tuple(u.shape)) for name, u in outputs])
    frozen = {n: {"dtype": str(a.dtype), "shape": list(a.shape), "values": a.reshape(-1).tolist()}
              for n, a in ((n, evaluate(vals[n].uop)) for n in input_values)}
    if frozen:  # what the model's own inputs were frozen to: tools feed onnxruntime the same
        meta["frozen_inputs"] = frozen
    constants = [name for name in with_init if name not in overridable]
    meta = {**meta, "constant_inputs": constants} if constants else meta
    return Graph(inputs, outputs, {"opset": opset, **meta}, *_origins(proto.graph.node, vals),
                 pairs, defaults, input_defaults)


def _initializers(graph: onnx.GraphProto, vals, in_file: dict | None = None) -> None:
    """A graph's (or a subgraph's) initializers into `vals`, as weights; in_file: {index:
    (path, offset)} of those mapped from the model file."""
    for i, init in enumerate(graph.initializer):
        onnx_dtype(init.data_type, f"initializer {init.name!r}")
        try:
            vals[init.name] = Tensor.weight(_weight(init, (in_file or {}).get(i)))
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
