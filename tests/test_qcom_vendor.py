"""Vendor (Adreno) programs without a device: the binary parser's refusals, the parsed-program
cache, and the shader registers the recorder takes from a parse.

Plainly: `vendor_lib` below lays a binary out from the same facts (tinygrad's `_parse_lib`
offsets) that qcom/vendor.py reads, so the round trip only shows that parser and test agree on
that reading, not that it is the vendor's format. What can fail independently here: every
truncation and garbling is a DeviceError naming the field (never an IndexError or a silent
default); the kernel name and parameter kinds are checked against the kernel's source; the cache
round-trips and rebuilds what it cannot read; the register fields sit at a6xx.xml's bit
positions in the recorded stream. tests/device/test_qcom.py runs real binaries on a comma 3X."""
import json
import struct

import numpy as np
import pytest
from onnx import helper

from qcom import cmdstream as cs
from qcom import record, store, vendor
from runner.errors import DeviceError
from qcom.program import Program, Regs
from sim.qcom.program import mock_build
import runner.blob
from runner import Model
from runner.blob import read_blob
from tests.graphs import make_model, ort_run, random_feeds
from tests.test_opencl import needs_opencl
from tools import compile as compile_tool

R = cs.REGISTERS
DECLS = ["__global float *x", "__read_only image2d_t w", "__global float *y"]


def vendor_lib(name="k", kinds=(0, 1, 0), offsets=(4, 0, 6), isa=b"\x11" * 200, pvt=0, nsamp=1,
               imms=((8, 0x3F800000),)) -> bytes:
    """A binary laid out as the module docstring says: header, registers, shader descriptor with
    the name, parameter records, immediate constants, then the ISA."""
    regs_at, desc_at = 0x200, 0x300
    params_at = -(-(desc_at + 0x158 + len(name)) // 4) * 4 + 8 * nsamp
    recs = b"".join(struct.pack("<8I", 32, 0, 0, off, 0, 0, 0, k) for k, off in zip(kinds, offsets))
    imm_at = params_at + len(recs) + 4
    imm = b"".join(struct.pack("<10I", v, 0, 0, 0, d, 0, 1, 0, 0, 0) for d, v in imms)
    isa_at = -(-(imm_at + len(imm)) // 64) * 64
    b = bytearray(isa_at + len(isa))
    for off, v in {0x34: regs_at, 0xAC: imm_at, 0xB0: len(imms), 0xC0: isa_at, 0x100: len(isa),
                   0x110: desc_at, regs_at + 0x14: 7, regs_at + 0x18: 3, desc_at + 0xC4: 16,
                   desc_at + 0xC8: pvt, desc_at + 0xD8: 2048, desc_at + 0xDC: nsamp,
                   desc_at + 0x108: 6}.items():
        struct.pack_into("<I", b, off, v)
    b[desc_at + 0x158:desc_at + 0x158 + len(name)] = name.encode()
    b[params_at:params_at + len(recs)] = recs
    b[imm_at:imm_at + len(imm)] = imm
    b[isa_at:] = isa
    return bytes(b)


def test_parse_reads_every_field():
    p = vendor.parse(vendor_lib(), "k", DECLS)
    assert p.params == ("buffer", "image", "buffer") and p.offsets == (4, None, 6)
    assert p.regs == Regs(full=7, half=3, branch=3, first=16, shared=2048)
    assert p.imms == ((8, 0x3F800000),)
    assert p.binary[:200] == b"\x11" * 200 and len(p.binary) == 256  # padded to 128-byte units
    assert p.const_vec4s == 4  # dwords up to 8 -> 3 vec4s -> whole units of 4


def test_every_truncation_is_a_device_error_naming_a_field():
    lib = vendor_lib()
    for n in range(0, len(lib), 7):
        with pytest.raises(DeviceError, match=r"vendor binary of kernel k \(\d+ bytes\): \w"):
            vendor.parse(lib[:n], "k", DECLS)


@pytest.mark.parametrize("lib, decls, field", [
    (vendor_lib(name="other"), DECLS, "kernel name .* expected 'k'"),
    (vendor_lib(kinds=(0, 2, 0)), DECLS, "parameter record 1 kind is 2"),
    (vendor_lib(kinds=(0, 0, 0)), DECLS, r"parameter records say \['buffer', 'buffer'"),
    (vendor_lib(), DECLS[:2], "the kernel's source declares"),
    (vendor_lib(pvt=512), DECLS, "private memory size is 512"),
    (vendor_lib(nsamp=3), DECLS, "sampler count is 3"),
    (vendor_lib(isa=b""), DECLS, "ISA of 0 bytes"),
    (vendor_lib(isa=b"\1" * 130 * 1024), DECLS, "ISA size .* more than one CP_LOAD_STATE6"),
])
def test_garbled_binaries_are_refused(lib, decls, field):
    with pytest.raises(DeviceError, match=field):
        vendor.parse(lib, "k", decls)


def test_cache_round_trips_and_rebuilds_what_it_cannot_read(tmp_path, monkeypatch):
    built = []

    def fake_build(source):
        built.append(source)
        return {"k": vendor.parse(vendor_lib(), "k", DECLS)}

    monkeypatch.setattr(vendor, "build", fake_build)
    args = ("__kernel void k() {}", "vendor", 0x06030001, "3.1/1.0", str(tmp_path))
    first = store.load(*args)
    assert store.load(*args) == first and len(built) == 1  # second load: from the cache
    assert store.load(*args[:2], 0x06030002, *args[3:]) == first and len(built) == 2  # chip
    path = store.cache_path(*args[1:3], args[3], args[0], args[4])
    path.write_text(json.dumps({"k": {"kernel": "k"}}))  # a cache entry of another shape
    assert store.load(*args) == first and len(built) == 3


def test_without_a_blob_folder_vendor_programs_cache_under_keel_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path))
    path = store.cache_path("vendor", 0x06030001, "v", "src", None)
    assert path.parent == tmp_path / "qcom"
    assert store.cache_path("mock", 0x06030001, "v", "src", None) is None


