"""Shared rendering for C-family kernel languages (C, OpenCL C, HVX C).

A renderer consumes the linear UOp list from linearize.py and writes source text; it never needs a
device. Languages differ only in the tables and hooks a subclass overrides.
"""
from __future__ import annotations

import math

from compiler.ir.dtypes import DType, dtypes
from compiler.ir.uop import Ops, UOp, reduce_identity

INFIX = {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.FDIV: "/", Ops.CMPLT: "<",
         Ops.CMPEQ: "==", Ops.CMPNE: "!=", Ops.AND: "&", Ops.OR: "|", Ops.XOR: "^"}


def dot4_bytes(u: UOp, a: list[str]) -> list[str]:
    """A DOT4's operands with its four bytes apart: a word's (src = (word, w)) shifted out."""
    if len(u.src) == 5:
        return a
    return [f"(({a[0]} >> {8 * k}) & 255)" for k in range(4)] + [a[1]]


def dot4_text(a: list[str], ints: str, word: str) -> str:
    """Ops.DOT4 in C, for scalars or vectors (`ints`: int or an int32 vector type; `word`: the
    word's type to shift left in, unsigned for scalars, where a signed overflow is undefined):
    byte k of the word sign-extended by shifting it to the top and back (arithmetic shift)."""
    w = a[4]
    terms = [f"(({ints})({b}) * (({ints})(({word})({w}) << {24 - 8 * k}) >> 24))"
             for k, b in enumerate(a[:4])]
    return f"({' + '.join(terms)})"


def _plain(u: UOp) -> bool:
    """A constant that is not NaN: a max/min with it needs no NaN test."""
    return u.op is Ops.CONST and not (isinstance(u.arg, float) and math.isnan(u.arg))


