"""openpilot's output slices, read from the manifest's `meta.output_slices` (docs/blob.md).

The compiler decoded openpilot's pickle into plain JSON (compiler/onnx/metadata.py); this reads
that JSON with no pickle and no onnx. `meta` is otherwise free-form, so the slices are checked
here, at load, as strictly as the rest of the manifest: they index the output's memory.
"""
from __future__ import annotations

import math

from runner.errors import BlobError

KEY = "output_slices"


def read_slices(manifest: dict, outputs) -> tuple[str | None, dict[str, slice]]:
    """(output name, {name: slice of the flattened output}) in manifest order; (None, {}) for a
    blob without slices. `outputs` are the blob's output BufferSpecs."""
    obj = manifest["meta"].get(KEY)
    if obj is None:
        return None, {}
    sizes = {b.name: math.prod(b.shape) for b in outputs}
    if type(obj) is not dict or obj.keys() != {"output", "slices"} or \
            obj["output"] not in sizes or type(obj["slices"]) is not list:
        raise BlobError(f"manifest meta.{KEY}: expected {{\"output\": one of {sorted(sizes)}, "
                        f"\"slices\": [...]}}, got {str(obj)[:80]}")
    size, slices = sizes[obj["output"]], {}
    for i, item in enumerate(obj["slices"]):
        ok = type(item) is list and len(item) == 4 and type(item[0]) is str and \
            item[0] not in slices and all(type(v) is int for v in item[1:])
        if not ok or not 0 <= item[1] <= item[2] <= size or item[3] < 1:
            raise BlobError(f"manifest meta.{KEY}.slices[{i}]: expected [unique name, start, "
                            f"stop, step] with 0 <= start <= stop <= {size} and step >= 1, "
                            f"got {str(item)[:80]}")
        slices[item[0]] = slice(*item[1:])
    return obj["output"], slices
