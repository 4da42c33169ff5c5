"""Kernel -> linear program, for every distinct kernel: plan, lower, simplify, pack, vectorize,
linearize. Kernels are independent once scheduled, and building them is most of the compile
time, so on Linux they build in forked worker processes, one per core."""
from __future__ import annotations

import hashlib
import math
import multiprocessing
import pickle
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace

from compiler import cache
from compiler.codegen.half import demote_half, half_rules, promote_for_half_compute, storage_casts
from compiler.codegen.l2fetch import l2fetch_next_tile
from compiler.codegen.linearize import linearize
from compiler.codegen.lower import lower_kernel
from compiler.codegen.pack import Packing, pack_weights, prefetch_next_tiles
from compiler.codegen.plan_cpu import merge_dims, plan_cpu
from compiler.codegen.plan_gpu import plan_gpu
from compiler.codegen.transcendental import transcendental_rules
from compiler.codegen.vectorize import vectorize
from compiler.ir.dtypes import DType, dtypes
from compiler.ir.rewrite import PatternMatcher, Rewriter, UPat, graph_rewrite
from compiler.ir.symbolic import linear_form, symbolic
from compiler.ir.uop import Ops, UOp
from compiler.renderers import get_renderer
from compiler.ir.kernel import AxisKind, Kernel, Plan
from compiler.target import Target
from compiler.toolchain import compile_jobs

PARALLEL_MIN_KERNELS = 8  # below this, starting worker processes costs more than it saves
# build_kernel's steps, each timed under its name (summed over the worker processes)
KERNEL_STEPS = ("plan", "lower", "simplify", "pack", "vectorize", "linearize", "render")


@dataclass
class Job:
    """One distinct kernel to build: its reads are its parameters, Ops.PARAM (layout.canonical)."""
    kernel: Kernel
    param_dtypes: list[DType]  # storage dtype per parameter, the output first
    target: Target
    packable: dict[int, int]  # parameter -> element count: weights pack.py may reorder
    arena: set[int]  # parameters in the arena (vectorize.py may read past their ends)
    float32: bool = False  # compute in fp32 on a half-compute target (codegen/ranges.py)
    images: tuple = ()  # per parameter, its Image layout or None (GPU targets read images)


@dataclass
class Built:
    name: str
    lin: list[UOp] | None  # the linearized program (None once compacted: piece holds it)
    plan: Plan
    packings: dict[int, Packing]  # parameter -> how its weight is packed (pack.py)
    piece: tuple[str, frozenset]  # the renderer's kernel_piece, rendered in the worker


def build_all(jobs: dict[tuple, Job], st, ready=None) -> dict[tuple, Built]:
    """Build every job, or take it from the kernel cache (compiler/cache.py). `ready(key,
    built)`: called as each job is done, in the order they finish."""
    ready = ready or (lambda key, b: None)
    digests = {k: job_digest(j) for k, j in jobs.items()}
    hits = {k: replace(b, name=jobs[k].kernel.name) for k, d in digests.items()
            if (b := _cached(d)) is not None}
    st.count("kernels", built=len(jobs) - len(hits), cached=len(hits))
    for k, b in hits.items():
        ready(k, b)
    todo = {k: j for k, j in jobs.items() if k not in hits}
    built = _build_all(todo, st, ready) if todo else {}
    for k, b in built.items():
        if digests[k]:
            cache.put("kernels", digests[k], pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL))
    return {k: hits[k] if k in hits else built[k] for k in jobs}  # job order: reproducible


def _cached(digest: str | None) -> Built | None:
    data = digest and cache.get("kernels", digest)
    try:
        return pickle.loads(data) if data else None
    except Exception:  # written by another Python or numpy, or damaged: build it again
        return None


def job_digest(job: Job) -> str | None:
    """The kernel cache's key: everything build_kernel reads (None: not cacheable)."""
    h = hashlib.sha256(cache.code_digest().encode())
    if not cache.graph_digest(UOp(Ops.SINK, src=(job.kernel.root, *job.kernel.inputs)), h):
        return None
    h.update(repr((job.param_dtypes, job.target, sorted(job.packable.items()),
                   sorted(job.arena), job.float32, job.images)).encode())
    return h.hexdigest()


def _build_all(jobs: dict[tuple, Job], st, ready) -> dict[tuple, Built]:
    """Build every job, in worker processes when there are enough of them (`st`: Stages)."""
    keys = list(jobs)
    workers = min(compile_jobs(), len(keys))
    if workers < 2 or len(keys) < PARALLEL_MIN_KERNELS or sys.platform != "linux":
        out = {}
        for i, key in enumerate(keys):
            st.tick("kernels", i, len(keys))
            out[key] = _compact(build_kernel(jobs[key], st))
            ready(key, out[key])
        st.tick("kernels", len(keys), len(keys))
        return out
    global _FORKED
    # inherited by the forked workers, nothing is pickled in; each times its stages with a
    # fresh timer of the caller's kind
    _FORKED = ([jobs[k] for k in keys], type(st))
    out = {}
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(_build_job, i) for i in range(len(keys))]
        for done, fut in enumerate(as_completed(futures)):
            i, result, times = fut.result()
            out[keys[i]] = result
            ready(keys[i], result)
            for name, secs in times.items():
                st.times[name] = st.times.get(name, 0.0) + secs
            st.tick("kernels", done + 1, len(keys))
    _FORKED = ([], type(st))
    return {k: out[k] for k in keys}  # job order, not completion order: reproducible output


