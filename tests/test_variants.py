"""One `cpu` blob for every x86-64 host: it holds an x86-64-v3 (cpu-avx2) and an x86-64-v4
(cpu-avx512) build sharing one weights region, and the runner loads the best its host runs
(runner/host.py), or the one KEEL_CPU_VARIANT names. docs/blob.md: format v3."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from onnx import helper

import runner.host
from compiler.blob import assemble, blob_bytes
from compiler.pipeline import compile_model
from compiler.target import TARGETS, variant_targets
from runner import BlobError, ConfigError, Model
from runner.blob import parse_blob
from runner.format import HEADER
from runner.host import choose, missing_flags, parse_flags
from tests.deps import needs_clang
from tests.fuzz_inputs import reseal
from tests.graphs import make_model, ort_run

pytestmark = [needs_clang, pytest.mark.xdist_group("variants")]
BOTH = ["cpu-avx2", "cpu-avx512"]
V3 = "fpu sse2 avx avx2 fma f16c bmi1 bmi2 movbe"
V4 = V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"


def _model():
    """A conv whose packed weights differ per vector width, a bias that does not, and a
    residual add: both variants' plans and both kinds of weights sections."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((32, 16, 3, 3)) * 0.1).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Add", ["r", "c"], ["y"])]
    return make_model(nodes, [("x", (1, 16, 12, 12), "float32")],
                      [("y", (1, 32, 12, 12), "float32")], {"w": w, "b": b})


@pytest.fixture(scope="module")
def blob():
    art = compile_model(_model(), target="cpu")
    return art, blob_bytes(art)


@pytest.fixture(scope="module")
def path(blob, tmp_path_factory):
    p = tmp_path_factory.mktemp("variants") / "m.blob"
    p.write_bytes(blob[1])
    return p


def _manifest(data: bytes) -> dict:
    fields = HEADER.unpack_from(data)
    return json.loads(data[fields[5]:fields[5] + fields[6]])


def test_a_cpu_blob_holds_both_x86_64_levels_sharing_identical_weights_once(blob):
    art, data = blob
    assert (art.target, art.variant, [v.variant for v in art.variants]) == \
        ("cpu", "cpu-avx2", ["cpu-avx512"])
    assert art.variants[0].weights is art.weights  # one region, every variant's offsets into it
    m = _manifest(data)
    assert [v["target"] for v in m["variants"]] == BOTH
    size = {s["name"]: s["size"] for s in m["sections"]}
    # the bias reads the same in both builds: shared; the conv weight is packed per vector
    # width, so each build has its own copy (32*16*9 floats)
    assert 32 * 4 <= size["weights"] < 32 * 16 * 9 * 4
    assert size["weights.cpu-avx2"] == size["weights.cpu-avx512"] == 32 * 16 * 9 * 4
    assert art.programs != art.variants[0].programs
    for a in (art, *art.variants):  # each build's weights buffers index the shared region
        for b in a.buffers:
            if b.region == "weights":
                assert b.offset + b.nbytes <= len(art.weights)


@pytest.mark.parametrize("variant", BOTH)
def test_each_variant_forced_by_the_environment_matches_onnxruntime(path, variant, monkeypatch):
    monkeypatch.setenv("KEEL_CPU_VARIANT", variant)
    x = np.random.default_rng(1).standard_normal((1, 16, 12, 12)).astype(np.float32)
    want = ort_run(_model(), {"x": x})["y"]
    if missing_flags(variant, runner.host.cpu_flags()):  # a host without AVX-512 refuses it
        with pytest.raises(BlobError, match="needs CPU features"):
            Model.load(path)
        return
    m = Model.load(path)
    assert m.blob.variant == variant
    # fp32 sums of 144 products in another order than onnxruntime's: a few ulp of the result
    np.testing.assert_allclose(m.run({"x": x})["y"], want, rtol=1e-5, atol=1e-5)


