"""Buffer layouts chosen after scheduling, for targets with `cpu_layouts`: which tensors are
stored channels-last, which reductions write straight into a padded tensor's interior or over a
residual they read, and how a kernel reads its buffers in those layouts (`canonical`).

A layout is chosen per buffer, so every kernel touching a buffer agrees on it; `canonical`
expresses the choice in the IR as permutes around numbered placeholders, so the kernels that
differ only in which buffers they touch share one program.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from compiler.ir.rewrite import substitute
from compiler.ir.tensor import Tensor
from compiler.ir.uop import ALU, Ops, UOp
from compiler.ir.kernel import Kernel, find_reduce
from compiler.schedule.fusion import inlined


def channels_last(kernels: list[Kernel], realized: set, keep: set) -> set[UOp]:
    """Tensors to store channels-last (NHWC): the input and output of every 2-D window
    reduction (conv or pool). There a conv's vector of output channels is one store (in NCHW,
    a scatter 784 floats apart), its input pixel's channels are one contiguous run, rows of 7,
    14 or 28 pixels need not be whole vectors, and a depthwise window reads whole channel
    vectors instead of gathers. Elementwise kernels over a channels-last tensor (a residual
    add, a squeeze-excite scale) store channels-last too, and so do their same-shape inputs:
    they stay plain vector code instead of becoming transposes.
    `keep`: tensors whose layout is fixed (graph inputs and outputs)."""
    out = set()

    def take(*us):
        out.update(u for u in us if u in realized and u.op not in (Ops.INPUT, Ops.WEIGHT)
                   and u not in keep and len(u.shape) == 4 and u.shape[1] > 1)
    reds = [find_reduce(k.root, realized) for k in kernels]
    # a conv whose every reader only copies it into a graph output (cuts off the channels a
    # padded weight added, compiler/algorithms.py _pad_out) stores as the output does: the copy
    # is then contiguous, not a transpose (docs/perf.md)
    readers: dict[UOp, list[int]] = {}
    for i, k in enumerate(kernels):
        for u in k.inputs:
            readers.setdefault(u, []).append(i)

    def to_outputs(u: UOp) -> bool:
        return all(kernels[i].root in keep and reds[i] is None for i in readers.get(u, ()))
    for k, red in zip(kernels, reds):
        if red is None:
            if any(u in out and u.shape == k.root.shape for u in k.inputs):
                take(k.root)
            continue
        for n in inlined(k.root, realized):
            if n.op is Ops.WINDOW:
                src = n.src[0]
                while src not in realized and src.op in (Ops.PAD, Ops.RESHAPE, Ops.PERMUTE):
                    src = src.src[0]
                take(src)
                if k.root.shape[2:] == n.shape[2:4] and not to_outputs(k.root):  # its output
                    take(k.root)
    # and what feeds an elementwise kernel that stores channels-last, also through a view that
    # keeps batch and channels: Winograd's output transform, whose odd last row is cut off
    # after it (3 rows of 80 pixels over 256 channels: 840 us in NCHW, a scatter per vector)
    for k, red in reversed(list(zip(kernels, reds))):
        if red is None and k.root in out:
            take(*(u for u in k.inputs if u.shape[:2] == k.root.shape[:2]))
    return out


def pad_in_place(kernels: list[Kernel], realized: set, keep: set) -> list[Kernel]:
    """A reduction whose only reader pads it (the padded input of a deep conv, realized by the
    scheduler so the conv reads no bounds checks) stores straight into the padded tensor's
    interior, after a kernel that fills the whole buffer with the pad value: a fill instead of
    a copy, and no buffer for the unpadded tensor. `realized` loses the unpadded tensors.
    `keep`: tensors whose buffers are fixed (graph outputs)."""
    readers = Counter(u for k in kernels for u in k.inputs)
    at = {k.root: i for i, k in enumerate(kernels)}
    out: list[list[Kernel]] = [[k] for k in kernels]
    for i, k in enumerate(kernels):
        pad = k.root
        src = pad.src[0] if pad.op is Ops.PAD else None
        if src is None or k.inputs != [src] or src not in at or readers[src] != 1 \
                or pad in keep or src in keep or find_reduce(src, realized) is None:
            continue
        j = at[src]
        realized.discard(src)
        fill = Tensor.full(pad.arg[1], pad.dtype, (pad.size,)).uop  # flat: whole vectors
        out[j] = [Kernel(f"{kernels[j].name}_fill", fill, [], into=pad),
                  Kernel(kernels[j].name, pad, kernels[j].inputs)]
        out[i] = []
    return [k for ks in out for k in ks]


def in_place(kernels: list[Kernel], realized: set, last: set, keep: set) -> list[Kernel]:
    """A reduction whose epilogue adds a tensor at its own output position (a residual), as that
    tensor's last reader, writes its result over it: each output line is read and written in
    one visit instead of streaming a second tensor through the caches. Same shape, dtype and
    layout, and only elementwise paths from the root to it, so every element is read before
    the store that replaces it, by the thread that stores it."""
    last_reader = {u: i for i, k in enumerate(kernels) for u in k.inputs}

    def over(i: int, k: Kernel, r: UOp) -> bool:
        return (last_reader[r] == i and r in realized and r not in keep
                and r.op not in (Ops.INPUT, Ops.WEIGHT) and r.shape == k.root.shape
                and r.dtype == k.root.dtype and (r in last) == (k.root in last)
                and _elementwise(k.root, r, realized))
    out = []
    for i, k in enumerate(kernels):
        if k.into is None and k.root not in keep and find_reduce(k.root, realized) is not None:
            k = replace(k, into=next((r for r in k.inputs if over(i, k, r)), None))
        out.append(k)
    return out


def _elementwise(root: UOp, r: UOp, realized: set) -> bool:
    """Whether the kernel computing `root` reads `r` only along paths of ALU ops from the root,
    so at its own output index: not inside its reduction, not through a view."""
    stack, seen, found = [(root, True)], set(), False
    while stack:
        n, direct = stack.pop()
        if (n, direct) in seen:
            continue
        seen.add((n, direct))
        direct = direct and n.op in ALU
        for s in n.src:
            if s is r:
                if not direct:
                    return False
                found = True
            elif s not in realized:
                stack.append((s, direct))
    return found


def canonical(k: Kernel, layouts: list, last: set) -> tuple[tuple, Kernel]:
    """The kernel with its reads replaced by its parameters (Ops.PARAM), keyed with how each buffer is
    stored: kernels that differ only in which buffers they touch share one program. Tensors in
    `last` are stored channels-last: read through a permute of their placeholder, written
    through a permute of the root."""
    # a tensor the kernel overwrites in place (in_place) is read through the output
    # pointer: one pointer per memory, so `restrict` on every parameter stays true
    params = [UOp(Ops.PARAM, u.dtype, (), (0 if u is k.into else j + 1,
                                           _stored(u.shape, u in last)))
              for j, u in enumerate(k.inputs)]
    holes = {u: _permute(p, _order(len(u.shape), inverse=True)) if u in last else p
             for u, p in zip(k.inputs, params)}
    root = substitute(k.root, holes)
    if k.root in last:
        root = _permute(root, _order(len(root.shape)))
    key = (root, tuple(layouts))
    return key, Kernel(k.name, root, params)


def _order(ndim: int, inverse: bool = False) -> tuple[int, ...]:
    """Channels (dim 1) last, or back."""
    last = (0,) + tuple(range(2, ndim)) + (1,)
    return tuple(last.index(i) for i in range(ndim)) if inverse else last


def _permute(u: UOp, order: tuple) -> UOp:
    return UOp(Ops.PERMUTE, u.dtype, (u,), order)


def _stored(shape: tuple, last: bool) -> tuple:
    return tuple(shape[i] for i in _order(len(shape))) if last else shape
