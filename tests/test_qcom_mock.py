"""The mock KGSL at the ioctl level, driven through qcom.kgsl.Kgsl as the runtime will drive the
kernel: allocation, mapping, contexts, submission, timestamps, and the errors each refusal gives."""
import ctypes
import errno
import mmap
import time

import pytest

from qcom import kgsl
from qcom.cmdstream import (CP_ALWAYS_ON_COUNTER, OPCODES, REG_TO_MEM_64B, counter_to_mem,
                             lohi, pkt7)
from runner.errors import ConfigError, DeviceError
from sim.qcom.mock_kgsl import GpuFault, MockKgsl


@pytest.fixture
def dev():
    k = kgsl.Kgsl(MockKgsl())
    yield k
    k.close()


def raw(dev, number, arg):
    """One ioctl straight to the driver; the OSError it raises, or None."""
    try:
        dev.driver.ioctl(dev.fd, number, arg)
    except OSError as e:
        return e
    return None


def write_ib(dev, words):
    """An indirect buffer holding `words`, written through the CPU mapping."""
    obj = dev.alloc(4 * len(words))
    view = dev.mmap(obj)
    view[:4 * len(words)] = b"".join(w.to_bytes(4, "little") for w in words)
    return obj, view


def test_device_info_names_an_adreno_630(dev):
    info = dev.check_chip()
    assert info.chip_id >> 8 == 0x060300 and info.gpu_id == 630
    assert (dev.version().drv_major, dev.version().drv_minor) == (3, 14)


def test_unvalidated_chip_is_refused_by_id():
    with pytest.raises(DeviceError, match=r"chip id 0x06040001 .*not validated.*Adreno 630"):
        kgsl.Kgsl(MockKgsl(chip_id=0x06040001, gpu_id=640)).check_chip()


def test_alloc_info_mmap_free(dev):
    obj = dev.alloc(5000)
    assert obj.size == obj.mmapsize == 8192 and obj.gpuaddr % kgsl.PAGE == 0
    info = dev.info(obj.id)
    assert (info.gpuaddr, info.size) == (obj.gpuaddr, 8192)
    view = dev.mmap(obj)
    view[:4] = b"keel"
    assert bytes(dev.driver.mem.view(obj.gpuaddr, 4)) == b"keel"  # the GPU sees the CPU's bytes
    other = dev.alloc(4096)
    assert other.gpuaddr >= obj.gpuaddr + obj.size
    dev.free(obj.id)
    with pytest.raises(DeviceError, match=r"IOCTL_KGSL_GPUOBJ_INFO failed with EINVAL .*object 1"):
        dev.info(obj.id)
    with pytest.raises(DeviceError, match="IOCTL_KGSL_GPUOBJ_FREE failed with EINVAL"):
        dev.free(obj.id)


def test_zero_byte_alloc_is_einval(dev):
    with pytest.raises(DeviceError, match=r"GPUOBJ_ALLOC failed with EINVAL .*allocate 0 bytes"):
        dev.alloc(0)


def test_user_memory_import_is_zero_copy(dev):
    host = mmap.mmap(-1, 2 * kgsl.PAGE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(host))
    obj = dev.import_user(addr, 2 * kgsl.PAGE)
    host[:5] = b"frame"
    assert bytes(dev.driver.mem.view(obj.gpuaddr, 5)) == b"frame"
    with pytest.raises(DeviceError, match=r"GPUOBJ_IMPORT failed with EINVAL .*page-aligned"):
        dev.import_user(addr + 16, kgsl.PAGE)
    with pytest.raises(DeviceError, match=r"mmap of GPU object .*EBUSY"):
        dev.mmap(obj)


def test_map_user_mem_gives_a_gpu_address_for_host_pages(dev):
    host = mmap.mmap(-1, kgsl.PAGE)
    arg = kgsl.MapUserMem(hostptr=ctypes.addressof(ctypes.c_char.from_buffer(host)),
                          len=kgsl.PAGE, memtype=kgsl.USER_MEM_TYPE_ADDR)
    assert raw(dev, kgsl.MAP_USER_MEM.number, arg) is None and arg.gpuaddr
    host[:3] = b"abc"
    assert bytes(dev.driver.mem.view(arg.gpuaddr, 3)) == b"abc"
    arg.hostptr += 8
    assert raw(dev, kgsl.MAP_USER_MEM.number, arg).errno == errno.EINVAL


