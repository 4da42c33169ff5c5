"""How a target stores each buffer: element type (half storage) and layout (2D images).

Both are decided once per buffer, when schedule/buffers.py creates it and before any kernel is
lowered, so every kernel touching a buffer agrees on them. How kernels compute on half values is
codegen/half.py's job.

float16 (`compile_model(..., float16=True)`): every float32 weight is stored as half (converted at
compile time); on targets with `half_activations` every float32 intermediate too. Graph inputs
and outputs keep the dtype the ONNX model declares.

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
from compiler.target import Target
from runner.format import DEVICE_REGIONS  # io buffers keep the layout and dtype the caller sees

F16, F32 = dtypes.float16, dtypes.float32

# (region, dtype, shape) -> (storage dtype, image layout or None)
StoragePolicy = Callable[[str, DType, tuple], tuple[DType, "Image | None"]]


def device_storage(target: Target, float16: bool = False,
                   images: bool | None = None) -> StoragePolicy:
    """The storage policy for buffers on `target`. images=None follows the target's default."""
    use_images = target.images if images is None else images

    def policy(region: str, dtype: DType, shape: tuple) -> tuple[DType, Image | None]:
        if region not in DEVICE_REGIONS:
            return dtype, None
        if float16 and dtype is F32 and (region == "weights" or target.half_activations):
            dtype = F16
        return dtype, image_layout(target, dtype, shape) if use_images else None
    return policy


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


def storage_bytes(data: np.ndarray, b: Buffer) -> memoryview:
    """A weight's bytes as the device stores them: converted to the storage dtype, rows pitched.
    A view, not a copy: a model's weights are copied once, into the blob's weights region."""
    data = np.ascontiguousarray(data, dtype=b.dtype)
    if b.image is not None:
        rows = np.zeros((b.image.height, b.image.pitch * 4), data.dtype)
        rows[:, :b.image.width * 4] = data.reshape(b.image.height, b.image.width * 4)
        data = rows
    return memoryview(data).cast("B")

