"""Hazards: which launches must wait for the ones before them. One pass that every backend's
execution order follows: the CPU's threaded graph puts a spin barrier there, a GPU command stream
a wait-for-idle, and the blob's replay table carries it as each launch's barrier flag."""
from __future__ import annotations

from dataclasses import replace

from compiler.artifact import Buffer, Launch
from runner.format import DEVICE_REGIONS


def mark_barriers(launches: list[Launch], buffers: dict[int, Buffer],
                  units: dict[int, int] | None = None) -> list[Launch]:
    """Set `barrier` on each launch that reads or writes memory written since the last barrier,
    or writes memory read since then. Arena and weights memory overlaps by byte range; an io
    slot is one unit of its own, but the io buffers `units` maps to one id are one unit (a
    ring's, compiler/ring.py: the runner binds them into one memory)."""
    units = units or {}

    def span(b: Buffer):
        if b.id in units:
            return ("ring", units[b.id], units[b.id] + 1)
        return (b.region, b.offset, b.offset + b.nbytes) if b.region in DEVICE_REGIONS \
            else (b.region, b.slot, b.slot + 1)

    def hits(a, spans) -> bool:
        return any(a[0] == s[0] and a[1] < s[2] and s[1] < a[2] for s in spans)

    out, written, read = [], [], []
    for ln in launches:
        w = span(buffers[ln.args[0]])
        r = [span(buffers[b]) for b in ln.args[1:]]
        sync = hits(w, written) or hits(w, read) or any(hits(x, written) for x in r)
        if sync:
            written, read = [], []
        out.append(replace(ln, barrier=sync))
        written.append(w)
        read.extend(r)
    return out
