"""ONNX ops that index, sort, scan or scatter, written as one-hot matches.

keel has one data-dependent view (GATHER); everything that writes to or ranks by runtime
positions is a comparison against a compile-time arange followed by a reduction: out[o] =
sum_i [pos(i) == o] * x[i]. Exactly one term is non-zero, so the sum is exact for every dtype.
These ops are O(n^2) along the indexed axis, fine for the sizes ONNX graphs index.
"""
from __future__ import annotations

import math

import numpy as np

from compiler.ir.dtypes import dtypes
from compiler.onnx.ops.shape import arange_at, pick
from compiler.onnx.registry import onnx_dtype, op
from compiler.ir.tensor import Tensor
from compiler.ir.uop import Ops


def any_(match: Tensor, axis: int) -> Tensor:
    return match.cast(dtypes.int32).max([axis], keepdims=False).ne(0)


def wrap_negative(ind: Tensor, n: int) -> Tensor:
    ind = ind.cast(dtypes.int64)
    return (ind < 0).where(ind + n, ind)


# ---- scans ----------------------------------------------------------------------------------
def _cumulative(ctx, i, a, reduce_op: Ops):
    x = i[0]
    axis = int(ctx.static(i[1], "axis").reshape(-1)[0]) % x.ndim
    n = x.shape[axis]
    src, dst = np.arange(n)[None, :], np.arange(n)[:, None]  # out[dst] sums x[src]
    if a.get("reverse", 0):
        keep = src > dst if a.get("exclusive", 0) else src >= dst
    else:
        keep = src < dst if a.get("exclusive", 0) else src <= dst
    mask = Tensor.weight(keep.reshape((1,) * axis + (n, n) + (1,) * (x.ndim - axis - 1)))
    terms = mask.where(x.unsqueeze(axis), Tensor.full(1 if reduce_op is Ops.MUL else 0, x.dtype))
    return terms.reduce(reduce_op, [axis + 1], keepdims=False)


@op("CumSum")
def _cumsum(ctx, i, a):
    return _cumulative(ctx, i, a, Ops.ADD)


@op("CumProd")
def _cumprod(ctx, i, a):
    return _cumulative(ctx, i, a, Ops.MUL)


# ---- sorting --------------------------------------------------------------------------------
@op("TopK")
def _topk(ctx, i, a):
    """Rank every element (ties: lower index first), then pick ranks 0..k-1."""
    x = i[0]
    k = int(ctx.static(i[1], "K").reshape(-1)[0]) if len(i) > 1 else a["k"]
    axis = a.get("axis", -1) % x.ndim
    n = x.shape[axis]
    xi, xj = x.unsqueeze(axis + 1), x.unsqueeze(axis)  # element i on axis, rival j on axis+1
    beats = (xj > xi) if a.get("largest", 1) else (xj < xi)
    earlier = arange_at(n, axis + 1, x.ndim + 1) < arange_at(n, axis, x.ndim + 1)
    rank = (beats | (xj.eq(xi) & earlier)).cast(dtypes.int64).sum([axis + 1], keepdims=False)
    hit = rank.unsqueeze(axis).eq(arange_at(k, axis, x.ndim + 1))  # (.., k, n, ..)
    values = pick(hit, x.unsqueeze(axis), axis + 1)
    indices = pick(hit, arange_at(n, axis + 1, x.ndim + 1), axis + 1)
    return [values, indices]


# ---- gather / scatter -------------------------------------------------------------------------
@op("GatherND")
def _gathernd(ctx, i, a):
    """Index the first k data dims (after batch_dims) with one flat GATHER."""
    x, ind = i
    b = a.get("batch_dims", 0)
    k = ind.shape[-1]
    lead, dims, rest = x.shape[:b], x.shape[b:b + k], x.shape[b + k:]
    ind = ind.cast(dtypes.int64)
    flat = None
    for j, n in enumerate(dims):
        term = wrap_negative(ind.shrink([(0, s) for s in ind.shape[:-1]] + [(j, j + 1)]), n)
        flat = term if flat is None else flat * n + term
    nb = math.prod(lead)
    batch = arange_at(nb, 0, 1).reshape(lead + (1,) * (ind.ndim - b))
    flat = flat + batch * math.prod(dims)
    data = x.reshape((nb * math.prod(dims),) + rest)
    return data.gather(flat.reshape(flat.shape[:-1]), 0)


