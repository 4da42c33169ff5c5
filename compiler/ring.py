"""Shifting queues in state become rings (docs/blob.md "Entries and state", runner/state.py).

A state pair X -> Y whose every writing entry computes Y = Concat(Slice(X, k..), N) on axis 0
(openpilot's frame and feature histories) keeps M - k of its M rows and shifts k new ones in.
As a ping-pong state, each run copies the M - k kept rows into the other half. As a ring, the
runner keeps the queue's rows in place and binds X to the queue's current window, so the graph
only has to write N: the entry's output Y becomes N (k rows), plus a second output, Y's mirror,
a copy of N that the runner binds to the other copy of the same rows (the ring is stored twice
so that every window is contiguous). Readers of Y in the same run still read
Concat(Slice(X, k..), N): X's window and N's rows, nothing copied.

A queue stays ping-pong when any entry writes it otherwise, when k does not divide M, or when
k rows are not a whole number of the target's buffer alignment (each window and row block
starts k rows apart, and kernels read io buffers at that alignment).
"""
from __future__ import annotations

import math

from compiler.ir.uop import Ops, UOp


def new_rows(y: UOp, x: UOp) -> tuple[int, UOp] | None:
    """(k, N) when y is Concat(Slice(x, k..), N) on axis 0 as the frontend builds it
    (Tensor.cat: a sum of zero-padded views), else None."""
    if y.op is not Ops.ADD or x.shape != y.shape or not x.shape:
        return None
    m, rest = x.shape[0], tuple((0, 0) for _ in x.shape[1:])
    for kept, new in (y.src, y.src[::-1]):
        if kept.op is not Ops.PAD or new.op is not Ops.PAD or kept.src[0].op is not Ops.SHRINK:
            continue
        shrink = kept.src[0]
        k = shrink.arg[0][0] if shrink.arg else 0
        if shrink.src[0] is x and 0 < k < m and \
                shrink.arg == ((k, m), *((0, d) for d in x.shape[1:])) and \
                kept.arg == (((0, k), *rest), 0) and new.arg == (((m - k, 0), *rest), 0):
            return k, new.src[0]
    return None


def find_rings(graphs: list, pairs: dict[str, str], align: int) -> dict[str, int]:
    """{state input: k} for the pairs that become rings (see the module docstring)."""
    out = {}
    for x, y in pairs.items():
        found = set()
        for g in graphs:
            ins, outs = dict(g.inputs), dict(g.outputs)
            if y in outs:
                got = new_rows(outs[y], ins[x]) if x in ins else None
                found.add(got and got[0])
        k = found.pop() if len(found) == 1 else None
        taken = any(n == mirror_name(y) for g in graphs for n, _ in g.outputs)
        if k and not taken:
            u = next(u for g in graphs for n, u in g.inputs if n == x)
            m = u.shape[0]
            if m % k == 0 and k * math.prod(u.shape[1:]) * u.dtype.itemsize % align == 0:
                out[x] = k
    return out


def mirror_name(y: str) -> str:
    return f"{y}.mirror"


def make_rings(graphs: list, pairs: dict[str, str], rings: dict[str, int]) -> None:
    """Each ring's writing entries output N as Y and again as Y's mirror (in place)."""
    for x, k in rings.items():
        y = pairs[x]
        for g in graphs:
            ins = dict(g.inputs)
            for j, (name, u) in enumerate(g.outputs):
                if name == y:
                    n = new_rows(u, ins[x])[1]
                    g.outputs[j] = (y, n)
                    g.outputs.append((mirror_name(y), n))
