"""The comma 3X's CPU path executed: `cpu-aarch64` blobs run under qemu-aarch64 (tests/aarch64)
and are compared with onnxruntime on the host.

Tolerances: both sides compute in float32; keel's NEON code sums in another order (4-lane
vectors, tiled reductions) and contracts multiply-adds into FMAs, ~1 ulp per step. Measured on
2026-11-24: light models max relative error 4e-6 (outputs are softmax probabilities, down to
~1e-6), so rtol=1e-4 with atol=1e-6 keeps a 25x margin; openpilot max abs 7.5e-6 on outputs up
to 3.6, so test_end_to_end's atol=rtol=1e-4 applies unchanged.

onnx's `light` models build every weight with ConstantOfShape (one value per tensor), which
makes every logit equal and every output 1/1000 whatever the kernels do. The tests give those
tensors seeded random values (He-scaled), so a wrong index or lane changes the output.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from compiler.blob import write_blob
from compiler.pipeline import compile_model
from compiler.toolchain import build_shared
from models.openpilot import make_openpilot
from tests.aarch64 import qemu
from tests.deps import needs
from tests.graphs import assert_close, ort_run, random_feeds

MISSING = qemu.missing()
pytestmark = needs("qemu-user, clang-19, lld-19, llvm-19", MISSING)  # fails in CI, skips locally
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
FMLA = re.compile(r"\bfmla\s+v\d+\.4s")  # a 4-lane float32 NEON multiply-add


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return qemu.build_harness(tmp_path_factory.mktemp("harness"))


def randomized(model: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """ConstantOfShape weights replaced by random initializers of the same shape: He-scaled
    normals for weights, the constant times U(0.5, 1.5) for per-channel vectors (keeps a
    BatchNormalization variance positive), U(-0.1, 0.1) where the constant is 0."""
    rng, g = np.random.default_rng(seed), model.graph
    shapes = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    made, kept = [], []
    for node in g.node:
        if node.op_type != "ConstantOfShape" or node.input[0] not in shapes:
            kept.append(node)
            continue
        shape = tuple(int(d) for d in shapes[node.input[0]])
        value = float(numpy_helper.to_array(node.attribute[0].t).reshape(-1)[0])
        if len(shape) >= 2:
            a = rng.standard_normal(shape) * np.sqrt(2 / np.prod(shape[1:]))
        else:
            a = value * rng.uniform(0.5, 1.5, shape) if value else rng.uniform(-0.1, 0.1, shape)
        made.append(numpy_helper.from_array(a.astype(np.float32), node.output[0]))
    used = {i for node in kept for i in node.input}
    inits = [i for i in g.initializer if i.name in used] + made
    del g.node[:], g.initializer[:]
    g.node.extend(kept)
    g.initializer.extend(inits)
    # before IR version 4 every initializer had to be a graph input too; these are not
    model.ir_version = max(model.ir_version, 4)
    return model


def light(name: str):
    model = randomized(onnx.load(LIGHT_DIR / f"light_{name}.onnx"), seed=0)
    return model, random_feeds(model, seed=1)


def compiled(model, path):
    write_blob(compile_model(model, target="cpu-aarch64"), path)
    return path


@pytest.fixture(scope="module")
def light_blob(tmp_path_factory):
    """name -> (model, feeds, blob path), each model compiled once per module."""
    made = {}

    def get(name):
        if name not in made:
            model, feeds = light(name)
            made[name] = model, feeds, compiled(model, tmp_path_factory.mktemp(name) / "m.blob")
        return made[name]
    return get


def test_randomized_light_model_no_longer_has_equal_outputs():
    model, feeds = light("squeezenet")
    (probs,) = ort_run(model, feeds).values()
    assert probs.std() > 1e-3  # the original's outputs are all 0.001 (std ~1e-10)


@pytest.mark.parametrize("name", ["squeezenet", "shufflenet"])
def test_light_model_matches_onnxruntime_under_qemu(name, light_blob, harness, tmp_path):
    model, feeds, path = light_blob(name)
    got, want = qemu.run_blob(harness, path, feeds, tmp_path), ort_run(model, feeds)
    assert list(got) == list(want)
    for k in want:
        assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, what=f"{name} {k}")


def test_threads_under_qemu_compute_exactly_what_one_thread_does(light_blob, harness, tmp_path):
    # threads split output loops only, never a reduction; 3 threads make uneven shares
    _, feeds, path = light_blob("squeezenet")
    one = qemu.run_blob(harness, path, feeds, tmp_path)
    for nt in (2, 3):
        many = qemu.run_blob(harness, path, feeds, tmp_path, threads=nt)
        for k in one:
            np.testing.assert_array_equal(many[k], one[k], err_msg=f"{nt} threads, {k}")


@pytest.mark.slow
def test_openpilot_matches_onnxruntime_under_qemu(harness, tmp_path):
    model = make_openpilot(float16=True)  # fp16 weights, as openpilot ships them
    feeds = random_feeds(model, seed=1)
    got = qemu.run_blob(harness, compiled(model, tmp_path / "m.blob"), feeds, tmp_path)
    want = ort_run(model, feeds)
    assert_close(got["outputs"], want["outputs"], rtol=1e-4, atol=1e-4, what="openpilot")


def test_code_executed_under_qemu_is_neon(light_blob, harness, tmp_path):
    """qemu's in_asm log lists every block it translates, i.e. every block that runs. The harness
    has no float arithmetic, so any fmla there was the blob's kernels."""
    assert not FMLA.search(_disassemble(harness))
    _, feeds, path = light_blob("squeezenet")
    log = tmp_path / "in_asm.log"
    qemu.run_blob(harness, path, feeds, tmp_path, ("-d", "in_asm", "-D", str(log)))
    assert FMLA.search(_disassemble(tmp_path / "programs.so"))
    assert len(FMLA.findall(log.read_text())) >= 100, "the kernels that ran were not NEON"


