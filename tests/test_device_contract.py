"""One contract, every device (runner/device.py, runner/queue.py): cpu, mock, opencl (PoCL), qcom
(the mock KGSL), dsp (qemu-hexagon) and amd (the mock USB enclosure) pass the same tests: bind and
rebind, zero-copy where promised, timeline values, deadlines, recovery after each fault kind the
device injects (runner/faults.py), profile spans per launch, persistent state (1,000 runs
bit-exact, failed-run atomicity, reset_state), several entries, idempotent close. Then what only the mock can show: bit-equality
with the CPU on every test model."""
from __future__ import annotations

import time

import numpy as np
import pytest

from compiler.blob import write_blob
from compiler.pipeline import compile_model
from compiler.toolchain import host_target
from models.efficientnet import make_efficientnet
from models.openpilot import make_openpilot
from models.resnet import make_resnet50
from runner import ConfigError, DeviceError, DeviceTimeout, InputError, Model
from runner.faults import parse, var_of
from dsp import build
from runner.opencl import unavailable_reason
from tests.deps import needs, needs_tool
from tests.graphs import assert_close, compiled_blob, ort_run, random_feeds
from tests.test_opencl import mlp

NO_OPENCL = unavailable_reason()
NEEDS_POCL = needs("pocl-opencl-icd", NO_OPENCL)
NEEDS_QEMU = needs("qemu-user, clang-19, lld-19", build.missing())
NEEDS_LLD = needs_tool("lld-19", "ld.lld-19")
# qcom: the KGSL device on the mock KGSL, whose GPU runs float programs on PoCL; dsp: the DSP
# runtime under qemu-hexagon; amd: the mock USB enclosure, its GPU's kernels on PoCL (the
# simulators fixture below selects them)
MARKS = {"cpu": [], "mock": [], "opencl": [NEEDS_POCL], "qcom": [NEEDS_POCL], "dsp": [NEEDS_QEMU],
         "amd": [NEEDS_POCL, NEEDS_LLD]}
DEVICES = [pytest.param(d, marks=m) for d, m in MARKS.items()]
TARGETS = {"cpu": host_target(), "mock": host_target(), "opencl": "opencl", "qcom": "qcom",
           "dsp": "dsp", "amd": "amd"}
AVAILABLE = {"opencl": NO_OPENCL is None, "qcom": NO_OPENCL is None,
             "dsp": build.missing() is None, "amd": NO_OPENCL is None}
SLOW_MS = 120_000  # PoCL on a shared 2-core machine: a deadline no healthy run comes near
# A wall-clock bound in a test on a machine shared with other jobs: a hang must be reported at
# its deadline; the 2 ms bound itself is proven with a fake clock in test_deadline.py.
SCHEDULING_MARGIN_S = 0.5


@pytest.fixture(scope="module")
def mlp_case(tmp_path_factory):
    model, feeds = mlp(np.random.default_rng(11))
    other = {"x": np.random.default_rng(12).standard_normal(feeds["x"].shape).astype(np.float32)}
    d = tmp_path_factory.mktemp("contract")
    paths = {}
    for device, target in TARGETS.items():
        if AVAILABLE.get(device, True):
            paths[device] = d / f"{device}.blob"
            write_blob(compile_model(model, target=target), paths[device])
    want = [ort_run(model, f)["y"] for f in (feeds, other)]
    return paths, [feeds, other], want


@pytest.fixture(scope="session")
def firmware_dir(tmp_path_factory):
    from sim.am import standin
    from sim.am.mock_device import IPS
    d = tmp_path_factory.mktemp("amd-firmware")
    standin.write_all(d, {(ip.hw_id, ip.instance): ip for ip in IPS})  # keel ships none
    return d


