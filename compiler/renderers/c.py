"""Freestanding C: every kernel plus the graph entry points in a single translation unit (and
the same program split into one unit per kernel, which toolchain.py builds and caches).

The entry points are the CPU "command buffer": one call from the runner executes the whole model.
Their ABI (signatures, argument encoding, keel_sync) is runner/keel_abi.h, pasted into the program.
  keel_graph(arena, weights, io)                     one thread
  keel_graph_mt(arena, weights, io, tid, nt, sync)   called by nt threads at once, for launches
      [sync->first, sync->end) (an entry point's range; end 0: to the last): each kernel
      splits its outermost loop between them; a spin barrier separates a kernel from the next
      one only where that one reads or overwrites something written since the last barrier
  keel_profile(arena, weights, io, tid, nt, sync, ticks)   keel_graph_mt, with this thread's
      cycle counter before and after every kernel in ticks[2i], ticks[2i + 1]
  keel_ticks()                                       the cycle counter, to calibrate it
  keel_launch(i, args)                               launch i alone, on args[j] = its j-th buffer:
      what a queue device replaying the blob's launch table does (runner/mock.py)
  keel_launch_part(i, args, tid, nt)                 share tid of nt of launch i (the DSP's
      hardware threads, dsp/graph_runner.h); keel_split(i) says how launch i's kernel shares:
      SPLIT_NONE (tid 0 does it all), SPLIT_SCALAR or SPLIT_VECTOR (its outermost output loop
      is split, and it uses vectors: HVX on the DSP)
Threads come from the runner (created once per model); the barrier is C11-style atomics and
needs no libc.
"""
from __future__ import annotations

import hashlib

from compiler.artifact import Buffer, Launch
from compiler.ir.dtypes import DType, dtypes
from compiler.ir.kernel import AxisKind
import compiler.renderers.hvx as hvx
from compiler.ir.uop import Ops, UOp
from compiler.renderers.cstyle import INFIX, Body, CStyle, dot4_bytes, dot4_text
from runner import abi
from runner.abi import GRAPH as ENTRY, GRAPH_MT as ENTRY_MT, LAUNCH, LAUNCH_PART, PROFILE, SPLIT
from runner.format import Region

SPLIT_MIN = 8  # trip count from which a loop is split between threads
SPLIT_NONE, SPLIT_SCALAR, SPLIT_VECTOR = 0, 1, 2  # keel_split's answers (runner/keel_abi.h)
Piece = tuple[str, frozenset, int]  # CRenderer.kernel_piece: text, vector types, its split
# Cycle counter without libc: clang's builtin on every target (rdtsc / cntvct), gcc on x86 only.
TICKS = """
#if defined(__clang__)
#define KEEL_TICKS() __builtin_readcyclecounter()
#elif defined(__x86_64__)
#define KEEL_TICKS() __builtin_ia32_rdtsc()
#else
#define KEEL_TICKS() 0ull
#endif
#if defined(__x86_64__)
#define KEEL_PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define KEEL_PAUSE() __asm__ volatile("yield")
#else
#define KEEL_PAUSE() ((void)0)
#endif
#include <stdint.h>
""" + abi.declarations() + """
static int keel_late(keel_sync *s) {
  keel_ts t;
  if (__atomic_load_n(&s->abort, __ATOMIC_RELAXED)) return 1;
  if (!s->clock_fn || s->clock_fn(s->clock_id, &t) != 0) return 0;
  if (t.sec * 1000000000LL + t.nsec <= s->deadline_ns) return 0;
  __atomic_store_n(&s->abort, 1, __ATOMIC_RELAXED);
  return 1;
}
/* sense-reversing barrier: the last thread to arrive flips the sense the others wait on; past
   the deadline every barrier passes (the runner discards that run's results). Not inlined: a
   graph has one barrier per launch, and inlining hundreds of copies of its loop took clang -O2
   2.3 s of the openpilot-shaped model's 4.8 s (0.4 s without); a call costs nanoseconds */
__attribute__((noinline)) static void keel_barrier(keel_sync *s, int nt, int *sense) {
  *sense = !*sense;
  if (__atomic_add_fetch(&s->count, 1, __ATOMIC_ACQ_REL) == nt) {
    __atomic_store_n(&s->count, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->sense, *sense, __ATOMIC_RELEASE);
    return;
  }
  for (int spins = 0; __atomic_load_n(&s->sense, __ATOMIC_ACQUIRE) != *sense; spins++) {
    if (spins < 4096) { KEEL_PAUSE(); continue; }
    if (s->yield_fn) s->yield_fn(); else KEEL_PAUSE();
    if (keel_late(s)) return;  /* a vDSO clock read: nothing beside a yield */
  }
}
"""


