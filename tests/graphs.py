"""Test helpers: build tiny ONNX graphs in a few lines, run them in onnxruntime and in keel.

    model = single_node_model("Softmax", [((2, 5), "float32")], {"axis": -1})
    feeds = random_feeds(model, seed=0)
    assert_close(keel_run(model, feeds)["y"], ort_run(model, feeds)["y"], 1e-5, 1e-6, "softmax")

A spec is (shape, dtype); dtype is anything numpy accepts ("float32", np.uint8, ...). A numpy array
in place of a spec becomes a constant initializer (Reshape's shape, Pad's pads), and None an
omitted optional input.
"""
from __future__ import annotations

import fcntl
import os
import pathlib
import tempfile

import numpy as np
import onnx
from onnx import helper, numpy_helper


def value_info(name: str, shape, dtype) -> onnx.ValueInfoProto:
    """shape None means unknown rank (shape inference or the compiler fills it in)."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


def _as_value_infos(values) -> list[onnx.ValueInfoProto]:
    """Accepts ValueInfoProtos or (name, shape, dtype) tuples."""
    return [v if isinstance(v, onnx.ValueInfoProto) else value_info(*v) for v in values]


def _as_initializers(initializers) -> list[onnx.TensorProto]:
    """Accepts a {name: array} dict or a sequence of TensorProtos."""
    if isinstance(initializers, dict):
        return [numpy_helper.from_array(np.asarray(a), n) for n, a in initializers.items()]
    return list(initializers)


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17,
               name: str = "test") -> onnx.ModelProto:
    """A model from nodes; inputs/outputs are ValueInfoProtos or (name, shape, dtype) tuples.

    The IR version is the one the opset needs, not onnx's newest (which onnxruntime rejects)."""
    graph = helper.make_graph(list(nodes), name, _as_value_infos(inputs),
                              _as_value_infos(outputs), _as_initializers(initializers))
    opsets = [helper.make_opsetid("", opset)]
    return helper.make_model(graph, opset_imports=opsets,
                             ir_version=helper.find_min_ir_version_for(opsets))


def single_node_model(op_type: str, input_specs, attrs: dict | None = None,
                      n_outputs: int = 1, output_dtype=None, opset: int = 17) -> onnx.ModelProto:
    """One node on inputs x0, x1, ... with outputs y (or y0, y1, ... when n_outputs > 1).

    Output shapes and dtypes come from onnx shape inference; output_dtype overrides the dtype
    where inference cannot tell (or when the test wants to pin it)."""
    inputs, initializers, names = [], [], []
    for i, spec in enumerate(input_specs):
        name = f"x{i}"
        if spec is None:
            name = ""
        elif isinstance(spec, np.ndarray):
            initializers.append(numpy_helper.from_array(spec, name))
        else:
            inputs.append(value_info(name, *spec))
        names.append(name)
    out_names = ["y"] if n_outputs == 1 else [f"y{i}" for i in range(n_outputs)]
    first_dtype = next((s[1] for s in input_specs if isinstance(s, tuple)), np.float32)
    dtype = output_dtype or first_dtype
    node = helper.make_node(op_type, names, out_names, **(attrs or {}))
    model = make_model([node], inputs, [(n, None, dtype) for n in out_names], initializers,
                       opset, name=op_type)
    return _with_inferred_outputs(model, output_dtype)


def _with_inferred_outputs(model: onnx.ModelProto, output_dtype) -> onnx.ModelProto:
    """Copies shape inference's output types onto the graph outputs, so they carry shapes."""
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for out in model.graph.output:
        vi = known.get(out.name)
        if vi is None or not vi.type.tensor_type.HasField("shape"):
            continue
        out.type.CopyFrom(vi.type)
        if output_dtype is not None:
            out.type.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(
                np.dtype(output_dtype))
    return model


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Inputs that need feeding (an input that is also an initializer has a default)."""
    init_names = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in init_names]


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs: uint8/int8 over their full range, other ints in [0, 4) (valid as
    indices into dims of 4+, and no overflow in arithmetic), bools 50/50, floats standard normal.
    """
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in _graph_inputs(model):
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        shape = []
        for d in vi.type.tensor_type.shape.dim:
            if not d.HasField("dim_value"):
                raise ValueError(f"input {vi.name}: dim {d.dim_param!r} is symbolic; "
                                 "random_feeds needs static shapes")
            shape.append(d.dim_value)
        feeds[vi.name] = _random_array(rng, dtype, shape)
    return feeds


