"""The compile pipeline as a list of passes in one function:
frontend -> schedule -> layout -> per variant: kernels (plan, lower, simplify, linearize) ->
memory plan -> shared weights -> per variant: render -> build."""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from compiler import toolchain
from compiler.artifact import Artifact, Entry, State
from compiler.blob import share_weights
from compiler.errors import CompileError
from compiler.codegen.build import Built, Job, build_all
from compiler.codegen.ranges import SAFE_MAX, Fp32Keep, keep_fp32, measure, samples
from compiler.ir.dtypes import dtypes
from compiler.ir.uop import UOp
from compiler.onnx.load import load_onnx
from compiler.renderers import get_renderer
from compiler.schedule.buffers import Buffers
from compiler.ir.kernel import Kernel
from compiler.schedule.fusion import schedule
from compiler.schedule.layout import canonical, channels_last, in_place, pad_in_place
from compiler.schedule.hazards import mark_barriers
from compiler.schedule.storage import device_storage
from compiler.target import LINE_BYTES, Target, get_target, variant_targets
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
                  images: bool | None = None, writer=None,
                  input_values: dict | None = None,
                  calibration: dict | None = None, overridable: tuple = (),
                  state: dict[str, str] | None = None) -> Artifact:
    """model: one ONNX model, or {entry name: ONNX model} for a blob of several entry points
    that share weights, state and the arena (docs/blob.md "entries"). state: {input: output}
    pairs made persistent in every entry that has them, beside each model's own metadata_props
    `keel.state` (docs/blob.md "state").
    images: GPU targets only, read eligible buffers as 2D images (None: the target's default).
    writer: the blob.BlobWriter the weights stream to: each packed weight as it is made
    (`spill`), laid out in the blob file (`region`), written while the programs still build.
    input_values: {input name: value}, inputs frozen to constants (an If on them folds).
    calibration: float16's sample inputs by name, which decide what stays fp32 (_calibrate).
    overridable: inputs with an initializer that stay inputs, with it as their default
    (onnx/load.py load_onnx).
    A target with variants (`cpu`) is built once per variant from one frontend and schedule:
    the first variant's Artifact is returned, the others in its `variants` (one blob)."""
    st, tgt = stages or Stages(), get_target(target)
    targets = variant_targets(tgt)
    models = _entry_models(model)
    with st("frontend"):
        graphs = _frontend(models, input_shapes or {}, float16, targets[0], state or {},
                           input_values or {}, tuple(overridable))
        pairs = _state_pairs(graphs, state or {})
    with st("schedule"):
        outs, kernels, last, nodes, origins, counts = _schedule(graphs, list(models), tgt,
                                                                targets[0])
        inputs = [io for g in graphs for io in g.inputs]
        keep = _calibrate(calibration if float16 else None, inputs, kernels, outs, targets[0], st)
        plans = []  # per variant: (target, its buffers, one job per distinct kernel, launches)
        for t in targets:
            bufs = Buffers(inputs, list(zip([n for g in graphs for n, _ in g.outputs], outs)),
                           device_storage(t, float16, images, frozenset(keep.buffers)),
                           t.buffer_align, writer and writer.spill)
            plans.append((t, bufs, *_jobs(kernels, bufs, last, t, keep.kernels)))
        st.count("schedule", kernels=len(kernels), programs=sum(len(p[2]) for p in plans))
    done, early = _kernels(plans, st)
    builds = [(t, bufs, _launch(bufs, {k: done[i, k] for k in jobs}, uses, st), uses)
              for i, (t, bufs, jobs, uses) in enumerate(plans)]
    defaults = [_defaults(bufs, graphs, pairs) for _, bufs, _, _ in builds]
    weights = share_weights([bufs for _, bufs, _, _ in builds], writer and writer.region)
    if writer is not None:
        writer.weights(weights)
    sources = [_render(t, bufs, built, st) for t, bufs, built, _ in builds]
    # every variant's compilers at once: no core waits while another variant's last batch ends
    with ThreadPoolExecutor(len(builds)) as pool:
        codes = pool.map(lambda ts: _build(*ts, st), zip(targets, sources, early))
    arts = [_artifact(tgt, t, bufs, code, weights)
            for (t, bufs, _, _), code in zip(builds, codes)]
    meta = _meta(graphs, float16, builds[0][1].flops,
                 _fp16_report(keep, nodes, origins) if float16 else None, st)
    for a, (_, bufs, _, uses), d in zip(arts, builds, defaults):
        a.meta, a.provenance, a.defaults = meta, provenance(uses, nodes, origins), d
        a.entries, a.state = _entries(list(models), graphs, bufs, counts), \
            _state(pairs, bufs)
    arts[0].variants = arts[1:]
    return arts[0]


def _calibrate(calibration: dict | None, inputs: list, kernels: list[Kernel], outs: list[UOp],
               tgt: Target, st: Stages) -> Fp32Keep:
    """float16 with sample inputs (by name: an input's shape, or a leading axis of samples
    more): the tensors and kernels that stay fp32 (codegen/ranges.py); meta "fp16_ranges"
    reports them. Nothing without samples, or where activations are fp32 anyway."""
    if not calibration or not tgt.half_activations:
        return Fp32Keep()
    feeds = samples(calibration, inputs)
    with st("calibrate", samples=len(feeds)):
        return keep_fp32(kernels, set(outs), measure(outs, feeds), len(feeds))


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
    # outputs padded to a cache line of float32: whole vectors at every CPU width (wider
    # multiples, for wider register tiles, measured slower: 2.36 ms at 16, 2.52 at 48)
    return [load_onnx(m, input_shapes, float16=float16, winograd=first.winograd,
                      pad_columns=LINE_BYTES // 4 if first.cpu_layouts else 0,
                      input_values=input_values, narrow_pad_divisor=first.narrow_pad_divisor,
                      hvx=first.hvx, overridable=overridable, state_inputs=frozenset(state), prefix=f"{name}/" if len(models) > 1 else "",
                      other_shapes=len(models) > 1) for name, m in models.items()]


def _meta(graphs: list, float16: bool, flops, fp16_ranges: dict | None, st: Stages) -> dict:
    return {"producer": f"keel {VERSION}", "float16": float16,
            **{k: v for g in reversed(graphs) for k, v in g.meta.items()},  # the first wins
            "flops": flops, **({"fp16_ranges": fp16_ranges} if fp16_ranges else {}),
            "stage_seconds": {k: round(v, 4) for k, v in st.times.items()}}


def _defaults(bufs: Buffers, graphs: list, pairs: dict[str, str]) -> list[list[int]]:
    """Stores the states' initial values (weights with the state's bytes) and the inputs'
    default values (--overridable); returns [input index, weights buffer] of the latter."""
    _state_inits(bufs, graphs, pairs)
    found, j = [], 0
    for g in graphs:
        for name, _ in g.inputs:
            if name in g.input_defaults:
                found.append([j, bufs.default(g.input_defaults[name])])
            j += 1
    return found


def _state_inits(bufs: Buffers, graphs: list, pairs: dict[str, str]) -> None:
    for x in pairs:
        default = next((g.defaults[x] for g in graphs if x in g.defaults), None)
        if default is not None:
            bufs.state_init(x, default)


def _schedule(graphs: list, names: list[str], tgt: Target, first: Target) -> tuple:
    """Each entry's graph scheduled alone (no kernel spans two entries), then put end to end:
    (outputs, kernels, channels-last tensors, provenance nodes and origins, launches per
    entry). Several entries' kernels are named after their entry's index and name, made a C
    identifier (e1_1928x1208_run_policy_k0...): each schedule numbers its kernels from 0, and a
    program's name must be one kernel's."""
    outs, kernels, last, nodes, origins, counts = [], [], set(), [], {}, []
    for i, (g, name) in enumerate(zip(graphs, names)):
        g_outs, g_kernels, realized, tracked = schedule(
            [u for _, u in g.outputs], tuple(g.origins), tgt.recompute_cheap)
        for u, i in zip(tracked, g.origins.values()):
            origins.setdefault(u, len(nodes) + i)
        g_kernels = _copies_for_shared_outputs(g_outs, g_kernels)
        g_kernels, g_last = _layouts(g_kernels, realized, set(g_outs), first)
        if len(graphs) > 1:
            for k in g_kernels:
                k.name = f"e{i}_{re.sub(r'[^A-Za-z0-9_]', '_', name)}_{k.name}"
        outs += g_outs
        kernels += g_kernels
        last |= g_last
        nodes += g.nodes
        counts.append(sum(k.root.size != 0 for k in g_kernels))  # _jobs: its launches
    return outs, kernels, last, nodes, origins, counts


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
            raise CompileError(f"state {x}={y}: the input and output must have one dtype and "
                               f"shape, got {sorted({(str(u.dtype), tuple(u.shape)) for _, u in found})}")
        for g in graphs:
            if x in g.defaults and tuple(g.defaults[x].shape) != tuple(found[0][1].shape):
                raise CompileError(f"state {x}: initializer shape {g.defaults[x].shape} is not "
                                   f"the input's {tuple(found[0][1].shape)}")
    return pairs


