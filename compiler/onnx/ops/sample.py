"""ONNX ops that sample an image at runtime coordinates: GridSample, RoiAlign, DeformConv, and
AffineGrid (which builds the grids GridSample reads).

Every sample point is a weighted sum of taps; each tap is one flat GATHER of all channels at
(batch, integer position). Interpolation (nearest, linear, cubic) and padding (zeros, border,
reflection) only decide the taps' positions and weights.
"""
from __future__ import annotations

import math
from itertools import product

import numpy as np

from compiler.ir.dtypes import dtypes
from compiler.onnx.ops.shape import arange_at
from compiler.onnx.registry import op
from compiler.ir.tensor import Tensor
from compiler.ir.uop import Ops


def gather_points(x: Tensor, batch: Tensor, idx: list[Tensor]) -> Tensor:
    """x: (B, C, *S); batch and idx[d]: int64 tensors broadcastable to P -> (*P, C)."""
    b, c, sp = x.shape[0], x.shape[1], x.shape[2:]
    flat, stride = batch * math.prod(sp), 1
    for d in range(len(sp) - 1, -1, -1):
        flat = flat + idx[d] * stride
        stride *= sp[d]
    data = x.reshape((b, c, math.prod(sp))).permute((0, 2, 1)).reshape((b * math.prod(sp), c))
    return data.gather(flat, 0)


def weighted_taps(x: Tensor, batch: Tensor, taps: list, combine: Ops = Ops.ADD) -> Tensor:
    """taps[d]: (index, weight) pairs along spatial dim d; every combination of one tap per dim
    contributes gather * product of weights, combined with `combine` -> (*P, C)."""
    out = None
    for combo in product(*taps):
        w = combo[0][1]
        for _, wd in combo[1:]:
            w = w * wd
        term = gather_points(x, batch, [i for i, _ in combo]) * w.cast(x.dtype).unsqueeze(-1)
        out = term if out is None else out + term if combine is Ops.ADD else out.maximum(term)
    return out


def _floor_int(v: Tensor) -> Tensor:
    return v.floor().cast(dtypes.int64)


def reflect(v: Tensor, lo: float, hi: float) -> Tensor:
    """Fold v into [lo, hi] by mirroring at the borders (any number of times)."""
    rng = hi - lo
    below, above = lo - v, v - hi
    out = v
    for d, outside, near, far in ((below, v < lo, lo, hi), (above, v > hi, hi, lo)):
        n = (d / rng).trunc()
        r = d - n * rng
        even = (n * 0.5).floor().eq(n * 0.5)
        toward = 1.0 if near == lo else -1.0
        out = outside.where(even.where(r * toward + near, far - r * toward), out)
    return out


def _cubic_coeffs(t: Tensor, alpha: float = -0.75) -> list[Tensor]:
    def k(d: Tensor) -> Tensor:
        d = d.abs()
        near = ((d * (alpha + 2) - (alpha + 3)) * d * d) + 1.0
        far = (((d * alpha - 5 * alpha) * d + 8 * alpha) * d) - 4 * alpha
        return (d <= 1.0).where(near, far)
    return [k(t + 1.0), k(t), k(1.0 - t), k(2.0 - t)]


def _fetch(i: Tensor, w: Tensor, n: int, padding: str, lo: float, hi: float):
    """A tap at integer position i on an axis of length n, under a padding mode."""
    if padding == "zeros":
        inside = (i >= 0) & (i < n)
        return i.maximum(0).minimum(n - 1), inside.where(w, Tensor.full(0.0, w.dtype))
    if padding == "border":
        return i.maximum(0).minimum(n - 1), w
    r = reflect(i.cast(w.dtype), lo, hi).trunc().cast(dtypes.int64)
    return r.maximum(0).minimum(n - 1), w


