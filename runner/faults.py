"""Fault injection for mock queue devices, from an environment variable such as

    KEEL_MOCK_FAULTS=hang@3,fault@7,slow@9:40

`KIND@N` applies to timeline value N (the Nth submission of the device, from 1). The kinds and
what a mock does with each are shared by every mock backend (this one, and the qcom, dsp and amd
mocks to come): each reads its own variable through `from_env` and asks `Faults.at(value)` per
submission.
  hang@N      submission N never signals (until recover()).
  fault@N     submission N ends in a device fault (DeviceError from wait()).
  slow@N:MS   submission N signals MS milliseconds later than it would.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

KINDS = ("hang", "fault", "slow")
_ENTRY = re.compile(r"(hang|fault)@([1-9][0-9]*)|slow@([1-9][0-9]*):([0-9]+(?:\.[0-9]+)?)")


@dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    ms: float = 0.0  # slow only: the delay


class Faults:
    def __init__(self, by_value: dict[int, Fault]):
        self.by_value = by_value

    def at(self, value: int) -> Fault | None:
        return self.by_value.get(value)


def parse(text: str, var: str) -> Faults:
    """Parse a comma-separated fault list; ValueError naming `var`, the entry and the grammar."""
    by_value: dict[int, Fault] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        m = _ENTRY.fullmatch(entry)
        if m is None:
            raise ValueError(f"{var}: bad entry {entry!r}; expected hang@N, fault@N or slow@N:MS "
                             f"(N >= 1 a submission number, MS >= 0 milliseconds)")
        kind, n, slow_n, ms = m.groups()
        value = int(n or slow_n)
        if value in by_value:
            raise ValueError(f"{var}: submission {value} has two faults ({entry!r} and an earlier "
                             f"{by_value[value].kind!r}); expected at most one per submission")
        by_value[value] = Fault("slow", float(ms)) if slow_n else Fault(kind)
    return Faults(by_value)


def from_env(var: str) -> Faults:
    return parse(os.environ.get(var, ""), var)
