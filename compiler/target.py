"""Targets are descriptions, not code forks: what the optimizer and renderer need to know about a
machine. Adding a device means adding a row here, not branches elsewhere. Which device runs a
target, the host its code runs on, its toolchain and the variants one blob holds are
runner/targets.py's rows (the runtime reads them too and never imports the compiler)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from compiler.errors import CompileError
from compiler.ir.kernel import AxisKind
from runner import targets

# cache line of the x86-64 and Kryo targets (Apple M's are 128 bytes: 64 reads one in halves)
LINE_BYTES = 64


@dataclass(frozen=True)
class Target:
    name: str
    renderer: str  # kernel language: "c" | "opencl"; only renderers.get_renderer reads it
    vector_bytes: int = 32  # SIMD register width the optimizer tiles for
    # float kernels' vector width where it differs (0: vector_bytes). Hexagon v65 HVX is integer
    # only: float kernels tile for scalar FP registers, integer ones for 128-byte HVX vectors.
    float_vector_bytes: int = 0
    registers: int = 16  # vector registers available for accumulators
    # per-core L1d and L2 the CPU loop order blocks for: the smallest among the target's
    # common CPUs (Skylake client for x86-64-v3, Skylake-SP for v4, Kryo 385 for aarch64)
    l1_bytes: int = 32 << 10
    l2_bytes: int = 256 << 10
    # CPU: hint the next output tile's weights into L2 while this tile computes (pack.py)
    prefetch: bool = False
    # HVX: each trip of a kernel's outer loop hints, with one l2fetch box, the block a later
    # trip streams in (codegen/l2fetch.py); off, the same kernels without the hint
    l2fetch: bool = False
    max_workgroup: int = 0  # GPU only
    # Sub-buffers (one per tensor in the arena / weights) must start on the device's base address
    # alignment (CL_DEVICE_MEM_BASE_ADDR_ALIGN: 1024 bits on Adreno 6xx and PoCL).
    buffer_align: int = 64
    # fp16 arithmetic in kernels (cl_khr_fp16). Without it, --float16 still halves memory traffic:
    # half storage through vload_half/vstore_half, fp32 arithmetic.
    half_compute: bool = False
    # --float16 stores activations as half too, not only weights. CPUs keep fp32 activations,
    # where the C compiler's vector code is fastest (half weights are widened in registers).
    half_activations: bool = False
    # GPU image path: float tensors whose innermost dim is a multiple of 4 are read as 2D RGBA
    # images (read_imagef) when `images` is on; rows are `image_pitch_align` texels apart.
    images: bool = False
    image_max_width: int = 0  # texels per row
    image_max_height: int = 0  # rows
    image_pitch_align: int = 0  # row pitch alignment in texels
    # How a kernel's output dims run: LOOP (nested loops; a thread pool shares the outermost,
    # planned by codegen/plan_cpu.py) or GLOBAL (one work item per output tile, plan_gpu.py).
    output_dims: AxisKind = AxisKind.LOOP
    # Buffer layouts chosen for cache reuse (schedule/layout.py): channels-last convs, padded and
    # residual tensors written in place, merged dims. Targets without it keep every buffer as
    # the graph has it (images already make GPU reads 2D).
    cpu_layouts: bool = False
    # Cheap elementwise work under a broadcast inside a reduction (the squeeze-excite scale
    # before a 1x1 conv, an input's normalization and zero border before the stem conv) is
    # recomputed on every read instead of stored and read back: memory, not ALUs, bounds a GPU
    # on these models (docs/perf.md, the Adreno 630 cost model). CPUs realize it once.
    recompute_cheap: bool = False
    # A quantized conv's int32 output channels are padded with zero channels up to whole
    # 32-lane vectors when that adds at most 1/16 of its work (onnx/ops/quant.py
    # _whole_vectors), or 1/this when the count is not a multiple of 32. On dsp a narrower
    # vector is half an HVX register or none (8 lanes: scalar code, several times the
    # packets): it pays up to half again the work there.
    narrow_pad_divisor: int = 16
    # The renderer has HVX forms of the integer idioms: quantized 1x1 convs over uint8
    # activations multiply four bytes at a time (Ops.DOT4, one vrmpy per 32 output channels;
    # onnx/ops/quant_hvx.py) and requantization takes the high word of a 32x32 product
    # in two instructions (Ops.MULHI), where plain int32 lanes take a dozen
    hvx: bool = False
    # Winograd F(2x2,3x3) for eligible 3x3 convs (compiler/winograd.py, chosen in
    # compiler/algorithms.py): fewer multiplies for more adds and a larger weight, a trade a
    # wide-SIMD CPU wins.
    winograd: bool = False
    pack_weights: bool = False  # weights copied into the order the kernel reads them (pack.py)
    # The programs are one shared object built by the toolchain; otherwise kernel source that the
    # device's driver compiles at load.
    shared_object: bool = False
    # GPU architecture the toolchain compiles the OpenCL C for, into one HSA code object
    # (toolchain.build_code_object); "" leaves the source for the device's driver to compile.
    code_object: str = ""
    # Where OpenCL C's builtin functions (get_global_id, vloadN, vstore_halfN, barrier) come
    # from: "library" (the OpenCL implementation's), or "amdgcn": the program defines the ones
    # the renderer uses, work-item ids from __builtin_amdgcn_* (no ROCm device library needed).
    cl_builtins: str = "library"
    # The device profiles each kernel by its symbol: every kernel stays its own function, never
    # inlined into the entry points (a call per launch costs nothing against a kernel).
    kernel_symbols: bool = False

    @property
    def variants(self) -> tuple[str, ...]:
        """Targets built into one blob, each a row of TARGETS (runner/targets.py: a `cpu` blob
        holds x86-64-v3 and -v4 code; the runner loads the best its host runs). Empty: this
        target's code only."""
        row = targets.TARGETS.get(self.name)
        return row.variants if row else ()

    def vector_width(self, dtypes) -> int:
        """Bytes per vector for a kernel computing in `dtypes` (keel DTypes): the float width
        as soon as one is a float (a float kernel with an int8 result is still float work)."""
        floats = self.float_vector_bytes and any(d.scalar.is_float for d in dtypes)
        return self.float_vector_bytes if floats else self.vector_bytes


