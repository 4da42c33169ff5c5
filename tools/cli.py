"""What every keel tool shares: an argument parser whose errors are one line and exit status 2,
and a timer for the benchmarks."""
from __future__ import annotations

import argparse
import sys
import time


class Parser(argparse.ArgumentParser):
    """argparse prints its usage before the error; a keel CLI error is one line (`-h` shows
    the usage)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


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
