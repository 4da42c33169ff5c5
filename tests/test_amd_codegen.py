"""`--target amd`: OpenCL C with amdgcn work-item builtins, compiled by clang-19 and linked by
ld.lld-19 into one HSA code object per blob, and the runner-side reader of its kernel descriptors
and metadata (am/elf.py, am/msgpack.py), checked against llvm-readelf-19's own decoding.

What this cannot prove: that the gfx1100 ISA computes the right numbers. No CI machine has an
RDNA3 GPU; the mock GPU runs the embedded OpenCL C on PoCL instead (tests/test_amd_mock.py).
"""
from __future__ import annotations

import re
import subprocess

import numpy as np
import onnx
import pytest

from am import elf, msgpack
from compiler import toolchain
from compiler.pipeline import compile_model
from runner.errors import BlobError
from tests.deps import needs_tool
from tests.graphs import compiled_blob, single_node_model

pytestmark = [needs_tool("clang-19", "clang-19"), needs_tool("lld-19", "ld.lld-19"),
              needs_tool("llvm-19", "llvm-readelf-19")]


def _small_models() -> dict[str, tuple[onnx.ModelProto, bool]]:
    """name -> (model, float16): a work-group reduction (LDS, barriers), a padded conv (vector
    loads and stores), and half storage."""
    w = np.random.default_rng(0).standard_normal((16, 8, 3, 3)).astype(np.float32)
    conv = single_node_model("Conv", [((1, 8, 16, 16), "float32"), w], {"pads": [1, 1, 1, 1]})
    reduce = single_node_model("ReduceSum", [((1, 4096), "float32")], {"keepdims": 1})
    return {"reduce": (reduce, False), "conv": (conv, False), "conv_f16": (conv, True)}


@pytest.fixture(scope="module")
def artifacts():
    return {name: compile_model(m, target="amd", float16=f16)
            for name, (m, f16) in _small_models().items()}


def _readelf(path, *flags) -> str:
    proc = subprocess.run(["llvm-readelf-19", *flags, str(path)], capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    return proc.stdout


def _yaml_ints(text: str, key: str) -> list[int]:
    return [int(v) for v in re.findall(rf"^\s+\.{key}:\s+(\d+)$", text, re.M)]


def test_code_object_has_one_descriptor_per_program_and_llvm_agrees_with_the_reader(
        artifacts, tmp_path):
    for name, art in artifacts.items():
        path = tmp_path / f"{name}.hsaco"
        path.write_bytes(art.programs)
        out = _readelf(path, "--file-header", "--symbols", "--notes")
        assert "AMDGPU" in out and "gfx1100" in out, name
        programs = sorted({ln.kernel for ln in art.launches})
        kds = sorted(set(re.findall(r"\s(\S+)\.kd$", out, re.M)))
        assert kds == programs, name
        co = elf.read(art.programs)
        assert sorted(co.kernels) == programs
        # the metadata YAML lists kernels in the note's order, as our decoder does
        ours = list(co.kernels.values())
        for key, attr in (("vgpr_count", "vgprs"), ("sgpr_count", "sgprs"),
                          ("kernarg_segment_size", "kernarg_size"),
                          ("group_segment_fixed_size", "lds_bytes")):
            assert _yaml_ints(out, key) == [getattr(k, attr) for k in ours], (name, key)
        for k in ours:
            assert k.wave == 32 and k.vgprs > 0 and k.entry > k.kd
            assert all(a.offset + a.size <= k.kernarg_size for a in k.args)


def test_work_item_ids_come_from_amdgcn_builtins_and_no_library_call_remains(artifacts,
                                                                             tmp_path):
    art = artifacts["reduce"]
    co = elf.read(art.programs)
    assert "__builtin_amdgcn_workitem_id_x()" in co.source
    assert any(k.lds_bytes > 0 for k in co.kernels.values())  # the halving tree's local array
    path = tmp_path / "reduce.hsaco"
    path.write_bytes(art.programs)
    undefined = [ln for ln in _readelf(path, "--dyn-syms").splitlines() if " UND " in ln
                 and not ln.rstrip().endswith("UND")]
    assert undefined == []


def test_embedded_source_is_plain_opencl_outside_amdgcn(artifacts):
    """The mock GPU builds the embedded source with another compiler: the amdgcn definitions
    must all sit under #ifdef __AMDGCN__."""
    src = elf.read(artifacts["conv_f16"].programs).source
    outside = re.sub(r"#ifdef __AMDGCN__.*?#endif\n", "", src, flags=re.S)
    assert "__builtin_amdgcn" not in outside and "vstore_half" in outside
    assert elf.SOURCE_SYMBOL == toolchain.SOURCE_SYMBOL


def test_msgpack_decodes_every_kind_amdgpu_metadata_uses():
    data = bytes([0x84, 0xa1, 0x61, 0x93, 0x01, 0xff, 0xcd, 0x01, 0x00,  # "a": [1, -1, 256]
                  0xa1, 0x62, 0xc3,  # "b": true
                  0xa1, 0x63, 0xd9, 0x03]) + b"xyz" + bytes([  # "c": "xyz" (str8)
                  0xa1, 0x64, 0xcb]) + np.float64(1.5).byteswap().tobytes()  # "d": 1.5
    assert msgpack.unpack(data) == {"a": [1, -1, 256], "b": True, "c": "xyz", "d": 1.5}


@pytest.mark.parametrize("data, what", [(b"\x92\x01", "truncated"), (b"\xc7\x00", "0xc7"),
                                        (b"\x01\x02", "trailing"), (b"\xa5ab", "past the end")])
def test_msgpack_rejects_malformed_input_with_the_offset(data, what):
    with pytest.raises(ValueError, match=what):
        msgpack.unpack(data)


def test_reader_rejects_what_is_not_an_amdgpu_code_object(artifacts):
    with pytest.raises(BlobError, match="ELF64"):
        elf.read(b"not an elf" * 10)
    image = bytearray(artifacts["conv"].programs)
    image[18:20] = (62).to_bytes(2, "little")  # EM_X86_64
    with pytest.raises(BlobError, match="EM_AMDGPU"):
        elf.read(bytes(image))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["openpilot", "resnet50", "efficientnet"])
def test_every_test_model_compiles_to_one_code_object(name, tmp_path):
    from models.efficientnet import make_efficientnet
    from models.openpilot import make_openpilot
    from models.resnet import make_resnet50
    from runner.blob import read_blob
    make = {"openpilot": make_openpilot, "resnet50": make_resnet50,
            "efficientnet": make_efficientnet}[name]
    blob = read_blob(compiled_blob(make(), target="amd"))
    path = tmp_path / "graph.hsaco"
    path.write_bytes(bytes(blob.programs))
    kds = set(re.findall(r"\s(\S+)\.kd$", _readelf(path, "--symbols"), re.M))
    assert kds == set(blob.program_names)
    assert set(elf.read(bytes(blob.programs)).kernels) == kds
