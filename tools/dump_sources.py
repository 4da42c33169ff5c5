"""Every kernel's rendered source and every build's buffer table, for a set of models on every
target, into a directory: a refactor of the compiler diffs two dumps (before and after) to show
the output did not change.

    python tools/dump_sources.py OUT_DIR [--models openpilot,toy,...] [--targets cpu,qcom,...]

No C compiler runs: the toolchain's build steps are replaced by no-ops, so the dump is the
renderers' text (C, OpenCL), the buffers, launches and the weights' digest of each build.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from compiler import toolchain  # noqa: E402
from compiler.pipeline import compile_model  # noqa: E402
from compiler.renderers.c import CRenderer  # noqa: E402
from compiler.renderers.opencl import OpenCLRenderer  # noqa: E402

TARGETS = ("cpu", "cpu-aarch64", "opencl", "qcom", "amd", "dsp")


def _split():
    from models.modeld_step import step_entries
    from models.openpilot_split import make_policy, make_vision
    return step_entries(make_vision(), make_policy(), (512, 256), [(1928, 1208)], 4)


def _models() -> dict:
    from models.dm import make_dm
    from models.openpilot import make_openpilot, make_toy
    from models.quantized import dm as make_dm_int8
    from models.realworld import make_ocr
    return {"dm-int8": make_dm_int8, "openpilot": make_openpilot, "openpilot-fp16": lambda: make_openpilot(float16=True),
            "toy": make_toy, "dm": make_dm, "ocr": make_ocr, "modeld-split": _split}


def _capture() -> list[str]:
    """Patch the renderers to record each program text, and the toolchain to build nothing."""
    texts: list[str] = []
    for cls in (CRenderer, OpenCLRenderer):
        real = cls.render_program

        def render(self, *a, _real=real, **k):
            out = _real(self, *a, **k)
            texts.append(str(out))
            return out
        cls.render_program = render
    toolchain.build_shared = lambda source, *a, **k: b""
    toolchain.build_code_object = lambda source, *a, **k: b""
    toolchain.precompile = lambda *a, **k: None
    toolchain.cached_units = lambda *a, **k: {}
    return texts


def _table(art) -> dict:
    """A build's buffers and launches as plain data (io buffers: their io slot)."""
    return {"buffers": [[b.id, str(b.region), getattr(b, "slot", None), b.offset, b.nbytes,
                         b.dtype, list(b.shape), b.name, repr(b.image)] for b in art.buffers],
            "launches": [[ln.kernel, list(ln.args), list(ln.global_size),
                          ln.local_size and list(ln.local_size), ln.barrier]
                         for ln in art.launches],
            "arena": art.arena_bytes, "weights": hashlib.sha256(bytes(art.weights)).hexdigest(),
            "sections": list(art.weight_sections),
            "entries": [repr(e) for e in art.entries], "state": [repr(s) for s in art.state],
            "defaults": art.defaults}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--models", default=",".join(_models()))
    ap.add_argument("--targets", default=",".join(TARGETS))
    args = ap.parse_args(argv)
    texts, makers = _capture(), _models()
    os.makedirs(args.out, exist_ok=True)
    for name in args.models.split(","):
        model = makers[name]()
        for tgt in args.targets.split(","):
            t0, texts[:] = time.perf_counter(), []
            art = compile_model(model, target=tgt, float16=name.endswith("fp16"))
            for i, (a, text) in enumerate(zip([art, *art.variants], texts)):
                stem = os.path.join(args.out, f"{name}.{tgt}.{i}")
                with open(stem + ".src", "w") as f:
                    f.write(text)
                with open(stem + ".json", "w") as f:
                    json.dump(_table(a), f, indent=0)
            print(f"{name} {tgt}: {len(texts)} programs, {time.perf_counter() - t0:.1f} s",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
