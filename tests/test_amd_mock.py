"""am/: a blob recorded once as PM4 (am/graph.py) and executed by the mock GPU's command processor
(sim/am/mock_gpu.py), which decodes every packet (am/pm4.py), finds each kernel through the code
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
        from sim.am.mock_gpu import CommandProcessor, Memory
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
        self.io = {b.slot: mem.alloc(b.nbytes) for b in blob.inputs + blob.outputs}
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
        return self.io[spec.slot] if base is None else base + spec.offset

    def put(self, words: list[int]) -> int:
        va = self.mem.alloc(4 * len(words))
        self.mem.write(va, struct.pack(f"<{len(words)}I", *words))
        return va

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for b in self.blob.inputs:
            data = np.ascontiguousarray(feeds[b.name], b.dtype)
            self.mem.write(self.io[b.slot], data.tobytes())
        self.runs += 1
        ring = pm4.indirect_buffer(self.ib, len(self.rec.ib)) + \
            pm4.release_mem(self.signal, self.runs)
        self.cp.run(self.put(ring), len(ring))
        assert struct.unpack("<Q", self.mem.read(self.signal, 8))[0] == self.runs
        return {b.name: np.frombuffer(self.mem.read(self.io[b.slot], b.nbytes), b.dtype)
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
    out_slot = placed.blob.outputs[0].slot
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
    "a value or the GPU clock counter": pm4.packet(pm4.RELEASE_MEM, 0x514, 4 << 29, 0x1000, 0,
                                                   0, 0, 0),  # DATA_SEL 4: the CP perfcounter
}


@pytest.mark.parametrize("what", BAD)
def test_the_decoder_rejects_a_malformed_packet_naming_it(what):
    with pytest.raises(pm4.PacketError, match=what):
        pm4.decode([*pm4.packet(pm4.NOP, 0), *BAD[what]])


@needs_llvm
def test_the_command_processor_faults_on_what_hardware_would_fault_on(placed):
    from sim.am.mock_gpu import GpuFault
    nested = placed.put(pm4.indirect_buffer(placed.ib, len(placed.rec.ib)))
    with pytest.raises(pm4.PacketError, match="inside an indirect buffer"):
        placed.cp.run(placed.put(pm4.indirect_buffer(nested, 4)), 4)
    at = placed.code + 0x100  # inside the code object's first page, but no kernel starts there
    wild = pm4.set_sh("COMPUTE_PGM_LO", at >> 8, at >> 40) + pm4.dispatch((1, 1, 1))
    with pytest.raises(GpuFault, match="no kernel's entry"):
        placed.cp.run(placed.put(wild), len(wild))
    with pytest.raises(GpuFault, match="page fault"):
        placed.cp.run(placed.signal + (1 << 28), 4)


@needs_pocl
def test_release_mem_of_the_gpu_clock_writes_a_count_that_grows_at_end_of_pipe():
    """What profiling records around each launch (pm4.clock_to_mem): the mock CP writes its
    100 MHz clock, later for a later packet; a 64-bit value release still writes the value."""
    from sim.am.mock_gpu import CommandProcessor, Memory
    mem = Memory(1 << 20)
    cp, stamps, ib = CommandProcessor(mem), mem.alloc(16), mem.alloc(4096)
    words = pm4.clock_to_mem(stamps) + pm4.release_mem(stamps + 8, 0) + \
        pm4.clock_to_mem(stamps + 8)
    mem.write(ib, struct.pack(f"<{len(words)}I", *words))
    cp.run(ib, len(words))
    first, second = struct.unpack("<QQ", mem.read(stamps, 16))
    assert 0 < first <= second
    cp.run(ib, len(words))
    assert struct.unpack("<Q", mem.read(stamps, 8))[0] >= second


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
    from sim.am import standin
    ips = discovery.parse(discovery.build(_tables()))
    names = firmware.required(ips)
    assert set(names) == {"psp_13_0_0_sos.bin", "smu_13_0_0.bin", "gc_11_0_0_pfp.bin",
                          "gc_11_0_0_me.bin", "gc_11_0_0_mec.bin", "gc_11_0_0_imu.bin",
                          "gc_11_0_0_rlc.bin"}  # no TA, SDMA or MES: keel loads none of them
    for n in names[1:]:
        (tmp_path / n).write_bytes(standin.image(n))
    monkeypatch.setenv(firmware.ENV, str(tmp_path))
    with pytest.raises(ConfigError, match=f"{names[0]}.*{firmware.ENV}"):
        firmware.load_all(ips)
    (tmp_path / names[0]).write_bytes(standin.image(names[0]))
    assert [f.name for f in firmware.load_all(ips)] == names


def test_each_header_kind_cuts_its_parts_where_amdgpu_does():
    from am import psp
    from sim.am import standin
    mec = firmware.parse("gc_11_0_0_mec.bin", standin.image("gc_11_0_0_mec.bin"))
    assert [p.kinds for p in mec.parts] == [(89,), (94, 95, 96, 97)] and \
        mec.start == standin.MEC_START
    assert all(set(p.kinds) == standin.tagged(p.data) for p in mec.parts)
    sos = firmware.parse("psp_13_0_0_sos.bin", standin.image("psp_13_0_0_sos.bin"))
    assert [p.kinds[0] for p in sos.parts] == [psp.KDB, psp.SYS_DRV, psp.TOC_BIN, psp.SOS]
    rlc = firmware.parse("gc_11_0_0_rlc.bin", standin.image("gc_11_0_0_rlc.bin"))
    assert [p.kinds[0] for p in rlc.parts] == [22, 20, 21, 26, 48, 25, 7, 8]  # RLC_G last
    imu = firmware.parse("gc_11_0_0_imu.bin", standin.image("gc_11_0_0_imu.bin"))
    assert [p.kinds for p in imu.parts] == [(psp.IMU_I,), (psp.IMU_D,)]
    assert all(set(p.kinds) == standin.tagged(p.data) for f in (sos, rlc, imu) for p in f.parts)


def _patched(name: str, at: int, value: int) -> bytes:
    from sim.am import standin
    data = bytearray(standin.image(name))
    struct.pack_into("<I", data, at, value)
    return bytes(data)


BAD_FILES = {  # what is wrong -> (file, its bytes, what the error must say)
    "truncated": ("gc_11_0_0_mec.bin", lambda: _patched("gc_11_0_0_mec.bin", 0, 1 << 20),
                  "header says 1048576 bytes"),
    "old header": ("gc_11_0_0_mec.bin", lambda: _patched("gc_11_0_0_mec.bin", 8, 1),
                   r"header version 1\.0; expected 2\.0"),
    "stack past the end": ("gc_11_0_0_me.bin",
                           lambda: _patched("gc_11_0_0_me.bin", 32 + 4 * 4, 1 << 16),
                           "RS64 data"),
    "no sOS": ("psp_13_0_0_sos.bin", lambda: _patched("psp_13_0_0_sos.bin", 32 + 4 + 48, 9),
               "expected at least the system driver"),
    "too many bins": ("psp_13_0_0_sos.bin", lambda: _patched("psp_13_0_0_sos.bin", 32, 99),
                      "99 psp_fw_bin descriptors"),
    "short": ("gc_11_0_0_imu.bin", lambda: b"\0" * 20, "shorter than the 32-byte"),
}


@pytest.mark.parametrize("what", BAD_FILES)
def test_a_file_whose_header_does_not_describe_it_is_refused_naming_it(what):
    name, data, message = BAD_FILES[what]
    with pytest.raises(ConfigError, match=f"{name}.*{message}"):
        firmware.parse(name, data())


def test_the_mock_bootloader_takes_components_only_in_order():
    """sOS before the system driver is refused; then system driver and sOS in order succeed;
    a component after sOS is refused. (am/boot.py drives the same mailbox.) The PSP reads
    through the MM hub: its system aperture onto VRAM, TLB and L2 on, as the driver sets them."""
    from am import psp, regs
    from sim.am import standin
    from sim.am.mock_device import MockGpu
    from sim.am.mock_gpu import GPU_BASE
    gpu = MockGpu()
    hub = regs.MM_HUB
    for reg, value in ((hub.sys_low, GPU_BASE >> 18), (hub.sys_high, (GPU_BASE + (64 << 20)) >> 18),
                       (hub.tlb_cntl, regs.TLB_SET), (hub.l2_cntl, regs.L2_SET)):
        gpu.mem_write(5, 4 * reg, value, 0xF)

    def give(kind: int, cmd: int) -> int:
        gpu.vram.write(GPU_BASE + (1 << 20), standin.payload((kind,)))
        gpu.mem_write(5, 4 * regs.C2PMSG_36, (GPU_BASE + (1 << 20)) >> 20, 0xF)
        gpu.mem_write(5, 4 * regs.C2PMSG_35, cmd, 0xF)
        return gpu.regs[regs.C2PMSG_35] & 0xFFFF
    cmds = dict(psp.BOOT)
    assert give(psp.SOS, cmds[psp.SOS]) and not gpu.sos
    assert give(psp.KDB, cmds[psp.SYS_DRV])  # an image of another type
    assert not give(psp.SYS_DRV, cmds[psp.SYS_DRV])
    assert give(psp.KDB, cmds[psp.KDB])  # the key database belongs before the system driver
    assert not give(psp.SOS, cmds[psp.SOS]) and gpu.sos and gpu.regs[regs.C2PMSG_81]
    assert give(psp.RAS_DRV, cmds[psp.RAS_DRV])


def test_the_mmu_walks_four_levels_as_the_registers_program_it():
    """sim/am/mock_device.Space on am/vm.PageTable's bytes: a 4 KiB page through PDB2 -> PDB1 ->
    PDB0 -> PTB, a 2 MiB PDB0 leaf, faults naming the address and the level for an unmapped page
    and a missing permission, the range's end, the FB aperture; a stale TLB until the
    invalidation request; a kernel buffer's run across 2 MiB leaves."""
    from am import regs, vm
    from sim.am.mock_device import MockGpu
    from sim.am.mock_gpu import GPU_BASE, GpuFault
    gpu, base = MockGpu(), 0x2000_0000_0000
    pt = vm.PageTable(base, 8 << 20, 1 << 20)
    pt.map(base, 32 << 20, 4096, vm.RWX)
    pt.map(base + 8192, 36 << 20, 4096, vm.VALID | vm.READABLE)
    pt.map(base + (4 << 20), 64 << 20, 4 << 20, vm.RWX)  # two 2 MiB leaves, no PTB
    for off, data in pt.fresh():
        gpu.vram.write(GPU_BASE + off, data)
    assert len(pt.tables) == 4  # PDB2, PDB1, PDB0 and one PTB
    end = (base >> 12) + (8 << 8) - 1  # 8 MiB of range
    program = {regs.GCVM_CONTEXT0_PT_BASE_LO: pt.root | vm.VALID, regs.GCVM_CONTEXT0_PT_BASE_HI: 0,
               regs.GCVM_CONTEXT0_PT_START_LO: base >> 12 & 0xFFFFFFFF,
               regs.GCVM_CONTEXT0_PT_START_HI: base >> 44,
               regs.GCVM_CONTEXT0_PT_END_LO: end & 0xFFFFFFFF,
               regs.GCVM_CONTEXT0_PT_END_HI: end >> 32,
               regs.GCMC_VM_SYSTEM_APERTURE_LOW_ADDR: GPU_BASE >> 18,
               regs.GCMC_VM_SYSTEM_APERTURE_HIGH_ADDR: (GPU_BASE + (512 << 20) - 1) >> 18,
               regs.GCVM_CONTEXT0_CNTL: regs.CONTEXT_ENABLE | 3 << regs.CONTEXT_DEPTH_SHIFT}
    for r, v in program.items():
        gpu.mem_write(5, 4 * r, v, 0xF)
    gpu.vram.write(GPU_BASE + (32 << 20) + 0x10, b"mapped")
    gpu.vram.write(GPU_BASE + (65 << 20) + 8, b"huge")
    space = gpu.space
    assert space.read(base + 0x10, 6) == b"mapped"  # 4 levels -> VRAM offset 32 MiB
    assert space.read(base + (5 << 20) + 8, 4) == b"huge"  # 1 MiB into the first 2 MiB leaf
    assert space.walk(base + (5 << 20))[2] == vm.HUGE
    assert space.read(GPU_BASE + (32 << 20) + 0x10, 6) == b"mapped"  # the FB aperture
    assert space.run(base + (4 << 20) + 64) == ((64 << 20) + 64, (4 << 20) - 64)
    assert space.run(base + 0x10) == ((32 << 20) + 0x10, 4096 - 0x10)  # page 1 breaks the run
    with pytest.raises(GpuFault, match=f"page fault.*0x{base + 4096:x}.*PTB entry 0x0 is not"):
        space.read(base + 4096, 4)
    with pytest.raises(GpuFault, match=f"page fault.*0x{base + (2 << 20):x}.*PDB0 entry"):
        space.read(base + (2 << 20), 4)
    with pytest.raises(GpuFault, match=f"protection fault.*0x{base + 8192:x}.*writing"):
        space.write(base + 8192, b"x")
    with pytest.raises(GpuFault, match=f"page fault.*0x{base + (8 << 20):x}.*outside"):
        space.read(base + (8 << 20), 4)  # past END
    leaf_at = space.walk(base)[0]
    gpu.vram.write(GPU_BASE + leaf_at, bytes(8))  # page 0 unmapped, its translation still cached
    assert space.read(base + 0x10, 6) == b"mapped"
    gpu.mem_write(5, 4 * regs.GCVM_INVALIDATE_ENG17_REQ, 1 | regs.INVALIDATE_ALL, 0xF)
    assert gpu.regs[regs.GCVM_INVALIDATE_ENG17_ACK] & 1
    with pytest.raises(GpuFault, match=f"page fault.*0x{base + 0x10:x}"):
        space.read(base + 0x10, 6)