def _random_array(rng: np.random.Generator, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if dtype in (np.uint8, np.int8):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 4, shape).astype(dtype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    raise ValueError(f"random_feeds: no generator for dtype {dtype}")


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reference: onnxruntime CPU, 1 thread, graph optimizations off (the plain ops, no
    fusions that would change rounding)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def keel_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], target: str = "cpu",
             **compile_kwargs) -> dict[str, np.ndarray]:
    """Compile, write the blob, load it with the runner and run: the whole user path."""
    # run() hands back fresh arrays that no later run touches: safe to return as they are.
    return keel_load(model, target, **compile_kwargs)[0].run(feeds)


def keel_load(model: onnx.ModelProto, target: str = "cpu", threads=(None,), **compile_kwargs):
    """Compile once and load the blob once per KEEL_THREADS value in `threads` (None: as the
    environment has it). The thread count is read at load, so this is how one compile serves
    runs at 1 and at 2 threads."""
    # Imported here so these helpers (and ORT-only tests) work without a compiler or runner.
    from compiler.blob import write_blob
    from compiler.pipeline import compile_model

    artifact = compile_model(model, target=target, **compile_kwargs)
    with tempfile.TemporaryDirectory(prefix="keel-test-") as tmp:
        path = pathlib.Path(tmp) / "model.blob"
        write_blob(artifact, path)
        return [_load_at(path, n) for n in threads]  # a mapping outlives its file


def compiled_blob(model, target: str = "cpu", **compile_kwargs) -> pathlib.Path:
    """The blob of `model` (or of {entry name: model}), compiled once per compiler version across
    test files and workers, cached beside the ONNX suite's blobs (keel/backend.py, keyed by the compile path's
    sources), under the hash of the model, the target and the options. Whole models cost tens of
    seconds each, and several test files run the same ones."""
    import hashlib
    import inspect

    from compiler.blob import write_blob
    from compiler.pipeline import compile_model
    from keel.backend import cache_dir

    # the options as compile_model sees them, defaults filled in: float16=False and no float16
    # argument are one blob
    options = inspect.signature(compile_model).bind(model, target=target, **compile_kwargs)
    options.apply_defaults()
    del options.arguments["model"]
    raw = b"".join(name.encode() + b"\0" + m.SerializeToString() for name, m in model.items()) \
        if isinstance(model, dict) else model.SerializeToString()  # several entries' models
    key = hashlib.sha256(raw + repr(sorted(options.arguments.items()))
                         .encode()).hexdigest()[:24]
    folder = cache_dir() or pathlib.Path(tempfile.mkdtemp(prefix="keel-test-"))
    path = folder / "models" / f"{key}.blob"
    path.parent.mkdir(parents=True, exist_ok=True)
    # A second worker that wants the same model waits for the first instead of compiling it
    # again (tests of one module are spread over workers); the lock dies with its process.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            write_blob(compile_model(model, target=target, **compile_kwargs), tmp)
            os.replace(tmp, path)  # atomic: a reader never sees half a blob
    return path


def _load_at(path, threads: int | None):
    from runner import Model

    before = os.environ.get("KEEL_THREADS")
    if threads is not None:
        os.environ["KEEL_THREADS"] = str(threads)
    try:
        return Model.load(path)
    finally:
        if before is None:
            os.environ.pop("KEEL_THREADS", None)
        else:
            os.environ["KEEL_THREADS"] = before


