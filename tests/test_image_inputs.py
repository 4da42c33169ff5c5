"""A uint8 graph input read as an R8 unsigned-int image (compile_model(image_inputs=...)): the
camera frame openpilot's warp gathers from, on the qcom path (compiler/schedule/storage.py
io_image, the OpenCL renderer's read_imageui, qcom/texture.py's FMT6_8_UINT descriptor patched
per binding, the mock GPU's image reads) and on OpenCL (PoCL has no cl_khr_image2d_from_buffer:
the frame is copied into its image before the launch). Every result is exact: a gather moves
bytes."""
import os

import numpy as np
import pytest
from onnx import helper

from compiler.errors import CompileError
from compiler.pipeline import compile_model
from qcom import kgsl, texture
from runner import DmaBuf, InputError, Model
from tests import halfhost
from tests.deps import needs_tool
from tests.graphs import compiled_blob, make_model
from tests.test_opencl import needs_opencl

pytestmark = [needs_tool("clang-19", halfhost.CLANG), needs_opencl]

W, H = 128, 24  # image rows of 128 bytes (two 64-texel pitch units), 24 of them
SIZE = 2 * kgsl.PAGE  # runs past the image, as a VENUS NV12 buffer does; whole pages: imported
N = 256  # gathered bytes
IMAGES = {"frame": {SIZE: (W, H)}}


@pytest.fixture(autouse=True)
def mock_kgsl(monkeypatch):
    monkeypatch.setenv("KEEL_KGSL", "mock")
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)
    monkeypatch.delenv("KEEL_MOCK_BRINGUP", raising=False)


def gather_model(size: int = SIZE, dtype: str = "uint8"):
    """y = frame[idx]: idx an input, so the gather's coordinates are data as in the warp."""
    return make_model([helper.make_node("Gather", ["frame", "idx"], ["y"], axis=0)],
                      [("frame", (size,), dtype), ("idx", (N,), "int32")], [("y", (N,), dtype)])


@pytest.fixture(scope="module")
def blob():
    return compiled_blob(gather_model(), "qcom", image_inputs=IMAGES)


def feeds(seed: int) -> dict:
    """A page-aligned frame (KGSL imports it in place) and indices within the image."""
    rng = np.random.default_rng(seed)
    raw = np.zeros(SIZE + kgsl.PAGE, np.uint8)
    frame = raw[-raw.ctypes.data % kgsl.PAGE:][:SIZE]
    frame[:] = rng.integers(0, 256, SIZE, np.uint8)
    return {"frame": frame, "idx": rng.integers(0, W * H, N).astype(np.int32)}


def test_the_frame_is_an_r8_image_read_with_read_imageui(blob):
    m = Model.load(blob, device="qcom")
    frame = next(b for b in m.blob.inputs if b.name == "frame")
    assert (frame.image.width, frame.image.height, frame.image.pitch, frame.image.channels) == \
        (W, H, W, 1) and frame.nbytes == SIZE  # the caller's buffer, unpadded
    src = bytes(m.blob.programs).decode()
    assert "__read_only image2d_t" in src and "read_imageui(" in src
    f = feeds(0)
    np.testing.assert_array_equal(m.run(f)["y"], f["frame"][f["idx"]])


def test_rebinding_the_frame_repoints_its_texture_descriptor(blob):
    """Two page-aligned frames bound in turn, zero copy: each run reads the one bound now, so
    the descriptor's base (not a stale address) follows the binding; DEPTH survives the patch."""
    m = Model.load(blob, device="qcom")
    for seed in (1, 2, 1):
        f = feeds(seed)
        m.bind_input("frame", f["frame"])
        m.input_view("idx")[:] = f["idx"]
        np.testing.assert_array_equal(m.run()["y"], f["frame"][f["idx"]])
        assert m.device.imported  # imported, not staged through a copy
        words = m.device.args_words
        descriptors = [i for sites in m.device.images.values() for i in sites]
        assert descriptors  # the frame is read through its texture descriptor
        for at in descriptors:
            t = texture.decode(words[at:at + texture.DESCRIPTOR_DWORDS])
            assert (t.width, t.height, t.pitch, t.dtype) == (W, H, W, np.dtype(np.uint8))
            assert (int(words[at + 5]) >> 17) & 0x1FFF == 1  # DEPTH 1


