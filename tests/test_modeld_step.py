"""openpilot's modeld step as ONNX graphs (models/modeld_step.py) against its numpy reference
(models/modeld_ref.py): first in onnxruntime with the queues as explicit io, then keel's warp.

Warp planes must equal the reference except at pixels whose source coordinate lies within
modeld_ref.NEAR px of a rounding boundary (another float evaluation order may round them the
other way); those are counted and bounded by NEAR_BOUND (tests/modeld_replay.py). With a 1e-3 px
band on each of two coordinates, about 4e-3 of the pixels fall in it for transforms with no
special alignment. onnxruntime evaluates the coordinates in numpy's order: exact everywhere.
"""
import numpy as np
import pytest

from models import modeld_ref as ref
from models.modeld_step import (Graph, Spec, dm_entries, entry_name, nv12_planes, step_entries,
                                 warp)
from models.openpilot_split import DM_SIZE, make_dmonitoring, make_policy, make_vision
from tests.graphs import compiled_blob
from tests.modeld_replay import FS, MODEL_SIZE, NEAR_BOUND, random_frame, reference

CAMS = [(1928, 1208), (1344, 760)]


@pytest.fixture(scope="module")
def models():
    return make_vision(), make_policy()


def test_nv12_layout_is_venus():
    # by hand from msm_media_info.h's VENUS_BUFFER_SIZE: stride to 128, Y rows to 32, UV to 16
    assert ref.nv12_layout(1928, 1208)[2:] == (2048, 1216, 608, 4804608)
    assert ref.nv12_layout(1344, 760)[2:] == (1408, 768, 384, 2428928)


def test_queue_shapes_are_openpilots(models):
    spec = Spec(*models, MODEL_SIZE, FS)
    assert {n: s for n, (s, _) in spec.queues.items()} == {
        "img_q": (5, 6, 128, 256), "big_img_q": (5, 6, 128, 256), "feat_q": (97, 1, 512),
        "desire_q": (100, 1, 8)}


def test_reference_packs_y_phases_then_u_v():
    """An identity warp of a frame whose bytes encode their own position."""
    nv12 = ref.nv12_layout(64, 32)
    frame = (np.arange(nv12.size) % 251).astype(np.uint8)
    planes, _ = ref.prepare_frame(frame, np.eye(3, dtype=np.float32), nv12, 64, 32)
    y = frame[:32 * nv12.stride].reshape(32, nv12.stride)[:, :64]
    uv = frame[nv12.stride * nv12.y_height:].reshape(-1, nv12.stride)[:16, :64]
    for p, (dy, dx) in enumerate(ref.Y_PHASES):
        assert np.array_equal(planes[p], y[dy::2, dx::2])
    assert np.array_equal(planes[4], uv[:, 0::2]) and np.array_equal(planes[5], uv[:, 1::2])


def replay_ort(models, cam, frames, seed):
    """Each entry in onnxruntime, queues carried by hand, against the reference Step."""
    import onnxruntime as ort
    vision, policy = models
    entries = step_entries(vision, policy, MODEL_SIZE, [cam], FS)
    sessions = {n: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                for n, m in entries.items()}
    nv12, step = ref.nv12_layout(*cam), reference(vision, policy)
    queues = {n: np.zeros_like(q) for n, q in step.queues.items()}
    rng = np.random.default_rng(seed)
    for i in range(frames):
        feeds = random_frame(rng, nv12, cam, skipped=i % 3 == 2)
        entry = entry_name(cam, "warp_enqueue" if "desire" not in feeds else "run_policy")
        session = sessions[entry]
        names = [v.name for v in session.get_inputs()]
        got = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {n: {**feeds, **queues}[n] for n in names})))
        queues.update({q: got[q + "_next"] for q in queues if q + "_next" in got})
        if "desire" in feeds:
            want, near = step.run_policy(nv12, **feeds)
        else:
            want, near = {}, step.warp_enqueue(nv12, **feeds)
        yield entry, got, want, queues, step.queues, near


@pytest.mark.parametrize("cam", CAMS, ids=lambda c: f"{c[0]}x{c[1]}")
def test_step_graphs_match_reference_in_onnxruntime(models, cam):
    for entry, got, want, queues, ref_queues, near in replay_ort(models, cam, 6, seed=1):
        # onnxruntime and numpy evaluate the coordinates in the same order: exact everywhere
        assert np.array_equal(queues["img_q"], ref_queues["img_q"]), entry
        assert np.array_equal(queues["big_img_q"], ref_queues["big_img_q"]), entry
        assert near.mean() < NEAR_BOUND
        if want:
            assert np.array_equal(queues["feat_q"], ref_queues["feat_q"])
            assert np.array_equal(queues["desire_q"], ref_queues["desire_q"])
            for k in ("vision_out", "policy_out"):
                assert got[k].dtype == np.float32 and np.array_equal(got[k], want[k]), k
    assert queues["img_q"].any() and queues["feat_q"].any() and queues["desire_q"].any()


def test_dm_graph_matches_reference_in_onnxruntime():
    import onnxruntime as ort
    dm = make_dmonitoring()
    cam = (1928, 1208)
    (name, graph), = dm_entries(dm, [cam]).items()
    assert name == "1928x1208/dmonitoring"
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    nv12, rng = ref.nv12_layout(*cam), np.random.default_rng(2)
    frame = rng.integers(0, 256, nv12.size, dtype=np.uint8)
    tfm = ref.random_tfm(rng, cam, DM_SIZE)
    calib = rng.standard_normal((1, 3)).astype(np.float32)
    got = session.run(None, {"frame": frame, "tfm": tfm, "calib": calib})[0]
    img, near = ref.dm_warp(frame, tfm, nv12, *DM_SIZE)
    assert near.mean() < NEAR_BOUND
    want = ref.ort_runner(dm)({"input_img": img, "calib": calib})
    assert got.shape == (1, 596) and np.array_equal(got, want)


