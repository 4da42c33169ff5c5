"""Fault injection for mock queue devices, from an environment variable such as

    KEEL_MOCK_FAULTS=hang@3,fault@7,slow@9:40

`KIND@N` applies to timeline value N (the Nth submission of the device, from 1). The kinds and
what a mock does with each are shared by every mock backend (runner/mock.py and the qcom, dsp
and amd simulators): each reads its own variable through `from_env` and asks `Faults.at(value)`
per submission. The cpu and opencl devices, which have no simulator, read the same syntax from
their own variables (KEEL_CPU_FAULTS, KEEL_OPENCL_FAULTS: `listed`) and inject each kind into a
real failure path of their own (runner/cpu.py: a worker's share; runner/opencl.py: the driver's
user events and its refusal of a bad wait list).
  hang@N      submission N never signals (until recover()).
  fault@N     submission N ends in a device fault (DeviceError from wait(); the amd mock: a GPU
              VM fault on the submission's indirect buffer, DeviceError from submit()).
  slow@N:MS   submission N signals MS milliseconds later than it would.
  unplug@N    the device disappears during submission N (the amd mock: the USB enclosure is
              unplugged; every later call is DeviceError until it is plugged back).
  fwerr@N     the Nth firmware load of the device's bring-up is refused (the amd mock's PSP).
"""
from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from enum import StrEnum

from runner.errors import ConfigError



class FaultKind(StrEnum):
    HANG = "hang"
    FAULT = "fault"
    SLOW = "slow"
    UNPLUG = "unplug"
    FWERR = "fwerr"


KINDS = tuple(FaultKind)
_ENTRY = re.compile(r"(hang|fault|unplug|fwerr)@([1-9][0-9]*)|"
                    r"slow@([1-9][0-9]*):([0-9]+(?:\.[0-9]+)?)")


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    ms: float = 0.0  # slow only: the delay


class Faults:
    def __init__(self, by_value: dict[int, Fault]):
        self.by_value = by_value

    def at(self, value: int) -> Fault | None:
        return self.by_value.get(value)


def parse(text: str, var: str, kinds: tuple[FaultKind, ...] = KINDS) -> Faults:
    """Parse a comma-separated fault list; ValueError naming `var`, the entry and the grammar,
    or a kind the reading mock does not inject (`kinds`)."""
    by_value: dict[int, Fault] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        m = _ENTRY.fullmatch(entry)
        if m is None:
            raise ConfigError(f"{var}: bad entry {entry!r}; expected hang@N, fault@N, unplug@N, "
                             f"fwerr@N or slow@N:MS (N >= 1 a submission number, or for "
                             f"fwerr a firmware load; MS >= 0 milliseconds)")
        kind, n, slow_n, ms = m.groups()
        if (kind or "slow") not in kinds:
            raise ConfigError(f"{var}: {entry!r}: this device's mock does not inject "
                             f"{kind or 'slow'}; expected one of {', '.join(kinds)}")
        value = int(n or slow_n)
        if value in by_value:
            raise ConfigError(f"{var}: submission {value} has two faults ({entry!r} and an earlier "
                             f"{by_value[value].kind.value!r}); expected at most one per submission")
        by_value[value] = Fault(FaultKind.SLOW, float(ms)) if slow_n else Fault(FaultKind(kind))
    return Faults(by_value)


def from_env(var: str, kinds: tuple[FaultKind, ...] = KINDS) -> Faults:
    return parse(os.environ.get(var, ""), var, kinds)


def var_of(device: str) -> str:
    """The fault list of a device without a simulator: its own variable, so a list meant for
    a simulated device never reaches the CPU build a test or tools/doctor.py compares with."""
    return f"KEEL_{device.upper()}_FAULTS"


def listed(device: str, kinds: tuple[str, ...] = ("hang", "fault", "slow")) -> Faults | None:
    """KEEL_CPU_FAULTS / KEEL_OPENCL_FAULTS (var_of) for a backend that injects `kinds` into
    its own failure paths: None when it lists none, so a run asks one attribute."""
    faults = from_env(var_of(device), kinds)
    return faults if faults.by_value else None


# Bring-up faults: what a simulator does wrong at one layer of its device's bring-up, so that
# tools/doctor.py's tests can show each of its stages catching the fault it exists for. Read from
#     KEEL_MOCK_BRINGUP=kgsl.open=EPERM,usb.link=down
# by the mock that owns the site, at the call the site names; a site not listed here is a
# ConfigError (a misspelt fault must not pass as a healthy device).
BRINGUP_VAR = "KEEL_MOCK_BRINGUP"
SITES = {
    "kgsl.open": "the mock KGSL's open() fails with this errno name (ENOENT, EPERM, EACCES)",
    "kgsl.chip": "the chip id the mock KGSL reports (hex)",
    "kgsl.context": "context creation fails with this errno name",
    "kgsl.alloc": "GPU object allocation fails with this errno name",
    "kgsl.import": "dma-buf import (a camera buffer) fails with this errno name",
    "gpu.answer": "wrong (or wrong@K: from the Kth dispatch of a submission on): the qcom and "
                  "amd mock GPUs flip the first word each such dispatch writes",
    "gpu.image": "fault: the qcom mock GPU faults on every image access",
    "fastrpc.pd": "the emulated DSP refuses its process (the unsigned PD) with this errno name",
    "fastrpc.answer": "wrong: the emulated DSP's answers flip the first byte of the last io slot",
    "usb.device": "absent: no bridge answers on the mock USB bus",
    "usb.link": "down: the mock bridge's PCIe link never trains (nothing answers behind it)",
    "amd.discovery": "corrupt: the mock GPU's IP discovery table fails its checksum",
    "amd.tlb": "mm or gc: the mock GPU never acknowledges that hub's TLB invalidation",
    "amd.queue": "inactive: the mock GPU ignores the compute queue's activation",
    "amd.huge": "alias: the mock GPU maps every 4 KiB page of a 2 MiB leaf to its first one",
    "fastrpc.memory": "the emulated DSP's shared buffer allocation fails with this errno name",
}


def bringup(site: str) -> str | None:
    """The value KEEL_MOCK_BRINGUP gives `site`, or None."""
    found = None
    for entry in filter(None, (e.strip() for e in os.environ.get(BRINGUP_VAR, "").split(","))):
        name, _, value = entry.partition("=")
        if name not in SITES or not value:
            raise ConfigError(f"{BRINGUP_VAR}: bad entry {entry!r}; expected SITE=VALUE with a "
                              f"site among {', '.join(SITES)}")
        if name == site:
            found = value
    return found


def bringup_from(site: str, word: str) -> int | None:
    """K for `site`=`word`@K (1 for a bare `word`), or None when the site is not set."""
    value = bringup(site)
    if value is None:
        return None
    name, _, k = value.partition("@")
    if name != word or (k and not k.isdigit()) or k == "0":
        raise ConfigError(f"{BRINGUP_VAR}: {site}={value!r}; expected {word} or {word}@K, K >= 1")
    return int(k or 1)


def bringup_errno(site: str) -> int | None:
    """The errno KEEL_MOCK_BRINGUP names for `site` (ConfigError for an unknown name)."""
    name = bringup(site)
    if name is None:
        return None
    code = getattr(errno, name, None)
    if not isinstance(code, int):
        raise ConfigError(f"{BRINGUP_VAR}: {site}={name!r} is not an errno name (EPERM, ...)")
    return code
