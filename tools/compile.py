"""Compile an ONNX model into one keel blob.

  python tools/compile.py MODEL.onnx -o OUT.blob [--target cpu] [--input-shape NAME=d0,d1,...]...
                          [--input-value NAME=v0,v1,...]... [--overridable NAME]...
                          [--state IN=OUT]...
                          [--float16 [--calibrate FEEDS.npz]]
                          [--embed-binaries] [--verbose]
  python tools/compile.py --entry NAME=MODEL.onnx [--entry NAME=MODEL.onnx]... -o OUT.blob ...

--entry (repeatable, instead of MODEL.onnx): one entry point per ONNX model, in this order, in one
blob that shares their weights (equal bytes stored once), state and arena; run one with
Model.run(feeds, entry=NAME). --state IN=OUT (repeatable): input IN is persistent state, replaced
after each run by output OUT, in every entry that has them (beside the models' own
metadata_props "keel.state"); docs/blob.md "state".

--input-value freezes an input to a constant: the blob no longer takes it, and what depends on
it folds (an If on a sample-rate input builds only the branch it takes).

--calibrate FEEDS.npz (with --float16): sample inputs, one array per input name (a leading axis
of samples allowed), run through keel's interpreter; every tensor beyond half's safe range stays
fp32 with the kernel that computes it, and the compile says which. Without it, --float16 on a
target that stores activations as half says their ranges are unchecked.

--embed-binaries (--target qcom, on the device): builds every kernel with this device's vendor
OpenCL compiler, parses the binaries and stores the parsed programs in the blob's binaries
section (docs/qcom.md), so a load on the same chip and driver never touches libOpenCL.

Exit codes: 0 success, 1 no usable device for --embed-binaries, 2 bad input (unreadable or
unsupported model, bad arguments).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

# the repository root, so the tool runs from a checkout without installing keel
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from compiler.blob import BlobWriter  # noqa: E402
from compiler.codegen.build import KERNEL_STEPS  # noqa: E402
from compiler.pipeline import Stages, compile_model  # noqa: E402
from compiler.errors import CompileError  # noqa: E402
from compiler.target import TARGETS  # noqa: E402
from qcom import store  # noqa: E402
from runner.errors import BlobError, DeviceError  # noqa: E402
from tools.cli import Parser, number  # noqa: E402

DIM = number(int, 0, 2**63 - 1)


def parse_pair(text: str) -> tuple[str, str]:
    """NAME=VALUE, both non-empty."""
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    name, sep, dims = text.rpartition("=")
    try:
        shape = tuple(DIM(d) for d in dims.split(","))
    except argparse.ArgumentTypeError:
        shape = ()
    if not sep or not name or not shape:
        raise argparse.ArgumentTypeError(f"expected NAME=d0,d1,... with non-negative ints, got {text!r}")
    return name, shape


def parse_value(text: str) -> tuple[str, list[float | int]]:
    name, sep, values = text.rpartition("=")
    try:
        numbers = [float(v) if any(c in v for c in ".eEn") else int(v) for v in values.split(",")]
    except ValueError:
        numbers = []
    if not sep or not name or not numbers:
        raise argparse.ArgumentTypeError(f"expected NAME=v0,v1,... with numbers, got {text!r}")
    return name, numbers


class Progress:
    """One status line on stderr: rewritten in place on a terminal, every 10% otherwise."""

    def __init__(self, stream=None):
        stream = stream or sys.stderr  # at the call: sys.stderr may be replaced after import
        self.stream, self.tty, self.last = stream, stream.isatty(), -1

    def __call__(self, stage: str, done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if self.tty:
            self.stream.write(f"\r{stage}: {done}/{total} ({pct}%)" + ("\n" if done == total else ""))
            self.stream.flush()
        elif pct // 10 != self.last // 10 or done == total:
            self.stream.write(f"{stage}: {done}/{total} ({pct}%)\n")
        self.last = pct


def report(stage: str, secs: float, counts: dict) -> None:
    """--verbose: one line per stage as it ends."""
    what = ", ".join(f"{n} {k}" for k, n in counts.items())
    print(f"  {stage:<10} {secs:8.2f} s" + (f"  ({what})" if what else ""), file=sys.stderr)


def load_calibration(path: str) -> dict:
    try:
        with np.load(path) as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError, EOFError, AttributeError) as e:  # not a file, not an .npz
        raise CompileError(f"--calibrate {path}: expected an .npz with one array per input "
                           f"({type(e).__name__}: {e})") from None


def print_fp16_ranges(r: dict) -> None:
    """What --float16 did about half's range: unchecked, or which tensors stayed fp32."""
    if not r["calibrated"]:
        print("fp16: activation ranges are unchecked (no --calibrate): a value beyond half's "
              "+-65504 becomes inf", file=sys.stderr)
        return
    kept = r["kept_fp32"]
    print(f"fp16: ranges calibrated on {r['samples']} sample(s): {len(kept)} tensor(s) beyond "
          f"+-{r['safe_max']:g} stay fp32, {r['kernels_fp32']} kernel(s) compute in fp32"
          + (":" if kept else ""), file=sys.stderr)
    for k in kept:
        what = f"{k['op_type']} node {k['node']!r}" if k["node"] else "a tensor of no node"
        print(f"  {what}: largest |x| {k['largest']:.3g}",
              file=sys.stderr)