@pytest.fixture(autouse=True)
def simulators(monkeypatch, firmware_dir):
    """The simulators of the devices that have one, and a fresh mock enclosure per test."""
    from am import firmware
    from sim.usb.mock import MockLibusb
    for var in ("KEEL_KGSL", "KEEL_FASTRPC", "KEEL_USB"):
        monkeypatch.setenv(var, "mock")
    monkeypatch.setenv(firmware.ENV, str(firmware_dir))
    for var in ("KEEL_MOCK_FAULTS", "KEEL_CPU_FAULTS", "KEEL_OPENCL_FAULTS"):
        monkeypatch.delenv(var, raising=False)
    MockLibusb.forget()
    yield
    MockLibusb.forget()


def _load(mlp_case, device) -> Model:
    m = Model.load(mlp_case[0][device], device=device)
    m.timeout_ms = SLOW_MS
    return m


def _check(got, want):
    # test_opencl's mlp tolerance: float32 sums in another order than onnxruntime's
    assert_close(got, want, 1e-5, 1e-5, "y")


@pytest.mark.parametrize("device", DEVICES)
def test_runs_match_onnxruntime_with_feeds_then_rebinding(mlp_case, device):
    m = _load(mlp_case, device)
    _, feeds, want = mlp_case
    for i in (0, 1, 0):  # a new feed array patches the slot; the next run sees the new one
        _check(m.run(feeds[i])["y"], want[i])


@pytest.mark.parametrize("device", DEVICES)
def test_input_view_is_the_device_io_buffer_runs_read(mlp_case, device):
    m = _load(mlp_case, device)
    _, feeds, want = mlp_case
    assert m.input_view("x") is m.device.io_buffer(0)
    m.input_view("x")[:] = feeds[1]["x"]
    m.run(feeds[0])  # feeds bound once must not detach the slot for later runs
    _check(m.run()["y"], want[1])


@pytest.mark.parametrize("device", DEVICES)
def test_timeline_grows_by_one_per_submission_and_waits_are_idempotent(mlp_case, device):
    dev = _load(mlp_case, device).device
    deadline = time.monotonic() + SLOW_MS / 1000
    values = [dev.submit(deadline) for _ in range(3)]
    assert values[1:] == [values[0] + 1, values[0] + 2]
    dev.wait(values[-1], deadline)
    assert dev.completed() >= values[-1]
    dev.wait(values[0], time.monotonic() - 1)  # completed: a past deadline is no timeout


@pytest.mark.parametrize("device", DEVICES)
def test_recover_without_a_failure_and_double_close_are_harmless(mlp_case, device):
    m = _load(mlp_case, device)
    _, feeds, want = mlp_case
    m.device.recover()
    _check(m.run(feeds[0])["y"], want[0])
    m.close()
    m.close()
    with pytest.raises(DeviceError, match="run\\(\\) on a closed Model; load it again"):
        m.run(feeds[0])


# zero-copy where the device can map host memory: host devices always, KGSL for whole pages;
# opencl, dsp and amd copy a bound host array in at submit and out at wait (runner/queue.py)
ZERO_COPY = {"cpu": True, "mock": True, "qcom": True, "opencl": False, "dsp": False,
             "amd": False}


@pytest.mark.parametrize("device", DEVICES)
def test_bound_host_arrays_are_zero_copy_where_promised_and_staged_elsewhere(mlp_case, device):
    m = _load(mlp_case, device)
    dev, (_, feeds, want) = m.device, mlp_case
    x, y = feeds[1]["x"].copy(), np.empty(want[1].shape, np.float32)
    m.run({"x": x}, out={"y": y})
    _check(y, want[1])
    # not whole pages: KGSL would import whole pages only (tests/test_qcom_device.py)
    zero_copy = ZERO_COPY[device] and device != "qcom"
    for slot in (0, 1):  # mapped: the recording points at the caller's array itself
        assert (slot in dev.staged) == (not zero_copy), slot
        assert (dev.io_address[slot] == dev.map_host(slot, (x, y)[slot])) == zero_copy, slot
    x[:] = feeds[0]["x"]  # the same arrays again: nothing to patch, the new contents read
    m.run({"x": x}, out={"y": y})
    _check(y, want[0])


