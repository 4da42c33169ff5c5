"""Freestanding C: every kernel plus one graph entry point in a single translation unit.

The entry point is the CPU "command buffer": one call from the runner executes the whole model.
"""
from __future__ import annotations

from compiler.artifact import Buffer, Launch
from compiler.dtypes import DType, dtypes
from compiler.renderers.cstyle import INFIX, Body, CStyle
from compiler.uop import Ops, UOp

ENTRY = "keel_graph"
PROFILE = "keel_profile"  # same graph, recording a timestamp after every launch
# Cycle counter without libc: clang's builtin on every target (rdtsc / cntvct), gcc on x86 only.
TICKS = """
#if defined(__clang__)
#define KEEL_TICKS() __builtin_readcyclecounter()
#elif defined(__x86_64__)
#define KEEL_TICKS() __builtin_ia32_rdtsc()
#else
#define KEEL_TICKS() 0ull
#endif
"""


class CRenderer(CStyle):
    """Vectors use the GCC/clang `vector_size` extension: lane-wise arithmetic and compares (which
    give 0/-1 integer masks), `__builtin_convertvector` for casts, a plain cast for bit casts."""

    def render_program(self, kernels: list[tuple[str, list[UOp]]], launches: list[Launch],
                       buffers: dict[int, Buffer]) -> str:
        used = {u.dtype for _, lin in kernels for u in lin if u.dtype.count > 1}
        counts = {d.count for d in used}
        masks = {_int_of(b).vec(n) for n in counts for b in (1, 2, 4, 8)}  # for select()
        vectors = {d for d in used if d.scalar is not dtypes.bool} | masks
        typedefs = "".join(self.typedef(d) for d in sorted(vectors, key=lambda d: d.cname))
        # every parameter is declared, even one whose loads simplified away: the call passes it
        signature = {ln.kernel: [dtypes.from_np(buffers[b].dtype) for b in ln.args]
                     for ln in reversed(launches)}
        body = [typedefs]
        for name, lin in kernels:
            self.param_dtypes = signature[name]
            body.append(self.render_kernel(name, lin))
        calls = [f"  {ln.kernel}({', '.join(self._arg(buffers[b]) for b in ln.args)});"
                 for ln in launches]
        sig = "unsigned char *arena, const unsigned char *weights, void *const *io"
        entry = f"void {ENTRY}({sig}) {{\n" + "\n".join(calls) + "\n}\n"
        timed = "\n".join(f"{c}\n  ticks[{i + 1}] = KEEL_TICKS();" for i, c in enumerate(calls))
        profile = (f"void {PROFILE}({sig}, unsigned long long *ticks) {{\n"
                   f"  ticks[0] = KEEL_TICKS();\n{timed}\n}}\n")
        return TICKS + "\n".join(body) + "\n" + entry + profile

    def _arg(self, b: Buffer) -> str:
        ty = dtypes.from_np(b.dtype).cname
        if b.region == "arena":
            return f"({ty} *)(arena + {b.offset})"
        if b.region == "weights":
            return f"({ty} *)(weights + {b.offset})"
        return f"({ty} *)io[{b.offset}]"

    def params(self, lin: list[UOp]) -> list[UOp]:
        return [UOp(Ops.PARAM, dt, (), (i, dt)) for i, dt in enumerate(self.param_dtypes)]

    # ---- vectors ----------------------------------------------------------------------------
    def dtype(self, dt: DType) -> str:
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
        body.bind(u, f"(*(const {u.dtype.cname}_u *)({p} + {idx}))")

    def render_store(self, body: Body, u: UOp) -> None:
        val = u.src[2]
        if val.dtype.count == 1:
            return super().render_store(body, u)
        p, idx = body.ref(u.src[0]), body.ref(u.src[1])
        body.emit(f"*({val.dtype.cname}_u *)({p} + {idx}) = {body.ref(val)};")

    def alu(self, u: UOp, a: list[str]) -> str:
        if u.op is Ops.GEP:
            return f"{a[0]}[{u.arg}]"
        if u.dtype.count == 1:
            return super().alu(u, a)
        return self.valu(u, [self.lanes(x, s, u) for x, s in zip(a, u.src)])

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
        n, vt = dt.count, self.dtype(dt)
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
            return f"(-{a[0]})"
        if op is Ops.WHERE:
            return self.select(a[0], a[1], a[2], dt)
        if op in (Ops.MAX, Ops.MIN):
            cmp = ">" if op is Ops.MAX else "<"
            keep = f"(({a[0]} {cmp} {a[1]}) | ({a[0]} != {a[0]}))" if dt.is_float else \
                f"({a[0]} {cmp} {a[1]})"
            return self.select(keep, a[0], a[1], dt, mask_bytes=dt.scalar.itemsize)
        if op is Ops.CAST:
            return f"__builtin_convertvector({a[0]}, {vt})"
        if op is Ops.BITCAST:
            return f"(({vt})({a[0]}))"
        if op in (Ops.SHL, Ops.SHR):
            sym = "<<" if op is Ops.SHL else ">>"
            return f"({a[0]} {sym} ({a[1]} & {dt.scalar.bits - 1}))"
        raise NotImplementedError(f"C renderer cannot vectorize {op}")

    def select(self, mask: str, a: str, b: str, dt: DType, mask_bytes: int = 4) -> str:
        """Lane-wise mask ? a : b as bit operations (C has no vector ternary)."""
        width = dt.scalar.itemsize
        ints = self.dtype(_int_of(width).vec(dt.count))
        if width != mask_bytes:
            mask = f"__builtin_convertvector({mask}, {ints})"
        return (f"(({self.dtype(dt)})((({ints})({a}) & {mask}) | "
                f"(({ints})({b}) & ~{mask})))")


def _int_of(nbytes: int) -> DType:
    return {1: dtypes.int8, 2: dtypes.int16, 4: dtypes.int32, 8: dtypes.int64}[nbytes]


def _mask(dt: DType) -> DType:
    """Vector compares yield integer lanes of 0 / -1; keel's vector bool is the 32-bit form."""
    return dtypes.int32.vec(dt.count) if dt.scalar is dtypes.bool else dt
