"""Find the first ONNX node whose output diverges from onnxruntime inside a compiled model.

    python tools/bisect.py MODEL.onnx BLOB-or-TARGET [--inputs feeds.npz] [--perturb NODE]
                           [--input-shape NAME=d0,d1,...]... [--device D] [--json]

A debug build of MODEL (for the blob's target, or TARGET) exports every node's output as an extra
graph output, so every tensor the graph computes is realized and read back; it runs through the
runner on the device, onnxruntime runs the same model with the same tensors as outputs, and the
two are compared node by node in the debug build's launch order. The culprit is the first node
whose output diverges while every input it reads matches; its kernel is named from the blob's
provenance (from the debug build's when given a target). --perturb NODE adds a small error to one
node's output in the debug build: the tool must then name exactly that node.

A model with dynamic dims is bisected at the shapes the blob was compiled for (and with the
inputs it froze with --input-value, from its meta); given a target, at the --input-shape
bindings or the shapes of --inputs.

Exporting every node's output means the debug build fuses less than the shipped blob: a fault
that lives only in a fused kernel's epilogue shows as a divergence of the blob's outputs that the
debug build does not reproduce (the report says whether the blob's own outputs match too).
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import math  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import helper  # noqa: E402

from runner import BlobError, ConfigError, DeviceError, DeviceTimeout, InputError, Model  # noqa
from runner.blob import launch_nodes, read_blob  # noqa: E402
from runner.targets import TARGETS  # noqa: E402
from runner.files import read_regular  # noqa: E402
from tools.cli import Parser, report  # noqa: E402
from tools.compile import parse_shape  # noqa: E402
from tools.run import ToolError, frozen_feeds, load_feeds, random_feeds  # noqa: E402

# (rtol, atol) per dtype kind and size: an element diverges when |keel - ort| > atol + rtol*|ort|.
# float32: keel reassociates sums (register tiles, FMA, Winograd regrouping) and evaluates exp and
# sigmoid with its own polynomials; each op's rounding differs by a few ulp (1e-7 relative) and a
# light net compounds that to ~1e-5, while a real bug (a wrong index, a lost term) is O(1) or at
# least O(1/K) of a K-term sum. 1e-3 relative (1e-4 absolute near zero) sits between the two.
# float16 has 2^-11 = 4.9e-4 spacing, so a few roundings reach 1e-3: ten times wider. Integers
# and bools are exact.
TOLERANCE = {"f8": (1e-3, 1e-4), "f4": (1e-3, 1e-4), "f2": (1e-2, 1e-3)}
EXACT = (0.0, 0.0)
# --perturb adds PERTURB * (1 + max|x|) to every element of the node's output: 1% of the tensor's
# scale, ten times the float32 tolerance, so the node diverges without drowning its consumers.
PERTURB = 1e-2


def tolerance(dtype: np.dtype) -> tuple[float, float]:
    return TOLERANCE.get(f"{dtype.kind}{dtype.itemsize}", EXACT)


def node_name(node: onnx.NodeProto, i: int) -> str:
    """As the compiler names it in provenance (compiler/onnx/load.py:node_name)."""
    return node.name or next((o for o in node.output if o), f"#{i}")


def tensor_outputs(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Every node output that shape inference types as a tensor, by name, in node order."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    known = {vi.name: vi for vi in [*g.value_info, *g.output, *g.input]}
    return {o: known[o] for n in g.node for o in n.output
            if o in known and known[o].type.HasField("tensor_type")}


def debug_model(model: onnx.ModelProto, perturb: tuple[str, float] | None = None) -> onnx.ModelProto:
    """`model` with every node's tensor output also a graph output. perturb (node name, delta):
    that node writes `<out>.unperturbed`, and an Add of delta writes `<out>` for every reader."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    outs = tensor_outputs(model)
    have = {vi.name for vi in m.graph.output}
    m.graph.output.extend(vi for name, vi in outs.items() if name not in have)
    if perturb is None:
        return m
    name, delta = perturb
    nodes = list(m.graph.node)
    i = next(i for i, n in enumerate(nodes) if node_name(n, i) == name)
    out = nodes[i].output[0]
    raw = f"{out}.unperturbed"
    nodes[i].output[0] = raw
    dt = helper.tensor_dtype_to_np_dtype(outs[out].type.tensor_type.elem_type)
    c = helper.make_tensor(f"{out}.delta", outs[out].type.tensor_type.elem_type, [],
                           [np.asarray(delta, dt).item()])
    # a Constant node, not an initializer: before IR version 4 every initializer must also be
    # a graph input, and older real models (onnx's light models: IR 3) are exactly those
    m.graph.node.insert(i + 1, helper.make_node("Constant", [], [c.name], value=c,
                                                name=f"{name}.delta"))
    m.graph.node.insert(i + 2, helper.make_node("Add", [raw, c.name], [out],
                                                name=f"{name}.perturb"))
    return m