def parser() -> Parser:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="ONNX model file (or --entry, for several)")
    ap.add_argument("--entry", action="append", type=parse_pair, default=[],
                    metavar="NAME=MODEL.onnx", help="an entry point and its ONNX model "
                    "(repeatable; instead of MODEL)")
    ap.add_argument("--state", action="append", type=parse_pair, default=[], metavar="IN=OUT",
                    help="input IN is state, replaced by output OUT after each run (repeatable)")
    ap.add_argument("-o", "--output", required=True, help="blob file to write")
    ap.add_argument("--target", default="cpu", choices=sorted(TARGETS))
    ap.add_argument("--input-shape", action="append", type=parse_shape, default=[],
                    metavar="NAME=d0,d1,...", help="bind an input's dynamic dims (repeatable)")
    ap.add_argument("--input-value", action="append", type=parse_value, default=[],
                    metavar="NAME=v0,v1,...", help="freeze an input to a constant (repeatable)")
    ap.add_argument("--overridable", action="append", default=[], metavar="NAME",
                    help="keep a graph input that has an initializer as an input, with the "
                         "initializer as its default (repeatable; otherwise it is a constant)")
    ap.add_argument("--float16", action="store_true", help="store weights and activations as fp16")
    ap.add_argument("--calibrate", metavar="FEEDS.npz",
                    help="--float16: keep tensors these sample inputs push beyond half in fp32")
    ap.add_argument("--embed-binaries", action="store_true",
                    help="qcom, on the device: embed this GPU's parsed kernel binaries")
    ap.add_argument("--verbose", action="store_true",
                    help="each stage as it ends: its time and what it handled")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if (args.model is None) == (not args.entry):
        ap.error("give one ONNX model, or --entry NAME=MODEL.onnx for each entry point")
    entries = dict(args.entry)
    if len(entries) != len(args.entry):
        ap.error(f"--entry names must be unique, got {[n for n, _ in args.entry]}")
    if args.embed_binaries and args.target != "qcom":
        ap.error(f"--embed-binaries needs --target qcom, not {args.target}")
    if args.calibrate and not args.float16:
        ap.error("--calibrate needs --float16")
    stages = Stages(progress=Progress(), report=report if args.verbose else None)
    t0 = time.perf_counter()
    try:
        sources = [args.model] if args.model else list(entries.values())
        with BlobWriter(args.output, inputs=sources) as out:  # checked before the compile
            calibration = load_calibration(args.calibrate) if args.calibrate else None
            art = compile_model(args.model or entries, target=args.target,
                                input_shapes=dict(args.input_shape), float16=args.float16,
                                stages=stages, writer=out,
                                input_values=dict(args.input_value), calibration=calibration,
                                overridable=args.overridable, state=dict(args.state))
            if args.embed_binaries:
                art.binaries = store.embed_here(bytes(art.programs).decode())
            out.finish(art)
    except CompileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (DeviceError, BlobError) as e:  # --embed-binaries: no KGSL, libOpenCL or parse
        print(f"error: --embed-binaries: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the path that failed: the output, its temporary, a C source...
        print(f"error: {e.filename or args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    summary(args, art, stages, time.perf_counter() - t0)
    return 0


def summary(args, art, stages: Stages, total: float) -> None:
    """What the compile did, on stderr (--verbose, fp16 ranges), and the blob written."""
    if args.verbose and stages.times.get("lower"):  # the kernel builder's own steps
        inner = {k: stages.times[k] for k in KERNEL_STEPS if k in stages.times}
        print("  in kernels: " + ", ".join(f"{k} {v:.2f} s" for k, v in inner.items())
              + " (summed over workers)", file=sys.stderr)
    if args.float16 and TARGETS[args.target].half_activations:
        print_fp16_ranges(art.meta["fp16_ranges"])
    elif args.calibrate:
        print(f"fp16: --target {args.target} keeps activations in fp32: --calibrate had nothing "
              f"to check", file=sys.stderr)
    size = os.path.getsize(args.output)
    print(f"wrote {args.output}: {size / 2**20:.1f} MiB, {len(art.launches)} launches, "
          f"arena {art.arena_bytes / 2**20:.2f} MiB (lower bound "
          f"{art.arena_lower_bound_bytes / 2**20:.2f} MiB), {total:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
