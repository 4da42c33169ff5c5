"""Typed errors raised by the compiler. Messages name the thing, the expected and the received value."""


class CompileError(Exception):
    """A source could not be compiled for a target (the message carries the compiler's stderr)."""


class StaticInputError(CompileError):
    """A value the compiler needs at compile time (a shape, axes, pads...) depends on graph inputs.
    `inputs` names them: binding them as constants (initializers) makes the model compile."""

    def __init__(self, message: str, inputs: list[str]):
        super().__init__(message)
        self.inputs = inputs
