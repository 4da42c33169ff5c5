"""C source -> shared object bytes for one CPU target.

One freestanding translation unit in, one shared object out, built with clang-19 (any target from
any host) or gcc (host target only, when clang-19 is missing). Nothing is cached yet. The object may
still import memcpy/memset that the compiler emits for large copies: the runner resolves them from
the libc already loaded in its process.
"""
from __future__ import annotations

import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from compiler.errors import CompileError

CLANG = "clang-19"
GCC = "gcc"
# -ffp-contract=fast: kernels bind every value to a variable, so a*b+c spans statements;
# only "fast" lets the compiler fuse it into an FMA (one rounding instead of two).
COMMON_FLAGS = ("-O2", "-ffreestanding", "-fno-math-errno", "-ffp-contract=fast", "-fPIC", "-shared",
                "-nostdlib")


@dataclass(frozen=True)
class CpuTarget:
    triple: str  # clang --target
    cpu_flags: tuple[str, ...]  # understood by clang and gcc alike
    link_flags: tuple[str, ...]  # clang only (lld)
    system: str  # platform.system() of a host that can run the object
    machines: tuple[str, ...]  # platform.machine() spellings of that host


TARGETS: dict[str, CpuTarget] = {
    "cpu": CpuTarget("x86_64-linux-gnu", ("-march=x86-64-v3",), ("-fuse-ld=lld",),
                     "Linux", ("x86_64", "AMD64")),
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
                                                  "-G0"), ("-fuse-ld=lld",), "QuRT", ()),
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
    """Compile `source` (one C translation unit) into a shared object for `target`."""
    cmd = _command(target)
    with tempfile.TemporaryDirectory(prefix="keel-cc-") as tmp:
        # relative names only: the file name lands in the object's symbol table, keep it stable
        Path(tmp, "graph.c").write_text(source)
        proc = subprocess.run([*cmd, "graph.c", "-o", "graph.so"], cwd=tmp,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(f"{cmd[0]} failed for target {target!r} (exit {proc.returncode}):\n"
                               f"{proc.stderr.strip()}")
        return Path(tmp, "graph.so").read_bytes()


def _target(target: str) -> CpuTarget:
    if target not in TARGETS:
        raise CompileError(f"unknown CPU target {target!r}; expected one of {sorted(TARGETS)}")
    return TARGETS[target]


def _command(target: str) -> list[str]:
    t = _target(target)
    if shutil.which(CLANG):
        return [CLANG, f"--target={t.triple}", *t.cpu_flags, *COMMON_FLAGS, *t.link_flags]
    if shutil.which(GCC) and target == host_target():
        return [GCC, *t.cpu_flags, *COMMON_FLAGS]
    raise CompileError(f"{CLANG} not found; the {GCC} fallback only builds for the host target "
                       f"{host_target()!r}, got {target!r}")


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
