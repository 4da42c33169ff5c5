"""A blob's whole graph recorded once as PM4 (the Adreno path's shape): one indirect buffer of
dispatches with a cache barrier where the blob's replay table asks for one, and one kernarg block
per launch holding its buffers' GPU addresses and the hidden arguments its metadata lists.

Per run nothing in the indirect buffer changes: binding an io slot rewrites only the 8-byte
pointers at `Recording.slots[slot]` (offsets into the kernarg region), and the queue gets the same
two packets, INDIRECT_BUFFER and a RELEASE_MEM of the next timeline value.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from am import pm4
from am.elf import CodeObject, Kernel
from runner.errors import BlobError
from runner.queue import STAMP_BYTES
from runner.format import IO_REGIONS

KERNARG_ALIGN = 64
MAX_GROUP = 64  # threads per group when the blob leaves the choice to the device: two waves32


@dataclass
class Recording:
    ib: list[int]  # dwords
    kernargs: bytearray
    slots: dict[int, list[int]] = field(default_factory=dict)  # io slot -> kernarg offsets
    starts: list[int] = field(default_factory=list)  # launch i's packets: ib[starts[i]:starts[i+1]]

    def stream(self, launches: range, stamps: int | None = None) -> list[int]:
        """The indirect buffer of a launch range (an entry point's). With `stamps` (a GPU
        address: STAMP_BYTES per launch of the blob), the GPU clock counter is written at end
        of pipe before and after each launch (pm4.clock_to_mem), as profiling asks."""
        ends = self.starts + [len(self.ib)]
        if stamps is None:
            return self.ib[ends[launches.start]:ends[launches.stop]]
        out = []
        for i in launches:
            at = stamps + STAMP_BYTES * i
            out += pm4.clock_to_mem(at) + self.ib[ends[i]:ends[i + 1]] + \
                pm4.clock_to_mem(at + STAMP_BYTES // 2)
        return out


def record(blob, co: CodeObject, code_base: int, kernarg_base: int, address) -> Recording:
    """`address(buffer id)` is the GPU address of a buffer (io slots: their bound memory)."""
    rec = Recording([], bytearray())
    for ln in blob.launches:
        k = co.kernels.get(ln.kernel)
        if k is None:
            raise BlobError(f"launch of {ln.kernel!r}: no such kernel in the code object")
        at = len(rec.kernargs)
        args, slots = _kernargs(blob, k, ln, address)
        rec.kernargs += args.ljust(-(-len(args) // KERNARG_ALIGN) * KERNARG_ALIGN, b"\0")
        for slot, off in slots:
            rec.slots.setdefault(slot, []).append(at + off)
        rec.starts.append(len(rec.ib))
        if ln.barrier:
            rec.ib += pm4.acquire_mem()
        rec.ib += _dispatch(k, code_base, kernarg_base + at, ln)
    return rec


def sizes(ln) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(work-groups, threads per group) in x, y, z."""
    glob = (tuple(ln.global_size) + (1, 1))[:3]
    if ln.local_size is not None:
        local = (tuple(ln.local_size) + (1, 1))[:3]
    else:
        local = (max(d for d in range(1, MAX_GROUP + 1) if glob[0] % d == 0), 1, 1)
    return tuple(g // max(w, 1) for g, w in zip(glob, local)), local


def _kernargs(blob, k: Kernel, ln, address) -> tuple[bytes, list[tuple[int, int]]]:
    groups, local = sizes(ln)
    out, slots = bytearray(k.kernarg_size), []
    buffers = iter(ln.args)
    hidden = {f"hidden_block_count_{c}": g for c, g in zip("xyz", groups)}
    hidden |= {f"hidden_group_size_{c}": w for c, w in zip("xyz", local)}
    for a in k.args:
        if a.kind == "global_buffer":
            b = next(buffers, None)
            if b is None:
                raise BlobError(f"{ln.kernel}: more pointer arguments than the launch's "
                                f"{len(ln.args)} buffers")
            struct.pack_into("<Q", out, a.offset, address(b))
            if blob.buffers[b].region in IO_REGIONS:
                slots.append((blob.buffers[b].slot, a.offset))
        elif a.kind in hidden:
            out[a.offset:a.offset + a.size] = hidden[a.kind].to_bytes(a.size, "little")
        elif not a.kind.startswith("hidden_"):
            raise BlobError(f"{ln.kernel}: argument kind {a.kind!r} at {a.offset}; keel kernels "
                            f"take buffers only")
    if next(buffers, None) is not None:
        raise BlobError(f"{ln.kernel}: the launch binds more buffers than the kernel takes")
    return bytes(out), slots


def _dispatch(k: Kernel, code_base: int, kernarg: int, ln) -> list[int]:
    if k.scratch_bytes:
        raise BlobError(f"kernel {k.name!r} needs {k.scratch_bytes} bytes of scratch per work "
                        f"item; the amd device sets up no scratch memory")
    user = k.kernarg_sgpr
    if user:  # the private segment buffer / dispatch / queue pointers keel kernels never use
        raise BlobError(f"kernel {k.name!r} asks for user SGPRs before its kernarg pointer "
                        f"(code properties 0x{k.properties:x}); expected the kernarg pointer only")
    groups, local = sizes(ln)
    entry = code_base + k.entry
    rsrc1, rsrc2, rsrc3 = k.rsrc
    return (pm4.set_sh("COMPUTE_PGM_LO", entry >> 8, entry >> 40) +
            pm4.set_sh("COMPUTE_PGM_RSRC1", rsrc1, rsrc2) + pm4.set_sh("COMPUTE_PGM_RSRC3", rsrc3) +
            pm4.set_sh("COMPUTE_START_X", 0, 0, 0, *local) +
            pm4.set_sh("COMPUTE_USER_DATA_0", kernarg, kernarg >> 32) +
            pm4.dispatch(groups, wave32=k.wave == 32))