def _scatter_reduce(old: Tensor, hit: Tensor, upd: Tensor, axis: int, mode: str) -> Tensor:
    """data updated where `hit` (its `axis` enumerates the updates) with reduction `mode`."""
    touched = any_(hit, axis)
    if mode == "none":
        return touched.where(pick(hit, upd, axis), old)
    red = {"add": Ops.ADD, "mul": Ops.MUL, "max": Ops.MAX, "min": Ops.MIN}[mode]
    fill = {Ops.ADD: 0, Ops.MUL: 1, Ops.MAX: old.dtype.min, Ops.MIN: old.dtype.max}[red]
    combined = hit.where(upd, Tensor.full(fill, old.dtype)).reduce(red, [axis], keepdims=False)
    if red is Ops.ADD:
        return old + combined
    if red is Ops.MUL:
        return old * combined
    return touched.where(old.maximum(combined) if red is Ops.MAX else old.minimum(combined), old)


@op("ScatterElements", "Scatter")
def _scatter_elements(ctx, i, a):
    x, ind, upd = i
    axis = a.get("axis", 0) % x.ndim
    n = x.shape[axis]
    pads = [(0, 0 if d == axis else s - t) for d, (s, t) in enumerate(zip(x.shape, ind.shape))]
    # updates smaller than data in the other dims leave the rest alone: pad with a miss (-1)
    ind = wrap_negative(ind, n).pad(pads, -1)
    upd = upd.pad(pads, 0 if upd.dtype is not dtypes.bool else False)
    hit = ind.unsqueeze(axis).eq(arange_at(n, axis, x.ndim + 1))  # (.., n, m, ..)
    return _scatter_reduce(x, hit, upd.unsqueeze(axis), axis + 1, a.get("reduction", "none"))


@op("ScatterND")
def _scatternd(ctx, i, a):
    x, ind, upd = i
    k = ind.shape[-1]
    dims, rest = x.shape[:k], x.shape[k:]
    ind = ind.cast(dtypes.int64)
    flat = None
    for j, n in enumerate(dims):
        term = wrap_negative(ind.shrink([(0, s) for s in ind.shape[:-1]] + [(j, j + 1)]), n)
        flat = term if flat is None else flat * n + term
    m = math.prod(ind.shape[:-1])
    cells = math.prod(dims)
    hit = flat.reshape((1, m) + (1,) * len(rest)).eq(arange_at(cells, 0, 2 + len(rest)))
    data = x.reshape((cells,) + rest)
    out = _scatter_reduce(data, hit, upd.reshape((1, m) + rest), 1, a.get("reduction", "none"))
    return out.reshape(x.shape)


@op("TensorScatter")
def _tensor_scatter(ctx, i, a):
    """present[b, .., (w_b + s) (mod L), ..] = update[b, .., s, ..] along the sequence axis."""
    past, upd = i[0], i[1]
    axis = a.get("axis", -2) % past.ndim
    L, S, nb = past.shape[axis], upd.shape[axis], past.shape[0]
    w = i[2].cast(dtypes.int64) if len(i) > 2 and i[2] is not None else \
        Tensor.full(0, dtypes.int64, (nb,))
    w = w.reshape((nb,) + (1,) * (past.ndim - 1)).unsqueeze(axis + 1)
    pos = w + arange_at(S, axis + 1, past.ndim + 1)  # (b, .., 1, S, ..)
    if a.get("mode", "linear") == "circular":
        pos = pos % L
    hit = pos.eq(arange_at(L, axis, past.ndim + 1))  # (b, .., L, S, ..)
    return _scatter_reduce(past, hit, upd.unsqueeze(axis), axis + 1, "none")


@op("ReverseSequence")
def _reverse_sequence(ctx, i, a):
    x, lens = i
    t_ax, b_ax = a.get("time_axis", 0), a.get("batch_axis", 1)
    n, nb = x.shape[t_ax], x.shape[b_ax]
    shape = [1] * (x.ndim + 1)
    shape[b_ax if b_ax < t_ax else b_ax + 1] = nb
    ln = lens.cast(dtypes.int64).reshape(shape)
    dst = arange_at(n, t_ax, x.ndim + 1)  # output position on t_ax, source on t_ax + 1
    rev = ln - 1 - dst
    src = (dst < ln).where(rev, dst)
    hit = src.eq(arange_at(n, t_ax + 1, x.ndim + 1))
    return pick(hit, x.unsqueeze(t_ax), t_ax + 1)


