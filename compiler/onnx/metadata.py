"""An ONNX model's metadata_props -> the blob manifest's `meta`, as plain JSON.

openpilot ships `output_slices` in metadata_props as base64 text of a pickled {name: slice} dict
(its modeld reads it with `pickle.loads(codecs.decode(value.encode(), "base64"))`), and cuts the
flattened model output with `out[np.newaxis, s]` per name. The compiler decodes it here, once, and
the manifest carries the result as JSON (docs/blob.md, "meta.output_slices"), so the runner needs
neither pickle nor onnx, and no pickle ever reaches a device.

Unpickling runs code chosen by whoever wrote the pickle. `_SliceUnpickler` resolves no global but
`slice` and `dict` from builtins; any other class or function is refused by name before it is
looked up. What it returns is then checked field by field.
"""
from __future__ import annotations

import base64
import binascii
import io
import math
import pickle

from compiler.errors import CompileError

KEY = "output_slices"
MAX_PICKLE_BYTES = 1 << 20  # openpilot's is ~1 KB; a bound keeps a hostile one small
_ALLOWED = {("builtins", "slice"): slice, ("builtins", "dict"): dict,
            ("__builtin__", "slice"): slice, ("__builtin__", "dict"): dict}  # pickle protocol <= 2


class _SliceUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed (only "
                                         f"builtins.slice and builtins.dict)")
        return _ALLOWED[module, name]


def model_meta(props: dict[str, str], outputs: list[tuple[str, tuple[int, ...]]]) -> dict:
    """{"metadata": the text props but output_slices, "output_slices": JSON} (either left out
    when empty). `outputs` are the graph outputs' (name, shape)."""
    meta, rest = {}, {k: v for k, v in props.items() if k != KEY}
    if rest:
        meta["metadata"] = rest
    if KEY in props:
        meta[KEY] = output_slices(props[KEY], outputs)
    return meta


def output_slices(text: str, outputs: list[tuple[str, tuple[int, ...]]]) -> dict:
    """openpilot's base64 pickle -> {"output": name, "slices": [[name, start, stop, step], ...]}
    in the pickle's order, each slice resolved against the flattened output (0 <= start <= stop
    <= size, step >= 1)."""
    if len(outputs) != 1:
        raise CompileError(f"metadata_props {KEY}: slices cut the model's one output; this model "
                           f"has {len(outputs)} outputs {[n for n, _ in outputs]}")
    name, shape = outputs[0]
    size = math.prod(shape)
    slices = _unpickle(text)
    return {"output": name,
            "slices": [[k, *_resolve(k, s, size, name)] for k, s in slices.items()]}


def _unpickle(text: str) -> dict:
    want = "openpilot's base64 text of a pickled {str: slice} dict"
    try:
        raw = base64.decodebytes(text.encode("ascii"))
    except (UnicodeEncodeError, binascii.Error) as e:
        raise CompileError(f"metadata_props {KEY}: expected {want}; not base64 ({e})") from None
    if len(raw) > MAX_PICKLE_BYTES:
        raise CompileError(f"metadata_props {KEY}: expected at most {MAX_PICKLE_BYTES} bytes of "
                           f"pickle, got {len(raw)}")
    try:
        obj = _SliceUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # a malformed pickle raises many types; none may escape untyped
        raise CompileError(f"metadata_props {KEY}: expected {want}; {type(e).__name__}: "
                           f"{e}") from None
    if type(obj) is not dict or not all(type(k) is str and type(v) is slice
                                        for k, v in obj.items()):
        got = type(obj).__name__ if type(obj) is not dict else \
            {type(k).__name__: type(v).__name__ for k, v in obj.items()}
        raise CompileError(f"metadata_props {KEY}: expected {want}, got {got}")
    return obj


def _resolve(key: str, s: slice, size: int, output: str) -> tuple[int, int, int]:
    fields = [s.start, s.stop, s.step]
    if not all(v is None or type(v) is int and v >= 0 for v in fields) or s.step == 0:
        raise CompileError(f"metadata_props {KEY}[{key!r}]: expected non-negative int or None "
                           f"bounds and a step >= 1, got {s}")
    start, stop, step = (0 if s.start is None else s.start, size if s.stop is None else s.stop,
                         1 if s.step is None else s.step)
    if not start <= stop <= size:
        raise CompileError(f"metadata_props {KEY}[{key!r}]: {s} expected within output "
                           f"{output!r}'s {size} elements, start <= stop")
    return start, stop, step
