"""Pipeline: Models on different devices run as the stages of one frame, in one call under one
deadline, each stage's outputs bound as the next stage's inputs with no copy by the host
(openpilot's WARP_DEV: the warp on the Adreno, the models on the USB GPU; docs/modeld.md "Two
devices").

    pipe = Pipeline([warp, model])   # Model.load(warp_blob, "qcom"), Model.load(model_blob, "amd")
    out = pipe.run(feeds, entries=("1344x760/warp", "run_policy"), timeout_ms=50)

Links: an output of stage i's entry and an input of stage i + 1's entry with the same name (the
warp's `planes`, the model's `planes`) are linked. Stage i writes it into its own io memory
(Model.output_buffer) and stage i + 1's input is bound to that memory: a device binding another
device's io_buffer (runner/device.py, Device.bind), the same code for every pair of backends.
Every other input comes from `feeds` by name; run() returns every stage's outputs that are not
linked.

A frame: every stage's feeds are checked and bound first, so nothing is submitted for a frame
any stage would refuse. Then stage by stage, each submission after the one before it has
completed, all under the frame's deadline. Once the last stage has completed, every stage's
state writes become its state. A stage that fails or misses the deadline drops the whole frame:
no stage after it is submitted and no stage's state changes (its ping-pong, runner/state.py,
does not flip), and that stage recovers before its next run.

The relay. Stage B may start only once stage A has completed, and two devices with no fence in
common (KGSL and a GPU behind a USB bridge) cannot wait for each other, so the host relays A's
completion: it blocks in A's wait (qcom: a KGSL timestamp wait, woken by the retire interrupt),
then submits B, whose command stream was recorded at load and whose bindings were decided before A
started: what is left between the two is B's kick, which on amd carries B's staged inputs (the
linked planes) in the same staging write over USB and the same doorbell. A device-side wait would
need B's queue to read A's timeline: a WAIT_REG_MEM at the head of B's recorded stream on a word
that A's queue writes last (qcom's ring entry ends in a CP_MEM_WRITE of the timeline value), in
memory both devices reach. On a comma 3X no such word exists: the Adreno writes system memory, and
the USB GPU reads only its VRAM and the bridge's SRAM window, which nothing but the host fills. And
B's inputs have to cross USB after A has written them anyway (docs/modeld.md).
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from runner.errors import DeviceTimeout, InputError
from runner.graph import Entry
from runner.model import _PROCESS, Model, _checked_timeout


@dataclass
class _Stage:
    """One stage of a frame: its Model, the entry it runs and its links to its neighbours."""
    model: Model
    entry: Entry
    reads: dict[str, np.ndarray] = field(default_factory=dict)  # linked input -> where it lies
    keep: dict[str, np.ndarray] = field(default_factory=dict)  # linked output -> its io memory


class Pipeline:
    def __init__(self, stages: Sequence[Model]):
        if not stages or not all(isinstance(m, Model) for m in stages):
            raise InputError(f"Pipeline: expected a list of Models, got {stages!r}")
        self.stages = list(stages)
        self._frames: dict[tuple, list[_Stage]] = {}  # entries -> its stages, resolved once

    def run(self, feeds: Mapping, entries: Sequence[str], out: Mapping | None = None,
            timeout_ms: float | None = None) -> dict[str, np.ndarray]:
        """One frame: `entries` names each stage's entry; `out` optionally holds arrays for
        unlinked outputs (as Model.run's out=). DeviceTimeout / DeviceError: the frame was
        dropped (see above)."""
        for m in self.stages:  # as Model.run: a forked child fails at once, before any lock
            if _PROCESS[0] != m._pid:
                m._forked()
        timeout_ms = _checked_timeout(max(m.timeout_ms for m in self.stages)
                                      if timeout_ms is None else timeout_ms)
        stages = self._resolve(tuple(entries))
        _check_names(stages, feeds, out or {})
        held = []
        try:
            for st in stages:
                if not st.model._lock.acquire(timeout=timeout_ms / 1000):
                    raise DeviceTimeout(f"another run() on stage {st.entry.name!r}'s Model did "
                                        f"not finish within {timeout_ms} ms")
                held.append(st.model)
            return self._frame(stages, feeds, out or {}, timeout_ms)
        finally:
            for m in held:
                m._lock.release()

    def _frame(self, stages: list[_Stage], feeds: Mapping, out: Mapping,
               timeout_ms: float) -> dict[str, np.ndarray]:
        plans = []
        for st in stages:
            mine = {**{s.name: feeds[s.name] for s in st.entry.inputs if s.name in feeds},
                    **st.reads}
            writes = {**{s.name: out[s.name] for s in st.entry.outputs if s.name in out},
                      **st.keep}
            plans.append(st.model._prepare(st.entry, mine, writes))
        deadline = time.monotonic() + timeout_ms / 1000
        for st in stages:
            dev = st.model.device
            try:  # the relay: this stage's wait returns before the next stage's submit
                dev.wait(dev.submit(deadline, st.entry.launches), deadline)
            except BaseException as err:
                st.model._failed(err, timeout_ms)
                raise
        results = {}
        for st, plan in zip(stages, plans):
            done = st.model._finish(st.entry, plan)
            results.update((k, v) for k, v in done.items() if k not in st.keep)
        return results

    def _resolve(self, entries: tuple) -> list[_Stage]:
        stages = self._frames.get(entries)
        if stages is not None:
            return stages
        if len(entries) != len(self.stages):
            raise InputError(f"Pipeline.run: expected one entry per stage ({len(self.stages)}), "
                             f"got {list(entries)}")
        stages = [_Stage(m, m.graph.entry(name)) for m, name in zip(self.stages, entries)]
        for before, after in zip(stages, stages[1:]):
            made = {s.name: s for s in before.entry.outputs}
            for s in after.entry.inputs:
                src = made.get(s.name)
                if src is None:
                    continue
                if (src.shape, src.dtype) != (s.shape, s.dtype):
                    raise InputError(f"Pipeline: {before.entry.name!r} writes {s.name!r} as "
                                     f"{src.dtype} {src.shape}, {after.entry.name!r} reads it "
                                     f"as {s.dtype} {s.shape}")
                memory = before.model.output_buffer(s.name, before.entry.name)
                before.keep[s.name] = after.reads[s.name] = memory
        results = [s.name for st in stages for s in st.entry.outputs if s.name not in st.keep]
        if len(set(results)) < len(results):
            raise InputError(f"Pipeline: entries {list(entries)} return outputs {results}: "
                             f"expected distinct names")
        self._frames[entries] = stages
        return stages


def _check_names(stages: list[_Stage], feeds, out) -> None:
    """Feeds name unlinked inputs of some stage, out= unlinked outputs; typed errors otherwise
    (Model.run checks the arrays themselves)."""
    if not isinstance(feeds, Mapping) or not isinstance(out, Mapping):
        raise InputError(f"Pipeline.run: feeds and out are dicts {{name: numpy.ndarray}}, got "
                         f"{type(feeds).__name__} and {type(out).__name__}")
    linked = {n for st in stages for n in st.reads}
    inputs = {s.name for st in stages for s in st.entry.inputs} - linked
    outputs = {s.name for st in stages for s in st.entry.outputs} - linked
    if linked & set(feeds):
        raise InputError(f"Pipeline.run: {sorted(linked & set(feeds))} come from the stage "
                         f"before; do not feed them")
    for what, given, known in (("feeds", feeds, inputs), ("out", out, outputs)):
        extra = sorted(map(str, set(given) - known))
        if extra:
            raise InputError(f"Pipeline.run: {what} names {extra}; expected names among "
                             f"{sorted(known)}")
