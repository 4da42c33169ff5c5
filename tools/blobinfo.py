"""Describe a keel blob: its variants (a `cpu` blob holds cpu-avx2 and cpu-avx512) and the one
this host runs, sections, arena vs lower bound, kernels, io, launch table (with the ONNX nodes each
launch computes), and optionally the memory plan as a picture.

    python tools/blobinfo.py model.blob [--json] [--memory plan.png] [--variant TARGET]

Every variant is validated (hashes included); the rest describes the one this host runs, or
--variant's.

--memory draws the arena: kernel order across, byte offset up, one rectangle per buffer from the
launch that writes it first to the last launch that reads it; the lower bound (the most bytes
live at any launch) is the red line, and the launch where the most bytes are live is shaded and
named with its buffers, so the picture shows why the arena is the size it is.
"""
import os
import sys

# the repository root, so the tool runs from a checkout without installing keel
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import signal  # noqa: E402

import numpy as np  # noqa: E402

from runner.blob import launch_nodes, read_blob  # noqa: E402
from runner.errors import BlobError, ConfigError  # noqa: E402
from tools.cli import Parser, report  # noqa: E402
from tools.png import PALETTE, Canvas, text_width  # noqa: E402


def describe(path: str, variant: str | None = None) -> dict:
    here = read_blob(path)  # the variant this host runs (KEEL_CPU_VARIANT's, if set)
    variants = [here if v == here.variant else read_blob(path, v) for v in here.variants]
    blob = here if variant is None else variants[here.variants.index(variant)] \
        if variant in here.variants else read_blob(path, variant)  # ConfigError: not in it
    m, r = blob.manifest, blob.variant_manifest
    return {
        "target": blob.target,
        "producer": blob.producer,
        "file_bytes": os.path.getsize(path),
        "variants": [{"target": v.variant, "kernels": len(v.program_names),
                      "programs_bytes": len(v.programs),
                      "own_weights_bytes": _size(m, f"weights.{v.variant}")}
                     for v in variants],
        "host_variant": here.variant,
        "variant": blob.variant,
        "sections": {s["name"]: {"offset": s["offset"], "size": s["size"]} for s in m["sections"]},
        "weights_bytes": _size(m, "weights") + _size(m, f"weights.{blob.variant}"),
        "programs_bytes": len(blob.programs),
        "arena_bytes": r["arena_bytes"],
        "arena_lower_bound_bytes": r["arena_lower_bound_bytes"],
        "kernels": len(r["programs"]),
        "inputs": _io(blob.inputs),
        "outputs": _io(blob.outputs),
        "entries": [{"name": e.name, "inputs": [b.slot for b in e.inputs],
                     "outputs": [b.slot for b in e.outputs],
                     "launches": [e.launches.start, e.launches.stop]} for e in blob.entries],
        "state": [{"name": x.name, "dtype": str(x.dtype), "shape": list(x.shape),
                   "reads": [b.slot for b in x.reads], "writes": [b.slot for b in x.writes],
                   "init": x.init is not None,
                   **({"ring": {"step": x.step, "mirrors": [b.slot for b in x.mirrors],
                                "windows": [b.slot for b in x.windows]}} if x.step else {})}
                  for x in blob.state],
        "launches": [{"kernel": l.kernel, "args": list(l.args), "barrier": l.barrier,
                      "global_size": list(l.global_size),
                      "local_size": l.local_size and list(l.local_size),
                      "onnx": [{"name": n, "op_type": op} for n, op in nodes]}
                     for l, nodes in zip(blob.launches, launch_nodes(blob))],
        "memory": memory_plan(blob),
        "meta": m["meta"],
    }


def _size(manifest: dict, section: str) -> int:
    return next(s["size"] for s in manifest["sections"] if s["name"] == section)


