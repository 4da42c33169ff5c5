"""openpilot's whole modeld step in one blob (tools/compile_modeld.py): entries per camera, the
queues as the blob's state, replayed 30 frames against models/modeld_ref.py on every device
(tests/modeld_replay.py states what is compared and how exactly), openpilot's own determinism
checks, one submission per frame, and the DM blob.

Tolerances on vision_out/policy_out against onnxruntime on the same pixels: fp32 blobs 1e-4
(fp32 sums of at most 1226 products of O(1) values, in another order: ~1e-6 seen); the qcom
--float16 blob 2e-2 (fp16 weights and activations, 2^-11 per rounding through four layers and
two 1k-term dense sums, on outputs of O(1): the fp16 ORT tests' 1e-2 doubled for the depth).
"""
import numpy as np
import pytest
from onnx import TensorProto, helper

from models.modeld_step import (dm_entries, entry_name, frame_images, split_entries,
                                step_entries)
from models.openpilot_split import DM_SIZE, make_dmonitoring, make_policy, make_vision
from models import modeld_ref as ref
from runner import DeviceTimeout, Model
from tests.graphs import assert_close, compiled_blob
from tests.modeld_replay import (FS, MODEL_SIZE, NEAR_BOUND, TwoDevices, random_frame,
                                 reference, replay)

CAMS = [(1928, 1208), (1344, 760)]
FRAMES = 30
FP32_TOL, FP16_TOL = 1e-4, 2e-2


@pytest.fixture(scope="module")
def models():
    return make_vision(), make_policy()


@pytest.fixture
def usb_gpu(tmp_path, monkeypatch):
    """The mock USB enclosure with its AMD GPU, and stand-in firmware where the driver looks."""
    from am import firmware
    from sim.am import standin
    from sim.am.mock_device import IPS
    from sim.usb.mock import MockLibusb
    standin.write_all(tmp_path, {(ip.hw_id, ip.instance): ip for ip in IPS})
    monkeypatch.setenv("KEEL_USB", "mock")
    monkeypatch.setenv(firmware.ENV, str(tmp_path))
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)
    MockLibusb.forget()
    yield
    MockLibusb.forget()


def pipeline(models, target, **kw):
    """As tools/compile_modeld.py builds it: on qcom the camera frames are R8 images."""
    kw.setdefault("image_inputs", frame_images(CAMS, target))
    return compiled_blob(step_entries(*models, MODEL_SIZE, CAMS, FS), target, **kw)


def check_replay(m, models, cam, tol, seed=0):
    r = replay(m, reference(*models), cam, FRAMES, seed, tol)
    assert r["frames"] == FRAMES and r["skipped"] == FRAMES // 4
    assert r["near_differ"] <= r["near"] <= NEAR_BOUND * r["pixels"]
    return r


def test_blob_has_both_entries_per_camera_and_the_queues_as_state(models):
    m = Model.load(pipeline(models, "cpu"))
    assert set(m.entries) == {entry_name(c, e) for c in CAMS
                              for e in ("warp_enqueue", "run_policy")}
    nv12 = ref.nv12_layout(*CAMS[0])
    run = m.entries["1928x1208/run_policy"]
    assert run.inputs["frame"] == ((nv12.size,), np.uint8) and run.inputs["tfm"][0] == (3, 3)
    assert run.inputs["desire"][0] == (8,) and run.inputs["traffic_convention"][0] == (2,)
    assert set(run.outputs) == {"vision_out", "policy_out"}
    assert {k: v.shape for k, v in m.state.items()} == {
        "img_q": (5, 6, 128, 256), "big_img_q": (5, 6, 128, 256), "feat_q": (97, 1, 512),
        "desire_q": (100, 1, 8)}
    assert not any(v.any() for v in m.state.values())  # zero at load, as openpilot's