def _entries(names: list[str], graphs: list, bufs: Buffers, counts: list[int]) -> list[Entry]:
    """Each entry's io buffers and launch range: the launches are the entries' in order."""
    entries, n_in, n_out, first = [], 0, 0, 0
    for name, g, count in zip(names, graphs, counts):
        ins = bufs.inputs[n_in:n_in + len(g.inputs)]
        outs = bufs.outputs[n_out:n_out + len(g.outputs)]
        entries.append(Entry(name, tuple(b.id for b in ins), tuple(b.id for b in outs), first,
                             count))
        n_in, n_out, first = n_in + len(g.inputs), n_out + len(g.outputs), first + count
    return entries


def _state(pairs: dict[str, str], bufs: Buffers) -> list[State]:
    return [State(x, tuple(b.id for b in bufs.inputs if b.name == x),
                  tuple(b.id for b in bufs.outputs if b.name == y), bufs.inits.get(x))
            for x, y in pairs.items()]


def _kernels(plans: list, st: Stages) -> tuple[dict[tuple, Built], list]:
    """Every variant's kernels, in one pool of workers kept busy; -> (built by (variant, key),
    per variant: toolchain.precompile's Early or None). A variant's kernels start compiling as
    soon as they are all built: beside the other variant's kernel builders, and while the
    launches, the arena and the weights are planned."""
    early, got, left = [None] * len(plans), {}, [len(p[2]) for p in plans]

    def ready(key: tuple, built: Built) -> None:
        got[key], i = built, key[0]
        left[i] -= 1
        t, _, jobs, _ = plans[i]
        if not left[i] and t.shared_object:
            early[i] = toolchain.precompile(get_renderer(t).kernel_units(
                [(got[i, k].name, got[i, k].code) for k in jobs]), t.name)

    with st("kernels"):
        done = build_all({(i, k): j for i, p in enumerate(plans) for k, j in p[2].items()}, st,
                         ready)
    return done, early


def _launch(bufs: Buffers, built: dict[tuple, Built], uses: list["Use"], st: Stages) -> dict:
    """Record one variant's launches of its built programs and plan its arena; -> `built`."""
    for use in uses:
        b = built[use.key]
        args = [use.out] + [bufs.of(u, b.packings.get(j)) for j, u in enumerate(use.kernel.inputs, 1)]
        bufs.launch(Kernel(b.name, use.kernel.root, use.kernel.inputs), args, b.plan)
    with st("plan"):
        bufs.plan_arena()
        bufs.launches = mark_barriers(bufs.launches, bufs.by_id())
    return built


def _render(tgt: Target, bufs: Buffers, built: dict, st: Stages):
    with st("render"):
        return get_renderer(tgt).render_program([(b.name, b.code) for b in built.values()],
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


def provenance(uses: list["Use"], nodes: list[tuple[str, str]], origins: dict[UOp, int]) -> dict:
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


@dataclass
class Use:
    """One launch: a scheduled kernel, the buffer it writes and the job that builds its program."""
    kernel: Kernel
    out: int
    key: tuple


def _jobs(kernels: list[Kernel], bufs: Buffers, last: set, tgt: Target,
          fp32: set = frozenset()) -> tuple[dict[tuple, Job], list[Use]]:
    """One job per distinct canonical kernel, and the launches that use them. `fp32`: roots of
    kernels that compute in fp32 under float16 (codegen/ranges.py)."""
    jobs: dict[tuple, Job] = {}
    uses = []
    for k in kernels:
        out = bufs.output_of(k)
        if k.root.size == 0:  # writes nothing: an empty tensor needs a buffer but no launch
            continue
        layouts = [bufs.layout_of(out)] + [bufs.layout(u) for u in k.inputs]
        key, ck = canonical(k, layouts, last)
        key = (key, k.root in fp32)
        if key not in jobs:
            packable = {j: u.size for j, (u, lay) in enumerate(zip(k.inputs, layouts[1:]), 1)
                        if lay.region is Region.WEIGHTS and lay.image is None and tgt.pack_weights}
            arena = {j for j, lay in enumerate(layouts) if lay.region is Region.ARENA}
            jobs[key] = Job(ck, [dtypes.from_np(lay.dtype) for lay in layouts], tgt, packable,
                            arena, k.root in fp32)
        uses.append(Use(k, out, key))
    return jobs, uses
