"""ONNX Resize and Upsample: separable, one axis at a time.

Per resized axis the source taps are a compile-time table: for output position o, indices
idx[o, :] into the input axis and coefficients c[o, :] (computed in float64 exactly as the ONNX
reference does, antialias and exclude_outside included). The axis then is sum_j gather(idx[:, j])
* c[:, j]; nearest picks the one tap whose coefficient is 1.
"""
from __future__ import annotations

import math

import numpy as np

from compiler.ir.dtypes import dtypes
from compiler.errors import CompileError
from compiler.onnx.registry import op
from compiler.ir.tensor import Tensor


# ---- coefficients for a fractional position `ratio` in (0, 1] (1 means "on a sample") ----------
def _nearest(mode: str):
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if float(ratio).is_integer():
            return np.array([0.0, 1.0])
        left = {"round_prefer_floor": ratio <= 0.5, "round_prefer_ceil": ratio < 0.5,
                "floor": True, "ceil": False}
        if mode not in left:
            raise CompileError(f"Resize nearest_mode {mode!r} is not supported")
        return np.array([1.0, 0.0]) if left[mode] else np.array([0.0, 1.0])
    return coeffs


def _linear(antialias: bool):
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            return np.array([1 - ratio, ratio])
        scale = min(scale, 1.0)
        start = int(np.floor(-1 / scale) + 1)
        args = (np.arange(start, 2 - start) - ratio) * scale
        c = np.clip(1 - np.abs(args), 0, 1)
        return c / c.sum()
    return coeffs


def _keys(d: np.ndarray, A: float) -> np.ndarray:
    d = np.abs(d)
    return np.where(d <= 1, ((A + 2) * d - (A + 3)) * d * d + 1,
                    np.where(d < 2, ((A * d - 5 * A) * d + 8 * A) * d - 4 * A, 0.0))


def _cubic(antialias: bool, A: float):
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            return _keys(np.array([ratio + 1, ratio, 1 - ratio, 2 - ratio]), A)
        scale = min(scale, 1.0)
        start = int(np.floor(-2 / scale) + 1)
        c = _keys(scale * (np.arange(start, 2 - start) - ratio), A)
        return c / c.sum()
    return coeffs


def _source(ctm: str, out_n: int, in_n: int, scale: float, roi) -> tuple[np.ndarray, np.ndarray]:
    """Source coordinate of every output position, and where tf_crop_and_resize extrapolates."""
    y = np.arange(out_n, dtype=np.float64)
    width = scale * in_n  # the un-rounded output length
    none = np.zeros(out_n, bool)
    if ctm == "align_corners":
        return (np.zeros(out_n) if width == 1 else y * (in_n - 1) / (width - 1)), none
    if ctm == "asymmetric":
        return y / scale, none
    if ctm == "pytorch_half_pixel":
        return (np.full(out_n, -0.5) if width == 1 else (y + 0.5) / scale - 0.5), none
    if ctm == "half_pixel":
        return (y + 0.5) / scale - 0.5, none
    if ctm == "half_pixel_symmetric":
        offset = in_n / 2 * (1 - out_n / width)
        return offset + (y + 0.5) / scale - 0.5, none
    if ctm == "tf_crop_and_resize":
        lo, hi = roi
        x = np.full(out_n, (hi - lo) * (in_n - 1) / 2) if width == 1 else \
            y * (hi - lo) * (in_n - 1) / (width - 1)
        x = x + lo * (in_n - 1)
        return x, (x < 0) | (x > in_n - 1)
    raise CompileError(f"Resize coordinate_transformation_mode {ctm!r} is not supported")