@pytest.mark.parametrize("cam", CAMS, ids=lambda c: f"{c[0]}x{c[1]}")
def test_replay_matches_reference_on_cpu(models, cam):
    check_replay(Model.load(pipeline(models, "cpu")), models, cam, FP32_TOL)


def test_two_runs_from_reset_are_bit_identical_and_another_seed_differs(models):
    """openpilot's own check of its compiled step (compile_modeld.py: same seed, same outputs
    and queues; seed + 1, different)."""
    m = Model.load(pipeline(models, "cpu"))
    cam, runs = CAMS[1], []
    for seed in (7, 7, 8):
        m.reset_state()
        assert not any(v.any() for v in m.state.values())
        r = replay(m, reference(*models), cam, 6, seed, FP32_TOL)
        runs.append((r["outputs"], r["state"]))

    def same(a, b):
        return all(np.array_equal(x[k], y[k]) for x, y in zip(a[0], b[0]) for k in x) and \
            all(np.array_equal(a[1][k], b[1][k]) for k in a[1])
    assert same(runs[0], runs[1]) and not same(runs[0], runs[2])


@pytest.mark.slow
def test_replay_matches_reference_on_opencl(models):
    check_replay(Model.load(pipeline(models, "opencl"), device="opencl"), models, CAMS[0],
                 FP32_TOL)


@pytest.mark.slow
def test_replay_matches_reference_on_qcom_float16(models, monkeypatch):
    monkeypatch.setenv("KEEL_KGSL", "mock")
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)
    m = Model.load(pipeline(models, "qcom", float16=True), device="qcom")
    check_replay(m, models, CAMS[0], FP16_TOL)


@pytest.mark.slow
def test_replay_matches_reference_on_amd(models, usb_gpu):
    m = Model.load(pipeline(models, "amd"), device="amd")
    check_replay(m, models, CAMS[1], FP32_TOL)  # the smaller frames: half the USB traffic
    m.close()


def test_each_frame_is_one_gpu_command_on_qcom(models, monkeypatch):
    monkeypatch.setenv("KEEL_KGSL", "mock")
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)
    m = Model.load(pipeline(models, "qcom", float16=True), device="qcom")
    submissions = m.device.kgsl.driver.submissions
    nv12, rng = ref.nv12_layout(*CAMS[0]), np.random.default_rng(0)
    for skipped in (False, True, False):
        before = len(submissions)
        feeds = random_frame(rng, nv12, CAMS[0], skipped)
        m.run(feeds, entry=entry_name(CAMS[0], "warp_enqueue" if skipped else "run_policy"),
              timeout_ms=60000)
        assert len(submissions) == before + 1


@pytest.mark.parametrize("target", ["cpu", pytest.param("qcom", marks=pytest.mark.slow)])
def test_dm_blob_matches_reference(target, monkeypatch):
    """cpu: each entry with its warped image as a second output (the same graph, one output
    more): the image equals the reference's but near rounding boundaries, and the outputs match
    the DM model in onnxruntime on keel's own image (fp32 tolerance). qcom --float16: the blob as
    built, against the DM model on the reference's image: the fp16 tolerance is 50 times what
    the pixels flipped at rounding boundaries move the outputs (4e-4 on cpu). There a second
    output would change the blob under test: sharing the warp between two kernels realizes its
    coordinates in the arena, which --float16 stores as half."""
    monkeypatch.setenv("KEEL_KGSL", "mock")
    dm = make_dmonitoring()
    entries = dm_entries(dm, CAMS)
    exposed = target == "cpu"
    for graph in entries.values() if exposed else ():
        graph.graph.output.append(helper.make_tensor_value_info(
            "input_img", TensorProto.UINT8, [1, DM_SIZE[0] * DM_SIZE[1]]))
    m = Model.load(compiled_blob(entries, target, float16=not exposed,
                                 image_inputs=frame_images(CAMS, target)), device=target)
    assert set(m.entries) == {entry_name(c, "dmonitoring") for c in CAMS}
    model, tol = ref.ort_runner(dm), FP32_TOL if exposed else FP16_TOL
    rng = np.random.default_rng(5)
    for cam in CAMS:
        nv12 = ref.nv12_layout(*cam)
        frame = rng.integers(0, 256, nv12.size, dtype=np.uint8)
        tfm = ref.random_tfm(rng, cam, DM_SIZE)
        calib = rng.standard_normal((1, 3)).astype(np.float32)
        got = m.run({"frame": frame, "tfm": tfm, "calib": calib},
                    entry=entry_name(cam, "dmonitoring"), timeout_ms=60000)
        img, near = ref.dm_warp(frame, tfm, nv12, *DM_SIZE)
        assert near.mean() < NEAR_BOUND
        if exposed:
            assert not ((got["input_img"] != img) & ~near).any()
            img = got["input_img"]
        want = model({"input_img": img, "calib": calib})
        assert_close(got["outputs"], want, tol, tol, f"DM {cam}")