@pytest.mark.parametrize("device", DEVICES)
def test_profile_spans_cover_every_launch_in_order(mlp_case, device):
    """Each device's own timestamps (cpu cycle counters, OpenCL events, the mock's clock, the
    DSP's counters, qcom's always-on counter and amd's GPU clock written by the recorded
    stream): one span per launch per lane, none of negative length, and on each lane the
    launches one after another in replay order."""
    m = _load(mlp_case, device)
    _, feeds, want = mlp_case
    deadline = time.monotonic() + SLOW_MS / 1000
    value = m.device.submit(deadline)
    with pytest.raises(DeviceError, match="profile\\(\\) while submission .* is in flight"):
        m.device.profile(True)
    m.device.wait(value, deadline)
    m.device.profile(True)
    with pytest.raises(DeviceError, match="no profiled submission has completed"):
        m.device.spans()
    for f, w in zip(feeds, want):  # a profiled run computes the same, run after run
        _check(m.run(f)["y"], w)
        spans = m.device.spans()
        assert sorted({s.launch for s in spans}) == list(range(len(m.blob.launches)))
        for lane in {s.lane for s in spans}:
            mine = sorted((s for s in spans if s.lane == lane), key=lambda s: s.launch)
            assert [s.launch for s in mine] == list(range(len(m.blob.launches))), lane
            assert all(0 <= s.start_ns <= s.end_ns for s in mine), mine
            assert all(a.end_ns <= b.start_ns for a, b in zip(mine, mine[1:])), mine
    m.device.profile(False)
    _check(m.run(feeds[1])["y"], want[1])


@pytest.mark.parametrize("device", [pytest.param(d, marks=MARKS[d]) for d in ("qcom", "amd")])
def test_a_profiled_stream_whose_stamps_were_not_written_is_a_device_error(mlp_case, device):
    """The queue zeroes the stamps before each profiled submission: a launch whose counter the
    stream did not write (here: every stamp is rewritten to zero after the run) is refused."""
    m = _load(mlp_case, device)
    dev = m.device
    dev.profile(True)
    m.run(mlp_case[1][0])
    dev._clear_stamps()
    with pytest.raises(DeviceError, match="launch 0's timestamps 0..0 do not follow"):
        dev.spans()


# the faults each device injects (runner/faults.py): the simulators' (KEEL_MOCK_FAULTS) into the
# simulated hardware; cpu (KEEL_CPU_FAULTS) into a worker's share (its pool's deadline, error and
# barrier paths); opencl (KEEL_OPENCL_FAULTS) through the driver (a user event held shut or
# opened late, a wait list it refuses)
FAULTS = {"cpu": ("hang", "fault", "slow"), "mock": ("hang", "fault", "slow"),
          "opencl": ("hang", "fault", "slow"), "qcom": ("hang", "fault", "slow"),
          "dsp": ("hang", "fault", "slow"), "amd": ("hang", "fault")}
FAULT_CASES = [pytest.param(d, kind, marks=MARKS[d]) for d in FAULTS for kind in FAULTS[d]]


def _inject(monkeypatch, device: str, faults: str) -> None:
    """The simulators read KEEL_MOCK_FAULTS; cpu and opencl their own variable (var_of)."""
    monkeypatch.setenv(var_of(device) if device in ("cpu", "opencl") else "KEEL_MOCK_FAULTS",
                       faults)
    if device == "cpu":  # injected into a worker's share: the pool must exist
        monkeypatch.setenv("KEEL_THREADS", "2")