def memory_plan(blob) -> dict:
    """Each arena buffer's place and lifetime (launch steps, as the compiler's planner saw them:
    compiler/link/memory.py), the bytes live at each step, and the step where most are."""
    life: dict[int, list[int]] = {}
    for i, ln in enumerate(blob.launches):
        for b in ln.args:
            if blob.buffers[b].region == "arena":
                life.setdefault(b, [i, i])[1] = i
    nodes = launch_nodes(blob)
    writer = {}
    for i, ln in enumerate(blob.launches):
        writer.setdefault(ln.args[0], i)
    live = np.zeros(max(len(blob.launches), 1), np.int64)
    bufs = []
    for b, (first, last) in sorted(life.items()):
        spec, w = blob.buffers[b], writer.get(b, first)
        live[first:last + 1] += spec.nbytes
        name = nodes[w][-1][0] if nodes[w] else blob.launches[w].kernel
        bufs.append({"id": b, "offset": spec.offset, "nbytes": spec.nbytes, "first": first,
                     "last": last, "name": name})
    peak = int(live.argmax())
    return {"arena_bytes": blob.variant_manifest["arena_bytes"],
            "lower_bound_bytes": blob.variant_manifest["arena_lower_bound_bytes"],
            "launches": len(blob.launches), "live_bytes": live.tolist(), "buffers": bufs,
            "peak": {"launch": peak, "kernel": blob.launches[peak].kernel if blob.launches else "",
                     "bytes": int(live[peak]),
                     "buffers": [x["name"] for x in bufs if x["first"] <= peak <= x["last"]]}}


def _io(specs) -> list[dict]:
    return [{"name": b.name, "shape": list(b.shape), "dtype": str(b.dtype), "slot": b.slot}
            for b in specs]


def print_text(d: dict) -> None:
    print(f"target {d['target']}  producer {d['producer']}  file {d['file_bytes']} bytes")
    print(f"variants: {len(d['variants'])}; this host runs {d['host_variant']}"
          + (f"; described below: {d['variant']}" if d["variant"] != d["host_variant"] else ""))
    for v in d["variants"]:
        print(f"  variant {v['target']:16s} kernels {v['kernels']:>5}  programs "
              f"{v['programs_bytes']:>10} bytes  own weights {v['own_weights_bytes']:>12} bytes")
    for name, s in d["sections"].items():
        print(f"  section {name:26s} offset {s['offset']:>10}  size {s['size']:>12}")
    lb = d["arena_lower_bound_bytes"]
    ratio = f"{d['arena_bytes'] / lb:.3f}x" if lb else "n/a"
    print(f"arena {d['arena_bytes']} bytes, lower bound {lb} ({ratio})")
    for kind in ("inputs", "outputs"):
        for b in d[kind]:
            print(f"{kind[:-1]:6s} {b['slot']}: {b['name']} {b['dtype']} {tuple(b['shape'])}")
    for e in d["entries"]:
        print(f"entry {e['name']}: launches [{e['launches'][0]}, {e['launches'][1]}), input "
              f"slots {e['inputs']}, output slots {e['outputs']}")
    for x in d["state"]:
        print(f"state {x['name']} {x['dtype']} {tuple(x['shape'])}: read by slots {x['reads']}, "
              f"written by slots {x['writes']}, initial value "
              f"{'stored' if x['init'] else 'zeros'}")
    print(f"kernels: {d['kernels']}, launches: {len(d['launches'])} (| = barrier before)")
    for i, l in enumerate(d["launches"]):
        ops = "+".join(dict.fromkeys(n["op_type"] for n in l["onnx"])) or "-"
        names = ", ".join(n["name"] for n in l["onnx"])
        print(f"  {i:4d} {'|' if l['barrier'] else ' '} {l['kernel']:32s} args {l['args']} "
              f"global {l['global_size']} local {l['local_size']}  {ops} [{names}]")
    p = d["memory"]["peak"]
    print(f"largest live set: {p['bytes']} bytes at launch {p['launch']} ({p['kernel']}): "
          f"{', '.join(p['buffers'])}")