def test_modeld_tool_drops_exactly_the_hung_frame_and_keeps_the_queues(models, monkeypatch):
    """tools/modeld.py on the pipeline blob, with submission 7 hung: one dropped frame, and the
    queues afterwards are those of a clean replay of exactly the frames that completed: the
    failed run left the state as it was (docs/modeld.md)."""
    import io
    from tools.modeld import PipelineFeeder, replay as replay_tool
    blob = pipeline(models, "cpu")
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "hang@7")
    m, trace, log = Model.load(blob, device="mock"), [], io.StringIO()
    # 2 Hz, a 450 ms deadline: a loaded machine's slow run is not a second timeout
    s = replay_tool(m, hz=2, frames=12, timeout_ms=450, budget_ms=500, log=log, trace=trace)
    assert (s["timeouts"], s["device_errors"]) == (1, 0), log.getvalue()
    assert "frame 6: dropped, DeviceTimeout" in log.getvalue()
    assert 6 not in [i for i, _ in trace] and s["processed"] == len(trace) == 12 - s["dropped"]
    monkeypatch.delenv("KEEL_MOCK_FAULTS")
    clean = Model.load(blob, device="mock")
    feed = PipelineFeeder(clean)
    for i, entry in trace:
        feed.before(i, entry)
        clean.run(out=feed.outs(entry), entry=entry)
    assert all(np.array_equal(m.state[q], clean.state[q]) for q in clean.state)
    feed.before(12, feed.policy)  # the feeder's views are this frame's heads
    clean.run(out=feed.outs(feed.policy), entry=feed.policy)
    assert np.array_equal(feed.views["vision"]["hidden_state"], clean.state["feat_q"][-1, 0])


def test_camera_frames_bind_without_a_copy(models):
    """A frame bound once is read where it lies at every run: what the camera writes into it
    after the bind is what the next warp sees."""
    m = Model.load(pipeline(models, "cpu"))
    cam, entry = CAMS[1], entry_name(CAMS[1], "warp_enqueue")
    nv12, rng = ref.nv12_layout(*cam), np.random.default_rng(9)
    bufs = {n: np.zeros(nv12.size, np.uint8) for n in ("frame", "big_frame")}
    for name, buf in bufs.items():
        m.bind_input(name, buf, entry)
        assert m.input_view(name, entry) is buf
    tfm = ref.random_tfm(rng, cam, MODEL_SIZE)
    m.input_view("tfm", entry)[:] = m.input_view("big_tfm", entry)[:] = tfm
    for _ in range(2):
        for buf in bufs.values():
            buf[:] = rng.integers(0, 256, nv12.size, dtype=np.uint8)  # the camera's next frame
        m.run(entry=entry)
        for q, buf in (("img_q", bufs["frame"]), ("big_img_q", bufs["big_frame"])):
            want, near = ref.prepare_frame(buf, tfm, nv12, *MODEL_SIZE)
            assert not ((m.state[q][-1] != want) & ~near).any()


