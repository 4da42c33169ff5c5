"""What the modeld warp's gather reads from the NV12 camera frame, for openpilot-like transforms:
what docs/modeld.md ("The warp's gather") argues the texture path from.

    python tools/warp_lines.py [--camera 1928x1208] [--transforms 20] [--blob modeld_qcom.blob]

Per camera frame: the samples the six planes take (one byte each), the distinct bytes and the
distinct 64-byte lines they touch (a buffer load moves a whole line from memory into the GPU's
cache), against the whole buffer; the median over random calibrated transforms
(models/modeld_ref.py random_tfm). With --blob, the rendered warp kernels' reads of the frame
and their integer division and modulo counts (an image read takes (x, y); where the compiler
cannot prove the index is row * stride + column, it divides: index % stride, index / stride).
"""
from __future__ import annotations

import os
import re
import sys

import numpy as np

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from models import modeld_ref as ref  # noqa: E402
from models.modeld_step import parse_size  # noqa: E402
from runner.blob import read_blob  # noqa: E402
from tools.cli import Parser, report  # noqa: E402

# a statement computing an integer (the perspective's float divisions are the same on either path)
INT_LINE = re.compile(r"^ *(?:u?(?:char|short|int|long)\d*) .*$", re.M)
LINE = 64  # bytes: the a6xx UCHE / L2 line a buffer load fills
MODEL = (512, 256)


def touched(cam: tuple[int, int], transforms: int, seed: int = 0) -> dict:
    """The warp's source addresses, from the reference warp run over a frame of addresses."""
    nv12, rng = ref.nv12_layout(*cam), np.random.default_rng(seed)
    addresses = np.arange(nv12.size, dtype=np.int64)
    rows = []
    for _ in range(transforms):
        at = ref.prepare_frame(addresses, ref.random_tfm(rng, cam, MODEL), nv12, *MODEL)[0]
        rows.append((at.size, np.unique(at).size, np.unique(at // LINE).size * LINE))
    samples, distinct, lines = (int(np.median(c)) for c in zip(*rows))
    return {"camera": f"{cam[0]}x{cam[1]}", "frame_bytes": nv12.size, "samples": samples,
            "distinct_bytes": distinct, "line_bytes": lines, "transforms": transforms}


def kernel_reads(path: str) -> list[dict]:
    """Per warp kernel of the blob (one that reads a camera frame): its frame reads, and the
    integer / and % it computes (in its image coordinates or elsewhere)."""
    blob = read_blob(path)
    src, out = bytes(blob.programs).decode(), []
    frames = {b.id for b in blob.inputs if b.name in ("frame", "big_frame")}
    kernels = {ln.kernel: ln for ln in blob.launches if frames & set(ln.args)}
    for name in sorted(kernels):
        body = src[src.index(f"__kernel void {name}("):]
        body = body[:body.find("\n}") + 2]
        out.append({"kernel": name, "image_reads": body.count("read_imageui("),
                    "buffer_reads": len(re.findall(r"\bp[1-9]\d*\[", body)),  # p0: the output
                    "int_div_mod": len(re.findall(r" [/%] ", "\n".join(INT_LINE.findall(body)))),
                    "lines": body.count("\n")})
    return out


def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--camera", type=parse_size, default=(1928, 1208))
    ap.add_argument("--transforms", type=int, default=20)
    ap.add_argument("--blob", help="a modeld blob: count its warp kernels' reads")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    r = touched(args.camera, args.transforms)
    if args.blob:
        r["kernels"] = kernel_reads(args.blob)
    return report(r, args.json, print)


if __name__ == "__main__":
    sys.exit(main())