def assert_close(got, want, rtol: float, atol: float, what: str = "output") -> None:
    """np.testing-style check whose message names the worst element and both error measures."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {want.shape}")
    if got.dtype != want.dtype:
        raise AssertionError(f"{what}: dtype {got.dtype}, expected {want.dtype}")
    g64, w64 = got.astype(np.float64), want.astype(np.float64)
    same_nonfinite = (np.isnan(g64) & np.isnan(w64)) | ((g64 == w64) & np.isinf(w64))
    with np.errstate(invalid="ignore"):  # inf - inf where both are inf, which where() masks
        err = np.where(same_nonfinite, 0.0, np.abs(g64 - w64))
    err = np.nan_to_num(err, nan=np.inf)
    excess = err - (atol + rtol * np.abs(np.nan_to_num(w64)))
    if got.size == 0 or not (excess > 0).any():
        return
    worst = np.unravel_index(np.argmax(excess), got.shape)
    rel = err / np.maximum(np.abs(w64), np.finfo(np.float64).tiny)
    where = tuple(int(i) for i in worst)
    raise AssertionError(
        f"{what}: {int((excess > 0).sum())}/{got.size} elements outside rtol={rtol} "
        f"atol={atol}; max abs err {err.max():.3g}, max rel err {rel.max():.3g}; worst at "
        f"{where}: got {got[worst]!r}, expected {want[worst]!r}")


def hostile_floats(dtype=np.float32, seed: int = 0) -> np.ndarray:
    """Inputs where float math goes wrong: four per decade over the type's whole range, both
    signs, subnormals, +-0, +-inf, NaN, the values next to multiples of pi/2 (where sin and cos
    cancel; k up to 2^40, and the float32 worst cases of that, 16367173 * 2^72 and
    10741887 * 2^11), next to 1 (acosh, atanh) and to ln(max) (sinh, cosh), and random bit
    patterns."""
    info, rng = np.finfo(dtype), np.random.default_rng(seed)
    decades = 10.0 ** np.arange(np.log10(info.smallest_subnormal), np.log10(info.max), 0.25)
    k = np.concatenate([np.arange(1, 400), rng.integers(400, 2**40, 400)]).astype(np.float64)
    near = np.concatenate([k * (np.pi / 2), [16367173 * 2.0**72, 10741887 * 2.0**11]])
    near = near[near < info.max].astype(dtype)
    ln_max = np.float64(np.log(info.max))
    one = np.float64(1.0)
    edges = np.array([0, info.smallest_subnormal, info.tiny, info.max, np.inf, one, ln_max,
                      ln_max * 1.005, 0.5, np.pi], dtype)
    with np.errstate(over="ignore"):  # the step up from max
        edges = np.concatenate([edges, np.nextafter(edges, dtype(np.inf)),
                                np.nextafter(edges, dtype(0)), near, np.nextafter(near, dtype(0))])
    bits = rng.integers(0, 2 ** info.bits, 2000, dtype=np.uint64)
    random = bits.astype(f"uint{info.bits}").view(dtype)
    x = np.concatenate([decades.astype(dtype), edges, random[np.isfinite(random)]]).astype(dtype)
    return np.concatenate([x, -x, np.array([np.nan], dtype)])


def ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|got - exact| in units in the last place of got's type at the exact value (subnormal
    spacing below the smallest normal); 0 where got is exact rounded to its type (an overflow
    to inf, an underflow to 0, the same NaN), inf where only one of them is non-finite."""
    got, dt = np.asarray(got), np.asarray(got).dtype
    g, e = got.astype(np.float64), np.asarray(exact, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        rounded = e.astype(dt)
        err = np.abs(g - e) / np.spacing(np.abs(rounded)).astype(np.float64)
    same = (np.isnan(g) & np.isnan(e)) | (got == rounded)
    return np.where(same, 0.0, np.nan_to_num(err, nan=np.inf))
