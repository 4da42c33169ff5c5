"""The mock KGSL's GPU: plays a decoded submission the way the CP would, over the mock's memory.

It keeps the register file the stream writes and the state CP_LOAD_STATE6 loads (shader,
constants, texture descriptors, samplers), and at each CP_RUN_OPENCL (groups in
HLSQ_CS_KERNEL_GROUP_X..Z, how vendor OpenCL binaries are launched) or CP_EXEC_CS (groups in its
payload) runs the kernel that state names: the program in the shader object (qcom/program.py),
the parameters read from the loaded constants (buffer addresses, texture slots), the images the
descriptors describe (qcom/texture.py), the sizes in HLSQ_CS_NDRANGE_*. Nothing comes from
anywhere but GPU memory and the stream, so a wrong address, descriptor or size in what the
device recorded shows up as a fault or a wrong result. CP_MEM_WRITE writes its payload.
CP_WAIT_REG_MEM polling memory blocks the stream until the word compares as asked: the call
returns the packets from the wait on, which MockKgsl runs again each time it is asked for a
timestamp (register polls pass). Anything it cannot make sense of is a GpuFault, which kills the
context as a real page fault does.

Bring-up faults (KEEL_MOCK_BRINGUP, runner/faults.py's SITES): gpu.answer=wrong flips the first
word of each dispatch's first buffer (the one it writes), a wrong known answer (wrong@K: only
from the Kth dispatch of a submission on, a fault only deeper graphs show); gpu.image=fault
faults every image access, as a bad texture descriptor does.
"""
from __future__ import annotations

import ctypes
import time

from qcom import cmdstream as cs
from qcom import texture
from sim.qcom.execute import Executor
from qcom.program import SHADER_UNIT, ParamKind, Program
from sim.qcom.program import parse
from runner.faults import bringup, bringup_from

R = cs.REGISTERS


class GpuFault(Exception):
    """What would be a GPU page fault or an illegal instruction: the context is lost."""


def host_address(mem, gpuaddr: int, nbytes: int) -> tuple[int, int]:
    """(host address of gpuaddr, bytes from it to the end of its GPU object)."""
    for o in mem.objs.values():
        if o.gpuaddr <= gpuaddr and gpuaddr + nbytes <= o.gpuaddr + o.size:
            base = getattr(o, "host", None)
            if base is None:
                view = o.view if isinstance(o.view, ctypes.Array) else \
                    (ctypes.c_char * o.size).from_buffer(o.view)
                base = o.host = ctypes.addressof(view)
            return base + gpuaddr - o.gpuaddr, o.gpuaddr + o.size - gpuaddr
    raise GpuFault(f"GPU access {gpuaddr:#x}+{nbytes} outside every allocation")