def _threaded(name: str, sig: str, timed: bool) -> str:
    """The threaded entry point: a loop over the launch table (_entries). Timed, it also stores
    the cycle counter before and after each launch into ticks[2i] and ticks[2i + 1] (the caller
    gives each thread its own row), so a profile sees every thread's share of every kernel and,
    between them, its barrier waits. Two bodies, not one that tests `ticks` per launch."""
    call = "keel_call(r->kernel, keel_bind(r, arena, weights, io, a), tid, nt);"
    if timed:
        call = f"ticks[2 * i] = KEEL_TICKS();\n    {call}\n    ticks[2 * i + 1] = KEEL_TICKS();"
    extra = ", unsigned long long *ticks" if timed else ""
    return (f"void {name}({sig}, int tid, int nt, keel_sync *s{extra}) {{\n"
            f"  int sense = __atomic_load_n(&s->sense, __ATOMIC_ACQUIRE);\n"
            f"  void *a[KEEL_MAX_ARGS];\n"
            f"  int end = s->end > 0 && s->end < KEEL_LAUNCHES ? s->end : KEEL_LAUNCHES;\n"
            f"  for (int i = s->first > 0 ? s->first : 0; i < end; i++) {{\n"
            f"    const keel_row *r = &keel_rows[i];\n"
            f"    if (r->barrier) keel_barrier(s, nt, &sense);  /* compiler/link/hazards.py */\n"
            f"    {call}\n  }}\n"
            f"  keel_barrier(s, nt, &sense);  /* all work done before any thread returns */\n}}\n")


