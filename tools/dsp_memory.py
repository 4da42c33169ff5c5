"""Per kernel of a dsp blob, its L2 model (compiler/codegen/l2fetch.py, the blob's meta
"memory"): what every trip of its outer loop shares (resident), what one trip touches (live),
the l2fetch box hinted per trip and how many trips ahead, the working set that must stay in L2
against the target's L2, and the bytes the launch's buffers hold (what it moves at least).

    python tools/dsp_memory.py model.blob [--json]

A model, not a measurement: only the device's L2 miss counts show what stays (docs/dsp.md).
"""
from __future__ import annotations

import argparse
import json
import sys

from compiler.target import get_target
from runner.blob import read_blob


def rows(path: str) -> list[dict]:
    """One row per kernel (its launches summed: every launch of a program has the same loops)."""
    blob = read_blob(path)
    memory = blob.manifest["meta"].get("memory")
    if not memory:
        raise SystemExit(f"{path}: no memory model in the blob's meta (a dsp blob compiled "
                         f"with l2fetch has one)")
    sizes = {i: b.nbytes for i, b in blob.buffers.items()}
    out: dict[str, dict] = {}
    for ln, mem in zip(blob.launches, memory):
        row = out.setdefault(ln.kernel, {"kernel": ln.kernel, "launches": 0, "moved": 0,
                                         **(mem or {"trips": 1, "resident": 0, "live": 0,
                                                    "fetched": 0, "ahead": 0})})
        row["launches"] += 1
        row["moved"] += sum(sizes[a] for a in ln.args)
    for row in out.values():
        row["working_set"] = row["resident"] + row["live"] + row["ahead"] * row["fetched"]
    return list(out.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("blob")
    ap.add_argument("--json", action="store_true", help="the rows and totals as JSON")
    args = ap.parse_args()
    table, l2 = rows(args.blob), get_target("dsp").l2_bytes
    summary = {"l2_bytes": l2, "moved": sum(r["moved"] for r in table),
               "largest_working_set": max(r["working_set"] for r in table),
               "over_l2": [r["kernel"] for r in table if r["working_set"] > l2], "kernels": table}
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'kernel':28s} {'n':>3s} {'trips':>6s} {'resident':>9s} {'live':>8s} "
          f"{'box x ahead':>13s} {'working set':>12s} {'moved':>9s}  (KiB; L2 {l2 >> 10} KiB)")
    for r in table:
        box = f"{r['fetched'] / 1024:.1f} x {r['ahead']}" if r["fetched"] else "-"
        flag = "  over L2" if r["working_set"] > l2 else ""
        print(f"{r['kernel']:28s} {r['launches']:3d} {r['trips']:6d} {r['resident'] / 1024:9.1f} "
              f"{r['live'] / 1024:8.1f} {box:>13s} {r['working_set'] / 1024:12.1f} "
              f"{r['moved'] / 1024:9.1f}{flag}")
    print(f"moved at least {summary['moved'] / 2**20:.2f} MiB per run; largest working set "
          f"{summary['largest_working_set'] / 1024:.1f} KiB; over L2: "
          f"{', '.join(summary['over_l2']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