W, H = 1000, 560
LEFT, RIGHT, TOP, BOTTOM = 90, 20, 70, 40
RED, GREY, SHADE = (214, 39, 40), (90, 90, 90), (255, 243, 191)


def draw_memory(mem: dict) -> Canvas:
    """Offset (up) against kernel order (across): one rectangle per arena buffer."""
    c = Canvas(W, H)
    n, top = max(mem["launches"], 1), max(mem["arena_bytes"], 1)
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    x = lambda step: LEFT + step * pw / n  # noqa: E731
    y = lambda off: H - BOTTOM - off * ph / top  # noqa: E731
    peak = mem["peak"]
    c.rect(x(peak["launch"]), TOP, x(peak["launch"] + 1), H - BOTTOM, SHADE)
    for i, b in enumerate(mem["buffers"]):
        color = PALETTE[i % len(PALETTE)]
        dark = tuple(v * 2 // 3 for v in color)
        x0, y0, x1, y1 = x(b["first"]), y(b["offset"] + b["nbytes"]), x(b["last"] + 1), \
            y(b["offset"])
        c.rect(x0, y0, x1, y1, color, outline=dark)
        if x1 - x0 > text_width(b["name"]) + 6 and y1 - y0 > 16:  # name it where it fits
            c.text(x0 + 4, y0 + 4, b["name"], (255, 255, 255))
    px0, px1 = x(peak["launch"]), x(peak["launch"] + 1)  # mark the peak's column above the plot
    c.rect(px0, TOP - 10, px1, TOP - 3, RED)
    for i in range(LEFT, W - RIGHT, 8):  # the lower bound, dashed
        c.rect(i, y(mem["lower_bound_bytes"]) - 1, i + 5, y(mem["lower_bound_bytes"]) + 1, RED)
    c.rect(LEFT, y(top), W - RIGHT, y(top) + 1, GREY)  # the arena's end
    c.rect(LEFT - 1, TOP, LEFT, H - BOTTOM, GREY)
    c.rect(LEFT, H - BOTTOM, W - RIGHT, H - BOTTOM + 1, GREY)
    _labels(c, mem, y)
    return c


def _labels(c: Canvas, mem: dict, y) -> None:
    arena, lb, peak = mem["arena_bytes"], mem["lower_bound_bytes"], mem["peak"]
    ratio = f" ({arena / lb:.2f}x)" if lb else ""
    c.text(LEFT, 10, f"arena {_kib(arena)}, lower bound {_kib(lb)}{ratio}, "
                     f"{len(mem['buffers'])} buffers, {mem['launches']} launches")
    names = ", ".join(peak["buffers"])
    line = f"largest live set: {_kib(peak['bytes'])} at launch {peak['launch']} " \
           f"{peak['kernel']}: {names}"
    while text_width(line) > W - LEFT - RIGHT and len(line) > 4:
        line = line[:-4] + "..."
    c.text(LEFT, 32, line, RED)
    c.text(W - RIGHT - text_width("lower bound"), y(lb) - 14, "lower bound", RED)
    c.text(4, int(y(arena)) - 4, _kib(arena), GREY)
    c.text(4, H - BOTTOM - 4, "0", GREY)
    c.text(LEFT, H - BOTTOM + 12, "kernel order (launch) ->", GREY)


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


def main() -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("blob")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--memory", metavar="PLAN.png", help="draw the arena's memory plan")
    ap.add_argument("--variant", metavar="TARGET",
                    help="describe this variant (default: the one this host runs)")
    args = ap.parse_args()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `blobinfo.py x.blob | head` ends quietly
    try:
        d = describe(args.blob, args.variant)
        if args.memory:
            draw_memory(d["memory"]).save(args.memory)
    except (BlobError, ConfigError, OSError) as e:
        print(f"blobinfo: {args.blob}: {e}", file=sys.stderr)
        return 2
    return report(d, args.json, print_text)


if __name__ == "__main__":
    sys.exit(main())
