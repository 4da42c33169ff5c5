"""Describe a keel blob: sections, arena vs lower bound, kernels, io, launch table.

    python tools/blobinfo.py model.blob [--json]
"""
import os
import sys

# the repository root, so the tool runs from a checkout without installing keel
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import json  # noqa: E402
import signal  # noqa: E402

from runner.blob import read_blob  # noqa: E402
from runner.errors import BlobError  # noqa: E402
from tools.cli import Parser  # noqa: E402


def describe(path: str) -> dict:
    blob = read_blob(path)
    m = blob.manifest
    return {
        "target": blob.target,
        "producer": blob.producer,
        "file_bytes": os.path.getsize(path),
        "sections": {s["name"]: {"offset": s["offset"], "size": s["size"]} for s in m["sections"]},
        "weights_bytes": len(blob.weights),
        "programs_bytes": len(blob.programs),
        "arena_bytes": m["arena_bytes"],
        "arena_lower_bound_bytes": m["arena_lower_bound_bytes"],
        "kernels": len(m["programs"]),
        "inputs": _io(blob.inputs),
        "outputs": _io(blob.outputs),
        "launches": [{"kernel": l.kernel, "args": list(l.args), "barrier": l.barrier,
                      "global_size": list(l.global_size),
                      "local_size": l.local_size and list(l.local_size)} for l in blob.launches],
        "meta": m["meta"],
    }


def _io(specs) -> list[dict]:
    return [{"name": b.name, "shape": list(b.shape), "dtype": str(b.dtype), "slot": b.offset}
            for b in specs]


def print_text(d: dict) -> None:
    print(f"target {d['target']}  producer {d['producer']}  file {d['file_bytes']} bytes")
    for name, s in d["sections"].items():
        print(f"  section {name:9s} offset {s['offset']:>10}  size {s['size']:>12}")
    lb = d["arena_lower_bound_bytes"]
    ratio = f"{d['arena_bytes'] / lb:.3f}x" if lb else "n/a"
    print(f"arena {d['arena_bytes']} bytes, lower bound {lb} ({ratio})")
    for kind in ("inputs", "outputs"):
        for b in d[kind]:
            print(f"{kind[:-1]:6s} {b['slot']}: {b['name']} {b['dtype']} {tuple(b['shape'])}")
    print(f"kernels: {d['kernels']}, launches: {len(d['launches'])} (| = barrier before)")
    for i, l in enumerate(d["launches"]):
        print(f"  {i:4d} {'|' if l['barrier'] else ' '} {l['kernel']:32s} args {l['args']} "
              f"global {l['global_size']} "
              f"local {l['local_size']}")


def main() -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("blob")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `inspect.py x.blob | head` ends quietly
    try:
        d = describe(args.blob)
    except BlobError as e:
        print(f"inspect: {args.blob}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(d, indent=1))
    else:
        print_text(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
