"""Models whose weights live outside the ONNX file, big blobs on the amd backend over the mock USB
link, and (opt-in) models of gigabytes (docs/wild.md, "Big models").

The small external-data models run in CI. The gigabyte ones cannot be made cheap: generating,
compiling and loading 1.6-2.2 GB of weights takes minutes and up to 7 GB of memory on a 2-core
machine, so they run only with KEEL_BIG_MODELS=1 (tools/big_model.py makes the same models by
hand). Tolerance: a chain of float32 MatMuls summed in another order than onnxruntime's, on
unit-scale activations. 3 layers of 256 terms: rtol=1e-4, atol=1e-5. 33 layers of 4096 terms:
each layer's sums differ by ~sqrt(4096) float32 ulps, compounding through depth (measured: max
abs error 2.6e-5, 2026-11-26), so atol=1e-4 and rtol=1e-3; the same for 24 layers on the amd
mock (OpenCL C on PoCL, another summation order again).

On device="amd" (KEEL_USB=mock: the mock ASM2464 and RX 7900, sim/usb and sim/am) the CI tests
cross the paths a 1.5 GB blob needs at a cost of seconds: VRAM's size from RCC_CONFIG_MEMSIZE
(24 GiB, sparse in the mock), BAR0 grown through its Resizable BAR capability to 32 GiB and placed
at 32 GiB (every BAR0 access a 4-dword, 64-bit TLP), weights staged through the bridge's 512 KiB
SRAM in 64 KiB WRITE(16)s, and VRAM used above 4 GiB. What only an enclosure can prove: that the
ASM2464's firmware forwards 4-dword headers for a BAR at 32 GiB as tinygrad's use of it says,
and the 7900's Resizable BAR sizes (tests/device/test_usbgpu.py prints them).
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from compiler.blob import BlobWriter, write_blob
from compiler.errors import CompileError
from compiler.onnx import proto
from compiler.pipeline import compile_model
from runner import Model
from runner.errors import DeviceError
from sim.usb.mock import MockLibusb
from tests.deps import needs, needs_tool, opencl_missing
from tests.graphs import assert_close
from tests.test_amd_device import enclosure  # noqa: F401 (the fixture)
from tools.big_model import make

BIG = os.environ.get("KEEL_BIG_MODELS") == "1"
COMPILE = Path(__file__).parent.parent / "tools" / "compile.py"
needs_big = pytest.mark.skipif(not BIG, reason="opt-in: KEEL_BIG_MODELS=1 (minutes, GBs)")


def _matches_onnxruntime(onnx_path, blob_path, width: int, rtol=1e-4, atol=1e-5) -> None:
    m = Model.load(blob_path)
    _agrees(m, onnx_path, width, rtol, atol)
    m.close()


def _agrees(m, onnx_path, width: int, rtol, atol) -> None:
    x = np.random.default_rng(1).standard_normal((1, width)).astype(np.float32)
    got = next(iter(m.run({"x": x}, timeout_ms=600_000).values()))
    want = ort.InferenceSession(str(onnx_path)).run(None, {"x": x})[0]
    assert_close(got, want, rtol=rtol, atol=atol)


def test_external_weights_compile_and_match_onnxruntime(tmp_path):
    path = tmp_path / "ext.onnx"
    make(str(path), layers=3, width=256, external=True)
    write_blob(compile_model(str(path), "cpu-avx2"), tmp_path / "ext.blob")
    _matches_onnxruntime(path, tmp_path / "ext.blob", 256)


def test_external_weights_cut_short_are_a_compile_error_naming_the_initializer(tmp_path):
    path = tmp_path / "ext.onnx"
    make(str(path), layers=2, width=64, external=True)
    with open(f"{path}.data", "r+b") as f:
        f.truncate(64 * 64 * 4 + 100)  # the second weight's bytes end early
    with pytest.raises(CompileError, match=r"w1"):
        compile_model(str(path), "cpu-avx2")


# runs a tool's script and then reports the process's own peak RSS (VmHWM, since its exec).
# Not RUSAGE_CHILDREN: a forked child starts with its parent's high-water mark, and the test
# process has just generated the model (a 1.6 GB one peaks at several GB).
_PEAK = ("import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n"
         "    runpy.run_path(sys.argv[0], run_name='__main__')\nfinally:\n"
         "    print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')), "
         "file=sys.stderr)")


def _compile_peak_rss(onnx_path, blob_path, target="cpu-avx2") -> int:
    """The compile in a child process (tools/compile.py); its peak RSS in bytes."""
    done = subprocess.run([sys.executable, "-c", _PEAK, str(COMPILE), str(onnx_path), "-o",
                           str(blob_path), "--target", target], check=True,
                          capture_output=True, text=True)
    kib = done.stderr.strip().splitlines()[-1].split()[1]  # "VmHWM:   1858900 kB"
    return int(kib) * 1024


@needs_big
def test_a_model_over_2_gb_of_external_weights_loads_compiles_and_runs(tmp_path):
    path = tmp_path / "big.onnx"
    make(str(path), layers=33, width=4096, external=True)
    assert os.path.getsize(f"{path}.data") > 2 ** 31
    _compile_peak_rss(path, tmp_path / "big.blob")
    _matches_onnxruntime(path, tmp_path / "big.blob", 4096, rtol=1e-3, atol=1e-4)


@needs_big
@pytest.mark.parametrize("target", ["cpu-avx2", "cpu"])  # cpu: two variants, two packings
def test_a_1_5_gb_model_compiles_within_twice_its_size(tmp_path, target):
    path = tmp_path / "big.onnx"
    make(str(path), layers=24, width=4096, external=False)
    assert _compile_peak_rss(path, tmp_path / "big.blob", target) <= 2 * os.path.getsize(path)


def _streamed(onnx_path, blob_path) -> int:
    """Compile a model read as a big one (its weights mapped from its file) into a blob through
    the streaming writer (tools/compile.py's way); the compile's Python-heap peak in bytes."""
    tracemalloc.start()
    try:
        with BlobWriter(blob_path) as out:
            out.finish(compile_model(str(onnx_path), "cpu-avx2", writer=out))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_streaming_writers_peak_does_not_grow_with_the_weights(tmp_path, monkeypatch):
    # every model here is "big" (BIG_MODEL_BYTES lowered): its weights are mapped from the ONNX
    # file, each packed copy goes to the scratch file as it is made, the region is the blob
    # file; held in memory, the 8 layers' packed weights add 24 MiB over the 2 layers' (measured
    # with compile_model(path) and write_blob: 8 and 32 MiB; streamed: 4.3 and 4.2 MiB)
    monkeypatch.setattr(proto, "BIG_MODEL_BYTES", 1 << 20)
    peaks = {}
    for layers in (2, 8):
        path = tmp_path / f"m{layers}.onnx"
        make(str(path), layers=layers, width=1024, external=False)
        peaks[layers] = _streamed(path, tmp_path / f"m{layers}.blob")
        _matches_onnxruntime(path, tmp_path / f"m{layers}.blob", 1024)
    one_weight = 1024 * 1024 * 4
    assert peaks[8] - peaks[2] < one_weight, peaks
    assert not [p for p in tmp_path.iterdir() if ".spill" in p.name or ".tmp" in p.name]


def test_a_big_models_file_is_parsed_without_its_large_weights(tmp_path):
    path = tmp_path / "m.onnx"
    make(str(path), layers=2, width=1024, external=False)  # two 4 MiB weights
    data = path.read_bytes()
    stripped, where = proto._strip(data)
    lean, full = onnx.load_from_string(stripped), onnx.load_from_string(data)
    assert len(stripped) < len(data) - 2 * 4 * 1024 * 1024
    assert sorted(where) == [0, 1] and not any(t.raw_data for t in lean.graph.initializer)
    for i, t in enumerate(full.graph.initializer):
        start, size = where[i]
        assert data[start:start + size] == t.raw_data
        t.ClearField("raw_data")
    assert lean == full  # nothing else changed


# ---- device="amd" over the mock USB link --------------------------------------------------------
def needs_amd(test):
    return needs("pocl-opencl-icd", opencl_missing())(needs_tool("lld-19", "ld.lld-19")(test))


GiB = 1 << 30


def _anon_kib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status")
                if line.startswith("RssAnon"))


@needs_amd
def test_vram_above_4_gib_through_a_resized_bar0_at_32_gib(enclosure):
    """VRAM's size comes from RCC_CONFIG_MEMSIZE, BAR0 is grown to 32 GiB and placed at 32 GiB;
    an upload past 4 GiB of VRAM lands there (the mock's VRAM and BAR0 read agree); a 3-dword
    request cannot name that BAR, and the 24 GiB VRAM costs only the pages written."""
    from am.driver import Gpu
    from sim.am.mock_gpu import GPU_BASE
    from usbgpu import asm24
    from usbgpu.pci import UsbPci
    before = _anon_kib()
    gpu = Gpu(UsbPci(1.0))
    mock = MockLibusb.shared().bridge.function
    assert gpu.vram_bytes == 24 * GiB and gpu.pci.bars[0] == (32 * GiB, 32 * GiB)
    deadline = time.monotonic() + 60
    gpu.alloc(5 * GiB, deadline)  # page tables only: 2,560 leaves of 2 MiB
    data = np.random.default_rng(0).integers(0, 256, 3 << 19, np.uint8).tobytes()  # 1.5 MiB
    va = gpu.alloc(len(data), deadline)
    phys = gpu.top - len(data)
    assert phys > 5 * GiB
    gpu.upload(va, data, deadline)  # 3 stagings of the 512 KiB SRAM
    out = bytearray(len(data))
    gpu.download(va, memoryview(out), deadline)
    assert bytes(out) == data == mock.vram.read(GPU_BASE + phys, len(data))
    assert gpu.pci.read32(0, phys) == struct.unpack_from("<I", data)[0]  # a 64-bit TLP
    assert MockLibusb.shared().bytes == gpu.pci.usb.bytes  # the mock counts what the host sent
    with pytest.raises(DeviceError, match="unsupported request"):
        gpu.pci.bridge.tlp(asm24.MEM_READ, 32 * GiB + phys)  # 3 dwords: the top half is lost
    with pytest.raises(DeviceError, match="past the 24576 MiB of VRAM"):
        gpu.pci.read32(0, 25 * GiB)  # inside the 32 GiB BAR0, past VRAM
    assert _anon_kib() - before < 256 << 10, "the mock's VRAM is not sparse"
    gpu.close()


@needs_amd
def test_a_bar0_that_cannot_grow_reads_discovery_through_mm_index(enclosure, monkeypatch):
    """A GPU whose Resizable BAR offers nothing past 256 MiB: IP discovery, 64 KiB below the
    top of 24 GiB, is read through MM_INDEX/MM_DATA, and VRAM past 4 GiB is used by DMA as
    before (nothing else goes through BAR0 past its first 40 MiB)."""
    from am.driver import Gpu, vram_read
    from sim.am import mock_device
    from sim.am.mock_gpu import GPU_BASE
    from usbgpu.pci import UsbPci
    monkeypatch.setattr(mock_device, "BAR0_SIZES", (256 << 20,))
    gpu = Gpu(UsbPci(1.0))
    assert gpu.pci.bars[0][1] == 256 << 20 and gpu.vram_bytes == 24 * GiB
    mock = MockLibusb.shared().bridge.function
    at = 24 * GiB - (64 << 10)
    assert vram_read(gpu.pci, at, 64) == mock.vram.read(GPU_BASE + at, 64)
    deadline = time.monotonic() + 60
    gpu.alloc(5 * GiB, deadline)
    va, data = gpu.alloc(8192, deadline), bytes(range(256)) * 32
    gpu.upload(va, data, deadline)
    out = bytearray(len(data))
    gpu.download(va, memoryview(out), deadline)
    assert bytes(out) == data
    gpu.close()


@needs_amd
def test_the_bridge_refuses_writes_its_sram_cannot_take(enclosure):
    """A WRITE(16) longer than one 64 KiB chunk is CHECK CONDITION at the bridge (and refused by
    the host before its 64 KiB stream buffer overflows); a ninth chunk past the 512 KiB SRAM is
    CHECK CONDITION, as the bridge's firmware answers them."""
    from usbgpu import asm24
    from usbgpu.pci import UsbPci
    pci = UsbPci(1.0)
    bridge = MockLibusb.shared().bridge

    def write16(n):
        return struct.pack(">BBQIBB", asm24.WRITE16, 0, 0, n // 512, 0, 0), 0, bytes(n)

    assert bridge.execute(write16(2 * asm24.CHUNK)[0], bytes(2 * asm24.CHUNK))[1] == \
        asm24.CHECK_CONDITION
    with pytest.raises(ValueError, match="at most 65536"):
        pci.bridge.commands([write16(2 * asm24.CHUNK)])
    pci.bridge.write(asm24.FILL_RESET, bytes(4))
    pci.bridge.commands([write16(asm24.CHUNK)] * (asm24.SRAM_BYTES // asm24.CHUNK))
    with pytest.raises(DeviceError, match="bridge refused CDB 8a"):
        pci.bridge.commands([write16(asm24.CHUNK)])
    pci.close()


def _load_bytes(blob_path, monkeypatch) -> tuple[int, int, object]:
    """(bytes over USB for Model.load, of which the bring-up's, the model) on device="amd"."""
    import am.device
    marks = []

    class Counted(am.device.Gpu):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            marks.append(self.pci.usb.bytes)

    monkeypatch.setattr(am.device, "Gpu", Counted)
    m = Model.load(blob_path, device="amd")
    return m.device.gpu.pci.usb.bytes, marks[0], m


@needs_amd
def test_a_blob_loads_on_the_amd_mock_moving_at_most_1_05x_its_weights(tmp_path, enclosure,
                                                                      monkeypatch):
    """16 MiB of weights (32 stagings of the bridge's SRAM): what the load moves after the
    bring-up (code object, weights, page tables, kernargs, streams) is at most 1.05x the
    weights, and the outputs match onnxruntime."""
    path = tmp_path / "m.onnx"
    make(str(path), layers=4, width=1024, external=False)
    write_blob(compile_model(str(path), "amd"), tmp_path / "m.blob")
    total, bring_up, m = _load_bytes(tmp_path / "m.blob", monkeypatch)
    weights = len(m.blob.weights)
    assert weights == 4 * 1024 * 1024 * 4
    assert total - bring_up <= 1.05 * weights, (total - bring_up) / weights
    _agrees(m, path, 1024, rtol=1e-4, atol=1e-5)
    m.close()


@needs_big
@needs_amd
def test_a_1_5_gb_blob_loads_on_the_amd_mock_moving_at_most_1_05x_its_weights(
        tmp_path, enclosure, monkeypatch):
    """The whole load, bring-up included, at 1.61 GB of weights (docs/wild.md has the figures:
    `tools/bench_amd_load.py`)."""
    path = tmp_path / "big.onnx"
    make(str(path), layers=24, width=4096, external=False)
    subprocess.run([sys.executable, str(COMPILE), str(path), "-o", str(tmp_path / "big.blob"),
                    "--target", "amd"], check=True, capture_output=True)
    total, _, m = _load_bytes(tmp_path / "big.blob", monkeypatch)
    weights = len(m.blob.weights)
    assert weights >= 1.5e9 and total <= 1.05 * weights, total / weights
    _agrees(m, path, 4096, rtol=1e-3, atol=1e-4)
    m.close()
