import dataclasses
import gc
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import runner.cpu
from compiler.toolchain import build_shared, host_target
from runner import BlobError, DeviceTimeout, InputError, Model
from runner.device import HUGE_PAGE, HUGE_PAGES, MAX_SLEEP_S, aligned_empty, get_device, wait_until
from tests.hand_graphs import ADD_N, add_artifact, chain_artifact, chain_reference, write

REPO = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def blobs(tmp_path_factory):
    d = tmp_path_factory.mktemp("blobs")
    return {"add": write(add_artifact(), d / "add.blob"),
            "chain": write(chain_artifact(), d / "chain.blob")}


@pytest.fixture
def chain(blobs):
    return Model.load(blobs["chain"])


def _chain_feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.integers(0, 256, (1, 64), dtype=np.uint8),
            "b": rng.uniform(-1, 1, (1, 64)).astype(np.float32)}


def test_add_graph_matches_numpy(blobs):
    m = Model.load(blobs["add"])
    a, b = (np.random.default_rng(i).standard_normal((4, ADD_N // 4), np.float32) for i in (0, 1))
    np.testing.assert_array_equal(m.run({"a": a, "b": b})["y"], a + b)


def test_two_kernel_chain_through_arena_and_weights_matches_reference(chain):
    feeds = _chain_feeds()
    np.testing.assert_array_equal(chain.run(feeds)["y"], chain_reference(**feeds))


def test_inputs_and_outputs_describe_names_shapes_dtypes(chain):
    assert chain.inputs == {"x": ((1, 64), np.dtype("uint8")), "b": ((1, 64), np.dtype("float32"))}
    assert chain.outputs == {"y": ((1, 64), np.dtype("float32"))}
    assert chain.meta == {"graph": "chain"}


def test_models_loaded_side_by_side_keep_their_own_code(blobs):
    # memfd paths (/proc/self/fd/N) are reused after close; each model must still get its own code
    for _ in range(3):
        add, chain = Model.load(blobs["add"]), Model.load(blobs["chain"])
        del add
        gc.collect()
        add = Model.load(blobs["add"])
        feeds = _chain_feeds()
        np.testing.assert_array_equal(chain.run(feeds)["y"], chain_reference(**feeds))
        ones = np.ones((4, ADD_N // 4), np.float32)
        np.testing.assert_array_equal(add.run({"a": ones, "b": ones})["y"], 2 * ones)


@pytest.mark.parametrize("feeds, message", [
    ({"x": np.zeros((1, 64), np.uint8)},
     r"missing input 'b' \(float32 \(1, 64\)\); received \['x'\]"),
    ({**_chain_feeds(), "z": np.zeros(1)}, r"unexpected inputs \['z'\]"),
    ({**_chain_feeds(), "b": np.zeros((1, 64), np.float64)},
     "input 'b': expected dtype float32, got float64"),
    ({**_chain_feeds(), "x": np.zeros((64,), np.uint8)},
     r"input 'x': expected shape \(1, 64\), got \(64,\)"),
    ({**_chain_feeds(), "x": [[0] * 64]}, "input 'x': expected numpy.ndarray uint8 .* got list"),
])
def test_bad_feeds_raise_input_error_naming_input_expected_and_received(chain, feeds, message):
    with pytest.raises(InputError, match=message):
        chain.run(feeds)
    assert issubclass(InputError, ValueError)


def test_input_view_writes_are_what_run_without_feeds_reads(chain):
    feeds = _chain_feeds(1)
    for name, arr in feeds.items():
        chain.input_view(name)[:] = arr
    chain.run(_chain_feeds(2))  # binding feeds once must not detach the slots for later runs
    np.testing.assert_array_equal(chain.run()["y"], chain_reference(**feeds))
    with pytest.raises(InputError, match="unknown input 'nope'"):
        chain.input_view("nope")


def test_out_arrays_are_written_in_place_and_returned_as_the_same_objects(chain):
    y = np.full((1, 64), np.nan, np.float32)
    feeds = _chain_feeds()
    result = chain.run(feeds, out={"y": y})
    assert result["y"] is y
    np.testing.assert_array_equal(y, chain_reference(**feeds))


@pytest.mark.parametrize("out, message", [
    ({"y": np.zeros((1, 64), np.float64)}, r"out\['y'\]: expected dtype float32, got float64"),
    ({"y": np.zeros((64, 1), np.float32)}, r"out\['y'\]: expected shape \(1, 64\), got \(64, 1\)"),
    ({"y": np.zeros((1, 128), np.float32)[:, ::2]}, "expected a C-contiguous, aligned, writable"),
    ({"y": np.frombuffer(bytes(256), np.float32).reshape(1, 64)}, "writeable=False"),
    ({"y": np.zeros((1, 64), np.float32), "q": np.zeros(1)}, r"unknown outputs \['q'\]"),
])
def test_bad_out_arrays_raise_input_error(chain, out, message):
    with pytest.raises(InputError, match=message):
        chain.run(_chain_feeds(), out=out)


def test_results_without_out_survive_the_next_run(chain):
    first_feeds = _chain_feeds(3)
    first = chain.run(first_feeds)["y"]
    chain.run(_chain_feeds(4))
    np.testing.assert_array_equal(first, chain_reference(**first_feeds))


def test_non_contiguous_feeds_are_copied_and_give_the_same_result(chain):
    feeds = _chain_feeds(5)
    wide = {k: np.repeat(v, 2, axis=1)[:, ::2] for k, v in feeds.items()}
    assert not wide["b"].flags.c_contiguous
    np.testing.assert_array_equal(chain.run(wide)["y"], chain_reference(**feeds))


def test_runner_runs_with_compiler_onnx_and_onnxruntime_blocked(blobs):
    script = textwrap.dedent(f"""
        import sys
        for name in ("compiler", "onnx", "onnxruntime"):
            sys.modules[name] = None  # any import of them now raises ImportError
        import numpy as np
        from runner import Model
        m = Model.load({blobs['add']!r})
        a = np.ones((4, {ADD_N // 4}), np.float32)
        assert (m.run({{"a": a, "b": a}})["y"] == 2).all()
        loaded = [n for n, mod in sys.modules.items() if mod and n.split(".")[0] in
                  ("compiler", "onnx", "onnxruntime")]
        assert not loaded, loaded
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_blob_for_another_cpu_target_is_a_blob_error_naming_both(tmp_path):
    here = runner.cpu.HOSTS[host_target()]
    other = next(t for t, h in runner.cpu.HOSTS.items()  # another machine, not just another ISA level
                 if (h.system, h.machines) != (here.system, here.machines))
    path = write(add_artifact(other), tmp_path / "other.blob")
    with pytest.raises(BlobError, match=f"blob target '{other}' cannot run on this host: "
                                        f"host target is '{host_target()}'"):
        Model.load(path)


@pytest.mark.skipif(host_target() != "cpu-avx2", reason="x86-64 host only")
def test_x86_64_v3_blob_on_a_cpu_without_avx2_is_a_blob_error(blobs, monkeypatch):
    monkeypatch.setattr(runner.cpu, "cpu_flags", lambda: {"sse2", "avx"})
    with pytest.raises(BlobError, match=r"needs CPU features \['avx2', 'fma'"):
        Model.load(blobs["add"])


def test_programs_without_keel_graph_is_a_blob_error(tmp_path):
    code = build_shared("void other(void) {}", host_target())
    art = dataclasses.replace(add_artifact(), programs=code)
    with pytest.raises(BlobError, match="does not export keel_graph"):
        Model.load(write(art, tmp_path / "nograph.blob"))


def test_failed_loads_leave_nothing_that_breaks_garbage_collection(tmp_path):
    art = dataclasses.replace(add_artifact(), programs=b"\x7fELF not really a shared object")
    path = write(art, tmp_path / "bad.blob")
    script = textwrap.dedent(f"""
        import gc
        from runner import BlobError, Model
        errors = 0
        for _ in range(20):
            try:
                Model.load({str(path)!r})
            except BlobError:
                errors += 1
            gc.collect()
        print("survived", errors)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0 and "survived 20" in proc.stdout, (proc.stdout, proc.stderr)
    assert "BufferError" not in proc.stderr, proc.stderr


def _thp_eligible(address: int) -> bool:
    """Whether /proc/self/smaps marks the mapping holding `address` as eligible for huge pages."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split()[0] and ":" not in line.split()[0]:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_host_buffers_are_huge_page_aligned_and_advised():
    small, big = aligned_empty((1000,), "float32"), aligned_empty((HUGE_PAGE + 12345,), "uint8")
    assert small.ctypes.data % 64 == 0 and small.shape == (1000,)
    big[:] = 7  # every byte of the requested size is writable
    assert big.shape == (HUGE_PAGE + 12345,) and int(big.sum()) == 7 * big.size
    if not HUGE_PAGES:
        pytest.skip("no MADV_HUGEPAGE on this OS: 64-byte alignment (checked) is the contract")
    assert big.ctypes.data % HUGE_PAGE == 0
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():
        assert _thp_eligible(big.ctypes.data)


def test_unknown_device_name_is_a_value_error(blobs):
    with pytest.raises(ValueError, match="unknown device 'gpu9'"):
        Model.load(blobs["add"], device="gpu9")
    assert get_device("cpu").name == "cpu"


class FakeClock:
    """A monotonic clock that only moves when the waiter sleeps; records every sleep."""

    def __init__(self):
        self.now, self.sleeps = 100.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def signals_at(clock, t):
    return lambda: clock() >= t


def test_wait_returns_once_the_fence_signals_with_bounded_sleeps():
    clock = FakeClock()
    wait_until(signals_at(clock, 100.050), 101.0, "fake", clock, clock.sleep)
    assert 100.050 <= clock.now < 100.050 + MAX_SLEEP_S and max(clock.sleeps) <= MAX_SLEEP_S


def test_wait_times_out_with_device_timeout_after_the_deadline():
    clock = FakeClock()
    with pytest.raises(DeviceTimeout, match="fake not complete by its deadline"):
        wait_until(signals_at(clock, 1e9), 100.020, "fake", clock, clock.sleep)
    assert clock.now == pytest.approx(100.020) and max(clock.sleeps) <= MAX_SLEEP_S
    assert issubclass(DeviceTimeout, TimeoutError)


def test_wait_rechecks_after_the_deadline_before_raising():
    clock = FakeClock()
    polls_after_deadline = []

    def lands_between_last_sleep_and_deadline_check():
        if clock.now >= 100.020:
            polls_after_deadline.append(clock.now)
        return len(polls_after_deadline) >= 2  # first poll past the deadline says no, then yes
    wait_until(lands_between_last_sleep_and_deadline_check, 100.020, "fake", clock, clock.sleep)
    assert len(polls_after_deadline) == 2


def test_wait_on_a_real_clock_never_gives_up_before_its_deadline():
    # how far past the deadline it returns is the scheduler's business on a loaded machine: the
    # fake-clock tests above bound every sleep by MAX_SLEEP_S
    t = time.monotonic()
    with pytest.raises(DeviceTimeout):
        wait_until(lambda: False, t + 0.015, "never")
    assert time.monotonic() - t >= 0.015


@pytest.mark.parametrize("device", ["cpu", "mock"])
def test_a_model_only_the_garbage_collector_frees_is_freed_cleanly(blobs, device):
    """A dropped Model in a reference cycle (an exception's traceback makes one) is freed by the
    GC's clear pass, in no particular order: the blob's memoryview must not be cleared while a
    cffi pointer still exports it (CPython prints 'Exception ignored in tp_clear', and the
    half-released view later crashed the process)."""
    script = textwrap.dedent(f"""
        import gc
        import numpy as np
        from runner import Model
        a = np.ones((4, {ADD_N // 4}), np.float32)
        for _ in range(5):
            m = Model.load({blobs['add']!r}, device={device!r})
            assert (m.run({{"a": a, "b": a}})["y"] == 2).all()
            m.device.cycle = m
            del m
            gc.collect()
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr
