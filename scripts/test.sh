#!/usr/bin/env bash
# The test suite, as CI runs it: install what is missing, then pytest on every core.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pytest -q -n auto tests "$@"
