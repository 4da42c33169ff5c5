"""fp16 safety: value ranges from sample inputs, and the tensors that must stay fp32.

`--float16` on a target with half activations stores every float32 intermediate as half, whose
largest finite value is 65504; an STFT power spectrum or a log-mel front end's mel energies pass
that and become inf, then NaN. `--calibrate FEEDS.npz` runs sample inputs through keel's
interpreter (ir/interp.py, fp32, C semantics) and records each tensor's largest magnitude. A
kernel result beyond SAFE_MAX is stored fp32. A kernel computes in fp32 when a value beyond it
would otherwise be computed in half (on half-compute targets, `_in_half`); values that half
compute computes in fp32 anyway (an exp, a division, a reduction's sum) need nothing. A product
inside a reduction is never materialized: its magnitude is bounded by its operands' (the
product of their largest), which is what counts for it. Weights are constants: one beyond
half's range stays fp32 with or without calibration (schedule/storage.py).

SAFE_MAX is 2^14, a quarter of half's range: calibration samples are not every input the model
will see, and one elementwise step (a sum of two such tensors, a residual add) must still fit.
Values that only underflow (below half's 6.1e-5 smallest normal) lose precision but never turn
into inf or NaN; they are not checked.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from compiler.codegen.half import DEMOTE
from compiler.errors import CompileError
from compiler.ir.dtypes import dtypes
from compiler.ir.interp import eval_node
from compiler.ir.uop import MOVEMENT, Ops, UOp
from compiler.schedule.storage import beyond_half

F32 = dtypes.float32
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
SAFE_MAX = 2.0 ** 14


@dataclass
class Fp32Keep:
    """What stays fp32 under --float16: buffers by the tensor they hold, kernels by their root,
    and the reason for each kept tensor (its largest magnitude over the samples)."""
    buffers: set[UOp] = field(default_factory=set)
    kernels: set[UOp] = field(default_factory=set)
    largest: dict[UOp, float] = field(default_factory=dict)
    samples: int = 0


def samples(feeds: dict, inputs: list[tuple[str, UOp]]) -> list[dict]:
    """Calibration feeds (by input name, as in an .npz) as one feed dict per sample: an array of
    the input's shape is one sample, one with a leading axis more holds a sample per row."""
    missing = [n for n, _ in inputs if n not in feeds]
    if missing:
        raise CompileError(f"calibration data has no input(s) {missing}; it has {sorted(feeds)}")
    rows = {}
    for name, u in inputs:
        a = np.asarray(feeds[name])
        if a.shape == u.shape:
            a = a[None]
        if a.shape[1:] != u.shape:
            raise CompileError(f"calibration data for input {name!r}: shape {a.shape}, expected "
                               f"{u.shape} or (samples, *{u.shape})")
        rows[name] = a
    counts = {n: len(a) for n, a in rows.items()}
    if len(set(counts.values())) > 1:
        raise CompileError(f"calibration data: inputs hold different sample counts {counts}")
    return [{n: a[i] for n, a in rows.items()} for i in range(min(counts.values(), default=0))]


def measure(roots: list[UOp], runs: list[dict]) -> dict[UOp, float]:
    """The largest |value| of every float tensor in the graph under `roots`, over the sample
    runs (each a feed dict by input name). Values are dropped as soon as their last reader is
    done, and a reduction of a product (a conv, a matmul) contracts with einsum instead of
    materializing the product; the product's magnitude is bounded by its operands' (recorded
    for it)."""
    order = UOp(Ops.SINK, src=tuple(roots)).toposort()[:-1]
    fused = _contracted_products(order)
    largest: dict[UOp, float] = {}
    for feeds in runs:
        for u, m in _sample(order, fused, feeds).items():
            largest[u] = max(largest.get(u, 0.0), m)
    return largest


def _contracted_products(order: list[UOp]) -> set[UOp]:
    """MUL nodes whose every reader is a sum over them: never evaluated on their own."""
    readers: dict[UOp, list[UOp]] = {}
    for u in order:
        for s in u.src:
            readers.setdefault(s, []).append(u)
    return {u for u in order if u.op is Ops.MUL and u.dtype.is_float and readers.get(u) and
            all(_is_sum(r) for r in readers[u])}


def _is_sum(u: UOp) -> bool:
    return u.op is Ops.REDUCE and u.arg[0] is Ops.ADD