def split(models, warp_target, model_target, **kw):
    warps, steps = split_entries(*models, MODEL_SIZE, CAMS, FS)
    images = frame_images(CAMS, warp_target)
    return compiled_blob(warps, warp_target, image_inputs=images, **kw), \
        compiled_blob(steps, model_target)


@pytest.mark.slow
def test_two_device_pipeline_matches_reference(models, usb_gpu, monkeypatch):
    """openpilot's WARP_DEV: the warp on the Adreno (qcom --float16, mock KGSL), the queues and
    models on the USB GPU (amd, mock enclosure); the planes cross the host between them. Twelve
    frames, not thirty: the mock USB link moves the planes and frames at a few MB/s."""
    monkeypatch.setenv("KEEL_KGSL", "mock")
    warp, model = split(models, "qcom", "amd", float16=True)
    pipe = TwoDevices(Model.load(warp, device="qcom"), Model.load(model, device="amd"))
    assert set(pipe.model.entries) == {"warp_enqueue", "run_policy"}
    r = replay(pipe, reference(*models), CAMS[1], 12, 0, FP32_TOL)
    assert r["skipped"] == 3 and r["near_differ"] <= r["near"] <= NEAR_BOUND * r["pixels"]
    pipe.model.close()


def two_devices(models, monkeypatch, warp_faults: str = "") -> TwoDevices:
    """The split step on the qcom (mock KGSL, KEEL_MOCK_FAULTS=warp_faults) and amd simulators."""
    monkeypatch.setenv("KEEL_KGSL", "mock")
    warp, model = split(models, "qcom", "amd", float16=True)
    monkeypatch.setenv("KEEL_MOCK_FAULTS", warp_faults)
    first = Model.load(warp, device="qcom")
    monkeypatch.delenv("KEEL_MOCK_FAULTS")  # the USB GPU's mock reads it too
    return TwoDevices(first, Model.load(model, device="amd"))


def test_two_devices_move_each_plane_over_usb_once_from_the_warps_memory(models, usb_gpu,
                                                                          monkeypatch):
    """No host copy: per frame the amd side uploads each plane exactly once, straight from the
    qcom output memory (the KGSL object the warp wrote, mapped): one long write of the bridge's
    SRAM carries both planes with the kick, and the two 64 KiB chunks that lie inside each
    plane go to their USB transfers as views of that memory; nothing else crosses USB but
    the desire and traffic convention in the same write."""
    from am.device import AmdDevice
    from usbgpu.asm24 import CHUNK, Bridge
    from usbgpu.pci import UsbPci
    pipe = two_devices(models, monkeypatch)
    cam = CAMS[1]
    warp = f"{cam[0]}x{cam[1]}/warp"
    sources = {pipe.warp.output_buffer(n, warp).ctypes.data for n in ("planes", "big_planes")}
    uploads, long_writes, views = [], [], []
    upload, stage, commands = AmdDevice.upload, UsbPci.stage, Bridge.commands
    monkeypatch.setattr(AmdDevice, "upload", lambda dev, mem, data: (
        uploads.append((np.asarray(data).ctypes.data, len(data))), upload(dev, mem, data))[1])
    monkeypatch.setattr(UsbPci, "stage", lambda pci, data: (
        long_writes.append(sum(map(len, data))), stage(pci, data))[1])
    monkeypatch.setattr(Bridge, "commands", lambda bridge, cmds: (views.extend(
        np.frombuffer(d, np.uint8).ctypes.data for _, _, d in cmds
        if isinstance(d, memoryview) and len(d) == CHUNK), commands(bridge, cmds))[1])
    rng, nv12 = np.random.default_rng(1), ref.nv12_layout(*cam)
    plane = 6 * MODEL_SIZE[1] // 2 * MODEL_SIZE[0] // 2
    for i, kind in enumerate(("run_policy", "warp_enqueue") * 2):
        uploads.clear(), long_writes.clear(), views.clear()
        feeds = random_frame(rng, nv12, cam, kind == "warp_enqueue")
        pipe.run(feeds, entry_name(cam, kind), timeout_ms=60000)
        if i < 2:
            continue  # each entry's first run also writes its slots' kernarg pointers
        big = [(ptr, n) for ptr, n in uploads if n == plane]
        assert {ptr for ptr, _ in big} == sources and len(big) == 2, (i, uploads)
        assert all(n <= 32 for ptr, n in uploads if n != plane), (i, uploads)  # desire, tc
        assert len(long_writes) == 1 and 2 * plane < long_writes[0] < 2 * plane + 4096
        assert len(views) == 4 and all(any(0 < v - s < plane for s in sources) for v in views)
    pipe.model.close()