def test_unknown_ioctl_is_enotty(dev):
    e = raw(dev, kgsl.ioc(3, 0x7F, 8), bytearray(8))
    assert e.errno == errno.ENOTTY


def test_wrong_size_or_direction_is_einval_and_short_buffer_efault(dev):
    create = kgsl.DRAWCTXT_CREATE
    e = raw(dev, kgsl.ioc(3, 0x13, 12), bytearray(12))  # right nr, wrong size
    assert e.errno == errno.EINVAL and "IOCTL_KGSL_DRAWCTXT_CREATE" in e.strerror
    e = raw(dev, kgsl.ioc(1, 0x13, 8), bytearray(8))  # right size, write-only
    assert e.errno == errno.EINVAL
    e = raw(dev, create.number, bytearray(4))
    assert e.errno == errno.EFAULT
    assert raw(dev, create.number, bytearray(8)) is None


def test_contexts_are_created_with_flags_and_destroyed(dev):
    ctx = dev.context_create(priority=10)
    flags = dev.driver.contexts[ctx].flags
    assert (flags & kgsl.CONTEXT_PRIORITY_MASK) >> kgsl.CONTEXT_PRIORITY_SHIFT == 10
    assert (flags & kgsl.CONTEXT_TYPE_MASK) >> kgsl.CONTEXT_TYPE_SHIFT == kgsl.CONTEXT_TYPE_CL
    dev.context_destroy(ctx)
    with pytest.raises(DeviceError, match=r"DRAWCTXT_DESTROY failed with EINVAL .*context 1"):
        dev.context_destroy(ctx)
    with pytest.raises(ValueError, match="0..15"):
        dev.context_create(priority=16)


def test_submit_decodes_advances_the_timestamp_and_waits(dev):
    seen = []
    dev.driver.on_submit = lambda packets, mem: seen.append([p.name for p in packets])
    ctx = dev.context_create()
    target = dev.alloc(4096)
    ib, _ = write_ib(dev, pkt7(OPCODES["CP_MEM_WRITE"], *lohi(target.gpuaddr), 42)
                     + pkt7(OPCODES["CP_WAIT_FOR_IDLE"]))
    assert dev.submit(ctx, [(ib.gpuaddr, 4 * 5)]) == 1
    assert dev.submit(ctx, [(ib.gpuaddr, 4 * 5)]) == 2
    assert seen == [["CP_MEM_WRITE", "CP_WAIT_FOR_IDLE"]] * 2
    assert dev.wait(ctx, 2, 10) and dev.read_timestamp(ctx) == 2
    assert dev.read_timestamp(ctx, kgsl.TIMESTAMP_QUEUED) == 2


def test_a_handler_sees_imported_user_memory_by_gpu_address(dev):
    """on_submit gets the decoded packets and the GPU's view of memory: a CP_MEM_WRITE executed
    there lands in the host's own buffer (imported zero-copy)."""
    def execute(packets, mem):
        for p in packets:
            if p.name == "CP_MEM_WRITE":
                mem.words(p.payload[0] | p.payload[1] << 32, len(p.payload) - 2)[:] = \
                    memoryview(b"".join(w.to_bytes(4, "little") for w in p.payload[2:])).cast("I")
    dev.driver.on_submit = execute
    host = mmap.mmap(-1, kgsl.PAGE)
    obj = dev.import_user(ctypes.addressof(ctypes.c_char.from_buffer(host)), kgsl.PAGE)
    ib, _ = write_ib(dev, pkt7(OPCODES["CP_MEM_WRITE"], *lohi(obj.gpuaddr + 8), 7, 9))
    ctx = dev.context_create()
    assert dev.wait(ctx, dev.submit(ctx, [(ib.gpuaddr, 20)]), 10)
    assert host[8:16] == (7).to_bytes(4, "little") + (9).to_bytes(4, "little")


