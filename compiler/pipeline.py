"""The compile pipeline as a list of passes in one function:
frontend -> schedule -> optimize -> lower -> simplify -> linearize -> render -> plan -> build."""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from math import prod
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from compiler import toolchain
from compiler.artifact import Artifact, Buffer, Launch
from compiler.ir.dtypes import dtypes
from compiler.onnx.load import load_onnx
from compiler.codegen.linearize import linearize
from compiler.codegen.lower import lower_kernel
from compiler.schedule.memory import plan as plan_memory
from compiler.codegen.optimize import channels_last, in_place, merge_dims, pad_in_place, plan_kernel
from compiler.codegen.pack import pack_weights, prefetch_next_tiles
from compiler.renderers import get_renderer
from compiler.ir.rewrite import graph_rewrite, substitute
from compiler.schedule.fusion import Kernel, schedule
from compiler.schedule.hazards import mark_barriers
from compiler.schedule.storage import (demote_half, device_storage, promote_for_half_compute,
                              storage_bytes, storage_casts, storage_nbytes)
from compiler.ir.symbolic import symbolic
from compiler.target import Target, get_target
from compiler.codegen.transcendental import half_rules, transcendental_rules
from compiler.ir.uop import Ops, UOp, Weight
from compiler.codegen.vectorize import vectorize

VERSION = "0.1.0"
ARENA_GUARD = 128  # >= the widest vector (16 lanes of 8 bytes) minus one lane
WEIGHT_ALIGN = 64  # cache line: vector loads of a weight never straddle two lines at its start


class Stages:
    """Per-stage wall time, and an optional progress callback for long stages."""

    def __init__(self, progress=None):
        self.times: dict[str, float] = {}
        self.progress = progress

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t

    def tick(self, stage: str, done: int, total: int):
        if self.progress:
            self.progress(stage, done, total)


def compile_model(model, target: str | Target = "cpu", input_shapes: dict | None = None,
                  float16: bool = False, stages: Stages | None = None,
                  images: bool | None = None) -> Artifact:
    """images: GPU targets only, read eligible buffers as 2D images (None: the target's default)."""
    st, tgt = stages or Stages(), get_target(target)
    with st("frontend"):
        graph = load_onnx(model, input_shapes or {}, float16=float16, winograd=tgt.renderer == "c")
    with st("schedule"):
        outs, kernels, realized = schedule([u for _, u in graph.outputs])
        kernels = _copies_for_shared_outputs(outs, kernels)
        last = set()
        if tgt.renderer == "c":  # CPU layouts and buffer reuse; GPU targets keep their buffers
            kernels = pad_in_place(kernels, realized, set(outs))
            last = channels_last(kernels, realized, set(outs))
            kernels = in_place(kernels, realized, last, set(outs))
    bufs = Buffers(graph.inputs, list(zip([n for n, _ in graph.outputs], outs)),
                   device_storage(tgt, float16, images), tgt.buffer_align)
    jobs: dict[tuple, tuple] = {}  # canonical kernel -> what build_kernel needs
    uses = []
    for k in kernels:
        out = bufs.output_of(k)
        if k.root.size == 0:  # writes nothing: an empty tensor needs a buffer but no launch
            continue
        layouts = [bufs.layout_of(out)] + [bufs.layout(u) for u in k.inputs]
        key, ck = canonical(k, layouts, last)
        if key not in jobs:
            packable = {j: u.size for j, (u, lay) in enumerate(zip(k.inputs, layouts[1:]), 1)
                        if lay[0] == "weights" and lay[2] is None and tgt.renderer == "c"}
            arena = {j for j, lay in enumerate(layouts) if lay[0] == "arena"}
            jobs[key] = (ck, [dtypes.from_np(lay[1]) for lay in layouts], tgt, packable, arena)
        uses.append((k, out, key))
    with st("kernels"):
        programs = build_all(jobs, st)
    for k, out, key in uses:
        name, _, plan, perms = programs[key]
        args = [out] + [bufs.of(u, perms.get(j)) for j, u in enumerate(k.inputs, 1)]
        bufs.launch(Kernel(name, k.root, k.inputs), args, plan)
    with st("plan"):
        bufs.plan_arena()
        bufs.launches = mark_barriers(bufs.launches, bufs.by_id())
    with st("render"):
        source = get_renderer(tgt).render_program([(n, lin) for n, lin, *_ in programs.values()],
                                                  bufs.launches, bufs.by_id())
    with st("build"):
        code = toolchain.build_shared(source, tgt.name) if tgt.renderer == "c" else \
            source.encode()
    return Artifact(
        target=tgt.name, inputs=bufs.inputs, outputs=bufs.outputs, buffers=list(bufs.by_id().values()),
        weights=bufs.weight_bytes(), arena_bytes=bufs.arena_bytes,
        arena_lower_bound_bytes=bufs.lower_bound, launches=bufs.launches, programs=code,
        meta={"producer": f"keel {VERSION}", "float16": float16, **graph.meta,
              "flops": bufs.flops,
              "stage_seconds": {k: round(v, 4) for k, v in st.times.items()}})