def _regs(words) -> dict:
    out = {}
    for pk in cs.split(words):
        if pk.kind == cs.TYPE4:
            out.update({pk.code + i: v for i, v in enumerate(pk.payload)})
    return out


def test_recorded_shader_registers_come_from_the_parse():
    """Bit positions from a6xx.xml: SP_CS_CTRL_REG0 HALFREGFOOTPRINT 1-6, FULLREGFOOTPRINT 7-12,
    BRANCHSTACK 14-19; SP_CS_CONFIG ENABLED 8, NTEX 9-16, NSAMP 17-21; HLSQ_CS_CNTL CONSTLEN
    0-7 (vec4s >> 2), ENABLED 8."""
    p = vendor.parse(vendor_lib(), "k", DECLS)
    words = record._shader_regs(p, 0x1_0000_1000, ntex=1)
    regs = _regs(words)
    ctrl = regs[R["SP_CS_CTRL_REG0"]]
    assert ((ctrl >> 1) & 63, (ctrl >> 7) & 63, (ctrl >> 14) & 63, ctrl >> 20 & 1) == (3, 7, 3, 0)
    assert regs[R["SP_CS_UNKNOWN_A9B1"]] == 0x41  # 2 KB local memory, constant RAM mode 256
    assert regs[R["SP_CS_OBJ_FIRST_EXEC_OFFSET"]] == 16
    assert (regs[R["SP_CS_OBJ_START_LO"]], regs[R["SP_CS_OBJ_START_HI"]]) == (0x1000, 1)
    cfg = regs[R["SP_CS_CONFIG"]]
    assert (cfg >> 8 & 1, (cfg >> 9) & 0xFF, (cfg >> 17) & 31) == (1, 1, 1)
    assert regs[R["SP_CS_INSTRLEN"]] == 64  # 256 bytes of (padded) ISA, in dwords
    assert regs[R["HLSQ_CS_CNTL"]] == 1 | 1 << 8


def test_mock_programs_keep_their_constant_layout():
    p = mock_build("__kernel void k(__global float *a, __global float *b) {}")["k"]
    assert p.offsets == (0, 2) and p.regs == Regs() and p.imms == ()
    assert store.from_json(json.loads(json.dumps(store.to_json(p)))) == p
    assert isinstance(p, Program)


# ---- binaries embedded in the blob ------------------------------------------------------------
SRC = "__kernel void k(__global float *a) { a[0] = 1.0f; }"
MOCK = ("mock", 0x06030001, "3.1/1.0")


def counting_build(monkeypatch) -> list:
    built = []
    real = store.build

    def build(source, compiler):
        built.append(compiler)
        return real(source, compiler)
    monkeypatch.setattr(store, "build", build)
    return built


def _read(section: bytes):
    """A binaries section as the blob reader checks and returns it."""
    return runner.blob._binaries(memoryview(section), ["k"])


def test_binaries_of_another_chip_or_driver_are_rebuilt_once_with_a_warning(monkeypatch,
                                                                            tmp_path):
    entry = _read(store.embedded(SRC, *MOCK))
    other = _read(store.embedded(SRC, "mock", 0x06030002, "9.9/1.0"))
    built = counting_build(monkeypatch)
    assert store.from_blob(entry, SRC, *MOCK, str(tmp_path))["k"].kernel == "k"
    assert built == []  # this device's own: used as they are
    with pytest.warns(UserWarning, match=r"built by mock compiler, chip 0x06030002, driver "
                                         r"9\.9/1\.0, this device is mock compiler, chip "
                                         r"0x06030001, driver 3\.1/1\.0"):
        progs = store.from_blob(other, SRC, *MOCK, str(tmp_path))
    assert built == ["mock"] and progs == store.from_blob(entry, SRC, *MOCK, None)
    with pytest.warns(UserWarning, match="source differs"):  # same device, another source
        store.from_blob(entry, SRC.replace("1.0f", "2.0f"), *MOCK, str(tmp_path))


def test_embed_binaries_needs_target_qcom(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        compile_tool.main([str(tmp_path / "m.onnx"), "-o", str(tmp_path / "m.blob"),
                           "--target", "opencl", "--embed-binaries"])
    assert e.value.code == 2 and "--embed-binaries needs --target qcom" in capsys.readouterr().err


@needs_opencl
def test_a_blob_compiled_with_embedded_binaries_loads_without_building(tmp_path, monkeypatch):
    """tools/compile.py --embed-binaries on the mock KGSL (mock binaries, as a comma 3X's would
    be vendor ones), then a load that must not build: fp32 on PoCL against onnxruntime; Relu and
    Mul are exact in fp32, so the outputs must be equal."""
    monkeypatch.setenv("KEEL_KGSL", "mock")
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)
    model = make_model([helper.make_node("Relu", ["x"], ["r"]),
                        helper.make_node("Mul", ["r", "x"], ["y"])],
                       [("x", (4, 8), "float32")], [("y", (4, 8), "float32")])
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    out = tmp_path / "m.blob"
    assert compile_tool.main([str(tmp_path / "m.onnx"), "-o", str(out), "--target", "qcom",
                              "--embed-binaries"]) == 0
    entry = read_blob(out).binaries
    assert entry.device["compiler"] == "mock" and entry.programs
    built = counting_build(monkeypatch)
    feeds = random_feeds(model)
    assert np.array_equal(Model.load(out, device="qcom").run(feeds)["y"],
                          ort_run(model, feeds)["y"])
    assert built == []
