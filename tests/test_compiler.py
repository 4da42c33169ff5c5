"""The compiler core: IR invariants, rewrite engine, symbolic index math, fusion, freestanding
code, bad input. End-to-end numerics against onnxruntime live in test_models.py / test_fuzz.py."""
from __future__ import annotations

import decimal
import math
import re
import subprocess
import sys
from decimal import Decimal

import numpy as np
import onnx
import pytest

from compiler.pipeline import compile_model
from compiler.ir.dtypes import dtypes
from compiler.errors import CompileError
from compiler.codegen.lower import iconst, reshape_index
from compiler.ir.kernel import Axis, AxisKind
from compiler.ir.rewrite import PatternMatcher, Rewriter, UPat, graph_rewrite
from compiler.ir.symbolic import symbolic
from compiler.ir.uop import Ops, UOp
from tests.graphs import (assert_close, hostile_floats, keel_load, keel_run, make_model,
                          ort_run, single_node_model, ulps)

IDX = dtypes.index


def rng_var(name: int, end: int) -> UOp:
    return UOp(Ops.RANGE, IDX, (iconst(end),), (name, AxisKind.LOOP))


def simplify(u: UOp) -> UOp:
    return graph_rewrite(u, symbolic)


# ---- IR and rewrite engine --------------------------------------------------------------------
def test_uops_are_hash_consed():
    a = UOp.const(3, IDX) + rng_var(0, 8)
    b = UOp.const(3, IDX) + rng_var(0, 8)
    assert a is b


def test_rewrite_reaches_fixpoint_on_deep_graph():
    # 20k-deep chain of +0: iterative rewriting must not hit the recursion limit
    x = rng_var(0, 4)
    for _ in range(20000):
        x = UOp(Ops.ADD, IDX, (x, iconst(0)))
    assert simplify(x) is rng_var(0, 4)


def test_patterns_match_commutative_sources():
    pm = PatternMatcher([(UPat(Ops.MUL, src=(UPat.var("x"), UPat.cvar("c"))),
                          lambda x, c: x if c.arg == 1 else None)])
    r = rng_var(0, 4)
    assert graph_rewrite(UOp(Ops.MUL, IDX, (iconst(1), r)), pm) is r


