"""The Hexagon 685 backend executed: `dsp` blobs run under qemu-hexagon through the DSP-side
runtime (dsp/runtime.c, dsp/mock.py, KEEL_FASTRPC=mock) and are compared with onnxruntime.

Tolerances: float kernels run on the DSP's scalar FP units in float32, summing in another order
than onnxruntime and contracting multiply-adds (-ffp-contract=fast), ~1 ulp per step; measured
2026-11-24: the conv model's softmax max abs error 9e-8 on outputs up to 0.35, squeezenet's 1.4e-7
on outputs up to 0.08. rtol=1e-4 with atol=1e-6 is test_aarch64's bound for the same situation and
keeps a >7x margin. Integer kernels are exact: compared with assert_array_equal.
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import time

import numpy as np
import onnx
import pytest
from onnx import helper

from compiler.blob import write_blob
from compiler.pipeline import compile_model
from compiler.target import get_target
from dsp import mock
from runner import DeviceError, DeviceTimeout, Model
from runner.errors import ConfigError
from tests.deps import needs
from tests.graphs import assert_close, make_model, ort_run, random_feeds
from tests.test_aarch64 import LIGHT_DIR, randomized

pytestmark = [needs("qemu-user, clang-19, lld-19", mock.missing()),
              pytest.mark.xdist_group("dsp")]
OBJDUMP = "llvm-objdump-19"
SLOW_MS = 120_000  # qemu on a shared 2-core machine: a deadline no healthy run comes near
SCHEDULING_MARGIN_S = 0.5  # as test_device_contract: a hang is reported at its deadline
HVX = re.compile(r"\bv\d+(?::\d+)?(?:\.[bhw])? \+?= (vmpy\w*|vadd|vmax)\(")  # HVX arithmetic
SCALAR_FP = re.compile(r"\br\d+ \+?= (sfmpy|sfadd)\(")


def conv_model() -> onnx.ModelProto:
    """Conv (stride 2, padded) -> Relu -> Flatten -> Gemm -> Softmax: a float network in small."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("Gemm", ["f", "w2"], ["g"], transB=1),
             helper.make_node("Softmax", ["g"], ["y"])]
    inits = {"w1": rng.standard_normal((16, 3, 3, 3)).astype(np.float32) * 0.3,
             "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
             "w2": rng.standard_normal((10, 16 * 8 * 8)).astype(np.float32) * 0.05}
    return make_model(nodes, [("x", (1, 3, 16, 16), np.float32)], [("y", (1, 10), np.float32)],
                      inits)


def int8_model(n: int = 4096) -> onnx.ModelProto:
    """max(a * b + c, a) on int8: wrapping int8 arithmetic, one 128-lane HVX vector per step."""
    c = (np.arange(n) % 7 - 3).astype(np.int8)
    nodes = [helper.make_node("Mul", ["a", "b"], ["p"]), helper.make_node("Add", ["p", "c"], ["s"]),
             helper.make_node("Max", ["s", "a"], ["y"])]
    return make_model(nodes, [("a", (n,), np.int8), ("b", (n,), np.int8)],
                      [("y", (n,), np.int8)], {"c": c})


def squeezenet64() -> onnx.ModelProto:
    """onnx's light squeezenet (randomized weights, test_aarch64) at 64x64: it ends in a global
    average pool, so a smaller image is the same network at 1/12 of the emulated time."""
    model = randomized(onnx.load(LIGHT_DIR / "light_squeezenet.onnx"), seed=0)
    image = next(i for i in model.graph.input if len(i.type.tensor_type.shape.dim) == 4)
    dims = image.type.tensor_type.shape.dim
    dims[2].dim_value = dims[3].dim_value = 64
    del model.graph.value_info[:]
    for out in model.graph.output:
        out.type.tensor_type.ClearField("shape")
    return model


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    """name -> (model, blob path), compiled for `dsp` once per module."""
    made, d = {}, tmp_path_factory.mktemp("dsp")

    def get(name):
        if name not in made:
            model = {"conv": conv_model, "int8": int8_model, "squeezenet": squeezenet64}[name]()
            write_blob(compile_model(model, target="dsp"), d / f"{name}.blob")
            made[name] = model, d / f"{name}.blob"
        return made[name]
    return get


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    monkeypatch.setenv("KEEL_FASTRPC", "mock")
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)


