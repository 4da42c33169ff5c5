"""Shifting queues in state become rings (docs/blob.md "Entries and state", runner/state.py).

A state pair X -> Y whose every writing entry computes Y = Concat(Slice(X, k..), N) on axis 0
(openpilot's frame and feature histories) keeps M - k of its M rows and shifts k new ones in.
As a ping-pong state, each run copies the M - k kept rows into the other half. As a ring, the
runner keeps the rows in place (stored twice, so every window of M rows is contiguous) and
binds, per run, X to the queue's current window, Y's new rows and their mirror (second copy)
to where they go, and Y's window (the next one) to an input that the run's readers of Y read.

So after scheduling, each writing entry's kernel for Y becomes the kernel for N alone (what it
read, realized as the scheduler chose: a warp's coordinates stay their own kernel), writing
Y's k rows, and the entry ends with a kernel writing them again into the mirror (N computed
again where that is cheap, else copied: `_mirror`); Y's readers, later in the same launch
order, read the window input. The three alias one memory, which the launches' barriers are
told (`units`). Nothing of the kept rows is copied.

A queue stays ping-pong when any entry writes it otherwise, when k does not divide M, or when
k rows are not a whole number of the target's buffer alignment (each window and row block
starts k rows apart, and kernels read io buffers at that alignment).
"""
from __future__ import annotations

import math
from dataclasses import replace

from compiler.ir.uop import Ops, UOp
from compiler.schedule.fusion import Kernel, inlined, kernel_of


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


def find_rings(scheduled: list, pairs: dict[str, str], align: int) -> dict[str, int]:
    """{state input: k} for the pairs that become rings (see the module docstring).
    `scheduled`: per entry, (its frontend Graph, its folded outputs, its kernels)."""
    out = {}
    for x, y in pairs.items():
        found = set()
        for g, outs, kernels in scheduled:
            names = [n for n, _ in g.outputs]
            if y in names:
                full = outs[names.index(y)]
                got = new_rows(full, dict(g.inputs)[x]) if x in dict(g.inputs) else None
                own = any(kn.root is full and kn.into is None for kn in kernels)
                found.add(got[0] if got and own else None)
        k = found.pop() if len(found) == 1 else None
        taken = any(n in (mirror_name(y), window_name(y)) for g, _, _ in scheduled
                    for n, _ in (*g.inputs, *g.outputs))
        if k and not taken:
            u = next(u for g, _, _ in scheduled for n, u in g.inputs if n == x)
            if u.shape[0] % k == 0 and k * math.prod(u.shape[1:]) * u.dtype.itemsize % align == 0:
                out[x] = k
    return out


def mirror_name(y: str) -> str:
    return f"{y}.mirror"


def window_name(y: str) -> str:
    return f"{y}.window"


def make_rings(inputs: list, outputs: list, outs: list[UOp], kernels: list[Kernel],
               realized: set, pairs: dict[str, str], rings: dict[str, int]) -> None:
    """One entry's kernels, folded outputs and (name, UOp) inputs and outputs (the schedule's
    own lists, never the frontend's), rings made in place: Y's kernel computes N alone into Y's
    output, a last copy puts it into Y's mirror, Y's readers read Y's window."""
    for x in rings:
        y, names = pairs[x], [n for n, _ in outputs]
        if y not in names:
            continue
        j = names.index(y)
        full = outs[j]
        new = new_rows(full, dict(inputs)[x])[1]
        i = next(i for i, kn in enumerate(kernels) if kn.root is full and kn.into is None)
        prefix = kernels[i].name.split("_", 1)[0]  # k<n>: the number of Y's kernel
        writer = _writer(new, kernels, realized, prefix)
        kernels[i:i + 1] = writer
        # last: the run's readers of Y read the copy the runner binds Y's rows to (the one in
        # the next window), so the mirror can wait, where a barrier is most likely there anyway
        kernels.append(_mirror(new, writer, realized, prefix))
        outs[j], outputs[j] = new, (y, new)
        outs.append(new)
        outputs.append((mirror_name(y), new))
        if any(full in kn.inputs for kn in kernels):
            inputs.append((window_name(y), full))


def _writer(new: UOp, kernels: list[Kernel], realized: set, prefix: str) -> list[Kernel]:
    """The kernel that writes N into Y's output: none where N's own kernel does (it is then
    the output's writer, compiler/schedule/place.py), a copy where N is realized into
    another tensor's buffer, else N computed from what Y's kernel read."""
    if new.op not in (Ops.INPUT, Ops.WEIGHT) and new in realized:
        if any(kn.root is new and kn.into is None for kn in kernels):
            return []
        return [Kernel(f"{prefix}_rows", new, [new])]
    return [kernel_of(new, realized, prefix)]


def _mirror(new: UOp, writer: list[Kernel], realized: set, prefix: str) -> Kernel:
    """N again, into Y's mirror: computed again where that reads at most twice N's bytes and
    no reduction or gather (then it waits for no barrier after N's write: a threaded CPU graph
    or a GPU stream pays one per barrier), else copied from Y's rows."""
    if writer and writer[0].inputs != [new] and \
            not any(n.op in (Ops.REDUCE, Ops.GATHER) for n in inlined(new, realized)) and \
            sum(u.size * u.dtype.itemsize for u in writer[0].inputs) <= \
            2 * new.size * new.dtype.itemsize:
        return replace(writer[0], name=f"{prefix}_mirror")
    return Kernel(f"{prefix}_mirror", new, [new])


def units(bufs, pairs: dict[str, str], rings: dict[str, int]) -> dict[int, int]:
    """{io buffer id: unit} for hazards.mark_barriers: a ring's new rows and its window are one
    memory (runner/state.py binds the rows inside the window); the mirror, the rows' other
    copy, lies outside the window and the rows."""
    out = {}
    for x in rings:
        y = pairs[x]
        ids = [b.id for b in bufs.table.values() if (b.region, b.name) in
               (("output", y), ("input", window_name(y)))]
        out.update({i: ids[0] for i in ids})
    return out