def test_a_rewriter_that_simplified_the_pieces_gives_what_rewriting_the_whole_gives():
    # lowering hands each piece to the kernel's Rewriter as it builds (codegen/lower.py): the
    # kernel must come out as if it had been simplified once, at the end
    i, j = rng_var(0, 6), rng_var(1, 10)
    flat = (i * 10 + j + 0) * 1
    rw = Rewriter(symbolic)
    early = rw((rw(flat) // 10) % 6 + rw(flat % 10) * 3)
    assert early is simplify((flat // 10) % 6 + (flat % 10) * 3)
    assert early is simplify(i + j * 3)


@pytest.mark.parametrize("src, dst", [((2, 3, 4), (6, 4)), ((1, 6, 1, 4), (2, 3, 4, 1)),
                                      ((24,), (2, 3, 4)), ((4, 6), (2, 12)), ((6, 4), (4, 6)),
                                      ((2, 1, 3), (6,)), ((1,), (1, 1))])
def test_reshape_index_addresses_the_element_numpy_reshape_does(src, dst):
    # lower.py splits a reshape into runs of dims and maps each run on its own
    a = np.arange(math.prod(src)).reshape(src)
    b = a.reshape(dst)
    for ix in np.ndindex(*src):
        out = tuple(simplify(u).arg for u in reshape_index(tuple(map(iconst, ix)), src, dst))
        assert b[out] == a[ix], (src, dst, ix, out)


# ---- symbolic index math ----------------------------------------------------------------------
def test_reshape_roundtrip_index_simplifies_to_the_loop_variables():
    i, j = rng_var(0, 6), rng_var(1, 10)
    flat = i * 10 + j
    assert simplify((flat // 10) % 6) is i
    assert simplify(flat % 10) is j


def test_split_axis_index_divides_exactly():
    outer, lane = rng_var(0, 32), UOp.const(3, IDX)
    idx = (outer * 4 + lane) * 7 + rng_var(1, 7)
    assert simplify(idx // 7) is simplify(outer * 4 + 3)


def test_mask_known_from_ranges_folds_to_constant():
    i = rng_var(0, 5)
    assert simplify(i.lt(5)).arg is True
    assert simplify((i + 1).lt(1)) is simplify(i.lt(0))
    assert simplify(i.lt(0)).arg is False


def test_split_and_joined_dim_index_is_the_loop_variable():
    # (r // 28) * 28 + r % 28 == r: a merged dim indexing a tensor through its two halves
    r, c = rng_var(0, 784), rng_var(1, 16)
    assert simplify(c * 50176 + ((r // 28) % 28) * 28 + r % 28 + 7) is simplify(c * 50176 + r + 7)


def test_common_factor_divides_out():
    a, b = rng_var(0, 100), rng_var(1, 2)
    assert simplify((a * 4 + b * 2) // 8) is simplify(a // 2)


def test_a_clipped_row_and_column_cast_to_an_index_divide_back_exactly():
    # the warp's gather index (models/modeld_step.py): int32 row * 2048 + column, each clipped to
    # the image, cast to an index: where the sum cannot wrap the cast distributes over it and
    # // and % by the row width fold to the row and the column
    i32 = dtypes.int32
    row, col = (rng_var(n, 5000).cast(i32).maximum(0).minimum(top)
                for n, top in ((0, 1823), (1, 2047)))
    idx = (row * 2048 + col).cast(IDX)
    assert simplify(idx // 2048) is simplify(row.cast(IDX))
    assert simplify(idx % 2048) is simplify(col.cast(IDX))
    # a sum that may wrap in int32 keeps its cast, and so its division
    wide = (row * (1 << 21) + col).cast(IDX)
    assert simplify(wide // (1 << 21)).op is Ops.IDIV


# ---- fusion -----------------------------------------------------------------------------------
def _conv_block(residual: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.1
    b = rng.standard_normal(8).astype(np.float32)
    nodes = [onnx.helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             onnx.helper.make_node("Relu", ["c"], ["r"])]
    out = "r"
    if residual:
        nodes.append(onnx.helper.make_node("Add", ["r", "x"], ["y"]))
        out = "y"
    return make_model(nodes, [("x", (1, 8, 12, 12), np.float32)], [(out, (1, 8, 12, 12), np.float32)],
                      [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b")])


def test_conv_bias_activation_residual_is_one_kernel():
    art = compile_model(_conv_block(residual=True))
    # one compute kernel; the only other launch copies the input into a zero-bordered buffer so
    # the conv's 72-deep reduction reads without bounds checks
    compute = [ln.kernel for ln in art.launches if "_copy_" not in ln.kernel]
    assert len(compute) == 1 and compute[0].startswith("k1_radd"), art.launches
    assert len(art.launches) == 2
    x = np.random.default_rng(1).standard_normal((1, 8, 12, 12)).astype(np.float32)
    got = keel_run(_conv_block(residual=True), {"x": x})
    want = ort_run(_conv_block(residual=True), {"x": x})
    # fp32 with FMA contraction and a different summation order than MLAS: a few ulp per term
    assert_close(got["y"], want["y"], rtol=1e-5, atol=1e-5)


def _queued_gather(row: int) -> onnx.ModelProto:
    """Concat(q, Gather(src, index)): a gather under a PAD five times its size, its index
    costly (a perspective-like division, floor and clip), as the modeld warp joins its queue."""
    mk, dt = onnx.helper.make_node, np.uint8 if row == 1 else np.float32
    nodes = [mk("Mul", ["s", "k"], ["a"]), mk("Add", ["a", "k"], ["b"]),
             mk("Mul", ["w", "k"], ["e"]), mk("Add", ["e", "k"], ["f"]),
             mk("Div", ["b", "f"], ["d"]), mk("Floor", ["d"], ["r"]),
             mk("Max", ["r", "lo"], ["m"]), mk("Min", ["m", "hi"], ["c"]),
             mk("Cast", ["c"], ["i"], to=onnx.TensorProto.INT32),
             mk("Gather", ["src", "i"], ["g"], axis=0),
             mk("Reshape", ["g", "shape"], ["g2"]), mk("Concat", ["q", "g2"], ["y"], axis=0)]
    inits = [onnx.numpy_helper.from_array(np.asarray(v, t), n) for n, v, t in (
        ("k", 0.37, np.float32), ("lo", 0, np.float32), ("hi", 99, np.float32),
        ("shape", [1, 64 * row], np.int64))]
    ins = [("src", (100, row), dt), ("s", (64,), np.float32), ("w", (64,), np.float32),
           ("q", (4, 64 * row), dt)]
    return make_model(nodes, ins, [("y", (5, 64 * row), dt)], inits)


@pytest.mark.parametrize("target, row, stored", [("opencl", 1, ("uint8", (64, 1))),
                                                  ("opencl", 16, ("int32", (64,))),
                                                  ("cpu", 1, ("int32", (64,)))])
def test_a_queued_gather_with_a_costly_index_stores_its_values_on_a_gpu(target, row, stored):
    # on a GPU one byte per sample beats a four-byte index: the gather is computed once, in the
    # kernel that computes its index; rows of 16 floats are more bytes than the index, which is
    # stored, as on a CPU (a gather would cost the coordinate kernel its vectors)
    model = _queued_gather(row)
    arena = {(b.dtype, tuple(b.shape)) for b in compile_model(model, target=target).buffers
             if str(b.region) == "arena"}
    assert arena == {stored}
    rng, dt = np.random.default_rng(0), np.uint8 if row == 1 else np.float32
    feeds = {"src": rng.integers(0, 256, (100, row)).astype(dt),
             "s": rng.uniform(-5, 45, 64).astype(np.float32),
             "w": rng.uniform(0.5, 2, 64).astype(np.float32),
             "q": rng.integers(0, 256, (4, 64 * row)).astype(dt)}
    # exact: the same samples (none of the 64 quotients lies within an ulp of an integer,
    # where a device division allowed 2.5 ulp could floor differently)
    np.testing.assert_array_equal(keel_run(model, feeds, target)["y"],
                                  ort_run(model, feeds)["y"])


def test_identical_kernels_share_one_program():
    nodes = [onnx.helper.make_node("Relu", ["x"], ["a"]), onnx.helper.make_node("Relu", ["z"], ["b"])]
    model = make_model(nodes, [("x", (4, 16), np.float32), ("z", (4, 16), np.float32)],
                       [("a", (4, 16), np.float32), ("b", (4, 16), np.float32)])
    art = compile_model(model)
    assert len(art.launches) == 2 and len({ln.kernel for ln in art.launches}) == 1


# ---- freestanding code and renderers ------------------------------------------------------------
def _undefined_symbols(code: bytes, tmp_path) -> list[str]:
    path = tmp_path / "k.so"
    path.write_bytes(code)
    out = subprocess.run(["llvm-nm-19", "-u", str(path)], capture_output=True, text=True)
    if out.returncode:
        out = subprocess.run(["nm", "-u", str(path)], capture_output=True, text=True)
    return out.stdout.split()


def _transcendental_model() -> onnx.ModelProto:
    names = ["Exp", "Log", "Sin", "Erf", "Tanh", "Sqrt", "Sigmoid"]
    nodes = [onnx.helper.make_node("Abs", ["x"], ["ax"])]
    nodes += [onnx.helper.make_node(n, ["ax" if n in ("Log", "Sqrt") else "x"], [f"y{i}"])
              for i, n in enumerate(names)]
    return make_model(nodes, [("x", (64,), np.float32)],
                      [(f"y{i}", (64,), np.float32) for i in range(len(names))])


def test_kernels_need_no_libc_or_libm(tmp_path):
    art = compile_model(_transcendental_model())
    assert _undefined_symbols(art.programs, tmp_path) == []


def test_transcendentals_match_onnxruntime_to_a_few_ulp():
    model = _transcendental_model()
    x = np.linspace(-20, 20, 64).astype(np.float32)
    got, want = keel_run(model, {"x": x}), ort_run(model, {"x": x})
    for name in want:
        # polynomial approximations, reduced-range error ~1e-7 relative: 4 float32 ulp
        assert_close(got[name], want[name], rtol=5e-7, atol=2e-7, what=name)


# Largest error against the exact value (numpy's float64, itself within an ulp of float64), in
# float32 ulps, measured on tests/graphs.py's hostile_floats and ~250,000 more (values next to
# multiples of pi/2 up to 2^40 of them, next to 1, random bit patterns), and why:
TRIG_ULPS = {
    # the reduction is exact to 2^-32 of r (transcendental.py _reduce32), the Taylor terms past
    # degree 12 are under 6e-12: what is left is float32 rounding (measured 1.88)
    "Sin": 2, "Cos": 2,
    # sin / cos, each within 2 (measured 2.42; 3.06 on PoCL, whose division OpenCL lets be
    # 2.5 ulp off)
    "Tan": 4,
    # a polynomial under 1, e^(|x|/2) squared past ln(max) (measured 1.8)
    "Sinh": 2, "Cosh": 2,
    # log1p as log(u) t / (u - 1): keel's log is within 2.8 ulp (log2 times ln 2) and the
    # ratio's roundings add to it (measured 3.4, 4.2 for Acosh next to 1, 3.0; 3.6 for Atanh
    # on PoCL)
    "Asinh": 4, "Acosh": 5, "Atanh": 4,
}
TRIG_EXACT = {"Sin": np.sin, "Cos": np.cos, "Tan": np.tan, "Sinh": np.sinh, "Cosh": np.cosh,
              "Asinh": np.arcsinh, "Acosh": np.arccosh, "Atanh": np.arctanh}


def trig_model(x: np.ndarray) -> onnx.ModelProto:
    nodes = [onnx.helper.make_node(op, ["x"], [op]) for op in TRIG_ULPS]
    return make_model(nodes, [("x", x.shape, x.dtype)], [(op, x.shape, x.dtype) for op in TRIG_ULPS])


def check_trig(x: np.ndarray, got: dict, want: dict, ulps_of_ort: float = 2.0) -> None:
    """Within TRIG_ULPS of the exact value and of onnxruntime (whose own error is under
    `ulps_of_ort`: 1.93 measured, for Sin), exactly onnxruntime's where it is 0, inf or NaN."""
    for op, bound in TRIG_ULPS.items():
        with np.errstate(all="ignore"):
            exact = TRIG_EXACT[op](x.astype(np.float64))
        g, w = got[op], want[op]
        special = (w == 0) | ~np.isfinite(w)
        np.testing.assert_array_equal(g[special], w[special], err_msg=f"{op} of {x[special]}")
        assert (np.signbit(g) == np.signbit(w))[special & ~np.isnan(w)].all(), op
        err = ulps(g, exact)
        worst = int(np.argmax(err))
        assert err[worst] <= bound, (op, x[worst], g[worst], exact[worst])
        assert ulps(g, w).max() <= bound + ulps_of_ort, op


def test_trig_and_hyperbolics_are_within_a_few_ulp_at_every_magnitude():
    """1e-30 and 1e30 included: sin and tan of 1e30 were -inf and NaN (a reduction exact only to
    about 2^24 pi), asinh(1e30) inf (x * x), sinh, asinh, atanh of 1e-30 0 (cancellation)."""
    x = hostile_floats(np.float32)
    model = trig_model(x)
    check_trig(x, keel_run(model, {"x": x}), ort_run(model, {"x": x}))


def test_expm1_and_erfc_activations_keep_their_digits_near_zero_and_in_the_tail():
    """Elu, Selu, Celu as e^x - 1 lost every digit near 0 (Elu(-1e-30) was 0, Elu(-3e-4) 2,000
    ulp off), Gelu as 1 + erf(x / sqrt 2) in its negative tail (900 ulp at -3.4); onnxruntime
    computes them that way and is as far off, so the reference is the exact value: within 2.5
    ulp for the expm1 forms (a degree-9 series under |x| = 1/2, first omitted term 3e-10;
    measured 2.02), 100 for Gelu, whose erfc is Numerical Recipes' fit (fractional error
    1.2e-7, 2 ulp) times two exps and a few roundings (measured 97, at -12.6: 1e-5 relative
    where onnxruntime's is off by 100%). Results under the smallest normal float flush to 0 as
    exp's do (transcendental.py `_exp`); zeros keep onnxruntime's signs (Selu(-0.0) is +0.0)."""
    x = np.concatenate([hostile_floats(np.float32), np.linspace(-8, 8, 4001, dtype=np.float32)])
    ops = ["Elu", "Selu", "Celu", "Gelu"]
    model = make_model([onnx.helper.make_node(op, ["x"], [op]) for op in ops],
                       [("x", x.shape, np.float32)], [(op, x.shape, np.float32) for op in ops],
                       opset=20)
    got, want = keel_run(model, {"x": x}), ort_run(model, {"x": x})
    v = x.astype(np.float64)
    alpha, gamma = 1.67326319217681884765625, 1.05070102214813232421875
    with np.errstate(all="ignore"):
        exact = {"Elu": np.where(v < 0, np.expm1(v), v), "Celu": np.where(v < 0, np.expm1(v), v),
                 "Selu": np.where(v > 0, v * gamma, np.expm1(v) * (alpha * gamma)),
                 "Gelu": v * 0.5 * np.vectorize(math.erfc)(-v / math.sqrt(2))}
    for op, bound in {"Elu": 2.5, "Selu": 2.5, "Celu": 2.5, "Gelu": 100}.items():
        normal = ~(np.abs(exact[op]) < np.finfo(np.float32).tiny)
        err = ulps(got[op], exact[op])[normal]
        worst = int(np.argmax(err))
        assert err[worst] <= bound, (op, x[normal][worst], got[op][normal][worst])
        assert (np.abs(got[op][~normal]) < np.finfo(np.float32).tiny).all(), op
        special = (x == 0) | ~np.isfinite(want[op])
        np.testing.assert_array_equal(got[op][special], want[op][special], err_msg=op)
        assert (np.signbit(got[op]) == np.signbit(want[op]))[special & ~np.isnan(x)].all(), op


def test_pow_of_signed_zero_and_minus_one_is_ieees():
    """-0.0 to an odd negative power is -inf (the sign bit, not x < 0, decides), (-1)^+-inf
    is 1 (not exp2(inf * 0)): exactly onnxruntime's."""
    x = np.array([-0.0, -0.0, 0.0, -0.0, -1, -1, -1, 1, -0.0, -2], np.float32)
    y = np.array([-1, -3, -1, -2, np.inf, -np.inf, np.nan, np.nan, 3, 3], np.float32)
    model = make_model([onnx.helper.make_node("Pow", ["x", "y"], ["z"])],
                       [("x", x.shape, np.float32), ("y", y.shape, np.float32)],
                       [("z", x.shape, np.float32)])
    got, want = keel_run(model, {"x": x, "y": y})["z"], ort_run(model, {"x": x, "y": y})["z"]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_is_exact_to_an_ulp_up_to_its_range_edges_and_saturates_past_them(dtype):
    """Exp adds 2^n straight into the polynomial's exponent bits: right for every normal result
    (checked at both edges), inf above, 0 below (subnormal results flush), NaN kept."""
    info = np.finfo(dtype)
    lo, hi = (dtype(math.log(v)) for v in (info.tiny, info.max))
    lo, hi = np.nextafter(lo, dtype(0)), np.nextafter(hi, dtype(0))  # surely inside
    inside = np.concatenate([np.linspace(lo, hi, 4001, dtype=dtype),
                             np.nextafter(np.array([lo, hi], dtype), dtype(0))])
    past = np.array([hi + 1, 1e30, np.inf, lo - 1, -1e30, -np.inf, np.nan], dtype)
    x = np.concatenate([inside, past])
    model = make_model([onnx.helper.make_node("Exp", ["x"], ["y"])], [("x", x.shape, dtype)],
                       [("y", x.shape, dtype)])
    got = keel_run(model, {"x": x})["y"]
    n = inside.size
    with decimal.localcontext() as ctx:  # the exact value, whatever long double is here
        ctx.prec = 40
        ulps = max(abs(Decimal(float(g)) - e) / Decimal(float(np.spacing(dtype(float(e)))))
                   for g, e in zip(got[:n], (Decimal(float(v)).exp() for v in inside)))
    # degree-7/13 Taylor polynomial (first omitted term under a tenth of an ulp) plus the
    # rounding of a dozen ops: measured 0.89 ulp in float32, 0.84 in float64
    assert ulps <= 1, float(ulps)
    assert np.all(got[:n] >= info.tiny) and np.all(np.isfinite(got[:n]))
    np.testing.assert_array_equal(got[n:], np.array([np.inf] * 3 + [0] * 3 + [np.nan], dtype))


def test_one_model_renders_for_two_triples_and_aarch64_cross_compiles(tmp_path):
    model = _conv_block(residual=True)
    x86 = compile_model(model, target="cpu").programs
    arm = compile_model(model, target="cpu-aarch64").programs
    assert x86[:4] == arm[:4] == b"\x7fELF"
    assert int.from_bytes(x86[18:20], "little") == 62  # EM_X86_64
    assert int.from_bytes(arm[18:20], "little") == 183  # EM_AARCH64
    assert _undefined_symbols(arm, tmp_path) == []


# ---- bad input ------------------------------------------------------------------------------------
def test_unsupported_ops_are_all_listed_with_node_and_opset():
    nodes = [onnx.helper.make_node("FooOp", ["x"], ["a"], name="first"),
             onnx.helper.make_node("Relu", ["a"], ["b"]),
             onnx.helper.make_node("BarOp", ["b"], ["y"], name="second")]
    model = make_model(nodes, [("x", (4,), np.float32)], [("y", (4,), np.float32)])
    with pytest.raises(CompileError) as e:
        compile_model(model)
    msg = str(e.value)
    assert "FooOp" in msg and "'first'" in msg and "BarOp" in msg and "'second'" in msg
    assert "opset 17" in msg


def test_dynamic_dim_needs_input_shape_and_the_message_names_it():
    model = single_node_model("Relu", [(("batch", 8), np.float32)])
    model.graph.input[0].name = model.graph.node[0].input[0] = "x"
    with pytest.raises(CompileError, match=r"'x'.*dim 0.*'batch'.*--input-shape"):
        compile_model(model)
    art = compile_model(model, input_shapes={"x": (3, 8)})
    assert art.inputs[0].shape == (3, 8)


def test_cli_rejects_malformed_onnx_with_exit_2_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage that is not a protobuf")
    proc = subprocess.run([sys.executable, "tools/compile.py", str(bad), "-o", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "not a valid ONNX model" in proc.stderr


def test_vector_load_with_per_lane_gates_never_loads_when_no_lane_is_valid():
    # lanes whose gates share no conjunct: the vector load itself must stay gated (by "some lane
    # is valid"), or it would read at an address no lane may touch
    from compiler.codegen.vectorize import Zipper
    p = UOp.param(1, dtypes.float32)
    r = rng_var(0, 64)
    lanes = tuple(UOp(Ops.LOAD, dtypes.float32, (p, r * 4 + k, (r + k).lt(60)))
                  for k in range(4))
    out = Zipper(4, overread={1})(lanes)
    assert out.op is Ops.WHERE
    load = out.src[1]
    assert load.op is Ops.LOAD and load.dtype.count == 4 and len(load.src) == 3
    assert Zipper(4, overread=set())(lanes).op is Ops.VECTORIZE  # not ours to over-read: scalar


def test_conv_weight_lanes_are_packed_side_by_side(monkeypatch):
    # a 3x3 conv vectorizes over output channels, 72 floats apart in ONNX order and unrolled
    # together with kw: packing must put each vector's lanes side by side (one vector load),
    # not in unroll order (an 8-lane gather per kw, 3x slower)
    built = _built_kernels(monkeypatch, _conv_block(residual=False))
    (name, lin, _, perms), = [b for b in built if "radd" in b[0]]
    assert perms, "the conv weight was not packed"
    weight_loads = [u for u in lin if u.op is Ops.LOAD and u.src[0].arg[0] in perms]
    assert any(u.dtype.count > 1 for u in weight_loads)
    gathers = [u for u in lin if u.op is Ops.VECTORIZE and any(
        s.op is Ops.LOAD and s.src[0].arg[0] in perms for s in u.src)]
    assert gathers == []
    x = np.random.default_rng(1).standard_normal((1, 8, 12, 12)).astype(np.float32)
    model = _conv_block(residual=False)
    assert_close(keel_run(model, {"x": x})["r"], ort_run(model, {"x": x})["r"], rtol=1e-5, atol=1e-5)


def test_a_packing_copies_by_strides_exactly_what_its_gather_index_reads():
    # pack.Packing.apply (strided copies, one per copy constant) against the gather through
    # its index, on packings of every shape pack.py makes: lanes or none, negative strides (a
    # flipped read), copies in any arithmetic or irregular order; identity() against the index
    from compiler.codegen.pack import Packing
    rng = np.random.default_rng(7)
    for _ in range(200):
        axes = tuple((int(rng.integers(-40, 40)), int(rng.integers(1, 5)))
                     for _ in range(rng.integers(0, 4)))
        lanes = int(rng.choice([1, 4, 8]))
        step = int(rng.integers(-3, 4)) if lanes > 1 else 0
        consts = tuple(sorted({int(c) for c in rng.integers(0, 60, rng.integers(1, 6))}))
        p = Packing(axes, consts, step, lanes)
        lo, hi = p.bounds()
        idx = p.index()
        assert (lo, hi) == (idx.min(), idx.max())
        flat = rng.standard_normal(hi - lo + 1).astype(np.float32)
        moved = Packing(axes, tuple(c - lo for c in consts), step, lanes)  # reads from 0
        assert np.array_equal(moved.apply(flat), flat.take(moved.index()))
        assert moved.identity() == np.array_equal(moved.index(), np.arange(idx.size))
    assert Packing(((8, 3), (4, 2)), (0, 2), 1, 2).identity()  # row-major [3][2][2][2]
    assert not Packing(((12, 3), (4, 2)), (0, 2), 1, 2).identity()  # a gap between rows


def _built_kernels(monkeypatch, model, **kw):
    import compiler.codegen.build as cb
    built = []
    monkeypatch.setenv("KEEL_CACHE_DIR", "")  # a cached kernel is not built: build them all
    build = cb.build_kernel
    monkeypatch.setattr(cb, "build_kernel", lambda *a: built.append(build(*a)) or built[-1])
    compile_model(model, **{"target": "cpu-avx2", **kw})  # one build: `cpu` has two variants
    return [(b.name, b.lin, b.plan, b.packings) for b in built]


def _depthwise_block() -> onnx.ModelProto:
    """1x1 expand + silu, 3x3 depthwise + silu, squeeze-excite scale, 1x1 project: the
    EfficientNet block whose middle tensors keel stores channels-last."""
    rng = np.random.default_rng(0)
    ws = {"we": (32, 16, 1, 1), "wd": (32, 1, 3, 3), "wp": (16, 32, 1, 1)}
    weights = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.3, n)
               for n, s in ws.items()]
    node = onnx.helper.make_node
    nodes = [node("Conv", ["x", "we"], ["e"]), node("Sigmoid", ["e"], ["es"]),
             node("Mul", ["e", "es"], ["h"]),
             node("Conv", ["h", "wd"], ["d"], pads=[1, 1, 1, 1], group=32),
             node("Sigmoid", ["d"], ["ds"]), node("Mul", ["d", "ds"], ["g"]),
             node("GlobalAveragePool", ["g"], ["p"]), node("Sigmoid", ["p"], ["s"]),
             node("Mul", ["g", "s"], ["gs"]), node("Conv", ["gs", "wp"], ["y"])]
    return make_model(nodes, [("x", (1, 16, 14, 14), np.float32)],
                      [("y", (1, 16, 14, 14), np.float32)], weights)


def test_the_vector_axis_lowers_once_per_vector_and_leaves_no_lane_behind(monkeypatch):
    # lower.py expands the vector axis per vector, its lane a variable in the index, so a
    # 16-lane register tile is built and simplified once, not 16 times (the openpilot-shaped
    # model's 1x1 convs with SiLU epilogues took 0.5-0.7 s each); vectorize.py turns every
    # node that depends on the lane into a vector, so none is left in the program
    import compiler.codegen.build as cb
    from compiler.codegen.lower import lane
    templates, vectorize = [], cb.vectorize
    monkeypatch.setattr(cb, "vectorize", lambda sink, *a: templates.append(sink) or
                        vectorize(sink, *a))
    built = _built_kernels(monkeypatch, _depthwise_block(), target="cpu-avx512")
    assert len(templates) == len(built)  # built in this process, in order
    wide = [(b, t) for b, t in zip(built, templates) if b[2].lanes == 16]
    assert wide, [b[2].lanes for b in built]
    for (name, lin, plan, _), sink in wide:
        upcast = math.prod(a.size for a in plan.axes if a.kind == AxisKind.UPCAST)
        stacks = [u for u in sink.toposort() if u.op is Ops.STACK]
        # one store per vector, not per lane (or one store in a loop over the vectors' STACK)
        assert [len(u.src) for u in stacks] == [upcast // 16] if stacks else \
            len(sink.src) == upcast // 16, name
        assert lane(16) in sink.toposort()
        assert not [u for u in lin if u.op is Ops.RANGE and u.arg[1] == "lane"]
        # whole vectors, or lanes of one (the last conv's NCHW output is strided)
        values = [u.src[2] for u in lin if u.op is Ops.STORE]
        assert values and all(v.dtype.count == 16 or (v.op is Ops.GEP and v.src[0].dtype.count
                                                         == 16) for v in values), name
    # the SiLUs' exp (transcendental.py: 2^n added into the exponent bits) runs on vectors
    assert any(u.op is Ops.BITCAST and u.dtype.count == 16 for (_, lin, _, _), _ in wide
               for u in lin)


def test_a_heavy_epilogue_loops_over_the_register_tile_and_a_light_one_does_not(monkeypatch):
    # lower.py: after a reduction into a register tile of accumulators, a SiLU (a polynomial
    # exp, transcendental.py) runs as one loop over a STACK of them, not once per accumulator in
    # straight-line code (24 copies of it were most of the C clang compiled for the
    # openpilot-shaped model); a Relu stays straight-line. Both match onnxruntime.
    rng = np.random.default_rng(3)
    w = onnx.numpy_helper.from_array(rng.standard_normal((32, 16, 1, 1)).astype(np.float32), "w")
    node = onnx.helper.make_node
    x = rng.standard_normal((1, 16, 12, 12)).astype(np.float32)
    for act, heavy in (("Sigmoid", True), ("Relu", False)):
        nodes = [node("Conv", ["x", "w"], ["c"]), node(act, ["c"], ["a"]),
                 node("Mul", ["c", "a"], ["y"])]
        model = make_model(nodes, [("x", x.shape, np.float32)], [("y", (1, 32, 12, 12), np.float32)],
                           [w])
        (name, lin, plan, _), = _built_kernels(monkeypatch, model)
        accs = math.prod(a.size for a in plan.axes if a.kind == AxisKind.UPCAST) // plan.lanes
        assert accs > 1, plan  # a register tile of several vectors
        stacks = [u for u in lin if u.op is Ops.STACK]
        trips = [u.src[0].arg for u in lin
                 if u.op is Ops.RANGE and u.arg[1] == AxisKind.EPILOGUE]
        stores = [u for u in lin if u.op is Ops.STORE]
        if heavy:
            assert [len(u.src) for u in stacks] == [accs] and math.prod(trips) == accs, name
            assert len(stores) == 1 and lin.index(stacks[0]) < lin.index(stores[0])
        else:
            assert stacks == [] and trips == [] and len(stores) == accs, name
        # rounding: the same fp32 ops as onnxruntime in a different order, and keel's exp
        # (transcendental.py, ~2 ulp): 1e-5 relative holds with margin for sums of 16 products
        assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"],
                     rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_depthwise_conv_reads_and_writes_whole_channel_vectors(monkeypatch):
    # in NCHW a 14-wide row is not a whole number of 8-lane vectors and a vector of channels is
    # a gather; channels-last in and out, the depthwise conv loads and stores whole vectors
    built = _built_kernels(monkeypatch, _depthwise_block(), target="cpu-avx2")
    (_, lin, plan, _), = [b for b in built
                          if math.prod(b[2].full_shape[d] for d in b[2].reduce_dims) == 9]
    assert plan.lanes == 8
    assert not [u for u in lin if u.op is Ops.VECTORIZE and any(s.op is Ops.LOAD for s in u.src)]
    stores = [u for u in lin if u.op is Ops.STORE]
    assert stores and all(u.src[2].dtype.count == 8 for u in stores)
    art = compile_model(_depthwise_block(), target="cpu-avx2")
    # the producers store straight into the layout: no transposing copy kernel
    assert not any("copy" in ln.kernel for ln in art.launches), art.launches
    x = np.random.default_rng(1).standard_normal((1, 16, 14, 14)).astype(np.float32)
    model = _depthwise_block()
    # fp32 sums of 16, 9 and 32 terms in another order than MLAS, through two sigmoids: a few
    # ulp of values of order 10
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-4)


def _bottleneck() -> onnx.ModelProto:
    """ResNet's 1x1 expand (64 -> 256 channels over 56x56 pixels) and strided 1x1 downsample
    (256 -> 512, stride 2): both intermediate, so keel picks their layout."""
    rng = np.random.default_rng(0)
    ws = {"we": (256, 64, 1, 1), "wd": (512, 256, 1, 1)}
    weights = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.1, n)
               for n, s in ws.items()]
    node = onnx.helper.make_node
    nodes = [node("Relu", ["x"], ["r"]), node("Conv", ["r", "we"], ["e"]), node("Relu", ["e"], ["h"]),
             node("Conv", ["h", "wd"], ["d"], strides=[2, 2]), node("Relu", ["d"], ["g"]),
             node("GlobalAveragePool", ["g"], ["y"])]
    return make_model(nodes, [("x", (1, 64, 56, 56), np.float32)],
                      [("y", (1, 512, 1, 1), np.float32)], weights)


def test_convs_store_channels_last_and_block_their_loops_for_cache(monkeypatch):
    # NCHW, a conv's vector of output channels is a scatter 3136 floats apart; channels-last
    # it is one store. And walking every pixel tile per channel tile (or the reverse) re-reads
    # an operand bigger than the cache once per tile: the planner blocks a loop instead
    built = _built_kernels(monkeypatch, _bottleneck(), target="cpu-avx2")
    depth = {math.prod(b[2].full_shape[d] for d in b[2].reduce_dims): b for b in built}
    for _, lin, _, _ in (depth[64], depth[256]):
        stores = [u for u in lin if u.op is Ops.STORE]
        assert stores and all(u.src[2].dtype.count == 8 for u in stores)
    expand, strided = depth[64][2], depth[256][2]
    loops = [a for a in expand.axes if a.kind == AxisKind.LOOP]
    # the 800 KB input and the 64 KB weight are both past L1 (and the input past the 256 KB L2
    # the "cpu" target blocks for): the outermost loop is a cache block, a split of a dim that
    # an inner loop walks too
    assert any(a.dim == loops[0].dim for a in loops[1:]), expand.axes
    # the strided conv's 512 KB weight must not be re-read per pixel tile: its channel tiles
    # go outermost, and each tile's 16-channel slice stays in L1 while the pixels go by
    assert strided.axes[0].dim == strided.full_shape.index(512), strided.axes
    x = np.random.default_rng(1).standard_normal((1, 64, 56, 56)).astype(np.float32)
    model = _bottleneck()
    # fp32 sums of 64 and 256 terms, then a mean of 784, in another order than MLAS
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-4)


def test_weight_prefetch_covers_the_next_tiles_slice_spread_over_the_tile(monkeypatch):
    # the strided 1x1 conv walks 98 pixel tiles per 32-channel tile: each tile's reduction steps
    # must hint every line of the next tile's weight slice into L2, from inside the reduction,
    # a line or two per step, and not run further ahead than the tile after that
    from compiler.ir.symbolic import linear_form
    built = _built_kernels(monkeypatch, _bottleneck(), target="cpu-avx512")
    (_, lin, _, perms), = [b for b in built if math.prod(b[2].full_shape[d] for d in b[2].reduce_dims) == 256]
    hints = [u for u in lin if u.op is Ops.PREFETCH]
    assert 1 <= len(hints) <= 2 and all(u.src[0].arg[0] in perms for u in hints)
    reduce = [u for u in lin if u.op is Ops.RANGE and u.arg[1] == AxisKind.REDUCE]
    assert all(lin.index(reduce[-1]) < lin.index(u) for u in hints)  # per reduction step
    load = next(u for u in lin if u.op is Ops.LOAD and u.src[0] is hints[0].src[0] and u.dtype.count > 1)
    wcoef, _ = linear_form(load.src[1])
    tiles = [r for r in wcoef if r.arg[1] != AxisKind.REDUCE]
    slice_ = wcoef[max(tiles, key=lambda r: r.arg[0])]  # packed: the next slice right after
    ranges = sorted({u for h in hints for u in h.toposort() if u.op is Ops.RANGE} - set(tiles),
                    key=lambda r: r.arg[0])
    grid = np.meshgrid(*[np.arange(r.src[0].arg) for r in ranges], indexing="ij")
    at = {r: g.reshape(-1) for r, g in zip(ranges, grid)} | {r: 0 for r in tiles}  # first tile
    ops = {Ops.ADD: np.add, Ops.MUL: np.multiply, Ops.AND: np.bitwise_and}

    def value(u):  # every loop position at once
        return at[u] if u.op is Ops.RANGE else u.arg if u.op is Ops.CONST else \
            ops[u.op](value(u.src[0]), value(u.src[1]))
    lines = set(np.concatenate([value(h.src[1]) for h in hints]) // 16)
    assert set(range(slice_ // 16, 2 * slice_ // 16)) <= lines and max(lines) < 3 * slice_ // 16


def _3x3_over_256_channels() -> onnx.ModelProto:
    w = onnx.numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((32, 256, 3, 3)).astype(np.float32) * 0.05, "w")
    node = onnx.helper.make_node
    nodes = [node("Relu", ["x"], ["r"]), node("Conv", ["r", "w"], ["c"], pads=[1] * 4, strides=[2, 2]),
             node("Relu", ["c"], ["h"]), node("GlobalAveragePool", ["h"], ["y"])]
    return make_model(nodes, [("x", (1, 256, 10, 10), np.float32)], [("y", (1, 32, 1, 1), np.float32)], [w])


def test_channels_last_conv_reads_each_input_line_whole_before_the_next(monkeypatch):
    # channels-last, a 3x3 conv's 9 taps of one channel are lines 1 KiB apart (a power of two:
    # few L1 sets); with the channel loop outermost, every tap's line stays live across all its
    # channels. A line's worth of channels (16 floats) must be the innermost reduce loop. 256
    # channels split into two equal loops of 16: lowering must keep them apart
    built = _built_kernels(monkeypatch, _3x3_over_256_channels(), target="cpu-avx2")
    (_, _, plan, _), = [b for b in built if len(b[2].reduce_dims) == 3]
    cin = plan.full_shape.index(256)
    loops = [a for a in plan.axes if a.kind == AxisKind.REDUCE]
    assert loops[-1] == Axis(cin, 16, AxisKind.REDUCE) and loops.count(loops[-1]) == 2, plan.axes
    x = np.random.default_rng(1).standard_normal((1, 256, 10, 10)).astype(np.float32)
    model = _3x3_over_256_channels()
    # fp32 sums of 2304 terms in another order than MLAS, then a mean of 25
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_c_index_arithmetic_is_pointer_width(monkeypatch):
    # an int index is sign-extended before every address, so clang cannot fold a window tap's
    # `i + 128` into the load: a stride-2 3x3 conv kept each tap in its own register, spilled
    # them, and ran 1.5x slower. Every loop counter and index value must be a `long`
    import compiler.toolchain as tc
    sources = []
    build = tc.build_shared
    monkeypatch.setattr(tc, "build_shared", lambda src, *a: sources.append(src) or build(src, *a))
    compile_model(_3x3_over_256_channels(), target="cpu-avx2")
    kernels = "".join(sources[0].split("static void ")[1:])
    loops = re.findall(r"for \((\w+) r\d+ = ", kernels)
    values = re.findall(r"(\w+) v\d+ = \(r\d+ [*+] ", kernels)  # v = (r3 * 896): index math
    assert loops and values and set(loops) == set(values) == {"long"}, (set(loops), set(values))


def test_a_lone_accumulator_splits_into_one_per_unrolled_part(monkeypatch):
    # 13 outputs (prime): no vector, no register tile, one scalar accumulator per output. Its
    # unrolled parts must each get their own accumulator, or every step waits on the last add
    w = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 13)).astype(np.float32), "w")
    model = make_model([onnx.helper.make_node("MatMul", ["x", "w"], ["y"])],
                       [("x", (1, 64), np.float32)], [("y", (1, 13), np.float32)], [w])
    (_, lin, plan, _), = _built_kernels(monkeypatch, model, target="cpu-avx512")
    reduces = [u for u in lin if u.op is Ops.REDUCE]
    assert len(reduces) == 4 and all(len(u.parts) == 1 for u in reduces), plan.axes
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    # fp32 sums of 64 terms, in 4 interleaved partial sums instead of MLAS's order
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_a_stem_conv_reads_its_few_input_channels_innermost(monkeypatch):
    # channels-last, a 3-channel pixel is 12 contiguous bytes: the channels are the innermost
    # (unrolled) reduce loop, not the window columns 24 bytes apart
    w = onnx.numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((64, 3, 7, 7)).astype(np.float32) * 0.1, "w")
    node = onnx.helper.make_node
    nodes = [node("Conv", ["x", "w"], ["c"], pads=[3] * 4, strides=[2, 2]), node("Relu", ["c"], ["h"]),
             node("GlobalAveragePool", ["h"], ["y"])]
    model = make_model(nodes, [("x", (1, 3, 32, 32), np.float32)], [("y", (1, 64, 1, 1), np.float32)], [w])
    (_, _, plan, _), = [b for b in _built_kernels(monkeypatch, model, target="cpu-avx512")
                        if len(b[2].reduce_dims) == 3]
    reduce = [a for a in plan.axes if a.dim in plan.reduce_dims]
    assert reduce[-1] == Axis(plan.full_shape.index(3), 3, AxisKind.UNROLL), plan.axes
    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)
    # fp32 sums of 147 terms in another order than MLAS, then a mean of 256
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_depthwise_conv_tiles_one_vector_and_walks_its_output_in_memory_order(monkeypatch):
    # channels-last 3x3 depthwise with swish: 64 channels would fill a 4-vector tile, but its
    # channels share no load; and its loops go rows, pixels, channels, as its output lies
    c, hw = 64, 16
    w = onnx.numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((c, 1, 3, 3)).astype(np.float32), "w")
    node = onnx.helper.make_node
    nodes = [node("Relu", ["x"], ["r"]), node("Conv", ["r", "w"], ["c"], pads=[1] * 4, group=c),
             node("Sigmoid", ["c"], ["s"]), node("Mul", ["c", "s"], ["h"]),
             node("GlobalAveragePool", ["h"], ["y"])]
    model = make_model(nodes, [("x", (1, c, hw, hw), np.float32)], [("y", (1, c, 1, 1), np.float32)],
                       [w])
    (_, _, plan, _), = [b for b in _built_kernels(monkeypatch, model, target="cpu-avx512")
                        if len(b[2].full_shape) == 5]
    assert plan.full_shape == (c, hw, hw, 3, 3), plan
    assert Axis(0, 16, AxisKind.UPCAST) in plan.axes, plan.axes  # one 16-lane vector of channels
    assert [a.dim for a in plan.axes if a.kind == AxisKind.LOOP] == [1, 2, 0], plan.axes
    x = np.random.default_rng(1).standard_normal((1, c, hw, hw)).astype(np.float32)
    # 9-term fp32 sums, a polynomial sigmoid (~2 ulp), then a mean of 256
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-6)


def _pad_fed_by(shared: bool) -> onnx.ModelProto:
    """1x1 conv + relu, padded for a direct 3x3 conv over 64 channels (deep: the padded input is
    realized; 8x8 pixels are too few tiles for Winograd); `shared`: the 1x1 result is also
    added to the 3x3 result."""
    rng = np.random.default_rng(0)
    ws = {"w1": (64, 32, 1, 1), "w3": (64, 64, 3, 3), "b1": (64,)}
    weights = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.1, n)
               for n, s in ws.items()]
    node = onnx.helper.make_node
    nodes = [node("Relu", ["x"], ["r"]), node("Conv", ["r", "w1", "b1"], ["e"]), node("Relu", ["e"], ["h"]),
             node("Conv", ["h", "w3"], ["c"], pads=[1] * 4), node("Relu", ["c"], ["g"])]
    nodes += [node("Add", ["g", "h"], ["s"]), node("GlobalAveragePool", ["s"], ["y"])] if shared \
        else [node("GlobalAveragePool", ["g"], ["y"])]
    return make_model(nodes, [("x", (1, 32, 8, 8), np.float32)], [("y", (1, 64, 1, 1), np.float32)], weights)


@pytest.mark.parametrize("shared", [False, True])
def test_a_padded_reduction_is_stored_into_its_padded_buffer(shared):
    # the 3x3 conv reads a padded copy of the 1x1 result; the 1x1 conv writes that copy's
    # interior itself, after a fill of its border, instead of a buffer of its own and a copy
    # kernel. A result read unpadded too keeps its own buffer and the copy
    art = compile_model(_pad_fed_by(shared), target="cpu")
    shape = {b.id: b.shape for b in art.buffers}
    padded = [ln for ln in art.launches if shape[ln.args[0]] == (1, 64, 10, 10)]
    fills = [ln for ln in art.launches if ln.kernel.endswith("_fill")]
    if shared:
        assert not fills and len(padded) == 1 and "_e_" in padded[0].kernel
    else:
        assert len(fills) == 1 and [ln.kernel for ln in padded] == [fills[0].kernel, fills[0].kernel[:-5]]
    x = np.random.default_rng(1).standard_normal((1, 32, 8, 8)).astype(np.float32)
    model = _pad_fed_by(shared)
    # fp32 sums of 32 and 576 terms in another order than MLAS, then a mean of 64
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_a_fill_kernel_never_takes_an_equal_constant_graph_output():
    # the fill of the padded 1x64x10x10 buffer is a flat constant of 6400 zeros, hash-consed to
    # the very node of a zero graph output of that size: the fill must still write the padded
    # buffer, and the output get its own kernel
    model = _pad_fed_by(False)
    model.graph.node.append(onnx.helper.make_node(
        "ConstantOfShape", ["n"], ["z"], value=onnx.numpy_helper.from_array(np.zeros(1, np.float32))))
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([64 * 10 * 10], np.int64), "n"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [6400]))
    x = np.random.default_rng(1).standard_normal((1, 32, 8, 8)).astype(np.float32)
    got, want = keel_run(model, {"x": x}), ort_run(model, {"x": x})
    assert np.array_equal(got["z"], want["z"])
    # fp32 sums of 32 and 576 terms in another order than MLAS, then a mean of 64
    assert_close(got["y"], want["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("conv_reads_it", [False, True])
def test_a_residual_add_overwrites_its_residual_in_place(monkeypatch, conv_reads_it):
    # a = relu(conv(x)) is read by the next conv and, last, by the residual add in the conv
    # after it: that kernel writes its sum over a (one tensor streamed, not two), reading a
    # through its own output pointer. A conv that itself reads a (every channel of a pixel per
    # output) beside the add must not overwrite it
    rng = np.random.default_rng(0)
    weights = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.1, n)
               for n, s in {"w1": (64, 32, 1, 1), "w2": (64, 64, 1, 1), "w3": (64, 64, 1, 1)}.items()]
    node = onnx.helper.make_node
    nodes = [node("Conv", ["x", "w1"], ["c1"]), node("Relu", ["c1"], ["a"]),
             node("Conv", ["a", "w2"], ["c2"]), node("Relu", ["c2"], ["b"]),
             node("Conv", ["a" if conv_reads_it else "b", "w3"], ["c3"]), node("Add", ["c3", "a"], ["s"]),
             node("Relu", ["s"], ["r"]), node("GlobalAveragePool", ["r"], ["y"])]
    model = make_model(nodes, [("x", (1, 32, 12, 12), np.float32)], [("y", (1, 64, 1, 1), np.float32)], weights)
    art = compile_model(model, target="cpu-avx2")
    over = [ln for ln in art.launches if ln.args[0] in ln.args[1:]]
    if conv_reads_it:
        assert not over, [ln.args for ln in art.launches]
    else:
        assert len(over) == 1 and over[0] is art.launches[-2], [ln.args for ln in art.launches]
        lins = {name: lin for name, lin, _, _ in _built_kernels(monkeypatch, model, target="cpu-avx2")}
        assert any(u.op is Ops.LOAD and u.src[0].arg[0] == 0 for u in lins[over[0].kernel])
    x = rng.standard_normal((1, 32, 12, 12)).astype(np.float32)
    want = ort_run(model, {"x": x})["y"]
    for threads, m in zip((1, 2), keel_load(model, threads=(1, 2))):
        # each thread reads the residual it overwrites; fp32 sums of 32 and 64 terms in another
        # order than MLAS, then a mean of 144
        assert_close(m.run({"x": x})["y"], want, rtol=1e-5, atol=1e-5, what=f"{threads} threads")


def test_1x1_conv_pixels_merge_into_one_dim_of_whole_vectors(monkeypatch):
    # 28x28 pixels: a 28-wide row is not a whole number of 8-lane vectors, 784 pixels are
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((16, 32, 1, 1)).astype(np.float32), "w")
    model = make_model([onnx.helper.make_node("Conv", ["x", "w"], ["y"])],
                       [("x", (1, 32, 28, 28), np.float32)], [("y", (1, 16, 28, 28), np.float32)], [w])
    (_, lin, plan, _), = _built_kernels(monkeypatch, model)
    assert 784 in plan.full_shape and 28 not in plan.full_shape
    assert not any(u.op in (Ops.IDIV, Ops.MOD) for u in lin)  # the split index joined again
    x = rng.standard_normal((1, 32, 28, 28)).astype(np.float32)
    # 32-term fp32 dot products in a different order than MLAS: a few ulp of the row's magnitude
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-4)


def _conv3x3(shape, k: int, pads, strides=(1, 1), group: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    n, c, h, w = shape
    weights = [onnx.numpy_helper.from_array((rng.standard_normal((k, c // group, 3, 3)) * 0.1).astype(np.float32), "w"),
               onnx.numpy_helper.from_array(rng.standard_normal(k).astype(np.float32), "b")]
    oh = (h + pads[0] + pads[2] - 3) // strides[0] + 1
    ow = (w + pads[1] + pads[3] - 3) // strides[1] + 1
    node = onnx.helper.make_node
    nodes = [node("Conv", ["x", "w", "b"], ["c"], pads=pads, strides=strides, group=group),
             node("Relu", ["c"], ["y"])]
    return make_model(nodes, [("x", shape, np.float32)], [("y", (n, k, oh, ow), np.float32)], weights)


def _winograd_planes(art) -> list:
    """Shapes of the transformed inputs: 16 planes of (tiles, 1, channels)."""
    return [b.shape for b in art.buffers if len(b.shape) == 4 and b.shape[0] == 16 and b.shape[2] == 1]


@pytest.mark.parametrize("shape, pads", [((2, 32, 15, 13), [1, 1, 1, 1]), ((1, 40, 12, 17), [0, 2, 1, 0])],
                         ids=["odd-output-batch2", "asymmetric-pads"])
def test_a_3x3_conv_runs_as_winograd_matmuls(shape, pads):
    # F(2x2, 3x3): the input's 4x4 tiles are transformed into 16 planes of (tiles, channels),
    # multiplied by the 16 transformed weights, and each tile's 2x2 outputs gathered back; an
    # odd output is cropped from whole tiles, the bias and relu ride on the output transform
    model = _conv3x3(shape, 48, pads)
    n, c, h, w = shape
    tiles = n * -(-(h + pads[0] + pads[2] - 2) // 2) * -(-(w + pads[1] + pads[3] - 2) // 2)
    art = compile_model(model, target="cpu")
    assert _winograd_planes(art) == [(16, tiles, 1, c)]
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    # the same products as a direct conv, regrouped: measured max error 2.4e-6 against
    # onnxruntime (itself 1.8e-6 from float64) on outputs up to 8, whose ulp is 1e-6
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, strides, group", [((1, 64, 8, 8), (1, 1), 1), ((1, 64, 16, 16), (2, 2), 1),
                                                    ((1, 64, 16, 16), (1, 1), 64), ((1, 16, 16, 16), (1, 1), 1)],
                         ids=["16-tiles", "stride-2", "depthwise", "16-channels"])
def test_convs_winograd_does_not_pay_for_stay_direct(shape, strides, group):
    # too few tiles (the 16/9 larger transformed weight is read once per tile), strided or
    # grouped windows, too few channels to fill the matmuls' vectors
    model = _conv3x3(shape, shape[1], [1, 1, 1, 1], strides, group)
    art = compile_model(model, target="cpu")
    assert not _winograd_planes(art)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    # direct convs: sums of up to 576 terms in another order than MLAS
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_a_conv_whose_weight_is_an_input_stays_direct():
    # the transformed weight is computed at compile time, so a weight known only at run time
    # keeps the direct conv (eligible otherwise: 64 channels, 64 tiles)
    node = onnx.helper.make_node
    model = make_model([node("Conv", ["x", "w"], ["y"], pads=[1] * 4)],
                       [("x", (1, 64, 16, 16), np.float32), ("w", (64, 64, 3, 3), np.float32)],
                       [("y", (1, 64, 16, 16), np.float32)], [])
    assert not _winograd_planes(compile_model(model, target="cpu"))
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((1, 64, 16, 16)).astype(np.float32),
             "w": (rng.standard_normal((64, 64, 3, 3)) * 0.1).astype(np.float32)}
    # sums of 576 terms in another order than MLAS, on outputs up to about 10
    assert_close(keel_run(model, feeds)["y"], ort_run(model, feeds)["y"], rtol=1e-5, atol=1e-5)


def _chain(acts: list[str]) -> onnx.ModelProto:
    """MatMul + activation per entry of `acts`, one after another: one kernel each."""
    rng = np.random.default_rng(0)
    node, prev, nodes, inits = onnx.helper.make_node, "x", [], []
    for i, act in enumerate(acts):
        inits.append(onnx.numpy_helper.from_array(
            rng.standard_normal((16, 16)).astype(np.float32), f"w{i}"))
        nodes += [node("MatMul", [prev, f"w{i}"], [f"m{i}"]), node(act, [f"m{i}"], [f"y{i}"])]
        prev = f"y{i}"
    return make_model(nodes, [("x", (4, 16), np.float32)], [(prev, (4, 16), np.float32)], inits)


def test_a_recompile_builds_only_kernels_it_has_not_built_before(tmp_path, monkeypatch):
    from compiler.pipeline import Stages
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    runs = []
    for acts in (["Relu", "Sigmoid"], ["Relu", "Sigmoid"], ["Relu", "Tanh"]):
        st = Stages()
        runs.append((compile_model(_chain(acts), stages=st), st.counts))
    (cold, c0), (warm, c1), (edited, c2) = runs
    n = 1 + len(cold.variants)  # `cpu` builds every kernel once per x86-64 level
    assert c0["kernels"] == {"built": 2 * n, "cached": 0}
    assert c1["kernels"] == {"built": 0, "cached": 2 * n} and c1["build"]["compiled"] == 0
    assert warm.programs == cold.programs  # the same objects, linked the same way
    assert warm.variants[0].programs == cold.variants[0].programs
    # the second activation changed (tanh takes more kernels than sigmoid): everything after
    # the first MatMul + Relu is new, and so are the entry points; that first kernel is not
    new = c2["place"]["programs"] // n - 1
    assert c2["kernels"] == {"built": new * n, "cached": n}, c2
    assert c2["build"] == {"compiled": (new + 1) * n, "cached": n}, c2
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    want = ort_run(_chain(["Relu", "Tanh"]), {"x": x})["y1"]
    # fp32 dot products of 16 terms summed in another order than onnxruntime's, then relu and
    # tanh, which do not grow a relative error: a few ulps of values of order 1-10
    assert_close(keel_run(_chain(["Relu", "Tanh"]), {"x": x})["y1"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
def test_a_dense_layer_with_odd_columns_runs_on_a_padded_weight_in_whole_vectors(monkeypatch, op):
    # 99 output columns (an OCR alphabet's 6625 alike) have no factor of 2: without padding
    # the matmul's vectors are 1 lane wide. The weight gains zero columns up to 112 (a whole
    # number of 16-float lines), the kernel stores 8-lane vectors, and the extra columns are
    # cut off before the bias. (1.6M multiply-adds: smaller products are not padded)
    rng = np.random.default_rng(0)
    node = onnx.helper.make_node
    if op == "MatMul":
        w = rng.standard_normal((256, 99)).astype(np.float32) * 0.1
        nodes = [node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "b"], ["y"])]
    else:
        w = rng.standard_normal((99, 256)).astype(np.float32) * 0.1
        nodes = [node("Gemm", ["x", "w", "b"], ["y"], transB=1)]
    weights = {"w": w, "b": rng.standard_normal(99).astype(np.float32)}
    model = make_model(nodes, [("x", (64, 256), np.float32)], [("y", (64, 99), np.float32)], weights)
    built = _built_kernels(monkeypatch, model, target="cpu-avx2")
    dense = [b for b in built if b[2].reduce_dims]
    assert [b[2].full_shape for b in dense] == [(64, 112, 256)]
    assert dense[0][2].lanes == 8
    x = rng.standard_normal((64, 256)).astype(np.float32)
    # 256-term fp32 dot products in another order than MLAS, outputs up to about 8
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_a_conv_to_odd_channels_feeding_an_output_pads_them_and_stores_as_the_output(monkeypatch):
    # a detector head: a 1x1 conv to 3 anchors x 85 = 255 channels (here 3 x 7 = 21) that is a
    # graph output. Its channels-last input would be gathered into vectors along the pixels;
    # padded to 32 channels it vectorizes along them, and stores NCHW like the output it feeds,
    # so cutting off the extra channels is a contiguous copy, not a transpose
    rng = np.random.default_rng(0)
    node = onnx.helper.make_node
    weights = {"w1": rng.standard_normal((24, 8, 3, 3)).astype(np.float32) * 0.2,
               "w2": rng.standard_normal((21, 24, 1, 1)).astype(np.float32) * 0.2,
               "b": rng.standard_normal(21).astype(np.float32)}
    nodes = [node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]), node("Relu", ["c"], ["r"]),
             node("Conv", ["r", "w2", "b"], ["y"])]
    model = make_model(nodes, [("x", (1, 8, 112, 20), np.float32)],  # 20-pixel rows: 4 lanes
                       [("y", (1, 21, 112, 20), np.float32)], weights)  # 1.1M multiply-adds
    built = _built_kernels(monkeypatch, model, target="cpu-avx2")
    head = [b for b in built if b[2].reduce_dims and 32 in b[2].full_shape]
    assert len(head) == 1
    (copy,) = [b for b in built if not b[2].reduce_dims and 21 in b[2].full_shape]
    # the head's pixels are read as whole vectors (channels-last they would be gathered, one
    # scalar load per lane); the bias is one scalar per channel
    access = [u.dtype if u.op is Ops.LOAD else u.src[2].dtype for u in copy[1]
              if u.op in (Ops.LOAD, Ops.STORE)]
    assert sorted(d.count for d in access) == [1, copy[2].lanes, copy[2].lanes]
    assert copy[2].lanes > 1
    x = rng.standard_normal((1, 8, 112, 20)).astype(np.float32)
    # sums of 72 then 24 terms in another order than MLAS, outputs up to about 10
    assert_close(keel_run(model, {"x": x})["y"], ort_run(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_an_expensive_subexpression_is_computed_once_in_the_kernel_of_its_every_use():
    # exact GELU as torch exports it: erf shares its reciprocal, exp and square among a dozen
    # uses, all in the one kernel that writes y, which computes each once: no buffers for them
    # (there were five, each a pass over the tensor). An exp whose uses end in two kernels
    # (two outputs) still gets its own, so neither kernel recomputes it
    node = onnx.helper.make_node
    consts = {"r2": np.array(math.sqrt(2), np.float32), "one": np.array(1, np.float32),
              "half": np.array(0.5, np.float32)}
    gelu = [node("Div", ["x", "r2"], ["d"]), node("Erf", ["d"], ["e"]),
            node("Add", ["e", "one"], ["p"]), node("Mul", ["x", "half"], ["h"]),
            node("Mul", ["h", "p"], ["y"])]
    shared = [node("Exp", ["x"], ["ex"]), node("Add", ["ex", "one"], ["y1"]),
              node("Mul", ["ex", "half"], ["y2"])]
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32) * 2
    for nodes, outs, launches in ((gelu, ["y"], 1), (shared, ["y1", "y2"], 3)):
        model = make_model(nodes, [("x", (4, 256), np.float32)],
                           [(o, (4, 256), np.float32) for o in outs], consts)
        assert len(compile_model(model, target="cpu").launches) == launches
        got, want = keel_run(model, {"x": x}), ort_run(model, {"x": x})
        for o in outs:  # erf's fit: 1.2e-7 relative; exp: an ulp or two
            assert_close(got[o], want[o], rtol=1e-6, atol=1e-6)