_FORKED: tuple[list[Job], type] = ([], type(None))


def _build_job(i: int):
    jobs, timer = _FORKED
    st = timer()
    return i, _compact(build_kernel(jobs[i], st)), st.times  # pickled back to the parent


def _compact(b: Built) -> Built:
    """What goes back to the parent and into the cache: the rendered piece, never the UOps
    (unpickling a large model's worth of them costs the parent serial time: docs/perf.md,
    "Issue 38")."""
    return replace(b, lin=None)


def build_kernel(job: Job, st) -> Built:
    k, tgt = job.kernel, job.target
    params = {u: u.arg[0] for u in k.inputs}
    with st("plan"):
        if tgt.output_dims is AxisKind.GLOBAL:
            plan = plan_gpu(k, params, tgt)
        else:
            k = merge_dims(k, params)
            plan = plan_cpu(k, params, tgt, job.packable)
    with st("lower"):
        rw = Rewriter(first_rules(k, job.param_dtypes, tgt, job.float32))
        sink = lower_kernel(k, params, job.param_dtypes, plan, rw)
    with st("simplify"):
        sink = simplify(sink, rw, tgt)
        if tgt.hvx:
            sink = graph_rewrite(sink, DOT4_WORDS)
    with st("pack"):
        sink, packings = pack_weights(sink, job.packable)
    with st("vectorize"):
        sink = vectorize(sink, rw, job.arena)
        if tgt.prefetch:
            sink = prefetch_next_tiles(sink, job.packable)
        if tgt.l2fetch:
            sink, memory = l2fetch_next_tile(sink, {i: math.prod(u.shape)
                                                    for u, i in params.items()}, tgt.l2_bytes)
            plan = replace(plan, memory=memory)
    with st("linearize"):
        lin = linearize(sink)
    with st("render"):
        renderer = get_renderer(tgt)
        renderer.overread = frozenset(job.arena)
        return Built(k.name, lin, plan, packings,
                     renderer.kernel_piece(lin, job.param_dtypes, job.images, plan))


KERNEL_RULES = storage_casts + half_rules + transcendental_rules + symbolic
FLOAT32_RULES = storage_casts + transcendental_rules + symbolic  # half_rules: nothing to do
# fp16 arithmetic: demote before transcendental lowering, so its polynomials stay fp32
HALF_FIRST_RULES = storage_casts + demote_half + symbolic
HALF_COMPUTE_RULES = promote_for_half_compute + transcendental_rules + symbolic


def _dot4_word(x: UOp) -> UOp | None:
    """A DOT4 of four bytes at consecutive addresses of one buffer, the first at a multiple of
    4 from its start, reads them as one uint32 (buffers start aligned to 4 bytes or more): one
    load where four loads, shifts and ors were (and clang-19's Hexagon bit simplification took
    seconds per kernel over them)."""
    loads = x.src[:4]
    if len(x.src) != 5 or not all(u.op is Ops.LOAD and len(u.src) == 2
                                  and u.src[0] is loads[0].src[0] for u in loads):
        return None
    base, c0 = linear_form(loads[0].src[1])
    if c0 % 4 or any(c % 4 for c in base.values()) or \
            any(linear_form(u.src[1]) != (base, c0 + k) for k, u in enumerate(loads)):
        return None
    word = UOp(Ops.LOAD, dtypes.uint32, loads[0].src)
    return UOp(Ops.DOT4, x.dtype, (word, x.src[4]))


DOT4_WORDS = PatternMatcher([(UPat(Ops.DOT4, name="x"), _dot4_word)])


def first_rules(k: Kernel, param_dtypes: list[DType], tgt: Target,
                float32: bool = False) -> PatternMatcher:
    """The rules lowering simplifies with. Without a float16 buffer or value, half_rules never
    apply, and asking them at every node costs time. `float32`: a half-compute target's kernel
    that computes in fp32 anyway (its values pass half's safe range)."""
    if tgt.half_compute and not float32:
        return HALF_FIRST_RULES
    half = dtypes.float16 in param_dtypes or any(u.dtype is dtypes.float16 for u in
                                                 k.root.toposort(leaves=set(k.inputs)))
    return KERNEL_RULES if half else FLOAT32_RULES


def simplify(sink: UOp, rw: Rewriter, tgt: Target) -> UOp:
    """`rw`: the first pass's Rewriter, which lowering already used on the pieces it built."""
    sink = rw(sink)
    return graph_rewrite(sink, HALF_COMPUTE_RULES) if tgt.half_compute else sink
