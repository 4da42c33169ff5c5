"""OpenCL C: one `__kernel` per kernel, all in one program source the runner builds on the device.

Rendered from the same linearized UOps as C, with these differences:
  * "global" RANGEs are work-item ids (`get_global_id`), not loops; the innermost one is id 0.
    Launch.global_size/local_size come from the plan in that order, and a kernel with a planned
    work-group size declares it (`reqd_work_group_size`) so the device compiler can specialise.
  * loads and stores of 2-4 consecutive elements (an upcast axis) are one vload/vstore;
  * buffers with an image layout (compiler.schedule.storage) are `image2d_t` parameters, read with
    `read_imagef` / `read_imageh`: 4 consecutive, texel-aligned loads are one texel read, other
    loads pick one lane of a texel (texel reads are shared within a scope). Their writer stores
    through the pitched row layout. An R8 input image (a camera frame a gather samples) is read
    with `read_imageui` at the element's integer coordinates (index % width, index / width).
  * half buffers without `target.half_compute` are storage only: values are float in registers,
    memory is accessed with vload_half/vstore_half (core OpenCL, no cl_khr_fp16).
"""
from __future__ import annotations

import math

from compiler.artifact import Buffer, Image, Launch
from compiler.ir.dtypes import DType, dtypes
from compiler.errors import CompileError
import compiler.renderers.amdgcn as amdgcn
from compiler.renderers.cstyle import Body, CStyle
from compiler.ir.kernel import WORK_ITEM_KINDS, AxisKind, Plan
from compiler.ir.rewrite import graph_rewrite
from compiler.ir.symbolic import build, symbolic, terms
from compiler.target import Target
from compiler.ir.uop import Ops, UOp

CL_TYPES = {dtypes.bool: "bool", dtypes.int8: "char", dtypes.int16: "short", dtypes.int32: "int",
            dtypes.int64: "long", dtypes.uint8: "uchar", dtypes.uint16: "ushort",
            dtypes.uint32: "uint", dtypes.uint64: "ulong", dtypes.float16: "half",
            dtypes.float32: "float", dtypes.float64: "double", dtypes.index: "int"}
VECTOR_DTYPES = (dtypes.float16, dtypes.float32)
VECTOR_WIDTHS = (4, 3, 2)
SAMPLER = "keel_smp"
NAME_HOLE = "K"  # a kernel_piece's name, until render_program gives the program's
HELPERS = {
    # f32 -> f16 rounding where half is a storage type only: through memory, as vstore_half does
    "keel_round_half": "inline float keel_round_half(float x) {\n"
                       "  ushort h; vstore_half(x, 0, (__private half *)&h);\n"
                       "  return vload_half(0, (__private half *)&h);\n}",
    "keel_lane": "inline float keel_lane(float4 t, int i) {\n"
                 "  return i == 0 ? t.x : i == 1 ? t.y : i == 2 ? t.z : t.w;\n}",
    "keel_lane_h": "inline half keel_lane_h(half4 t, int i) {\n"
                   "  return i == 0 ? t.x : i == 1 ? t.y : i == 2 ? t.z : t.w;\n}",
}