class CRenderer(CStyle):
    """Vectors use the GCC/clang `vector_size` extension: lane-wise arithmetic and compares (which
    give 0/-1 integer masks), `__builtin_convertvector` for casts, a plain cast for bit casts."""

    hvx = False  # 128-byte HVX vectors (dsp): Ops.DOT4 of 32 int32 lanes is one vrmpy
    # parameters a vector load may read past (arena buffers: guard bytes at both ends); set per
    # kernel by codegen/build.py
    overread: frozenset = frozenset()

    def __init__(self, target=None):
        if target is not None:
            self.hvx = target.hvx
        if target is not None and target.kernel_symbols:
            # each kernel its own function, never inlined into the entry points: the DSP's
            # profile counts and tests/test_dsp.py's disassembly are per kernel symbol (a call
            # per launch costs nothing against a kernel)
            self.kernel_prefix = "static __attribute__((noinline)) void"

    def kernel_piece(self, lin: list[UOp], param_dtypes: list[DType], images: tuple = (),
                     plan=None) -> Piece:
        """What render_program needs of one kernel, rendered where the kernel was built (a
        worker process, build.py): its text after the name, "(params) {body}", the vector
        types it declares and how it shares out between threads (keel_split). `param_dtypes`:
        every parameter the launch passes, even one whose loads simplified away (C reads no
        images, and its plan is in the loops already)."""
        self.param_dtypes = param_dtypes
        self.whole = {}  # narrow HVX loads -> the whole 128-byte vector from their address
        text = self.render_kernel("K", lin)
        used = {u.dtype for u in lin if u.dtype.count > 1}
        split = SPLIT_NONE if self.split is None else SPLIT_VECTOR if used else SPLIT_SCALAR
        return text[len(f"{self.kernel_prefix} K"):], frozenset(used), split

    def render_program(self, kernels: list[tuple[str, Piece]], launches: list[Launch],
                       buffers: dict[int, Buffer]) -> Program:
        """kernels: (name, kernel_piece)."""
        texts = {name: f"{self.kernel_prefix} {name}{rest}" for name, (rest, *_) in kernels}
        used = frozenset().union(*(used for _, (_, used, _) in kernels))
        splits = {name: split for name, (*_, split) in kernels}
        whole = (TICKS + "\n".join([_typedefs(self, used), *texts.values()]) + "\n"
                 + _entries(self, launches, buffers, {}, splits))
        return Program(whole, self._units(kernels, launches, buffers))

    def kernel_units(self, kernels: list[tuple[str, Piece]]) -> list[tuple[str, str]]:
        """The kernels as separate units [(symbol, C source)]: extern and named by a hash of
        their own text, so an object built once serves every model (and every position in a
        model) that has the kernel; kernels of equal text are one unit. They need no launch:
        toolchain.precompile starts on them while the launches are still being planned."""
        return list(dict(self._unit(piece) for _, piece in kernels).items())

    def _unit(self, piece: Piece) -> tuple[str, str]:
        rest, used, _ = piece  # rest: "(params) {body}"
        unit = _typedefs(self, used) + "void KEEL_KERNEL" + rest
        sym = "keel_" + hashlib.sha256(unit.encode()).hexdigest()[:20]
        return sym, unit.replace("void KEEL_KERNEL", f"void {sym}", 1)

    def _units(self, kernels: list[tuple[str, Piece]], launches: list[Launch],
               buffers: dict[int, Buffer]) -> list[tuple[str, str]]:
        """kernel_units, and a unit for the entry points, which call the kernels by symbol."""
        units = [self._unit(piece) for _, piece in kernels]  # each rendered and hashed once
        syms = {name: sym for (name, _), (sym, _) in zip(kernels, units)}
        protos = "".join(f"void {syms[name]}{rest.split(' {', 1)[0]};\n"
                         for name, (rest, *_) in kernels)
        splits = {syms[name]: split for name, (*_, split) in kernels}
        return list(dict(units).items()) + \
            [("keel_graph", TICKS + protos + _entries(self, launches, buffers, syms, splits))]

    # ---- threads: each kernel takes its share of the outermost loop ---------------------------
    def extra_params(self) -> list[str]:
        return ["int tid", "int nt"]

    def render_kernel(self, name: str, lin: list[UOp]) -> str:
        # the outermost output loop long enough to share; a 5-row matmul tile loop would leave a
        # thread idle, the loop inside it may not
        loops = [u for u in lin if u.op is Ops.RANGE
                 and u.arg[1] not in (AxisKind.REDUCE, AxisKind.EPILOGUE)]
        self.split = next((u for u in loops if u.src[0].arg >= SPLIT_MIN), None) or \
            max(loops, key=lambda u: u.src[0].arg, default=None)
        text = super().render_kernel(name, lin)
        if self.split is None:  # nothing to share: thread 0 does it all
            head, rest = text.split("{\n", 1)
            text = f"{head}{{\n  if (tid != 0) return;\n{rest}"
        return text

    def range_open(self, u: UOp, name: str, end: str) -> str:
        if u is not self.split:
            return super().range_open(u, name, end)
        i = self.dtype(u.dtype)
        return (f"for ({i} {name} = tid * {end} / nt, {name}_end = (tid + 1) * {end} / nt; "
                f"{name} < {name}_end; {name}++) {{")

    # ---- vectors ----------------------------------------------------------------------------
    def dtype(self, dt: DType) -> str:
        if dt is dtypes.index:
            # pointer-width (LP64 and ILP32 alike): an int index is sign-extended before each
            # address, so clang cannot fold `i + 128` into the load's displacement and keeps
            # every tap of a strided window as its own 64-bit register, and spills them
            # (docs/perf.md)
            return "long"
        return self.dtype(_mask(dt)) if dt.count > 1 and dt.scalar is dtypes.bool else dt.cname

    def typedef(self, dt: DType) -> str:
        base, size = dt.scalar.cname, dt.itemsize
        # the "_u" twin has element alignment: vector loads/stores at any element offset
        return (f"typedef {base} {dt.cname} __attribute__((vector_size({size})));\n"
                f"typedef {base} {dt.cname}_u __attribute__((vector_size({size}), "
                f"aligned({dt.scalar.itemsize})));\n")

    def literal(self, v, dt: DType) -> str:
        if dt.count == 1:
            return super().literal(v, dt)
        lane = "-1" if dt.scalar is dtypes.bool and v else super().literal(v, dt.scalar)
        return f"(({self.dtype(dt)}){{{', '.join([lane] * dt.count)}}})"

    def render_load(self, body: Body, u: UOp) -> None:
        if u.dtype.count == 1:
            return super().render_load(body, u)
        p, idx = body.ref(u.src[0]), body.ref(u.src[1])
        load = f"(*(const {u.dtype.cname}_u *)({p} + {idx}))"
        if len(u.src) == 3 and self.hvx and u.dtype.scalar.is_int:
            # one gate for every lane: on HVX, the vector at offset 0 when it fails (in bounds:
            # the buffer holds one), masked to zero, so the read needs no branch
            gate, lane = body.ref(u.src[2]), u.dtype.scalar.cname
            at = f"(*(const {u.dtype.cname}_u *)({p} + ({gate} ? {idx} : 0)))"
            load = f"({at} & ({lane})-({lane}){gate})"
        elif len(u.src) == 3:  # one gate for every lane: nothing is read when it fails
            load = f"({body.ref(u.src[2])} ? {load} : {self.literal(0, u.dtype)})"
        elif self.hvx and u.dtype.count == 32 and u.dtype.scalar.itemsize in (1, 2) \
                and u.src[0].arg[0] in self.overread:
            self.whole[u] = f"(*(const int32x32_u *)({p} + {idx}))"
        body.bind(u, load)

    def render_store(self, body: Body, u: UOp) -> None:
        val = u.src[2]
        if val.dtype.count == 1:
            return super().render_store(body, u)
        p, idx = body.ref(u.src[0]), body.ref(u.src[1])
        if self.hvx and val.dtype.count == 32 and val.dtype.scalar.itemsize == 1 \
                and val.op is Ops.CAST and val.src[0].dtype.scalar.itemsize == 4:
            # the low bytes of 32 int32 lanes
            lanes = body.ref(val.src[0])
            return body.emit(f"keel_store_bytes32({p} + {idx}, (int32x32)({lanes}));")
        body.emit(f"*({val.dtype.cname}_u *)({p} + {idx}) = {body.ref(val)};")

    def render_prefetch(self, body: Body, u: UOp) -> None:
        if u.arg is not None:  # an l2fetch box (codegen/l2fetch.py)
            return body.emit(hvx.l2fetch(f"{body.ref(u.src[0])} + {body.ref(u.src[1])}", *u.arg))
        # read (0), into L2 but not L1 (locality 2: prefetcht1, PLDL2KEEP): the slice is needed
        # one tile from now, and L1 holds the slice in use
        body.emit(f"__builtin_prefetch({body.ref(u.src[0])} + {body.ref(u.src[1])}, 0, 2);")

    def alu(self, u: UOp, a: list[str]) -> str:
        if u.op is Ops.GEP:
            return f"{a[0]}[{u.arg}]"
        if u.dtype.count == 1 or u.op is Ops.PICK:  # a PICK of vectors indexes an array of them
            return super().alu(u, a)
        if u.op is Ops.DOT4:
            return self.vdot4(u, a)
        if u.op is Ops.MULHI:
            return self.vmulhi(u, [self.lanes(x, s, u) for x, s in zip(a, u.src)])
        if self.hvx and u.dtype.count == 32 and (u.op is Ops.MUL16 or u.op is Ops.ADD and any(
                s.op is Ops.MUL16 and s.dtype.count == 32 for s in u.src)):
            return self.vmul16(u, a)
        return self.valu(u, [self.lanes(x, s, u) for x, s in zip(a, u.src)])

    def vmul16(self, u: UOp, a: list[str]) -> str:
        """Ops.MUL16 on 32 HVX lanes, and an ADD of one to another value: one `vmpyie(Vu.w,
        Vv.h)` accumulate, word times the halfword that holds the small operand, where a 32x32
        multiply is two instructions and the add a third."""
        if u.op is Ops.MUL16:
            acc, m = f"(({self.dtype(u.dtype)}){{0}})", u
        else:
            k = next(i for i, s in enumerate(u.src) if s.op is Ops.MUL16)
            acc, m = self.lanes(a[1 - k], u.src[1 - k], u), u.src[k]
        x, w = (self.lanes(self.body.ref(s), s, u) for s in m.src)
        return f"__builtin_HEXAGON_V6_vmpyiewh_acc_128B({acc}, {x}, {w})"

    def vmulhi(self, u: UOp, a: list[str]) -> str:
        """Ops.MULHI on vectors. On HVX, 32 lanes: vmpye + vmpyo accumulated with <<1:sat:shift
        is floor(a * b / 2^31), exact but where both are -2^31 (the requantization's b is in
        [2^30, 2^31)); one more shift halves it. Otherwise lane by lane in 64 bits."""
        vt, n = self.dtype(u.dtype), u.dtype.count
        if self.hvx and n <= 32:
            x, y = (hvx.fill32(v, n) for v in a)
            q31 = (f"(({self.dtype(dtypes.int32.vec(32))})__builtin_HEXAGON_V6_vmpyowh_sacc_128B("
                   f"__builtin_HEXAGON_V6_vmpyewuh_128B({x}, {y}), {x}, {y}))")
            return f"({hvx.first(q31, n)} >> 1)"
        lanes = [f"((int)(((long long)({a[0]})[{i}] * ({a[1]})[{i}]) >> 32))" for i in range(n)]
        return f"(({vt}){{{', '.join(lanes)}}})"

    def vdot4(self, u: UOp, a: list[str]) -> str:
        """Ops.DOT4 on vectors. On HVX, four scalar bytes against 32 words is one vrmpy: the
        bytes splatted as one word (Vu.ub) times the words' signed bytes (Vv.b), summed per
        32-bit lane. Otherwise lane-wise C."""
        vt, n = self.dtype(u.dtype), u.dtype.count
        if self.hvx and n <= 32 and all(s.dtype.count == 1 for s in u.src[:-1]):
            word = a[0] if len(u.src) == 2 else \
                " | ".join(f"((unsigned)({x}) << {8 * k})" for k, x in enumerate(a[:4]))
            w = hvx.fill32(self.lanes(a[-1], u.src[-1], u), n)
            vrmpy = f"__builtin_HEXAGON_V6_vrmpybusv_128B(__builtin_HEXAGON_V6_lvsplatw_128B(" \
                    f"(int)({word})), {w})"
            return hvx.first(vrmpy, n)
        a = [self.lanes(x, s, u) for x, s in zip(a, u.src)]
        b = dot4_bytes(u, a)
        return dot4_text([f"__builtin_convertvector({x}, {vt})" for x in b[:4]] + [b[4]], vt, vt)

    def operand(self, body: Body, src: UOp, user: UOp) -> str:
        return self.lanes(body.ref(src), src, user)

    def lanes(self, text: str, src: UOp, user: UOp) -> str:
        """A scalar operand of a vector op, broadcast to the op's width."""
        n = user.dtype.count
        if src.dtype.count > 1 or n == 1 or user.op is Ops.VECTORIZE:
            return text
        vt = src.dtype.vec(n)
        lane = f"-(int)({text})" if src.dtype is dtypes.bool else text
        return f"(({self.dtype(vt)}){{{', '.join([lane] * n)}}})"

    def valu(self, u: UOp, a: list[str]) -> str:
        op, dt = u.op, u.dtype
        vt = self.dtype(dt)
        if op is Ops.VECTORIZE:
            lanes = [f"-(int)({x})" if dt.scalar is dtypes.bool else x for x in a]
            return f"(({vt}){{{', '.join(lanes)}}})"
        if op in (Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE):
            mask = f"({a[0]} {INFIX[op]} {a[1]})"
            src = u.src[0].dtype.scalar
            return mask if src.itemsize == 4 else \
                f"__builtin_convertvector({mask}, {self.dtype(_mask(dt))})"
        if op in INFIX:
            return f"({a[0]} {INFIX[op]} {a[1]})"
        if op is Ops.NEG:
            return f"(-({a[0]}))"
        if op is Ops.WHERE:
            return self.select(a[0], a[1], a[2], dt)
        if op in (Ops.MAX, Ops.MIN):
            keep, x, y = self.minmax(u, a, "|")
            return self.select(keep, x, y, dt, mask_bytes=dt.scalar.itemsize)
        if op is Ops.CAST:
            if u.src[0] in self.whole and dt.scalar.itemsize == 4:
                return self.unpacked(u.src[0].dtype.scalar, dt, self.whole[u.src[0]])
            return f"__builtin_convertvector({a[0]}, {vt})"
        if op is Ops.BITCAST:
            return f"(({vt})({a[0]}))"
        if op in (Ops.SHL, Ops.SHR):
            sym = "<<" if op is Ops.SHL else ">>"
            return f"({a[0]} {sym} ({a[1]} & {dt.scalar.bits - 1}))"
        raise NotImplementedError(f"C renderer cannot vectorize {op}")

    def unpacked(self, src: DType, dt: DType, whole: str) -> str:
        """32 bytes or halfwords widened to 32-bit lanes from the whole 128-byte vector at their
        address: HVX's in-order unpacks (lower half first), where clang-19 assembles a 32- or
        64-byte vector lane by lane from scalar loads (and takes seconds to compile it)."""
        u = "" if src.kind == "i" else "u"
        v = whole
        for part in (["b"] if src.itemsize == 1 else []) + ["h"]:
            v = f"__builtin_HEXAGON_V6_lo_128B(__builtin_HEXAGON_V6_vunpack{u}{part}_128B({v}))"
        return f"(({self.dtype(dt)})({v}))"

    def select(self, mask: str, a: str, b: str, dt: DType, mask_bytes: int = 4) -> str:
        """Lane-wise mask ? a : b as bit operations (C has no vector ternary)."""
        width = dt.scalar.itemsize
        ints = self.dtype(_int_of(width).vec(dt.count))
        if width != mask_bytes:
            mask = f"__builtin_convertvector({mask}, {ints})"
        return (f"(({self.dtype(dt)})((({ints})({a}) & {mask}) | "
                f"(({ints})({b}) & ~{mask})))")