def canonical(k: Kernel, layouts: list, last: set) -> tuple[tuple, Kernel]:
    """The kernel with its reads replaced by numbered placeholders, keyed with how each buffer is
    stored: kernels that differ only in which buffers they touch share one program. Tensors in
    `last` are stored channels-last: read through a permute of their placeholder, written
    through a permute of the root."""
    # a tensor the kernel overwrites in place (optimize.in_place) is read through the output
    # pointer: one pointer per memory, so `restrict` on every parameter stays true
    params = [UOp(Ops.INPUT, u.dtype, (), (f"param{0 if u is k.into else j + 1}",
                                           _stored(u.shape, u in last)))
              for j, u in enumerate(k.inputs)]
    holes = {u: _permute(p, _order(len(u.shape), inverse=True)) if u in last else p
             for u, p in zip(k.inputs, params)}
    root = substitute(k.root, holes)
    if k.root in last:
        root = _permute(root, _order(len(root.shape)))
    key = (root, tuple(layouts))
    return key, Kernel(k.name, root, params)


def _order(ndim: int, inverse: bool = False) -> tuple[int, ...]:
    """Channels (dim 1) last, or back."""
    last = (0,) + tuple(range(2, ndim)) + (1,)
    return tuple(last.index(i) for i in range(ndim)) if inverse else last


def _permute(u: UOp, order: tuple) -> UOp:
    return UOp(Ops.PERMUTE, u.dtype, (u,), order)


def _stored(shape: tuple, last: bool) -> tuple:
    return tuple(shape[i] for i in _order(len(shape))) if last else shape


PARALLEL_MIN_KERNELS = 8  # below this, starting worker processes costs more than it saves


def build_all(jobs: dict[tuple, tuple], st: Stages) -> dict[tuple, tuple]:
    """Build every distinct kernel; on Linux in forked worker processes, one per core (kernels
    are independent once scheduled, and building them is most of the compile time)."""
    keys = list(jobs)
    workers = min(compile_jobs(), len(keys))
    if workers < 2 or len(keys) < PARALLEL_MIN_KERNELS or sys.platform != "linux":
        out = {}
        for i, key in enumerate(keys):
            st.tick("kernels", i, len(keys))
            out[key] = build_kernel(*jobs[key], st)
        st.tick("kernels", len(keys), len(keys))
        return out
    global _JOBS
    _JOBS = [jobs[k] for k in keys]  # inherited by the forked workers; nothing is pickled in
    out = {}
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(_build_job, i) for i in range(len(keys))]
        for done, fut in enumerate(as_completed(futures)):
            i, result, times = fut.result()
            out[keys[i]] = result
            for name, secs in times.items():
                st.times[name] = st.times.get(name, 0.0) + secs
            st.tick("kernels", done + 1, len(keys))
    _JOBS = []
    return out


_JOBS: list = []


def _build_job(i: int):
    st = Stages()
    return i, build_kernel(*_JOBS[i], st), st.times


def compile_jobs() -> int:
    text = os.environ.get("KEEL_COMPILE_JOBS", "")
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def build_kernel(k: Kernel, param_dtypes: list, tgt: Target, packable: dict[int, int],
                 arena: set[int], st: Stages) -> tuple:
    """-> (name, linear uops, plan, {param: weight packing permutation})"""
    params = {u: int(u.arg[0].removeprefix("param")) for u in k.inputs}
    with st("optimize"):
        if tgt.renderer == "c":
            k = merge_dims(k, params)
        plan = plan_kernel(k, set(k.inputs), tgt, params, packable)
    with st("lower"):
        sink = simplify(lower_kernel(k, params, param_dtypes, plan), tgt)
        sink, perms = pack_weights(sink, packable)
        sink = vectorize(sink, arena)
        if tgt.prefetch:
            sink = prefetch_next_tiles(sink, packable)
    with st("linearize"):
        return k.name, linearize(sink), plan, perms


KERNEL_RULES = storage_casts + half_rules + transcendental_rules + symbolic
HALF_COMPUTE_RULES = promote_for_half_compute + transcendental_rules + symbolic


def simplify(sink: UOp, tgt: Target) -> UOp:
    if not tgt.half_compute:
        return graph_rewrite(sink, KERNEL_RULES)
    # fp16 arithmetic: demote before transcendental lowering, so its polynomials stay fp32
    sink = graph_rewrite(sink, storage_casts + demote_half + symbolic)
    return graph_rewrite(sink, HALF_COMPUTE_RULES)


def _copies_for_shared_outputs(outs: list[UOp], kernels: list[Kernel]) -> list[Kernel]:
    """Two graph outputs that are the same tensor need two buffers: the second one copies."""
    seen, extra = set(), []
    for u in outs:
        if u in seen:
            extra.append(Kernel(f"k{len(kernels) + len(extra)}_copy", u, [u]))
        seen.add(u)
    return kernels + extra