# ---- algebra --------------------------------------------------------------------------------
@op("Einsum")
def _einsum(ctx, i, a):
    """Each operand: diagonals of repeated labels, then permuted and reshaped onto one label
    space; the product is summed over the labels that are not in the output."""
    eq = a["equation"].replace(" ", "")
    lhs, out = eq.split("->") if "->" in eq else (eq, None)
    terms = lhs.split(",")
    ell = max((t.ndim - len(s.replace("...", "")) for s, t in zip(terms, i) if "..." in s),
              default=0)
    ell_labels = "".join(chr(0x100 + j) for j in range(ell))  # never a letter of the equation
    terms = [s.replace("...", ell_labels[ell - (t.ndim - len(s.replace("...", ""))):])
             for s, t in zip(terms, i)]
    if out is None:
        once = sorted(c for c in set("".join(terms)) if "".join(terms).count(c) == 1
                      and c not in ell_labels)
        out = ell_labels + "".join(once)
    else:
        out = out.replace("...", ell_labels)
    labels = out + "".join(sorted(set("".join(terms)) - set(out)))
    sizes: dict = {}
    prod = None
    for s, t in zip(terms, i):
        t, s = _diagonals(t, s)
        for c, n in zip(s, t.shape):
            sizes[c] = max(sizes.get(c, 1), n)
        t = t.permute([s.index(c) for c in labels if c in s])
        t = t.reshape([t.shape[[c for c in labels if c in s].index(c)] if c in s else 1
                       for c in labels])
        prod = t if prod is None else prod * t
    prod = prod.expand([sizes.get(c, 1) for c in labels])
    return prod.sum(list(range(len(out), len(labels))), keepdims=False) \
        if len(labels) > len(out) else prod


def _diagonals(t: Tensor, s: str) -> tuple[Tensor, str]:
    """A label repeated within one operand takes the diagonal: t['ii'] -> t['i']."""
    while len(set(s)) < len(s):
        c = next(c for c in s if s.count(c) > 1)
        p, q = s.index(c), s.index(c, s.index(c) + 1)
        n = t.shape[p]
        eye = arange_at(n, p, t.ndim).eq(arange_at(n, q, t.ndim))
        t = eye.where(t, Tensor.full(0, t.dtype)).sum([q], keepdims=False)
        s = s[:q] + s[q + 1:]
    return t, s


@op("Det")
def _det(ctx, i, a):
    """Gaussian elimination with partial pivoting, unrolled over the (static) matrix size."""
    x = i[0]
    n = x.shape[-1]
    m, det = x, Tensor.full(1.0, x.dtype, x.shape[:-2])
    for c in range(n):
        col = m.shrink([(0, s) for s in m.shape[:-1]] + [(c, c + 1)]).reshape(m.shape[:-1])
        rows = arange_at(n, m.ndim - 2, m.ndim - 1)
        cand = (rows >= c).where(col.abs(), Tensor.full(-1.0, x.dtype))
        best = cand.max([-1])
        piv = (cand.eq(best).where(rows, Tensor.full(n, dtypes.int64))).min([-1])  # (.., 1)
        is_piv, is_c = rows.eq(piv), rows.eq(c)
        prow = pick(is_piv.unsqueeze(-1), m, m.ndim - 2).unsqueeze(-2)  # (.., 1, n)
        crow = m.shrink([(0, s) for s in m.shape[:-2]] + [(c, c + 1), (0, n)])
        m = is_c.unsqueeze(-1).where(prow, is_piv.unsqueeze(-1).where(crow, m))  # swap rows
        pv = prow.shrink([(0, s) for s in prow.shape[:-1]] + [(c, c + 1)])  # (.., 1, 1)
        safe = pv.eq(0.0).where(Tensor.full(1.0, x.dtype), pv)  # singular: det is already 0
        swapped = piv.ne(c).reshape(det.shape)
        det = det * pv.reshape(det.shape) * swapped.where(Tensor.full(-1.0, x.dtype),
                                                          Tensor.full(1.0, x.dtype))
        factor = (rows > c).unsqueeze(-1).where(m.shrink(
            [(0, s) for s in m.shape[:-1]] + [(c, c + 1)]) / safe, Tensor.full(0.0, x.dtype))
        m = m - factor * prow
    return det


@op("BitCast")
def _bitcast(ctx, i, a):
    x, dt = i[0], onnx_dtype(a["to"], ctx.where())
    if dtypes.bool in (x.dtype, dt):
        return x.ne(0) if dt is dtypes.bool else x.cast(dt)
    return x.bitcast(dt)