def test_cpu_faults_need_the_worker_pool_and_a_simulators_list_never_reaches_the_cpu(
        mlp_case, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "fwerr@1")  # an amd simulator's: not the cpu's
    monkeypatch.setenv("KEEL_CPU_FAULTS", "hang@2")
    monkeypatch.setenv("KEEL_THREADS", "1")
    with pytest.raises(ConfigError, match="KEEL_CPU_FAULTS on device 'cpu' .* needs the worker "
                                          "pool"):
        _load(mlp_case, "cpu")
    monkeypatch.delenv("KEEL_CPU_FAULTS")
    _check(_load(mlp_case, "cpu").run(mlp_case[1][0])["y"], mlp_case[2][0])


@pytest.mark.parametrize("device, kind", FAULT_CASES)
def test_each_injected_fault_kind_fails_only_its_run_and_the_next_run_is_correct(
        mlp_case, device, kind, monkeypatch):
    _inject(monkeypatch, device, f"{kind}@2" + (":30" if kind == "slow" else ""))
    m = _load(mlp_case, device)
    _, feeds, want = mlp_case
    _check(m.run(feeds[0])["y"], want[0])
    t = time.monotonic()
    if kind == "hang":
        with pytest.raises(DeviceTimeout, match=f"{device} submission 2 not complete by its "
                                                f"deadline"):
            m.run(feeds[1], timeout_ms=200)
        assert time.monotonic() - t < 0.2 + SCHEDULING_MARGIN_S
    elif kind == "fault":
        with pytest.raises(DeviceError):
            m.run(feeds[1])
    else:
        _check(m.run(feeds[1])["y"], want[1])  # late, still correct
        assert time.monotonic() - t >= 0.030
    _check(m.run(feeds[1])["y"], want[1])  # recovered first where it failed


@pytest.mark.parametrize("device", ["cpu", "mock"])
def test_binding_device_memory_without_support_is_a_device_error(mlp_case, device):
    with pytest.raises(DeviceError, match=f"device '{device}' has no device memory to bind"):
        _load(mlp_case, device).device.bind_device(0, object())


@NEEDS_POCL
def test_opencl_binds_device_memory_then_patches_back_to_host_arrays(mlp_case):
    from runner.cl import CL_MEM_COPY_HOST_PTR, CL_MEM_READ_WRITE, create, ffi
    m = _load(mlp_case, "opencl")
    dev, (_, feeds, want) = m.device, mlp_case

    def device_copy(arr):
        return ffi.gc(create(dev.lib.clCreateBuffer, "clCreateBuffer", dev.ctx,
                             CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, arr.nbytes,
                             ffi.from_buffer(arr)), dev.lib.clReleaseMemObject)
    y = np.empty(want[1].shape, np.float32)
    dev.bind_device(0, device_copy(feeds[1]["x"]))  # a "camera frame" already on the device
    dev.bind(1, y)
    deadline = time.monotonic() + SLOW_MS / 1000
    dev.wait(dev.submit(deadline), deadline)
    _check(y, want[1])
    _check(m.run(feeds[0])["y"], want[0])  # a host array again: kernels read the slot's buffer
    with pytest.raises(DeviceError, match=r"slot 0 \('x'\): .* >= 480 bytes, got 4 bytes"):
        dev.bind_device(0, device_copy(np.zeros(1, np.float32)))
    with pytest.raises(DeviceError, match="bind_device expected a cl_mem, got object"):
        dev.bind_device(0, object())


# ---- persistent state and entry points, on every device ------------------------------------------

ROWS, WIDTH = 3, 4  # tiny: 1,000 runs on the slowest simulator stay cheap
RUNS, HANG_AT = 1000, 500


