"""KGSL on a comma 3X (/dev/kgsl-3d0): the UAPI and the packet format, proven on the hardware.

    KEEL_KGSL= python -m pytest -q tests/device/test_qcom.py

Skipped elsewhere. The same calls run against sim/qcom/mock_kgsl.py in tests/test_qcom_mock.py; here
the kernel and the CP answer instead, so a wrong struct layout, ioctl number or packet header shows
up as an errno or a value the GPU did not write. The last test runs the openpilot-shaped model
and onnx's light models through device="qcom", compares them with the CPU backend and prints
their latency (median, p99, max over 1000 runs) beside the vendor OpenCL path (device="opencl").
It compiles with tests/graphs.py:compiled_blob, so the device needs keel's compiler dependencies
(onnx, clang-19 for the cpu-aarch64 reference).
"""
import ctypes
import mmap
import os
import time

import numpy as np
import pytest

from qcom import kgsl
from qcom.cmdstream import OPCODES, decode, lohi, pkt7
from tests.deps import needs_hardware

pytestmark = needs_hardware("a Qualcomm Adreno device", None if os.path.exists(
    kgsl.DEVICE_PATH) else f"{kgsl.DEVICE_PATH} absent")


@pytest.fixture
def dev(monkeypatch):
    monkeypatch.delenv("KEEL_KGSL", raising=False)  # the kernel, never the mock
    k = kgsl.Kgsl()
    yield k
    k.close()


def test_the_chip_is_a_validated_adreno_630(dev):
    info = dev.check_chip()
    version = dev.version()
    print(f"chip {info.chip_id:#010x} gpu_id {info.gpu_id} driver {version.drv_major}."
          f"{version.drv_minor} device {version.dev_major}.{version.dev_minor}")
    assert info.gpu_id == 630


def _write_and_check(dev, ctx, target_addr, view):
    """Submit CP_MEM_WRITE of a marker to target_addr; wait; read it back through `view`."""
    marker = 0x6B65656C  # "keel"
    words = (pkt7(OPCODES["CP_MEM_WRITE"], *lohi(target_addr), marker)
             + pkt7(OPCODES["CP_WAIT_MEM_WRITES"]) + pkt7(OPCODES["CP_WAIT_FOR_IDLE"]))
    ib = dev.alloc(4096)
    decode(words, [(ib.gpuaddr, ib.size), (target_addr, 4)])  # the mock would accept it too
    ibmap = dev.mmap(ib)
    ibmap[:4 * len(words)] = b"".join(w.to_bytes(4, "little") for w in words)
    ts = dev.submit(ctx, [(ib.gpuaddr, 4 * len(words))])
    assert dev.wait(ctx, ts, 1000), "a 3-packet IB did not retire in 1 s"
    assert int.from_bytes(view[:4], "little") == marker
    dev.free(ib.id)


def test_the_gpu_runs_a_packet_stream_and_writes_memory(dev):
    ctx = dev.context_create()
    try:
        target = dev.alloc(4096)
        _write_and_check(dev, ctx, target.gpuaddr, dev.mmap(target))
        assert kgsl.ts_reached(dev.read_timestamp(ctx), 1)
    finally:
        dev.context_destroy(ctx)


def test_imported_user_memory_is_written_in_place(dev):
    host = mmap.mmap(-1, 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(host))
    ctx = dev.context_create()
    try:
        obj = dev.import_user(addr, 4096)
        _write_and_check(dev, ctx, obj.gpuaddr, host)
    finally:
        dev.context_destroy(ctx)


def test_a_timestamp_never_submitted_is_refused(dev):
    ctx = dev.context_create()
    try:
        with pytest.raises(kgsl.DeviceError, match="EINVAL"):
            dev.wait(ctx, 1000, 10)
    finally:
        dev.context_destroy(ctx)


# ---- vendor binaries (issue item 3) --------------------------------------------------------------

def _small():
    from onnx import helper
    from tests.graphs import make_model, random_feeds
    model = make_model([helper.make_node("Relu", ["x"], ["r"]),
                        helper.make_node("Mul", ["r", "x"], ["y"])],
                       [("x", (4, 64), "float32")], [("y", (4, 64), "float32")])
    return model, random_feeds(model)


