"""Hypothesis strategies for small random ONNX graphs (opset 17) and inputs to run them on.

`graph_strategy()` draws (model, feeds): 1-3 float32 inputs of rank 1-4 with dims 1-7, then a
chain of 1-8 ops, each taking the newest tensor (or any earlier one) plus partners drawn from the
pool or made up as constants. Elementwise, movement and reduce ops are covered; see OPS.

Every graph is built to be well-conditioned, so two correct fp32 implementations agree to a few
ulps and a tolerance failure means a bug, not bad luck:
- a worst-case |value| bound is tracked per tensor and no op may push it past MAX_BOUND: an ulp
  of a large value that cancels to a small result would exceed atol;
- domains are kept away from their edges: Div by (|b| + 1), Log of (|x| + 1), Sqrt of
  (|x| + 0.01) (the offset bounds the slope at 0), Exp of x clipped to [-3, 3];
- discontinuous ops (Where's comparison, Cast to int32 or float16) only see graph inputs, which
  are exact everywhere: a computed value within an ulp of a threshold could go either way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from tests.graphs import make_model

MAX_RANK = 4
MAX_ELEMENTS = 4096
MAX_BOUND = 64.0
FEED_BOUND = 4.0  # inputs are standard normal clipped to this
INT64_MAX, INT64_MIN = 2**63 - 1, -2**63


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    bound: float  # worst-case |value|
    is_input: bool = False  # exact in every implementation: safe to compare or truncate

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class _Graph:
    """The graph being drawn: nodes, constants, and the pool of float32 tensors to pick from."""

    def __init__(self, draw):
        self.draw = draw
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.pool: list[Tensor] = []
        self.consumed: set[str] = set()
        self._count = 0

    def fresh(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def const(self, value) -> str:
        name = self.fresh("c")
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def scalar(self, value: float) -> str:
        return self.const(np.float32(value))

    def node(self, op: str, inputs: list[str], n_outputs: int = 1, **attrs) -> list[str]:
        outputs = [self.fresh(op.lower()) for _ in range(n_outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, **attrs))
        self.consumed.update(inputs)
        return outputs

    def add(self, name: str, shape, bound: float) -> Tensor:
        t = Tensor(name, tuple(int(d) for d in shape), float(bound))
        self.pool.append(t)
        return t

    def pick(self) -> Tensor:
        """Mostly the newest tensor, so ops chain; sometimes any earlier one."""
        if self.draw(st.integers(0, 3)) > 0:
            return self.pool[-1]
        return self.pool[self.draw(st.integers(0, len(self.pool) - 1))]

    def ints(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def axis(self, rank: int, axis: int) -> int:
        """axis as given or as its negative alias: both spellings must work."""
        return axis - rank if self.draw(st.booleans()) else axis


# ---- shapes --------------------------------------------------------------------------------

def broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    out = []
    for dims in zip(*padded):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            return None
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def _fits(shape) -> bool:
    return shape is not None and len(shape) <= MAX_RANK and math.prod(shape) <= MAX_ELEMENTS


def _partner_shape(g: _Graph, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts with `shape`: each dim kept, set to 1, or (where 1) grown."""
    out = []
    for d in shape:
        choice = g.ints(0, 2)
        if choice == 2 and d == 1:
            out.append(g.ints(2, 4))
        else:
            out.append(d if choice == 0 else 1)
    if len(out) < MAX_RANK and g.draw(st.booleans()):
        out.insert(0, g.ints(1, 3))
    while len(out) > 1 and g.draw(st.integers(0, 3)) == 0:
        out.pop(0)  # lower rank: broadcasting right-aligns
    return tuple(out)


def _constant(g: _Graph, shape: tuple[int, ...]) -> Tensor:
    rng = np.random.default_rng(g.ints(0, 2**16))
    value = rng.uniform(-2, 2, shape).astype(np.float32)
    return Tensor(g.const(value), shape, 2.0)


def _partner(g: _Graph, a: Tensor) -> Tensor:
    """A second operand broadcastable with a: from the pool, a itself, or a new constant."""
    options = [t for t in g.pool if _fits(broadcast(a.shape, t.shape))]
    kind = g.ints(0, 2)
    if kind == 0 and options:
        return options[g.ints(0, len(options) - 1)]
    if kind == 1:
        return a
    return _constant(g, _partner_shape(g, a.shape))


