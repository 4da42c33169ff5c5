"""The on-disk compile cache: built kernels and their objects, so a recompile redoes only what
changed.

Its root and its writes are runner/cache.py's, the one policy of every keel cache (KEEL_CACHE_DIR,
default ~/.cache/keel; KEEL_CACHE_DIR="" turns it off). Each layer is a folder of files named by
a key that already says everything the entry depends on:
  kernels/  a built kernel (plan, linear program, weight permutations), keyed by the canonical
            kernel's structure, its parameters, the target and the codegen sources (`code_digest`)
  objects/  one compiled batch of kernels (or the entry points) as an object file, keyed by its
            C source, the compile command and the C compiler's version (toolchain.py)
  units/    per kernel (keyed by its C source, the command and the compiler's version): the key
            of an object that holds it
  valid/    a model file that onnx's checker and shape inference passed, keyed by its bytes and
            onnx's version (a recompile skips checking it again)
Entries are written atomically (runner/cache.py: write), so concurrent compiles (pytest workers)
never read a half-written entry.
"""
from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

from compiler.ir.uop import UOp, Weight
from runner.cache import root, write

ROOT = Path(__file__).resolve().parent
# the frontend only decides which kernels exist; a kernel's lowering reads none of it
NOT_CODEGEN = ("onnx",)


def get(layer: str, key: str) -> bytes | None:
    r = root()
    if r is None:
        return None
    try:
        return (r / layer / key).read_bytes()
    except OSError:  # absent, or unreadable: a miss either way
        return None


def has(layer: str, key: str) -> bool:
    r = root()
    return r is not None and (r / layer / key).is_file()


def put(layer: str, key: str, data: bytes) -> None:
    r = root()
    if r is None:
        return
    write(r / layer / key, data)


@cache
def code_digest() -> str:
    """Hash of the compiler sources a built kernel can depend on: all of compiler/ but the
    frontend (an edit there changes which kernels exist, not how one is built)."""
    h = hashlib.sha256()
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in NOT_CODEGEN:
            continue
        h.update(str(rel).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def graph_digest(root_uop: UOp, h) -> bool:
    """Feed a UOp graph's structure into hash `h`: ops, dtypes, args and source positions (not
    object identities, which differ between processes). Weights hash by their bytes. False when
    some arg has no stable spelling (its repr names an address): such a graph is not cached."""
    order = root_uop.toposort()
    pos = {u: i for i, u in enumerate(order)}
    for u in order:
        arg = u.arg
        if isinstance(arg, Weight):
            arg = (arg.data.dtype.str, arg.data.shape, hashlib.sha256(arg.data.tobytes()).hexdigest())
        text = f"{u.op.name} {u.dtype!r} {[pos[s] for s in u.src]} {arg!r}\n"
        if " at 0x" in text:
            return False
        h.update(text.encode())
    return True
