"""ONNX control flow, built at compile time: If, Loop and Scan.

keel compiles one static graph, so control flow is resolved while the graph is built:
- If: a condition known at compile time (a constant, a value computed from shapes, an input
  frozen with --input-value) builds only the branch it takes. Otherwise both branches are built
  and each output selects between them (WHERE): both run, which needs their outputs to agree in
  shape and dtype; a pair that does not is refused, naming the node.
- Loop: unrolled, when its trip count and its condition at every iteration are known at compile
  time (a `for` loop, a Range's function body). A condition computed from run-time values is
  refused (keel cannot stop at run time).
- Scan (opset 9 on): unrolled over its scan axis, whose length the static shapes give.
Both unroll at most MAX_UNROLL iterations: each is a copy of the body in the graph.

The loader (compiler/onnx/load.py) dispatches these by name (CONTROL) and hands them a Body,
which builds a subgraph in a scope of its own that sees the outer one; nothing here imports the
loader.
"""
from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass
from typing import Callable

import onnx

from compiler.errors import CompileError
from compiler.ir.dtypes import dtypes
from compiler.ir.tensor import Tensor
from compiler.ir.uop import Ops
from compiler.onnx.registry import Ctx

MAX_UNROLL = 1024


@dataclass
class Body:
    """How a control-flow node builds its subgraphs: its Ctx, the scope it sees, the model's
    functions, and the loader's graph builder (initializers and nodes into an env)."""
    ctx: Ctx
    scope: object  # name -> Tensor: the enclosing graph's values
    functions: dict
    build: Callable

    def run(self, graph: onnx.GraphProto, inputs: list = ()) -> list:
        """The subgraph's outputs, with its formal inputs bound to `inputs`."""
        env = ChainMap({f.name: t for f, t in zip(graph.input, inputs)}, self.scope)
        self.build(graph, env, self.ctx, self.functions)
        missing = [o.name for o in graph.output if env.get(o.name) is None]
        if missing:
            raise CompileError(f"{self.ctx.where()}: subgraph {graph.name!r} output(s) "
                               f"{missing} are not produced by any node")
        return [env[o.name] for o in graph.output]

    def graph(self, name: str) -> onnx.GraphProto:
        return next(a.g for a in self.ctx.node.attribute if a.name == name)

    def ints(self, name: str, default: list[int]) -> list[int]:
        a = next((a for a in self.ctx.node.attribute if a.name == name), None)
        return list(a.ints) if a is not None else default


def _if(body: Body, args: list) -> list:
    ctx, cond = body.ctx, args[0]
    if cond is None:
        raise CompileError(f"{ctx.where()}: input cond is required")
    known = ctx.constant(cond)
    if known is not None:
        if known.size != 1:
            raise CompileError(f"{ctx.where()}: its condition has {known.size} elements, not 1")
        return body.run(body.graph("then_branch" if known.reshape(-1)[0] else "else_branch"))
    inputs = sorted({n.arg[0] for n in cond.uop.toposort() if n.op is Ops.INPUT})
    then, other = (_both(body, branch, inputs) for branch in ("then_branch", "else_branch"))
    for name, t, e in zip(ctx.node.output, then, other):
        if not (isinstance(t, Tensor) and isinstance(e, Tensor)) or \
                (t.shape, t.dtype) != (e.shape, e.dtype):
            raise CompileError(
                f"{ctx.where()}: its condition depends on graph input(s) {inputs}, and its "
                f"branches give output {name!r} as {_kind(t)} and {_kind(e)}: keel runs both "
                f"branches and selects, which needs one shape and dtype; freeze the input "
                f"with --input-value NAME=V so the condition folds")
    pick = cond.reshape(())
    return [pick.where(t, e) for t, e in zip(then, other)]


def _both(body: Body, branch: str, inputs: list[str]) -> list:
    """One branch of an If whose condition is known only at run time: both must build."""
    try:
        return body.run(body.graph(branch))
    except CompileError as e:  # a branch written for other inputs: a sample rate's other shapes
        raise CompileError(f"{body.ctx.where()}: its condition depends on graph input(s) "
                           f"{inputs}, so keel builds both branches, and its {branch} does not "
                           f"build here ({e}); freeze the input with --input-value NAME=V so "
                           f"the condition folds") from None