def test_vendor_binaries_parse_run_and_embed(dev, tmp_path, monkeypatch):
    """libOpenCL builds each kernel once; the parse (qcom/vendor.py) gives ISA and registers the
    Adreno runs; the parsed programs are cached and embedded, and a load from either never
    touches libOpenCL. Relu then Mul is exact in fp32: equal to numpy."""
    from qcom import store
    from runner import Model, cl
    from tools import compile as compile_tool
    model, feeds = _small()
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    out = tmp_path / "m.blob"
    assert compile_tool.main([str(tmp_path / "m.onnx"), "-o", str(out), "--target", "qcom",
                              "--embed-binaries"]) == 0
    x = feeds["x"]
    monkeypatch.setattr(cl, "lib", lambda: pytest.fail("libOpenCL used at load or run"))
    m = Model.load(out)  # a qcom blob runs on keel's KGSL path unless another is asked for
    assert m.device.name == "qcom"
    assert np.array_equal(m.run(feeds)["y"], np.maximum(x, 0) * x)
    from runner.blob import read_blob
    binaries = read_blob(out).binaries
    progs = store.from_blob(binaries, bytes(read_blob(out).programs).decode(),
                            *(binaries.device[k] for k in ("compiler", "chip_id", "driver")), None)
    for name, p in progs.items():
        print(f"{name}: {len(p.binary)} bytes ISA, regs {p.regs}, offsets {p.offsets}")
        assert p.regs.full > 0 and p.units > 0


# ---- whole models through device="qcom", beside the vendor OpenCL path (issue item 9) ---------

RUNS = 1000


def _latency_ms(m, feeds, runs: int = RUNS) -> np.ndarray:
    for name, arr in feeds.items():
        m.input_view(name)[:] = arr
    out = {name: np.empty(shape, dtype) for name, (shape, dtype) in m.outputs.items()}
    m.run(out=out)  # warm
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        m.run(out=out)
        times.append((time.perf_counter() - t0) * 1e3)
    return np.array(times)


def _models():
    """(name, onnx model, feeds, float16, rtol, atol) for the openpilot-shaped model and onnx's
    light models. openpilot in fp16 against the fp32 CPU backend: the OpenCL tests' fp16
    tolerance (5e-2 on O(1) outputs). Light models in fp32 (squeezenet overflows fp16): onnx's
    1e-3 relative, with 1e-5 absolute for the sums the GPU orders differently from the CPU."""
    from models.openpilot import INPUTS, make_openpilot
    from tests.test_opencl import LIGHT, light_case
    rng = np.random.default_rng(0)
    feeds = {n: (rng.integers(0, 256, s).astype(d) if d == np.uint8
                 else rng.standard_normal(s).astype(d)) for n, (d, s) in INPUTS.items()}
    yield "openpilot", make_openpilot(float16=True), feeds, True, 5e-2, 5e-2
    for name in LIGHT:
        model, feeds, _ = light_case(name)
        yield name, model, feeds, False, 1e-3, 1e-5


def test_whole_models_match_the_cpu_backend_and_report_latency(doctor_qcom, dev, monkeypatch):
    from runner import Model
    from tests.graphs import assert_close, compiled_blob
    for name, model, feeds, fp16, rtol, atol in _models():
        want = Model.load(compiled_blob(model, "cpu-aarch64")).run(feeds)
        path = compiled_blob(model, "qcom", float16=fp16)
        qcom = Model.load(path, device="qcom")
        for out, value in qcom.run(feeds).items():
            assert_close(value, want[out], rtol, atol, f"{name} {out} on qcom")
        for device, m in (("qcom", qcom), ("opencl", Model.load(path, device="opencl"))):
            ms = _latency_ms(m, feeds)
            print(f"{name} {device}: median {np.median(ms):.2f} ms, p99 "
                  f"{np.percentile(ms, 99):.2f} ms, max {ms.max():.2f} ms over {RUNS} runs")