def test_step_rejects_models_it_cannot_join(models):
    vision, policy = models
    with pytest.raises(ValueError, match="vision inputs: expected img, big_img uint8"):
        Spec(vision, policy, (256, 128), FS)
    with pytest.raises(ValueError, match="policy inputs: expected features_buffer"):
        Spec(vision, vision, MODEL_SIZE, FS)
    with pytest.raises(ValueError, match="frame skip: expected >= 1"):
        step_entries(vision, policy, MODEL_SIZE, CAMS, 0)


def warp_model(nv12):
    g = Graph()
    g.input("frame", np.uint8, (nv12.size,))
    g.input("tfm", np.float32, (3, 3))
    planes = warp(g, "frame", "tfm", nv12, nv12_planes(nv12), MODEL_SIZE[0] // 2,
                  MODEL_SIZE[1] // 2)
    g.op("Identity", planes, out="planes")
    g.output("planes", np.uint8, (6, MODEL_SIZE[1] // 2, MODEL_SIZE[0] // 2))
    return g.model("warp", 17, {})


def test_keel_warp_matches_reference_on_cpu():
    from runner import Model
    cam = (1928, 1208)
    nv12 = ref.nv12_layout(*cam)
    m = Model.load(compiled_blob(warp_model(nv12), "cpu"))
    rng = np.random.default_rng(3)
    for _ in range(4):
        frame = rng.integers(0, 256, nv12.size, dtype=np.uint8)
        tfm = ref.random_tfm(rng, cam, MODEL_SIZE)
        want, near = ref.prepare_frame(frame, tfm, nv12, *MODEL_SIZE)
        got = m.run({"frame": frame, "tfm": tfm})["planes"]
        assert not ((got != want) & ~near).any()
        assert near.mean() < NEAR_BOUND


def test_a_queue_shift_computes_its_new_row_once():
    """Concat(Slice(q, 1..), new) lowers to a PAD of `new` over the queue's rows; a costly `new`
    (the warp) inlined there would run at every row, masked off on all but the last
    (compiler/schedule/fusion.py: PAD_WASTE). It is its own kernel, and the values hold."""
    from onnx import helper
    from compiler.pipeline import compile_model
    from tests.graphs import keel_run, make_model, ort_run, random_feeds
    nodes = [helper.make_node("Slice", ["q", "s", "e", "a"], ["old"]),
             helper.make_node("Exp", ["x"], ["ex"]), helper.make_node("Sin", ["ex"], ["new"]),
             helper.make_node("Concat", ["old", "new"], ["y"], axis=0)]
    model = make_model(nodes, [("q", (5, 64), "float32"), ("x", (1, 64), "float32")],
                       [("y", (5, 64), "float32")],
                       {"s": np.array([1]), "e": np.array([5]), "a": np.array([0])})
    kernels = [launch.kernel for launch in compile_model(model, "cpu-avx2").launches]
    # the row's kernels run at the row's size (Sin's signed-zero select reads Exp twice, so Exp
    # may be a kernel of its own); only the last, the shift itself, runs at the queue's
    assert kernels[-1].endswith("_5x64") and len(kernels) >= 2 and \
        all(k.endswith("_1x64") for k in kernels[:-1]), kernels
    feeds = random_feeds(model)
    assert np.allclose(keel_run(model, feeds, "cpu-avx2")["y"], ort_run(model, feeds)["y"],
                       rtol=1e-6, atol=1e-6)


def test_compile_modeld_cli(tmp_path, capsys):
    """openpilot's arguments; bad ones are one line and exit status 2."""
    import onnx
    from runner import Model
    from tools.compile_modeld import main
    paths = {n: str(tmp_path / f"{n}.onnx") for n in ("vision", "policy", "dm")}
    for name, make in (("vision", make_vision), ("policy", make_policy), ("dm", make_dmonitoring)):
        onnx.save(make(), paths[name])
    driving = ["--vision-onnx", paths["vision"], "--policy-onnx", paths["policy"],
               "--frame-skip", "4", "--camera-resolutions", "1928x1208", "--output",
               str(tmp_path / "m.blob")]
    with pytest.raises(SystemExit) as e:
        main(driving + ["--model-size", "512by256"])
    assert e.value.code == 2 and "expected a size WxH" in capsys.readouterr().err
    assert main(driving + ["--model-size", "256x128"]) == 2
    assert "vision inputs: expected img, big_img uint8 (1, 6 * frames, 64, 128)" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(driving[:4] + ["--dm-onnx", paths["dm"], "--camera-resolutions", "1928x1208",
                            "--output", "x.blob"])
    assert "--dm-onnx compiles the DM blob alone" in capsys.readouterr().err
    out = str(tmp_path / "dm.blob")
    assert main(["--dm-onnx", paths["dm"], "--camera-resolutions", "1928x1208", "1344x760",
                 "--output", out, "--target", "cpu-avx2"]) == 0
    assert set(Model.load(out).entries) == {"1928x1208/dmonitoring", "1344x760/dmonitoring"}
