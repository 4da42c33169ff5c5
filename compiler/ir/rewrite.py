"""The one rewrite engine: patterns as data (UPat -> function), applied bottom-up to a fixpoint.

A new optimization is a new rule in some PatternMatcher, not a new pass class.
"""
from __future__ import annotations

from typing import Callable

from compiler.ir.uop import COMMUTATIVE, Ops, UOp

_ANY = object()


class UPat:
    __slots__ = ("ops", "dtypes", "src", "arg", "name", "flat")

    def __init__(self, op=None, dtype=None, src: tuple | None = None, arg=_ANY,
                 name: str | None = None):
        self.ops = None if op is None else frozenset(op if isinstance(op, (set, frozenset, tuple))
                                                     else (op,))
        self.dtypes = None if dtype is None else frozenset(
            dtype if isinstance(dtype, (set, frozenset, tuple)) else (dtype,))
        self.src, self.arg, self.name = src, arg, name
        self.flat = src is not None and all(p.src is None for p in src)

    @staticmethod
    def var(name: str | None = None, dtype=None) -> UPat:
        return UPat(dtype=dtype, name=name)

    @staticmethod
    def cvar(name: str | None = None, dtype=None) -> UPat:
        return UPat(Ops.CONST, dtype, name=name)

    def match_flat(self, u: UOp) -> list[dict]:
        """match(u, {}) for a pattern whose sources have no sources of their own (most rules:
        "x + c", "where(c, a, b)"): the same matches in the same order, without recursion."""
        if self.ops is not None and u.op not in self.ops or len(self.src) != len(u.src) or \
                self.dtypes is not None and u.dtype not in self.dtypes or \
                self.arg is not _ANY and self.arg != u.arg:
            return []
        orders = (u.src, u.src[::-1]) if u.op in COMMUTATIVE and len(u.src) == 2 and \
            u.src[0] is not u.src[1] else (u.src,)
        out = []
        for srcs in orders:
            caps = {} if self.name is None else {self.name: u}
            for p, s in zip(self.src, srcs):
                if p.ops is not None and s.op not in p.ops or \
                        p.dtypes is not None and s.dtype not in p.dtypes or \
                        p.arg is not _ANY and p.arg != s.arg:
                    break
                if p.name is not None:
                    bound = caps.get(p.name)
                    if bound is not None and bound is not s:
                        break
                    caps[p.name] = s
            else:
                out.append(caps)
        return out

    def match(self, u: UOp, caps: dict) -> list[dict]:
        """Every way `u` matches (commutative ops try both source orders)."""
        if self.ops is not None and u.op not in self.ops:
            return []
        if self.dtypes is not None and u.dtype not in self.dtypes:
            return []
        if self.arg is not _ANY and self.arg != u.arg:
            return []
        if self.name is not None:
            bound = caps.get(self.name)
            if bound is not None and bound is not u:
                return []
            caps = {**caps, self.name: u}
        if self.src is None:
            return [caps]
        if len(self.src) != len(u.src):
            return []
        out = _match_all(self.src, u.src, caps)
        if u.op in COMMUTATIVE and len(u.src) == 2 and u.src[0] is not u.src[1]:
            out += _match_all(self.src, u.src[::-1], caps)
        return out


def _match_all(pats, srcs, caps) -> list[dict]:
    found = [caps]
    for p, s in zip(pats, srcs):
        found = [c2 for c in found for c2 in p.match(s, c)]
        if not found:
            break
    return found


Rule = tuple[UPat, Callable[..., UOp | None]]


class PatternMatcher:
    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self.by_op: dict[Ops, list[Rule]] = {op: [] for op in Ops}
        for pat, fn in rules:
            for op in (pat.ops if pat.ops is not None else Ops):
                self.by_op[op].append((pat, fn))

    def __add__(self, other: PatternMatcher) -> PatternMatcher:
        return PatternMatcher(self.rules + other.rules)

    def rewrite(self, u: UOp, ctx=None) -> UOp | None:
        for pat, fn in self.by_op[u.op]:
            if pat.src is None and pat.arg is _ANY:  # most rules: one op, maybe a dtype, a name
                if pat.dtypes is not None and u.dtype not in pat.dtypes:
                    continue
                found = [{pat.name: u} if pat.name is not None else {}]
            elif pat.flat:
                found = pat.match_flat(u)
            else:
                found = pat.match(u, {})
            for caps in found:
                out = fn(ctx, **caps) if ctx is not None else fn(**caps)
                if out is not None and out is not u:
                    return out
        return None


class Rewriter:
    """Rewrites nodes bottom-up until no rule applies, remembering every answer across calls.

    The answer for a node depends only on the node (rules see nothing else), and rewriting a node
    gives the same answer as rewriting it after its sources were rewritten. So a builder may hand
    each piece to the same Rewriter as it builds (lower.py does): copies that become equal once
    simplified are then one node, and nothing is simplified twice, with the same result as
    rewriting the whole graph at the end."""

    def __init__(self, pm: PatternMatcher, ctx=None):
        self.pm, self.ctx = pm, ctx
        self.memo: dict[UOp, UOp] = {}

    def __call__(self, root: UOp) -> UOp:
        """Iterative: graphs can be very deep."""
        memo, pm, ctx = self.memo, self.pm, self.ctx
        if root in memo:
            return memo[root]
        stack: list[tuple[UOp, int, UOp | None]] = [(root, 0, None)]
        while stack:
            node, stage, pending = stack.pop()
            if stage == 0:
                if node in memo:
                    continue
                stack.append((node, 1, None))
                stack.extend((s, 0, None) for s in node.src if s not in memo)
            elif stage == 1:
                src = tuple(memo[s] for s in node.src)
                built = node if src == node.src else UOp(node.op, node.dtype, src, node.arg)
                out = pm.rewrite(built, ctx)
                if out is None:
                    memo[node] = memo[built] = built
                else:
                    stack.append((node, 2, out))
                    stack.append((out, 0, None))
            else:
                memo[node] = memo[pending]
        return memo[root]


def graph_rewrite(root: UOp, pm: PatternMatcher, ctx=None) -> UOp:
    """Rewrite every node bottom-up until no rule applies."""
    return Rewriter(pm, ctx)(root)


def substitute(root: UOp, mapping: dict[UOp, UOp], shared: bool = False) -> UOp:
    """Replace nodes by identity (no pattern matching); used to bind placeholders. One
    post-order walk that rebuilds as it goes, and stops at the nodes it replaces (what is below
    them is not needed). shared: `mapping` also keeps every answer, so calls on several roots
    with one mapping (which may grow between them, by nodes not yet walked) walk each node
    once."""
    memo: dict[UOp, UOp] = mapping if shared else dict(mapping)
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if node in memo:
            continue
        if done:
            src = tuple([memo[s] for s in node.src])
            memo[node] = node if src == node.src else UOp(node.op, node.dtype, src, node.arg)
        else:
            stack.append((node, True))
            stack.extend([(s, False) for s in node.src if s not in memo])
    return memo[root]
