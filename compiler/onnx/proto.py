"""Reading an ONNX file into a checked ModelProto: the onnx checker and shape inference, and
for big models (past BIG_MODEL_BYTES) the large initializers left out of the parse and mapped
from the file instead, so the weights are never held twice (docs/wild.md, "Big models")."""
from __future__ import annotations

import hashlib
import itertools
import math
import mmap
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from compiler import cache
from compiler.errors import CompileError
from runner.files import open_regular


# a model past this size is checked on a copy without its large initializers (_lent): the
# checker and shape inference would each hold another copy of the weights
BIG_MODEL_BYTES, BIG_TENSOR_BYTES = 256 << 20, 1 << 20


def read_model(model) -> tuple[onnx.ModelProto, bytes | None, dict]:
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
            else:  # big: parsed without its weights, mapped from the file when built (initializer_array)
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    data, in_file = _strip(m)
        proto = onnx.load_from_string(data)
        if _external(proto):
            # the weights stay in their files, mapped when built (initializer_array): a model over 2 GB
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


def initializer_array(init: onnx.TensorProto, in_file: tuple[str, int, int] | None = None) -> np.ndarray:
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


def well_formed(proto: onnx.ModelProto, source) -> None:
    """What every model needs before its ops can be listed (an empty or cut-off file parses as
    a model that lacks them): an IR version, the default domain's opset, graph outputs."""
    why = "it has no ir_version" if proto.ir_version < 1 else \
        "it has no opset_import for the default domain" if not any(
            o.domain in ("", "ai.onnx") for o in proto.opset_import) else \
        "its graph has no outputs" if not proto.graph.output else None
    if why:
        raise CompileError(f"{_where(source)}: not a valid ONNX model: {why}")


def validate(proto: onnx.ModelProto, source, data: bytes | None) -> None:
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
