"""Freestanding C: every kernel plus one graph entry point in a single translation unit.

The entry point is the CPU "command buffer": one call from the runner executes the whole model.
"""
from __future__ import annotations

from compiler.artifact import Buffer, Launch
from compiler.dtypes import dtypes
from compiler.renderers.cstyle import CStyle
from compiler.uop import UOp

ENTRY = "keel_graph"


class CRenderer(CStyle):
    def render_program(self, kernels: list[tuple[str, list[UOp]]], launches: list[Launch],
                       buffers: dict[int, Buffer]) -> str:
        body = [self.render_kernel(name, lin) for name, lin in kernels]
        calls = [f"  {ln.kernel}({', '.join(self._arg(buffers[b]) for b in ln.args)});"
                 for ln in launches]
        entry = (f"void {ENTRY}(unsigned char *arena, const unsigned char *weights, "
                 f"void *const *io) {{\n" + "\n".join(calls) + "\n}\n")
        return "\n".join(body) + "\n" + entry

    def _arg(self, b: Buffer) -> str:
        ty = dtypes.from_np(b.dtype).cname
        if b.region == "arena":
            return f"({ty} *)(arena + {b.offset})"
        if b.region == "weights":
            return f"({ty} *)(weights + {b.offset})"
        return f"({ty} *)io[{b.offset}]"