class CStyle:
    kernel_prefix = "static void"
    buffer_prefix = ""  # address-space qualifier, e.g. "__global " in OpenCL
    restrict = "restrict"
    sqrt = {dtypes.float32: "__builtin_sqrtf", dtypes.float64: "__builtin_sqrt"}

    def dtype(self, dt: DType) -> str:
        return dt.cname

    def literal(self, v, dt: DType) -> str:
        if dt.is_float:
            if math.isnan(v):
                return "__builtin_nanf(\"\")" if dt is dtypes.float32 else "__builtin_nan(\"\")"
            if math.isinf(v):
                inf = "__builtin_inff()" if dt is dtypes.float32 else "__builtin_inf()"
                return inf if v > 0 else f"(-{inf})"
            text = repr(float(v))
            return {dtypes.float32: f"{text}f", dtypes.float16: f"(_Float16){text}f"}.get(dt, text)
        if dt is dtypes.bool:
            return "1" if v else "0"
        suffix = ("ll" if dt.bits == 64 else "") if dt.kind != "u" else ("ull" if dt.bits == 64 else "u")
        if dt.kind == "i" and v == dt.min:  # -2^63 is not a literal in C, only an expression
            return f"({v + 1}{suffix} - 1)"
        return f"{v}{suffix}"

    # ---- expression per op ------------------------------------------------------------------
    def alu(self, u: UOp, a: list[str]) -> str:
        op, dt = u.op, u.dtype
        if op in INFIX:
            return f"({a[0]} {INFIX[op]} {a[1]})"
        if op is Ops.NEG:
            return f"(-({a[0]}))" if dt is not dtypes.bool else f"(!{a[0]})"
        if op is Ops.WHERE:
            return f"({a[0]} ? {a[1]} : {a[2]})"
        if op is Ops.DOT4:
            return dot4_text(dot4_bytes(u, a), "int", "unsigned")
        if op is Ops.MUL16:
            return f"({a[0]} * {a[1]})"
        if op is Ops.MULHI:
            return f"((int)(((long long)({a[0]}) * ({a[1]})) >> 32))"
        if op in (Ops.MAX, Ops.MIN):
            keep, x, y = self.minmax(u, a, "||")
            return f"({keep} ? {x} : {y})"
        if op is Ops.CAST:
            return f"(({self.dtype(dt)})({a[0]}))"
        if op is Ops.BITCAST:
            return self.bitcast(u.src[0].dtype, dt, a[0])
        if op is Ops.PICK:
            return f"{a[0]}[{a[1]}]"
        if op is Ops.SQRT:
            return f"{self.sqrt[dt]}({a[0]})"
        if op in (Ops.IDIV, Ops.MOD):
            return self.int_divmod(u, a)
        if op in (Ops.SHL, Ops.SHR):
            sym = "<<" if op is Ops.SHL else ">>"
            return f"({a[0]} {sym} ({a[1]} & {dt.bits - 1}))"  # no UB for wide shifts
        raise NotImplementedError(f"{type(self).__name__} cannot render {op}")

    def minmax(self, u: UOp, a: list[str], orop: str) -> tuple[str, str, str]:
        """MAX/MIN as `keep ? x : y`, where a NaN in either operand wins (ONNX Max/Min/Relu,
        onnxruntime). With a non-NaN constant as x, `c > y ? c : y` already yields a NaN y, so
        no NaN test is needed (and clang emits one maxps); otherwise `x != x` keeps a NaN x."""
        if _plain(u.src[1]) and not _plain(u.src[0]):
            a = a[::-1]
        keep = f"({a[0]} {'>' if u.op is Ops.MAX else '<'} {a[1]})"
        if u.dtype.is_float and not _plain(u.src[0]) and not _plain(u.src[1]):
            keep = f"({keep} {orop} ({a[0]} != {a[0]}))"
        return keep, a[0], a[1]

    def int_divmod(self, u: UOp, a: list[str]) -> str:
        sym = "/" if u.op is Ops.IDIV else "%"
        d = u.src[1]
        if d.op is Ops.CONST and d.arg not in (0, -1):
            return f"({a[0]} {sym} {a[1]})"
        # a zero divisor (and INT_MIN / -1) traps in hardware: never let data crash the process
        safe = f"(({a[1]}) == 0 ? 1 : ({a[1]}))"
        if u.dtype.kind == "i":
            neg = f"(-{a[0]})" if u.op is Ops.IDIV else "0"
            return f"(({a[1]}) == -1 ? {neg} : ({a[0]} {sym} {safe}))"
        return f"({a[0]} {sym} {safe})"

    def bitcast(self, src: DType, dst: DType, x: str) -> str:
        return f"(((union {{ {self.dtype(src)} a; {self.dtype(dst)} b; }}){{.a = {x}}}).b)"

    # ---- kernel -------------------------------------------------------------------------------
    def params(self, lin: list[UOp]) -> list[UOp]:
        """Every parameter the launch passes (set in self.param_dtypes by render_program), even
        one whose loads simplified away: the call site still passes it."""
        return [UOp.param(i, dt) for i, dt in enumerate(self.param_dtypes)]

    def param_decl(self, p: UOp) -> str:
        const = "" if p.arg[0] == 0 else "const "
        return f"{self.buffer_prefix}{const}{self.dtype(p.dtype)} *{self.restrict} p{p.arg[0]}"

    def extra_params(self) -> list[str]:
        """Parameters after the buffers (the C target's thread id and count)."""
        return []

    def range_open(self, u: UOp, name: str, end: str) -> str:
        i = self.dtype(u.dtype)
        return f"for ({i} {name} = 0; {name} < {end}; {name}++) {{"

    def render_kernel(self, name: str, lin: list[UOp]) -> str:
        body = self.body = Body(self)  # self.body: for forms that read an operand's operands
        for u in lin:
            op = u.op
            if op is Ops.PARAM:
                body.names[u] = f"p{u.arg[0]}"
            elif op in (Ops.CONST, Ops.SINK):
                continue
            elif op is Ops.RANGE:
                self.render_range(body, u)
            elif op is Ops.ENDRANGE:
                self.render_endrange(body, u)
            elif op is Ops.DEFINE_ACC:
                red = u.src[0]
                body.names[red] = f"acc{len(body.names)}"
                init = self.literal(reduce_identity(red.arg, red.dtype), red.dtype)
                body.emit(f"{self.dtype(red.dtype)} {body.names[red]} = {init};")
            elif op is Ops.REDUCE:
                self.render_reduce(body, u)
            elif op is Ops.LOAD:
                self.render_load(body, u)
            elif op is Ops.STORE:
                self.render_store(body, u)
            elif op is Ops.PREFETCH:
                self.render_prefetch(body, u)
            elif op is Ops.STACK:
                self.render_stack(body, u)
            else:
                body.bind(u, self.alu(u, [body.ref(s) for s in u.src]))
        params = ", ".join([self.param_decl(p) for p in self.params(lin)] + self.extra_params())
        return f"{self.kernel_prefix} {name}({params}) {{\n" + "\n".join(body.lines) + "\n}\n"

    # ---- per-op hooks a language overrides ----------------------------------------------------
    def render_range(self, body: Body, u: UOp) -> None:
        body.names[u] = f"r{u.arg[0]}"
        body.emit(self.range_open(u, body.names[u], body.ref(u.src[0])))
        body.depth += 1

    def render_endrange(self, body: Body, u: UOp) -> None:
        body.depth -= 1
        body.emit("}")

    def render_reduce(self, body: Body, u: UOp) -> None:
        acc = body.names[u]
        for part in u.parts:
            step = UOp(u.arg, u.dtype, (u, part))
            body.emit(f"{acc} = {self.alu(step, [acc, body.ref(part)])};")

    def render_load(self, body: Body, u: UOp) -> None:
        expr = f"{body.ref(u.src[0])}[{body.ref(u.src[1])}]"
        if u.dtype.itemsize != u.src[0].dtype.itemsize:  # bytes read as a word (DOT4's)
            p, idx = body.ref(u.src[0]), body.ref(u.src[1])
            expr = f"(*(const {self.dtype(u.dtype)} *)({p} + {idx}))"
        if len(u.src) == 3:
            expr = f"({body.ref(u.src[2])} ? {expr} : {self.literal(0, u.dtype)})"
        body.bind(u, expr)

    def render_store(self, body: Body, u: UOp) -> None:
        p, idx, val = (body.ref(s) for s in u.src)
        body.emit(f"{p}[{idx}] = {val};")

    def render_stack(self, body: Body, u: UOp) -> None:
        name = body.names[u] = f"s{len(body.lines)}"
        vals = ", ".join(self.operand(body, s, u) for s in u.src)
        body.emit(f"{self.dtype(u.dtype)} {name}[{len(u.src)}] = {{{vals}}};")

    def operand(self, body: Body, src: UOp, user: UOp) -> str:
        """src's value as an operand of user (a vector language broadcasts a scalar)."""
        return body.ref(src)

    def render_prefetch(self, body: Body, u: UOp) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no prefetch")


class Body:
    """A kernel body being written: statements at the current loop depth, and the source name of
    every value rendered so far."""

    def __init__(self, renderer: CStyle):
        self.renderer = renderer
        self.lines: list[str] = []
        self.names: dict[UOp, str] = {}
        self.depth = 1

    def ref(self, u: UOp) -> str:
        if u.op is Ops.CONST:
            return self.renderer.literal(u.arg, u.dtype)
        return self.names[u]

    def emit(self, text: str) -> None:
        self.lines.append("  " * self.depth + text)

    def bind(self, u: UOp, expr: str) -> str:
        """Declare a variable holding `expr` as the value of `u`."""
        name = f"v{len(self.lines)}"
        self.emit(f"{self.renderer.dtype(u.dtype)} {name} = {expr};")
        self.names[u] = name
        return name
