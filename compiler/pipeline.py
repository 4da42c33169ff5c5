"""The compile pipeline as a list of stages in one function (compile_model):
frontend -> algorithms (Winograd, padded columns) -> schedule -> place (per variant: buffers'
storage, one job per distinct kernel) -> kernels (codegen: plan, lower, simplify, pack,
vectorize, linearize, render) -> link (buffers, packed weights, launches, arena, barriers, one
weights region) -> build -> the Artifact, which compiler/blob.py writes."""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace

from compiler import toolchain
from compiler.algorithms import choose
from compiler.artifact import Artifact, Entry, State
from compiler.errors import CompileError
from compiler.codegen.build import Built, Job, build_all
from compiler.codegen.ranges import SAFE_MAX, Fp32Keep, keep_fp32, measure, samples
from compiler.ir.dtypes import dtypes
from compiler.ir.uop import Ops, UOp
from compiler.onnx.load import load_onnx
from compiler.ring import find_rings, make_rings, mirror_name, units, window_name
from compiler.renderers import get_renderer
from compiler.ir.kernel import Kernel
from compiler.link.buffers import Buffers
from compiler.link.link import Linked, Use, link
from compiler.schedule.fusion import schedule
from compiler.schedule.layout import canonical, channels_last, in_place, pad_in_place
from compiler.schedule.place import Placement, place
from compiler.schedule.storage import device_storage
from compiler.spec import Spec
from compiler.target import Target, get_target, variant_targets
from runner.format import DEFAULT_ENTRY, ENTRY_NAME, Region, entry_name_ok

VERSION = "0.1.0"


class Stages:
    """Per-stage wall time, counts (kernels built, taken from the cache...), and an optional
    progress callback for long stages."""

    def __init__(self, progress=None, report=None):
        self.times: dict[str, float] = {}
        self.counts: dict[str, dict[str, int]] = {}  # stage -> what it handled, by kind
        self.progress = progress
        self.report = report  # called with (stage, seconds, counts) as each top stage ends

    @contextmanager
    def __call__(self, name: str, **counts: int):
        """`counts`: what this run of the stage handles, known at its start (runs of one stage
        on several threads at once, the variants' builds, report their own)."""
        self.count(name, **counts)
        t, before = time.perf_counter(), dict(self.counts.get(name, {}))
        yield
        secs = time.perf_counter() - t
        self.times[name] = self.times.get(name, 0.0) + secs
        if self.report:  # what this run of the stage handled (a variant's build, say)
            now = self.counts.get(name, {})
            self.report(name, secs, counts or {k: n - before.get(k, 0) for k, n in now.items()})

    def count(self, stage: str, **counts: int) -> None:
        """Add to a stage's counts (a stage run once per variant adds up)."""
        mine = self.counts.setdefault(stage, {})
        for kind, n in counts.items():
            mine[kind] = mine.get(kind, 0) + n

    def tick(self, stage: str, done: int, total: int):
        if self.progress:
            self.progress(stage, done, total)