def accumulator_and_queue() -> "onnx.ModelProto":
    """acc_out = acc + x, and a queue whose oldest row leaves as x enters (openpilot's
    histories); y = 2 * acc_out is an ordinary output. State pairs in metadata_props."""
    import json
    from onnx import helper
    from tests.graphs import make_model
    nodes = [helper.make_node("Add", ["acc", "x"], ["acc_out"]),
             helper.make_node("Slice", ["q", "one", "rows", "zero"], ["q_tail"]),
             helper.make_node("Concat", ["q_tail", "x"], ["q_out"], axis=0),
             helper.make_node("Mul", ["acc_out", "two"], ["y"])]
    m = make_model(nodes, [("x", (1, WIDTH), "float32"), ("acc", (1, WIDTH), "float32"),
                           ("q", (ROWS, WIDTH), "float32")],
                   [("y", (1, WIDTH), "float32"), ("acc_out", (1, WIDTH), "float32"),
                    ("q_out", (ROWS, WIDTH), "float32")],
                   {"one": np.array([1], np.int64), "rows": np.array([ROWS], np.int64),
                    "zero": np.array([0], np.int64), "two": np.array([2], np.float32)})
    helper.set_model_props(m, {"keel.state": json.dumps({"acc": "acc_out", "q": "q_out"})})
    return m


SHARED_W = (np.arange(WIDTH * WIDTH, dtype=np.float32).reshape(WIDTH, WIDTH) - 7) / 8


def entry_model(scale: float) -> "onnx.ModelProto":
    """acc_out = scale * acc + x @ W, y = acc_out; every entry has the same W (stored once)."""
    from onnx import helper
    from tests.graphs import make_model
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]),
             helper.make_node("Mul", ["acc", "s"], ["acc_s"]),
             helper.make_node("Add", ["acc_s", "xw"], ["acc_out"]),
             helper.make_node("Identity", ["acc_out"], ["y"])]
    return make_model(nodes, [("x", (1, WIDTH), "float32"), ("acc", (1, WIDTH), "float32")],
                      [("y", (1, WIDTH), "float32"), ("acc_out", (1, WIDTH), "float32")],
                      {"W": SHARED_W, "s": np.array([scale], np.float32)})


def _state_model(device: str) -> Model:
    m = Model.load(compiled_blob(accumulator_and_queue(), target=TARGETS[device]), device=device)
    m.timeout_ms = SLOW_MS
    return m


@pytest.mark.parametrize("device", [pytest.param(d, marks=MARKS[d] + [pytest.mark.slow])
                                    for d in MARKS])
def test_state_runs_1000_times_bit_exact_survives_a_hang_and_resets(device, monkeypatch):
    """Bit-exact: one float32 add per element and row copies, as numpy does them. A failed run
    leaves every state as before it (ping-pong, runner/state.py); the run after continues."""
    faults = device in FAULTS
    if faults:
        _inject(monkeypatch, device, f"hang@{HANG_AT}")
    m = _state_model(device)
    assert m.inputs.keys() == {"x"} and m.outputs.keys() == {"y"}  # state is not io
    acc, q = np.zeros((1, WIDTH), np.float32), np.zeros((ROWS, WIDTH), np.float32)
    rng = np.random.default_rng(3)
    for i in range(1, RUNS + 1):
        x = rng.standard_normal((1, WIDTH)).astype(np.float32)
        if faults and i == HANG_AT:
            with pytest.raises(DeviceTimeout):
                m.run({"x": x}, timeout_ms=100)
        else:
            y = m.run({"x": x})["y"]
            acc, q = acc + x, np.concatenate([q[1:], x])
            np.testing.assert_array_equal(y, 2 * acc, err_msg=f"run {i}")
        state = m.state
        np.testing.assert_array_equal(state["acc"], acc, err_msg=f"run {i}")
        np.testing.assert_array_equal(state["q"], q, err_msg=f"run {i}")
    m.reset_state()
    assert not m.state["acc"].any() and not m.state["q"].any()
    x = np.ones((1, WIDTH), np.float32)
    np.testing.assert_array_equal(m.run({"x": x})["y"], 2 * x)
    m.set_state("q", np.arange(ROWS * WIDTH, dtype=np.float32).reshape(ROWS, WIDTH))
    m.run({"x": x})
    np.testing.assert_array_equal(m.state["q"][-1], x[0])
    np.testing.assert_array_equal(m.state["q"][0], np.arange(WIDTH, 2 * WIDTH))


