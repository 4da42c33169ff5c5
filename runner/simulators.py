"""Which simulator stands in for a piece of hardware: one switch per hardware interface, read from
the environment and resolved here, for every backend.

  KEEL_KGSL=mock     the KGSL driver under qcom/ -> sim/qcom/mock_kgsl.py (a mock KGSL whose
                     GPU executes every dispatch)
  KEEL_FASTRPC=mock  FastRPC under dsp/ -> sim/dsp/mock.py (dsp's runtime under qemu-hexagon)
  KEEL_USB=mock      libusb under usbgpu/ -> sim/am/mock_device.py (a mock ASM2464 bridge,
                     sim/usb/mock.py, with a mock RX 7900 behind it)

Unset, empty or "device": the hardware. The simulators are the `sim` package, which an
on-device install leaves out (README.md, "Layout"); the runtime imports a simulator only here,
and only when its variable asks for it.
"""
from __future__ import annotations

import importlib
import os

from runner.errors import ConfigError

# variable -> "module:attribute" of what stands in for the hardware when it is "mock"
SIMULATORS = {"KEEL_KGSL": "sim.qcom.mock_kgsl:MockKgsl",
              "KEEL_FASTRPC": "sim.dsp.mock:QemuTransport",
              "KEEL_USB": "sim.am.mock_device:enclosure"}
HARDWARE = ("", "device")


def simulator(var: str):
    """What `var` selects: None for the hardware, else the simulator's factory (a class or a
    function) named in SIMULATORS. ConfigError for any other value, or for "mock" where the
    `sim` package is not installed."""
    value = os.environ.get(var, "").strip()
    if value in HARDWARE:
        return None
    if value != "mock":
        raise ConfigError(f"{var}={value!r}: expected 'mock' (the simulator, "
                          f"{SIMULATORS[var].split(':')[0]}) or unset/'device' (the hardware)")
    module, name = SIMULATORS[var].split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "sim":
            raise
        raise ConfigError(f"{var}=mock: the simulators (package `sim`) are not installed here; "
                          f"unset {var} to use the hardware") from None