def compile_model(model, target: str | Target = "cpu", input_shapes: dict | None = None,
                  float16: bool = False, stages: Stages | None = None,
                  images: bool | None = None, writer=None, input_values: dict | None = None,
                  calibration: dict | None = None, overridable: tuple = (),
                  state: dict[str, str] | None = None, image_inputs=None) -> Artifact:
    """model: one ONNX model, or {entry name: ONNX model} for a blob of several entry points
    that share weights, state and the arena (docs/blob.md "entries"). state: {input: output}
    pairs made persistent in every entry that has them, beside each model's own metadata_props
    `keel.state` (docs/blob.md "state").
    images: GPU targets only, read eligible buffers as 2D images (None: the target's default);
    image_inputs: uint8 inputs read as R8 images (schedule/storage.py: a camera frame).
    writer: the blob.BlobWriter the weights stream to: each packed weight as it is made
    (`spill`), laid out in the blob file (`region`), written while the programs still build.
    input_values: {input name: value}, inputs frozen to constants (an If on them folds).
    calibration: float16's sample inputs by name, which decide what stays fp32 (_calibrate).
    overridable: inputs with an initializer that stay inputs, with it as their default
    (onnx/load.py load_onnx).
    A target with variants (`cpu`) is built once per variant from one frontend and schedule:
    the first variant's Artifact is returned, the others in its `variants` (one blob).
    The stages, in order; each one's output is read, never changed, by the ones after it
    (compiler/spec.py checks both under KEEL_SPEC=1)."""
    st, tgt, spec = stages or Stages(), get_target(target), Spec()
    targets, models = variant_targets(tgt), _entry_models(model)
    with st("frontend"):
        graphs = spec("frontend", _frontend(models, input_shapes or {}, float16, targets[0],
                                            state or {}, input_values or {}, tuple(overridable)))
        pairs = _state_pairs(graphs, state or {})
    with st("algorithms"):
        graphs = spec("algorithms", [choose(g, targets[0]) for g in graphs])
    with st("schedule"):
        sched = spec("schedule", _schedule(graphs, list(models), tgt, targets[0], pairs))
    keep = _calibrate(calibration if float16 else None, sched, targets[0], st)
    with st("place"):
        variants = spec("place", [_place(t, sched, float16, images, keep, image_inputs)
                                  for t in targets])
        st.count("place", kernels=len(sched.kernels),
                 programs=sum(len(v.jobs) for v in variants))
    built, early = _kernels(variants, st)
    spec("codegen", (variants, built))
    with st("link"):
        linked, weights = spec("link", link(
            [v.placed for v in variants], [v.uses for v in variants], built,
            [v.target.buffer_align for v in variants], graphs, [n for n, _ in sched.io], pairs,
            writer, lambda bufs: units(bufs, pairs, sched.rings)))
    if writer is not None:
        writer.weights(weights)
    sources = [_render(v.target, lk.buffers, b, st) for v, lk, b in zip(variants, linked, built)]
    # every variant's compilers at once: no core waits while another variant's last batch ends
    with ThreadPoolExecutor(len(variants)) as pool:
        codes = list(pool.map(lambda ts: _build(*ts, st), zip(targets, sources, early)))
    spec.unchanged()
    return _artifacts(tgt, variants, linked, codes, weights, graphs, models, pairs, sched,
                      float16, keep, st)


def _artifacts(tgt: Target, variants: list[Variant], linked: list[Linked], codes: list[bytes],
               weights, graphs: list, models: dict, pairs: dict, sched: Scheduled,
               float16: bool, keep: Fp32Keep, st: Stages) -> Artifact:
    """The first variant's Artifact, the others in its `variants`."""
    meta = _meta(graphs, float16, linked[0].buffers,
                 _fp16_report(keep, sched.nodes, sched.origins) if float16 else None, st)
    arts = []
    for v, lk, code in zip(variants, linked, codes):
        a = _artifact(tgt, v.target, lk.buffers, code, weights)
        a.meta, a.defaults = meta, lk.defaults
        a.provenance = provenance(v.uses, sched.nodes, sched.origins)
        a.entries = _entries(list(models), sched, lk.buffers)
        a.state = _state(pairs, sched.rings, lk.buffers)
        arts.append(a)
    arts[0].variants = arts[1:]
    return arts[0]


@dataclass(frozen=True)
class Scheduled:
    """The schedule stage's output: every entry's kernels end to end, and what provenance and
    calibration read of it."""
    inputs: list  # (name, UOp) of every entry's graph inputs, in entry order
    outputs: list  # (name, UOp) of every entry's graph outputs (folded), in entry order
    kernels: list[Kernel]
    last: frozenset  # tensors stored channels-last
    nodes: list  # the ONNX nodes, (name, op_type)
    origins: dict  # UOp -> index in nodes of the node that produced it
    counts: list[int]  # launches per entry
    rings: dict  # {state input: rows per run} of the queues made rings (compiler/ring.py)
    io: list[tuple[int, int]]  # per entry: its inputs and outputs (a ring's window and mirror
    # included: the frontend's graphs lack them)


