"""A roofline lower bound for a blob on the GPU it targets: what no schedule of these kernels can
beat on that chip, from what each launch must compute and move.

    python tools/roofline.py model.blob [--chip adreno630] [--entry NAME] [--json]

A blob of several entry points (tools/compile_modeld.py's) is bounded per entry with --entry
(one frame's run_policy, say); without it, every launch of every entry is summed.

Per launch, the bound is the larger of its FLOPs at the chip's peak arithmetic rate and its
bytes at the memory's peak bandwidth; the model's bound is their sum (launches run one after
another). A launch's FLOPs are the compiler's count (manifest meta "flops": two per
multiply-add, one per elementwise op). Its bytes are the sizes of the buffers it touches,
each once (an image's data, not its row padding): weights, activations and images read, its
outputs written; but a buffer the launch gathers from (manifest meta "gathers": [parameter,
samples] per launch, one sample per element of the Gather's output) counts only the bytes the
gather can touch, samples x its element size, capped by the buffer's size: the warp reads
196,608 bytes of a 4.8 MB camera frame. That is the least
traffic there can be with no reuse across launches (on-chip caches are far smaller than the
activations here) and perfect reuse within one, so the bound stays a bound. Half arithmetic
counts at the half rate only when the blob computes in half (`--target qcom --float16`).

The bound says where a kernel's time can go, not what it will take: dispatch overhead, occupancy
and the vendor compiler's code are what `tests/device/test_qcom.py` measures on the device.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

# the repository root, so the tool runs from a checkout without installing keel
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from compiler.target import TARGETS  # noqa: E402
from runner.blob import launch_nodes, read_blob  # noqa: E402
from runner.errors import BlobError  # noqa: E402
from tools.cli import Parser, report  # noqa: E402


@dataclass(frozen=True)
class Chip:
    name: str
    fp32_gflops: float
    fp16_gflops: float
    gbps: float
    source: str


CHIPS = {
    # 512 FP32 lanes x 2 FLOPs (fused multiply-add) x 710 MHz = 727 GFLOP/s, half at twice the
    # rate; LPDDR4X at 1866 MHz on 4 x 16-bit channels = 29.9 GB/s. Published figures
    # (Qualcomm's Snapdragon 845 specification; the Adreno table on Wikipedia), not measured.
    "adreno630": Chip("Adreno 630 (Snapdragon 845, comma 3X)", 727.0, 1454.0, 29.9,
                      "512 ALUs x 2 x 710 MHz; LPDDR4X-3733, 64-bit"),
}


def _data_bytes(buf) -> int:
    """The tensor's bytes: an image's rows are `pitch` texels apart (64-texel aligned), but a
    kernel reads only the `width` texels of each row that hold data."""
    return math.prod(buf.shape) * buf.dtype.itemsize


def _launch_bytes(blob, ln, samples: dict) -> int:
    """Each buffer once; one the launch gathers from (samples: {parameter: samples}) at most its
    samples' bytes, unless the launch also reads it as a whole through another parameter."""
    touched = {}
    for j, bid in enumerate(ln.args):
        b = blob.buffers[bid]
        full = _data_bytes(b)
        part = min(full, samples[j] * b.dtype.itemsize) if j in samples else full
        touched[bid] = max(touched.get(bid, 0), part)
    return sum(touched.values())


def bound(blob, chip: Chip, entry: str | None = None) -> dict:
    meta = blob.manifest["meta"]
    half = TARGETS[blob.target].half_compute and bool(meta.get("float16"))
    peak = (chip.fp16_gflops if half else chip.fp32_gflops) * 1e9
    flops = meta.get("flops") or [0] * len(blob.launches)
    gathers = meta.get("gathers") or [[]] * len(blob.launches)
    nodes = launch_nodes(blob)
    rows = []
    launches = range(len(blob.launches)) if entry is None else \
        next(e.launches for e in blob.entries if e.name == entry)
    for i in launches:
        ln = blob.launches[i]
        nbytes = _launch_bytes(blob, ln, dict(gathers[i]))
        compute, memory = flops[i] / peak, nbytes / (chip.gbps * 1e9)
        rows.append({"launch": i, "kernel": ln.kernel, "flops": flops[i], "bytes": nbytes,
                     "bound_us": max(compute, memory) * 1e6,
                     "limit": "compute" if compute > memory else "memory",
                     "ops": list(dict.fromkeys(op for _, op in nodes[i]))})
    weights = sum(_data_bytes(b) for b in blob.buffers.values() if b.region == "weights")
    return {"chip": chip.name, "arithmetic": "half" if half else "float",
            "kernels": len(blob.program_names), "launches": len(rows),
            "gflop": sum(r["flops"] for r in rows) / 1e9,
            "bytes_moved": sum(r["bytes"] for r in rows), "weights_bytes": weights,
            "bound_ms": sum(r["bound_us"] for r in rows) / 1e3,
            "memory_bound_launches": sum(r["limit"] == "memory" for r in rows),
            "launches_by_bound": sorted(rows, key=lambda r: -r["bound_us"])}


def print_text(r: dict, top: int = 10) -> None:
    print(f"{r['chip']}, {r['arithmetic']} arithmetic: {r['kernels']} kernels, {r['launches']} "
          f"launches, {r['gflop']:.2f} GFLOP, {r['bytes_moved'] / 2**20:.1f} MiB moved "
          f"(weights {r['weights_bytes'] / 2**20:.1f} MiB)")
    print(f"roofline lower bound {r['bound_ms']:.2f} ms; {r['memory_bound_launches']} of "
          f"{r['launches']} launches memory-bound")
    print(f"{'#':>4} {'kernel':32s} {'bound us':>9} {'MFLOP':>8} {'KiB':>8}  limit    ONNX ops")
    for x in r["launches_by_bound"][:top]:
        print(f"{x['launch']:4d} {x['kernel']:32s} {x['bound_us']:9.1f} {x['flops'] / 1e6:8.1f} "
              f"{x['bytes'] / 1024:8.1f}  {x['limit']:8s} {'+'.join(x['ops']) or '-'}")


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("blob")
    ap.add_argument("--chip", default="adreno630", choices=sorted(CHIPS))
    ap.add_argument("--entry", help="bound one entry point's launches")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args(argv)
    try:
        blob = read_blob(args.blob)
    except (BlobError, OSError) as e:
        print(f"roofline: {args.blob}: {e}", file=sys.stderr)
        return 2
    names = [e.name for e in blob.entries]
    if args.entry is not None and args.entry not in names:
        print(f"roofline: --entry {args.entry!r}: expected one of {names}", file=sys.stderr)
        return 2
    return report(bound(blob, CHIPS[args.chip], args.entry), args.json, print_text)


if __name__ == "__main__":
    sys.exit(main())