@pytest.mark.parametrize("device, kind", [c for c in FAULT_CASES if c.values[1] != "slow"])
def test_a_failed_run_leaves_the_state_exactly_as_before_it(device, kind, monkeypatch):
    _inject(monkeypatch, device, f"{kind}@3")
    m = _state_model(device)
    ones = np.ones((1, WIDTH), np.float32)
    for _ in range(2):
        m.run({"x": ones})
    before = {k: v.copy() for k, v in m.state.items()}
    with pytest.raises(DeviceTimeout if kind == "hang" else DeviceError):
        m.run({"x": 100 * ones}, timeout_ms=200)
    for k, v in m.state.items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    np.testing.assert_array_equal(m.run({"x": ones})["y"], 2 * (before["acc"] + ones))


@pytest.mark.parametrize("device", DEVICES)
def test_two_entries_share_a_weight_and_a_state_and_run_interleaved(device):
    blob = compiled_blob({"step": entry_model(1.0), "decay": entry_model(0.5)},
                         target=TARGETS[device], state={"acc": "acc_out"})
    m = Model.load(blob, device=device)
    m.timeout_ms = SLOW_MS
    assert list(m.entries) == ["step", "decay"]
    assert m.entries["decay"].inputs == {"x": ((1, WIDTH), np.dtype("float32"))}
    with pytest.raises(InputError, match=r"entries \['step', 'decay'\]: name one"):
        m.run({"x": np.zeros((1, WIDTH), np.float32)})
    with pytest.raises(InputError, match="unknown entry 'warp'"):
        m.run({"x": np.zeros((1, WIDTH), np.float32)}, entry="warp")
    # W (packed as each target packs it): one weights buffer per entry, one place in the blob
    w = [b for b in m.blob.buffers.values() if b.region == "weights"]
    assert len(w) == 2 and len({b.offset for b in w}) == 1 and len(m.blob.weights) == w[0].nbytes
    acc = np.zeros((1, WIDTH), np.float32)
    rng = np.random.default_rng(4)
    for i in range(12):
        entry, scale = ("decay", 0.5) if i % 3 == 2 else ("step", 1.0)
        x = rng.standard_normal((1, WIDTH)).astype(np.float32)
        acc = np.float32(scale) * acc + x @ SHARED_W
        # float32 sums of 4 products in the device's order against numpy's: a few ulps
        assert_close(m.run({"x": x}, entry=entry)["y"], acc, 1e-5, 1e-6, f"{entry} run {i}")
        acc = m.state["acc"].copy()  # go on from what the device holds, exactly


@pytest.mark.parametrize("device", [pytest.param("opencl", marks=[NEEDS_POCL])])
def test_a_run_copies_in_only_its_own_entrys_staged_inputs(device, monkeypatch):
    """A device that stages host arrays (opencl here, amd over USB) copies in, per submission,
    the inputs of the entry it runs, not every slot it ever staged."""
    from runner.queue import QueueDevice
    m = Model.load(compiled_blob({"step": entry_model(1.0), "decay": entry_model(0.5)},
                                 target=TARGETS[device], state={"acc": "acc_out"}), device=device)
    copied, copy_in = [], QueueDevice._copy_in
    monkeypatch.setattr(QueueDevice, "_copy_in",
                        lambda dev, slot: (copied.append(slot), copy_in(dev, slot))[1])
    x = np.ones((1, WIDTH), np.float32)
    for entry in ("step", "decay", "step"):
        copied.clear()
        m.run({"x": x}, entry=entry, timeout_ms=SLOW_MS)
        assert copied == [m.graph.entry(entry).inputs[0].slot], (entry, copied)


@pytest.mark.parametrize("timeout", [0, -5, float("nan"), float("inf"), "10", True])
def test_timeout_ms_must_be_a_positive_finite_number(mlp_case, timeout):
    with pytest.raises(InputError, match="timeout_ms: expected a positive finite number"):
        _load(mlp_case, "cpu").run(mlp_case[1][0], timeout_ms=timeout)


