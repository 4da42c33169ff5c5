"""A Model survives what a long-running process does to it: injected device faults and hangs by the
thousand, two threads calling run() at once, a CPU share that never arrives, and reloading a
model over and over. Resource checks run in a fresh process, so pytest's own allocations do not
blur them."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from compiler.blob import write_blob
from compiler.pipeline import compile_model
from compiler.toolchain import host_target
from runner import DeviceTimeout, Model
from tests.graphs import ort_run
from tests.hand_graphs import chain_artifact, write
from tests.test_opencl import mlp

REPO = Path(__file__).parents[1]
# RSS bound: what 1,000 faults or 1,800 loads may add after warm-up. Measured on the 2-core
# development VM: +0 KB after the faults, +44 KB after the loads; with cffi still keeping every
# library it opened, the same loads grew RSS by 11.9 MB (~6.6 KB per load).
RSS_BOUND_KB = 2048


def _probe(script: str, blob: str) -> dict:
    head = textwrap.dedent("""
        import os, threading, numpy as np
        from runner import Model, DeviceError, DeviceTimeout
        def resources():
            status = dict(l.split(":", 1) for l in open("/proc/self/status"))
            return (len(os.listdir("/proc/self/fd")), threading.active_count(),
                    int(status["Threads"]), int(status["VmRSS"].split()[0]))
        BLOB = %r
    """) % blob
    proc = subprocess.run([sys.executable, "-c", head + textwrap.dedent(script)], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(REPO), "KEEL_THREADS": "1", "PATH": "/usr/bin"})
    assert proc.returncode == 0, proc.stderr
    return eval(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def chain_blob(tmp_path_factory):
    return write(chain_artifact(), tmp_path_factory.mktemp("recovery") / "chain.blob")


FAULTS = """
    faults = ",".join(f"{'hang' if k % 10 == 0 else 'fault'}@{2 * k + 1}" for k in range(1000))
    os.environ["KEEL_MOCK_FAULTS"] = faults  # every odd submission fails; 1 in 10 hangs
    m = Model.load(BLOB, device="mock")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (1, 64), dtype=np.uint8)
    b = rng.standard_normal((1, 64)).astype(np.float32)
    want = Model.load(BLOB, device="cpu").run({"x": x, "b": b})["y"]
    wrong = failed = 0
    def cycle():
        global wrong, failed
        try:
            m.run({"x": x, "b": b}, timeout_ms=5)
        except (DeviceError, DeviceTimeout):
            failed += 1
        wrong += not np.array_equal(m.run({"x": x, "b": b}, timeout_ms=5000)["y"], want)
    for _ in range(100):
        cycle()
    before = resources()
    for _ in range(900):
        cycle()
    print((failed, wrong, before, resources()))
"""


def test_1000_injected_faults_recover_exactly_and_leave_resources_flat(chain_blob):
    failed, wrong, before, after = _probe(FAULTS, chain_blob)
    assert (failed, wrong) == (1000, 0)
    assert after[:3] == before[:3]  # fds, Python threads, OS threads
    assert after[3] - before[3] < RSS_BOUND_KB, (before, after)


RELOADS = """
    import gc
    def cycle(device):
        Model.load(BLOB, device=device).run({"x": np.zeros((1, 64), np.uint8),
                                             "b": np.zeros((1, 64), np.float32)})
        gc.collect()
    for _ in range(300):
        cycle("cpu"), cycle("mock")
    before = resources()
    for _ in range(1500):
        cycle("cpu")
    for _ in range(300):
        cycle("mock")
    print((before, resources()))
"""


def test_loading_and_dropping_a_model_1500_times_keeps_rss_flat(chain_blob):
    before, after = _probe(RELOADS, chain_blob)
    assert after[:3] == before[:3]
    assert after[3] - before[3] < RSS_BOUND_KB, (before, after)


@pytest.fixture(scope="module")
def mlp_blob(tmp_path_factory):
    model, _ = mlp(np.random.default_rng(3), rows=64, dims=(64, 128, 32))
    path = tmp_path_factory.mktemp("threads") / "mlp.blob"
    write_blob(compile_model(model, target=host_target()), path)
    rng = np.random.default_rng(4)
    feeds = [{"x": rng.standard_normal((64, 64)).astype(np.float32)} for _ in range(2)]
    return path, feeds, model


@pytest.mark.parametrize("threads", ["1", "2"])
def test_two_threads_running_one_model_get_their_own_correct_results(mlp_blob, threads,
                                                                     monkeypatch):
    monkeypatch.setenv("KEEL_THREADS", threads)
    path, feeds, _ = mlp_blob
    m = Model.load(path)
    want = [m.run(f)["y"] for f in feeds]
    wrong = []

    def hammer(i):
        for _ in range(1000):  # before the lock, 7 to 17 of 2,000 came back wrong
            wrong.append(not np.array_equal(m.run(feeds[i])["y"], want[i]))
    workers = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)  # 2,000 runs of a 1 MFLOP model: seconds even on a busy machine
    assert not any(w.is_alive() for w in workers), "run() hung with two threads"
    assert len(wrong) == 2000 and not any(wrong)


def test_a_cpu_share_that_never_arrives_is_bounded_by_the_deadline(mlp_blob, monkeypatch):
    monkeypatch.setenv("KEEL_THREADS", "2")
    path, feeds, model = mlp_blob
    m = Model.load(path)
    pool = m.device._pool
    stuck = pool.start[0]
    pool.start[0] = threading.Semaphore(0)  # worker 1 waits on the old one: never runs its share
    t = time.monotonic()
    with pytest.raises(DeviceTimeout, match="cpu submission 1 not complete by its deadline"):
        m.run(feeds[0], timeout_ms=50)
    # share 0 leaves the barrier at the deadline (one sched_yield late at most); the margin is
    # scheduling noise on a machine shared with other jobs
    assert time.monotonic() - t < 0.050 + 0.5
    try:
        got = m.run(feeds[0], timeout_ms=5000)["y"]  # recovery replaces the pool
        assert m.device._pool is not pool
        want = ort_run(model, feeds[0])["y"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # float32 sum order
    finally:
        stuck.release()  # let the abandoned worker see its pool's stop flag and exit