def axis_taps(in_n: int, out_n: int, scale: float, ctm: str, roi, coeffs, exclude: bool):
    """-> (indices (out, n), coefficients (out, n), extrapolated (out,)), the ONNX reference's
    neighbour choice: the n samples nearest the source coordinate, edge-clamped."""
    x, extrap = _source(ctm, out_n, in_n, scale, roi)
    base = np.floor(x)
    ratios = np.where(x == base, 1.0, x - base)
    c = np.stack([coeffs(float(r), scale) for r in ratios])
    n = c.shape[1]
    pad = math.ceil(n / 2)
    p = np.floor(x + pad)
    frac = x + pad - p
    if n % 2 == 0:
        off = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        off = np.where(frac <= 0.5, -((n - 1) // 2), -((n - 1) // 2) + 1)
    idx = (p + off).astype(np.int64)[:, None] + np.arange(n)[None, :] - pad
    if exclude:
        c = np.where((idx < 0) | (idx >= in_n), 0.0, c)
        total = c.sum(-1, keepdims=True)
        c = c / np.where(total == 0, 1.0, total)
    return np.clip(idx, 0, in_n - 1), c, extrap


def _resize_axis(x: Tensor, ax: int, taps, nearest: bool, extrap_value: float) -> Tensor:
    idx, c, extrap = taps
    shape = [1] * x.ndim
    shape[ax] = idx.shape[0]
    if nearest:
        y = x.gather(Tensor.weight(idx[np.arange(idx.shape[0]), c.argmax(1)]), ax)
    else:
        y = None
        for j in range(idx.shape[1]):
            if not c[:, j].any():
                continue
            w = Tensor.weight(c[:, j].astype(x.dtype.np).reshape(shape))
            term = x.gather(Tensor.weight(idx[:, j]), ax) * w
            y = term if y is None else y + term
    if extrap.any():
        y = Tensor.weight(extrap.reshape(shape)).where(Tensor.full(extrap_value, y.dtype), y)
    return y


@op("Resize", "Upsample")
def _resize(ctx, i, a):
    x = i[0]
    legacy = ctx.node.op_type == "Upsample" or ctx.opset < 11
    scales = sizes = roi = None
    if legacy:
        scales = a["scales"] if "scales" in a else ctx.static(i[1], "scales")
    else:
        given = lambda k: len(i) > k and i[k] is not None and i[k].uop.size  # noqa: E731
        roi = ctx.static(i[1], "roi").astype(np.float64) if given(1) else None
        scales = ctx.static(i[2], "scales") if given(2) else None
        sizes = ctx.static(i[3], "sizes") if given(3) else None
    r = x.ndim
    axes = [d % r for d in a.get("axes", range(r))]
    if roi is not None and len(roi) == 2 * len(axes) and len(axes) != r:
        full = [0.0] * r + [1.0] * r
        for j, d in enumerate(axes):
            full[d], full[r + d] = roi[j], roi[len(axes) + j]
        roi = np.array(full)
    out, scale = list(x.shape), [1.0] * r
    if sizes is not None:
        for j, d in enumerate(axes):
            out[d], scale[d] = int(sizes[j]), int(sizes[j]) / x.shape[d]
        policy = a.get("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            s = (min if policy == "not_larger" else max)(scale[d] for d in axes)
            for d in axes:
                scale[d], out[d] = s, int(s * x.shape[d] + 0.5)
    else:
        scales = [float(v) for v in scales]
        if len(scales) != r:
            scales = [scales[axes.index(d)] if d in axes else 1.0 for d in range(r)]
        for d in range(r):
            scale[d], out[d] = scales[d], int(scales[d] * x.shape[d])
    mode = a.get("mode", "nearest")
    ctm = "asymmetric" if legacy else a.get("coordinate_transformation_mode", "half_pixel")
    nearest_mode = "floor" if ctx.node.op_type == "Upsample" else \
        a.get("nearest_mode", "round_prefer_floor")
    antialias = bool(a.get("antialias", 0))
    coeffs = {"nearest": lambda: _nearest(nearest_mode), "linear": lambda: _linear(antialias),
              "cubic": lambda: _cubic(antialias, a.get("cubic_coeff_a", -0.75))}
    if mode not in coeffs:
        raise CompileError(f"{ctx.where()}: Resize mode {mode!r} is not supported")
    fn = coeffs[mode]()
    dt = x.dtype
    if mode != "nearest":  # interpolate in float: ints and float16 in float32
        x = x.cast(dtypes.float64 if dt is dtypes.float64 else dtypes.float32)
    for d in range(r):
        lohi = (roi[d], roi[r + d]) if roi is not None and roi.size == 2 * r else (0.0, 1.0)
        if math.isclose(scale[d], 1.0) and out[d] == x.shape[d] and \
                (ctm != "tf_crop_and_resize" or lohi == (0.0, 1.0)):
            continue
        taps = axis_taps(x.shape[d], out[d], scale[d], ctm, lohi, fn,
                         bool(a.get("exclude_outside", 0)))
        x = _resize_axis(x, d, taps, mode == "nearest", a.get("extrapolation_value", 0.0))
    if x.dtype != dt and dt.is_int:
        return x.maximum(float(dt.min)).minimum(float(dt.max)).cast(dt)
    return x.cast(dt)
