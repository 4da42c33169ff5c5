"""ONNX recurrent ops (RNN, GRU, LSTM), unrolled over the static sequence length.

The input projection X @ W^T is one matmul over all steps; each step adds H @ R^T and applies
the cell. `sequence_lens` masks steps past a sequence's end: the state holds and Y is zero there,
which also makes a reverse pass start at each sequence's own last step.
"""
from __future__ import annotations

from dataclasses import dataclass

from compiler.ir.dtypes import dtypes
from compiler.onnx.ops.elementwise import expm1, softplus
from compiler.onnx.ops.shape import arange_at
from compiler.onnx.registry import op
from compiler.ir.tensor import Tensor


def _activation(name: str, alpha, beta):
    fns = {
        "Relu": lambda x: x.relu(), "Tanh": Tensor.tanh, "Sigmoid": Tensor.sigmoid,
        "Affine": lambda x: x * alpha + beta,
        "LeakyRelu": lambda x: (x > 0).where(x, x * alpha),
        "ThresholdedRelu": lambda x: (x > alpha).where(x, 0.0),
        "ScaledTanh": lambda x: (x * beta).tanh() * alpha,
        "HardSigmoid": lambda x: (x * alpha + beta).maximum(0.0).minimum(1.0),
        "Elu": lambda x: (x < 0).where(expm1(x) * alpha, x),
        "Softsign": lambda x: x / (x.abs() + 1.0),
        "Softplus": softplus,
    }
    key = next((k for k in fns if k.lower() == name.lower()), None)
    if key is None:
        raise ValueError(f"unsupported activation {name!r}")
    return fns[key]


_ALPHA_DEFAULTS = {"LeakyRelu": 0.01, "ThresholdedRelu": 1.0, "HardSigmoid": 0.2, "Elu": 1.0,
                   "ScaledTanh": 1.0, "Affine": 1.0}
_BETA_DEFAULTS = {"HardSigmoid": 0.5, "ScaledTanh": 1.0, "Affine": 0.0}


@dataclass
class Cell:
    gates: int  # weight blocks per direction: RNN 1, GRU 3, LSTM 4
    default_acts: tuple[str, ...]


CELLS = {"RNN": Cell(1, ("Tanh",)), "GRU": Cell(3, ("Sigmoid", "Tanh")),
         "LSTM": Cell(4, ("Sigmoid", "Tanh", "Tanh"))}


def _acts(a: dict, cell: Cell, ndir: int) -> list[list]:
    """Per direction, the cell's activation functions with their alpha/beta."""
    names = a.get("activations") or list(cell.default_acts) * ndir
    alphas, betas = list(a.get("activation_alpha", [])), list(a.get("activation_beta", []))
    fns = []
    for name in names:
        key = next((k for k in _ALPHA_DEFAULTS if k.lower() == name.lower()), name)
        alpha = alphas.pop(0) if key in _ALPHA_DEFAULTS and alphas else _ALPHA_DEFAULTS.get(key)
        beta = betas.pop(0) if key in _BETA_DEFAULTS and betas else _BETA_DEFAULTS.get(key)
        fns.append(_activation(name, alpha, beta))
    per = len(cell.default_acts)
    return [fns[d * per:(d + 1) * per] for d in range(ndir)]


def _rows(t: Tensor, j: int, n: int) -> Tensor:
    """Block j of n equal blocks along the last axis."""
    h = t.shape[-1] // n
    return t.shrink([(0, s) for s in t.shape[:-1]] + [(j * h, (j + 1) * h)])