def check_perturb(model: onnx.ModelProto, name: str) -> None:
    outs = tensor_outputs(model)
    for i, n in enumerate(model.graph.node):
        if node_name(n, i) == name:
            vi = outs.get(n.output[0])
            dt = vi and helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            if dt is None or dt.kind != "f":
                raise ToolError(f"--perturb {name}: its first output must be a float tensor, "
                                f"got {dt}")
            return
    names = [node_name(n, i) for i, n in enumerate(model.graph.node)]
    raise ToolError(f"--perturb {name}: no such node; nodes are {names[:10]}"
                    f"{' ...' if len(names) > 10 else ''}")


def ort_run(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """onnxruntime with its graph optimizations off: the reference computes each node as ONNX
    defines it, not a fused approximation."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def keel_run(model: onnx.ModelProto, target: str, device: str | None, feeds: dict,
             folder: str) -> tuple[dict[str, np.ndarray], list]:
    """Compile and run the debug build; (outputs, its per-launch (kernel, node names))."""
    from compiler.blob import write_blob
    from compiler.errors import CompileError
    from compiler.pipeline import compile_model
    path = os.path.join(folder, "debug.blob")
    try:
        write_blob(compile_model(model, target=target), path)
    except CompileError as e:
        raise ToolError(f"debug build: {e}") from None
    m = Model.load(path, device)
    try:
        out = {k: np.array(v) for k, v in m.run(feeds).items()}
        return out, kernels_of(m.blob)
    finally:
        m.close()


def kernels_of(blob) -> list[tuple[str, list[str]]]:
    return [(ln.kernel, [n for n, _ in nodes]) for ln, nodes in zip(blob.launches,
                                                                   launch_nodes(blob))]


def error(got: np.ndarray, want: np.ndarray) -> tuple[float, bool]:
    """(max |got - want|, diverges): NaN against NaN matches, NaN against a number diverges."""
    if got.shape != want.shape:
        return math.inf, True
    g, w = got.astype(np.float64), want.astype(np.float64)
    nan = np.isnan(g) != np.isnan(w)
    both = ~np.isnan(g) & ~np.isnan(w)
    diff = np.abs(g - w, where=both, out=np.zeros_like(g))
    diff[np.isinf(diff)] = math.inf  # inf - inf is NaN: mark a mismatch of infinities
    rtol, atol = tolerance(want.dtype)
    bad = nan.any() or bool((diff > atol + rtol * np.abs(np.where(both, w, 0))).any())
    return float(diff.max(initial=0.0)) if not nan.any() else math.inf, bad


def execution_order(model: onnx.ModelProto, launches: list) -> list[int]:
    """Node indices in the order the debug build computes them: by the first launch that computes
    a node; a node in no launch (an Identity, a folded constant) keeps its place after the node
    before it in the model."""
    first: dict[str, int] = {}
    for i, (_, names) in enumerate(launches):
        for n in names:
            first.setdefault(n, i)
    key, last = [], -1
    for i, n in enumerate(model.graph.node):
        last = first.get(node_name(n, i), last)
        key.append((last, i))
    return [i for _, i in sorted(key)]


def compare(model: onnx.ModelProto, keel: dict, ref: dict, order: list[int]) -> list[dict]:
    """One record per node with a compared output, in `order`."""
    errs: dict[str, tuple[float, bool]] = {}
    rows = []
    for i in order:
        node = model.graph.node[i]
        outs = [o for o in node.output if o in ref and o in keel]
        if not outs:
            continue
        for o in outs:
            errs[o] = error(keel[o], ref[o])
        inputs = {x: errs[x][0] if math.isfinite(errs[x][0]) else None
                  for x in node.input if x in errs}
        worst = max(errs[o][0] for o in outs)
        rows.append({"node": node_name(node, i), "op_type": node.op_type,
                     # JSON has no infinity: None is a NaN where onnxruntime has a number, or
                     # another shape
                     "max_abs_err": worst if math.isfinite(worst) else None,
                     "diverges": any(errs[o][1] for o in outs),
                     "inputs_match": not any(errs[x][1] for x in node.input if x in errs),
                     "input_errors": inputs})
    return rows


def kernel_of(name: str, launches: list) -> str | None:
    return next((f"{i} {k}" for i, (k, names) in enumerate(launches) if name in names), None)


def bisect(model_path: str, blob_or_target: str, feeds: dict | None = None,
           perturb: str | None = None, device: str | None = None,
           input_shapes: dict | None = None) -> dict:
    try:
        model = onnx.load_from_string(read_regular(model_path))
        onnx.external_data_helper.load_external_data_for_model(
            model, os.path.dirname(os.path.abspath(model_path)))
    except OSError as e:
        raise ToolError(f"{e.filename or model_path}: {e.strerror or e}") from None
    except Exception as e:  # protobuf raises several unrelated types for garbage input
        raise ToolError(f"{model_path}: not a readable ONNX model ({type(e).__name__}: {e})") \
            from None
    blob = read_blob(blob_or_target) if blob_or_target.endswith(".blob") else None
    target = blob.variant if blob else blob_or_target  # the build that ran here, alone
    if target not in TARGETS:
        raise ToolError(f"{blob_or_target}: expected a .blob file or a target, one of "
                        f"{sorted(TARGETS)}")
    if feeds is not None:  # against the model's own dims, before the feeds fix dynamic ones
        _checked_feeds(model, feeds)
    model = static_model(model, _shapes(blob, input_shapes, feeds),
                         frozen_feeds(blob.manifest["meta"]) if blob else {})
    if perturb is not None:
        check_perturb(model, perturb)
    feeds = _checked_feeds(model, feeds) if feeds is not None else _feeds(model)
    ref = ort_run(debug_model(model), feeds)
    delta = None
    if perturb is not None:
        out = model.graph.node[_index(model, perturb)].output[0]
        delta = (perturb, PERTURB * (1 + float(np.nanmax(np.abs(ref[out]), initial=0))))
    with tempfile.TemporaryDirectory(prefix="keel-bisect-") as folder:
        keel, launches = keel_run(debug_model(model, delta), target, device, feeds, folder)
    rows = compare(model, keel, ref, execution_order(model, launches))
    rep = _report(rows, kernels_of(blob) if blob else launches, target, perturb, blob is not None)
    if blob is not None:
        rep["blob_outputs_diverge"] = _blob_diverges(blob_or_target, device, feeds, ref)
    return rep


def _shapes(blob, given: dict | None, feeds: dict | None) -> dict[str, tuple[int, ...]]:
    """The input shapes to bisect at: the blob's own, else --input-shape, else the feeds'."""
    if blob is not None:
        return {b.name: tuple(b.shape) for b in blob.inputs}
    return {**{k: v.shape for k, v in (feeds or {}).items()}, **(given or {})}


def static_model(model: onnx.ModelProto, shapes: dict, frozen: dict) -> onnx.ModelProto:
    """`model` as the blob was compiled from it: its inputs' dims fixed to `shapes` and its
    frozen inputs turned into initializers, so shape inference types every node output and the
    debug build needs no bindings."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = [vi for vi in m.graph.input if vi.name not in frozen]
    for vi in keep:
        if vi.name in shapes and vi.type.HasField("tensor_type"):
            dims = vi.type.tensor_type.shape
            dims.Clear()
            for d in shapes[vi.name]:
                dims.dim.add().dim_value = int(d)
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.initializer.extend(onnx.numpy_helper.from_array(v, n) for n, v in frozen.items())
    return m


def _blob_diverges(path: str, device: str | None, feeds: dict, ref: dict) -> list[str]:
    """The blob's own outputs that diverge: a fault of its fused kernels that the debug build,
    fused differently, does not reproduce shows here."""
    m = Model.load(path, device)
    try:
        out = m.run(feeds)
        return [k for k, v in out.items() if error(np.asarray(v), ref[k])[1]]
    finally:
        m.close()


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Seeded random inputs, as tools/run.py makes them."""
    init = {i.name for i in model.graph.initializer}
    specs = {}
    for vi in model.graph.input:
        if vi.name in init:
            continue
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param or "?"
                for d in t.shape.dim]
        if not all(isinstance(d, int) and d >= 0 for d in dims):
            raise ToolError(f"input {vi.name!r} has dynamic dims {dims}; give a blob, "
                            f"--input-shape {vi.name}=d0,d1,... or --inputs feeds.npz")
        specs[vi.name] = (tuple(dims), helper.tensor_dtype_to_np_dtype(t.elem_type))
    return random_feeds(specs)


def _checked_feeds(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """--inputs against the model's inputs (names, dtypes, static dims), so a wrong array is
    one line naming it rather than onnxruntime's traceback."""
    init = {i.name for i in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name not in feeds:
            if vi.name in init:
                continue  # its default
            raise ToolError(f"--inputs has no array {vi.name!r}; it has {sorted(feeds)}")
        t, arr = vi.type.tensor_type, feeds[vi.name]
        want = helper.tensor_dtype_to_np_dtype(t.elem_type)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if arr.dtype != want or arr.ndim != len(dims) or \
                any(d is not None and d != n for d, n in zip(dims, arr.shape)):
            raise ToolError(f"--inputs {vi.name!r}: expected {want} of shape "
                            f"{['?' if d is None else d for d in dims]}, got {arr.dtype} "
                            f"{list(arr.shape)}")
    extra = sorted(set(feeds) - {vi.name for vi in model.graph.input})
    if extra:
        raise ToolError(f"--inputs has arrays {extra} that are no input of the model")
    return feeds


def _index(model: onnx.ModelProto, name: str) -> int:
    return next(i for i, n in enumerate(model.graph.node) if node_name(n, i) == name)


def _report(rows: list[dict], launches: list, target: str, perturb: str | None,
            from_blob: bool) -> dict:
    culprit = next((r for r in rows if r["diverges"] and r["inputs_match"]), None)
    first = None
    if culprit is not None:
        first = {"node": culprit["node"], "op_type": culprit["op_type"],
                 "max_abs_err": culprit["max_abs_err"],
                 "kernel": kernel_of(culprit["node"], launches),
                 "input_errors": culprit["input_errors"]}
    return {"target": target, "perturbed": perturb, "kernels_from": "blob" if from_blob else
            "debug build", "nodes_compared": len(rows),
            "nodes_diverging": sum(r["diverges"] for r in rows), "first_divergence": first,
            "nodes": [{k: r[k] for k in ("node", "op_type", "max_abs_err", "diverges")}
                      for r in rows]}


def _fmt(err: float | None) -> str:
    return "NaN or shape mismatch" if err is None else f"{err:.3g}"


def print_text(rep: dict) -> None:
    first = rep["first_divergence"]
    print(f"target {rep['target']}: {rep['nodes_compared']} nodes compared with onnxruntime"
          + (f", node {rep['perturbed']!r} perturbed" if rep["perturbed"] else ""))
    if first is None:
        print("no divergence; largest error per node:")
        for r in rep["nodes"]:
            print(f"  {r['node']:40s} {r['op_type']:20s} {_fmt(r['max_abs_err'])}")
        return
    print(f"first divergence: node {first['node']!r} ({first['op_type']}), max abs error "
          f"{_fmt(first['max_abs_err'])}, in kernel {first['kernel'] or '(none)'} "
          f"(kernels from the {rep['kernels_from']})")
    for name, err in first["input_errors"].items():
        print(f"  input {name!r}: max abs error {_fmt(err)} (matches)")
    print(f"{rep['nodes_diverging']} of {rep['nodes_compared']} nodes diverge in all")


def _print_blob(rep: dict) -> None:
    bad = rep.get("blob_outputs_diverge")
    if bad:
        print(f"the blob's own outputs {bad} diverge from onnxruntime")
    elif bad is not None:
        print("the blob's own outputs match onnxruntime")


def main() -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="the ONNX model")
    ap.add_argument("blob", help="a blob compiled from it, or a target name")
    ap.add_argument("--inputs", help=".npz with one array per input (default: seeded random)")
    ap.add_argument("--perturb", metavar="NODE", help="add a small error to NODE's output")
    ap.add_argument("--input-shape", action="append", type=parse_shape, default=[],
                    metavar="NAME=d0,d1,...",
                    help="bind an input's dynamic dims, given a target (repeatable)")
    ap.add_argument("--device", help="runner device (default: the target's)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `bisect.py ... --json | head` ends quietly
    try:
        feeds = load_feeds(args.inputs) if args.inputs else None
        rep = bisect(args.model, args.blob, feeds, args.perturb, args.device,
                     dict(args.input_shape))
    except (ToolError, BlobError, ConfigError, InputError, DeviceError, DeviceTimeout,
            ValueError) as e:
        print(f"bisect: {e}", file=sys.stderr)
        return 2
    return report(rep, args.json, lambda r: (print_text(r), _print_blob(r)))


if __name__ == "__main__":
    sys.exit(main())
