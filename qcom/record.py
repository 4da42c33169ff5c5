"""The whole graph as one indirect buffer, recorded once from the blob's replay table.

`record(blob, programs, layout)` returns each launch's packets (u32 words), the argument block
they point into (kernel constants, texture descriptors, the one sampler), and where in that block
each (launch, argument) that is an io slot has its address (runner/graph.py's patch sites), so a
run that binds other io memory rewrites only those dwords. `stream(recording, launches)` is the
indirect buffer of a launch range (an entry point's).

Per launch:
  CP_WAIT_FOR_IDLE                       when the launch reads what an earlier one wrote (barrier)
  SP_CS_OBJ_START, SP_CS_INSTRLEN        where the program's binary is, and its length
  CP_LOAD_STATE6_FRAG shader, constants  indirect loads from the shader object and the arg block
  SP_CS_TEX_COUNT, CP_LOAD_STATE6_FRAG textures and sampler, SP_CS_TEX_CONST / _SAMP  (images)
  HLSQ_CS_NDRANGE_0..6, HLSQ_CS_KERNEL_GROUP_X..Z, CP_RUN_OPENCL   sizes, then the dispatch
                                         (CP_RUN_OPENCL: how tinygrad launches vendor binaries)
A stream starts by entering compute mode and pointing the border-colour base at a zeroed
table (clamp-to-border reads 0, OpenCL's CLK_ADDRESS_CLAMP), and ends waiting for idle.

The shader registers come from the program's parse (qcom/program.py, qcom/vendor.py):
SP_CS_CTRL_REG0 (register footprints, branch stack, 64-wide threads), SP_CS_UNKNOWN_A9B1 (local
memory and constant RAM mode 256: 0x41, what a6xx.xml saw vendor streams write, up to 2 KB),
SP_CS_OBJ_FIRST_EXEC_OFFSET, SP_CS_CONFIG (enabled, textures, samplers), HLSQ_CS_CNTL (constant
length, enabled) and HLSQ_CS_CNTL_0/1 with the "no register" ids vendor streams carry. No
private memory: a binary that needs it is refused at parse. docs/qcom.md lists what only
hardware can prove.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from qcom import cmdstream as cs
from qcom import texture
from qcom.cmdstream import lohi, pkt4, pkt7
from qcom.program import ParamKind
from runner.errors import BlobError
from runner.queue import STAMP_BYTES
from runner.format import IO_REGIONS

OP, R = cs.OPCODES, cs.REGISTERS
CONST_RAM_256 = 2 << 5  # SP_CS_UNKNOWN_A9B1 bits 5-6: constant RAM mode, 256 vec4s
NO_REG = 0xFC  # a3xx_regid meaning "none": what HLSQ_CS_CNTL_0/1 hold when unused
CS_CNTL_0 = 0x00CCC0CF  # HLSQ_CS_CNTL_0 as vendor OpenCL streams program it (tinygrad)
MAX_GROUP = 128  # work items per group the recorder picks when the blob leaves it to the driver


class Layout(NamedTuple):
    """GPU addresses of what the stream names."""
    region: dict  # Region.ARENA / WEIGHTS -> base address
    io: list  # io slot -> address bound now
    shaders: dict  # kernel -> address of its binary
    args: int  # the argument block
    border: int  # the zeroed border-colour table


class Recording(NamedTuple):
    launches: list[list[int]]  # per launch, its packets
    args: np.ndarray  # uint32 dwords of the argument block
    at: dict  # (launch, argument) of an io slot -> dword index in args of its 64-bit address,
    # or of its texture descriptor when the kernel reads it as an image (an R8 camera frame)
    border: int  # the zeroed border-colour table's address
    textures: frozenset  # the `at` values that are texture descriptors (texture.set_base)


def address(b, layout: Layout) -> int:
    return layout.io[b.slot] if b.region in IO_REGIONS else \
        layout.region[b.region] + b.offset


def stream(rec: Recording, launches: range, stamps: int | None = None) -> list[int]:
    """The indirect buffer of these launches: compute mode and the border-colour base first,
    then each launch's packets, then a wait for idle. With `stamps` (a GPU address: STAMP_BYTES
    per launch of the blob), each launch runs alone between two reads of the always-on counter
    (wait for idle, counter, the launch, wait for idle, counter), as profiling asks."""
    idle, body = pkt7(OP["CP_WAIT_FOR_IDLE"]), []
    for i in launches:
        if stamps is None:
            body += rec.launches[i]
        else:
            at = stamps + STAMP_BYTES * i
            body += idle + cs.counter_to_mem(at) + rec.launches[i] + idle + \
                cs.counter_to_mem(at + STAMP_BYTES // 2)
    return pkt7(OP["CP_SET_MARKER"], cs.RM6_COMPUTE) + \
        pkt4(R["SP_PS_TP_BORDER_COLOR_BASE_ADDR_LO"], *lohi(rec.border)) + body + idle


def local_size(gs: list[int]) -> list[int]:
    """Per dim the largest divisor of the global size that keeps the group within MAX_GROUP."""
    out, room = [], MAX_GROUP
    for g in gs:
        d = max(d for d in range(1, min(g, room) + 1) if g % d == 0)
        out.append(d)
        room //= d
    return out


def _shader_regs(prog, shader: int, ntex: int) -> list[int]:
    """SP_CS_CTRL_REG0..SP_CS_OBJ_START, SP_CS_CONFIG + SP_CS_INSTRLEN, HLSQ_CS_CNTL: from the
    program's parse. Field positions: a6xx.xml (a6xx_sp_xs_ctrl_reg0, a6xx_sp_xs_config,
    a6xx_hlsq_xs_cntl); threads are 64 wide (THREADSIZE 0)."""
    r = prog.regs
    ctrl = r.half << 1 | r.full << 7 | r.branch << 14
    shared = max(1, (r.shared - 1) // 1024)  # KB above the first, at least 1 (tinygrad's)
    config = 1 << 8 | ntex << 9 | min(ntex, 1) << 17
    return (pkt4(R["SP_CS_CTRL_REG0"], ctrl, CONST_RAM_256 | shared, 0, r.first, *lohi(shader))
            + pkt4(R["SP_CS_CONFIG"], config, len(prog.binary) // 4)
            + pkt4(R["HLSQ_CS_CNTL"], prog.const_vec4s >> 2 | 1 << 8))


def _load(block: int, kind: int, units: int, addr: int) -> list[int]:
    head = units << 22 | block << 18 | cs.SS6_INDIRECT << 16 | kind << 14
    return pkt7(OP["CP_LOAD_STATE6_FRAG"], head, *lohi(addr))


def _sizes(ln) -> list[int]:
    gs = list(ln.global_size) + [1] * (3 - len(ln.global_size))
    ls = list(ln.local_size) + [1] * (3 - len(ln.local_size)) if ln.local_size else local_size(gs)
    if any(g % n for g, n in zip(gs, ls)) or max(ls) > 1024:
        raise BlobError(f"launch {ln.kernel}: global size {gs} is not whole work-groups of {ls}")
    nd0 = len(ln.global_size) | (ls[0] - 1) << 2 | (ls[1] - 1) << 12 | (ls[2] - 1) << 22
    return (pkt4(R["HLSQ_CS_NDRANGE_0"], nd0, gs[0], 0, gs[1], 0, gs[2], 0, CS_CNTL_0, NO_REG,
                 *(g // n for g, n in zip(gs, ls)))  # HLSQ_CS_CNTL_0/1, KERNEL_GROUP_X..Z
            + pkt7(OP["CP_RUN_OPENCL"], 0))


def _launch_packets(blob, ln, prog, layout: Layout, args: list[int], sites: list) -> list[int]:
    """One dispatch's packets; appends its constants and descriptors to `args` (dwords), and to
    `sites` (argument, dword, is a descriptor) for each io argument."""
    if len(ln.args) != len(prog.params):
        raise BlobError(f"launch {ln.kernel}: {len(ln.args)} buffers for a kernel of "
                        f"{len(prog.params)} parameters")
    consts, descs = [0] * (prog.const_vec4s * 4), []
    for dword, value in prog.imms:
        consts[dword] = value
    for i, (bid, kind, at) in enumerate(zip(ln.args, prog.params, prog.offsets)):
        b = blob.buffers[bid]
        if kind is ParamKind.IMAGE:
            if b.image is None:
                raise BlobError(f"launch {ln.kernel}: parameter {i} is an image, buffer {bid} "
                                f"has no image layout")
            if at is not None:  # mock binaries: the slot is a constant too
                consts[at] = len(descs) // texture.DESCRIPTOR_DWORDS
            if b.region in IO_REGIONS:
                sites.append((i, len(args) + len(consts) + len(descs), True))
            img = b.image
            try:
                descs += texture.descriptor(texture.Texture(
                    address(b, layout), img.width, img.height, img.pitch, b.dtype))
            except ValueError as e:
                raise BlobError(f"launch {ln.kernel}: buffer {bid} as an image: {e}") from None
            continue
        consts[at:at + 2] = lohi(address(b, layout))
        if b.region in IO_REGIONS:
            sites.append((i, len(args) + at, False))
    base = layout.args + 4 * len(args)
    args += consts + descs
    args += [0] * (-len(args) % 16)  # every block 64-byte aligned
    words = pkt7(OP["CP_WAIT_FOR_IDLE"]) if ln.barrier else []
    shader, ntex = layout.shaders[ln.kernel], len(descs) // texture.DESCRIPTOR_DWORDS
    words += _shader_regs(prog, shader, ntex) + \
        _load(cs.SB6_CS_SHADER, cs.ST6_SHADER, prog.units, shader) + \
        _load(cs.SB6_CS_SHADER, cs.ST6_CONSTANTS, prog.const_vec4s, base)
    if descs:
        n, tex = ntex, base + 4 * len(consts)
        words += pkt4(R["SP_CS_TEX_COUNT"], n) + \
            _load(cs.SB6_CS_TEX, cs.ST6_CONSTANTS, n, tex) + \
            _load(cs.SB6_CS_TEX, cs.ST6_SHADER, 1, layout.args) + \
            pkt4(R["SP_CS_TEX_CONST_LO"], *lohi(tex)) + \
            pkt4(R["SP_CS_TEX_SAMP_LO"], *lohi(layout.args))
    return words + _sizes(ln)


def record(blob, programs: dict, layout: Layout) -> Recording:
    args = texture.sampler() + [0] * 12  # the one sampler, at the start of the block
    at, launches, textures = {}, [], set()
    for i, ln in enumerate(blob.launches):
        sites: list = []
        launches.append(_launch_packets(blob, ln, programs[ln.kernel], layout, args, sites))
        at.update({(i, j): dword for j, dword, _ in sites})
        textures.update(dword for _, dword, desc in sites if desc)
    return Recording(launches, np.array(args, np.uint32), at, layout.border, frozenset(textures))


def args_bytes(blob, programs: dict) -> int:
    """The argument block's size, known before any address is (to allocate it first)."""
    n = 16
    for ln in blob.launches:
        p = programs[ln.kernel]
        imgs = sum(k is ParamKind.IMAGE for k in p.params)
        n += -(-(p.const_vec4s * 4 + imgs * texture.DESCRIPTOR_DWORDS) // 16) * 16
    return 4 * n