class Program(str):
    """The program as one translation unit (what a reader of the source sees), carrying the same
    program split into `units` [(name, C source)]: one per distinct kernel and one for the entry
    points, which toolchain.py builds and caches one object each."""
    units: list[tuple[str, str]]

    def __new__(cls, text: str, units: list[tuple[str, str]]):
        self = super().__new__(cls, text)
        self.units = units
        return self


def _typedefs(r: CRenderer, used: frozenset[DType]) -> str:
    """Typedefs of the vector types `used`, and of the masks a select() of them needs (and on
    HVX its store helper)."""
    counts = {d.count for d in used}
    masks = {_int_of(b).vec(n) for n in counts for b in (1, 2, 4, 8)}  # for select()
    vectors = {d for d in used if d.scalar is not dtypes.bool} | masks
    if r.hvx:  # the register's own type: narrower vectors fill one for HVX's builtins
        vectors.add(dtypes.int32.vec(32))
    return "".join(r.typedef(d) for d in sorted(vectors, key=lambda d: d.cname)) + \
        (HVX_STORE_BYTES if r.hvx else "")


# 32 int32 lanes stored as their low bytes (a requantized int8/uint8 result): packed in the
# vector (two vpacke) and written with masked aligned stores into the one or two 128-byte blocks
# the 32 bytes span, where clang-19 goes through the stack, a word at a time.
HVX_STORE_BYTES = """
static inline void keel_store_bytes32(void *p, int32x32 v) {
  typedef long hvx __attribute__((__vector_size__(128)));
  hvx h = __builtin_HEXAGON_V6_vpackeh_128B((hvx)v, (hvx)v);
  hvx b = __builtin_HEXAGON_V6_vpackeb_128B(h, h);
  unsigned off = (unsigned)p & 127, end = off + 32;
  hvx rot = __builtin_HEXAGON_V6_vlalignb_128B(b, b, off);
  hvx *base = (hvx *)((unsigned)p & ~127u);
  hvx lo = __builtin_HEXAGON_V6_vandqrt_128B(__builtin_HEXAGON_V6_pred_scalar2_128B(off), -1);
  hvx hi = __builtin_HEXAGON_V6_vandqrt_128B(__builtin_HEXAGON_V6_pred_scalar2v2_128B(
      end < 128 ? end : 128), -1);
  hvx first = __builtin_HEXAGON_V6_vandqrt_128B(__builtin_HEXAGON_V6_pred_and_n_128B(
      __builtin_HEXAGON_V6_vandvrt_128B(hi, -1), __builtin_HEXAGON_V6_vandvrt_128B(lo, -1)), -1);
  __builtin_HEXAGON_V6_vS32b_qpred_ai_128B(__builtin_HEXAGON_V6_vandvrt_128B(first, -1), base, rot);
  if (end > 128) {
    hvx rest = __builtin_HEXAGON_V6_vandqrt_128B(
        __builtin_HEXAGON_V6_pred_scalar2_128B(end - 128), -1);
    __builtin_HEXAGON_V6_vS32b_qpred_ai_128B(__builtin_HEXAGON_V6_vandvrt_128B(rest, -1),
                                            base + 1, rot);
  }
}
"""