# what every CPU target shares; they differ in vector width, registers and caches
CPU = dict(renderer="c", prefetch=True, cpu_layouts=True, winograd=True,
           pack_weights=True, shared_object=True)
# every OpenCL target: one work item per output tile, half activations under --float16
GPU = dict(renderer="opencl", vector_bytes=16, buffer_align=128,
           half_activations=True, output_dims=AxisKind.GLOBAL, recompute_cheap=True)

TARGETS = {t.name: t for t in (
    # every x86-64 host: one blob, both levels below (the runner picks one at load)
    Target("cpu", vector_bytes=32, registers=16, **CPU),
    Target("cpu-avx2", vector_bytes=32, registers=16, **CPU),  # x86-64-v3: AVX2+FMA
    Target("cpu-avx512", vector_bytes=64, registers=32, l2_bytes=1 << 20, **CPU),  # x86-64-v4
    Target("cpu-aarch64", vector_bytes=16, registers=32, **CPU),  # comma 3X
    Target("cpu-arm64-apple", vector_bytes=16, registers=32, **CPU),
    # any OpenCL 1.2 device (PoCL in CI): no fp16 arithmetic, images opt-in within the limits
    # every OpenCL 1.2 image-capable device guarantees (8192 x 8192)
    Target("opencl", max_workgroup=256, image_max_width=8192, image_max_height=8192,
           image_pitch_align=16, **GPU),
    # Adreno 630: 1024-wide work-groups, fp16 ALUs, 16384-texel images, 64-texel row pitch alignment
    Target("qcom", max_workgroup=1024, half_compute=True, images=True, image_max_width=16384,
           image_max_height=16384, image_pitch_align=64, **GPU),
    # RDNA3 (gfx1100, RX 7900 XTX) through usbgpu/ + am/: buffers only (no image path without a
    # driver-side image descriptor), fp32 arithmetic, 1024-wide work-groups (HSA's maximum)
    Target("amd", max_workgroup=1024, code_object="gfx1100", cl_builtins="amdgcn",
           **GPU),
    # Hexagon 685 cDSP (v65): 128-byte integer HVX vectors, 32 of them; floats on the scalar
    # units (one 4-byte lane); 32 KiB L1d, 512 KiB L2. No Winograd: scalar FP multiplies cost
    # what adds do. Buffers on HVX's 128-byte vector alignment. The programs are one
    # position-independent Hexagon shared object run by the DSP-side runtime (dsp/).
    Target("dsp", renderer="c", vector_bytes=128, float_vector_bytes=4,
           registers=16, l2_bytes=512 << 10, buffer_align=128, cpu_layouts=True,
           pack_weights=True, shared_object=True, kernel_symbols=True,
           narrow_pad_divisor=1, hvx=True, l2fetch=True),
)}


def get_target(name: str | Target) -> Target:
    """A target by name; a Target passes through (tests vary limits with dataclasses.replace)."""
    if isinstance(name, Target):
        return name
    if name not in TARGETS:
        raise CompileError(f"unknown target {name!r}; expected one of {', '.join(TARGETS)}")
    return TARGETS[name]


# What the frontend and the schedule read: the variants of one blob share them (one graph, one
# schedule, one set of buffers), and differ only in how each kernel is planned and compiled.
SHARED_FIELDS = ("renderer", "buffer_align", "half_compute", "half_activations",
                 "images", "output_dims", "cpu_layouts", "winograd", "pack_weights",
                 "shared_object", "code_object")


def variant_targets(tgt: Target) -> list[Target]:
    """The targets a blob for `tgt` is built for: its variants, or itself. A variant is `tgt`
    with the fields its row differs in from `tgt`'s row, so a target varied with
    dataclasses.replace keeps its changes in every variant."""
    if not tgt.variants:
        return [tgt]
    base, out = TARGETS[tgt.name], []
    for name in tgt.variants:
        row = TARGETS[name]
        diff = {f.name: getattr(row, f.name) for f in fields(Target)
                if getattr(row, f.name) != getattr(base, f.name)}
        out.append(replace(tgt, **diff))
    bad = [f for f in SHARED_FIELDS if len({getattr(v, f) for v in out}) > 1]
    if bad:
        raise CompileError(f"target {tgt.name!r}: its variants {list(tgt.variants)} must agree "
                           f"on {bad}")
    return out
