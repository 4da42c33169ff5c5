"""What a test group needs from the machine, as marks that skip locally and fail in CI.

    @needs("pocl-opencl-icd", NO_OPENCL)      # NO_OPENCL: why it is missing, or None

Locally a missing dependency skips its tests with the package named in the reason. With CI set,
tests/conftest.py turns exactly these skips into failures, so CI can never go green with a test
group silently not run. Hardware-only tests (tests/device/) use `needs_hardware` instead: no CI
machine has a phone attached, so those skip everywhere and say so.
"""
from __future__ import annotations

import os
import shutil

import pytest

MISSING = "missing dependency"  # the reason prefix conftest.py fails on under CI
HARDWARE = "hardware-only test"
CI = bool(os.environ.get("CI"))


def needs(package: str, missing: str | None):
    """A skip mark, active when `missing` (why the package is unusable) is not None."""
    return pytest.mark.skipif(missing is not None, reason=f"{MISSING} {package}: {missing}")


def needs_tool(package: str, command: str):
    """A command on PATH, from the Debian package `package`."""
    found = shutil.which(command) is not None
    return needs(package, None if found else f"{command} not on PATH")


def needs_hardware(what: str, missing: str | None):
    return pytest.mark.skipif(missing is not None, reason=f"{HARDWARE} ({what}): {missing}")


def opencl_missing() -> str | None:
    from runner.opencl import unavailable_reason
    return unavailable_reason()


needs_clang = needs_tool("clang-19", "clang-19")  # emulated backends: needs_tool("qemu-user", ...)
