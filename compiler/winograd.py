"""Winograd's F(2x2, 3x3) convolution (Lavin and Gray, 2015) for CPU targets: a 3x3 stride-1
conv as 16 matmuls over 4x4 input tiles, with 2.25x fewer multiplies than the direct conv.

    V[t, p, c] = sum_i BB[t, i] d[p, c, i]    input transform: 4x4 tiles d at stride 2
    M[t, p, k] = sum_c V[t, p, c] U[t, k, c]  16 independent matmuls, one kernel
    Y[p, k, o] = sum_t AA[o, t] M[t, p, k]    output transform: each tile's 2x2 outputs

where t indexes the 16 points of the transformed tile, p the tiles and o a tile's outputs.
U = G w G^T is computed at compile time, in float64. All three are plain reductions, so they
take the optimizer's usual plans, and the output transform takes the conv's epilogue (bias,
activation, residual). The transforms' matrices hold only 0, +-1 and +-1/2 (G, folded into
U), so rounding stays close to a direct conv's: each output is still a sum of products of the
same inputs and weights, regrouped; its error against float64 is within 2x onnxruntime's own
(docs/perf.md).
"""
from __future__ import annotations

import numpy as np

from compiler.ir.tensor import Tensor

BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64)
G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]], np.float64)
AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float64)
BB = np.einsum("xi,yj->xyij", BT, BT).reshape(16, 16).astype(np.float32)  # [t, tap]
AA = np.einsum("ax,by->abxy", AT, AT).reshape(2, 2, 16).astype(np.float32)  # [a, b, t]
# Fewer tiles and the matmuls lose: their weight is 16/9 the conv's and each element is used
# once per tile (docs/perf.md).
MIN_TILES = 32
MIN_CHANNELS = 32  # narrower convs are cheap either way, and their matmuls fill few vectors


def eligible(x_shape, w_shape, strides, dilations, pads, groups: int) -> bool:
    if len(w_shape) != 4 or tuple(w_shape[2:]) != (3, 3) or groups != 1:
        return False
    if tuple(strides) != (1, 1) or tuple(dilations) != (1, 1):
        return False
    _, _, ty, tx = _tiles(x_shape, pads)
    return min(w_shape[0], w_shape[1]) >= MIN_CHANNELS and x_shape[0] * ty * tx >= MIN_TILES


def _tiles(x_shape, pads) -> tuple[int, int, int, int]:
    """The output's height and width, and how many 2x2 tiles cover each."""
    (top, bottom), (left, right) = pads
    oh, ow = x_shape[2] + top + bottom - 2, x_shape[3] + left + right - 2
    return oh, ow, -(-oh // 2), -(-ow // 2)


def _weights(w: np.ndarray) -> Tensor:
    """U[t, k, c] = (G w G^T)[k, c] for a (K, C, 3, 3) weight, as a (16, K, C) constant."""
    u = np.einsum("xa,yb,kcab->xykc", G, G, w.astype(np.float64))
    return Tensor.weight(u.reshape(16, *w.shape[:2]).astype(np.float32))


def conv(x: Tensor, w: np.ndarray, pads) -> Tensor:
    """x: (N, C, H, W); w: the (K, C, 3, 3) weight's value; pads: ((top, bottom), (left, right))."""
    n, c, h, wd = x.shape
    k, u = w.shape[0], _weights(w)
    (top, _), (left, _) = pads
    oh, ow, ty, tx = _tiles(x.shape, pads)
    p = n * ty * tx
    x = x.pad(((0, 0), (0, 0), (top, 2 * ty + 2 - h - top), (left, 2 * tx + 2 - wd - left)))
    d = x.window((4, 4), (2, 2), (1, 1)).permute((0, 2, 3, 1, 4, 5)).reshape((1, p, c, 16))
    v = (d * Tensor.weight(BB.reshape(16, 1, 1, 16))).sum([3], keepdims=False)  # (16, P, C)
    m = v.matmul(u.transpose())  # (16, P, K)
    m = m.reshape((4, 4, n, ty, tx, k)).permute((2, 5, 3, 4, 0, 1)).reshape((n, k, ty, 1, tx, 1, 16))
    y = (m * Tensor.weight(AA.reshape(2, 1, 2, 16))).sum([6], keepdims=False)
    y = y.reshape((n, k, 2 * ty, 2 * tx))
    return y.shrink(((0, n), (0, k), (0, oh), (0, ow))) if (2 * ty, 2 * tx) != (oh, ow) else y