@op("RNN", "GRU", "LSTM")
def _recurrent(ctx, i, a):
    kind = ctx.node.op_type
    cell = CELLS[kind]
    x, w, r = i[0], i[1], i[2]
    opt = lambda k: i[k] if len(i) > k and i[k] is not None else None  # noqa: E731
    b, lens, h0 = opt(3), opt(4), opt(5)
    c0, peep = opt(6), opt(7)
    layout = a.get("layout", 0)
    if layout:
        x = x.permute((1, 0, 2))
        h0 = h0.permute((1, 0, 2)) if h0 is not None else None
        c0 = c0.permute((1, 0, 2)) if c0 is not None else None
    steps, batch = x.shape[:2]
    ndir, hidden = w.shape[0], r.shape[-1]
    acts = _acts(a, cell, ndir)
    clip = a.get("clip")
    mask = None
    if lens is not None:  # (steps, batch, 1): step t is inside sequence b
        mask = arange_at(steps, 0, 3) < lens.cast(dtypes.int64).reshape((1, batch, 1))
    reverse = [a.get("direction", "forward") == "reverse"] if ndir == 1 else [False, True]
    ys, hs, cs = [], [], []
    for d in range(ndir):
        def sel(t: Tensor) -> Tensor:  # direction d of a (ndir, ...) tensor
            return t.shrink([(d, d + 1)] + [(0, s) for s in t.shape[1:]]).reshape(t.shape[1:])

        wd, rd = sel(w), sel(r)
        bd = sel(b) if b is not None else Tensor.full(0.0, x.dtype, (2 * cell.gates * hidden,))
        h = sel(h0) if h0 is not None else Tensor.full(0.0, x.dtype, (batch, hidden))
        c = sel(c0) if c0 is not None else Tensor.full(0.0, x.dtype, (batch, hidden))
        p = sel(peep) if peep is not None else None
        xw = x.matmul(wd.transpose()) + _rows(bd, 0, 2)  # (steps, batch, gates*hidden)
        rb = _rows(bd, 1, 2)
        outs = [None] * steps
        for s in (range(steps - 1, -1, -1) if reverse[d] else range(steps)):
            xs = xw.shrink([(s, s + 1), (0, batch), (0, xw.shape[-1])]).reshape(xw.shape[1:])
            h_new, c_new = _step(kind, a, acts[d], clip, xs, h, c, rd, rb, p)
            if mask is not None:
                m = mask.shrink([(s, s + 1), (0, batch), (0, 1)]).reshape((batch, 1))
                h_new, c_new = m.where(h_new, h), m.where(c_new, c)
                outs[s] = m.where(h_new, Tensor.full(0.0, x.dtype))
            else:
                outs[s] = h_new
            h, c = h_new, c_new
        ys.append(Tensor.cat([o.unsqueeze(0) for o in outs], 0))  # (steps, batch, hidden)
        hs.append(h.unsqueeze(0))
        cs.append(c.unsqueeze(0))
    y = Tensor.cat([t.unsqueeze(1) for t in ys], 1)  # (steps, ndir, batch, hidden)
    yh, yc = Tensor.cat(hs, 0), Tensor.cat(cs, 0)
    if layout:
        y, yh, yc = y.permute((2, 0, 1, 3)), yh.permute((1, 0, 2)), yc.permute((1, 0, 2))
    return [y, yh, yc]


def _step(kind, a, f, clip, xs, h, c, r, rb, p):
    """One cell step -> (h, c). xs = x_t W^T + Wb for every gate; r, rb the recurrent weights."""
    n = xs.shape[-1] // r.shape[-1] if kind != "RNN" else 1

    def gate(pre):
        return pre.maximum(-clip).minimum(clip) if clip is not None else pre

    if kind == "RNN":
        return f[0](gate(xs + h.matmul(r.transpose()) + rb)), c
    if kind == "GRU":
        hr = h.matmul(r.transpose())  # (batch, 3*hidden): z, r, h blocks
        z = f[0](gate(_rows(xs, 0, n) + _rows(hr, 0, n) + _rows(rb, 0, n)))
        rr = f[0](gate(_rows(xs, 1, n) + _rows(hr, 1, n) + _rows(rb, 1, n)))
        hid = r.shape[-1]
        rh, rbh = r.shrink(((2 * hid, 3 * hid), (0, hid))), _rows(rb, 2, n)
        if a.get("linear_before_reset", 0):
            hh = _rows(xs, 2, n) + rr * (_rows(hr, 2, n) + rbh)
        else:
            hh = _rows(xs, 2, n) + (rr * h).matmul(rh.transpose()) + rbh
        hh = f[1](gate(hh))
        return (1.0 - z) * hh + z * h, c
    pre = xs + h.matmul(r.transpose()) + rb  # (batch, 4*hidden): i, o, f, c blocks
    pi, po, pf = (_rows(p, j, 3) for j in range(3)) if p is not None else (None,) * 3
    ig = gate(_rows(pre, 0, n) + (pi * c if pi is not None else 0.0))
    fg = gate(_rows(pre, 2, n) + (pf * c if pf is not None else 0.0))
    it = f[0](ig)
    ft = 1.0 - it if a.get("input_forget", 0) else f[0](fg)
    c_new = ft * c + it * f[1](gate(_rows(pre, 3, n)))
    ot = f[0](gate(_rows(pre, 1, n) + (po * c_new if po is not None else 0.0)))
    return ot * f[2](c_new), c_new