def _sample(order: list[UOp], fused: set[UOp], feeds: dict) -> dict[UOp, float]:
    left: dict[UOp, int] = {}
    for u in order:
        for s in _reads(u, fused):
            left[s] = left.get(s, 0) + 1
    vals: dict[UOp, np.ndarray] = {}
    largest: dict[UOp, float] = {}
    for u in order:
        if u in fused:
            largest[u] = largest[u.src[0]] * largest[u.src[1]]
            continue
        if u.op is Ops.REDUCE and u.src[0] in fused:
            vals[u] = _contract(u, *(vals[s] for s in u.src[0].src))
        else:
            vals[u] = eval_node(u, [vals[s] for s in u.src], feeds)
        largest[u] = _largest(u, vals[u], largest)
        for s in _reads(u, fused):
            left[s] -= 1
            if not left[s]:
                del vals[s]
    return largest


def _reads(u: UOp, fused: set[UOp]) -> tuple[UOp, ...]:
    if u in fused:
        return ()
    if u.op is Ops.REDUCE and u.src[0] in fused:
        return u.src[0].src
    return u.src


def _largest(u: UOp, value: np.ndarray, largest: dict) -> float:
    if not u.dtype.is_float:
        return 0.0
    if u.op in MOVEMENT and u.op is not Ops.PAD:  # the same values, rearranged
        return largest[u.src[0]]
    if value.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        m = np.nanmax(np.abs(value)) if not np.isnan(value).all() else 0.0
    return float(m)


def _contract(r: UOp, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sum(a * b) over r's axes (a, b broadcast to the product's shape), keepdims, by einsum
    over the dims each operand really has (a broadcast dim is a stride-0 view: dropped). A
    summed dim neither operand has multiplies the sum by its size."""
    shape, axes = r.src[0].shape, set(r.arg[1])
    a, b = np.broadcast_to(a, shape), np.broadcast_to(b, shape)
    ops, subs, has = [], [], set()
    for x in (a, b):
        real = [i for i in range(len(shape)) if shape[i] > 1 and x.strides[i] != 0]
        ops.append(x[tuple(slice(None) if i in real else 0 for i in range(len(shape)))])
        subs.append("".join(LETTERS[i] for i in real))
        has.update(real)
    kept = [i for i in range(len(shape)) if i in has and i not in axes]
    res = np.einsum(f"{subs[0]},{subs[1]}->{''.join(LETTERS[i] for i in kept)}", *ops,
                    optimize=True)
    res = res * np.prod([shape[i] for i in axes if i not in has])
    res = np.asarray(res, r.dtype.np).reshape(
        [shape[i] if i in kept else 1 for i in range(len(shape))])
    return np.broadcast_to(res, r.shape)


def keep_fp32(kernels: list, outputs: set[UOp], largest: dict[UOp, float],
              samples: int) -> Fp32Keep:
    """The buffers stored fp32 (a kernel's result beyond SAFE_MAX) and the kernels that compute
    in fp32 (one with a value beyond it that a half-compute target would compute in half),
    deciding kernel by kernel in launch order, so a kernel knows which of its inputs are half.
    `kernels`: schedule.fusion.Kernel records; `outputs`: graph outputs (stored as declared)."""
    keep = Fp32Keep(samples=samples)
    for k in kernels:
        if largest.get(k.root, 0.0) > SAFE_MAX:
            keep.buffers.update({k.root} | ({k.into} if k.into is not None else set()))
            keep.largest[k.root] = largest[k.root]
        if any(largest.get(u, 0.0) > SAFE_MAX for u in _in_half(k, keep.buffers, outputs)):
            keep.kernels.add(k.root)
    return keep


def _in_half(k, kept: set[UOp], outputs: set[UOp]) -> set[UOp]:
    """The values of kernel k that half compute (codegen/half.py `demote_half`) computes in
    half: an op of DEMOTE whose float operands are all half, where half means read from a half
    buffer (an arena tensor or a weight not kept fp32), a constant, or such an op's result.
    Transcendentals, division and reductions compute in fp32 and end the chain."""
    half: set[UOp] = set()
    for u in k.root.toposort(leaves=set(k.inputs)):
        if u in k.inputs:
            stored_half = u.dtype is F32 and u.op is not Ops.INPUT and u not in kept and \
                u not in outputs and not beyond_half(u)
            if stored_half:
                half.add(u)
        elif u.op in MOVEMENT or u.op is Ops.CONST:
            if u.op is Ops.CONST or u.src[0] in half:
                half.add(u)
        elif u.op in DEMOTE and all(s in half for s in u.src if s.dtype.is_float):
            half.add(u)
    return half