def test_the_host_runs_the_widest_variant_its_cpu_flags_allow(monkeypatch):
    monkeypatch.delenv("KEEL_CPU_VARIANT", raising=False)
    monkeypatch.setattr(runner.host, "machine_targets", lambda: BOTH)  # any machine: x86-64
    assert choose(BOTH, parse_flags(f"processor : 0\nflags\t\t: {V3}\n")) == "cpu-avx2"
    assert choose(BOTH, parse_flags(f"flags : {V4}\nflags : sse2\n")) == "cpu-avx512"
    # no flags line (another OS): the narrowest, which cannot fault
    monkeypatch.setattr(runner.host, "cpu_flags", lambda: None)
    assert choose(BOTH) == "cpu-avx2"
    assert choose(["cpu-avx512"], parse_flags(f"flags : {V3}")) == "cpu-avx512"  # one: no choice


def test_an_unknown_forced_variant_is_a_config_error_naming_the_valid_ones(path, monkeypatch):
    monkeypatch.setenv("KEEL_CPU_VARIANT", "cpu-avx9")
    with pytest.raises(ConfigError, match=r"KEEL_CPU_VARIANT='cpu-avx9': expected one of this "
                                          r"blob's variants \['cpu-avx2', 'cpu-avx512'\]"):
        Model.load(path)


def _resealed(data: bytes, edit) -> bytes:
    """The blob with its manifest edited and every hash made right again."""
    m = _manifest(data)
    payloads = {s["name"]: data[s["offset"]:s["offset"] + s["size"]] for s in m.pop("sections")}
    edit(m, payloads)
    return assemble("cpu", m, payloads)


def _twice(m, p):
    m["variants"][1]["target"] = "cpu-avx2"


def _gpu(m, p):
    m["variants"][1]["target"] = "opencl"
    p.update({f"{k}.opencl": p[f"{k}.cpu-avx512"] for k in ("weights", "programs", "graph")})


def _key(m, p):
    del m["variants"][1]["programs"]


def _none(m, p):
    m["variants"] = []


def _into_the_other(m, p):
    """cpu-avx512's first weights buffer moved into cpu-avx2's own section."""
    other = next(b for b in m["variants"][0]["buffers"] if b["region"] == "weights" and
                 b["offset"] >= 4096)
    mine = next(b for b in m["variants"][1]["buffers"] if b["region"] == "weights")
    mine["offset"] = other["offset"]


@pytest.mark.parametrize("edit, message", [
    (_twice, r"manifest variants: expected distinct targets .* got \['cpu-avx2', 'cpu-avx2'\]"),
    (_gpu, r"run by the 'cpu' device .* got \['cpu-avx2', 'opencl'\]"),
    (_key, r"manifest variants\[1\]: expected keys"),
    (_none, r"manifest variants: expected distinct targets .* got \[\]"),
    (_into_the_other, r"lies outside the weights sections .* of its variant"),
])
def test_a_corrupt_variant_table_is_a_blob_error_naming_it(blob, edit, message):
    with pytest.raises(BlobError, match=message):
        parse_blob(_resealed(blob[1], edit), "cpu-avx512")


def test_variants_listed_out_of_their_sections_order_are_a_blob_error(blob):
    m = _manifest(blob[1])
    m["variants"].reverse()  # the section table stays: it no longer follows the variants
    with pytest.raises(BlobError, match=r"section table: expected sections \['weights', "
                                        r"'weights.cpu-avx512', 'weights.cpu-avx2'"):
        parse_blob(reseal(blob[1], m))


def test_only_the_chosen_variant_is_read(blob):
    """A flipped byte in cpu-avx2's code: cpu-avx512 loads without reading it, cpu-avx2's load
    names the section."""
    data = bytearray(blob[1])
    s = next(s for s in _manifest(blob[1])["sections"] if s["name"] == "programs.cpu-avx2")
    data[s["offset"] + 100] ^= 1
    assert parse_blob(bytes(data), "cpu-avx512").variant == "cpu-avx512"
    with pytest.raises(BlobError, match="section programs.cpu-avx2: SHA-256 mismatch in chunk 0"):
        parse_blob(bytes(data), "cpu-avx2")


def test_a_varied_target_keeps_its_change_in_every_variant():
    """dataclasses.replace on `cpu` (tests vary limits) reaches both builds; each keeps what
    its own row sets."""
    v2, v4 = variant_targets(dataclasses.replace(TARGETS["cpu"], half_compute=True))
    assert (v2.name, v4.name) == tuple(BOTH) and v2.half_compute and v4.half_compute
    assert (v2.vector_bytes, v4.vector_bytes, v4.l2_bytes) == (32, 64, 1 << 20)
    assert not v2.variants and not v4.variants
