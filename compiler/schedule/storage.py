"""How a target stores each buffer: element type (half storage) and layout (2D images).

Both are decided once per buffer, when compile.py creates it and before any kernel is lowered, so
every kernel touching a buffer agrees on them. Kernels are lowered against the storage dtype (the
PARAM dtype); `storage_casts` then makes every LOAD/STORE carry that dtype with explicit casts to
and from the compute type, so a renderer never has to guess.

float16 (`compile_model(..., float16=True)` on an OpenCL target):
  * storage: every float32 intermediate and weight is stored as half (weights converted at compile
    time). Graph inputs and outputs keep the dtype the ONNX model declares.
  * compute: on targets with `half_compute` (Adreno) elementwise arithmetic runs in half
    (`demote_half`); reductions still accumulate in fp32: a conv or matmul sums hundreds to
    thousands of products, and an fp16 accumulator (11-bit mantissa) loses the small addends once
    the sum grows (relative error grows ~ sqrt(n) * 2^-11, and n * 2^-11 in the worst case).
    Transcendentals, division and sqrt also stay fp32, so their polynomial lowering has the same
    numerics on every target. Without `half_compute` everything computes in fp32 and only the
    loads/stores convert (vload_half/vstore_half are core OpenCL, no cl_khr_fp16 needed).

Images: a float buffer in the arena or the weights whose innermost dim is a multiple of 4 is read
through `read_imagef` as 2D RGBA (see compiler.artifact.Image), when the target has images on (or
the compile option asks for them) and the image fits the target's width/height limits.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from compiler.artifact import Buffer, Image
from compiler.ir.dtypes import DType, dtypes
from compiler.ir.rewrite import PatternMatcher, UPat
from compiler.target import Target
from compiler.codegen.transcendental import promote_half, promote_half_reduce
from compiler.ir.uop import Ops, UOp

F16, F32 = dtypes.float16, dtypes.float32
DEVICE_REGIONS = ("arena", "weights")  # io buffers keep the layout and dtype the caller sees

# (region, dtype, shape) -> (storage dtype, image layout or None)
StoragePolicy = Callable[[str, DType, tuple], tuple[DType, "Image | None"]]


def device_storage(target: Target, float16: bool = False,
                   images: bool | None = None) -> StoragePolicy | None:
    """The storage policy for buffers on `target`; None keeps every buffer as the graph has it.
    images=None follows the target's default."""
    if target.renderer == "c":
        # CPU: fp16 weights only (half the blob and the weight bandwidth, widened in registers);
        # activations stay fp32, where the C compiler's vector code is fastest
        return _cpu_weights_half if float16 else None
    use_images = target.images if images is None else images

    def policy(region: str, dtype: DType, shape: tuple) -> tuple[DType, Image | None]:
        if region not in DEVICE_REGIONS:
            return dtype, None
        if float16 and dtype is F32:
            dtype = F16
        return dtype, image_layout(target, dtype, shape) if use_images else None
    return policy


def _cpu_weights_half(region: str, dtype: DType, shape: tuple) -> tuple[DType, None]:
    return (F16 if region == "weights" and dtype is F32 else dtype), None


def image_layout(target: Target, dtype: DType, shape: tuple) -> Image | None:
    if dtype not in (F16, F32) or not shape or math.prod(shape) == 0 or shape[-1] % 4:
        return None
    width, height = shape[-1] // 4, math.prod(shape[:-1])
    if width > target.image_max_width or height > target.image_max_height:
        return None
    align = max(target.image_pitch_align, 1)
    return Image(width, height, -(-width // align) * align)


def storage_nbytes(dtype: DType, shape: tuple, image: Image | None) -> int:
    if image is not None:
        return image.height * image.pitch * 4 * dtype.itemsize
    return math.prod(shape) * dtype.itemsize


def storage_bytes(data: np.ndarray, b: Buffer) -> bytes:
    """A weight's bytes as the device stores them: converted to the storage dtype, rows pitched."""
    data = np.ascontiguousarray(data, dtype=b.dtype)
    if b.image is not None:
        rows = np.zeros((b.image.height, b.image.pitch * 4), data.dtype)
        rows[:, :b.image.width * 4] = data.reshape(b.image.height, b.image.width * 4)
        data = rows
    return data.tobytes()


# ---- kernel level ---------------------------------------------------------------------------
def _load_as_stored(ld: UOp) -> UOp | None:
    stored = ld.src[0].dtype
    if stored == ld.dtype:
        return None
    return UOp(Ops.LOAD, stored, ld.src).cast(ld.dtype)


def _store_as_stored(st: UOp) -> UOp | None:
    param, idx, value = st.src
    if value.dtype == param.dtype:
        return None
    return UOp(Ops.STORE, st.dtype, (param, idx, value.cast(param.dtype)))


storage_casts = PatternMatcher([
    (UPat(Ops.LOAD, name="ld"), _load_as_stored),
    (UPat(Ops.STORE, name="st"), _store_as_stored),
])

# arithmetic that is as good in half as the fp16 operands it reads (no growth of error with n)
DEMOTE = {Ops.ADD, Ops.SUB, Ops.MUL, Ops.NEG, Ops.MAX, Ops.MIN, Ops.WHERE,
          Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE}
# stays fp32 even on fp16 inputs: same polynomials everywhere, and division/sqrt accuracy
PROMOTE = {Ops.EXP2, Ops.EXP, Ops.LOG2, Ops.SIN, Ops.POW, Ops.SQRT, Ops.FDIV, Ops.RECIP, Ops.TRUNC}


def _as_half(u: UOp, exact: bool) -> UOp | None:
    """u (fp32) as an fp16 node: a value read from half, or a constant rounded to half (only when
    that is exact, if `exact`: a comparison threshold must not move). None if neither."""
    if u.op is Ops.CAST and u.src[0].dtype is F16:
        return u.src[0]
    if u.op is Ops.CONST:
        h = np.float16(u.arg)
        if float(h) == u.arg or np.isnan(u.arg) or (not exact and np.isfinite(h)):
            return UOp.const(float(h), F16)  # overflow to inf is never accepted
    return None


def _demote(x: UOp) -> UOp | None:
    floats = [i for i, s in enumerate(x.src) if s.dtype is F32]
    if not floats or not any(x.src[i].op is Ops.CAST for i in floats):
        return None
    src = list(x.src)
    for i in floats:
        h = _as_half(src[i], exact=x.dtype is dtypes.bool)
        if h is None:
            return None
        src[i] = h
    out = UOp(x.op, F16 if x.dtype is F32 else x.dtype, tuple(src), x.arg)
    return out.cast(F32) if x.dtype is F32 else out


demote_half = PatternMatcher([
    (UPat(DEMOTE, dtype=(F32, dtypes.bool), name="x"), _demote),
    # f16 -> f32 -> f16 is exact
    (UPat(Ops.CAST, dtype=F16, src=(UPat(Ops.CAST, dtype=F32, src=(UPat.var("h", F16),)),)),
     lambda h: h),
])

# with half compute, half values stay half except where PROMOTE says fp32; reductions accumulate
# in fp32
promote_for_half_compute = PatternMatcher([
    (UPat(PROMOTE, name="x"), promote_half),
    (UPat(Ops.REDUCE, name="x"), promote_half_reduce),
])
