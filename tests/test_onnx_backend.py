"""ONNX conformance: the node tests and the `light` real-model tests of onnx.backend.test, run
through keel/backend.py (compile -> blob -> runner), at each test's own rtol/atol.

Out-of-scope tests are excluded by name, each pattern with its reason (EXCLUDE). In-scope tests
that fail are listed in XFAIL with the concrete cause; they count as failed in
tools/onnx_coverage.py. test_exclusions_are_out_of_scope keeps EXCLUDE honest: a pattern may only
hide tests whose model really is out of scope.
"""
from __future__ import annotations

import re
import warnings

import numpy as np
import onnx
import onnx.backend.test
import pytest

import keel.backend as onnx_backend
from compiler.pipeline import compile_model
from compiler.errors import CompileError
from tests.graphs import make_model

# (pattern, reason): searched in the test name (onnx.backend.test appends _cpu / _cuda)
EXCLUDE = [
    (r"^test_(adagrad|adam|momentum|nesterov_momentum|gradient)", "training op"),
    (r"^test_ai_onnx_ml_", "ai.onnx.ml domain"),
    (r"^test_flexattention(?!.*_expanded)", "ai.onnx.preview domain"),
    (r"^test_scan_sum", "Scan before opset 9 (a batch axis and sequence_lens)"),
    (r"^test_(identity_sequence|identity_opt|optional_|sequence_|split_to_sequence|"
     r"concat_from_sequence|if_seq|if_opt|loop13_seq|loop16_seq_none)",
     "sequence/optional types"),
    (r"^test_(equal_string|regex_full_match|string_|strnormalizer)", "string tensors"),
    (r"(?i)(bfloat16|_bf16)", "bfloat16 type"),
    (r"(?i)(float8|e4m3|e5m2|e8m0)", "float8 types"),
    (r"(?i)(float4e2m1|u?int4(_|$)|u?int2(_|$))", "int4/uint4/int2/uint2/float4 types"),
    (r"^test_(nonzero|compress|unique|nonmaxsuppression)_",
     "output shape depends on input values (keel compiles static shapes)"),
    (r"^test_image_decoder_", "image codec; output shape depends on the encoded bytes"),
]

# (pattern, reason): in scope, known to fail
XFAIL = [
    (r"^test_bernoulli", "random op: the expected values are draws from numpy's global RNG "
     "(the ONNX test itself says no backend can reproduce them); keel has no RNG op"),
    (r"^test_training_dropout(_default)?(_mask)?_cpu$", "random op: Dropout in training mode "
     "keeps a mask drawn from numpy's global RNG; keel has no RNG op"),
    (r"^test_dft_inverse", "the reference output holds ~2e-7 of float32 FFT rounding noise "
     "where the exact value is 0, above atol=1e-7; keel's DFT (a matmul with float64-built "
     "tables) gives 3e-15"),
]

OUT_OF_SCOPE_TYPES = {"BFLOAT16", "STRING", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2",
                      "FLOAT8E5M2FNUZ", "FLOAT8E8M0", "UINT4", "INT4", "UINT2", "INT2",
                      "FLOAT4E2M1"}
OUT_OF_SCOPE_OPS = {"Adagrad", "Adam", "Momentum", "Gradient",
                    "NonZero", "Compress", "Unique", "NonMaxSuppression", "ImageDecoder"}

with warnings.catch_warnings():  # building the node cases runs numpy on inf/nan on purpose
    warnings.simplefilter("ignore")
    backend_test = onnx.backend.test.BackendTest(onnx_backend, __name__)
backend_test.include(r"^test_.*_cpu$")  # node tests, and the real-model tests that run offline
for _pattern, _reason in EXCLUDE:
    backend_test.exclude(_pattern)
for _pattern, _reason in XFAIL:
    backend_test.xfail(_pattern)
# node tests and the offline `light` real models; the pytorch-converted/-operator and simple
# collections are not part of this suite
globals().update({name: case for name, case in backend_test.enable_report().test_cases.items()
                  if name in ("OnnxBackendNodeModelTest", "OnnxBackendRealModelTest")})
# ~1,300 compiles: minutes whenever a compiler edit makes the blob cache cold
OnnxBackendNodeModelTest = pytest.mark.slow(OnnxBackendNodeModelTest)
# whole CNNs (vgg19, densenet121): compile-bound, minutes on loaded cores
OnnxBackendRealModelTest = pytest.mark.timeout(1200)(pytest.mark.slow(OnnxBackendRealModelTest))