@op("MaxUnpool")
def _max_unpool(ctx, i, a):
    """out.flat[I] = X; MaxPool's indices stay inside their own (n, c) plane."""
    x, ind = i[0], i[1]
    ks = a["kernel_shape"]
    nsp = len(ks)
    strides = a.get("strides", [1] * nsp)
    pads = a.get("pads", [0] * 2 * nsp)
    out_sp = tuple((s - 1) * st - pads[d] - pads[nsp + d] + k
                   for d, (s, st, k) in enumerate(zip(x.shape[2:], strides, ks)))
    want = tuple(int(v) for v in ctx.static(i[2], "output_shape"))[2:] \
        if len(i) > 2 and i[2] is not None else out_sp
    n, c = x.shape[:2]
    p_in, p_out = math.prod(x.shape[2:]), math.prod(out_sp)
    plane = arange_at(n * c, 0, 1).reshape((n, c, 1)) * p_out
    local = ind.cast(dtypes.int64).reshape((n, c, p_in)) - plane
    hit = local.unsqueeze(2).eq(arange_at(p_out, 2, 4))  # (n, c, p_out, p_in)
    out = pick(hit, x.reshape((n, c, 1, p_in)), 3).reshape((n, c) + out_sp)
    # a larger output_shape keeps the unpooled block at the origin (the ONNX reference)
    return out.pad(((0, 0), (0, 0)) + tuple((0, w - o) for w, o in zip(want, out_sp)))


@op("Col2Im")
def _col2im(ctx, i, a):
    """Sum every column entry into its image pixel: a matmul with a compile-time 0/1 matrix."""
    x = i[0]  # (N, C*K, L)
    image = [int(v) for v in ctx.static(i[1], "image_shape")]
    block = [int(v) for v in ctx.static(i[2], "block_shape")]
    nsp = len(image)
    dil = a.get("dilations", [1] * nsp)
    pads = a.get("pads", [0] * 2 * nsp)
    strides = a.get("strides", [1] * nsp)
    slide = [(im + pads[d] + pads[nsp + d] - dil[d] * (b - 1) - 1) // strides[d] + 1
             for d, (im, b) in enumerate(zip(image, block))]
    k, L, P = math.prod(block), math.prod(slide), math.prod(image)
    m = np.zeros((k, L, P), x.dtype.np)
    for kk, kpos in enumerate(np.ndindex(*block)):
        for ll, lpos in enumerate(np.ndindex(*slide)):
            pix = [lp * st - pads[d] + kp * dl for d, (lp, st, kp, dl)
                   in enumerate(zip(lpos, strides, kpos, dil))]
            if all(0 <= p < s for p, s in zip(pix, image)):
                m[kk, ll, np.ravel_multi_index(pix, image)] = 1
    n, c = x.shape[0], x.shape[1] // k
    y = x.reshape((n, c, k * L)).matmul(Tensor.weight(m.reshape(k * L, P)))
    return y.reshape([n, c] + image)


@op("TfIdfVectorizer")
def _tfidf(ctx, i, a):
    """Count each pool n-gram at every start and skip distance (unigrams once), then weight."""
    x = i[0]
    rows = x.reshape((1, x.shape[0])) if x.ndim == 1 else x
    width = rows.shape[1]
    lo, hi, skips = a["min_gram_length"], a["max_gram_length"], a["max_skip_count"]
    pool, counts = list(a["pool_int64s"]), list(a["ngram_counts"]) + [len(a["pool_int64s"])]
    columns: dict[int, Tensor] = {}
    gram = 0
    for size, (start, end) in enumerate(zip(counts, counts[1:]), 1):
        for at in range(start, end, size):
            col = a["ngram_indexes"][gram]
            gram += 1
            if not lo <= size <= hi:
                continue
            for dist in range(1, (skips + 1 if size > 1 else 1) + 1):
                span = (size - 1) * dist
                if span >= width:
                    continue
                match = None
                for j in range(size):
                    part = rows.shrink(((0, rows.shape[0]), (j * dist, j * dist + width - span)))
                    eq = part.eq(Tensor.full(pool[at + j], rows.dtype))
                    match = eq if match is None else match & eq
                n = match.cast(dtypes.float32).sum([1])
                columns[col] = n if col not in columns else columns[col] + n
    size_out = max(a["ngram_indexes"]) + 1
    zero = Tensor.full(0.0, dtypes.float32, (rows.shape[0], 1))
    tf = Tensor.cat([columns.get(c, zero) for c in range(size_out)], 1)
    weights = a.get("weights")
    mode = a["mode"]
    if mode == "IDF":
        w = Tensor.weight(np.asarray(weights, np.float32)) if weights else 1.0
        out = (tf > 0).where(w if isinstance(w, Tensor) else Tensor.full(w, dtypes.float32),
                             Tensor.full(0.0, dtypes.float32))
    elif mode == "TFIDF" and weights:
        out = tf * Tensor.weight(np.asarray(weights, np.float32))
    else:
        out = tf
    return out.reshape((size_out,)) if x.ndim == 1 else out
