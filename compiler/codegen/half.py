"""float16 inside kernels: every rewrite rule and lowering choice that depends on half.

Kernels are lowered against each buffer's storage dtype (schedule/storage.py decides it);
`storage_casts` then makes every LOAD/STORE carry that dtype with explicit casts to and from the
compute type, so a renderer never has to guess.

  * Without `half_compute`, half is a storage type: everything computes in fp32 (`half_rules`),
    and only the loads/stores convert (vload_half/vstore_half are core OpenCL, no cl_khr_fp16).
  * With `half_compute` (Adreno), elementwise arithmetic runs in half (`demote_half`).
    Transcendentals, division and sqrt stay fp32, so their polynomial lowering has the same
    numerics on every target (`promote_for_half_compute`).
  * Reductions always accumulate in fp32 (`accumulator`): a conv or matmul sums hundreds to
    thousands of products, and an fp16 accumulator (11-bit mantissa) loses the small addends once
    the sum grows (relative error grows ~ sqrt(n) * 2^-11, and n * 2^-11 in the worst case).
"""
from __future__ import annotations

import numpy as np

from compiler.ir.dtypes import DType, dtypes
from compiler.ir.rewrite import PatternMatcher, UPat
from compiler.ir.uop import ALU, Ops, UOp

F16, F32 = dtypes.float16, dtypes.float32


def accumulator(dtype: DType) -> DType:
    """The dtype a reduction of `dtype` values accumulates in."""
    return F32 if dtype is F16 else dtype


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

def promote_half(x: UOp) -> UOp | None:
    """x computed in float32 from its float16 operands, its result cast back."""
    if x.op not in ALU or x.op in (Ops.CAST, Ops.BITCAST):
        return None
    if not any(s.dtype is F16 for s in x.src) and x.dtype is not F16:
        return None
    src = tuple(s.cast(F32) if s.dtype is F16 else s for s in x.src)
    out_dt = F32 if x.dtype is F16 else x.dtype
    return UOp(x.op, out_dt, src, x.arg).cast(x.dtype)


def promote_half_reduce(x: UOp) -> UOp | None:
    acc = accumulator(x.dtype)
    if acc is x.dtype:
        return None
    src = tuple(s.cast(acc) if s.op is not Ops.RANGE else s for s in x.src)
    return UOp(Ops.REDUCE, acc, src, x.arg).cast(x.dtype)


half_rules = PatternMatcher([
    (UPat(ALU, name="x"), promote_half),
    (UPat(Ops.REDUCE, name="x"), promote_half_reduce),
])

# arithmetic that is as good in half as the fp16 operands it reads (no growth of error with n)
DEMOTE = {Ops.ADD, Ops.SUB, Ops.MUL, Ops.NEG, Ops.MAX, Ops.MIN, Ops.WHERE,
          Ops.CMPLT, Ops.CMPEQ, Ops.CMPNE}
# stays fp32 even on fp16 inputs: same polynomials everywhere, and division/sqrt accuracy
PROMOTE = {Ops.EXP2, Ops.EXP, Ops.LOG2, Ops.SIN, Ops.COS, Ops.POW, Ops.SQRT, Ops.FDIV, Ops.RECIP, Ops.TRUNC}


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
