"""Camera buffers (dma-buf fds, what VisionIPC hands out) bound to a qcom model's input through
KGSL's dma-buf import, on the mock KGSL: a memfd stands in for the dma-buf (the mock has no
exporter), so these tests prove the UAPI bytes, the errors and the zero-copy binding, not that
the kernel accepts an ION buffer (docs/qcom.md says what only hardware can prove)."""
import errno
import os

import numpy as np
import pytest
from onnx import TensorProto, helper

from qcom import kgsl
from runner import DeviceError, DmaBuf, InputError, Model
from sim.qcom.mock_kgsl import MockKgsl
from tests import halfhost
from tests.deps import needs_tool
from tests.graphs import compiled_blob, make_model
from tests.test_opencl import needs_opencl

pytestmark = [needs_tool("clang-19", halfhost.CLANG), needs_opencl]

W, H = 64, 32
NV12 = W * H * 3 // 2  # a Y plane and a half-height interleaved UV plane


@pytest.fixture(autouse=True)
def mock_kgsl(monkeypatch):
    monkeypatch.setenv("KEEL_KGSL", "mock")
    monkeypatch.delenv("KEEL_MOCK_FAULTS", raising=False)
    monkeypatch.delenv("KEEL_MOCK_BRINGUP", raising=False)


@pytest.fixture(scope="module")
def blob():
    """y = float(img) * 0.5 over an NV12 frame (uint8 in, exact in float32)."""
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    model = make_model([helper.make_node("Cast", ["img"], ["f"], to=TensorProto.FLOAT),
                        helper.make_node("Mul", ["f", "half"], ["y"])],
                       [("img", (1, NV12), "uint8")], [("y", (1, NV12), "float32")],
                       initializers=[half])
    return compiled_blob(model, "qcom", float16=False)


