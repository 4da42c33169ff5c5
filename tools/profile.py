"""Per-kernel time of a keel blob on a device: a table sorted by time and a Perfetto trace.

    python tools/profile.py model.blob [--device D] [--runs N] [--trace out.json]
                           [--timeline run.png] [--json]

Each launch is timed by the device itself (runner/device.py, `profile` and `spans`): the CPU's
cycle counter before and after every kernel on every thread, OpenCL event profiling, the mock's
host clock around each replayed launch. A launch's time is its slowest thread's; the table gives
each kernel's median over the runs, its share of the run's median latency (Model.run, measured on
the host), its ONNX ops (the blob's provenance), GFLOP/s (meta "flops": two per multiply-add) and
GB/s (the bytes of its argument buffers, each counted once: a lower bound on its traffic).
What the kernels do not account for is reported in two parts: the host's overhead (the run's
latency minus the device's span from first launch start to last launch end: binding, submit,
wait, copies) and the gaps between launches (barrier waits, dispatch).

--trace writes Chrome trace-event JSON (Perfetto and chrome://tracing open it): per run, one
slice per launch and thread, and a host row with the run and its overhead. The device's clock is
not the host's, so each run's launches are drawn from the end of its host overhead (the split
of the overhead between before and after the launches is not measured). --timeline draws the
median run's slices as a PNG.

On the DSP (`--device dsp`, or a dsp blob) the runtime counts instead of timing: one profiled
run, per launch and hardware thread its packets (qemu-hexagon under KEEL_FASTRPC=mock; cycles on
the device) and HVX instructions, the totals in `packets` (the critical path), `packets_total`
and `hvx_instructions`, and a table per kernel with its MACs per packet (dsp_counts).
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from runner import BlobError, ConfigError, DeviceError, DeviceTimeout, InputError, Model  # noqa
from runner.blob import launch_nodes, read_blob  # noqa: E402
from tools.cli import Parser, positive_int, report  # noqa: E402
from tools.png import PALETTE, Canvas, text_width  # noqa: E402
from tools.run import random_feeds  # noqa: E402

HOST_TID = 0  # the trace row of the host's run() and overhead slices; device lane k is row k + 1


def profile(path: str, device: str | None = None, runs: int = 20, warmup: int = 3) -> dict:
    """Every profiled run's latency (ns) and spans, plus what the table needs from the blob."""
    m = Model.load(path, device)
    try:
        for name, arr in random_feeds(m.inputs).items():
            m.input_view(name)[:] = arr
        out = {n: np.empty(s, d) for n, (s, d) in m.outputs.items()}
        m.device.profile(True)
        for _ in range(warmup):
            m.run(out=out)
        samples = []
        for _ in range(runs):
            t0 = time.perf_counter_ns()
            m.run(out=out)
            t1 = time.perf_counter_ns()
            samples.append((t0, t1 - t0, m.device.spans()))
        m.device.profile(False)
        return {"samples": samples, "blob": m.blob, "device": m.device.name}
    finally:
        m.close()