def test_a_hang_in_the_warp_drops_one_frame_and_leaves_the_usb_gpu_untouched(models, usb_gpu,
                                                                              monkeypatch):
    """The warp's second submission hangs: that frame is a DeviceTimeout at its deadline and
    the USB GPU gets no submission for it; after the next frame every queue has moved by
    exactly one frame since the first (bit for bit), the new row that frame's warp."""
    pipe = two_devices(models, monkeypatch, "hang@2")
    cam = CAMS[1]
    rng, nv12 = np.random.default_rng(2), ref.nv12_layout(*cam)
    entry = entry_name(cam, "run_policy")
    pipe.run(random_frame(rng, nv12, cam, False), entry, timeout_ms=60000)
    before, submitted = {k: np.array(v) for k, v in pipe.state.items()}, pipe.model.device.value
    with pytest.raises(DeviceTimeout):
        pipe.run(random_frame(rng, nv12, cam, False), entry, timeout_ms=300)
    assert pipe.model.device.value == submitted  # the relay stopped at the hung warp
    feeds = random_frame(rng, nv12, cam, False)
    pipe.run(feeds, entry, timeout_ms=60000)
    after = pipe.state  # one read of the queues over USB
    assert all(np.array_equal(after[q][:-1], before[q][1:]) for q in after), list(after)
    want, near = ref.prepare_frame(feeds["frame"], feeds["tfm"], nv12, *MODEL_SIZE)
    assert not ((after["img_q"][-1] != want) & ~near).any()
    pipe.model.close()


def test_soak_runs_the_pipeline_blob_with_matching_canaries(models, monkeypatch):
    """tools/soak.py on the pipeline blob: run_policy back to back, a canary from reset state
    every 10 runs, one hang recovered; every canary bit-equal to the first."""
    import io
    from tools.soak import Soak
    monkeypatch.setenv("KEEL_MOCK_FAULTS", "hang@15")
    soak = Soak(Model.load(pipeline(models, "cpu"), device="mock"), runs=30, canary_every=10,
                sample_s=0.05, timeout_ms=2000, allow_faults=1, log=io.StringIO())
    s = soak.run()
    assert (s["runs"], s["timeouts"], s["recovered"]) == (30, 1, 1)
    assert s["canaries"] >= 4 and s["canary_mismatches"] == 0


def test_roofline_bounds_one_entry(models):
    """tools/roofline.py --entry: one frame's launches, warp included, not the whole blob's."""
    from runner.blob import read_blob
    from tools.roofline import CHIPS, bound
    blob = read_blob(pipeline(models, "qcom", float16=True))
    whole = bound(blob, CHIPS["adreno630"])
    entries = {e.name: e for e in blob.entries}
    per = {n: bound(blob, CHIPS["adreno630"], n) for n in entries}
    assert all(per[n]["launches"] == len(e.launches) for n, e in entries.items())
    assert np.isclose(sum(r["bound_ms"] for r in per.values()), whole["bound_ms"])
    run = per[entry_name(CAMS[0], "run_policy")]
    assert any("Gather" in x["ops"] for x in run["launches_by_bound"])  # the warp is in it
    # each warp launch counts what its gather can touch: six planes of 128 x 256 samples of
    # the 4.8 MB frame, not the frame
    gathers = blob.manifest["meta"]["gathers"]
    frames = [(blob.buffers[blob.launches[i].args[j]].name, n)
              for i in entries[entry_name(CAMS[0], "run_policy")].launches for j, n in gathers[i]
              if blob.buffers[blob.launches[i].args[j]].name in ("frame", "big_frame")]
    assert sorted(frames) == [("big_frame", 6 * 128 * 256), ("frame", 6 * 128 * 256)]


