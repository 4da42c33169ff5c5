"""Which CPU targets this host runs, and which variant of a blob it loads.

A `cpu` blob holds one build per x86-64 level (cpu-avx2: x86-64-v3, cpu-avx512: x86-64-v4);
`choose` picks the widest one the host's CPU flags allow, or the one KEEL_CPU_VARIANT names.
Standard library only: runner/blob.py asks before it loads anything.
"""
from __future__ import annotations

import functools
import os
import platform

from runner.errors import ConfigError
from runner.targets import hosts

VARIANT_VAR = "KEEL_CPU_VARIANT"
# narrow to wide within each machine (runner/targets.py): choose() prefers the last one a host runs
HOSTS = hosts()


def parse_flags(cpuinfo: str) -> set[str] | None:
    """The first `flags` line of /proc/cpuinfo text (x86), or None when it has none."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            return set(line.split(":", 1)[1].split())
    return None


@functools.cache
def cpu_flags() -> set[str] | None:
    """This host's CPU flags, or None where /proc/cpuinfo cannot tell (another OS). Read once
    per process, and only up to the first CPU's flags: the kernel formats the file a CPU at a
    time, and on many-core hosts each one costs (it samples the core's clock)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return parse_flags(line)
    except OSError:
        pass
    return None


def machine_targets() -> list[str]:
    """CPU targets for this OS and machine, narrow to wide (the order HOSTS lists them)."""
    system, machine = platform.system(), platform.machine()
    return [t for t, h in HOSTS.items() if h.system == system and machine in h.machines]


def missing_flags(target: str, flags: set[str] | None) -> list[str]:
    """The CPU features `target`'s code uses that `flags` lacks; unknown flags (None) lack
    nothing: the target is trusted, as a blob compiled for this machine was."""
    return [] if flags is None else [f for f in HOSTS[target].cpu_flags if f not in flags]


def _widest(targets: list[str], flags: set[str] | None) -> str | None:
    """The last (widest) of `targets` whose features `flags` all has (None: trusted)."""
    fits = [t for t in targets if not missing_flags(t, flags)]
    return fits[-1] if fits else None


def best_host_target() -> str | None:
    """The widest CPU target this host runs, by its flags (None: no CPU target runs here)."""
    return _widest(machine_targets(), cpu_flags())


def choose(variants: list[str], flags: set[str] | None = None) -> str:
    """The variant of a blob this host loads: the one KEEL_CPU_VARIANT names (ConfigError if
    the blob has none of that name), else the widest this machine runs whose features `flags`
    (default: this host's) all has. Where the flags are unknown, the narrowest one runnable
    here, since a wider one could fault. A blob of one variant, or none runnable here, gives
    the first: loading it then says why it cannot run."""
    if len(variants) == 1:
        return variants[0]
    forced = os.environ.get(VARIANT_VAR, "").strip()
    if forced:
        if forced not in variants:
            raise ConfigError(f"{VARIANT_VAR}={forced!r}: expected one of this blob's variants "
                              f"{variants}")
        return forced
    here = [t for t in machine_targets() if t in variants]
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return here[0] if here else variants[0]
    return _widest(here, flags) or variants[0]