@dataclass(frozen=True)
class Variant:
    """One build of the model for one target (a `cpu` blob holds two): its buffers' placement,
    one codegen job per distinct kernel, and its launches of them."""
    target: Target
    placed: Placement
    jobs: dict
    uses: list


def _place(t: Target, sched: Scheduled, float16: bool, images: bool | None,
           keep: Fp32Keep, image_inputs: dict | None) -> Variant:
    storage = device_storage(t, float16, images, frozenset(keep.buffers), image_inputs)
    placed = place(sched.kernels, sched.inputs, sched.outputs, storage)
    jobs, uses = _jobs(sched.kernels, placed, sched.last, t, keep.kernels)
    return Variant(t, placed, jobs, uses)


def _calibrate(calibration: dict | None, sched: Scheduled, tgt: Target, st: Stages) -> Fp32Keep:
    """float16 with sample inputs (by name: an input's shape, or a leading axis of samples
    more): the tensors and kernels that stay fp32 (codegen/ranges.py); meta "fp16_ranges"
    reports them. Nothing without samples, or where activations are fp32 anyway. A ring's
    window inputs (compiler/ring.py) are computed values, not fed."""
    if not calibration or not tgt.half_activations:
        return Fp32Keep()
    feeds = samples(calibration, [io for io in sched.inputs if io[1].op is Ops.INPUT])
    with st("calibrate", samples=len(feeds)):
        outs = [u for _, u in sched.outputs]
        return keep_fp32(sched.kernels, set(outs), measure(outs, feeds), len(feeds))


def _fp16_report(keep: Fp32Keep, nodes: list, origins: dict[UOp, int]) -> dict:
    """meta "fp16_ranges": whether sample ranges were checked, and each tensor kept fp32: the
    ONNX node that builds it (an op's inner tensor, an STFT's real part, is its node's) and its
    largest magnitude over the samples."""
    owner = dict(origins)
    for u, i in sorted(origins.items(), key=lambda ui: ui[1]):
        stack = list(u.src)
        while stack:
            x = stack.pop()
            if x not in owner:
                owner[x] = i
                stack.extend(x.src)
    kept = sorted(keep.largest.items(), key=lambda ul: owner.get(ul[0], -1))
    return {"calibrated": keep.samples > 0, "samples": keep.samples, "safe_max": SAFE_MAX,
            "kernels_fp32": len(keep.kernels),
            "kept_fp32": [{"node": nodes[owner[u]][0] if u in owner else None,
                           "op_type": nodes[owner[u]][1] if u in owner else None,
                           "largest": m} for u, m in kept]}


def _frontend(models: dict, input_shapes: dict, float16: bool, first: Target,
              state: dict, input_values: dict, overridable: tuple) -> list:
    """Each entry's ONNX model as a Graph; several entries' inputs get their entry's name as a
    prefix inside the IR, so equal input names of two entries stay two tensors."""
    return [load_onnx(m, input_shapes, float16=float16,
                      input_values=input_values, narrow_pad_divisor=first.narrow_pad_divisor,
                      hvx=first.hvx, overridable=overridable, state_inputs=frozenset(state),
                      prefix=f"{name}/" if len(models) > 1 else "",
                      other_shapes=len(models) > 1) for name, m in models.items()]