def _load(path) -> Model:
    m = Model.load(path)  # the blob's target names the device: "dsp"
    m.timeout_ms = SLOW_MS
    return m


def _disassemble(blob_path) -> str:
    from runner.blob import read_blob
    so = bytes(read_blob(blob_path).programs)
    return subprocess.run([OBJDUMP, "-d", "-"], input=so, capture_output=True,
                          check=True).stdout.decode()


# ---- the renderer's objects --------------------------------------------------------------------

def test_integer_kernels_are_hvx_and_float_kernels_scalar_fp(blobs):
    ints, floats = _disassemble(blobs("int8")[1]), _disassemble(blobs("conv")[1])
    assert {m.group(1)[:4] for m in HVX.finditer(ints)} >= {"vmpy", "vadd", "vmax"}
    assert not SCALAR_FP.search(ints)
    assert SCALAR_FP.search(floats)
    assert not HVX.search(floats), "v65 HVX has no float lanes: float kernels stay scalar"


def test_programs_are_a_position_independent_v65_object(blobs):
    from runner.blob import read_blob
    so = bytes(read_blob(blobs("conv")[1]).programs)
    assert so[:4] == b"\x7fELF" and so[4] == 1  # ELF32
    e_type, e_machine = np.frombuffer(so[16:20], "<u2")
    e_flags = int(np.frombuffer(so[36:40], "<u4")[0])
    assert (e_type, e_machine) == (3, 164)  # ET_DYN, EM_HEXAGON
    assert e_flags & 0xff == 0x65  # EF_HEXAGON_MACH_V65: runs on the Hexagon 685
    dyn = subprocess.run(["llvm-readelf-19", "-d", "-l", "-r", "-"], input=so, capture_output=True,
                         check=True).stdout.decode()
    assert "TEXTREL" not in dyn  # code is never patched: shareable, mappable read-only
    # every loadable segment page-aligned, as the DSP's loader maps them
    aligns = [int(line.split()[-1], 16) for line in dyn.splitlines() if line.strip()
              .startswith("LOAD")]
    assert aligns and all(a % 4096 == 0 for a in aligns)


# ---- runs under qemu-hexagon --------------------------------------------------------------------

def test_float_model_matches_onnxruntime(blobs):
    model, path = blobs("conv")
    feeds = random_feeds(model, seed=1)
    assert_close(_load(path).run(feeds)["y"], ort_run(model, feeds)["y"], 1e-4, 1e-6, "conv")


@pytest.mark.slow  # ~10 s compile, ~10 s of scalar FP under emulation
def test_light_squeezenet_matches_onnxruntime(blobs):
    model, path = blobs("squeezenet")
    feeds = random_feeds(model, seed=1)
    (name, want), = ort_run(model, feeds).items()
    assert want.std() > 1e-4  # randomized: the outputs are not all equal
    assert_close(_load(path).run(feeds)[name], want, 1e-4, 1e-6, "squeezenet")


def test_hvx_int8_kernels_match_onnxruntime_exactly(blobs):
    model, path = blobs("int8")
    m = _load(path)
    for seed in (1, 2):  # a second run on new inputs: the shared buffer is rewritten
        feeds = random_feeds(model, seed=seed)
        np.testing.assert_array_equal(m.run(feeds)["y"], ort_run(model, feeds)["y"])


def test_outputs_bound_to_host_arrays_are_copied_back(blobs):
    model, path = blobs("int8")
    m, feeds = _load(path), random_feeds(model, seed=3)
    y = np.full(4096, 77, np.int8)
    m.run(feeds, out={"y": y})
    np.testing.assert_array_equal(y, ort_run(model, feeds)["y"])