# ---- the mock: bit-equal to the CPU, and its faults ---------------------------------------------

MODELS = {"mlp": lambda: mlp(np.random.default_rng(5))[0],
          "openpilot": make_openpilot,
          "openpilot-fp16": lambda: make_openpilot(float16=True),
          "resnet50": lambda: make_resnet50(size=64),
          "efficientnet": lambda: make_efficientnet(size=64)}


@pytest.mark.parametrize("name", MODELS)
def test_mock_replay_matches_the_cpu_bit_for_bit(name):
    proto = MODELS[name]()
    path = compiled_blob(proto, target=host_target())
    feeds = random_feeds(proto, seed=4)
    want = Model.load(path, device="cpu").run(feeds)
    got = Model.load(path, device="mock").run(feeds)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_hang_at_3_times_out_at_its_deadline_and_run_4_is_correct(mlp_case, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "hang@3")
    m = Model.load(mlp_case[0]["mock"], device="mock")
    _, feeds, want = mlp_case
    for _ in range(2):
        _check(m.run(feeds[0], timeout_ms=SLOW_MS)["y"], want[0])
    t = time.monotonic()
    with pytest.raises(DeviceTimeout, match=r"mock submission 3 not complete by its deadline "
                                            r"\(50 ms after submit\)"):
        m.run(feeds[0], timeout_ms=50)
    assert 0.050 <= time.monotonic() - t < 0.050 + SCHEDULING_MARGIN_S
    _check(m.run(feeds[1], timeout_ms=SLOW_MS)["y"], want[1])


def test_fault_is_a_device_error_and_the_next_run_recovers(mlp_case, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "fault@1")
    m = Model.load(mlp_case[0]["mock"], device="mock")
    _, feeds, want = mlp_case
    with pytest.raises(DeviceError, match=r"mock submission 1: device fault \(KEEL_MOCK_FAULTS\)"):
        m.run(feeds[0], timeout_ms=SLOW_MS)
    _check(m.run(feeds[0], timeout_ms=SLOW_MS)["y"], want[0])


def test_a_slow_run_that_finishes_before_its_deadline_is_no_timeout(mlp_case, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "slow@1:30")
    m = Model.load(mlp_case[0]["mock"], device="mock")
    t = time.monotonic()
    _check(m.run(mlp_case[1][0], timeout_ms=SLOW_MS)["y"], mlp_case[2][0])
    assert time.monotonic() - t >= 0.030


@pytest.mark.parametrize("text, message", [
    ("hang3", "bad entry 'hang3'; expected hang@N, fault@N, unplug@N, fwerr@N or slow@N:MS"),
    ("hang@0", "bad entry 'hang@0'"),
    ("slow@2", "bad entry 'slow@2'"),
    ("fault@1:5", "bad entry 'fault@1:5'"),
    ("boom@1", "bad entry 'boom@1'"),
    ("hang@2, fault@2", "submission 2 has two faults"),
])
def test_bad_fault_lists_are_clear_errors(text, message):
    with pytest.raises(ConfigError, match=f"^KEEL_MOCK_FAULTS: {message}"):
        parse(text, "KEEL_MOCK_FAULTS")


def test_a_bad_fault_list_fails_the_load(mlp_case, monkeypatch):
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "hang@x")
    with pytest.raises(ConfigError, match="KEEL_MOCK_FAULTS: bad entry 'hang@x'"):
        Model.load(mlp_case[0]["mock"], device="mock")


def test_fault_lists_parse_every_kind():
    faults = parse(" hang@3,fault@7 ,slow@9:40.5,", "V")
    assert [(v, f.kind, f.ms) for v, f in sorted(faults.by_value.items())] == \
        [(3, "hang", 0.0), (7, "fault", 0.0), (9, "slow", 40.5)]
    assert faults.at(4) is None