def _meta(graphs: list, float16: bool, bufs: Buffers, fp16_ranges: dict | None,
          st: Stages) -> dict:
    """bufs: the first variant's launches, whose per-launch work and L2 models it records."""
    gathers = {"gathers": bufs.gathers} if any(bufs.gathers) else {}  # tools/roofline.py
    return {"producer": f"keel {VERSION}", "float16": float16,
            **{k: v for g in reversed(graphs) for k, v in g.meta.items()},  # the first wins
            "flops": bufs.flops, **gathers,
            **({"memory": bufs.memory} if any(bufs.memory) else {}),
            **({"fp16_ranges": fp16_ranges} if fp16_ranges else {}),
            "stage_seconds": {k: round(v, 4) for k, v in st.times.items()}}


def _schedule(graphs: list, names: list[str], tgt: Target, first: Target,
              pairs: dict[str, str]) -> Scheduled:
    """Each entry's graph scheduled alone (no kernel spans two entries), its shifting queues
    made rings (compiler/ring.py), then put end to end. Several entries' kernels are named
    after their entry's index and name, made a C identifier (e1_1928x1208_run_policy_k0...):
    each schedule numbers its kernels from 0, and a program's name must be one kernel's."""
    done = []
    for g in graphs:
        g_outs, g_kernels, realized, tracked = schedule(
            [u for _, u in g.outputs], tuple(g.origins), tgt.recompute_cheap)
        g_kernels = _copies_for_shared_outputs(g_outs, g_kernels)
        done.append((g_outs, *_layouts(g_kernels, realized, set(g_outs), first), realized,
                     tracked))
    rings = find_rings([(g, d[0], d[1]) for g, d in zip(graphs, done)], pairs,
                       max(t.buffer_align for t in variant_targets(tgt)))
    inputs, names_out, outs, kernels, last, nodes, origins, counts, io = [], [], [], [], set(), \
        [], {}, [], []
    for i, (g, name, (g_outs, g_kernels, g_last, realized, tracked)) in enumerate(
            zip(graphs, names, done)):
        g_in, g_out = list(g.inputs), list(g.outputs)  # the schedule's own: rings add to them
        make_rings(g_in, g_out, g_outs, g_kernels, realized, pairs, rings)
        for u, j in zip(tracked, g.origins.values()):
            origins.setdefault(u, len(nodes) + j)
        if len(graphs) > 1:
            tag = f"e{i}_{re.sub(r'[^A-Za-z0-9_]', '_', name)}_"
            g_kernels = [replace(k, name=tag + k.name) for k in g_kernels]
        inputs += g_in
        names_out += [n for n, _ in g_out]
        io.append((len(g_in), len(g_out)))
        outs += g_outs
        kernels += g_kernels
        last |= g_last
        nodes += g.nodes
        counts.append(sum(k.root.size != 0 for k in g_kernels))  # _jobs: its launches
    return Scheduled(inputs, list(zip(names_out, outs)), kernels, frozenset(last), nodes, origins,
                     counts, rings, io)


def _entry_models(model) -> dict:
    if not isinstance(model, dict):
        return {DEFAULT_ENTRY: model}
    if not model or not all(entry_name_ok(n) for n in model):
        raise CompileError(f"entries: expected at least one, each named by "
                           f"{ENTRY_NAME.pattern!r}, got {list(model)}")
    return model


def _state_pairs(graphs: list, extra: dict[str, str]) -> dict[str, str]:
    """Every entry's state pairs as one {input: output}: a name pair is one state across entries;
    each is an input or an output of some entry, with one dtype and shape everywhere."""
    pairs = dict(extra)
    for g in graphs:
        for x, y in g.state.items():
            if pairs.setdefault(x, y) != y:
                raise CompileError(f"state {x!r}: replaced by output {pairs[x]!r} in one entry "
                                   f"and by {y!r} in another")
    outputs = set(pairs.values())
    if len(outputs) != len(pairs):
        raise CompileError(f"state: each output replaces one input, got {pairs}")
    for x, y in pairs.items():
        reads = [(g, u) for g in graphs for n, u in g.inputs if n == x]
        writes = [(g, u) for g in graphs for n, u in g.outputs if n == y]
        if not reads or not writes:
            raise CompileError(f"state {x}={y}: expected an entry with input {x!r} and one with "
                               f"output {y!r}; inputs are "
                               f"{sorted({n for g in graphs for n, _ in g.inputs})}, outputs "
                               f"{sorted({n for g in graphs for n, _ in g.outputs})}")
        found = reads + writes
        if len({(u.dtype, tuple(u.shape)) for _, u in found}) != 1:
            got = sorted({(str(u.dtype), tuple(u.shape)) for _, u in found})
            raise CompileError(f"state {x}={y}: the input and output must have one dtype and "
                               f"shape, got {got}")
        for g in graphs:
            if x in g.defaults and tuple(g.defaults[x].shape) != tuple(found[0][1].shape):
                raise CompileError(f"state {x}: initializer shape {g.defaults[x].shape} is not "
                                   f"the input's {tuple(found[0][1].shape)}")
    return pairs


