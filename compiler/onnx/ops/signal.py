"""ONNX signal ops: DFT, STFT, MelWeightMatrix.

A DFT of static length is a matmul with compile-time cos/sin tables (computed in float64), so it
runs as well as any matmul; complex values are (..., 2) pairs as ONNX lays them out.
"""
from __future__ import annotations

import numpy as np

from compiler.onnx.registry import onnx_dtype, op
from compiler.ir.tensor import Tensor


def _part(x: Tensor, j: int) -> Tensor:
    """Real (0) or imaginary (1) part of a (..., 1|2) tensor, without the trailing axis."""
    if j >= x.shape[-1]:
        return Tensor.full(0.0, x.dtype, x.shape[:-1])
    return x.shrink([(0, s) for s in x.shape[:-1]] + [(j, j + 1)]).reshape(x.shape[:-1])


def dft(x: Tensor, axis: int, length: int, inverse: bool, onesided: bool) -> Tensor:
    """x: (..., 1|2) with the transformed axis at `axis` -> (..., K, 1|2)."""
    axis %= x.ndim - 1
    n_in = x.shape[axis]
    if inverse and onesided:  # irfft: bins 0..L/2 in, L real samples out
        used, k_out = min(n_in, length // 2 + 1), length
    else:
        used, k_out = min(n_in, length), (length // 2 + 1 if onesided else length)
    n = np.arange(used)[:, None]  # rows: input index, cols: output index
    k = np.arange(k_out)[None, :]
    theta = 2 * np.pi * ((n * k) % length) / length
    cos, sin = np.cos(theta), np.sin(theta)
    if inverse and onesided:
        weight = np.where((n == 0) | (2 * n == length), 1.0, 2.0) / length
        cos, sin = cos * weight, sin * weight
    elif inverse:
        cos, sin = cos / length, sin / length
    order = [d for d in range(x.ndim - 1) if d != axis] + [axis]
    xs = x.shrink([(0, used) if d == axis else (0, s) for d, s in enumerate(x.shape)])
    re, im = (_part(xs, j).permute(order) for j in (0, 1))
    c, s = (Tensor.weight(t.astype(x.dtype.np)) for t in (cos, sin))
    sign = 1.0 if inverse else -1.0  # e^{-i theta} forward, e^{+i theta} inverse
    out_re = re.matmul(c) - (im.matmul(s) * sign)
    parts = [out_re] if inverse and onesided else [out_re, re.matmul(s) * sign + im.matmul(c)]
    back = list(np.argsort(order))
    return Tensor.cat([p.permute(back).unsqueeze(-1) for p in parts], -1)


@op("DFT")
def _dft(ctx, i, a):
    x = i[0]
    length = int(ctx.static(i[1], "dft_length").reshape(-1)[0]) \
        if len(i) > 1 and i[1] is not None else None
    if ctx.opset >= 20:
        axis = int(ctx.static(i[2], "axis").reshape(-1)[0]) if len(i) > 2 and i[2] is not None \
            else -2
    else:
        axis = a.get("axis", 1)
    axis %= x.ndim
    inverse, onesided = bool(a.get("inverse", 0)), bool(a.get("onesided", 0))
    if length is None:
        length = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    return dft(x, axis, length, inverse, onesided)


@op("STFT")
def _stft(ctx, i, a):
    x = i[0]  # (batch, length, 1|2)
    step = int(ctx.static(i[1], "frame_step").reshape(-1)[0])
    window = i[2] if len(i) > 2 and i[2] is not None else None
    if len(i) > 3 and i[3] is not None:
        frame = int(ctx.static(i[3], "frame_length").reshape(-1)[0])
    else:
        frame = window.shape[0] if window is not None else x.shape[-2]
    frames = x.permute((0, 2, 1)).window((frame,), (step,), (1,))  # (batch, c, n, frame)
    frames = frames.permute((0, 2, 3, 1))  # (batch, n, frame, c)
    if window is not None:
        frames = frames * window.reshape((1, 1, frame, 1))
    return dft(frames, 2, frame, False, bool(a.get("onesided", 1)))


@op("MelWeightMatrix")
def _mel(ctx, i, a):
    """All inputs are scalars known at compile time: the matrix is a constant (ONNX reference)."""
    bins, length, rate, lo, hi = (ctx.static(t, n).reshape(-1)[0] for t, n in zip(
        i, ("num_mel_bins", "dft_length", "sample_rate", "lower_edge_hertz", "upper_edge_hertz")))
    bins, length, rate = int(bins), int(length), int(rate)
    mel = lambda hz: 2595 * np.log1p(hz / 700) / np.log(10)  # noqa: E731
    edges = np.arange(bins + 2) * (mel(hi) - mel(lo)) / (bins + 2) + mel(lo)
    edges = (((length + 1) * 700 * np.expm1(edges / 2595 * np.log(10))) // rate).astype(int)
    out = np.zeros((length // 2 + 1, bins))
    for m in range(bins):
        left, center, right = edges[m:m + 3]
        if center == left:
            out[center, m] = 1
        else:
            out[left:center + 1, m] = (np.arange(left, center + 1) - left) / (center - left)
        if right > center:
            out[center:right, m] = (right - np.arange(center, right)) / (right - center)
    dt = onnx_dtype(a.get("output_datatype", 1), ctx.where())
    return Tensor.weight(out.astype(dt.np))
