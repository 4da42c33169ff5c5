"""C source -> shared object bytes for one CPU target.

One freestanding translation unit in, one shared object out, built with clang-19 (any target from
any host) or gcc (host target only, when clang-19 is missing). The object may still import
memcpy/memset that the compiler emits for large copies: the runner resolves them from the libc
already loaded in its process.

A source that carries `units` (renderers/c.py:Program: one per kernel, one for the entry points)
is built unit by unit instead: each unit's object comes from the cache (compiler/cache.py, keyed
by its name, text, the command and the compiler's version) or is compiled, the missing ones in one
compiler process per core, and the objects are linked. An edited model recompiles only the
kernels it changed; an unchanged one only links.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from compiler import cache as disk
from compiler.errors import CompileError

CLANG = "clang-19"
GCC = "gcc"
# -ffp-contract=fast: kernels bind every value to a variable, so a*b+c spans statements;
# only "fast" lets the compiler fuse it into an FMA (one rounding instead of two).
CODE_FLAGS = ("-O2", "-ffreestanding", "-fno-math-errno", "-ffp-contract=fast", "-fPIC")
LINK_FLAGS = ("-shared", "-nostdlib")
TIMEOUT = 1800  # seconds for one compiler process: the largest model's kernels take ~30 s


@dataclass(frozen=True)
class CpuTarget:
    triple: str  # clang --target
    cpu_flags: tuple[str, ...]  # understood by clang and gcc alike
    link_flags: tuple[str, ...]  # clang only (lld)
    system: str  # platform.system() of a host that can run the object
    machines: tuple[str, ...]  # platform.machine() spellings of that host
    # one translation unit, never per-kernel units: ld.lld-19 concatenates Hexagon build
    # attribute sections instead of merging them, and a tool reading the object then finds them
    # malformed (llvm-objdump decodes no HVX at all)
    one_unit: bool = False


X86_64_V3 = CpuTarget("x86_64-linux-gnu", ("-march=x86-64-v3",), ("-fuse-ld=lld",), "Linux",
                      ("x86_64", "AMD64"))
# a `cpu` blob's code is built per variant (compiler/target.py: cpu-avx2 and cpu-avx512); as a
# toolchain target, "cpu" is the baseline, x86-64-v3, for C that must run on every x86-64 host
TARGETS: dict[str, CpuTarget] = {
    "cpu-avx2": X86_64_V3,
    "cpu": X86_64_V3,
    # clang's x86-64-v4 prefers 256-bit vectors (it splits a 64-byte vector type into two ymm
    # halves) unless told otherwise; gcc understands the flag too
    "cpu-avx512": CpuTarget("x86_64-linux-gnu", ("-march=x86-64-v4", "-mprefer-vector-width=512"),
                            ("-fuse-ld=lld",),
                            "Linux", ("x86_64", "AMD64")),
    # comma 3X: Snapdragon 845, Kryo 385 gold cores are Cortex-A75 derivatives
    "cpu-aarch64": CpuTarget("aarch64-linux-gnu", ("-mcpu=cortex-a75",), ("-fuse-ld=lld",),
                             "Linux", ("aarch64", "arm64")),
    # ld64.lld refuses undefined symbols (memcpy) unless told they come from the loading process
    "cpu-arm64-apple": CpuTarget("arm64-apple-macos11", (),
                                 ("-fuse-ld=lld", "-Wl,-undefined,dynamic_lookup"),
                                 "Darwin", ("arm64",)),
    # Hexagon 685 cDSP (v65) with 128-byte HVX. -G0: no small-data (GP-relative) section, which
    # a position-independent object loaded by the DSP's loader cannot use. Never a host: the
    # objects run on the DSP, or under qemu-hexagon through dsp/runtime.c.
    "dsp": CpuTarget("hexagon-unknown-none-elf", ("-mcpu=hexagonv65", "-mhvx", "-mhvx-length=128b",
                                                  "-G0"), ("-fuse-ld=lld",), "QuRT", (),
                     one_unit=True),
}


def host_target() -> str:
    """The CPU target whose objects this machine can load."""
    system, machine = platform.system(), platform.machine()
    for name, t in TARGETS.items():
        if t.system == system and machine in t.machines:
            return name
    raise CompileError(f"no keel CPU target for host {system}/{machine}; known: {sorted(TARGETS)}")


def can_run(target: str) -> bool:
    t = _target(target)
    return t.system == platform.system() and platform.machine() in t.machines


def build_shared(source: str, target: str) -> bytes:
    """Compile `source` (one C translation unit, or a Program with units) into a shared object
    for `target`."""
    units = None if _target(target).one_unit else getattr(source, "units", None)
    with tempfile.TemporaryDirectory(prefix="keel-cc-") as tmp:
        # relative names only: a file's name lands in its object's symbol table, keep it stable
        if not units:
            Path(tmp, "graph.c").write_text(source)
            _run([*_command(target), "graph.c", "-o", "graph.so"], tmp, target)
            return Path(tmp, "graph.so").read_bytes()
        objs = _objects(units, target, tmp)
        _run([*_link_command(target), *objs, "-o", "graph.so"], tmp, target)
        return Path(tmp, "graph.so").read_bytes()


def cached_units(source: str, target: str) -> dict[str, int]:
    """How many of the source's units build_shared will compile, and how many it has cached."""
    units = (None if _target(target).one_unit else getattr(source, "units", None)) \
        or [("graph", source)]
    keys = _unit_keys(units, target)
    hit = sum(disk.has("objects", k) for k in keys.values())
    return {"compiled": len(units) - hit, "cached": hit}