def dsp_counts(path: str, device: str | None = None) -> dict:
    """One profiled run on the DSP (docs/dsp.md, "Profiling" and "Threads"): per launch and
    hardware thread, the runtime's two counters. Under qemu-hexagon (KEEL_FASTRPC=mock) they
    are executed packets and HVX instructions; on the device the first is UPCYCLE cycles.
    A launch is shared between threads and ends with its slowest share, and launches run one
    after another, so `packets` is the critical path: the sum over launches of the most any
    thread spent on it. `packets_total` sums every thread's packets (the work, >= `packets`),
    `packets_per_thread` each thread's, and each launch row has its `threads` [per thread].
    MACs per launch are the blob's meta flops / 2 (a reduction's multiply-adds; an
    elementwise launch counts one op per element, half a MAC)."""
    m = Model.load(path, device)
    try:
        m.timeout_ms = max(m.timeout_ms, 600_000)  # qemu emulates a whole model per run
        for name, arr in random_feeds(m.inputs).items():
            m.input_view(name)[:] = arr
        counters(m.device, True)
        m.run()
        ticks, threads, blob = list(m.device.last_ticks), m.device.worker_ticks, m.blob
    finally:
        m.close()
    n = len(blob.launches)
    packets, hvx = ticks[:n], ticks[n:2 * n]
    flops = blob.manifest["meta"].get("flops") or [0] * n
    nodes = launch_nodes(blob)
    rows = [{"launch": i, "kernel": ln.kernel, "packets": packets[i], "hvx_instructions": hvx[i],
             "threads": [t[i] for t in threads], "macs": flops[i] // 2,
             "ops": list(dict.fromkeys(op for _, op in nodes[i]))}
            for i, ln in enumerate(blob.launches)]
    kernels: dict[str, dict] = {}
    for r in rows:
        k = kernels.setdefault(r["kernel"], {"kernel": r["kernel"], "launches": 0, "packets": 0,
                                             "hvx_instructions": 0, "macs": 0})
        k["launches"] += 1
        for f in ("packets", "hvx_instructions", "macs"):
            k[f] += r[f]
    for k in kernels.values():
        k["macs_per_packet"] = k["macs"] / k["packets"] if k["packets"] else 0.0
    total = sum(packets)
    return {"device": "dsp", "counter": "packets" if os.environ.get("KEEL_FASTRPC") == "mock"
            else "cycles", "packets": total, "packets_total": sum(map(sum, threads)),
            "packets_per_thread": [sum(t) for t in threads], "hvx_instructions": sum(hvx),
            "macs": sum(r["macs"] for r in rows),
            "macs_per_packet": sum(r["macs"] for r in rows) / total if total else 0.0,
            "launches": rows,
            "kernels": sorted(kernels.values(), key=lambda k: -k["packets"])}


def counters(device, on: bool) -> None:
    """The DSP runtime's per-launch counters on or off: `set_profiling` where the device has it
    (the runtime rewrite of branch w3-r32), else its `profile` flag."""
    if hasattr(device, "set_profiling"):
        device.set_profiling(on)
    else:
        device.profile = on


def print_dsp_table(s: dict) -> None:
    print(f"device dsp ({s['counter']}): {s['packets']:,} on the critical path "
          f"({s['packets_total']:,} on all threads: "
          f"{', '.join(f'{p:,}' for p in s['packets_per_thread'])}), "
          f"{s['hvx_instructions']:,} HVX instructions, {s['macs_per_packet']:.1f} MACs per "
          f"{s['counter'][:-1]} of the critical path")
    print(f"{'kernel':32s} {'launches':>8} {s['counter']:>12} {'HVX':>12} {'MACs':>12} "
          f"{'MACs/' + s['counter'][:-1]:>14}")
    for k in s["kernels"]:
        print(f"{k['kernel']:32s} {k['launches']:8d} {k['packets']:12,} "
              f"{k['hvx_instructions']:12,} {k['macs']:12,} {k['macs_per_packet']:14.1f}")


def launch_bytes(blob) -> list[int]:
    return [sum(blob.buffers[b].nbytes for b in set(ln.args)) for ln in blob.launches]


def per_launch(spans, n: int) -> np.ndarray:
    """Each launch's time (ns): its slowest lane's."""
    t = np.zeros(n)
    for s in spans:
        t[s.launch] = max(t[s.launch], s.end_ns - s.start_ns)
    return t


