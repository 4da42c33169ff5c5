"""Compile openpilot's whole modeld step into one keel blob, from openpilot's own arguments.

  python tools/compile_modeld.py --vision-onnx V --policy-onnx P --model-size 512x256 \\
      --camera-resolutions 1928x1208 1344x760 --frame-skip 4 --output modeld.blob \\
      [--target cpu] [--float16] [--frame-buffers] [--verbose]
  python tools/compile_modeld.py --dm-onnx DM --camera-resolutions 1928x1208 --output dm.blob ...

The driving blob has, per camera resolution WxH, the entries `WxH/warp_enqueue` (frames and
transforms into the frame queues, for a frame whose model run is skipped) and `WxH/run_policy`
(the same, then vision, the feature and desire queues and the policy). The queues are the blob's
state, shared by every entry; the weights are stored once. The DM blob has `WxH/dmonitoring`
per resolution: the Y plane warped to the DM model's input, then the model.
On qcom the camera frames are read as R8 images, so the warp's gather goes through the texture
path; --frame-buffers reads them as plain buffers instead, to compare (docs/modeld.md).
models/modeld_step.py builds the graphs; docs/modeld.md shows how modeld runs the blob.

Exit codes: 0 success, 2 bad input (unreadable or unsupported model, bad arguments).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import onnx  # noqa: E402
from google.protobuf.message import DecodeError  # noqa: E402

from compiler.blob import BlobWriter  # noqa: E402
from compiler.errors import CompileError  # noqa: E402
from compiler.pipeline import Stages, compile_model  # noqa: E402
from compiler.target import TARGETS  # noqa: E402
from models.modeld_step import dm_entries, frame_images, parse_size, step_entries  # noqa: E402
from tools.cli import Parser, positive_int  # noqa: E402
from tools.compile import Progress, report  # noqa: E402


def size(text: str) -> tuple[int, int]:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def entries(args) -> dict[str, onnx.ModelProto]:
    cams = args.camera_resolutions
    if args.dm_onnx:
        return dm_entries(onnx.load(args.dm_onnx), cams)
    return step_entries(onnx.load(args.vision_onnx), onnx.load(args.policy_onnx),
                        args.model_size, cams, args.frame_skip)


def main(argv=None) -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--vision-onnx")
    ap.add_argument("--policy-onnx")
    ap.add_argument("--dm-onnx", help="the driver-monitoring model (instead of vision/policy)")
    ap.add_argument("--model-size", type=size, help="the driving model's input WxH")
    ap.add_argument("--camera-resolutions", type=size, nargs="+", required=True,
                    metavar="WxH", help="camera resolutions, one entry set each")
    ap.add_argument("--frame-skip", type=positive_int)
    ap.add_argument("--output", "-o", required=True)
    ap.add_argument("--target", default="cpu", choices=sorted(TARGETS))
    ap.add_argument("--float16", action="store_true", help="store weights (GPU: activations) "
                    "as fp16; the warp's coordinates stay fp32")
    ap.add_argument("--frame-buffers", action="store_true", help="read the camera frames as "
                    "plain buffers, not as R8 images (qcom: the texture path, the default)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    driving = (args.vision_onnx, args.policy_onnx, args.model_size, args.frame_skip)
    if args.dm_onnx and any(v is not None for v in driving):
        ap.error("--dm-onnx compiles the DM blob alone: drop --vision-onnx, --policy-onnx, "
                 "--model-size and --frame-skip")
    if not args.dm_onnx and any(v is None for v in driving):
        ap.error("expected --vision-onnx, --policy-onnx, --model-size and --frame-skip "
                 "(or --dm-onnx)")
    if len(set(args.camera_resolutions)) != len(args.camera_resolutions):
        ap.error("--camera-resolutions: each resolution once")
    stages = Stages(progress=Progress(), report=report if args.verbose else None)
    t0 = time.perf_counter()
    try:
        graphs = entries(args)
        sources = [p for p in (args.vision_onnx, args.policy_onnx, args.dm_onnx) if p]
        with BlobWriter(args.output, inputs=sources) as out:  # -o never names a model
            images = None if args.frame_buffers else \
                frame_images(args.camera_resolutions, args.target)
            art = compile_model(graphs, target=args.target, float16=args.float16,
                                stages=stages, writer=out, image_inputs=images)
            out.finish(art)
    except (CompileError, ValueError, DecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e.filename or args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {os.path.getsize(args.output) / 2**20:.1f} MiB, entries "
          f"{', '.join(graphs)}, {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
