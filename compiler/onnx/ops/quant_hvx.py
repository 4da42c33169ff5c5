"""The integer QDQ path's forms for targets with `hvx` (dsp; Target.hvx, Ctx.hvx): what
onnx/ops/quant.py builds there instead of its plain int32 forms (docs/dsp.md, "HVX int8
idioms")."""
from __future__ import annotations

import numpy as np

from compiler.ir.dtypes import dtypes
from compiler.ir.tensor import Tensor


def dot4_conv(ctx, q: Tensor, zp: int, wc: np.ndarray | None, bq: Tensor | None,
              a: dict) -> Tensor | None:
    """A 1x1 conv of uint8 activations by constant int8 weights, four input channels per
    multiply-add (Ops.DOT4): the activations' bytes are read as they are
    stored, the weights packed four to an int32 word, and the zero point's share,
    zp * sum(w), subtracted in the bias: sum((q - zp) * w) = sum(q * w) - zp * sum(w). The
    int32 accumulator is the same. None when the conv is not one."""
    if not ctx.hvx or wc is None or q.dtype is not dtypes.uint8 or q.ndim != 4 \
            or wc.ndim != 4 or wc.shape[2:] != (1, 1) or wc.shape[1] % 4 or wc.dtype != np.int8 \
            or a.get("group", 1) != 1 or any(s != 1 for s in a.get("strides", [1, 1])) \
            or any(a.get("pads", [0] * 4)) \
            or a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    bc = ctx.constant(bq) if bq is not None else np.zeros(wc.shape[0], np.int32)
    if bc is None:
        return None
    cout, c = wc.shape[:2]
    n, _, h, wd = q.shape
    # (cout, c/4): channel 4j + k in byte k of word j, the low byte first
    words = np.ascontiguousarray(wc.reshape(cout, c)).view(np.int32)
    bias = bc.reshape(-1).astype(np.int64) - zp * wc.reshape(cout, c).astype(np.int64).sum(1)
    if np.abs(bias).max(initial=0) >= 2 ** 31:
        return None
    j, full = c // 4, (n, cout, h, wd, c // 4)
    # a 1x1 window: the schedule stores the activations channels-last, as a conv's
    x4 = q.window((1, 1), (1, 1), (1, 1)).reshape((n, j, 4, h, wd))

    def byte(k: int) -> Tensor:
        b = x4.shrink(((0, n), (0, j), (k, k + 1), (0, h), (0, wd))).reshape((n, j, h, wd))
        return b.permute((0, 2, 3, 1)).reshape((n, 1, h, wd, j)).expand(full)
    w = Tensor.weight(words).reshape((1, cout, 1, 1, j)).expand(full)
    acc = Tensor.dot4([byte(k) for k in range(4)], w).sum([4], keepdims=False)
    return acc + Tensor.weight(bias.astype(np.int32).reshape(1, cout, 1, 1))


def clamped_quotient(ctx, x: Tensor, s: Tensor, lo, hi) -> Tensor:
    """x / s clamped to [lo, hi] (integers, |lo|, |hi| < 2**17: a quantization to 8 or 16 bits
    rounds it next). On HVX targets (whose float is the scalar unit, where a division is a
    dozen dependent packets) by one constant float32 s: x clamped once, to [lo, hi] * s (its
    quotient is then within an ulp of [lo, hi], which the rounding next takes to lo or hi; no
    infinity or overflow below), q = x * y with y the float32 nearest 1/s, then
    q + (x - q * s) * y, each multiply-add fused (the renderer's -ffp-contract=fast): the
    residual is exact, and the corrected quotient is x / s rounded to nearest (Markstein's
    theorem: y within half an ulp of 1/s, q within one ulp of x / s). |s| >= 2**-100 keeps
    the bounds' products normal floats. NaN stays NaN."""
    sc = ctx.constant(s) if ctx.hvx else None
    if sc is None or sc.size != 1 or not 2.0 ** -100 <= abs(float(sc.reshape(-1)[0])) < 2 ** 100:
        return (x / s).maximum(lo).minimum(hi)
    s0 = float(sc.reshape(-1)[0])
    xlo, xhi = (lo * s0, hi * s0) if s0 > 0 else (hi * s0, lo * s0)
    x = x.maximum(xlo).minimum(xhi)
    y = Tensor.full(float(np.float32(1 / np.float64(s0))), dtypes.float32)
    q = x * y
    return q + (x - q * s) * y
