"""keel's targets, defined once: per blob target, the runner device that runs it, the host its code
runs on (CPU targets: OS, machine, the CPU features the code uses) and how its C is built (clang
triple and flags). The compiler (compiler/target.py: what codegen knows about the machine;
compiler/toolchain.py) and the runner (runner/host.py, runner/blob.py, runner/model.py, dsp/build.py)
read this table. It lives in runner/ because the on-device runtime never imports compiler/.
Standard library only: runner/blob.py asks before it loads anything.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    """The machine a CPU target's shared object runs on, as a process of this host."""
    system: str  # platform.system()
    machines: tuple[str, ...]  # platform.machine() spellings
    cpu_flags: tuple[str, ...] = ()  # /proc/cpuinfo flags the code may use


@dataclass(frozen=True)
class Toolchain:
    """How the target's C is built into one shared object (compiler/toolchain.py)."""
    triple: str  # clang --target
    code_flags: tuple[str, ...]  # -march / -mcpu and kin, understood by clang and gcc alike
    link_flags: tuple[str, ...] = ("-fuse-ld=lld",)  # clang only
    # one translation unit, never per-kernel units: ld.lld-19 concatenates Hexagon build
    # attribute sections instead of merging them, and a tool reading the object then finds them
    # malformed (llvm-objdump decodes no HVX at all)
    one_unit: bool = False


@dataclass(frozen=True)
class Target:
    name: str
    device: str  # the runner device that runs a blob of this target when Model.load names none
    host: Host | None = None  # CPU targets
    toolchain: Toolchain | None = None  # targets whose programs are C built by keel
    # the targets one blob of this target holds, each a row here (the runner loads the widest
    # its host runs); empty: this target's code only
    variants: tuple[str, ...] = ()


V3_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
X86 = ("x86_64", "AMD64")
X86_64_V3 = Toolchain("x86_64-linux-gnu", ("-march=x86-64-v3",))
# Hexagon 685 cDSP (v65) with 128-byte HVX. -G0: no small-data (GP-relative) section, which a
# position-independent object loaded by the DSP's loader cannot use. Never a host: the objects
# run on the DSP (dsp/), or under qemu-hexagon (sim/dsp).
HEXAGON = Toolchain("hexagon-unknown-none-elf", ("-mcpu=hexagonv65", "-mhvx", "-mhvx-length=128b",
                                                 "-G0"), one_unit=True)

# CPU targets of one machine narrow to wide: runner/host.py's choose() prefers the last one a
# host runs, and compiler/toolchain.py's host_target() the first
TARGETS = {t.name: t for t in (
    Target("cpu-avx2", "cpu", Host("Linux", X86, V3_FLAGS), X86_64_V3),  # x86-64-v3: AVX2+FMA
    # x86-64-v4. clang prefers 256-bit vectors there (it splits a 64-byte vector type into two
    # ymm halves) unless told otherwise; gcc understands the flag too
    Target("cpu-avx512", "cpu",
           Host("Linux", X86, V3_FLAGS + ("avx512f", "avx512bw", "avx512cd", "avx512dq",
                                         "avx512vl")),
           Toolchain("x86_64-linux-gnu", ("-march=x86-64-v4", "-mprefer-vector-width=512"))),
    # comma 3X: Snapdragon 845, Kryo 385 gold cores are Cortex-A75 derivatives
    Target("cpu-aarch64", "cpu", Host("Linux", ("aarch64", "arm64")),
           Toolchain("aarch64-linux-gnu", ("-mcpu=cortex-a75",))),
    # ld64.lld refuses undefined symbols (memcpy) unless told they come from the loading process
    Target("cpu-arm64-apple", "cpu", Host("Darwin", ("arm64",)),
           Toolchain("arm64-apple-macos11", (), ("-fuse-ld=lld", "-Wl,-undefined,dynamic_lookup"))),
    # every x86-64 host: one blob holding both levels. As a toolchain target, C that must run on
    # every x86-64 host is built for the baseline, x86-64-v3
    Target("cpu", "cpu", Host("Linux", X86, V3_FLAGS), X86_64_V3,
           variants=("cpu-avx2", "cpu-avx512")),
    Target("opencl", "opencl"),  # any OpenCL device, through its vendor's libOpenCL
    # OpenCL C for the Adreno 630, run through KGSL directly (qcom/); the vendor's libOpenCL
    # runs it when asked for (Model.load(path, device="opencl"))
    Target("qcom", "qcom"),
    Target("amd", "amd"),  # a gfx1100 HSA code object, run by am/ over usbgpu/
    Target("dsp", "dsp", toolchain=HEXAGON),  # Hexagon 685 through FastRPC (dsp/)
)}


def device_of(target: str) -> str:
    """The runner device that runs a blob of `target` by default (KeyError: no such target)."""
    return TARGETS[target].device


def hosts() -> dict[str, Host]:
    """The CPU targets whose code a host process runs, each one build (not a `cpu` blob's set)."""
    return {n: t.host for n, t in TARGETS.items() if t.host is not None and not t.variants}