def _unit_keys(units: list[tuple[str, str]], target: str) -> dict[str, str]:
    """The object cache's key per unit: its name (it lands in the object), its text, the
    command and the compiler's version."""
    cmd = [*_command(target, link=False), "-c"]
    tag = repr((cmd, _cc_version(cmd[0]))).encode()
    return {n: hashlib.sha256(tag + n.encode() + b"\0" + src.encode()).hexdigest()
            for n, src in units}


def _objects(units: list[tuple[str, str]], target: str, tmp: str) -> list[str]:
    """Each unit's object file in `tmp` (names in unit order): from the cache, or compiled by
    as many compiler processes as there are cores, each given a similar share of the source."""
    cmd = [*_command(target, link=False), "-c"]
    keys = _unit_keys(units, target)
    missing = []
    for name, src in units:
        data = disk.get("objects", keys[name])
        if data is None:
            Path(tmp, f"{name}.c").write_text(src)
            missing.append((len(src), name))
        else:
            Path(tmp, f"{name}.o").write_bytes(data)
    # clang runs a compiler process per file it is given (~30 ms of start-up each, measured), so
    # a second process pays for itself as soon as it takes one file off the first
    n = max(1, min(compile_jobs(), len(missing)))
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(n)]
    for size, name in sorted(missing, reverse=True):  # largest first, onto the lightest group
        load, names = min(groups, key=lambda g: g[0])
        groups[groups.index((load, names))] = (load + size, names + [name])
    procs = [subprocess.Popen([*cmd, *(f"{n}.c" for n in names)], cwd=tmp, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _, names in groups if names]
    errors = []
    for p in procs:  # every process is waited for, so none outlives the temporary folder
        try:
            _wait(p, target)
        except CompileError as e:
            errors.append(e)
    if errors:
        raise errors[0]
    for _, name in missing:
        disk.put("objects", keys[name], Path(tmp, f"{name}.o").read_bytes())
    return [f"{name}.o" for name, _ in units]


def _run(cmd: list[str], cwd: str, target: str) -> None:
    _wait(subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True), target)


def _wait(proc: subprocess.Popen, target: str) -> None:
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise CompileError(f"{proc.args[0]} took over {TIMEOUT} s for target {target!r}") from None
    if proc.returncode != 0:
        raise CompileError(f"{proc.args[0]} failed for target {target!r} (exit {proc.returncode}):\n"
                           f"{err.strip()}")