# ---- elementwise ---------------------------------------------------------------------------

def _unary_chain(g: _Graph, x: Tensor, steps, bound: float) -> bool:
    """steps: (op, extra inputs, attrs) applied in order to x."""
    name = x.name
    for op, extra, attrs in steps:
        name = g.node(op, [name, *extra], **attrs)[0]
    g.add(name, x.shape, bound)
    return True


def _simple_unary(op: str, bound_fn):
    def build(g: _Graph) -> bool:
        x = g.pick()
        return _unary_chain(g, x, [(op, [], {})], bound_fn(x.bound))
    build.__name__ = op
    return build


def _exp(g: _Graph) -> bool:
    x = g.pick()
    clip = ("Clip", [g.scalar(-3.0), g.scalar(3.0)], {})
    return _unary_chain(g, x, [clip, ("Exp", [], {})], math.exp(3.0))


def _log(g: _Graph) -> bool:
    x = g.pick()
    steps = [("Abs", [], {}), ("Add", [g.scalar(1.0)], {}), ("Log", [], {})]
    return _unary_chain(g, x, steps, math.log(x.bound + 1))


def _sqrt(g: _Graph) -> bool:
    x = g.pick()
    steps = [("Abs", [], {}), ("Add", [g.scalar(0.01)], {}), ("Sqrt", [], {})]
    return _unary_chain(g, x, steps, math.sqrt(x.bound + 0.01))


def _clip(g: _Graph) -> bool:
    x = g.pick()
    lo, hi = sorted(g.draw(st.sampled_from([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0]))
                    for _ in range(2))
    hi = hi if hi > lo else lo + 1.0
    kind = g.ints(0, 2)  # both bounds, min only, max only ("" skips an optional input)
    lo, hi = [(lo, hi), (lo, None), (None, hi)][kind]
    extra = ["" if v is None else g.scalar(v) for v in (lo, hi)]
    ends = np.clip([-x.bound, x.bound], lo, hi)  # clipping is monotonic: the ends bound it
    return _unary_chain(g, x, [("Clip", extra, {})], float(np.abs(ends).max()))


def _cast(g: _Graph) -> bool:
    x = g.pick()
    if x.is_input:  # exact values: truncation and fp16 rounding agree everywhere
        via = g.draw(st.sampled_from([TensorProto.INT32, TensorProto.FLOAT16]))
    else:  # computed values: only a lossless round trip
        via = TensorProto.DOUBLE
    steps = [("Cast", [], {"to": via}), ("Cast", [], {"to": TensorProto.FLOAT})]
    return _unary_chain(g, x, steps, x.bound)


BINARY_BOUNDS = {
    "Add": lambda a, b: a + b, "Sub": lambda a, b: a + b, "Mul": lambda a, b: a * b,
    "Div": lambda a, b: a, "Max": max, "Min": max,
}


def _binary(g: _Graph) -> bool:
    op = g.draw(st.sampled_from(sorted(BINARY_BOUNDS)))
    a = g.pick()
    b = _partner(g, a)
    shape, bound = broadcast(a.shape, b.shape), BINARY_BOUNDS[op](a.bound, b.bound)
    if not _fits(shape) or bound > MAX_BOUND:
        return False
    rhs = b.name
    if op == "Div":  # a / (|b| + 1): the divisor stays >= 1
        rhs = g.node("Add", [g.node("Abs", [b.name])[0], g.scalar(1.0)])[0]
    g.add(g.node(op, [a.name, rhs])[0], shape, bound)
    return True


def _where(g: _Graph) -> bool:
    a = g.pick()
    b = _partner(g, a)
    inputs = [t for t in g.pool if t.is_input]
    lhs = inputs[g.ints(0, len(inputs) - 1)]
    rhs_options = [t for t in inputs if broadcast(lhs.shape, t.shape)]
    if g.draw(st.booleans()):
        rhs = rhs_options[g.ints(0, len(rhs_options) - 1)]
    else:
        rhs = Tensor(g.scalar(g.draw(st.sampled_from([-0.5, 0.0, 0.5]))), (), 0.0)
    shape = broadcast(lhs.shape, rhs.shape, a.shape, b.shape)
    if not _fits(shape) or lhs is rhs:
        return False
    compare = g.draw(st.sampled_from(["Less", "Greater", "LessOrEqual", "GreaterOrEqual"]))
    cond = g.node(compare, [lhs.name, rhs.name])[0]
    g.add(g.node("Where", [cond, a.name, b.name])[0], shape, max(a.bound, b.bound))
    return True


