"""The compile as a list of stages (compiler/pipeline.py): each timed under its own name, each
output checked by the IR spec (compiler/spec.py, on in tests: tests/conftest.py), and none
changed by a later stage."""
from __future__ import annotations

from dataclasses import replace

import pytest

from compiler import pipeline
from compiler.algorithms import choose
from compiler.link import link as link_stage
from compiler.pipeline import Stages, compile_model
from compiler.ir.uop import Ops
from compiler.spec import Spec, SpecError
from models.openpilot import make_toy
from tests.test_compiler import _conv3x3

STAGES = ("frontend", "algorithms", "schedule", "place", "kernels", "link", "assemble", "build")


def test_the_spec_check_is_on_in_tests():
    assert Spec().on


@pytest.mark.parametrize("target", ["cpu", "qcom"])
def test_each_stage_is_timed_under_its_name_and_its_output_passes_the_spec(target, monkeypatch,
                                                                           tmp_path):
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))  # cold: every kernel is built
    seen = []
    real = Spec.__call__
    monkeypatch.setattr(Spec, "__call__", lambda s, stage, v: seen.append(stage) or
                        real(s, stage, v))
    st = Stages()
    compile_model(make_toy(), target=target, stages=st)
    assert [k for k in st.times if k in STAGES] == list(STAGES), st.times
    assert seen == ["frontend", "algorithms", "schedule", "place", "codegen", "link"]
    assert {"plan", "lower", "simplify", "pack", "vectorize", "linearize", "render"} <= \
        set(st.times)  # build_kernel's steps, summed over the workers


def _mutating_link(mutate):
    real = link_stage.link

    def link(placements, uses, built, *rest):
        out = real(placements, uses, built, *rest)
        mutate(placements, uses, built)
        return out
    return link


@pytest.mark.parametrize("what, mutate", [
    ("codegen", lambda p, u, b: b[0].update({k: replace(v, name="other")
                                             for k, v in list(b[0].items())[:1]})),
    ("place", lambda p, u, b: u[0].pop()),
])
def test_a_stage_changing_an_earlier_stage_output_fails_the_compile(what, mutate, monkeypatch):
    """Link changing the programs codegen built, or the launches placement planned: the spec
    check names the stage whose output changed."""
    monkeypatch.setattr(pipeline, "link", _mutating_link(mutate))
    with pytest.raises(SpecError, match=f"stage '{what}': its output changed"):
        compile_model(make_toy(), target="cpu-avx2")


def test_a_kernel_reading_a_tensor_nobody_writes_breaks_the_schedule_spec(monkeypatch):
    real = pipeline._schedule

    def dropped_first(*a):
        s = real(*a)
        return replace(s, kernels=s.kernels[1:])
    monkeypatch.setattr(pipeline, "_schedule", dropped_first)
    with pytest.raises(SpecError, match="stage 'schedule': kernel .* no earlier kernel writes"):
        compile_model(make_toy(), target="cpu-avx2")


def _weight_shapes(g) -> set:
    return {u.shape for _, out in g.outputs for u in out.toposort() if u.op is Ops.WEIGHT}


def test_the_importer_ignores_the_target_and_algorithms_choose_after_it():
    """A Winograd-eligible 3x3 conv (48 channels, 64 tiles): the frontend builds the plain conv
    for every target; the algorithms stage gives CPU targets a new Graph with the transformed
    (16, K, C) weight and leaves the frontend's as it was, and gives a GPU target the
    frontend's Graph itself."""
    model = _conv3x3((1, 48, 16, 16), 48, [1, 1, 1, 1])
    cpu, qcom = pipeline.get_target("cpu-avx2"), pipeline.get_target("qcom")
    g_cpu, g_qcom = (pipeline._frontend({"main": model}, {}, False, t, {}, {}, ())[0]
                     for t in (cpu, qcom))
    for g in (g_cpu, g_qcom):
        assert (48, 48, 3, 3) in _weight_shapes(g) and len(g.choices) == 1
    before = list(g_cpu.outputs)
    chosen = choose(g_cpu, cpu)
    assert (16, 48, 48) in _weight_shapes(chosen) and (16, 48, 48) not in _weight_shapes(g_cpu)
    assert g_cpu.outputs == before and chosen.outputs != before
    assert set(chosen.origins.values()) == set(g_cpu.origins.values())  # provenance kept
    assert choose(g_qcom, qcom) is g_qcom


def test_scheduled_kernels_are_frozen():
    s = pipeline._schedule([pipeline._frontend({"main": make_toy()}, {}, False,
                                               pipeline.get_target("cpu-avx2"), {}, {}, ())[0]],
                           ["main"], pipeline.get_target("cpu-avx2"),
                           pipeline.get_target("cpu-avx2"), {})
    with pytest.raises(AttributeError):
        s.kernels[0].name = "renamed"


@pytest.mark.parametrize("target", ["qcom", "cpu-avx2"])
def test_every_renderer_renders_in_the_worker_and_no_uops_come_back(target, monkeypatch,
                                                                      tmp_path):
    """codegen's output is each kernel's rendered text (OpenCL too), never its UOps: the
    parent only names the kernels and adds the entry points."""
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    got = []
    real = pipeline._kernels
    monkeypatch.setattr(pipeline, "_kernels", lambda *a: got.append(real(*a)) or got[-1])
    art = compile_model(make_toy(), target=target)
    built = [b for variant in got[0][0] for b in variant.values()]
    assert built and all(b.lin is None for b in built)
    assert all(isinstance(b.piece[0], str) and isinstance(b.piece[1], frozenset) for b in built)
    if target == "qcom":  # each piece's text is in the program under its kernel's name
        program = art.programs.decode()
        for b in built:
            assert f"__kernel void {b.name}(" in program
            assert b.piece[0].split("void K(", 1)[1] in program
