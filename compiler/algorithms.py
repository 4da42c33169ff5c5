"""The algorithms stage, between the frontend and the schedule: the importer builds every
MatMul, Gemm and Conv as the plain product and records it as a Choice (onnx/registry.py); here
the target's capabilities pick another algorithm for some of them, and each such product is
substituted in a new Graph (the frontend's is read, never changed):

- on targets with `cpu_layouts`, a big product by a constant weight with an odd output count
  computes whole vectors of outputs on a zero-padded weight, and the padding is cut off after;
- on targets with `winograd`, an eligible float32 3x3 conv takes Winograd's F(2x2, 3x3)
  (compiler/winograd.py).

A product is rebuilt from its operands as substituted so far (Choices come in the order they
were built, an operand's before its consumers'), and UOps are hash-consed: a product no
algorithm changes, and everything downstream of a changed one, is the node the importer would
have built for that choice directly.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from compiler import winograd
from compiler.ir.dtypes import dtypes
from compiler.ir.rewrite import substitute
from compiler.ir.tensor import Tensor
from compiler.ir.uop import Ops, UOp
from compiler.onnx.load import Graph
from compiler.onnx.registry import Choice, constant
from compiler.target import LINE_BYTES, Target

PAD_MIN_MACS = 1 << 20  # below this a product is cheap either way, and the cut is a launch


def choose(graph: Graph, t: Target) -> Graph:
    """`graph` with each Choice built by the algorithm `t` takes for it (graph itself when
    that is the plain one everywhere)."""
    memo: dict[UOp, UOp] = {}  # plain node -> chosen; grows with each Choice, kept across them
    changed = False
    for c in graph.choices:
        x, w = (Tensor(substitute(u, memo, shared=True) if changed else u) for u in (c.x, c.w))
        if c.out not in memo and (y := _chosen(c, x, w, t)) is not None:
            memo[c.out], changed = y.uop, True
    if not changed:
        return graph
    keys = list(graph.origins)
    sink = substitute(UOp(Ops.SINK, dtypes.void, (*(u for _, u in graph.outputs), *keys)), memo,
                      shared=True)
    outs, new = sink.src[:len(graph.outputs)], sink.src[len(graph.outputs):]
    origins: dict[UOp, int] = {}
    for u, old in zip(new, keys):
        origins.setdefault(u, graph.origins[old])
    return replace(graph, outputs=[(n, u) for (n, _), u in zip(graph.outputs, outs)],
                   origins=origins, choices=[])


def _chosen(c: Choice, x: Tensor, w: Tensor, t: Target) -> Tensor | None:
    """The product by the algorithm `t` takes for it, None for the plain one."""
    w_axis, y_axis = (0, 1) if c.window else (1, -1)
    # outputs padded to a cache line of float32: whole vectors at every CPU width (wider
    # multiples, for wider register tiles, ran slower (docs/perf.md))
    wide, extra = _pad_out(w, w_axis, c.macs, LINE_BYTES // 4 if t.cpu_layouts else 0)
    if t.winograd and c.window and x.dtype is dtypes.float32 \
            and winograd.eligible(x.shape, wide.shape, *c.window) \
            and (value := constant(wide)) is not None:
        y = winograd.conv(x, value, c.window[2])
    elif extra:
        y = c.build(x, wide)
    else:
        return None
    return _cut(y, y_axis, w.shape[w_axis]) if extra else y


def _pad_out(w: Tensor, axis: int, macs: int, cols: int) -> tuple[Tensor, int]:
    """(w, 0), or a constant weight whose output count along `axis` is not a multiple of 8 (no
    whole AVX2 vector, half an AVX-512 one) zero-padded to a multiple of `cols` (a cache line
    of float32 on CPU targets; 0: never), and how many it gained, when its product (`macs`
    multiply-adds) is big enough to pay for the extra kernel that cuts the padding off (the
    cut ends the product's epilogue). The kernel then vectorizes along its outputs, where an
    odd output count (an OCR alphabet, a detector head's 255 channels) had one lane or gathered
    its input along the pixels (docs/perf.md)."""
    n = w.shape[axis]
    if not cols or n % 8 == 0 or n <= cols or macs < PAD_MIN_MACS \
            or (value := constant(w)) is None:
        return w, 0
    pads = [(0, 0)] * w.ndim
    pads[axis] = (0, -n % cols)
    return Tensor.weight(np.pad(value, pads)), -n % cols


def _cut(y: Tensor, axis: int, n: int) -> Tensor:
    """y's first n entries along axis: the real outputs of a kernel run on a _pad_out weight."""
    return y.shrink(tuple((0, n) if d == axis % y.ndim else (0, s) for d, s in enumerate(y.shape)))