def _entries(r: CRenderer, launches: list[Launch], buffers: dict[int, Buffer],
             syms: dict[str, str], splits: dict[str, int]) -> str:
    """The entry points (module docstring); `syms` renames kernels (units call them by symbol),
    `splits` says how each (by its symbol) shares out between threads.

    They are a loop over a table, one row per launch (its kernel, its barrier, where its
    arguments live), and a switch with one call per kernel: code that grows with the kernels,
    not the launches. Straight-line calls, one per launch per entry point, cost clang seconds
    at the end of a compile (docs/perf.md); a table row costs a few loads per launch at run
    time."""
    calls = [syms.get(ln.kernel, ln.kernel) for ln in launches]
    first = dict(reversed(list(zip(calls, launches))))  # symbol -> its first launch
    case = {sym: k for k, sym in enumerate(dict.fromkeys(calls))}  # symbol -> keel_call's case
    cases = [f"  case {k}: {sym}(" + ", ".join(
        f"({dtypes.from_np(buffers[b].dtype).cname} *)a[{j}]" for j, b in enumerate(first[sym].args))
        + ", tid, nt); return;" for sym, k in case.items()]
    rows, args = [], []
    for ln, sym in zip(launches, calls):
        rows.append(f"{{{case[sym]}, {int(ln.barrier)}, {len(ln.args)}, {len(args)}}}")
        args += [f"{_at(buffers[b]) * 4 + BASES.get(buffers[b].region, 2)}ull" for b in ln.args]
    n = len(launches)
    sig = "unsigned char *arena, const unsigned char *weights, void *const *io"
    table = (f"#define KEEL_LAUNCHES {n}\n"
             f"#define KEEL_MAX_ARGS {max((len(ln.args) for ln in launches), default=1)}\n"
             "typedef struct { unsigned kernel, barrier, nargs, first; } keel_row;\n"
             f"static const keel_row keel_rows[{max(n, 1)}] = {{{', '.join(rows) or '{0}'}}};\n"
             "/* an argument: its offset (io: slot) * 4 + its region (BASES: 0 arena, 1 weights, "
             "2 io[slot]) */\n"
             f"static const unsigned long long keel_args[{max(len(args), 1)}] = "
             f"{{{', '.join(args) or '0'}}};\n"
             "static void keel_call(unsigned kernel, void *const *a, int tid, int nt) {\n"
             "  switch (kernel) {\n" + "\n".join(cases) + "\n  }\n}\n"
             f"static void *const *keel_bind(const keel_row *r, {sig}, void **a) {{\n"
             "  for (unsigned j = 0; j < r->nargs; j++) {\n"
             "    unsigned long long v = keel_args[r->first + j], at = v >> 2;\n"
             "    a[j] = (v & 3) == 0 ? (void *)(arena + at) : (v & 3) == 1 ? (void *)(weights + at)"
             " : io[at];\n  }\n  return a;\n}\n")
    # one thread runs the threaded body (its barriers pass at once)
    graph = _threaded(ENTRY_MT, sig, timed=False) + _threaded(PROFILE, sig, timed=True) + \
        f"void {ENTRY}({sig}) {{\n  keel_sync s = {{0}};\n  {ENTRY_MT}(arena, weights, io, 0, 1, &s);\n}}\n" + \
        f"unsigned long long {abi.TICKS}(void) {{ return KEEL_TICKS(); }}\n"
    return table + graph + _replay(n, [splits[sym] for sym in case])


