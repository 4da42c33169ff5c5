"""Run the OpenCL C that keel renders for `--target qcom --float16` on the host, in IEEE half.

No CI device has cl_khr_fp16, so the qcom kernels are built for the host with clang's `_Float16`
(sim/qcom/hostcl.py, the same executor the mock KGSL uses for half programs). `run(artifact, feeds)`
executes an artifact's launches in order over host memory laid out as the blob says (arena,
weights, io slots) and returns the outputs; `main` measures a model's fp16 error.
"""
from __future__ import annotations

import ctypes
import tempfile
from pathlib import Path

import numpy as np

from sim.qcom.hostcl import CLANG, Image, build  # noqa: F401 (CLANG: tests name the tool they need)

def _memory(artifact, feeds: dict) -> tuple[dict, dict, list]:
    """Host arrays for every region, and the address of every buffer."""
    arena = np.zeros(artifact.arena_bytes + 64, np.uint8)
    weights = np.frombuffer(artifact.weights, np.uint8).copy() if artifact.weights else arena[:0]
    slots = {b.slot: np.ascontiguousarray(feeds[b.name], b.dtype) for b in artifact.inputs}
    outs = {b.name: np.zeros(b.shape, b.dtype) for b in artifact.outputs}
    slots.update({b.slot: outs[b.name] for b in artifact.outputs})
    base = {"arena": arena.ctypes.data, "weights": weights.ctypes.data}
    addr = {b.id: base[b.region] + b.offset if b.region in base else slots[b.slot].ctypes.data
            for b in artifact.buffers}
    return addr, outs, [arena, weights, slots]


def run(artifact, feeds: dict) -> dict:
    """Execute every launch of a qcom artifact on the host in half; returns the outputs."""
    src = artifact.programs.decode()
    addr, outs, keep = _memory(artifact, feeds)
    images = {b.id: Image(addr[b.id], b.image.width, b.image.height, b.image.pitch,
                          b.dtype == "float16") for b in artifact.buffers if b.image}
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(src, Path(tmp))
        for ln in artifact.launches:
            ptrs = [ctypes.addressof(images[b]) if i and b in images else addr[b]
                    for i, b in enumerate(ln.args)]
            gs = list(ln.global_size) + [1] * (3 - len(ln.global_size))
            ls = list(ln.local_size or (1, 1, 1)) + [1] * (3 - len(ln.local_size or (1, 1, 1)))
            getattr(lib, f"run_{ln.kernel}")((ctypes.c_void_p * len(ptrs))(*ptrs),
                                             (ctypes.c_int * 3)(*gs), (ctypes.c_int * 3)(*ls))
    del keep
    return outs


def main() -> None:
    """python tests/halfhost.py model.onnx: the model's fp16 error on the Adreno's arithmetic,
    against onnxruntime, on seeded random inputs (uint8 inputs uniform over 0..255)."""
    import argparse

    import onnx

    from compiler.pipeline import compile_model
    from tests.graphs import ort_run

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("model")
    model = onnx.load(ap.parse_args().model)
    rng, feeds = np.random.default_rng(0), {}
    inits = {i.name for i in model.graph.initializer}
    for vi in (v for v in model.graph.input if v.name not in inits):
        dtype = onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        shape = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        feeds[vi.name] = (rng.integers(0, 256, shape) if dtype == np.uint8
                          else rng.standard_normal(shape)).astype(dtype)
    got = run(compile_model(model, target="qcom", float16=True), feeds)
    for name, want in ort_run(model, feeds).items():
        err = np.abs(got[name].astype(np.float64) - want)
        print(f"{name}: max abs error {err.max():.2e}, |reference| up to {np.abs(want).max():.3g}, "
              f"{int((~np.isfinite(got[name])).sum())} non-finite")


if __name__ == "__main__":
    main()
