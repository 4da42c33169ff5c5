"""One renderer per kernel language; each consumes the same linearized UOps."""
from __future__ import annotations


def get_renderer(target):
    if target.renderer == "c":
        from compiler.renderers.c import CRenderer
        return CRenderer(target)
    if target.renderer == "opencl":
        from compiler.renderers.opencl import OpenCLRenderer
        return OpenCLRenderer(target)
    raise ValueError(f"no renderer {target.renderer!r}")
