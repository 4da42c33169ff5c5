import subprocess
import tempfile
from pathlib import Path

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


def test_the_compiler_and_the_runner_know_the_same_targets():
    from compiler.target import TARGETS as CODEGEN
    from runner.targets import TARGETS as ROWS
    assert set(CODEGEN) == set(ROWS)
    assert all(v in ROWS and not ROWS[v].variants for t in ROWS.values() for v in t.variants)
    assert set(TARGETS) == {n for n, t in ROWS.items() if t.toolchain}  # C targets only


def test_host_target_is_runnable_and_other_machines_are_not():
    host = TARGETS[host_target()].host
    assert can_run(host_target())
    # x86-64-v3 and -v4 share a machine: CPU flags are the runner's check, at load
    assert not any(can_run(t) for t, d in TARGETS.items()
                   if d.host is None or (d.host.system, d.host.machines) != (host.system,
                                                                              host.machines))
    assert not can_run("dsp")  # never a host: its objects run on the DSP or under qemu


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
    """Two kernels and the entry unit that calls them, as renderers/c.py:Program splits a model:
    a kernel's name is its symbol and changes with its text."""
    from compiler.renderers.c import Program
    a = f"keel_a{a_value}"
    units = [(a, f"void {a}(int *p) {{ *p = {a_value}; }}\n"),
             ("keel_b", "void keel_b(int *p) { p[1] = 2; }\n"),
             ("keel_c", "void keel_c(int *p) { p[2] = 4; }\n"),
             ("keel_graph", f"void {a}(int *); void keel_b(int *); void keel_c(int *);\n"
                            "void keel_graph(unsigned char *a, const unsigned char *w, void *const *io)"
                            f" {{ {a}((int *)a); keel_b((int *)a); keel_c((int *)a); }}\n")]
    return Program("".join(src for _, src in units), units)


def _run_graph(so: bytes, tmp_path) -> list[int]:
    import ctypes
    path = tmp_path / f"g{len(list(tmp_path.iterdir()))}.so"
    path.write_bytes(so)
    out = (ctypes.c_int * 3)()
    ctypes.CDLL(str(path)).keel_graph(out, None, None)
    return list(out)


def _spy_compiles(monkeypatch) -> list[str]:
    """The text of every file handed to a compiling (-c) process from now on."""
    from compiler import toolchain
    seen, popen = [], subprocess.Popen

    def spy(cmd, **kw):
        if "-c" in cmd:
            seen.extend(Path(kw["cwd"], a).read_text() for a in cmd if a.endswith(".c"))
        else:
            seen.append(None)  # a link
        return popen(cmd, **kw)
    monkeypatch.setattr(toolchain.subprocess, "Popen", spy)
    return seen


def _defines(texts: list[str]) -> list[str]:
    return sorted(n for t in texts if t for n in ("keel_a1", "keel_a3", "keel_b", "keel_c", "keel_graph")
                  if f"void {n}(int *p) {{" in t or f"void {n}(unsigned char" in t)


def test_units_compile_in_batches_and_an_edit_recompiles_only_what_changed(tmp_path, monkeypatch):
    from compiler import toolchain
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KEEL_COMPILE_JOBS", "1")  # one batch: both kernels share an object
    runs = _spy_compiles(monkeypatch)
    assert toolchain.cached_units(_program(1), "cpu") == {"compiled": 4, "cached": 0}
    first = build_shared(_program(1), "cpu")
    assert _run_graph(first, tmp_path) == [1, 2, 4]
    # both kernels in one file for one process, the entry points in their own
    assert [_defines([t]) for t in runs if t] == [["keel_a1", "keel_b", "keel_c"], ["keel_graph"]]
    assert toolchain.cached_units(_program(1), "cpu") == {"compiled": 0, "cached": 4}
    runs.clear()
    assert build_shared(_program(1), "cpu") == first  # cached objects link to the same bytes
    assert runs == [None]  # nothing compiled, one link
    runs.clear()
    assert toolchain.cached_units(_program(3), "cpu") == {"compiled": 2, "cached": 2}
    edited = build_shared(_program(3), "cpu")
    assert _defines(runs) == ["keel_a3", "keel_graph"]  # keel_b, keel_c: the first batch
    assert _run_graph(edited, tmp_path) == [3, 2, 4]
    # that batch still holds keel_a1: the link drops it, as nothing calls it
    assert b"keel_a1" in first and b"keel_a1" not in edited and b"keel_b" in edited and b"keel_c" in edited
    assert not list((tmp_path / "cache" / "objects").glob(".*"))  # no temporaries left behind


def test_precompiled_kernels_leave_only_the_entry_unit_to_compile(tmp_path, monkeypatch):
    # the pipeline compiles a model's kernels while it plans its launches (toolchain.precompile)
    # and build_shared then only compiles the entry unit and links, with the cache off too
    from compiler import toolchain
    monkeypatch.setenv("KEEL_CACHE_DIR", "")
    runs = _spy_compiles(monkeypatch)
    program = _program(1)
    early = toolchain.precompile(program.units[:3], "cpu")
    assert _run_graph(build_shared(program, "cpu", early), tmp_path) == [1, 2, 4]
    compiled = [_defines([t]) for t in runs if t]
    assert sorted(n for d in compiled for n in d) == ["keel_a1", "keel_b", "keel_c", "keel_graph"]
    assert ["keel_graph"] in compiled  # the entry unit alone, beside the kernels
    assert toolchain.precompile(program.units[:3], "dsp") is None  # one unit: nothing early
    from compiler.renderers.c import Program
    broken = [("keel_x", "void keel_x(int *p) { *p = ; }\n"),
              ("keel_graph", "void keel_graph(void) {}\n")]
    with pytest.raises(CompileError, match="expected expression"):  # failed early: fails here
        build_shared(Program("".join(t for _, t in broken), broken), "cpu",
                     toolchain.precompile(broken[:1], "cpu"))


def test_a_kernel_in_two_cached_objects_links_once(tmp_path, monkeypatch):
    # two batches can hold the same kernel (two compiles at once, each missing it): it has the
    # same symbol and code in both, and the link must take one, not fail on a duplicate. Here
    # keel_c stays in the first batch, and keel_b goes into the second one too
    from compiler import toolchain
    monkeypatch.setenv("KEEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KEEL_COMPILE_JOBS", "1")
    build_shared(_program(1), "cpu")
    a3 = _program(3)
    keys = toolchain._unit_keys(a3.units, "cpu")
    (tmp_path / "cache" / "units" / keys["keel_b"]).unlink()  # as if another compile raced it
    runs = _spy_compiles(monkeypatch)
    assert _run_graph(build_shared(a3, "cpu"), tmp_path) == [3, 2, 4]
    assert _defines(runs) == ["keel_a3", "keel_b", "keel_graph"]
    objs = {n: (tmp_path / "cache" / "units" / k).read_bytes() for n, k in keys.items()}
    assert objs["keel_a3"] == objs["keel_b"] != objs["keel_c"]  # both batches are linked


def test_an_empty_cache_dir_turns_the_object_cache_off(tmp_path, monkeypatch):
    from compiler import toolchain
    monkeypatch.setenv("KEEL_CACHE_DIR", "")
    monkeypatch.chdir(tmp_path)
    build_shared(_program(1), "cpu")
    assert toolchain.cached_units(_program(1), "cpu") == {"compiled": 4, "cached": 0}
    assert list(tmp_path.iterdir()) == []