def _replay(n: int, splits: list[int]) -> str:
    """keel_launch, keel_launch_part and keel_split: a launch alone, or one share of it (what a
    device replaying the launch table calls, runner/mock.py and dsp/graph_runner.h)."""
    known = f"launch >= 0 && launch < {n}"
    return (f"static const unsigned char keel_splits[{max(len(splits), 1)}] = "
            f"{{{', '.join(map(str, splits)) or '0'}}};\n"
            f"int {SPLIT}(int launch) {{\n"
            f"  return {known} ? keel_splits[keel_rows[launch].kernel] : 0;\n}}\n"
            f"void {LAUNCH_PART}(int launch, void *const *args, int tid, int nt) {{\n"
            f"  if ({known}) keel_call(keel_rows[launch].kernel, args, tid, nt);\n}}\n"
            f"void {LAUNCH}(int launch, void *const *args) {{\n"
            f"  {LAUNCH_PART}(launch, args, 0, 1);\n}}\n")


# an argument's region code in keel_args; io (inputs and outputs) is 2, its slot an index into io
BASES = {Region.ARENA: 0, Region.WEIGHTS: 1}


def _at(b: Buffer) -> int:
    """Where keel_args finds a buffer: its io slot, or its offset in the arena / the weights."""
    return b.offset if b.slot is None else b.slot


def _int_of(nbytes: int) -> DType:
    return {1: dtypes.int8, 2: dtypes.int16, 4: dtypes.int32, 8: dtypes.int64}[nbytes]


def _mask(dt: DType) -> DType:
    """Vector compares yield integer lanes of 0 / -1; keel's vector bool is the 32-bit form."""
    return dtypes.int32.vec(dt.count) if dt.scalar is dtypes.bool else dt