@op("GridSample")
def _grid_sample(ctx, i, a):
    x, grid = i
    nsp = x.ndim - 2
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(a.get("mode", "linear"),
                                                           a.get("mode", "linear"))
    padding, align = a.get("padding_mode", "zeros"), bool(a.get("align_corners", 0))
    out_sp = grid.shape[1:-1]
    batch = arange_at(x.shape[0], 0, 1 + len(out_sp))
    taps = []
    for d in range(nsp):
        n = x.shape[2 + d]
        g = grid.shrink([(0, s) for s in grid.shape[:-1]] + [(nsp - 1 - d, nsp - d)])
        g = g.reshape(grid.shape[:-1]).cast(dtypes.float32 if grid.dtype is dtypes.float16
                                            else grid.dtype)
        v = (g + 1.0) * ((n - 1) / 2.0) if align else ((g + 1.0) * n - 1.0) * 0.5
        lo, hi = (0.0, n - 1.0) if align else (-0.5, n - 0.5)
        if mode == "nearest":
            v = v.round_even()
        outside = (v < lo) | (v > hi)
        if padding == "border":
            v = outside.where(v.maximum(0.0).minimum(n - 1.0), v)
        elif padding == "reflection":
            v = reflect(v, lo, hi)
        if mode == "nearest":
            pos = [(v.trunc().cast(dtypes.int64), v.const_like(1.0))]
        else:
            base = v.floor()
            t = v - base
            base = base.cast(dtypes.int64)
            ws = [1.0 - t, t] if mode == "linear" else _cubic_coeffs(t)
            first = 0 if mode == "linear" else -1
            pos = [(base + (first + j), w) for j, w in enumerate(ws)]
        taps.append([_fetch(p, w, n, padding, lo, hi) for p, w in pos])
    y = weighted_taps(x, batch, taps).cast(x.dtype)  # (N, *out, C)
    return y.permute((0, y.ndim - 1) + tuple(range(1, y.ndim - 1)))


@op("AffineGrid")
def _affine_grid(ctx, i, a):
    """grid[n, *p, :] = theta[n] @ (x_p, y_p[, z_p], 1), base coordinates in [-1, 1]."""
    theta = i[0]
    size = [int(v) for v in ctx.static(i[1], "size")]
    sp = size[2:]
    align = bool(a.get("align_corners", 0))
    axes = []
    for n in reversed(sp):  # x (the last dim) first
        if align:
            axes.append(np.linspace(-1.0, 1.0, n) if n > 1 else np.zeros(1))
        else:
            axes.append((np.arange(n) * 2.0 + 1.0) / n - 1.0)
    mesh = np.meshgrid(*axes[::-1], indexing="ij")[::-1]  # per coordinate, shape sp
    base = np.stack([m.reshape(-1) for m in mesh] + [np.ones(math.prod(sp))], -1)
    base = Tensor.weight(base.astype(theta.dtype.np))  # (P, nsp + 1)
    grid = base.matmul(theta.transpose())  # (N, P, nsp)
    return grid.reshape((theta.shape[0],) + tuple(sp) + (len(sp),))