def _entries(names: list[str], sched: Scheduled, bufs: Buffers) -> list[Entry]:
    """Each entry's io buffers and launch range: the launches are the entries' in order."""
    entries, n_in, n_out, first = [], 0, 0, 0
    for name, (k_in, k_out), count in zip(names, sched.io, sched.counts):
        ins, outs = bufs.inputs[n_in:n_in + k_in], bufs.outputs[n_out:n_out + k_out]
        entries.append(Entry(name, tuple(b.id for b in ins), tuple(b.id for b in outs), first,
                             count))
        n_in, n_out, first = n_in + k_in, n_out + k_out, first + count
    return entries


def _state(pairs: dict[str, str], rings: dict[str, int], bufs: Buffers) -> list[State]:
    def outs(name: str) -> tuple[int, ...]:
        return tuple(b.id for b in bufs.outputs if b.name == name)
    def ins(name: str) -> tuple[int, ...]:
        return tuple(b.id for b in bufs.inputs if b.name == name)
    return [State(x, ins(x), outs(y), bufs.inits.get(x), rings.get(x, 0),
                  outs(mirror_name(y)) if x in rings else (),
                  ins(window_name(y)) if x in rings else ())
            for x, y in pairs.items()]


def _kernels(variants: list[Variant], st: Stages) -> tuple[list[dict[tuple, Built]], list]:
    """Every variant's kernels, in one pool of workers kept busy; -> (built by (variant, key),
    per variant: toolchain.precompile's Early or None). A variant's kernels start compiling as
    soon as they are all built: beside the other variant's kernel builders, and while the
    launches, the arena and the weights are planned."""
    early, got, left = [None] * len(variants), {}, [len(v.jobs) for v in variants]

    def ready(key: tuple, built: Built) -> None:
        got[key], i = built, key[0]
        left[i] -= 1
        t, jobs = variants[i].target, variants[i].jobs
        if not left[i] and t.shared_object:
            early[i] = toolchain.precompile(get_renderer(t).kernel_units(
                [(got[i, k].name, got[i, k].piece) for k in jobs]), t.name)

    with st("kernels"):
        done = build_all({(i, k): j for i, v in enumerate(variants) for k, j in v.jobs.items()},
                         st, ready)
    return [{k: done[i, k] for k in v.jobs} for i, v in enumerate(variants)], early


def _render(tgt: Target, bufs: Buffers, built: dict, st: Stages):
    """The program: the kernels (rendered by codegen) and the entry points over the launches."""
    with st("assemble"):
        return get_renderer(tgt).render_program([(b.name, b.piece) for b in built.values()],
                                                bufs.launches, bufs.by_id())


def _build(tgt: Target, source, early, st: Stages) -> bytes:
    """`early`: toolchain.precompile's objects for the kernels."""
    counts = toolchain.cached_units(source, tgt.name, early) if tgt.shared_object else {}
    with st("build", **counts):
        if tgt.shared_object:
            return toolchain.build_shared(source, tgt.name, early)
        if tgt.code_object:
            return toolchain.build_code_object(source, tgt.code_object)
        return source.encode()