def out_of_scope(model: onnx.ModelProto) -> str | None:
    """Why a model is out of scope (from its content, not its name), or None."""
    types, ops, domains = set(), set(), set()

    def walk(graph):
        for vi in list(graph.input) + list(graph.output):
            kind = vi.type.WhichOneof("value")
            if kind == "tensor_type":
                types.add(onnx.TensorProto.DataType.Name(vi.type.tensor_type.elem_type))
            elif kind is not None:
                types.add(kind)
        for n in graph.node:
            ops.add(n.op_type)
            domains.add(n.domain)
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    types.add(onnx.TensorProto.DataType.Name(a.t.data_type))
                if a.name == "to" and a.type == onnx.AttributeProto.INT:
                    types.add(onnx.TensorProto.DataType.Name(a.i))
                for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(g)

    walk(model.graph)
    if domains - {"", "ai.onnx"}:
        return f"domain {sorted(domains - {'', 'ai.onnx'})}"
    if ops & OUT_OF_SCOPE_OPS:
        return f"op {sorted(ops & OUT_OF_SCOPE_OPS)}"
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    if "Scan" in ops and opset < 9:
        return "Scan-8"
    if any("Sequence" in o and o != "ReverseSequence" or "Optional" in o for o in ops):
        return "sequence/optional op"
    bad_types = types & ({"sequence_type", "optional_type", "map_type"} | OUT_OF_SCOPE_TYPES)
    if bad_types:
        return f"type {sorted(bad_types)}"
    return None


def excluded_reason(test_name: str) -> str | None:
    return _reason(EXCLUDE, test_name)


def xfail_reason(test_name: str) -> str | None:
    return _reason(XFAIL, test_name)


def _reason(table: list, test_name: str) -> str | None:
    return next((reason for pattern, reason in table if re.search(pattern, test_name)), None)


def test_exclusions_are_out_of_scope():
    from onnx.backend.test.loader import load_model_tests
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = load_model_tests(kind="node")
    wrongly_hidden = [c.name for c in cases
                      if excluded_reason(c.name) and not out_of_scope(c.model)]
    not_hidden = [c.name for c in cases if out_of_scope(c.model) and not excluded_reason(c.name)]
    assert wrongly_hidden == [], "EXCLUDE hides in-scope tests"
    assert not_hidden == [], "out-of-scope tests are not excluded"


# ---- the backend's own contract ------------------------------------------------------------------
def test_symbolic_dims_compile_once_per_input_shape():
    model = make_model([onnx.helper.make_node("Relu", ["x"], ["y"])],
                       [("x", ("batch", 3), np.float32)], [("y", ("batch", 3), np.float32)])
    rep = onnx_backend.prepare(model)
    for n in (2, 4, 2):
        x = np.linspace(-1, 1, n * 3, dtype=np.float32).reshape(n, 3)
        np.testing.assert_array_equal(rep.run([x])[0], np.maximum(x, 0))
    assert len(rep._compiled) == 2


def test_shape_input_is_bound_from_the_values_each_run_receives():
    model = make_model([onnx.helper.make_node("Reshape", ["x", "shape"], ["y"])],
                       [("x", (2, 6), np.float32), ("shape", (2,), np.int64)],
                       [("y", None, np.float32)])
    rep = onnx_backend.prepare(model)
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    for shape in ((3, 4), (6, 2)):
        np.testing.assert_array_equal(rep.run([x, np.array(shape)])[0], x.reshape(shape))
    assert rep.constant_inputs == {"shape"}


def test_outputs_come_back_in_graph_order_and_by_name():
    nodes = [onnx.helper.make_node("Neg", ["x"], ["a"]), onnx.helper.make_node("Abs", ["x"], ["b"])]
    model = make_model(nodes, [("x", (3,), np.float32)],
                       [("b", (3,), np.float32), ("a", (3,), np.float32)])
    x = np.array([-1.0, 2.0, -3.0], np.float32)
    out = onnx_backend.run_model(model, [x])
    np.testing.assert_array_equal(out[0], np.abs(x))
    np.testing.assert_array_equal(out["a"], -x)


def test_run_node_runs_one_node():
    node = onnx.helper.make_node("Mod", ["x", "y"], ["z"], fmod=0)
    x, y = np.array([-7, 7, -7], np.int32), np.array([3, -3, -3], np.int32)
    np.testing.assert_array_equal(onnx_backend.run_node(node, [x, y])[0], np.mod(x, y))


def test_unsupported_op_raises_compile_error_naming_it():
    model = make_model([onnx.helper.make_node("NotAnOp", ["x"], ["y"], name="n1")],
                       [("x", (3,), np.float32)], [("y", (3,), np.float32)])
    with pytest.raises(CompileError, match=r"NotAnOp \(node 'n1', opset 17\)"):
        onnx_backend.prepare(model)


def test_empty_outputs_get_a_buffer_but_no_launch():
    # a kernel over zero elements would still store to element 0 of its (empty) output buffer
    nodes = [onnx.helper.make_node("Slice", ["x", "s", "e"], ["y"]),
             onnx.helper.make_node("Relu", ["x"], ["z"])]
    model = make_model(nodes, [("x", (3, 4), np.float32)],
                       [("y", (3, 0), np.float32), ("z", (3, 4), np.float32)],
                       {"s": np.array([2], np.int64), "e": np.array([2], np.int64)})
    model.graph.node[0].input.extend(["ax"])
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "ax"))
    art = compile_model(model)
    empty = {b.id for b in art.buffers if b.nbytes == 0}
    assert empty and not any(launch.args[0] in empty for launch in art.launches)
    y, z = onnx_backend.run_model(model, [np.ones((3, 4), np.float32)])
    assert y.shape == (3, 0) and (z == 1).all()
