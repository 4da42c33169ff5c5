#!/usr/bin/env bash
# Installs what keel needs on a fresh Debian/Ubuntu machine: clang-19 + lld-19 (kernel builds and
# cross-compiles), PoCL (an OpenCL device on the CPU), then keel itself with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v clang-19 >/dev/null || need+=(clang-19)
command -v ld.lld-19 >/dev/null || need+=(lld-19)
[ -e /usr/lib/x86_64-linux-gnu/libOpenCL.so ] || [ -e /usr/lib/aarch64-linux-gnu/libOpenCL.so ] \
  || need+=(ocl-icd-opencl-dev)
ls /etc/OpenCL/vendors/*pocl* >/dev/null 2>&1 || need+=(pocl-opencl-icd)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "keel: missing system packages: ${need[*]} (run as root, or: sudo apt-get install ${need[*]})" >&2
  fi
fi
python3 -m pip install -q -e ".[test]"