# ---- movement ------------------------------------------------------------------------------

def _factor_shape(g: _Graph, size: int) -> list[int]:
    """A random shape of rank 1-4 with `size` elements."""
    rank = g.ints(1, MAX_RANK)
    dims = [1] * rank
    n, p = size, 2
    while n > 1:
        while n % p:
            p += 1
        dims[g.ints(0, rank - 1)] *= p
        n //= p
    return dims


def _reshape(g: _Graph) -> bool:
    x = g.pick()
    dims = _factor_shape(g, x.size)
    spec = list(dims)
    special = g.ints(0, 2)
    if special == 1:
        spec[g.ints(0, len(spec) - 1)] = -1
    elif special == 2:  # 0 copies the input's dim at that position (allowzero=0)
        same = [i for i in range(min(len(dims), len(x.shape))) if dims[i] == x.shape[i]]
        if same:
            spec[same[g.ints(0, len(same) - 1)]] = 0
    out = g.node("Reshape", [x.name, g.const(np.array(spec, np.int64))])[0]
    g.add(out, dims, x.bound)
    return True


def _transpose(g: _Graph) -> bool:
    x = g.pick()
    perm = g.draw(st.permutations(list(range(len(x.shape)))))
    g.add(g.node("Transpose", [x.name], perm=perm)[0], [x.shape[p] for p in perm], x.bound)
    return True


def _expand(g: _Graph) -> bool:
    x = g.pick()
    target = _partner_shape(g, x.shape)
    shape = broadcast(x.shape, target)
    if not _fits(shape):
        return False
    g.add(g.node("Expand", [x.name, g.const(np.array(target, np.int64))])[0], shape, x.bound)
    return True


def _pad(g: _Graph) -> bool:
    x = g.pick()
    mode = g.draw(st.sampled_from(["constant", "edge", "reflect"]))
    begins, ends = [], []
    for d in x.shape:
        # reflect mirrors without repeating the edge, so it needs pad < dim; negative pads
        # (cropping) are spec'd for every mode but only constant mode is exercised here.
        hi = min(2, d - 1) if mode == "reflect" else 2
        lo = -1 if mode == "constant" and d > 1 else 0
        begins.append(g.ints(lo, max(lo, hi)))
        ends.append(g.ints(lo, max(lo, hi)))
    shape = [d + b + e for d, b, e in zip(x.shape, begins, ends)]
    if min(shape) < 1 or not _fits(shape):
        return False
    inputs = [x.name, g.const(np.array(begins + ends, np.int64))]
    bound = x.bound
    if mode == "constant" and g.draw(st.booleans()):
        value = g.draw(st.sampled_from([-1.5, 0.5, 2.0]))
        inputs.append(g.scalar(value))
        bound = max(bound, abs(value))
    g.add(g.node("Pad", inputs, mode=mode)[0], shape, bound)
    return True


