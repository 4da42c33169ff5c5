"""ONNX LinearAttention: the recurrence unrolled over the static sequence length.

(Attention, RotaryEmbedding, CausalConvWithState and friends come from their ONNX function
bodies; LinearAttention's body is a Scan, which keel does not build, so it is written here.)
"""
from __future__ import annotations

from compiler.ir.dtypes import dtypes
from compiler.onnx.registry import op
from compiler.ir.tensor import Tensor


def _heads(x: Tensor, heads: int) -> Tensor:
    """(B, T, H*D) -> (B, H, T, D) in float32."""
    b, t, hd = x.shape
    return x.reshape((b, t, heads, hd // heads)).permute((0, 2, 1, 3)).cast(dtypes.float32)


def _step(t: Tensor, s: int) -> Tensor:
    """Time step s of a (B, H, T, D) tensor -> (B, H, D)."""
    b, h, _, d = t.shape
    return t.shrink(((0, b), (0, h), (s, s + 1), (0, d))).reshape((b, h, d))


@op("LinearAttention")
def _linear_attention(ctx, i, a):
    q, k, v = i[0], i[1], i[2]
    opt = lambda j: i[j] if len(i) > j and i[j] is not None else None  # noqa: E731
    past, decay, beta = opt(3), opt(4), opt(5)
    hq, hkv = a["q_num_heads"], a["kv_num_heads"]
    rule = a.get("update_rule", "gated_delta")
    b, steps, _ = q.shape
    dk, dv = q.shape[-1] // hq, v.shape[-1] // hkv
    q4, k4, v4 = _heads(q, hq), _heads(k, hkv), _heads(v, hkv)
    if decay is not None:  # per head (.., H) or per key dim (.., H*dk) -> (B, H, T, 1|dk)
        per = 1 if decay.shape[-1] == hkv else dk
        decay = decay.reshape((b, steps, hkv, per)).permute((0, 2, 1, 3)).cast(dtypes.float32)
    if beta is not None:
        beta = beta.reshape((b, steps, beta.shape[-1], 1)).permute((0, 2, 1, 3)).cast(
            dtypes.float32)
    state = past.cast(dtypes.float32) if past is not None else \
        Tensor.full(0.0, dtypes.float32, (b, hkv, dk, dv))
    scale = a.get("scale") or 1.0 / dk ** 0.5
    group = hq // hkv
    outs = []
    for s in range(steps):
        kt, vt = _step(k4, s), _step(v4, s)
        if rule in ("gated", "gated_delta"):
            state = state * _step(decay, s).exp().unsqueeze(-1)
        if rule in ("delta", "gated_delta"):
            retrieved = (state * kt.unsqueeze(-1)).sum([2], keepdims=False)  # (B, H, dv)
            vt = _step(beta, s) * (vt - retrieved)
        state = state + kt.unsqueeze(-1) * vt.unsqueeze(-2)
        read = state if group == 1 else state.unsqueeze(2).expand(
            (b, hkv, group, dk, dv)).reshape((b, hq, dk, dv))
        ot = (_step(q4, s).unsqueeze(-1) * read).sum([2], keepdims=False) * scale  # (B, Hq, dv)
        outs.append(ot.unsqueeze(1))
    out = Tensor.cat(outs, 1).reshape((b, steps, hq * dv)).cast(q.dtype)
    return [out, state.cast(past.dtype if past is not None else q.dtype)]