def test_profiled_runs_count_packets_per_kernel_and_hvx_only_where_integer(blobs):
    """qemu's packet counter per launch: the cost signal. The int8 kernel's work is HVX; the
    float model has none. A profiled run computes the same outputs (launch by launch)."""
    for name, hvx in (("int8", True), ("conv", False)):
        model, path = blobs(name)
        m, feeds = _load(path), random_feeds(model, seed=1)
        m.device.profile = True
        got, n = m.run(feeds), len(m.blob.launches)
        packets, hvx_ops = m.device.last_ticks[:n], m.device.last_ticks[n:]
        assert len(m.device.last_ticks) == 2 * n and all(p > 0 for p in packets)
        assert (sum(hvx_ops) > 0) == hvx, name
        for k, want in ort_run(model, feeds).items():
            assert_close(got[k], want, 1e-4, 1e-6, name)


def test_hvx_kernel_takes_a_tenth_of_the_packets_of_scalar_code(blobs, tmp_path):
    """The cost signal compares HVX with scalar code: the same int8 kernel compiled with 4-byte
    "vectors" (what a target without HVX would tile for). Measured 2026-11-24 under qemu 7.2:
    175 packets against 17419; 10x leaves room for scheduling changes."""
    model, path = blobs("int8")
    scalar = dataclasses.replace(get_target("dsp"), vector_bytes=4)
    write_blob(compile_model(model, target=scalar), tmp_path / "scalar.blob")
    feeds, packets = random_feeds(model, seed=1), []
    for p in (path, tmp_path / "scalar.blob"):
        m = _load(p)
        m.device.profile = True
        np.testing.assert_array_equal(m.run(feeds)["y"], ort_run(model, feeds)["y"])
        packets.append(sum(m.device.last_ticks[:len(m.blob.launches)]))
    assert packets[0] * 10 < packets[1], packets


# ---- faults: the runtime core's contract on the emulated DSP ------------------------------------

def test_hang_times_out_at_its_deadline_and_the_next_run_matches(blobs, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "hang@2")
    model, path = blobs("int8")
    m = _load(path)
    feeds = [random_feeds(model, seed=s) for s in (1, 2)]
    np.testing.assert_array_equal(m.run(feeds[0])["y"], ort_run(model, feeds[0])["y"])
    t = time.monotonic()
    with pytest.raises(DeviceTimeout, match=r"dsp invoke 2 not complete by its deadline "
                                            r"\(100 ms after submit\)"):
        m.run(feeds[1], timeout_ms=100)
    assert 0.100 <= time.monotonic() - t < 0.100 + SCHEDULING_MARGIN_S
    np.testing.assert_array_equal(m.run(feeds[1])["y"], ort_run(model, feeds[1])["y"])


def test_fault_is_a_device_error_and_the_next_run_recovers(blobs, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "fault@1,slow@2:30")
    model, path = blobs("int8")
    m, feeds = _load(path), random_feeds(model, seed=1)
    with pytest.raises(DeviceError, match=r"dsp invoke 1 failed on the DSP"):
        m.run(feeds)
    t = time.monotonic()
    np.testing.assert_array_equal(m.run(feeds)["y"], ort_run(model, feeds)["y"])
    assert time.monotonic() - t >= 0.030


def test_runtime_refuses_an_object_that_is_not_hexagon(tmp_path):
    from compiler.toolchain import build_shared
    link = mock.QemuTransport()
    try:
        link.alloc(4096)
        x86 = build_shared("void keel_graph(void) {}\n", "cpu")
        with pytest.raises(DeviceError, match="not an ELF32 Hexagon shared object"):
            link.open(x86, 0, 0, [], b"", time.monotonic() + 30)
    finally:
        link.close()


def test_a_wrong_transport_is_a_config_error(blobs, monkeypatch):
    monkeypatch.setenv("KEEL_FASTRPC", "usb")
    with pytest.raises(ConfigError, match="KEEL_FASTRPC must be 'device' .* or 'mock'"):
        Model.load(blobs("int8")[1])