def onnx_slice_len(dim: int, start: int, end: int, step: int) -> int:
    """ONNX Slice semantics (which differ from Python's for a start before the beginning with a
    negative step: ONNX clamps it to 0, Python yields nothing)."""
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        return max(0, -(-(end - start) // step))
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return max(0, -(-(start - end) // -step))


def _slice_bound(g: _Graph, dim: int) -> int:
    choice = g.ints(0, 3)
    if choice == 0:
        return g.draw(st.sampled_from([INT64_MAX, INT64_MIN]))
    return g.ints(-dim - 2, dim + 2)


def _slice(g: _Graph) -> bool:
    x = g.pick()
    rank = len(x.shape)
    axes = g.draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    shape = list(x.shape)
    starts, ends, steps = [], [], []
    for axis in axes:
        dim = x.shape[axis]
        step = g.draw(st.sampled_from([1, 1, 2, 3, -1, -2]))
        start, end = _slice_bound(g, dim), _slice_bound(g, dim)
        n = onnx_slice_len(dim, start, end, step)
        if n == 0:  # keep tensors non-empty: take the whole axis in this direction instead
            start, end = (0, INT64_MAX) if step > 0 else (-1, INT64_MIN)
            n = onnx_slice_len(dim, start, end, step)
        starts.append(start), ends.append(end), steps.append(step)
        shape[axis] = n
    inputs = [x.name, g.const(np.array(starts, np.int64)), g.const(np.array(ends, np.int64))]
    unit_steps = all(s == 1 for s in steps)
    # axes and steps are optional inputs: leave them out where the defaults (axes 0..k-1,
    # steps 1) say the same, sometimes.
    if axes != list(range(len(axes))) or not unit_steps or g.draw(st.booleans()):
        inputs.append(g.const(np.array([g.axis(rank, a) for a in axes], np.int64)))
        if not unit_steps or g.draw(st.booleans()):
            inputs.append(g.const(np.array(steps, np.int64)))
    g.add(g.node("Slice", inputs)[0], shape, x.bound)
    return True


def _flatten(g: _Graph) -> bool:
    x = g.pick()
    rank = len(x.shape)
    axis = g.ints(0, rank)
    shape = (math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))
    spelled = g.axis(rank, axis) if 0 < axis < rank else axis  # -rank is 0; rank has no alias
    g.add(g.node("Flatten", [x.name], axis=spelled)[0], shape, x.bound)
    return True


def _squeeze(g: _Graph) -> bool:
    x = g.pick()
    rank = len(x.shape)
    ones = [i for i, d in enumerate(x.shape) if d == 1]
    most = len(ones) if len(ones) < rank else len(ones) - 1  # rank 0 results are out of scope
    if most == 0:
        return _unsqueeze(g, x)
    axes = g.draw(st.lists(st.sampled_from(ones), min_size=1, max_size=most, unique=True))
    shape = [d for i, d in enumerate(x.shape) if i not in axes]
    inputs = [x.name, g.const(np.array([g.axis(rank, a) for a in axes], np.int64))]
    if len(axes) == len(ones) and g.draw(st.booleans()):
        inputs = inputs[:1]  # no axes: squeeze every 1
    g.add(g.node("Squeeze", inputs)[0], shape, x.bound)
    return True


def _unsqueeze(g: _Graph, x: Tensor | None = None) -> bool:
    x = x or g.pick()
    if len(x.shape) >= MAX_RANK:
        return False
    out_rank = len(x.shape) + g.ints(1, MAX_RANK - len(x.shape))
    axes = g.draw(st.lists(st.integers(0, out_rank - 1), min_size=out_rank - len(x.shape),
                           max_size=out_rank - len(x.shape), unique=True))
    dims = iter(x.shape)
    shape = [1 if i in axes else next(dims) for i in range(out_rank)]
    axes_spelled = [g.axis(out_rank, a) for a in axes]
    g.add(g.node("Unsqueeze", [x.name, g.const(np.array(axes_spelled, np.int64))])[0], shape,
          x.bound)
    return True


def _concat(g: _Graph) -> bool:
    x = g.pick()
    rank = len(x.shape)
    axis = g.ints(0, rank - 1)

    def compatible(t: Tensor) -> bool:
        return len(t.shape) == rank and all(
            a == b for i, (a, b) in enumerate(zip(t.shape, x.shape)) if i != axis)

    parts = [x]
    for _ in range(g.ints(1, 2)):
        options = [t for t in g.pool if compatible(t)]
        if g.draw(st.booleans()):
            parts.append(options[g.ints(0, len(options) - 1)])  # x itself is always an option
        else:
            shape = list(x.shape)
            shape[axis] = g.ints(1, 4)
            parts.append(_constant(g, tuple(shape)))
    shape = list(x.shape)
    shape[axis] = sum(t.shape[axis] for t in parts)
    if not _fits(shape):
        return False
    out = g.node("Concat", [t.name for t in parts], axis=g.axis(rank, axis))[0]
    g.add(out, shape, max(t.bound for t in parts))
    return True


def _split(g: _Graph) -> bool:
    x = g.pick()
    axes = [i for i, d in enumerate(x.shape) if d >= 2]
    if not axes:
        return False
    axis = axes[g.ints(0, len(axes) - 1)]
    dim = x.shape[axis]
    cuts = sorted(g.draw(st.lists(st.integers(1, dim - 1), min_size=1, max_size=2, unique=True)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, dim])]
    outs = g.node("Split", [x.name, g.const(np.array(sizes, np.int64))], n_outputs=len(sizes),
                  axis=g.axis(len(x.shape), axis))
    for name, size in zip(outs, sizes):
        shape = list(x.shape)
        shape[axis] = size
        g.add(name, shape, x.bound)
    return True


# ---- reductions ----------------------------------------------------------------------------

def _reduce(g: _Graph) -> bool:
    op = g.draw(st.sampled_from(["ReduceSum", "ReduceMax", "ReduceMean"]))
    x = g.pick()
    rank = len(x.shape)
    every = g.draw(st.integers(0, 4)) == 0  # no axes: reduce everything
    axes = list(range(rank)) if every else g.draw(
        st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    keepdims = 1 if len(axes) == rank else g.ints(0, 1)  # rank 0 results are out of scope
    count = math.prod(x.shape[a] for a in axes)
    bound = x.bound * count if op == "ReduceSum" else x.bound
    if bound > MAX_BOUND:
        op, bound = "ReduceMean", x.bound
    spelled = np.array([g.axis(rank, a) for a in axes], np.int64)
    inputs, attrs = [x.name], {"keepdims": keepdims}
    if not every and op == "ReduceSum":  # opset 13 made ReduceSum's axes an input
        inputs.append(g.const(spelled))
    elif not every:  # ReduceMax/ReduceMean keep the attribute until opset 18
        attrs["axes"] = [int(a) for a in spelled]
    shape = [1 if i in axes else d for i, d in enumerate(x.shape) if keepdims or i not in axes]
    g.add(g.node(op, inputs, **attrs)[0], shape, bound)
    return True


UNARY = [
    _simple_unary("Relu", lambda b: b), _simple_unary("Neg", lambda b: b),
    _simple_unary("Abs", lambda b: b), _simple_unary("Sigmoid", lambda b: 1.0),
    _simple_unary("Tanh", lambda b: 1.0), _simple_unary("Erf", lambda b: 1.0),
    _exp, _log, _sqrt, _clip, _cast,
]
MOVEMENT = [_reshape, _transpose, _expand, _pad, _slice, _flatten, _squeeze, _unsqueeze,
            _concat, _split]
OPS = UNARY + [_binary, _binary, _binary, _where] + MOVEMENT + [_reduce, _reduce]


# ---- the strategy --------------------------------------------------------------------------

def _input_shapes(draw) -> list[tuple[int, ...]]:
    dims = st.integers(1, 7)
    first = tuple(draw(st.lists(dims, min_size=1, max_size=MAX_RANK)))
    shapes = [first]
    for _ in range(draw(st.integers(0, 2))):
        if draw(st.booleans()):  # related: broadcasts against the first input
            g = _Graph(draw)
            shapes.append(_partner_shape(g, first))
        else:
            shapes.append(tuple(draw(st.lists(dims, min_size=1, max_size=MAX_RANK))))
    return shapes


def _outputs(g: _Graph) -> list[Tensor]:
    """Every dangling tensor (newest three), so no op is dead code, plus maybe one
    intermediate that is also consumed (an output that feeds later ops)."""
    produced = [t for t in g.pool if not t.is_input]
    dangling = [t for t in produced if t.name not in g.consumed][-3:]
    consumed = [t for t in produced if t.name in g.consumed]
    if consumed and g.draw(st.booleans()):
        dangling.insert(0, consumed[g.ints(0, len(consumed) - 1)])
    return dangling


@st.composite
def graph_strategy(draw, max_ops: int = 8):
    """(model, feeds): a random opset-17 graph on float32 inputs, and inputs for it."""
    g = _Graph(draw)
    for i, shape in enumerate(_input_shapes(draw)):
        g.pool.append(Tensor(f"in{i}", shape, FEED_BOUND, is_input=True))
    inputs = list(g.pool)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(OPS))
        if not op(g):
            _simple_unary("Tanh", lambda b: 1.0)(g)
    outputs = _outputs(g)
    model = make_model(g.nodes, [(t.name, t.shape, np.float32) for t in inputs],
                       [(t.name, t.shape, np.float32) for t in outputs], g.initializers)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    feeds = {t.name: np.clip(rng.standard_normal(t.shape), -FEED_BOUND, FEED_BOUND)
             .astype(np.float32) for t in inputs}
    return model, feeds