class Gpu:
    def __init__(self):
        self.executor = Executor()
        self.programs: dict[bytes, Program] = {}  # shader object bytes -> parsed
        self.wrong_from = bringup_from("gpu.answer", "wrong")
        self.image_fault = bringup("gpu.image") == "fault"

    def __call__(self, packets, mem) -> list | None:
        """Execute one submission (the mock's on_submit); the packets not yet run when a
        CP_WAIT_REG_MEM blocks, else None."""
        loads = [self._program(mem, *_source(pk.payload)) for pk in packets
                 if pk.kind == cs.TYPE7 and pk.name.startswith("CP_LOAD_STATE6")
                 and _state(pk.payload) == (cs.SB6_CS_SHADER, cs.ST6_SHADER)]
        self.executor.prepare(loads)
        regs, state, self.nth = {}, {}, 0
        for i, pk in enumerate(packets):
            if pk.kind == cs.TYPE4:
                regs.update({pk.code + i: v for i, v in enumerate(pk.payload)})
            elif pk.name.startswith("CP_LOAD_STATE6"):
                state[_state(pk.payload)] = _source(pk.payload)
            elif pk.name in ("CP_EXEC_CS", "CP_RUN_OPENCL"):
                self._dispatch(mem, regs, state, pk)
            elif pk.name == "CP_MEM_WRITE":
                memory_writes([pk], mem)
            elif pk.name == "CP_REG_TO_MEM":
                _counter_to_mem(pk, mem)
            elif pk.name == "CP_WAIT_REG_MEM" and not _polled(pk.payload, mem):
                return packets[i:]
        return None

    def _program(self, mem, addr: int, units: int) -> Program:
        raw = bytes(mem.view(addr, units * SHADER_UNIT))
        if raw not in self.programs:
            try:
                self.programs[raw] = parse(raw)
            except Exception as e:
                raise GpuFault(f"shader object at {addr:#x} is not a program: {e}") from None
        return self.programs[raw]

    def _dispatch(self, mem, regs: dict, state: dict, pk) -> None:
        where = f"{pk.name} (packet {pk.index}, dword {pk.at})"
        if (cs.SB6_CS_SHADER, cs.ST6_SHADER) not in state:
            raise GpuFault(f"{where}: no shader loaded")
        prog = self._program(mem, *state[cs.SB6_CS_SHADER, cs.ST6_SHADER])
        consts_addr, vec4s = state.get((cs.SB6_CS_SHADER, cs.ST6_CONSTANTS), (0, 0))
        if vec4s < prog.const_vec4s:
            raise GpuFault(f"{where}: {prog.kernel} takes {len(prog.params)} parameters, "
                           f"{vec4s} constant vec4s loaded")
        consts = mem.words(consts_addr, vec4s * 4) if vec4s else []
        args = [self._arg(mem, state, kind, consts[at] | consts[at + 1] << 32, where)
                for kind, at in zip(prog.params, prog.offsets)]
        gs, ls = _sizes(regs, where)
        groups = [g // n for g, n in zip(gs, ls)]
        said = list(pk.payload[1:]) if pk.name == "CP_EXEC_CS" else \
            [regs.get(R[f"HLSQ_CS_KERNEL_GROUP_{c}"]) for c in "XYZ"]
        if said != groups:
            raise GpuFault(f"{where}: groups {said}, the NDRANGE registers give {groups}")
        self.executor.run(prog, args, gs, ls)
        self.nth += 1
        if self.wrong_from and self.nth >= self.wrong_from and args[0][0] is ParamKind.BUFFER:
            word = ctypes.c_uint32.from_address(args[0][1])
            word.value ^= 0xFFFFFFFF

    def _arg(self, mem, state: dict, kind: ParamKind, value: int, where: str) -> tuple:
        if kind is ParamKind.BUFFER:
            return (kind, *host_address(mem, value, 1))
        if self.image_fault:
            raise GpuFault(f"{where}: texture slot {value}: injected (KEEL_MOCK_BRINGUP gpu.image)")
        descs, count = state.get((cs.SB6_CS_TEX, cs.ST6_CONSTANTS), (0, 0))
        samp, nsamp = state.get((cs.SB6_CS_TEX, cs.ST6_SHADER), (0, 0))
        if value >= count or nsamp < 1:
            raise GpuFault(f"{where}: texture slot {value} of {count} loaded, {nsamp} samplers")
        try:
            texture.check_sampler(mem.words(samp, texture.SAMPLER_DWORDS))
            t = texture.decode(mem.words(descs + 64 * value, texture.DESCRIPTOR_DWORDS))
        except ValueError as e:
            raise GpuFault(f"{where}: {e}") from None
        return (kind, host_address(mem, t.gpuaddr, texture.nbytes(t))[0], t)


def memory_writes(packets, mem) -> None:
    """The CP's CP_MEM_WRITEs alone: an on_submit for timing the host side without running
    kernels (tools/bench_qcom.py)."""
    for pk in packets:
        if pk.kind == cs.TYPE7 and pk.name == "CP_MEM_WRITE":
            dst = mem.words(pk.payload[0] | pk.payload[1] << 32, len(pk.payload) - 2)
            dst[:] = _u32(pk.payload[2:])


def always_on() -> int:
    """The mock's CP_ALWAYS_ON_COUNTER: the host's monotonic clock at the counter's 19.2 MHz."""
    return time.perf_counter_ns() * (cs.ALWAYS_ON_HZ // 1000) // 1_000_000


def _counter_to_mem(pk, mem) -> None:
    """CP_REG_TO_MEM: the one register the mock reads is the always-on counter, both dwords
    as one 64-bit write (how Linux and Mesa read it); anything else it does not model."""
    head = pk.payload[0]
    reg, count = head & 0x3FFFF, (head >> 18) & 0xFFF
    if reg != cs.CP_ALWAYS_ON_COUNTER or count != 2 or not head & cs.REG_TO_MEM_64B or \
            head & cs.REG_TO_MEM_ACCUMULATE:
        raise GpuFault(f"CP_REG_TO_MEM (packet {pk.index}, dword {pk.at}) of register {reg:#x}, "
                       f"{count} dwords, header {head:#010x}: the mock reads only "
                       f"CP_ALWAYS_ON_COUNTER ({cs.CP_ALWAYS_ON_COUNTER:#x}), 2 dwords, 64-bit, "
                       f"not accumulated")
    value = always_on()
    dst = mem.words(pk.payload[1] | pk.payload[2] << 32, 2)
    dst[:] = _u32([value & 0xFFFFFFFF, value >> 32])


# CP_WAIT_REG_MEM dword 0 bits 0-2 (adreno_pm4.xml cp_cond_function, mirror/mesa@8334434e):
# (value & mask) OP reference
_COMPARE = {0: lambda v, r: True, 1: lambda v, r: v < r, 2: lambda v, r: v <= r,
            3: lambda v, r: v == r, 4: lambda v, r: v != r, 5: lambda v, r: v >= r,
            6: lambda v, r: v > r}


def _polled(payload, mem) -> bool:
    """Whether a CP_WAIT_REG_MEM lets the stream go on: dwords address lo/hi, reference, mask."""
    if not payload[0] & cs.WAIT_POLL_MEMORY:
        return True
    value = mem.words(payload[1] | payload[2] << 32, 1)[0] & payload[4]
    if payload[0] & 7 not in _COMPARE:
        raise GpuFault(f"CP_WAIT_REG_MEM function {payload[0] & 7}")
    return _COMPARE[payload[0] & 7](value, payload[3])


def _state(payload) -> tuple[int, int]:
    """(state block, state type) of a CP_LOAD_STATE6 header word."""
    return (payload[0] >> 18) & 0xF, (payload[0] >> 14) & 3


def _source(payload) -> tuple[int, int]:
    """(GPU address, units) an indirect CP_LOAD_STATE6 loads from."""
    if len(payload) != 3:
        raise GpuFault(f"CP_LOAD_STATE6 with {len(payload)} words: the mock loads indirectly only")
    return payload[1] | payload[2] << 32, payload[0] >> 22


def _sizes(regs: dict, where: str) -> tuple[list[int], list[int]]:
    nd = [regs.get(R[f"HLSQ_CS_NDRANGE_{i}"]) for i in range(7)]
    if None in nd:
        raise GpuFault(f"{where}: HLSQ_CS_NDRANGE_0..6 not all written")
    dims = nd[0] & 3
    ls = [((nd[0] >> s) & 0x3FF) + 1 for s in (2, 12, 22)]
    gs = [nd[1], nd[3], nd[5]]
    if any(nd[i] for i in (2, 4, 6)) or any(g % n for g, n in zip(gs, ls)) or 0 in gs or not dims \
            or any(g != 1 for g in gs[dims:]):
        raise GpuFault(f"{where}: ndrange global {gs} local {ls} dims {dims} offsets "
                       f"{[nd[2], nd[4], nd[6]]}: expected whole work-groups and no offsets")
    return gs, ls


def _u32(values) -> memoryview:
    return memoryview((ctypes.c_uint32 * len(values))(*values)).cast("B").cast("I")
