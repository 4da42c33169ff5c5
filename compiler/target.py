"""Targets are descriptions, not code forks: what the optimizer, renderer and toolchain need to
know about a machine. Adding a device means adding a row here, not branches elsewhere."""
from __future__ import annotations

from dataclasses import dataclass

from compiler.errors import CompileError


@dataclass(frozen=True)
class Target:
    name: str
    renderer: str  # "c" | "opencl"
    device: str  # runner device that executes it
    vector_bytes: int = 32  # SIMD register width the optimizer tiles for
    registers: int = 16  # vector registers available for accumulators
    max_workgroup: int = 0  # GPU only
    image_max_width: int = 0  # GPU image path: texels per row
    image_pitch_align: int = 0  # GPU image path: row pitch alignment in texels


TARGETS = {t.name: t for t in (
    Target("cpu", "c", "cpu", vector_bytes=32, registers=16),  # x86-64-v3: AVX2 + FMA
    Target("cpu-aarch64", "c", "cpu", vector_bytes=16, registers=32),  # comma 3X (Kryo 385)
    Target("cpu-arm64-apple", "c", "cpu", vector_bytes=16, registers=32),
    Target("opencl", "opencl", "opencl", vector_bytes=16, max_workgroup=256),
    # Adreno 630: 1024-wide work-groups, 16384-texel images, 64-texel row pitch alignment
    Target("qcom", "opencl", "qcom", vector_bytes=16, max_workgroup=1024,
           image_max_width=16384, image_pitch_align=64),
)}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise CompileError(f"unknown target {name!r}; expected one of {', '.join(TARGETS)}")
    return TARGETS[name]