def test_a_visionipc_buffer_binds_zero_copy_on_qcom(models, monkeypatch):
    """A VisionIPC buffer is an ION/dma-buf fd that the camera fills and modeld maps. Bound as
    that mapping, keel imports it with GPUOBJ_IMPORT of the user address, which KGSL turns into
    a dma-buf import when the address lies in a dma-buf's mapping (kgsl.c:
    kgsl_setup_useraddr tries kgsl_setup_dmabuf_useraddr first). Here a memfd stands for the
    ION buffer: what the camera writes through the fd after the bind is what the next warp
    reads, with no copy by keel."""
    import mmap
    import os
    monkeypatch.setenv("KEEL_KGSL", "mock")
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)
    m = Model.load(pipeline(models, "qcom", float16=True), device="qcom")
    cam = CAMS[1]
    entry, nv12, rng = entry_name(cam, "warp_enqueue"), ref.nv12_layout(*cam), \
        np.random.default_rng(11)
    fds = [os.memfd_create(f"visionipc_{n}") for n in ("road", "wide")]
    maps = []
    for fd, name in zip(fds, ("frame", "big_frame")):
        os.ftruncate(fd, nv12.size)
        maps.append(mmap.mmap(fd, nv12.size))
        m.bind_input(name, np.frombuffer(maps[-1], np.uint8), entry)
    tfm = ref.random_tfm(rng, cam, MODEL_SIZE)
    m.input_view("tfm", entry)[:] = m.input_view("big_tfm", entry)[:] = tfm
    slots = {s.slot for s in m.graph.entry(entry).inputs if s.name in ("frame", "big_frame")}
    try:
        for _ in range(2):
            frames = [rng.integers(0, 256, nv12.size, dtype=np.uint8) for _ in fds]
            for fd, data in zip(fds, frames):
                os.pwrite(fd, data.tobytes(), 0)  # the camera process's side of the buffer
            m.run(entry=entry, timeout_ms=60000)
            assert slots <= set(m.device.imported)  # imported, not staged
            for q, data in zip(("img_q", "big_img_q"), frames):
                want, near = ref.prepare_frame(data, tfm, nv12, *MODEL_SIZE)
                assert not ((m.state[q][-1] != want) & ~near).any()
    finally:
        m.close()
        for fd in fds:
            os.close(fd)


def test_the_frame_switch_and_what_the_warp_reads(models):
    """tools/warp_lines.py: on qcom the warp kernels read the frames with read_imageui (the
    default) or as buffers (compile_modeld --frame-buffers: image_inputs=None), at coordinates
    with no integer division; what the gather touches is bounded by its samples, and its
    64-byte lines by the frame."""
    from tools.warp_lines import kernel_reads, touched
    image = kernel_reads(str(pipeline(models, "qcom", float16=True)))
    plain = kernel_reads(str(pipeline(models, "qcom", float16=True, image_inputs=None)))
    assert len(image) == len(plain) == len(CAMS)
    assert all(k["image_reads"] > 0 for k in image) and not any(k["image_reads"] for k in plain)
    # the compiler proves the gather's index is row * stride + column: the image read takes
    # (column, row) and no kernel that reads a frame divides an integer, on either path
    assert [k["int_div_mod"] for k in image + plain] == [0] * (2 * len(CAMS))
    t = touched(CAMS[0], 2)
    assert t["samples"] == 6 * 128 * 256
    assert t["distinct_bytes"] <= t["samples"] <= t["line_bytes"] < t["frame_bytes"]