def summarize(prof: dict) -> dict:
    blob, samples = prof["blob"], prof["samples"]
    n = len(blob.launches)
    each = [per_launch(sp, n) for _, _, sp in samples]
    times = np.median(each, axis=0)
    # the totals are one run's, the run of median latency, so its parts add up exactly (medians
    # of parts taken separately need not: a preempted kernel inflates some runs' spans only)
    mid = int(np.argsort([lat for _, lat, _ in samples])[len(samples) // 2])
    _, latency, spans = samples[mid]
    span = max(s.end_ns for s in spans) - min(s.start_ns for s in spans) if spans else 0
    flops = blob.manifest["meta"].get("flops") or [0] * n
    nbytes, nodes = launch_bytes(blob), launch_nodes(blob)
    rows = [{"launch": i, "kernel": ln.kernel, "ns": float(times[i]),
             "share": float(times[i]) / latency if latency else 0.0,
             "gflops": flops[i] / times[i] if times[i] else 0.0,
             "gbps": nbytes[i] / times[i] if times[i] else 0.0,
             "ops": list(dict.fromkeys(op for _, op in nodes[i])),
             "nodes": [name for name, _ in nodes[i]]}
            for i, ln in enumerate(blob.launches)]
    rows.sort(key=lambda r: -r["ns"])
    kernels = float(each[mid].sum())
    return {"device": prof["device"], "runs": len(samples), "latency_ns": latency,
            "kernels_ns": kernels, "accounted": kernels / latency if latency else 0.0,
            "unaccounted_ns": latency - kernels, "host_overhead_ns": latency - span,
            "gaps_ns": span - kernels, "launches": rows}


def print_table(s: dict) -> None:
    print(f"device {s['device']}, the median of {s['runs']} runs: latency "
          f"{s['latency_ns'] / 1e3:.1f} us, kernels {s['kernels_ns'] / 1e3:.1f} us "
          f"({100 * s['accounted']:.1f}% of it; per-kernel times below: medians over the runs)")
    print(f"unaccounted {s['unaccounted_ns'] / 1e3:.1f} us: host overhead "
          f"{s['host_overhead_ns'] / 1e3:.1f} us (bind, submit, wait, copies), gaps between "
          f"launches {s['gaps_ns'] / 1e3:.1f} us (barriers, dispatch)")
    print(f"{'#':>4} {'kernel':32s} {'us':>9} {'share':>6} {'GFLOP/s':>8} {'GB/s':>7}  ONNX ops")
    for r in s["launches"]:
        print(f"{r['launch']:4d} {r['kernel']:32s} {r['ns'] / 1e3:9.1f} {100 * r['share']:5.1f}% "
              f"{r['gflops']:8.2f} {r['gbps']:7.2f}  {'+'.join(r['ops']) or '-'}")


def trace(prof: dict) -> dict:
    """Chrome trace-event JSON: complete events ("X"), every one with ph, ts, dur, name, pid,
    tid (metadata events too, with ts and dur 0, so a strict reader finds them everywhere)."""
    blob, samples = prof["blob"], prof["samples"]
    nodes, pid = launch_nodes(blob), 1
    first = samples[0][0] if samples else 0
    lanes = sorted({s.lane for _, _, sp in samples for s in sp})
    events = [_meta("process_name", pid, 0, f"keel {prof['device']}")]
    events += [_meta("thread_name", pid, HOST_TID if lane is None else lane + 1,
                     _lane_name(prof["device"], lane))
               for lane in [None, *lanes]]
    for run, (t0, latency, spans) in enumerate(samples):
        base = (t0 - first) / 1e3
        start = min((s.start_ns for s in spans), default=0)
        span = max((s.end_ns for s in spans), default=0) - start
        overhead = max(latency - span, 0) / 1e3
        events.append(_slice("run()", base, latency / 1e3, pid, HOST_TID, {"run": run}))
        events.append(_slice("host overhead", base, overhead, pid, HOST_TID,
                             {"run": run, "what": "bind, submit, wait, copies"}))
        for s in spans:
            ln = blob.launches[s.launch]
            events.append(_slice(ln.kernel, base + overhead + (s.start_ns - start) / 1e3,
                                 (s.end_ns - s.start_ns) / 1e3, pid, s.lane + 1,
                                 {"launch": s.launch, "run": run,
                                  "onnx": [f"{n} ({op})" for n, op in nodes[s.launch]]}))
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def _slice(name: str, ts: float, dur: float, pid: int, tid: int, args: dict) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def _meta(kind: str, pid: int, tid: int, name: str) -> dict:
    return {"ph": "M", "name": kind, "ts": 0, "dur": 0, "pid": pid, "tid": tid,
            "args": {"name": name}}


def _lane_name(device: str, lane: int | None) -> str:
    if lane is None:
        return "host"
    return f"cpu thread {lane}" if device == "cpu" else f"{device} queue {lane}"


def draw_run(prof: dict, width: int = 1000, row: int = 34) -> Canvas:
    """The median run as a picture: one row for the host, one per device lane, a rectangle per
    launch (named where it fits), time across. The same slices --trace writes for that run."""
    samples = prof["samples"]
    t0, latency, spans = samples[int(np.argsort([s[1] for s in samples])[len(samples) // 2])]
    lanes = sorted({s.lane for s in spans})
    left, top = 130, 40
    c = Canvas(width, top + row * (len(lanes) + 1) + 30)
    x = lambda ns: left + ns * (width - left - 10) / max(latency, 1)  # noqa: E731
    start = min((s.start_ns for s in spans), default=0)
    overhead = max(latency - (max((s.end_ns for s in spans), default=0) - start), 0)
    c.text(10, 10, f"{prof['device']}: one run, {latency / 1e3:.1f} us, "
                   f"{len(prof['blob'].launches)} launches")
    c.text(10, top + 10, "host")
    c.rect(x(0), top + 4, x(latency), top + row - 4, (220, 220, 220), outline=(120, 120, 120))
    c.rect(x(0), top + 4, x(overhead), top + row - 4, (120, 120, 120))
    for r, lane in enumerate(lanes, 1):
        c.text(10, top + r * row + 10, _lane_name(prof["device"], lane))
        for sp in (s for s in spans if s.lane == lane):
            x0, x1 = x(overhead + sp.start_ns - start), x(overhead + sp.end_ns - start)
            color = PALETTE[sp.launch % len(PALETTE)]
            c.rect(x0, top + r * row + 4, x1, top + (r + 1) * row - 4, color,
                   outline=tuple(v * 2 // 3 for v in color))
            name = prof["blob"].launches[sp.launch].kernel.split("_")[0]
            if x1 - x0 > text_width(name) + 6:
                c.text(x0 + 3, top + r * row + 10, name, (255, 255, 255))
    c.text(left, c.size[1] - 20, f"0 .. {latency / 1e3:.1f} us (grey: host overhead)",
           (90, 90, 90))
    return c


def main() -> int:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("blob")
    ap.add_argument("--device", help="runner device (default: the blob target's)")
    ap.add_argument("--runs", type=positive_int, default=20, help="profiled runs (median)")
    ap.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace-event JSON file")
    ap.add_argument("--timeline", metavar="OUT.png", help="draw the median run as a PNG")
    ap.add_argument("--json", action="store_true", help="the table as one JSON object")
    args = ap.parse_args()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `profile.py x.blob | head` ends quietly
    try:
        if (args.device or read_blob(args.blob).target) == "dsp":
            return report(dsp_counts(args.blob, args.device), args.json, print_dsp_table)
        prof = profile(args.blob, args.device, args.runs)
        if args.trace:
            with open(args.trace, "w") as f:
                json.dump(trace(prof), f)
        if args.timeline:
            draw_run(prof).save(args.timeline)
    except (BlobError, ConfigError, InputError, DeviceError, DeviceTimeout, ValueError,
            OSError) as e:
        print(f"profile: {args.blob}: {e}", file=sys.stderr)
        return 2
    return report(summarize(prof), args.json, print_table)


if __name__ == "__main__":
    sys.exit(main())
