"""How a target stores each buffer: element type (half storage) and layout (2D images).

Both are decided once per buffer, when schedule/place.py places it and before any kernel is
lowered, so every kernel touching a buffer agrees on them. How kernels compute on half values is
codegen/half.py's job.

float16 (`compile_model(..., float16=True)`): every float32 weight is stored as half (converted at
compile time); on targets with `half_activations` every float32 intermediate too. Graph inputs
and outputs keep the dtype the ONNX model declares.

Images: a float buffer in the arena or the weights whose innermost dim is a multiple of 4 is read
through `read_imagef` as 2D RGBA (see compiler.artifact.Image), when the target has images on (or
the compile option asks for them) and the image fits the target's width/height limits.

Input images (`image_inputs`, {input name: {element count: (width, height)}}): a uint8 graph
input of that many elements is read as an R8 unsigned-int image of its first width * height
bytes, rows `width` bytes apart, bound from the caller's own buffer (no copy, no padding: the
width must already meet the target's pitch alignment). A read past the image's rows returns 0
(clamp to border), so name only inputs whose reads stay within it: openpilot's NV12 camera
frame, whose planes the warp's gather reads at clipped coordinates (models/modeld_step.py
frame_images; docs/modeld.md says why it pays).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from compiler.artifact import Buffer, Image
from compiler.errors import CompileError
from compiler.ir.dtypes import DType, dtypes
from compiler.ir.uop import Ops, UOp
from compiler.target import Target
from runner.format import DEVICE_REGIONS, Region  # io buffers keep the layout and dtype the caller sees

F16, F32 = dtypes.float16, dtypes.float32
F16_MAX = float(np.finfo(np.float16).max)

# (region, dtype, shape, the tensor stored, its graph name) -> (storage dtype, image or None)
StoragePolicy = Callable[..., tuple[DType, "Image | None"]]


def device_storage(target: Target, float16: bool = False, images: bool | None = None,
                   keep_fp32: frozenset = frozenset(),
                   image_inputs: dict | None = None) -> StoragePolicy:
    """The storage policy for buffers on `target`. images=None follows the target's default.
    keep_fp32: tensors stored fp32 under float16 (codegen/ranges.py: beyond half's safe range on
    the calibration samples); a weight beyond half's range always is. image_inputs: the module
    docstring."""
    use_images = target.images if images is None else images
    if image_inputs and not target.image_max_width:
        raise CompileError(f"image_inputs {sorted(image_inputs)}: target {target.name} has no "
                           f"images")

    def policy(region: Region, dtype: DType, shape: tuple, node: UOp | None = None,
               name: str = "") -> tuple[DType, Image | None]:
        if region is Region.INPUT and name in (image_inputs or {}):  # the graph's, unprefixed
            return dtype, io_image(target, name, dtype, shape, image_inputs[name])
        if region not in DEVICE_REGIONS:
            return dtype, None
        if float16 and dtype is F32 and (region is Region.WEIGHTS or target.half_activations) and \
                node not in keep_fp32 and not beyond_half(node):
            dtype = F16
        return dtype, image_layout(target, dtype, shape) if use_images else None
    return policy


def beyond_half(node: UOp | None) -> bool:
    """A weight with a value half cannot hold (it would be stored as inf)."""
    if node is None or node.op is not Ops.WEIGHT:
        return False
    data = node.arg.data
    return data.size > 0 and bool(np.nanmax(np.abs(data), initial=0.0) > F16_MAX)


def image_layout(target: Target, dtype: DType, shape: tuple) -> Image | None:
    if dtype not in (F16, F32) or not shape or math.prod(shape) == 0 or shape[-1] % 4:
        return None
    width, height = shape[-1] // 4, math.prod(shape[:-1])
    if width > target.image_max_width or height > target.image_max_height:
        return None
    align = max(target.image_pitch_align, 1)
    return Image(width, height, -(-width // align) * align)


def io_image(target: Target, name: str, dtype: DType, shape: tuple, sizes: dict) -> Image:
    """The R8 image a uint8 input of `shape` is read as: sizes[its element count] = (width,
    height), the image over its first width * height bytes. Adreno reads image rows at a pitch
    aligned to 64 texels (qcom/texture.py), and the rows are the caller's buffer as it is: a
    misaligned width is refused, not padded."""
    n = math.prod(shape)
    if dtype is not dtypes.uint8 or n not in sizes or sizes[n][0] * sizes[n][1] > n:
        raise CompileError(f"image input {name!r}: expected uint8 of one of the sizes {sizes} "
                           f"(element count: (width, height) within it), got {dtype.name} "
                           f"{tuple(shape)}")
    (width, height), align = sizes[n], max(target.image_pitch_align, 1)
    if width % align or width > target.image_max_width or height > target.image_max_height:
        raise CompileError(f"image input {name!r}: {width}x{height} texels; target "
                           f"{target.name} reads rows at a pitch that is a multiple of {align} "
                           f"texels, at most {target.image_max_width}x"
                           f"{target.image_max_height}")
    return Image(width, height, width, 1)


def storage_nbytes(dtype: DType, shape: tuple, image: Image | None) -> int:
    if image is not None and image.channels == 4:  # an R8 input image is the caller's buffer
        return image.height * image.pitch * 4 * dtype.itemsize
    return math.prod(shape) * dtype.itemsize


def storage_bytes(data: np.ndarray, b: Buffer) -> memoryview:
    """A weight's bytes as the device stores them: converted to the storage dtype, rows pitched.
    A view, not a copy: a model's weights are copied once, into the blob's weights region."""
    data = np.ascontiguousarray(data, dtype=b.dtype)
    if b.image is not None:
        rows = np.zeros((b.image.height, b.image.pitch * 4), data.dtype)
        rows[:, :b.image.width * 4] = data.reshape(b.image.height, b.image.width * 4)
        data = rows
    return memoryview(data).cast("B")

