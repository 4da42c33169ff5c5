"""The standard `onnx.backend.base` interface over keel, as onnxruntime.backend is for
onnxruntime (and what onnx.backend.test.BackendTest runs: tests/test_onnx_backend.py).

    import keel.backend as backend
    rep = backend.prepare(model)           # compiles to a blob, loads it with runner.Model
    outputs = rep.run([x, y])              # graph outputs, in graph order
    backend.run_model(model, [x, y]), backend.run_node(node, [x, y])

A rep runs the blob through the runner exactly as a user's blob runs, compiled for TARGET
(`KEEL_BACKEND_TARGET`, default `cpu`: every x86-64 host; the test suite compiles `cpu-avx2`
alone, tests/conftest.py). keel compiles for static shapes, so a rep compiles once per input
signature: eagerly in prepare() when the model's inputs are fully static, otherwise on the
first run() that sees a new signature. A graph input that the compiler needs as a value (the
`shape` of a Reshape, the `axes` of a reduction: StaticInputError) is bound as a constant from
the values run() receives, so the signature includes its value.

Two cache layers, both under KEEL_CACHE_DIR (default ~/.cache/keel; KEEL_CACHE_DIR="" turns both
off):
- here, whole blobs in onnx_backend/<digest>/: a folder per hash of exactly the sources a blob can
  depend on (_source_digest; the newest few folders are kept), keyed by the model bytes, the
  target and the bound shapes and constants. A hit skips the compiler altogether.
- beneath it, the compiler's own per-kernel cache (compiler/cache.py: kernels/ and objects/),
  keyed by each canonical kernel and the codegen sources, and by each kernel's C source and the C
  compiler. After an edit that misses this layer (any compile path source changes the digest),
  a node test's compile re-runs the frontend and the scheduler but takes every kernel the edit
  did not change from there, and only links.
"""
from __future__ import annotations

import ast
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, namedtupledict

from compiler import cache
from compiler.blob import write_blob
from compiler.pipeline import compile_model
from compiler.errors import StaticInputError
from runner import Model

ROOT = Path(__file__).resolve().parent.parent  # the checkout, or site-packages when installed
COMPILE_PATH = ["compiler.pipeline", "compiler.blob"]
KEEP_VERSIONS = 3  # cache folders of older compiler versions beyond this many are removed
TARGET = os.environ.get("KEEL_BACKEND_TARGET", "cpu")


def _source_digest() -> str:
    """Hash of every keel module the compile path imports (statically, functions' imports too:
    all of compiler/ and the part of runner/ that defines the blob format) and of the C
    compiler's version. A blob cached by another version is never served, and edits that cannot
    change a blob (tools/, tests/, the runner's devices) keep the cache warm. The finer layer is
    the compiler's own per-kernel cache (module docstring): an edit that misses here still
    rebuilds only the kernels it changed."""
    h = hashlib.sha256(_cc_version())
    for p in sorted(_imported_files(COMPILE_PATH)):
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _imported_files(modules: list[str]) -> set[Path]:
    """The files of `modules` and of every keel module they import, transitively, read from
    their source (the `import` and `from ... import` statements anywhere in it), with the
    __init__.py of every package on the way (importing a module runs them)."""
    seen: set[Path] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # packages run first
        path = _module_file(name)
        if path is None or path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_bytes())):
            if isinstance(node, ast.Import):
                todo.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                todo.extend([node.module] + [f"{node.module}.{a.name}" for a in node.names])
    return seen


def _module_file(name: str) -> Path | None:
    """A keel module's file (a package's __init__.py), or None for anything else."""
    if name.split(".")[0] not in ("compiler", "runner"):
        return None
    base = ROOT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _cc_version() -> bytes:
    for cc in ("clang-19", "gcc"):  # the order compiler/toolchain.py picks them in
        if shutil.which(cc):
            return subprocess.run([cc, "--version"], capture_output=True).stdout
    return b""