def _disassemble(path) -> str:
    proc = subprocess.run([qemu.OBJDUMP, "-d", str(path)], capture_output=True, text=True,
                          check=True)
    return proc.stdout


# ---- the harness as a loader: relocations and imports a kernel object may have -------------

LOADER_CASE = r"""
typedef unsigned long size_t;
void *memcpy(void *d, const void *s, size_t n);
void *memset(void *d, int c, size_t n);
static const float k[4] = {1, 2, 3, 4};
/* exported, so code reaches it through the GOT (R_AARCH64_GLOB_DAT); its entries point into
   this object (R_AARCH64_RELATIVE) */
const float *const quarters[4] = {k, k + 1, k + 2, k + 3};
void keel_graph(unsigned char *arena, const unsigned char *weights, void *const *io) {
  const int *in = io[0];
  float *out = io[1];
  memset(arena, 0, 4096);
  memcpy(out, weights, 4096);  /* big enough to stay a call: an import */
  out[0] = *quarters[in[0] & 3] + arena[4095];
}
"""


def test_harness_applies_relocations_and_provides_memcpy(harness, tmp_path):
    so = build_shared(LOADER_CASE, "cpu-aarch64")
    assert b"memcpy" in so and b"memset" in so  # imported, not inlined: the loader must bind them
    weights = np.arange(1024, dtype=np.float32)
    relocs = subprocess.run([qemu.READELF, "-r", "-"], input=so, capture_output=True,
                            check=True).stdout.decode()
    for kind in ("RELATIVE", "GLOB_DAT", "JUMP_SLOT"):
        assert f"R_AARCH64_{kind}" in relocs
    for i in range(4):
        (out,) = qemu.run(harness, so, weights.tobytes(), 4096, [np.array([i], np.int32)],
                          [((1024,), np.float32)], tmp_path)
        np.testing.assert_array_equal(out, np.r_[np.float32(i + 1), weights[1:]])


def test_harness_refuses_an_x86_object(harness, tmp_path):
    so = build_shared(LOADER_CASE, "cpu")
    with pytest.raises(RuntimeError, match="not an ELF64 aarch64 shared object"):
        qemu.run(harness, so, b"\0" * 4096, 4096, [np.zeros(1, np.int32)],
                 [((1024,), np.float32)], tmp_path)
