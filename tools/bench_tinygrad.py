"""keel against tinygrad on this machine's OpenCL device (PoCL in CI), in one process.

    python tools/bench_tinygrad.py [model.onnx] [--runs 20] [--no-images] [--json]
    python tools/bench_tinygrad.py [model.onnx] --count-on NULL:OPENCL:ARCH [--json]

tinygrad is optional: it is not a keel dependency and only this tool imports it
(`pip install tinygrad`; 0.14.0 measured). Without it the tool says so and exits with status 2.

tinygrad runs the ONNX model through its own ONNX frontend (`tinygrad.nn.onnx.OnnxRunner`) under
`TinyJit` (prune=True, as openpilot compiles it: kernels on weights alone run once at capture),
with openpilot's flags DEV=CL IMAGE=1 FLOAT16=1 unless the environment sets them. Its kernel
count is the kernel calls its JIT captured. keel runs the same model compiled `--target opencl
--float16`, and the same with images on (`compile_model(images=True)`; the opencl target's
images are opt-in), through `runner.Model` on device "opencl". Without a model it builds the
openpilot-shaped model (models/openpilot.py).

Every timed run writes the inputs, runs the model and reads the output back, for both. Runs
alternate in blocks of 5 between the contestants, so all see the same machine load; medians.

--count-on counts tinygrad's kernels for a GPU this machine lacks, on tinygrad's NULL device
(scheduled and rendered for the named renderer and arch, nothing run; no keel, no timing).
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import statistics
import sys
import tempfile

# the repository root, so the tool runs from a checkout without installing keel
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from compiler.blob import write_blob  # noqa: E402
from compiler.pipeline import compile_model  # noqa: E402
from runner import Model  # noqa: E402
from tools.cli import Parser, positive_int, report, timed  # noqa: E402
from tools.run import random_feeds  # noqa: E402

FLAGS = {"DEV": "CL", "IMAGE": "1", "FLOAT16": "1"}  # openpilot's tinygrad flags
BLOCK = 5
WARMUP = 3  # TinyJit captures on its second call and replays from the third
RUN_DEADLINE_MS = 60_000


class Missing(Exception):
    pass


def load_tinygrad():
    """tinygrad's modules, with openpilot's flags set first (tinygrad reads them at import)."""
    for k, v in FLAGS.items():
        os.environ.setdefault(k, v)
    # tinygrad builds its host-side helper kernels with `$CC` (default "clang"); Debian names
    # the compiler clang-19, keel's own toolchain
    if "CC" not in os.environ and not shutil.which("clang") and shutil.which("clang-19"):
        os.environ["CC"] = "clang-19"
    try:
        from tinygrad import Device, Tensor, TinyJit
        from tinygrad.nn.onnx import OnnxRunner
        from tinygrad.uop.ops import Ops
    except ImportError as e:
        raise Missing(f"tinygrad is not installed ({e}); it is optional, only this tool uses "
                      "it: pip install tinygrad") from None
    return Device, Tensor, TinyJit, OnnxRunner, Ops


def captured(path: str, feeds: dict, device: str | None = None):
    """tinygrad's jitted run of the model (feeds -> output array), warmed up, and each kernel
    call its JIT replays, by program (a program called twice is one kernel, two launches).
    device: load the graph on the CPU, then move it there (count_on)."""
    Device, Tensor, TinyJit, OnnxRunner, Ops = load_tinygrad()
    if device is None:
        onnx_run = OnnxRunner(path)
    else:
        onnx_run = _on_cpu_then(path, device, OnnxRunner)
    jit = TinyJit(lambda **kw: next(iter(onnx_run(kw).values())).cast("float32").realize(),
                  prune=True)

    def run():
        return jit(**{k: Tensor(v, device=device).realize() for k, v in feeds.items()}).numpy()
    for _ in range(WARMUP):
        out = run()
    return run, out, [c.src[0] for c in jit.captured.linear.src
                      if c.op is Ops.CALL and c.src[0].op is Ops.PROGRAM]


def _on_cpu_then(path: str, device: str, OnnxRunner):
    """The graph parsed on the CPU, the constants it needs as Python values (Reshape's shape)
    read there, then moved: a NULL device stores nothing to read them back from."""
    from tinygrad.helpers import Context
    from tinygrad.nn import onnx as tg_onnx
    with Context(DEV="CPU"):
        onnx_run = OnnxRunner(path)
        for node in onnx_run.graph_nodes:
            for i, name in enumerate(node.inputs):
                t = onnx_run.graph_values.get(name)
                needed = i in tg_onnx.required_input_python_consts.get(node.op, ()) or (
                    node.op == "Gather" and i == 1 and name in onnx_run.const_names)
                if needed and hasattr(t, "tolist"):
                    onnx_run._python_const_cache[name] = tg_onnx._to_python_const(t)
    return onnx_run.to(device)


def tinygrad_facts(launches: list) -> dict:
    from tinygrad import Device
    exts = set(getattr(Device[Device.DEFAULT], "device_exts", ()))
    return {"version": importlib.metadata.version("tinygrad"), "device": Device.DEFAULT,
            "flags": {k: os.environ[k] for k in FLAGS},
            "launches": len(launches), "kernels": len(set(launches)),
            # without cl_khr_fp16 tinygrad stores half as ushort and converts with integer ops;
            # without cl_khr_image2d_from_buffer IMAGE=1 makes no images
            "half": "native" if "cl_khr_fp16" in exts else "emulated (ushort storage)",
            "images": "cl_khr_image2d_from_buffer" in exts}


def count_on(path: str, dev: str) -> dict:
    """Kernel counts for a device this machine lacks: tinygrad's NULL device schedules and
    renders for the renderer and arch DEV names, and runs nothing (NULL:OPENCL:cl_khr_fp16,
    IMAGE_PITCH_ALIGNMENT=64 is an OpenCL GPU with half arithmetic and images: the Adreno's)."""
    # JIT=2: the JIT replays kernel calls one by one, not batched into the NULL device's graph
    os.environ.update(DEV=dev, NULL_ALLOW_COPYOUT="1", JIT="2")
    import onnx
    from onnx import helper
    graph = onnx.load(path, load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    feeds = {vi.name: np.zeros([d.dim_value for d in vi.type.tensor_type.shape.dim],
                               helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
             for vi in graph.input if vi.name not in inits}
    load_tinygrad()
    _, _, launches = captured(path, feeds, dev.split(":")[0])
    return {"launches": len(launches), "kernels": len(set(launches)), "dev": dev,
            "flags": {k: os.environ[k] for k in FLAGS},
            "version": importlib.metadata.version("tinygrad")}


def keel_model(path: str, images: bool, tmp: str) -> Model:
    blob = os.path.join(tmp, f"keel-opencl-fp16{'-images' if images else ''}.blob")
    write_blob(compile_model(path, target="opencl", float16=True, images=images), blob)
    model = Model.load(blob, "opencl")
    # PoCL runs kernels on the host's cores: on a busy machine a run can take seconds, well past
    # the runner's default deadline, which is meant for real GPUs
    model.timeout_ms = RUN_DEADLINE_MS
    return model


def keel_runner(model: Model, feeds: dict):
    out = {n: np.empty(s, d) for n, (s, d) in model.outputs.items()}

    def run():
        model.run(feeds, out=out)
        return next(iter(out.values()))
    for _ in range(WARMUP):
        run()
    return run


def bench(path: str, runs: int, images: bool, tmp: str) -> dict:
    load_tinygrad()  # before compiling: a missing tinygrad ends the tool at once
    models = {"keel": keel_model(path, False, tmp)}
    if images:
        models["keel images"] = keel_model(path, True, tmp)
    try:
        feeds = random_feeds(models["keel"].inputs)
        tg_run, tg_out, launches = captured(path, feeds)
        facts = tinygrad_facts(launches)
        runs_of = {"tinygrad": tg_run}
        result = {"tinygrad": facts, "keel": {}}
        for name, m in models.items():
            runs_of[name] = keel_runner(m, feeds)
            diff = np.abs(runs_of[name]().astype(np.float64) - tg_out)
            result["keel"][name] = {"kernels": len(m.blob.manifest["programs"]),
                                    "launches": len(m.blob.launches),
                                    "max_abs_diff_vs_tinygrad": float(diff.max())}
        times = {k: [] for k in runs_of}
        for _ in range(max(runs // BLOCK, 1)):
            for k, fn in runs_of.items():
                times[k] += timed(fn, BLOCK)
    finally:
        for m in models.values():
            m.close()
    result["median_ms"] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    result["runs"] = len(times["tinygrad"])
    result["output_max_abs"] = float(np.max(np.abs(tg_out)))
    return result


def print_text(r: dict) -> None:
    tg = r["tinygrad"]
    flags = " ".join(f"{k}={v}" for k, v in tg["flags"].items())
    print(f"tinygrad {tg['version']} ({flags}) on {tg['device']}: {tg['kernels']} kernels, "
          f"{tg['launches']} launches; "
          f"half {tg['half']}, images {'on' if tg['images'] else 'off (no cl_khr_image2d_from_buffer)'}")
    for name, k in r["keel"].items():
        print(f"{name}: {k['kernels']} kernels, {k['launches']} launches, max abs diff against "
              f"tinygrad {k['max_abs_diff_vs_tinygrad']:.3g} (outputs up to "
              f"{r['output_max_abs']:.3g})")
    base = r["median_ms"]["tinygrad"]
    print(f"median of {r['runs']} runs each, interleaved in blocks of {BLOCK}:")
    for name, ms in r["median_ms"].items():
        print(f"  {name:12s} {ms:9.2f} ms  {ms / base:5.2f}x tinygrad")


def print_count(r: dict) -> None:
    flags = " ".join(f"{k}={v}" for k, v in r["flags"].items() if k != "DEV")
    print(f"tinygrad {r['version']} ({flags}) for {r['dev']}: {r['kernels']} kernels, "
          f"{r['launches']} launches (scheduled and rendered on tinygrad's NULL device, not run)")


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="ONNX model (default: the openpilot-shaped model)")
    ap.add_argument("--runs", type=positive_int, default=20, help="timed runs per contestant")
    ap.add_argument("--no-images", action="store_true", help="skip keel's images-on blob")
    ap.add_argument("--count-on", metavar="DEV", help="only count tinygrad's kernels for DEV, "
                    "a tinygrad NULL device, e.g. NULL:OPENCL:cl_khr_fp16,IMAGE_PITCH_ALIGNMENT=64")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    if args.count_on is not None and not args.count_on.startswith("NULL:"):
        ap.error(f"--count-on: expected a tinygrad NULL device (NULL:RENDERER:ARCH), got "
                 f"{args.count_on!r}")
    with tempfile.TemporaryDirectory(prefix="keel-bench-tinygrad-") as tmp:
        path = args.model
        if path is None:
            from models.openpilot import make_openpilot
            import onnx
            path = os.path.join(tmp, "openpilot.onnx")
            onnx.save(make_openpilot(), path)
        try:
            if args.count_on:
                return report(count_on(path, args.count_on), args.json, print_count)
            result = bench(path, args.runs, not args.no_images, tmp)
        except Missing as e:
            print(f"bench_tinygrad: {e}", file=sys.stderr)
            return 2
    return report(result, args.json, print_text)


if __name__ == "__main__":
    sys.exit(main())