class OpenCLRenderer(CStyle):
    kernel_prefix = "__kernel void"
    buffer_prefix = "__global "

    def __init__(self, target: Target):
        self.target = target
        self.half_compute = target.half_compute
        self.used: set[str] = set()  # helpers and extensions the program needs
        self.rounded_by_store: set[UOp] = set()

    # ---- program ------------------------------------------------------------------------------
    def kernel_piece(self, lin: list[UOp], param_dtypes: list[DType], images: tuple,
                     plan: Plan) -> tuple[str, frozenset]:
        """One kernel's text, rendered where it was built (a worker process, build.py), named
        NAME_HOLE (render_program names it), and the helpers and extensions it uses.
        `param_dtypes` and `images`: every parameter the launch passes (the output first), even
        one whose loads simplified away; `plan`: its global and work-group sizes."""
        self.used = set()
        text = self.render_cl_kernel(lin, param_dtypes, images, plan)
        return text, frozenset(self.used)

    def render_program(self, kernels: list[tuple[str, tuple[str, frozenset]]],
                       launches: list[Launch], buffers: dict[int, Buffer]) -> str:
        """kernels: (name, kernel_piece)."""
        used = frozenset().union(*(u for _, (_, u) in kernels))
        hole = f"{self.kernel_prefix} {NAME_HOLE}("
        body = [text.replace(hole, f"{self.kernel_prefix} {name}(", 1)
                for name, (text, _) in kernels]
        head = [amdgcn.prelude()] if self.target.cl_builtins == "amdgcn" else []
        if "fp16" in used:
            head.append("#pragma OPENCL EXTENSION cl_khr_fp16 : enable")
        if "fp64" in used:
            head.append("#pragma OPENCL EXTENSION cl_khr_fp64 : enable")
        if "image" in used:
            head.append(f"__constant sampler_t {SAMPLER} = CLK_NORMALIZED_COORDS_FALSE | "
                        "CLK_ADDRESS_CLAMP | CLK_FILTER_NEAREST;")
        head += [code for name, code in HELPERS.items() if name in used]
        return "\n".join(head + [""] + body)

    def render_cl_kernel(self, lin: list[UOp], param_dtypes: list[DType], images: tuple,
                         plan: Plan) -> str:
        self.param_dtypes = list(param_dtypes)
        layouts = list(images)
        self.out_image = layouts[0]  # the output is written as a buffer, in its pitched rows
        self.images = {i: img for i, img in enumerate(layouts) if i > 0 and img is not None}
        self.scope: list[UOp] = []  # open loops, for sharing texel reads
        self.global_ids = _global_ids(lin, plan)
        self.loads, self.stores = vector_groups(lin, self.images)
        self.texels: dict[tuple, tuple[str, tuple]] = {}
        self.rounded_by_store = _rounded_by_store(lin) if not self.half_compute else set()
        self.lid = None  # the group's local id, when the kernel reduces across a work-group
        self.combine_after = _combine_point(lin)
        src = super().render_kernel(NAME_HOLE, lin)
        if plan.local is not None:
            wg = ", ".join(map(str, (tuple(plan.local) + (1, 1))[:3]))
            src = f"__attribute__((reqd_work_group_size({wg})))\n" + src
        return src

    # ---- types and literals -------------------------------------------------------------------
    def dtype(self, dt: DType) -> str:
        if dt is dtypes.float16:
            if self.half_compute:
                self.used.add("fp16")
                return "half"
            return "float"  # storage only: half values live in float registers
        if dt is dtypes.float64:
            self.used.add("fp64")
        return CL_TYPES[dt]

    def literal(self, v, dt: DType) -> str:
        if dt.is_float:
            if math.isnan(v) or math.isinf(v):
                text = "NAN" if math.isnan(v) else ("INFINITY" if v > 0 else "(-INFINITY)")
            else:
                text = repr(float(v)) + ("" if dt is dtypes.float64 else "f")
            return text if dt is dtypes.float32 else f"(({self.dtype(dt)}){text})"
        if dt is dtypes.bool:
            return "true" if v else "false"
        suffix = {dtypes.int64: "L", dtypes.uint64: "UL", dtypes.uint32: "u"}.get(dt, "")
        if dt.kind in "ix" and v == dt.min:
            return f"({v + 1}{suffix} - 1)"
        return f"{v}{suffix}"

    # ---- ALU ------------------------------------------------------------------------------------
    def alu(self, u: UOp, a: list[str]) -> str:
        op, dt = u.op, u.dtype
        if op is Ops.SQRT:
            return f"sqrt({a[0]})"
        if op is Ops.MULHI:  # OpenCL's long is 64 bits; `long long` is a reserved word there
            return f"((int)(((long)({a[0]}) * ({a[1]})) >> 32))"
        if op is Ops.CAST:
            if u in self.rounded_by_store:
                return f"({a[0]})"
            if dt is dtypes.float16 and not self.half_compute:
                self.used.add("keel_round_half")
                return f"keel_round_half((float)({a[0]}))"
            return f"(({self.dtype(dt)})({a[0]}))"
        return super().alu(u, a)

    def bitcast(self, src: DType, dst: DType, x: str) -> str:
        return f"as_{self.dtype(dst)}({x})"

    # ---- parameters and work-items ------------------------------------------------------------
    def param_decl(self, p: UOp) -> str:
        i, dt = p.arg[0], p.dtype
        if i in self.images:
            self.used.add("image")
            return f"__read_only image2d_t p{i}"
        const = "" if i == 0 else "const "
        elem = "uchar" if dt is dtypes.bool else CL_TYPES[dt]  # bool has no defined size
        if dt is dtypes.float16 and self.half_compute:
            self.used.add("fp16")
        return f"{self.buffer_prefix}{const}{elem} *{self.restrict} p{i}"

    def render_range(self, body: Body, u: UOp) -> None:
        kind = u.arg[1]
        if kind not in WORK_ITEM_KINDS:
            self.scope.append(u)
            return super().render_range(body, u)
        body.names[u] = f"r{u.arg[0]}"
        fn = "get_global_id" if kind == AxisKind.GLOBAL else "get_local_id"
        body.emit(f"int {body.names[u]} = {fn}({self.global_ids[u]});")
        if kind == AxisKind.GROUP:
            self.lid = (body.names[u], u.src[0].arg)

    def render_endrange(self, body: Body, u: UOp) -> None:
        if u.src[0].arg[1] not in WORK_ITEM_KINDS:
            super().render_endrange(body, u)
            self.scope.pop()
        if u is self.combine_after:
            self._combine(body)

    def render_reduce(self, body: Body, u: UOp) -> None:
        super().render_reduce(body, u)
        if u is self.combine_after:
            self._combine(body)

    def _combine(self, body: Body) -> None:
        """Every work item holds partial accumulators: a halving tree in local memory combines
        them; afterwards all work items hold the totals."""
        if self.lid is None:
            return
        lid, n = self.lid
        reds = [u for u in body.names if u.op is Ops.REDUCE and any(
            r.arg[1] == AxisKind.GROUP for r in u.ranges)]
        tmp = {r: f"lds_{body.names[r]}" for r in reds}
        for r in reds:
            body.emit(f"__local {self.dtype(r.dtype)} {tmp[r]}[{n}];")
            body.emit(f"{tmp[r]}[{lid}] = {body.names[r]};")
        body.emit("barrier(CLK_LOCAL_MEM_FENCE);")
        body.emit(f"for (int s = {n // 2}; s > 0; s >>= 1) {{")
        body.emit(f"  if ({lid} < s) {{")
        for r in reds:
            mine, other = f"{tmp[r]}[{lid}]", f"{tmp[r]}[{lid} + s]"
            body.emit(f"    {mine} = {self.alu(UOp(r.arg, r.dtype, (r, r)), [mine, other])};")
        body.emit("  }")
        body.emit("  barrier(CLK_LOCAL_MEM_FENCE);")
        body.emit("}")
        for r in reds:
            body.emit(f"{body.names[r]} = {tmp[r]}[0];")

    # ---- memory ---------------------------------------------------------------------------------
    def render_load(self, body: Body, u: UOp) -> None:
        p, idx = u.src[0], u.src[1]
        valid = body.ref(u.src[2]) if len(u.src) == 3 else None
        group = self.loads.get(u)
        if group is not None:
            members, base, first = group
            if u not in body.names:  # the first member in program order reads for all
                vec = self._vector_load(body, p, base, first, len(members), valid)
                for lane, m in enumerate(members):
                    body.names[m] = f"{vec}.s{lane}"
            return
        if p.arg[0] in self.images and self.images[p.arg[0]].channels == 1:
            body.bind(u, self._pixel(body, p, idx, valid, u.dtype))
            return
        if p.arg[0] in self.images:
            lane = graph_rewrite(idx % 4, symbolic)
            texel = self._texel(body, p, idx, valid)
            if lane.op is Ops.CONST:
                body.names[u] = f"{texel}.s{lane.arg}"
            else:
                helper = "keel_lane_h" if self.half_compute and p.dtype is dtypes.float16 \
                    else "keel_lane"
                self.used.add(helper)
                body.bind(u, f"{helper}({texel}, {self.expr(body, lane)})")
            return
        ptr, i = body.ref(p), body.ref(idx)
        if p.dtype is dtypes.float16 and not self.half_compute:
            expr = f"vload_half({i}, {ptr})"
        else:
            expr = f"{ptr}[{i}]"
        body.bind(u, expr if valid is None else
                  f"({valid} ? {expr} : {self.literal(0, u.dtype)})")

    def _vector_load(self, body: Body, p: UOp, base: UOp | None, first: int, n: int,
                     valid: str | None) -> str:
        dt = p.dtype
        vtype = f"{self.dtype(dt)}{n}"
        if p.arg[0] in self.images:
            return self._texel(body, p, _offset(base, first), valid)
        ptr = self._address(body, p, base, first)
        fn = f"vload_half{n}" if dt is dtypes.float16 and not self.half_compute else f"vload{n}"
        expr = f"{fn}(0, {ptr})"
        if valid is not None:
            expr = f"({valid} ? {expr} : ({vtype})({self.literal(0, dt)}))"
        return self._bind_vector(body, vtype, expr)

    def _bind_vector(self, body: Body, vtype: str, expr: str) -> str:
        name = f"v{len(body.lines)}"
        body.emit(f"{vtype} {name} = {expr};")
        return name

    def _pixel(self, body: Body, p: UOp, elem: UOp, valid: str | None, dt: DType) -> str:
        """Element `elem` of an R8 unsigned-int image: the texture unit reads it at integer
        coordinates through its 2D cache, where a buffer load would fetch a 64-byte line.
        Where `elem` provably is row * width + column with 0 <= column < width (the modeld
        warp's clipped index, computed in this kernel) the symbolic rules fold the / and % to
        row and column; they stay only where it is not (an index loaded from memory)."""
        width = self.images[p.arg[0]].width
        x, y = (self._coord(body, graph_rewrite(c, symbolic)) for c in (elem % width,
                                                                        elem // width))
        expr = f"(({self.dtype(dt)})read_imageui(p{p.arg[0]}, {SAMPLER}, (int2)({x}, {y})).x)"
        return expr if valid is None else f"({valid} ? {expr} : {self.literal(0, dt)})"

    def _coord(self, body: Body, c: UOp) -> str:
        """A coordinate; a gather's clamped index is never negative, so its `/` and `%` by the
        row width are unsigned: a shift and a mask for 2048, no sign fix-up for 1408."""
        if c.op in (Ops.IDIV, Ops.MOD) and c.src[1].op is Ops.CONST and c.src[0].vmin >= 0:
            sym = "/" if c.op is Ops.IDIV else "%"
            return f"((int)((uint)({self.expr(body, c.src[0])}) {sym} {c.src[1].arg}u))"
        return self.expr(body, c)

    def _texel(self, body: Body, p: UOp, elem: UOp, valid: str | None) -> str:
        """The texel holding element `elem` of image param p; read once per scope."""
        img: Image = self.images[p.arg[0]]
        t = elem // 4
        x = self.expr(body, graph_rewrite(t % img.width, symbolic))
        y = self.expr(body, graph_rewrite(t // img.width, symbolic))
        key = (p.arg[0], x, y, valid)
        hit = self.texels.get(key)
        scope = tuple(self.scope)
        if hit is not None and hit[1] == scope[:len(hit[1])]:
            return hit[0]
        half = self.half_compute and p.dtype is dtypes.float16
        vtype, fn = ("half4", "read_imageh") if half else ("float4", "read_imagef")
        expr = f"{fn}(p{p.arg[0]}, {SAMPLER}, (int2)({x}, {y}))"
        if valid is not None:
            expr = f"({valid} ? {expr} : ({vtype})({self.literal(0, p.dtype)}))"
        name = self._bind_vector(body, vtype, expr)
        self.texels[key] = (name, scope)
        return name

    def render_store(self, body: Body, u: UOp) -> None:
        p, idx, val = u.src
        group = self.stores.get(u)
        if group is not None:
            members, base, first = group
            if u is not members[-1]:
                return  # written with the last member, once every value is defined
            n, dt = len(members), p.dtype
            vals = ", ".join(body.ref(m.src[2]) for m in members)
            vec = f"({self.dtype(dt)}{n})({vals})"
            ptr = self._address(body, p, base, first)
            fn = f"vstore_half{n}" if dt is dtypes.float16 and not self.half_compute \
                else f"vstore{n}"
            body.emit(f"{self._only_one()}{fn}({vec}, 0, {ptr});")
            return
        i = self.expr(body, self._stored_index(p, idx))
        if p.dtype is dtypes.float16 and not self.half_compute:
            body.emit(f"{self._only_one()}vstore_half({body.ref(val)}, {i}, {body.ref(p)});")
        else:
            body.emit(f"{self._only_one()}{body.ref(p)}[{i}] = {body.ref(val)};")

    def _only_one(self) -> str:
        """After a work-group reduction every work item has the result; one of them stores."""
        return "" if self.lid is None else f"if ({self.lid[0]} == 0) "

    def _stored_index(self, p: UOp, idx: UOp) -> UOp:
        """Element index in memory: image-layout buffers have pitched rows."""
        img = self.out_image if p.arg[0] == 0 else None
        if img is None:
            return idx
        inner = img.width * 4
        return graph_rewrite(idx // inner * (img.pitch * 4) + idx % inner, symbolic)

    def _address(self, body: Body, p: UOp, base: UOp | None, first: int) -> str:
        i = self.expr(body, self._stored_index(p, _offset(base, first)))
        return f"{body.ref(p)} + {i}"

    def expr(self, body: Body, u: UOp) -> str:
        """An index expression inline: nodes the kernel already named are referenced."""
        if u.op is Ops.CONST or u in body.names:
            return body.ref(u)
        return self.alu(u, [self.expr(body, s) for s in u.src])


def _offset(base: UOp | None, first: int) -> UOp:
    c = UOp.const(first, dtypes.index)
    return c if base is None else graph_rewrite(base + c, symbolic)


def _split(idx: UOp, order: dict[UOp, int]) -> tuple[UOp | None, int]:
    """index = base + constant offset, base rebuilt in a canonical term order (program order),
    so indices that differ only in the constant share one base node."""
    ts, c = terms(idx)
    merged: dict[UOp, int] = {}
    for k, t in ts:
        merged[t] = merged.get(t, 0) + k
    ts = sorted(((k, t) for t, k in merged.items() if k), key=lambda kt: order[kt[1]])
    return (build(ts, 0, idx.dtype) if ts else None), c


def _multiple_of(base: UOp | None, n: int) -> bool:
    if base is None:
        return True
    ts, c = terms(base)
    return c % n == 0 and all(k % n == 0 for k, _ in ts)


def vector_groups(lin: list[UOp], images: dict[int, Image]):
    """Loads and stores of consecutive elements that can be one vector access.

    Returns ({load: (members, base, first offset)}, {store: (...)}): members in lane order.
    Image loads group only as whole texels (4 lanes starting on a multiple of 4)."""
    loads: dict[tuple, dict[int, UOp]] = {}
    stores: dict[tuple, dict[int, UOp]] = {}
    order = {u: i for i, u in enumerate(lin)}
    for u in lin:
        if u.op not in (Ops.LOAD, Ops.STORE) or u.src[0].dtype not in VECTOR_DTYPES:
            continue
        base, off = _split(u.src[1], order)
        if u.op is Ops.LOAD:
            loads.setdefault((u.src[0], base, u.src[2:]), {})[off] = u
        else:
            stores.setdefault((u.src[0], base), {})[off] = u
    out_loads, out_stores = {}, {}
    for table, out, is_load in ((loads, out_loads, True), (stores, out_stores, False)):
        for key, by_off in table.items():
            image = is_load and key[0].arg[0] in images
            if image and not _multiple_of(key[1], 4):
                continue
            offs = sorted(by_off)
            i = 0
            while i < len(offs):
                o = offs[i]
                widths = (4,) if image else VECTOR_WIDTHS
                n = next((w for w in widths if all(o + k in by_off for k in range(w))
                          and (not image or o % 4 == 0)), 1)
                if n > 1:
                    members = [by_off[o + k] for k in range(n)]
                    for m in members:
                        out[m] = (members, key[1], o)
                i += max(n, 1) if n > 1 else 1
                while i < len(offs) and offs[i] < o + n:
                    i += 1
    return out_loads, out_stores


def _rounded_by_store(lin: list[UOp]) -> set[UOp]:
    """Casts to half whose only users are stores: vstore_half rounds the same way, once."""
    users: dict[UOp, list[UOp]] = {}
    for u in lin:
        for s in u.src:
            users.setdefault(s, []).append(u)
    return {u for u in lin if u.op is Ops.CAST and u.dtype is dtypes.float16 and users.get(u)
            and all(s.op is Ops.STORE and s.src[2] is u for s in users[u])}


def _combine_point(lin: list[UOp]) -> UOp | None:
    """The last REDUCE or reduce-loop end: where a work-group's partial sums are complete."""
    last = None
    for u in lin:
        if u.op is Ops.REDUCE or (u.op is Ops.ENDRANGE and u.src[0].arg[1] == AxisKind.REDUCE):
            last = u
    return last


def _global_ids(lin: list[UOp], plan: Plan) -> dict[UOp, int]:
    ranges = sorted((u for u in lin if u.op is Ops.RANGE and u.arg[1] in WORK_ITEM_KINDS),
                    key=lambda r: r.arg[0])
    ids = {r: len(ranges) - 1 - i for i, r in enumerate(ranges)}
    sizes = tuple(r.src[0].arg for r in reversed(ranges)) or (1,)
    if sizes != tuple(plan.global_size):
        raise CompileError(f"global ranges {sizes} disagree with the plan's global size "
                           f"{tuple(plan.global_size)}")
    return ids