def _artifact(blob_tgt: Target, tgt: Target, bufs: Buffers, code: bytes,
              weights: tuple[bytes, tuple[int, ...]]) -> Artifact:
    """One target's Artifact (meta and provenance are the caller's)."""
    return Artifact(
        target=blob_tgt.name, inputs=bufs.inputs, outputs=bufs.outputs,
        buffers=list(bufs.by_id().values()), weights=weights[0], weight_sections=weights[1],
        arena_bytes=bufs.arena_bytes, arena_lower_bound_bytes=bufs.lower_bound,
        launches=bufs.launches, programs=code,
        variant=tgt.name if tgt.name != blob_tgt.name else "")


def provenance(uses: list[Use], nodes: list[tuple[str, str]], origins: dict[UOp, int]) -> dict:
    """Per launch, the ONNX nodes it computes (docs/blob.md, "provenance"): every tensor some
    node produced between the kernel's root and the realized tensors it reads. A node folded into
    the weights at compile time, or one whose output is another's (Identity), runs in no launch.
    Only nodes some launch computes are listed, so the table stays small."""
    per = []
    for use in uses:
        k, found = use.kernel, set()
        stop, seen, stack = set(k.inputs), set(), [k.root]
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            if u in origins and (u is k.root or u not in stop):
                found.add(origins[u])
            if u not in stop:
                stack.extend(u.src)
        per.append(sorted(found))
    index = {n: j for j, n in enumerate(sorted({i for p in per for i in p}))}
    return {"nodes": [list(nodes[i]) for i in index],
            "launches": [[index[i] for i in p] for p in per]}


def _copies_for_shared_outputs(outs: list[UOp], kernels: list[Kernel]) -> list[Kernel]:
    """Two graph outputs that are the same tensor need two buffers: the second one copies."""
    seen, extra = set(), []
    for u in outs:
        if u in seen:
            extra.append(Kernel(f"k{len(kernels) + len(extra)}_copy", u, [u]))
        seen.add(u)
    return kernels + extra


def _layouts(kernels: list[Kernel], realized: set, keep: set,
             tgt: Target) -> tuple[list[Kernel], set[UOp]]:
    """(kernels, tensors stored channels-last): CPU layouts and buffer reuse; other targets keep
    every buffer as the graph has it."""
    if not tgt.cpu_layouts:
        return kernels, set()
    kernels = pad_in_place(kernels, realized, keep)
    last = channels_last(kernels, realized, keep)
    return in_place(kernels, realized, last, keep), last


def _jobs(kernels: list[Kernel], placed: Placement, last: frozenset, tgt: Target,
          fp32: set = frozenset()) -> tuple[dict[tuple, Job], list[Use]]:
    """One job per distinct canonical kernel, and the launches that use them. `fp32`: roots of
    kernels that compute in fp32 under float16 (codegen/ranges.py)."""
    jobs: dict[tuple, Job] = {}
    uses = []
    for k, out in zip(kernels, placed.writes):
        if k.root.size == 0:  # writes nothing: an empty tensor needs a buffer but no launch
            continue
        layouts = [placed.layout_of(out)] + [placed.layout(u) for u in k.inputs]
        key, ck = canonical(k, layouts, last)
        key = (key, k.root in fp32)
        if key not in jobs:
            packable = {j: u.size for j, (u, lay) in enumerate(zip(k.inputs, layouts[1:]), 1)
                        if lay.region is Region.WEIGHTS and lay.image is None and tgt.pack_weights}
            arena = {j for j, lay in enumerate(layouts) if lay.region is Region.ARENA}
            jobs[key] = Job(ck, [dtypes.from_np(lay.dtype) for lay in layouts], tgt, packable,
                            arena, k.root in fp32, tuple(lay.image for lay in layouts))
        uses.append(Use(k, out, key))
    return jobs, uses
