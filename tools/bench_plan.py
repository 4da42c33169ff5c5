"""Memory planner speed: wall time of plan() on 2000-buffer graphs (tests/test_memory.py).

    python tools/bench_plan.py [--runs N]

The planner runs once per compile; at 2000 buffers (a model several times openpilot's size) it
should stay well under a second.
"""
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import time  # noqa: E402

from compiler.link.memory import plan  # noqa: E402
from tests.test_memory import big_graphs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    for name, (sizes, lifetimes) in big_graphs().items():
        times = []
        for _ in range(args.runs):
            t = time.perf_counter()
            p = plan(sizes, lifetimes)
            times.append(time.perf_counter() - t)
        print(f"{name}: {len(sizes)} buffers, min {min(times) * 1e3:.0f} ms over {args.runs} "
              f"runs, arena / lower bound {p.arena_bytes / p.lower_bound:.4f}")


if __name__ == "__main__":
    main()
