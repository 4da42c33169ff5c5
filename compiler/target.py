"""Targets are descriptions, not code forks: what the optimizer, renderer and toolchain need to
know about a machine. Adding a device means adding a row here, not branches elsewhere."""
from __future__ import annotations

from dataclasses import dataclass

from compiler.errors import CompileError

# cache line of the x86-64 and Kryo targets (Apple M's are 128 bytes: 64 reads one in halves)
LINE_BYTES = 64


@dataclass(frozen=True)
class Target:
    name: str
    renderer: str  # "c" | "opencl"
    device: str  # runner device that executes it
    vector_bytes: int = 32  # SIMD register width the optimizer tiles for
    registers: int = 16  # vector registers available for accumulators
    # per-core L1d and L2 the CPU loop order blocks for: the smallest among the target's
    # common CPUs (Skylake client for x86-64-v3, Skylake-SP for v4, Kryo 385 for aarch64)
    l1_bytes: int = 32 << 10
    l2_bytes: int = 256 << 10
    # CPU: hint the next output tile's weights into L2 while this tile computes (pack.py)
    prefetch: bool = False
    max_workgroup: int = 0  # GPU only
    # Sub-buffers (one per tensor in the arena / weights) must start on the device's base address
    # alignment (CL_DEVICE_MEM_BASE_ADDR_ALIGN: 1024 bits on Adreno 6xx and PoCL).
    buffer_align: int = 64
    # fp16 arithmetic in kernels (cl_khr_fp16). Without it, --float16 still halves memory traffic:
    # half storage through vload_half/vstore_half, fp32 arithmetic.
    half_compute: bool = False
    # GPU image path: float tensors whose innermost dim is a multiple of 4 are read as 2D RGBA
    # images (read_imagef) when `images` is on; rows are `image_pitch_align` texels apart.
    images: bool = False
    image_max_width: int = 0  # texels per row
    image_max_height: int = 0  # rows
    image_pitch_align: int = 0  # row pitch alignment in texels


TARGETS = {t.name: t for t in (
    Target("cpu", "c", "cpu", vector_bytes=32, registers=16, prefetch=True),  # x86-64-v3: AVX2+FMA
    Target("cpu-avx512", "c", "cpu", vector_bytes=64, registers=32,
           l2_bytes=1 << 20, prefetch=True),  # x86-64-v4: AVX-512
    Target("cpu-aarch64", "c", "cpu", vector_bytes=16, registers=32, prefetch=True),  # comma 3X
    Target("cpu-arm64-apple", "c", "cpu", vector_bytes=16, registers=32, prefetch=True),
    # any OpenCL 1.2 device (PoCL in CI): no fp16 arithmetic, images opt-in within the limits
    # every OpenCL 1.2 image-capable device guarantees (8192 x 8192)
    Target("opencl", "opencl", "opencl", vector_bytes=16, max_workgroup=256, buffer_align=128,
           image_max_width=8192, image_max_height=8192, image_pitch_align=16),
    # Adreno 630: 1024-wide work-groups, fp16 ALUs, 16384-texel images, 64-texel row pitch alignment
    Target("qcom", "opencl", "qcom", vector_bytes=16, max_workgroup=1024, buffer_align=128,
           half_compute=True, images=True, image_max_width=16384, image_max_height=16384,
           image_pitch_align=64),
)}


def get_target(name: str | Target) -> Target:
    """A target by name; a Target passes through (tests vary limits with dataclasses.replace)."""
    if isinstance(name, Target):
        return name
    if name not in TARGETS:
        raise CompileError(f"unknown target {name!r}; expected one of {', '.join(TARGETS)}")
    return TARGETS[name]