def test_a_frame_at_an_unaligned_offset_is_an_input_error(blob):
    """A texture's base must be 64-byte aligned; a DmaBuf plane at another offset is refused
    naming the input when the run binds it, and the model runs once bound at an aligned one."""
    m = Model.load(blob, device="qcom")
    f = feeds(3)
    fd = os.memfd_create("camera", os.MFD_CLOEXEC)
    os.ftruncate(fd, 2 * kgsl.PAGE * -(-SIZE // kgsl.PAGE))
    os.pwrite(fd, f["frame"].tobytes(), 32)
    m.input_view("idx")[:] = f["idx"]
    try:
        m.bind_input("frame", DmaBuf(fd, 32, SIZE))
        with pytest.raises(InputError, match=r"'frame'.*64-byte aligned"):
            m.run()
        os.pwrite(fd, f["frame"].tobytes(), 64)
        m.bind_input("frame", DmaBuf(fd, 64, SIZE))
        np.testing.assert_array_equal(m.run()["y"], f["frame"][f["idx"]])
    finally:
        m.close()
        os.close(fd)


def test_a_read_past_the_image_rows_is_zero(blob):
    """The image covers the first W * H bytes; the gather's clamp keeps indices in the buffer,
    the texture's clamp-to-border makes the bytes beyond the rows read 0 (storage.py: only an
    input whose reads stay within the image is named)."""
    m = Model.load(blob, device="qcom")
    f = feeds(4)
    f["idx"][:10] = W * H + np.arange(10)
    y = m.run(f)["y"]
    assert not y[:10].any()
    np.testing.assert_array_equal(y[10:], f["frame"][f["idx"][10:]])


def test_the_qcom_blob_runs_on_opencl_through_a_copied_image(blob):
    """PoCL 3.1 lacks cl_khr_image2d_from_buffer: the frame's image is its own memory, filled
    from the bound slot before the launch; rebinding another frame is what the next run reads."""
    m = Model.load(blob, device="opencl")
    assert "cl_khr_image2d_from_buffer" not in m.device.extensions  # the copy path is tested
    for seed in (5, 6):
        f = feeds(seed)
        np.testing.assert_array_equal(m.run(f)["y"], f["frame"][f["idx"]])


@pytest.mark.parametrize("model, target, images, message", [
    (gather_model(), "cpu", IMAGES, r"target cpu\S* has no images"),
    (gather_model(), "qcom", {"frame": {SIZE: (96, H)}}, r"multiple of 64 texels"),
    (gather_model(), "qcom", {"frame": {SIZE: (W, SIZE // W + 1)}}, r"expected uint8 of one"),
    (gather_model(), "qcom", {"frame": {SIZE + 1: (W, H)}}, r"expected uint8 of one of"),
    (gather_model(dtype="float32"), "qcom", IMAGES, r"got float32"),
], ids=["no-images", "misaligned-stride", "larger-than-buffer", "no-size", "not-uint8"])
def test_a_frame_that_cannot_be_an_image_is_refused(model, target, images, message):
    with pytest.raises(CompileError, match=message):
        compile_model(model, target, image_inputs=images)


def test_the_r8_descriptor_round_trips_through_the_mock_decoder():
    t = texture.Texture(0x1_2345_6780, 2048, 1824, 2048, np.dtype(np.uint8))
    words = texture.descriptor(t)
    assert (words[0] >> 22) & 0xFF == texture.FMT6_8_UINT == 0x05  # a6xx.xml enum a6xx_format
    assert (words[2] >> 7) & 0x3FFFFF == 2048  # PITCH in bytes: one byte per texel
    assert texture.decode(words) == t
    texture.set_base(words, 0, 0x2_0000_0040)
    assert texture.decode(words).gpuaddr == 0x2_0000_0040 and (words[5] >> 17) & 1
    with pytest.raises(ValueError, match="multiple of 64"):
        texture.descriptor(t._replace(pitch=2000, width=2000))
