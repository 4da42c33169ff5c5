"""keel's simulators: second implementations of the hardware interfaces the runtime drives, so
every backend runs in CI. None of it is part of the on-device runtime, which imports a simulator
only through runner/simulators.py when KEEL_KGSL, KEEL_FASTRPC or KEEL_USB is "mock"; an
on-device install leaves this package out (README.md, "Layout").

  qcom/  a mock KGSL and its GPU, which runs every dispatch's OpenCL C on the host
  dsp/   dsp's runtime as a Linux program under qemu-hexagon, in place of FastRPC
  usb/   a mock ASM2464 USB-to-PCIe bridge behind libusb's calls
  am/    a mock RX 7900 behind that bridge (PSP, SMU, GC, VM, compute queue), with stand-in firmware
"""