@cache
def _cc_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout


def compile_jobs() -> int:
    """Processes a compile may run at once (kernel builders, clang): KEEL_COMPILE_JOBS, or one
    per core this process may use."""
    text = os.environ.get("KEEL_COMPILE_JOBS", "")
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def _target(target: str) -> CpuTarget:
    if target not in TARGETS:
        raise CompileError(f"unknown CPU target {target!r}; expected one of {sorted(TARGETS)}")
    return TARGETS[target]


def _command(target: str, link: bool = True) -> list[str]:
    """The compiler command for `target`: compile and link in one go, or (link=False) compile."""
    t = _target(target)
    if shutil.which(CLANG):
        tail = (*LINK_FLAGS, *t.link_flags) if link else ()
        return [CLANG, f"--target={t.triple}", *t.cpu_flags, *CODE_FLAGS, *tail]
    if shutil.which(GCC) and target == host_target():
        return [GCC, *t.cpu_flags, *CODE_FLAGS, *(LINK_FLAGS if link else ())]
    raise CompileError(f"{CLANG} not found; the {GCC} fallback only builds for the host target "
                       f"{host_target()!r}, got {target!r}")


def _link_command(target: str) -> list[str]:
    cc, t = _command(target, link=False)[0], _target(target)
    if cc == CLANG:
        return [CLANG, f"--target={t.triple}", *LINK_FLAGS, *t.link_flags]
    return [GCC, *LINK_FLAGS]


LLD = "ld.lld-19"
# The OpenCL C the code object was compiled from rides along as a loaded, exported constant: the
# mock GPU's command processor (am/mock_gpu.py) finds it through the dynamic symbol table in GPU
# memory, as it finds kernels, and runs it on PoCL. A real GPU never reads it (it costs its size in VRAM).
SOURCE_SYMBOL = "keel_source"
# -nogpulib: no ROCm device library; the program defines the builtins it calls (renderers/amdgcn.py)
GPU_FLAGS = ("-x", "cl", "-cl-std=CL1.2", "-nogpulib", "-O2", "-ffp-contract=fast")


def build_code_object(source: str, arch: str) -> bytes:
    """OpenCL C -> one HSA code object (an ELF shared object) for AMD GPU `arch` (gfx1100):
    clang-19 compiles, ld.lld-19 links."""
    steps = [[CLANG, "-target", "amdgcn-amd-amdhsa", f"-mcpu={arch}", *GPU_FLAGS, "-c",
              "graph.cl", "-o", "graph.o"],
             [LLD, "-shared", "graph.o", "-o", "graph.hsaco"]]
    with tempfile.TemporaryDirectory(prefix="keel-amd-") as tmp:
        Path(tmp, "graph.cl").write_text(source + _source_constant(source))
        for cmd in steps:
            if not shutil.which(cmd[0]):
                raise CompileError(f"{cmd[0]} not found; target {arch!r} needs clang-19 and "
                                   f"lld-19 (apt-get install clang-19 lld-19)")
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
            if proc.returncode != 0:
                raise CompileError(f"{cmd[0]} failed for {arch} (exit {proc.returncode}):\n"
                                   f"{proc.stderr.strip()}")
        return Path(tmp, "graph.hsaco").read_bytes()


def _source_constant(source: str) -> str:
    """`source` as an exported __constant char array, one string literal per line (octal
    escapes for quotes, backslashes, '?' (trigraphs) and anything not printable ASCII)."""
    def lit(line: str) -> str:
        return '"' + "".join(c if " " <= c <= "~" and c not in '"\\?' else f"\\{ord(c):03o}"
                             for c in line) + '"'
    body = "\n".join(lit(line) for line in source.encode().decode("latin-1").splitlines(True))
    return (f"\n__attribute__((visibility(\"protected\"))) __constant char {SOURCE_SYMBOL}[] =\n"
            f"{body or chr(34) * 2};\n")
