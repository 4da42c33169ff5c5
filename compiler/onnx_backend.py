"""The standard `onnx.backend.base` interface over keel, for onnx.backend.test.BackendTest.

    rep = onnx_backend.prepare(model)      # compiles to a blob, loads it with runner.Model
    outputs = rep.run([x, y])              # graph outputs, in graph order

A rep runs the blob through the runner exactly as a user's blob runs. keel compiles for static
shapes, so each rep compiles once per input-shape signature: eagerly in prepare() when the model's
inputs are fully static, otherwise on the first run() that sees a new signature.

Compiled blobs are cached on disk (KEEL_CACHE_DIR, default ~/.cache/keel/onnx_backend), keyed by
the model bytes, the bound input shapes and a hash of the compiler's own source, so editing the
compiler never serves a stale blob. KEEL_CACHE_DIR="" turns the cache off.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, namedtupledict

from compiler.blob import write_blob
from compiler.compile import compile_model
from runner import Model

COMPILER_DIR = Path(__file__).parent


def _compiler_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(COMPILER_DIR.rglob("*.py")):
        h.update(str(p.relative_to(COMPILER_DIR)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def _cache_dir() -> Path | None:
    d = os.environ.get("KEEL_CACHE_DIR", str(Path.home() / ".cache" / "keel" / "onnx_backend"))
    return Path(d) if d else None


class KeelRep(BackendRep):
    def __init__(self, model: onnx.ModelProto, device: str = "CPU"):
        self.model, self.device = model, device
        self._bytes = model.SerializeToString()
        inits = {i.name for i in model.graph.initializer}
        self.input_names = [vi.name for vi in model.graph.input if vi.name not in inits]
        self.output_names = [vi.name for vi in model.graph.output]
        self._compiled: dict[tuple, Model] = {}
        static = _static_shapes(model, inits)
        if static is not None:
            self._model_for(static)

    def run(self, inputs, **kwargs):
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            inputs = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            if len(inputs) != len(self.input_names):
                raise ValueError(f"expected {len(self.input_names)} inputs "
                                 f"{self.input_names}, got {len(inputs)}")
            feeds = dict(zip(self.input_names, inputs))
        feeds = {k: _array(v) for k, v in feeds.items()}
        model = self._model_for({k: v.shape for k, v in feeds.items()})
        out = model.run(feeds)
        return namedtupledict("Outputs", self.output_names)(*(out[n] for n in self.output_names))

    def _model_for(self, shapes: dict) -> Model:
        sig = tuple((n, tuple(shapes[n])) for n in self.input_names if n in shapes)
        if sig not in self._compiled:
            self._compiled[sig] = Model.load(self._blob_path(dict(sig)))
        return self._compiled[sig]

    def _blob_path(self, shapes: dict) -> Path:
        cache = _cache_dir()
        key = hashlib.sha256(self._bytes + repr(sorted(shapes.items())).encode()
                             + _DIGEST.encode()).hexdigest()
        if cache is not None and (cache / f"{key}.blob").exists():
            return cache / f"{key}.blob"
        artifact = compile_model(self.model, target="cpu", input_shapes=shapes)
        if cache is None:
            path = Path(tempfile.mkdtemp(prefix="keel-backend-")) / "model.blob"
        else:
            cache.mkdir(parents=True, exist_ok=True)
            path = cache / f"{key}.blob"
        write_blob(artifact, path)  # atomic: a concurrent reader never sees half a blob
        return path


def _array(x) -> np.ndarray:
    return onnx.numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else np.asarray(x)


def _static_shapes(model: onnx.ModelProto, inits: set) -> dict | None:
    shapes = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            return None
        dims = vi.type.tensor_type.shape.dim
        if not all(d.HasField("dim_value") for d in dims):
            return None
        shapes[vi.name] = tuple(d.dim_value for d in dims)
    return shapes


class KeelBackend(Backend):
    @classmethod
    def is_compatible(cls, model, device: str = "CPU", **kwargs) -> bool:
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model, device: str = "CPU", **kwargs) -> KeelRep:
        if not isinstance(model, onnx.ModelProto):
            model = onnx.load(model)
        return KeelRep(model, device)

    @classmethod
    def run_model(cls, model, inputs, device: str = "CPU", **kwargs):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node, inputs, device: str = "CPU", outputs_info=None, **kwargs):
        """One node as a one-node model; its inputs are graph inputs typed from `inputs`."""
        names = [n for n in node.input if n]
        arrays = [_array(x) for x in (inputs.values() if isinstance(inputs, dict) else inputs)]
        graph_inputs = [onnx.helper.make_tensor_value_info(
            n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(names, arrays)]
        graph_outputs = [onnx.helper.make_empty_tensor_value_info(n) for n in node.output if n]
        graph = onnx.helper.make_graph([node], "run_node", graph_inputs, graph_outputs)
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
        return cls.prepare(model, device).run(arrays)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"


_DIGEST = _compiler_digest()
backend = KeelBackend
prepare = KeelBackend.prepare
run_model = KeelBackend.run_model
run_node = KeelBackend.run_node
supports_device = KeelBackend.supports_device
