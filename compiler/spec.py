"""The IR spec check, on with KEEL_SPEC=1 (tests turn it on: tests/conftest.py): each stage's
output is validated as the stage ends, and at the end of the compile every stage's output must
be as it was when its stage ended, so no stage changed what an earlier one produced. Off, it
costs nothing but a call per stage."""
from __future__ import annotations

import math
import os

from compiler.ir.uop import Ops
from runner.format import IO_REGIONS, Region


class SpecError(AssertionError):
    """A stage's output breaks the IR's rules, or a later stage changed it: a compiler bug."""


class Spec:
    def __init__(self, on: bool | None = None):
        self.on = os.environ.get("KEEL_SPEC") == "1" if on is None else on
        self.seen: list[tuple[str, object, tuple]] = []  # (stage, output, its fingerprint)

    def __call__(self, stage: str, value):
        """Check that the earlier stages' outputs are as they were, then `stage`'s own, and
        remember it; returns it."""
        if self.on:
            self.unchanged()
            CHECKS[stage](value)
            self.seen.append((stage, value, FINGERPRINTS[stage](value)))
        return value

    def unchanged(self) -> None:
        for stage, value, before in self.seen:
            if FINGERPRINTS[stage](value) != before:
                raise SpecError(f"stage {stage!r}: its output changed after it ended")


def _fail(stage: str, what: str) -> None:
    raise SpecError(f"stage {stage!r}: {what}")


# ---- what each stage's output must satisfy -------------------------------------------------
def _frontend(graphs: list, stage: str = "frontend") -> None:
    for g in graphs:
        names = [n for n, _ in g.inputs]
        if len(set(names)) != len(names) or not g.outputs:
            _fail(stage, f"expected unique input names and an output, got inputs {names}")


def _schedule(s) -> None:
    names, written = [k.name for k in s.kernels], {u for _, u in s.inputs}  # a ring's window
    # is an input whose value a kernel of the graph computed (compiler/ring.py)
    if len(set(names)) != len(names):
        _fail("schedule", f"kernel names repeat: {sorted(n for n in names if names.count(n) > 1)}")
    for k in s.kernels:
        for u in k.inputs:
            if u not in written and u.op not in (Ops.INPUT, Ops.WEIGHT):
                _fail("schedule", f"kernel {k.name} reads a {u.op} no earlier kernel writes")
        written.update((k.root, k.into))


def _place(variants: list) -> None:
    for v in variants:
        p, n_in = v.placed, v.placed.n_inputs
        if [b.id for b in p.buffers] != list(range(len(p.buffers))):
            _fail("place", "buffer ids are not their positions")
        io = [(b.region, b.slot) for b in p.buffers if b.region in IO_REGIONS]
        want = [(Region.INPUT, i) for i in range(n_in)]
        if io[:n_in] != want or [p.buffers[b].slot for b in p.outputs] != \
                list(range(n_in, n_in + len(p.outputs))):
            _fail("place", f"io slots: inputs 0..{n_in - 1} then outputs in order, got {io}")


def _codegen(vb) -> None:
    variants, built = vb
    for v, b in zip(variants, built):
        if b.keys() != v.jobs.keys():
            _fail("codegen", f"{v.target.name}: a job without its program")
        for p in (x.plan for x in b.values()):
            for d, size in enumerate(p.full_shape):
                got = math.prod(a.size for a in p.axes if a.dim == d)
                if got != size:
                    _fail("codegen", f"plan axes of dim {d} cover {got}, the shape has {size}")


def _link(out) -> None:
    linked, (region, sizes) = out
    for lk in linked:
        table, bufs = lk.buffers.by_id(), lk.buffers
        for ln in bufs.launches:
            if any(a not in table for a in ln.args):
                _fail("link", f"launch {ln.kernel} names a buffer not in the table: {ln.args}")
        for b in table.values():
            end = b.offset + b.nbytes
            if b.region is Region.ARENA and end > bufs.arena_bytes or \
                    b.region is Region.WEIGHTS and end > len(region):
                _fail("link", f"buffer {b.id} [{b.offset}, {end}) outside its {b.region}")


CHECKS = {"frontend": _frontend, "algorithms": lambda gs: _frontend(gs, "algorithms"),
          "schedule": _schedule, "place": _place, "codegen": _codegen, "link": _link}


# ---- what must not change once a stage has ended ---------------------------------------------
def _kernel(k) -> tuple:
    return k.name, id(k.root), tuple(map(id, k.inputs)), id(k.into)


def _job(j) -> tuple:
    return (_kernel(j.kernel), tuple(j.param_dtypes), tuple(sorted(j.packable.items())),
            tuple(sorted(j.arena)), j.float32, j.images)


def _graphs(gs) -> tuple:
    return tuple((tuple((n, id(u)) for n, u in g.inputs), tuple((n, id(u)) for n, u in g.outputs),
                  tuple(map(id, g.origins))) for g in gs)


FINGERPRINTS = {
    "frontend": _graphs, "algorithms": _graphs,
    "schedule": lambda s: (tuple(map(_kernel, s.kernels)), tuple(map(id, s.last)),
                           tuple((n, id(u)) for n, u in s.outputs), tuple(s.counts),
                           len(s.nodes), len(s.origins)),
    "place": lambda vs: tuple((v.placed.buffers, v.placed.writes, tuple(v.placed.reads.items()),
                               tuple((k, _job(j)) for k, j in v.jobs.items()),
                               tuple((_kernel(u.kernel), u.out, u.key) for u in v.uses))
                              for v in vs),
    "codegen": lambda vb: tuple(tuple((k, b.name, b.plan, tuple(b.packings.items()),
                                       b.piece) for k, b in built.items())
                                for built in vb[1]),
    "link": lambda out: tuple((tuple(lk.buffers.table.items()), tuple(lk.buffers.launches),
                               lk.buffers.arena_bytes, repr(lk.defaults)) for lk in out[0]),
}
