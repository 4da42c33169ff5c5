import subprocess
import tempfile

import pytest

from compiler.errors import CompileError
from compiler.toolchain import TARGETS, build_shared, can_run, host_target

SOURCE = "void keel_graph(unsigned char *a, const unsigned char *w, void *const *io) { *a = *w; }"
MAGICS = {"cpu": (b"\x7fELF", 62), "cpu-avx2": (b"\x7fELF", 62), "cpu-avx512": (b"\x7fELF", 62),
          "cpu-aarch64": (b"\x7fELF", 183),
          "cpu-arm64-apple": (b"\xcf\xfa\xed\xfe", None),
          "dsp": (b"\x7fELF", 164)}  # ELF e_machine: 62 x86-64, 183 aarch64, 164 Hexagon


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_target_builds_a_shared_object_for_its_architecture(target):
    so = build_shared(SOURCE, target)
    magic, machine = MAGICS[target]
    assert so.startswith(magic)
    if machine is not None:
        assert int.from_bytes(so[18:20], "little") == machine


def test_same_source_gives_identical_bytes():
    assert build_shared(SOURCE, "cpu-aarch64") == build_shared(SOURCE, "cpu-aarch64")


def test_compile_failure_raises_compile_error_with_target_and_stderr():
    with pytest.raises(CompileError, match=r"(?s)target 'cpu-aarch64'.*expected expression"):
        build_shared("int x = ;", "cpu-aarch64")


def test_unknown_target_raises_compile_error_listing_targets():
    with pytest.raises(CompileError, match="unknown CPU target 'riscv'"):
        build_shared(SOURCE, "riscv")


def test_host_target_is_runnable_and_other_machines_are_not():
    host = TARGETS[host_target()]
    assert can_run(host_target())
    # x86-64-v3 and -v4 share a machine: CPU flags are the runner's check, at load
    assert not any(can_run(t) for t, d in TARGETS.items()
                   if (d.system, d.machines) != (host.system, host.machines))


def test_avx512_target_computes_in_512_bit_registers():
    # clang's x86-64-v4 splits 64-byte vector types into ymm halves unless told to prefer 512
    src = ("typedef float v16 __attribute__((vector_size(64)));\n"
           "void k(v16 *a, const v16 *b, const v16 *c) { *a = *a * *b + *c; }\n")
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(build_shared(src, "cpu-avx512"))
        f.flush()
        out = subprocess.run(["llvm-objdump-19", "-d", f.name], capture_output=True, text=True)
        if out.returncode:  # llvm-19 tools not installed: binutils reads x86-64 just as well
            out = subprocess.run(["objdump", "-d", f.name], capture_output=True, text=True)
        asm = out.stdout
    assert "vfmadd" in asm and "zmm" in asm


def _program(a_value: int):
    """Two kernels and the entry unit that calls them, as renderers/c.py:Program splits a model."""
    from compiler.renderers.c import Program
    units = [("keel_a", f"void keel_a(int *p) {{ *p = {a_value}; }}\n"),
             ("keel_b", "void keel_b(int *p) { p[1] = 2; }\n"),
             ("keel_graph", "void keel_a(int *); void keel_b(int *);\n"
                            "void keel_graph(unsigned char *a, const unsigned char *w, void *const *io)"
                            " { keel_a((int *)a); keel_b((int *)a); }\n")]
    return Program("".join(src for _, src in units), units)


def _run_graph(so: bytes, tmp_path) -> list[int]:
    import ctypes
    path = tmp_path / f"g{len(list(tmp_path.iterdir()))}.so"
    path.write_bytes(so)
    out = (ctypes.c_int * 2)()
    ctypes.CDLL(str(path)).keel_graph(out, None, None)
    return list(out)


def test_units_compile_once_and_an_edit_recompiles_only_its_unit(tmp_path, monkeypatch):
    from compiler import toolchain
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    runs, popen = [], subprocess.Popen
    monkeypatch.setattr(toolchain.subprocess, "Popen", lambda cmd, **kw: runs.append(cmd) or popen(cmd, **kw))
    assert toolchain.cached_units(_program(1), "cpu") == {"compiled": 3, "cached": 0}
    first = build_shared(_program(1), "cpu")
    assert _run_graph(first, tmp_path) == [1, 2]
    assert toolchain.cached_units(_program(1), "cpu") == {"compiled": 0, "cached": 3}
    runs.clear()
    assert build_shared(_program(1), "cpu") == first  # cached objects link to the same bytes
    assert len(runs) == 1 and "-c" not in runs[0]  # nothing compiled, one link
    runs.clear()
    edited = build_shared(_program(3), "cpu")
    assert [a for cmd in runs if "-c" in cmd for a in cmd if a.endswith(".c")] == ["keel_a.c"]
    assert _run_graph(edited, tmp_path) == [3, 2]
    assert not list((tmp_path / "cache" / "objects").glob(".*"))  # no temporaries left behind


def test_an_empty_cache_dir_turns_the_object_cache_off(tmp_path, monkeypatch):
    from compiler import toolchain
    monkeypatch.setenv("KEEL_CACHE_DIR", "")
    monkeypatch.chdir(tmp_path)
    build_shared(_program(1), "cpu")
    assert toolchain.cached_units(_program(1), "cpu") == {"compiled": 3, "cached": 0}
    assert list(tmp_path.iterdir()) == []
