"""am/: a blob recorded once as PM4 (am/graph.py) and executed by the mock GPU's command processor
(am/mock_gpu.py), which decodes every packet (am/pm4.py), finds each kernel through the code
object's dynamic symbols in GPU memory and runs its OpenCL C on PoCL with exactly the buffers the
kernarg segment points at; IP discovery tables and firmware files.

What no mock proves: the gfx1100 ISA (the machine code is never run here), and that the register
and packet facts match the silicon; tests/device/test_usbgpu.py is for a real GPU.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest

from am import discovery, elf, firmware, graph, pm4
from runner.errors import ConfigError, DeviceError
from tests.deps import needs, needs_tool, opencl_missing
from tests.graphs import assert_close, compiled_blob, ort_run, random_feeds, single_node_model

needs_pocl = needs("pocl-opencl-icd", opencl_missing())
needs_llvm = needs_tool("lld-19", "ld.lld-19")


class Placed:
    """A blob laid out in mock GPU memory as am/ lays it out: the code object's segments at a
    page-aligned base, arena, weights, io slots, kernargs, the recorded IB, a signal and a ring
    of INDIRECT_BUFFER + RELEASE_MEM."""

    def __init__(self, blob_path):
        from am.mock_gpu import CommandProcessor, Memory
        from runner.blob import read_blob
        self.blob = blob = read_blob(blob_path)
        image = bytes(blob.programs)
        self.co = elf.read(image)
        self.mem = mem = Memory(256 << 20 if len(blob.weights) > 8 << 20 else 32 << 20)
        self.code = mem.alloc(self.co.size)
        for va, data in elf.load_image(image):
            mem.write(self.code + va, data)
        self.arena = mem.alloc(blob.arena_bytes)
        self.weights = mem.alloc(len(blob.weights))
        mem.write(self.weights, bytes(blob.weights))
        self.io = {b.offset: mem.alloc(b.nbytes) for b in blob.inputs + blob.outputs}
        self.kernargs = mem.alloc(64 * 1024 + 256 * len(blob.launches))
        self.rec = graph.record(blob, self.co, self.code, self.kernargs, self.address)
        mem.write(self.kernargs, bytes(self.rec.kernargs))
        self.ib = self.put(self.rec.ib)
        self.signal = mem.alloc(8)
        self.cp = CommandProcessor(mem)
        self.runs = 0

    def address(self, b: int) -> int:
        spec = self.blob.buffers[b]
        base = {"arena": self.arena, "weights": self.weights}.get(spec.region)
        return self.io[spec.offset] if base is None else base + spec.offset

    def put(self, words: list[int]) -> int:
        va = self.mem.alloc(4 * len(words))
        self.mem.write(va, struct.pack(f"<{len(words)}I", *words))
        return va

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for b in self.blob.inputs:
            data = np.ascontiguousarray(feeds[b.name], b.dtype)
            self.mem.write(self.io[b.offset], data.tobytes())
        self.runs += 1
        ring = pm4.indirect_buffer(self.ib, len(self.rec.ib)) + \
            pm4.release_mem(self.signal, self.runs)
        self.cp.run(self.put(ring), len(ring))
        assert struct.unpack("<Q", self.mem.read(self.signal, 8))[0] == self.runs
        return {b.name: np.frombuffer(self.mem.read(self.io[b.offset], b.nbytes), b.dtype)
                .reshape(b.shape) for b in self.blob.outputs}


def _conv():
    w = np.random.default_rng(0).standard_normal((16, 8, 3, 3)).astype(np.float32)
    return single_node_model("Conv", [((1, 8, 16, 16), "float32"), w], {"pads": [1, 1, 1, 1]})


@pytest.fixture(scope="module")
def placed():
    return Placed(compiled_blob(_conv(), target="amd"))


@needs_llvm
@needs_pocl
def test_recorded_pm4_runs_on_the_mock_gpu_and_matches_onnxruntime(placed):
    model = _conv()
    feeds = random_feeds(model, seed=1)
    # same math as onnxruntime in another summation order over 72 products: 1e-5
    assert_close(placed.run(feeds)["y"], ort_run(model, feeds)["y"], 1e-5, 1e-5, "conv")
    assert placed.cp.dispatches == len(placed.blob.launches)
    feeds2 = random_feeds(model, seed=2)  # the same recording, replayed with new inputs
    assert_close(placed.run(feeds2)["y"], ort_run(model, feeds2)["y"], 1e-5, 1e-5, "conv again")


@needs_llvm
@needs_pocl
def test_binding_an_io_slot_patches_only_its_kernarg_pointers(placed):
    out_slot = placed.blob.outputs[0].offset
    other = placed.mem.alloc(placed.blob.outputs[0].nbytes)
    saved = bytes(placed.rec.kernargs)
    for off in placed.rec.slots[out_slot]:
        placed.mem.write(placed.kernargs + off, struct.pack("<Q", other))
    feeds = random_feeds(_conv(), seed=3)
    placed.run(feeds)
    got = np.frombuffer(placed.mem.read(other, placed.blob.outputs[0].nbytes), np.float32)
    assert_close(got.reshape(placed.blob.outputs[0].shape), ort_run(_conv(), feeds)["y"],
                 1e-5, 1e-5, "rebound output")
    now = placed.mem.read(placed.kernargs, len(saved))
    changed = [i for i in range(len(saved)) if now[i] != saved[i]]
    assert changed and all(any(o <= i < o + 8 for o in placed.rec.slots[out_slot]) for i in changed)
    placed.mem.write(placed.kernargs, saved)


@needs_llvm
def test_the_code_object_reads_the_same_from_gpu_memory_as_from_the_file(placed):
    loaded = elf.parse(lambda va, n: placed.mem.read(placed.code + va, n))
    assert loaded.kernels == placed.co.kernels and loaded.source == placed.co.source
    assert "__kernel" in loaded.source


@needs_llvm
def test_a_barrier_in_the_replay_table_is_an_acquire_mem_before_that_dispatch(placed):
    ops = [p.op for p in pm4.decode(placed.rec.ib)]
    dispatches = [i for i, op in enumerate(ops) if op == pm4.DISPATCH_DIRECT]
    assert len(dispatches) == len(placed.blob.launches)
    for ln, at in zip(placed.blob.launches, dispatches):
        before = ops[dispatches[dispatches.index(at) - 1] + 1 if at != dispatches[0] else 0:at]
        assert (pm4.ACQUIRE_MEM in before) == ln.barrier


BAD = {
    "not a type-3 packet": [0x8000_0000],
    "opcode 0x99": [pm4.header(0x99, 1), 0],
    "runs past": pm4.packet(pm4.SET_SH_REG, 0x200, 1)[:2],
    "expected 4": pm4.packet(pm4.DISPATCH_DIRECT, 1, 1, 1),
    "COMPUTE_SHADER_EN": pm4.packet(pm4.DISPATCH_DIRECT, 1, 1, 1, 0),
    "VALID": pm4.packet(pm4.INDIRECT_BUFFER, 0x1000, 0, 16),
    "8-byte aligned": pm4.packet(pm4.RELEASE_MEM, 0x514, 2 << 29, 0x1004, 0, 1, 0, 0),
    "inside 0x2c00": pm4.packet(pm4.SET_SH_REG, 0x3FF, 1, 2),
}


@pytest.mark.parametrize("what", BAD)
def test_the_decoder_rejects_a_malformed_packet_naming_it(what):
    with pytest.raises(pm4.PacketError, match=what):
        pm4.decode([*pm4.packet(pm4.NOP, 0), *BAD[what]])


@needs_llvm
def test_the_command_processor_faults_on_what_hardware_would_fault_on(placed):
    from am.mock_gpu import GpuFault
    nested = placed.put(pm4.indirect_buffer(placed.ib, len(placed.rec.ib)))
    with pytest.raises(pm4.PacketError, match="inside an indirect buffer"):
        placed.cp.run(placed.put(pm4.indirect_buffer(nested, 4)), 4)
    at = placed.code + 0x100  # inside the code object's first page, but no kernel starts there
    wild = pm4.set_sh("COMPUTE_PGM_LO", at >> 8, at >> 40) + pm4.dispatch((1, 1, 1))
    with pytest.raises(GpuFault, match="no kernel's entry"):
        placed.cp.run(placed.put(wild), len(wild))
    with pytest.raises(GpuFault, match="page fault"):
        placed.cp.run(placed.signal + (1 << 28), 4)


def _tables():
    return [discovery.Ip(11, 0, (11, 0, 0), (0x1260, 0xA000)),
            discovery.Ip(255, 0, (13, 0, 0), (0x16000,)),
            discovery.Ip(1, 0, (13, 0, 0), (0x16000,)),
            discovery.Ip(42, 0, (6, 0, 0), (0x1260,))]


def test_ip_discovery_round_trips_and_rejects_a_corrupt_table():
    data = discovery.build(_tables()) + bytes(64)
    ips = discovery.parse(data)
    assert {(ip.name, ip.version) for ip in ips.values()} == {
        ("GC", (11, 0, 0)), ("MP0", (13, 0, 0)), ("MP1", (13, 0, 0)), ("SDMA0", (6, 0, 0))}
    assert ips[11, 0].bases == (0x1260, 0xA000)
    bad = bytearray(data)
    bad[70] ^= 1
    with pytest.raises(DeviceError, match="checksum"):
        discovery.parse(bytes(bad))
    with pytest.raises(DeviceError, match="signature"):
        discovery.parse(bytes(64))


def test_firmware_names_come_from_discovery_and_all_missing_files_are_named(tmp_path, monkeypatch):
    ips = discovery.parse(discovery.build(_tables()))
    names = firmware.required(ips)
    assert {"psp_13_0_0_sos.bin", "smu_13_0_0.bin", "gc_11_0_0_mec.bin",
            "gc_11_0_0_rlc.bin", "sdma_6_0_0.bin"} <= set(names)
    for n in names[1:]:
        (tmp_path / n).write_bytes(firmware.image(b"\x01" * 64))
    monkeypatch.setenv(firmware.ENV, str(tmp_path))
    with pytest.raises(ConfigError, match=f"{names[0]}.*{firmware.ENV}"):
        firmware.load_all(ips)
    (tmp_path / names[0]).write_bytes(firmware.image(b"\x02" * 32, version=7))
    loaded = firmware.load_all(ips)
    assert loaded[0].ucode == b"\x02" * 32 and loaded[0].version == 7
    (tmp_path / names[0]).write_bytes(firmware.image(b"\x02" * 32)[:-1])
    with pytest.raises(ConfigError, match="header says 64 bytes"):
        firmware.load(names[0], tmp_path)


def test_the_mmu_walks_the_gart_table_as_the_registers_program_it():
    """am/mock_device.Space: a GART page through its PTE (VRAM or system memory), the system
    aperture onto the FB location, faults naming the address for an invalid PTE, a missing
    permission and an address outside both; a stale TLB until the invalidation request."""
    from am import regs
    from am.mock_device import MockGpu
    from am.mock_gpu import GPU_BASE, GpuFault
    gpu = MockGpu()
    gart, pt = 0x7FFF_0000_0000, 8 << 20  # GART range start, table's VRAM offset
    program = {regs.GCVM_CONTEXT0_PT_BASE_LO: pt | regs.PTE_VALID, regs.GCVM_CONTEXT0_PT_BASE_HI: 0,
               regs.GCVM_CONTEXT0_PT_START_LO: gart >> 12 & 0xFFFFFFFF,
               regs.GCVM_CONTEXT0_PT_START_HI: gart >> 44,
               regs.GCVM_CONTEXT0_PT_END_LO: (gart >> 12) + 3 & 0xFFFFFFFF,
               regs.GCVM_CONTEXT0_PT_END_HI: gart >> 44,
               regs.GCMC_VM_SYSTEM_APERTURE_LOW_ADDR: GPU_BASE >> 18,
               regs.GCMC_VM_SYSTEM_APERTURE_HIGH_ADDR: (GPU_BASE + (512 << 20) - 1) >> 18,
               regs.GCVM_CONTEXT0_CNTL: regs.CONTEXT_ENABLE}
    for r, v in program.items():
        gpu.mem_write(5, 4 * r, v, 0xF)
    ptes = [(32 << 20) | regs.PTE_RWX, 0, (36 << 20) | regs.PTE_VALID | regs.PTE_READABLE, 0]
    gpu.vram.write(GPU_BASE + pt, struct.pack("<4Q", *ptes))
    gpu.vram.write(GPU_BASE + (32 << 20) + 0x10, b"mapped")
    space = gpu.space
    assert space.read(gart + 0x10, 6) == b"mapped"  # page 0 -> VRAM offset 32 MiB
    assert space.read(GPU_BASE + (32 << 20) + 0x10, 6) == b"mapped"  # the FB aperture
    assert space.run(gart + 0x10) == ((32 << 20) + 0x10, 4096 - 0x10)  # page 1 breaks the run
    with pytest.raises(GpuFault, match=f"page fault.*0x{gart + 4096:x}.*not valid"):
        space.read(gart + 4096, 4)
    with pytest.raises(GpuFault, match=f"protection fault.*0x{gart + 8192:x}.*writing"):
        space.write(gart + 8192, b"x")
    with pytest.raises(GpuFault, match=f"page fault.*0x{gart + 4 * 4096:x}.*outside"):
        space.read(gart + 4 * 4096, 4)  # past END
    gpu.vram.write(GPU_BASE + pt, bytes(8))  # page 0 unmapped, its translation still cached
    assert space.read(gart + 0x10, 6) == b"mapped"
    gpu.mem_write(5, 4 * regs.GCVM_INVALIDATE_ENG17_REQ, 1 | regs.INVALIDATE_ALL, 0xF)
    assert gpu.regs[regs.GCVM_INVALIDATE_ENG17_ACK] & 1
    with pytest.raises(GpuFault, match=f"page fault.*0x{gart + 0x10:x}"):
        space.read(gart + 0x10, 6)