@op("RoiAlign")
def _roi_align(ctx, i, a):
    x, rois, bidx = i
    oh, ow = a.get("output_height", 1), a.get("output_width", 1)
    ratio, scale = a.get("sampling_ratio", 0), a.get("spatial_scale", 1.0)
    if ratio <= 0:
        raise ValueError("sampling_ratio 0 (adaptive) makes the sample count depend on ROI "
                         "values; keel needs a positive sampling_ratio")
    half = a.get("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    h, w = x.shape[2:]
    r = rois.shape[0]

    def col(j):
        return rois.shrink(((0, r), (j, j + 1))) * scale - (0.5 if half else 0.0)  # (R, 1)

    x0, y0, x1, y1 = col(0), col(1), col(2), col(3)
    rw, rh = x1 - x0, y1 - y0
    if not half:
        rw, rh = rw.maximum(1.0), rh.maximum(1.0)
    # sample points: (R, out, ratio) per axis, the offsets within a bin known at compile time
    def points(start, size, nout):
        frac = (np.arange(nout)[:, None] + (np.arange(ratio)[None, :] + 0.5) / ratio)
        return start.reshape((r, 1, 1)) + size.reshape((r, 1, 1)) / float(nout) * \
            Tensor.weight(frac.reshape(1, nout, ratio).astype(x.dtype.np))

    ys = points(y0, rh, oh).reshape((r, oh, 1, ratio, 1))
    xs = points(x0, rw, ow).reshape((r, 1, ow, 1, ratio))
    out_of = (ys < -1.0) | (ys > float(h)) | (xs < -1.0) | (xs > float(w))
    taps = [_roi_taps(ys, h), _roi_taps(xs, w)]
    zero = Tensor.full(0.0, x.dtype)
    taps[0] = [(ind, out_of.where(zero, wt)) for ind, wt in taps[0]]
    batch = bidx.cast(dtypes.int64).reshape((r, 1, 1, 1, 1))
    mode = Ops.MAX if a.get("mode", "avg") == "max" else Ops.ADD
    v = weighted_taps(x, batch, taps, mode)  # (R, oh, ow, ratio, ratio, C)
    v = v.reduce(mode, [3, 4], keepdims=False)
    if mode is Ops.ADD:
        v = v / float(ratio * ratio)
    return v.permute((0, 3, 1, 2))


def _roi_taps(v: Tensor, n: int):
    """RoiAlign's bilinear rule: clamp below at 0, collapse to the last row at the far edge."""
    v = v.maximum(0.0)
    low = v.trunc().cast(dtypes.int64)
    edge = low >= n - 1
    low = edge.where(Tensor.full(n - 1, dtypes.int64), low)
    high = edge.where(low, low + 1)
    v = edge.where(low.cast(v.dtype), v)
    frac = v - low.cast(v.dtype)
    return [(low, 1.0 - frac), (high, frac)]


@op("DeformConv")
def _deform_conv(ctx, i, a):
    """Bilinear samples of x at the kernel taps moved by `offset` (zeros outside), contracted
    with the weights like a grouped conv."""
    x, w, off = i[0], i[1], i[2]
    bias = i[3] if len(i) > 3 else None
    mask = i[4] if len(i) > 4 else None
    n, c = x.shape[:2]
    oc, cg, ks = w.shape[0], w.shape[1], tuple(w.shape[2:])
    nsp, groups, og = len(ks), a.get("group", 1), a.get("offset_group", 1)
    strides = a.get("strides", [1] * nsp)
    dil = a.get("dilations", [1] * nsp)
    pads = a.get("pads", [0] * 2 * nsp)
    osp = off.shape[2:]
    kk = math.prod(ks)
    off = off.reshape((n, og, kk, nsp) + osp)
    pts = (n, og, kk) + osp
    taps = []
    for d in range(nsp):
        kpos = np.stack(np.meshgrid(*[np.arange(k) * dl for k, dl in zip(ks, dil)],
                                    indexing="ij"), -1).reshape(kk, nsp)[:, d]
        opos = np.arange(osp[d]) * strides[d] - pads[d]
        base = kpos.reshape((kk,) + (1,) * nsp) + opos.reshape(
            [osp[d] if e == d else 1 for e in range(nsp)])
        o = off.shrink([(0, n), (0, og), (0, kk), (d, d + 1)] + [(0, s) for s in osp])
        v = o.reshape(pts) + Tensor.weight(base.astype(x.dtype.np)).reshape((1, 1) + base.shape)
        lo = v.floor()
        t = v - lo
        lo = lo.cast(dtypes.int64)
        size = x.shape[2 + d]
        taps.append([_fetch(lo + j, wt, size, "zeros", 0.0, size - 1.0)
                     for j, wt in ((0, 1.0 - t), (1, t))])
    xg = x.reshape((n * og, c // og) + x.shape[2:])
    batch = arange_at(n * og, 0, 1).reshape((n, og) + (1,) * (nsp + 1))
    s = weighted_taps(xg, batch, taps)  # (n, og, kk, *osp, c/og)
    s = s.permute((0, 1, nsp + 3, 2) + tuple(range(3, 3 + nsp))).reshape((n, c, kk) + osp)
    if mask is not None:
        m = mask.reshape((n, og, 1, kk) + osp).expand((n, og, c // og, kk) + osp)
        s = s * m.reshape((n, c, kk) + osp)
    # grouped contraction: (n, g, 1, cg, kk, *osp) x (1, g, ocg, cg, kk, 1..) summed over cg, kk
    s = s.reshape((n, groups, 1, cg, kk) + osp)
    wv = w.reshape((1, groups, oc // groups, cg, kk) + (1,) * nsp)
    y = (s * wv).sum([3, 4], keepdims=False).reshape((n, oc) + osp)
    return y + bias.reshape((1, oc) + (1,) * nsp) if bias is not None else y

