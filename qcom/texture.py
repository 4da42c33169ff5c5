"""a6xx texture descriptors (16 dwords) and samplers (4 dwords) for the image-layout buffers the
compiler chooses: RGBA, fp16 or fp32 texels, or R8 unsigned-int texels (a camera frame the warp
samples, read_imageui), linear rows `pitch` texels apart (a multiple of 64), read with
unnormalized coordinates, nearest filtering and clamp-to-border (border colour 0, which is what
OpenCL's CLK_ADDRESS_CLAMP returns outside an image).

Field positions come from Mesa's a6xx.xml (freedreno/envytools@d88cafa, domains A6XX_TEX_CONST and
A6XX_TEX_SAMP; formats from enum a6xx_format). `decode` is what the mock GPU reads back: the image
a kernel samples is whatever the descriptor it was given says, nothing else.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

DESCRIPTOR_DWORDS, SAMPLER_DWORDS = 16, 4
PITCH_TEXELS = 64  # the compiler's image pitch alignment (docs/blob.md)

FMT6_8_UINT, FMT6_16_16_16_16_FLOAT, FMT6_32_32_32_32_FLOAT = 0x05, 0x62, 0x82
FORMATS = {np.dtype("float16"): FMT6_16_16_16_16_FLOAT, np.dtype("float32"): FMT6_32_32_32_32_FLOAT,
           np.dtype("uint8"): FMT6_8_UINT}
DTYPES = {v: k for k, v in FORMATS.items()}
TEX_X, TEX_Y, TEX_Z, TEX_W, TEX_ZERO, TEX_ONE = 0, 1, 2, 3, 4, 5  # a6xx_tex_swiz
# (channels, SWIZ_X..W) per format: one channel reads (r, 0, 0, 1), as OpenCL's CL_R does
RGBA = (4, (TEX_X, TEX_Y, TEX_Z, TEX_W))
LAYOUTS = {FMT6_8_UINT: (1, (TEX_X, TEX_ZERO, TEX_ZERO, TEX_ONE)),
           FMT6_16_16_16_16_FLOAT: RGBA, FMT6_32_32_32_32_FLOAT: RGBA}
TEX_2D = 1  # a6xx_tex_type
TEX_NEAREST, TEX_CLAMP_TO_BORDER = 0, 3  # a6xx_tex_filter, a6xx_tex_clamp
MAX_EXTENT = 1 << 15  # WIDTH and HEIGHT are 15-bit fields
BASE_ALIGN = 64  # bytes: BASE_LO holds address bits 5..31; the compiler aligns images to 64


class Texture(NamedTuple):
    gpuaddr: int
    width: int  # texels
    height: int
    pitch: int  # texels between row starts
    dtype: np.dtype


def texel_bytes(fmt: int) -> int:
    return LAYOUTS[fmt][0] * DTYPES[fmt].itemsize


def nbytes(t: Texture) -> int:
    """The bytes an image spans from its base: every row but the last at its pitch."""
    return ((t.height - 1) * t.pitch + t.width) * texel_bytes(FORMATS[np.dtype(t.dtype)])


def descriptor(t: Texture) -> list[int]:
    """TEX_CONST dwords 0..15 for a linear 2-D image (RGBA float, or R8 uint)."""
    fmt = FORMATS[np.dtype(t.dtype)]
    if not (0 < t.width < MAX_EXTENT and 0 < t.height < MAX_EXTENT):
        raise ValueError(f"image {t.width}x{t.height}: width and height must be "
                         f"1..{MAX_EXTENT - 1}")
    if t.pitch % PITCH_TEXELS or t.pitch < t.width:
        raise ValueError(f"image pitch {t.pitch} texels: expected a multiple of {PITCH_TEXELS} "
                         f"of at least the width {t.width}")
    if t.gpuaddr % BASE_ALIGN:
        raise ValueError(f"image base {t.gpuaddr:#x} is not {BASE_ALIGN}-byte aligned")
    x, y, z, w = LAYOUTS[fmt][1]
    words = [0] * DESCRIPTOR_DWORDS
    words[0] = x << 4 | y << 7 | z << 10 | w << 13 | fmt << 22  # TILE_MODE linear, SWAP WZYX: 0
    words[1] = t.width | t.height << 15
    words[2] = (t.pitch * texel_bytes(fmt)) << 7 | TEX_2D << 29  # PITCH is in bytes
    words[5] = 1 << 17  # DEPTH 1
    set_base(words, 0, t.gpuaddr)
    return words


def set_base(words, at: int, gpuaddr: int) -> None:
    """BASE_LO (bits 5..31 of the address) and BASE_HI (17 bits) of the descriptor at words[at]:
    a bound io image is re-pointed in place, DEPTH untouched."""
    words[at + 4] = gpuaddr & 0xFFFFFFE0
    words[at + 5] = int(words[at + 5]) & ~0x1FFFF | (gpuaddr >> 32) & 0x1FFFF


def decode(words) -> Texture:
    """The image a descriptor names; ValueError for anything `descriptor` would not write."""
    w = [int(x) for x in words]
    fmt = (w[0] >> 22) & 0xFF
    swiz = tuple((w[0] >> s) & 7 for s in (4, 7, 10, 13))
    if fmt not in DTYPES or (w[2] >> 29) & 3 != TEX_2D or w[0] & 3 or \
            swiz != LAYOUTS[fmt][1]:
        raise ValueError(f"texture descriptor format {fmt:#x}, type {(w[2] >> 29) & 3}, tile "
                         f"mode {w[0] & 3}, swizzle {swiz}: expected a linear 2-D RGBA "
                         f"fp16/fp32 or R8 uint image")
    dtype = DTYPES[fmt]
    pitch_bytes = (w[2] >> 7) & 0x3FFFFF
    texel = texel_bytes(fmt)
    if pitch_bytes % texel:
        raise ValueError(f"texture pitch {pitch_bytes} bytes is not whole {texel}-byte texels")
    return Texture(w[4] & 0xFFFFFFE0 | (w[5] & 0x1FFFF) << 32, w[1] & 0x7FFF, (w[1] >> 15) & 0x7FFF,
                   pitch_bytes // texel, dtype)


def sampler() -> list[int]:
    """TEX_SAMP dwords 0..3: nearest, clamp-to-border on every axis, unnormalized coordinates."""
    wrap = TEX_CLAMP_TO_BORDER
    return [TEX_NEAREST << 1 | TEX_NEAREST << 3 | wrap << 5 | wrap << 8 | wrap << 11,
            1 << 5, 0, 0]  # UNNORM_COORDS; BCOLOR_OFFSET 0: the border entry at the base


def check_sampler(words) -> None:
    """The mock executes OpenCL's CLK_ADDRESS_CLAMP (zero outside); refuse any other sampler."""
    if [int(x) for x in words] != sampler():
        raise ValueError(f"sampler {[hex(int(x)) for x in words]}: expected nearest, "
                         f"clamp-to-border, unnormalized coordinates {[hex(x) for x in sampler()]}")