def test_xz_firmware_is_read_and_zstd_firmware_is_refused_with_the_unpack_command(tmp_path):
    """Debian/Fedora ship linux-firmware as .bin.xz: read through lzma, the same parts as the
    plain file. .bin.zst has no stdlib reader before Python 3.14: a ConfigError with the
    command that unpacks it; a corrupt .xz names the file."""
    import lzma
    from sim.am import standin
    from sim.am.mock_device import IPS
    ips = {(ip.hw_id, ip.instance): ip for ip in IPS}
    names = standin.write_all(tmp_path, ips)
    plain = firmware.load_all(ips, tmp_path)
    for name in names:
        path = tmp_path / name
        (tmp_path / f"{name}.xz").write_bytes(lzma.compress(path.read_bytes(), lzma.FORMAT_XZ))
        path.unlink()
    packed = firmware.load_all(ips, tmp_path)
    assert [[p.data for p in f.parts] for f in packed] == [[p.data for p in f.parts] for f in plain]
    (tmp_path / f"{names[0]}.xz").write_bytes(b"not xz")
    with pytest.raises(ConfigError, match=f"{names[0]}.*not a valid .xz file"):
        firmware.load_all(ips, tmp_path)
    (tmp_path / f"{names[0]}.xz").rename(tmp_path / f"{names[0]}.zst")
    with pytest.raises(ConfigError, match=r"no zstd module before 3.14.*zstd -d --rm"):
        firmware.load_all(ips, tmp_path)
