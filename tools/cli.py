"""What every keel tool shares: an argument parser whose errors are one line and exit status 2,
and a timer for the benchmarks."""
from __future__ import annotations

import argparse
import re
import sys
import time


class Parser(argparse.ArgumentParser):
    """argparse prints its usage before the error; a keel CLI error is one line (`-h` shows
    the usage)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


# ASCII numerals only: int() and float() also take "1_0", full-width digits, "nan" and "inf"
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def number(kind: type, low, high, low_open: bool = False):
    """An argparse type: an int (kind int) or a finite float in [low, high], or (low, high]
    with low_open. Out of range is a one-line error (Parser.error), never a silent clamp."""
    def parse(text: str):
        ok = (_INT if kind is int else _FLOAT).fullmatch(text.strip())
        x = kind(text) if ok else None
        if x is None or not (low < x if low_open else low <= x) or not x <= high:
            what, fmt = ("an integer", str) if kind is int else ("a number", "{:g}".format)
            raise argparse.ArgumentTypeError(f"expected {what} in {'(' if low_open else '['}"
                                             f"{fmt(low)}, {fmt(high)}], got {text!r}")
        return x
    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


MAX_COUNT = 10**12  # runs, frames: more than a lifetime of 20 Hz frames
positive_int = number(int, 1, MAX_COUNT)
non_negative_int = number(int, 0, MAX_COUNT)


def timeout_ms(text: str) -> float:
    """A run deadline: what Model.run accepts."""
    from runner.model import MAX_TIMEOUT_MS
    return number(float, 0, MAX_TIMEOUT_MS, low_open=True)(text)


def report(result, as_json: bool, text) -> int:
    """A tool's result: one indented JSON object with --json, else `text(result)` prints it."""
    if as_json:
        import json
        print(json.dumps(result, indent=1))
    else:
        text(result)
    return 0


def timed(fn, n: int) -> list[float]:
    """Seconds per call of fn, for n calls."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out
