"""The compile pipeline as a list of passes in one function:
frontend -> schedule -> optimize -> lower -> simplify -> linearize -> render -> plan -> build."""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from compiler import toolchain
from compiler.artifact import Artifact, Buffer, Launch
from compiler.dtypes import dtypes
from compiler.frontend import load_onnx
from compiler.linearize import linearize
from compiler.lower import lower_kernel
from compiler.memory import plan as plan_memory
from compiler.optimize import plan_kernel
from compiler.renderers import get_renderer
from compiler.rewrite import graph_rewrite
from compiler.schedule import Kernel, schedule
from compiler.symbolic import symbolic
from compiler.target import Target, get_target
from compiler.transcendental import half_rules, transcendental_rules
from compiler.uop import Ops, UOp

VERSION = "0.1.0"
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


def compile_model(model, target: str = "cpu", input_shapes: dict | None = None,
                  float16: bool = False, stages: Stages | None = None) -> Artifact:
    st, tgt = stages or Stages(), get_target(target)
    with st("frontend"):
        graph = load_onnx(model, input_shapes or {}, float16=float16)
    with st("schedule"):
        outs, kernels, realized = schedule([u for _, u in graph.outputs])
        kernels = _copies_for_shared_outputs(outs, kernels)
    bufs = Buffers(graph.inputs, list(zip([n for n, _ in graph.outputs], outs)))
    programs = []
    for i, k in enumerate(kernels):
        st.tick("kernels", i, len(kernels))
        args = [bufs.output_of(k)] + [bufs.of(u) for u in k.inputs]
        with st("optimize"):
            plan = plan_kernel(k, realized | set(k.inputs), tgt)
        with st("lower"):
            params = {u: j + 1 for j, u in enumerate(k.inputs)}
            sink = lower_kernel(k, params, [dtypes.from_np(bufs.table[b].dtype) for b in args], plan)
            sink = simplify(sink, tgt)
        with st("linearize"):
            programs.append((k.name, linearize(sink), plan))
        bufs.launch(k, args, plan)
    st.tick("kernels", len(kernels), len(kernels))
    with st("plan"):
        bufs.plan_arena()
    with st("render"):
        source = get_renderer(tgt).render_program([(n, lin) for n, lin, _ in programs],
                                                  bufs.launches, bufs.by_id())
    with st("build"):
        code = toolchain.build_shared(source, tgt.name) if tgt.renderer == "c" else \
            source.encode()
    return Artifact(
        target=tgt.name, inputs=bufs.inputs, outputs=bufs.outputs, buffers=list(bufs.by_id().values()),
        weights=bufs.weight_bytes(), arena_bytes=bufs.arena_bytes,
        arena_lower_bound_bytes=bufs.lower_bound, launches=bufs.launches, programs=code,
        meta={"producer": f"keel {VERSION}", "float16": float16, **graph.meta,
              "stage_seconds": {k: round(v, 4) for k, v in st.times.items()}})


def simplify(sink: UOp, tgt: Target) -> UOp:
    sink = graph_rewrite(sink, symbolic)
    return graph_rewrite(sink, half_rules + transcendental_rules + symbolic)


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

    def __init__(self, inputs: list[tuple[str, UOp]], outputs: list[tuple[str, UOp]]):
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
        self.life: dict[int, list[int]] = {}

    def _new(self, region: str, offset: int, u: UOp, name: str = "") -> Buffer:
        b = Buffer(len(self.table), region, offset, u.size * u.dtype.itemsize, u.dtype.name,
                   tuple(u.shape), name)
        self.table[b.id] = b
        return b

    def output_of(self, k: Kernel) -> int:
        for j, (name, u) in enumerate(self.pending_outputs):
            if u is k.root:
                self.pending_outputs[j] = (name, None)
                b = self._new("output", 0, u, name)
                self.out_index[b.id] = j
                if k.inputs != [k.root]:
                    self.node_buf.setdefault(u, b.id)
                return b.id
        b = self._new("arena", 0, k.root)
        self.node_buf[k.root] = b.id
        return b.id

    def of(self, u: UOp) -> int:
        if u not in self.node_buf:
            assert u.op is Ops.WEIGHT, f"unscheduled read of {u.op}"
            self.weight_size = -(-self.weight_size // WEIGHT_ALIGN) * WEIGHT_ALIGN
            b = self._new("weights", self.weight_size, u)
            self.weights.append((self.weight_size, u.arg.data))
            self.weight_size += b.nbytes
            self.node_buf[u] = b.id
        return self.node_buf[u]

    def launch(self, k: Kernel, args: list[int], plan) -> None:
        step = len(self.launches)
        for b in args:
            self.life.setdefault(b, [step, step])[1] = step
        gs = tuple(a.size for a in plan.axes if a.kind == "global") or (1,)
        self.launches.append(Launch(k.name, tuple(args), gs, plan.local))

    def plan_arena(self) -> None:
        n_in = len(self.inputs)
        for bid, j in self.out_index.items():  # io slots: inputs first, then outputs in order
            b = self.table[bid]
            self.table[bid] = Buffer(bid, "output", n_in + j, b.nbytes, b.dtype, b.shape, b.name)
        self.outputs = [self.table[bid] for bid in sorted(self.out_index, key=self.out_index.get)]
        arena = [b for b in self.table.values() if b.region == "arena"]
        p = plan_memory([b.nbytes for b in arena], [tuple(self.life[b.id]) for b in arena])
        for b, off in zip(arena, p.offsets):
            self.table[b.id] = Buffer(b.id, "arena", off, b.nbytes, b.dtype, b.shape, b.name)
        self.arena_bytes, self.lower_bound = p.arena_bytes, p.lower_bound

    def by_id(self) -> dict[int, Buffer]:
        return dict(sorted(self.table.items()))

    def weight_bytes(self) -> bytes:
        out = bytearray(self.weight_size)
        for off, data in self.weights:
            out[off:off + data.nbytes] = data.tobytes()
        return bytes(out)