def test_malformed_stream_is_rejected_naming_the_packet(dev):
    ctx = dev.context_create()
    words = pkt7(OPCODES["CP_WAIT_FOR_IDLE"]) + pkt7(OPCODES["CP_EXEC_CS"], 0, 1, 1, 1)
    words[1] ^= 1 << 15  # flip the count parity of packet 1
    ib, _ = write_ib(dev, words)
    with pytest.raises(DeviceError, match=r"GPU_COMMAND failed with EINVAL .*packet 1 "
                                          r"\(dword 1.*bad parity"):
        dev.submit(ctx, [(ib.gpuaddr, 4 * len(words))])
    assert dev.read_timestamp(ctx, kgsl.TIMESTAMP_QUEUED) == 0  # nothing was queued


def test_ib_outside_memory_and_stray_addresses_are_rejected(dev):
    ctx = dev.context_create()
    with pytest.raises(DeviceError, match="EINVAL .*outside every allocation"):
        dev.submit(ctx, [(0xDEAD000, 16)])
    ib, _ = write_ib(dev, pkt7(OPCODES["CP_MEM_WRITE"], *lohi(0x1234000), 1))
    with pytest.raises(DeviceError, match=r"packet 0 .*CP_MEM_WRITE.*0x1234000"):
        dev.submit(ctx, [(ib.gpuaddr, 16)])


def test_wait_on_a_hung_submission_times_out_within_its_slice(dev):
    ctx = dev.context_create()
    ib, _ = write_ib(dev, pkt7(OPCODES["CP_WAIT_FOR_IDLE"]))
    dev.driver.hang = True
    ts = dev.submit(ctx, [(ib.gpuaddr, 4)])
    t0 = time.monotonic()
    assert dev.wait(ctx, ts, 30) is False
    assert 0.025 <= time.monotonic() - t0 < 0.5


def test_slow_submission_retires_after_its_delay(dev):
    ctx = dev.context_create()
    ib, _ = write_ib(dev, pkt7(OPCODES["CP_WAIT_FOR_IDLE"]))
    dev.driver.delay_s = 0.05
    ts = dev.submit(ctx, [(ib.gpuaddr, 4)])
    assert dev.read_timestamp(ctx) == 0
    assert dev.wait(ctx, ts, 2000)
    assert dev.read_timestamp(ctx) == ts


def test_wait_on_a_timestamp_never_queued_is_einval(dev):
    ctx = dev.context_create()
    with pytest.raises(DeviceError, match=r"TIMESTAMP_CTXTID failed with EINVAL .*never queued"):
        dev.wait(ctx, 5, 10)


def test_gpu_fault_marks_the_context_dead(dev):
    def fault(packets, mem):
        raise GpuFault("page fault at 0x0")
    dev.driver.on_submit = fault
    ctx = dev.context_create()
    ib, _ = write_ib(dev, pkt7(OPCODES["CP_WAIT_FOR_IDLE"]))
    ts = dev.submit(ctx, [(ib.gpuaddr, 4)])
    with pytest.raises(DeviceError, match="EDEADLK"):
        dev.wait(ctx, ts, 10)
    with pytest.raises(DeviceError, match="GPU_COMMAND failed with EDEADLK"):
        dev.submit(ctx, [(ib.gpuaddr, 4)])
    fresh = dev.context_create()  # recovery: a new context works
    dev.driver.on_submit = None
    assert dev.wait(fresh, dev.submit(fresh, [(ib.gpuaddr, 4)]), 10)


