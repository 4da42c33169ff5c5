#!/usr/bin/env bash
# The main job on the built-in example: generate the openpilot-shaped model, compile it, run it,
# and print latency and max error against onnxruntime.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 tools/demo.py "$@"