def _kind(t) -> str:
    return f"{t.shape} {t.dtype.name}" if isinstance(t, Tensor) else "no tensor"


def _loop(body: Body, args: list) -> list:
    ctx = body.ctx
    trips_t, cond_t, carried = args[0], args[1] if len(args) > 1 else None, list(args[2:])
    # no trip count: a while loop, unrolled while its condition is known and true
    trips = MAX_UNROLL + 1 if trips_t is None else \
        int(ctx.static(trips_t, "M (the trip count)").reshape(-1)[0])
    cond = cond_t is None or bool(ctx.static(cond_t, "cond").reshape(-1)[0])
    _check_unroll(ctx, trips if trips_t is not None else 0)
    graph, scans, i = body.graph("body"), None, 0
    while i < trips and cond:
        _check_unroll(ctx, i + 1)  # a while loop's
        outs = body.run(graph, [Tensor.full(i, dtypes.int64), Tensor.full(cond, dtypes.bool),
                                *carried])
        known = ctx.constant(outs[0])
        if known is None:
            raise CompileError(f"{ctx.where()}: its body's condition depends on run-time "
                               f"values; keel unrolls loops whose iterations are known")
        cond, carried = bool(known.reshape(-1)[0]), outs[1:1 + len(carried)]
        step = outs[1 + len(carried):]
        scans = [[s] for s in step] if scans is None else [a + [s] for a, s in zip(scans, step)]
        i += 1
    n_scans = len(graph.output) - 1 - len(carried)
    if n_scans and scans is None:
        raise CompileError(f"{ctx.where()}: it runs no iteration, so its scan outputs' shapes "
                           f"are unknown; keel supports loops that run at least once")
    return carried + [_stack(s, 0) for s in scans or []]


def _scan(body: Body, args: list) -> list:
    ctx = body.ctx
    if ctx.opset < 9:
        raise CompileError(f"{ctx.where()}: Scan before opset 9 (a batch axis and "
                           f"sequence_lens) is not supported; opset 9's Scan is")
    n_in = next(a.i for a in ctx.node.attribute if a.name == "num_scan_inputs")
    states, xs = list(args[:len(args) - n_in]), args[len(args) - n_in:]
    in_axes = [a % x.ndim for a, x in zip(body.ints("scan_input_axes", [0] * n_in), xs)]
    in_dirs = body.ints("scan_input_directions", [0] * n_in)
    lengths = {x.shape[a] for x, a in zip(xs, in_axes)}
    if len(lengths) != 1:
        raise CompileError(f"{ctx.where()}: its scan inputs have different lengths {lengths}")
    (length,) = lengths
    _check_unroll(ctx, length)
    graph, steps = body.graph("body"), []
    for t in range(length):
        slices = [_at(x, a, length - 1 - t if d else t) for x, a, d in zip(xs, in_axes, in_dirs)]
        outs = body.run(graph, [*states, *slices])
        states = outs[:len(states)]
        steps.append(outs[len(states):])
    n_out = len(graph.output) - len(states)
    out_axes = body.ints("scan_output_axes", [0] * n_out)
    out_dirs = body.ints("scan_output_directions", [0] * n_out)
    outs = []
    for j in range(n_out):
        seq = [s[j] for s in steps]
        outs.append(_stack(seq[::-1] if out_dirs[j] else seq, out_axes[j]))
    return states + outs


def _check_unroll(ctx: Ctx, n: int) -> None:
    if n > MAX_UNROLL:
        raise CompileError(f"{ctx.where()}: {n} iterations; keel unrolls at most {MAX_UNROLL} "
                           f"(each is a copy of the body)")


def _at(x: Tensor, axis: int, i: int) -> Tensor:
    """x's slice at index i of `axis`, without that axis."""
    part = x.shrink([(i, i + 1) if d == axis else (0, s) for d, s in enumerate(x.shape)])
    return part.reshape(x.shape[:axis] + x.shape[axis + 1:])


def _stack(seq: list[Tensor], axis: int) -> Tensor:
    axis %= seq[0].ndim + 1
    return Tensor.cat([s.unsqueeze(axis) for s in seq], axis)


CONTROL = {"If": _if, "Loop": _loop, "Scan": _scan}