def test_the_always_on_counter_read_by_cp_reg_to_mem_grows_and_other_reads_fault(dev):
    """What profiling records around each launch (cmdstream.counter_to_mem): the mock GPU
    writes its 19.2 MHz count as one 64-bit value; a CP_REG_TO_MEM of a register it does not
    model, or not as two dwords 64-bit, is a GPU fault (the context dies, as on a bad read)."""
    ctx, target = dev.context_create(), dev.alloc(4096)
    view = dev.mmap(target)
    ib, _ = write_ib(dev, counter_to_mem(target.gpuaddr) + pkt7(OPCODES["CP_WAIT_FOR_IDLE"])
                     + counter_to_mem(target.gpuaddr + 8))
    assert dev.wait(ctx, dev.submit(ctx, [(ib.gpuaddr, 4 * 9)]), 1000)
    first, second = int.from_bytes(view[0:8], "little"), int.from_bytes(view[8:16], "little")
    assert 0 < first <= second
    for bad in (CP_ALWAYS_ON_COUNTER + 4 | 2 << 18 | REG_TO_MEM_64B,  # another register
                CP_ALWAYS_ON_COUNTER | 1 << 18):  # one dword, 32-bit
        ib, _ = write_ib(dev, pkt7(OPCODES["CP_REG_TO_MEM"], bad, *lohi(target.gpuaddr)))
        ctx = dev.context_create()
        ts = dev.submit(ctx, [(ib.gpuaddr, 16)])
        with pytest.raises(DeviceError, match="EDEADLK"):
            dev.wait(ctx, ts, 1000)


def test_keel_kgsl_env_selects_the_mock(monkeypatch):
    monkeypatch.setenv("KEEL_KGSL", "mock")
    k = kgsl.Kgsl()
    assert isinstance(k.driver, MockKgsl) and k.check_chip().gpu_id == 630


def test_kernel_driver_failure_names_the_ioctl_errno_and_request():
    """The real entry point (fcntl.ioctl) on a file that is not KGSL: the kernel's ENOTTY arrives
    as DeviceError with the ioctl's name and what was asked."""
    dev = kgsl.Kgsl(kgsl.KernelDriver(), path="/dev/null")
    try:
        with pytest.raises(DeviceError, match=r"IOCTL_KGSL_GPUOBJ_ALLOC failed with ENOTTY "
                                              r"\(.*\) asking to allocate 4096 bytes"):
            dev.alloc(4096)
    finally:
        dev.close()


def test_real_device_absent_is_a_named_error(monkeypatch):
    monkeypatch.delenv("KEEL_KGSL", raising=False)
    with pytest.raises(DeviceError, match=r"open\(/nonexistent/kgsl\) failed: ENOENT"):
        kgsl.Kgsl(path="/nonexistent/kgsl")


def test_an_unknown_kgsl_driver_name_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("KEEL_KGSL", "mok")
    with pytest.raises(ConfigError, match=r"KEEL_KGSL='mok': expected 'mock' .* or unset"):
        kgsl.Kgsl()


def test_an_ib_waiting_on_memory_retires_only_once_the_host_writes_the_word():
    """CP_WAIT_REG_MEM (poll memory, equal): the mock GPU holds the stream at the wait until the
    word matches, as tools/doctor.py's deadline stage relies on (a gate the host opens)."""

    from qcom import kgsl as _kgsl
    from qcom.cmdstream import OPCODES, WAIT_POLL_MEMORY, lohi, pkt7
    from sim.qcom.mock_kgsl import MockKgsl
    k = _kgsl.Kgsl(MockKgsl())
    ctx, obj = k.context_create(), k.alloc(4096)
    view, ib = k.mmap(obj), k.alloc(4096)
    words = pkt7(OPCODES["CP_WAIT_REG_MEM"], WAIT_POLL_MEMORY | 3, *lohi(obj.gpuaddr + 64), 1,
                 0xFFFFFFFF, 16) + pkt7(OPCODES["CP_MEM_WRITE"], *lohi(obj.gpuaddr), 7)
    k.mmap(ib)[:4 * len(words)] = b"".join(w.to_bytes(4, "little") for w in words)
    ts = k.submit(ctx, [(ib.gpuaddr, 4 * len(words))])
    assert not k.wait(ctx, ts, 20)
    assert view[:4] == bytes(4)  # nothing after the wait ran
    view[64:68] = (1).to_bytes(4, "little")
    assert k.wait(ctx, ts, 1000)
    assert int.from_bytes(view[:4], "little") == 7