class Buffers:
    """Every buffer the graph touches, their regions, and the launch records that use them."""

    def __init__(self, inputs: list[tuple[str, UOp]], outputs: list[tuple[str, UOp]],
                 storage=None, align: int = WEIGHT_ALIGN):
        self.storage = storage  # compiler.schedule.storage policy: device dtype and image layout
        self.align = max(align, WEIGHT_ALIGN)
        self.table: dict[int, Buffer] = {}
        self.node_buf: dict[UOp, int] = {}
        self.inputs = [self._new("input", i, u, name) for i, (name, u) in enumerate(inputs)]
        for (_, u), b in zip(inputs, self.inputs):
            self.node_buf[u] = b.id
        self.outputs: list[Buffer] = []
        self.out_index: dict[int, int] = {}  # buffer id -> position among graph outputs
        self.pending_outputs = list(outputs)
        self.weights: list[tuple[int, np.ndarray]] = []
        self.weight_size = 0
        self.launches: list[Launch] = []
        self.flops: list[int] = []
        self.life: dict[int, list[int]] = {}

    def _new(self, region: str, offset: int, u: UOp, name: str = "") -> Buffer:
        dt, image = self.storage(region, u.dtype, u.shape) if self.storage else (u.dtype, None)
        b = Buffer(len(self.table), region, offset, storage_nbytes(dt, u.shape, image), dt.name,
                   tuple(u.shape), name, image)
        self.table[b.id] = b
        return b

    def output_of(self, k: Kernel) -> int:
        for j, (name, u) in enumerate(self.pending_outputs):
            # a kernel writing another tensor's buffer is never a graph output's writer, even
            # when its root (hash-consed: a fill's constant) is the same node as an output
            if u is k.root and k.into is None:
                self.pending_outputs[j] = (name, None)
                b = self._new("output", 0, u, name)
                self.out_index[b.id] = j
                if k.inputs != [k.root]:
                    self.node_buf.setdefault(u, b.id)
                return b.id
        node = k.into or k.root
        # a padded tensor's buffer exists from its fill kernel on; one overwritten in place
        # already has its own
        if node not in self.node_buf:
            self.node_buf[node] = self._new("arena", 0, node).id
        self.node_buf.setdefault(k.root, self.node_buf[node])
        return self.node_buf[node]

    def layout(self, u: UOp) -> tuple:
        """(region, storage dtype, image) of the buffer that `u` is or will be read from."""
        if u in self.node_buf:
            return self.layout_of(self.node_buf[u])
        dt, image = self.storage("weights", u.dtype, u.shape) if self.storage else (u.dtype, None)
        return ("weights", dt.name, image)

    def layout_of(self, bid: int) -> tuple:
        b = self.table[bid]
        return (b.region, b.dtype, b.image)

    def of(self, u: UOp, perm: np.ndarray | None = None) -> int:
        """The buffer `u` is read from; a weight read through a packing permutation gets its own
        packed copy (one per distinct permutation)."""
        key = u if perm is None else (u, id(perm))
        if key not in self.node_buf:
            assert u.op is Ops.WEIGHT, f"unscheduled read of {u.op}"
            data = u.arg.data if perm is None else u.arg.data.reshape(-1)[perm]
            self.weight_size = -(-self.weight_size // self.align) * self.align
            b = self._new("weights", self.weight_size, u if perm is None else
                          UOp(Ops.WEIGHT, u.dtype, (), Weight(data)))
            self.weights.append((self.weight_size, storage_bytes(data, b)))
            self.weight_size += b.nbytes
            self.node_buf[key] = b.id
        return self.node_buf[key]

    def launch(self, k: Kernel, args: list[int], plan) -> None:
        step = len(self.launches)
        for b in args:
            self.life.setdefault(b, [step, step])[1] = step
        self.launches.append(Launch(k.name, tuple(args), plan.global_size, plan.local))
        # work per launch, for GFLOP/s in profiles: a multiply-add per reduced element
        self.flops.append(2 * prod(plan.full_shape) if plan.reduce_dims else prod(plan.full_shape))

    def plan_arena(self) -> None:
        n_in = len(self.inputs)
        for bid, j in self.out_index.items():  # io slots: inputs first, then outputs in order
            b = self.table[bid]
            self.table[bid] = replace(b, offset=n_in + j)
        self.outputs = [self.table[bid] for bid in sorted(self.out_index, key=self.out_index.get)]
        arena = [b for b in self.table.values() if b.region == "arena"]
        p = plan_memory([b.nbytes for b in arena],
                        [tuple(self.life.get(b.id, (0, 0))) for b in arena], self.align)
        # guard bytes at both ends: a masked vector load may read a few elements past a buffer
        # (vectorize.py), which must stay inside the arena; inside it they hit a neighbour
        guard = -(-ARENA_GUARD // self.align) * self.align
        for b, off in zip(arena, p.offsets):
            self.table[b.id] = replace(b, offset=off + guard)
        self.arena_bytes, self.lower_bound = p.arena_bytes + 2 * guard, p.lower_bound

    def by_id(self) -> dict[int, Buffer]:
        return dict(sorted(self.table.items()))

    def weight_bytes(self) -> bytes:
        out = bytearray(self.weight_size)
        for off, data in self.weights:
            out[off:off + len(data)] = data
        return bytes(out)
