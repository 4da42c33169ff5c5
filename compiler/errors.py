"""Typed errors raised by the compiler. Messages name the thing, the expected and the received value."""


class CompileError(Exception):
    """A source could not be compiled for a target (the message carries the compiler's stderr)."""