def memfd(frame: bytes, size: int | None = None) -> int:
    """A stand-in dma-buf holding `frame`, whole pages long as an ION buffer is."""
    fd = os.memfd_create("camera", os.MFD_CLOEXEC)
    os.ftruncate(fd, -(-len(frame) // kgsl.PAGE) * kgsl.PAGE if size is None else size)
    os.pwrite(fd, frame, 0)
    return fd


def frame(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (1, NV12), np.uint8)


def test_a_bound_dmabuf_gives_the_host_array_result_imported_once_and_read_in_place(blob):
    m = Model.load(blob, device="qcom")
    driver = m.device.kgsl.driver
    a, b = frame(0), frame(1)
    fds = [memfd(a.tobytes()), memfd(b.tobytes())]
    try:
        want = [m.run({"img": x})["y"].copy() for x in (a, b)]
        for _ in range(2):  # a ring of two VisionIPC buffers, cycled
            for fd, w in zip(fds, want):
                m.bind_input("img", DmaBuf(fd, 0, NV12))
                np.testing.assert_array_equal(m.run()["y"], w)
        assert driver.dmabuf_imports == 2  # once per fd, however often it is bound
        c = frame(2)
        os.pwrite(fds[0], c.tobytes(), 0)  # the camera writes the next frame into buffer 0
        m.bind_input("img", DmaBuf(fds[0], 0, NV12))
        np.testing.assert_array_equal(m.run()["y"], c.astype(np.float32) * 0.5)  # no copy
        m.bind_input("img", None)  # the host-array path is untouched by the binding
        np.testing.assert_array_equal(m.run({"img": b})["y"], want[1])
        assert driver.dmabuf_imports == 2
        m.close()
        assert not [o for o in driver.mem.objs.values() if o.fd >= 0 and o.imported]
    finally:
        for fd in fds:
            os.close(fd)


def test_a_plane_at_an_offset_is_bound_at_that_offset(blob):
    m = Model.load(blob, device="qcom")
    x = frame(3)
    fd = memfd(bytes(kgsl.PAGE) + x.tobytes())
    try:
        m.bind_input("img", DmaBuf(fd, kgsl.PAGE, NV12))
        np.testing.assert_array_equal(m.run()["y"], x.astype(np.float32) * 0.5)
        m.bind_input("img", DmaBuf(fd, 3 * kgsl.PAGE, NV12))
        with pytest.raises(InputError, match=r"bytes 12288\.\.15360 lie outside its 8192-byte"):
            m.run()
    finally:
        m.close()
        os.close(fd)


@pytest.mark.parametrize("buf, message", [
    (DmaBuf(3, 0, NV12 - 1), r"expected 3072 bytes \(uint8 \(1, 3072\)\), the DmaBuf has 3071"),
    (DmaBuf(3, 0, NV12, np.dtype(np.float32)), r"expected dtype uint8, the DmaBuf holds float32"),
    (DmaBuf(-1, 0, NV12), r"DmaBuf.fd must be an integer >= 0, got -1"),
])
def test_a_dmabuf_of_the_wrong_size_or_dtype_is_an_input_error(blob, buf, message):
    m = Model.load(blob, device="qcom")
    with pytest.raises(InputError, match=message):
        m.bind_input("img", buf)
    m.close()


def _refused(blob, fd: int) -> DeviceError:
    m = Model.load(blob, device="qcom")
    m.bind_input("img", DmaBuf(fd, 0, NV12))
    try:
        with pytest.raises(DeviceError, match="IOCTL_KGSL_GPUOBJ_IMPORT failed") as e:
            m.run()
        return e.value
    finally:
        m.close()


def test_a_refused_import_is_a_device_error_with_the_kernels_errno(blob, monkeypatch):
    closed = os.sysconf("SC_OPEN_MAX") - 1  # the highest fd number: loading opens none there
    with pytest.raises(OSError):
        os.fstat(closed)
    assert _refused(blob, closed).errno == errno.EBADF  # dma_buf_get: no such fd
    r, w = os.pipe()
    empty = os.memfd_create("empty")
    try:
        assert _refused(blob, r).errno == errno.EINVAL  # an fd, but no dma-buf
        assert _refused(blob, empty).errno == errno.EINVAL  # a buffer of 0 bytes
    finally:
        for fd in (r, w, empty):
            os.close(fd)
    monkeypatch.setenv("KEEL_MOCK_BRINGUP", "kgsl.import=ENOMEM")
    fd = memfd(bytes(NV12))
    try:
        assert _refused(blob, fd).errno == errno.ENOMEM
    finally:
        os.close(fd)


def test_the_mock_reads_the_import_as_the_kernel_does():
    k = kgsl.Kgsl(MockKgsl())
    fd = memfd(b"\x5a" * 100)
    try:
        obj = k.import_dmabuf(fd)
        assert obj.size == kgsl.PAGE and k.info(obj.id).gpuaddr == obj.gpuaddr
        assert bytes(k.driver.mem.view(obj.gpuaddr, 4)) == b"\x5a" * 4  # the fd's own pages
        with pytest.raises(DeviceError, match="EBUSY|mmap"):
            k.mmap(kgsl.GpuObj(obj.id, obj.gpuaddr, obj.size, obj.size))
        for priv_len, kind, code in [(0, kgsl.USER_MEM_TYPE_DMABUF, errno.EINVAL),
                                     (4, 1, errno.EOPNOTSUPP)]:  # ASHMEM: not importable
            buf = kgsl.ImportDmaBuf(fd=fd)
            arg = kgsl.GpuobjImport(priv=kgsl.ctypes.addressof(buf), priv_len=priv_len,
                                    type=kind)
            with pytest.raises(DeviceError) as e:
                k.call(kgsl.GPUOBJ_IMPORT, arg, "import")
            assert e.value.errno == code
        k.free(obj.id)
        assert obj.id not in k.driver.mem.objs
    finally:
        os.close(fd)
        k.close()