def cache_dir() -> Path | None:
    """This compiler version's folder of whole blobs (None: caching is off)."""
    root = cache.root()
    if root is None:
        return None
    d = root / "onnx_backend"
    here = d / _DIGEST
    if not here.exists():
        here.mkdir(parents=True, exist_ok=True)
        old = sorted((p for p in d.iterdir() if p.is_dir() and p != here),
                     key=lambda p: p.stat().st_mtime)
        for p in old[:max(len(old) - (KEEP_VERSIONS - 1), 0)]:
            shutil.rmtree(p, ignore_errors=True)
    return here


class KeelRep(BackendRep):
    def __init__(self, model: onnx.ModelProto, device: str = "CPU"):
        self.model, self.device = model, device
        inits = {i.name for i in model.graph.initializer}
        self.input_names = [vi.name for vi in model.graph.input if vi.name not in inits]
        self.output_names = [vi.name for vi in model.graph.output]
        self.constant_inputs: set[str] = set()  # inputs the compiler needs as values
        self._compiled: dict[bytes, Model] = {}
        static = _static_shapes(model, inits)
        if static is not None:
            try:
                self._model_for({}, static)
            except StaticInputError as e:  # compiled on the first run(), with the values
                self.constant_inputs.update(e.inputs)

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
        while True:
            try:
                model = self._model_for(feeds, {k: v.shape for k, v in feeds.items()})
                break
            except StaticInputError as e:
                if set(e.inputs) <= self.constant_inputs:
                    raise
                self.constant_inputs.update(e.inputs)
        out = model.run({k: v for k, v in feeds.items() if k not in self.constant_inputs})
        return namedtupledict("Outputs", self.output_names)(*(out[n] for n in self.output_names))

    def _model_for(self, values: dict, shapes: dict) -> Model:
        """The loaded blob for these input shapes (and values of the constant inputs)."""
        consts = {n: values[n] for n in sorted(self.constant_inputs)}
        shapes = {n: tuple(shapes[n]) for n in self.input_names
                  if n in shapes and n not in consts}
        key = hashlib.sha256(repr((TARGET, sorted(shapes.items()))).encode())
        for n, v in consts.items():
            key.update(f"{n}:{v.dtype}:{v.shape}".encode() + v.tobytes())
        key = key.digest()
        if key not in self._compiled:
            self._compiled[key] = self._load(key, shapes, consts)
        return self._compiled[key]

    def _load(self, key: bytes, shapes: dict, consts: dict) -> Model:
        model = _with_constants(self.model, consts)
        cache = cache_dir()
        if cache is None:
            with tempfile.TemporaryDirectory(prefix="keel-backend-") as tmp:
                path = Path(tmp) / "model.blob"
                write_blob(compile_model(model, target=TARGET, input_shapes=shapes), path)
                return Model.load(path)  # the mapping outlives the file
        path = cache / f"{hashlib.sha256(key + model.SerializeToString()).hexdigest()}.blob"
        if not path.exists():
            # atomic: a concurrent reader never sees half a blob
            write_blob(compile_model(model, target=TARGET, input_shapes=shapes), path)
        return Model.load(path)


def _with_constants(model: onnx.ModelProto, consts: dict) -> onnx.ModelProto:
    """The model with these graph inputs turned into initializers holding the given values."""
    if not consts:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [vi for vi in out.graph.input if vi.name not in consts]
    del out.graph.input[:]
    out.graph.input.extend(keep)
    out.graph.initializer.extend(onnx.numpy_helper.from_array(v, n) for n, v in consts.items())
    return out


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
        if not all(d.HasField("dim_value") and d.dim_value >= 0 for d in dims):  # -1: dynamic
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
            n, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for n, a in zip(names, arrays)]
        graph_outputs = [onnx.helper.make_empty_tensor_value_info(n) for n in node.output if n]
        graph = onnx.helper.make_graph([node], "run_node", graph_inputs, graph_outputs)
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
        return cls.prepare(model, device).run(arrays)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"


_DIGEST = _source_digest()
backend = KeelBackend
prepare = KeelBackend.prepare
run_model = KeelBackend.run_model
run_node = KeelBackend.run_node
supports_device = KeelBackend.supports_device
