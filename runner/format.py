"""The blob format's single definition (docs/blob.md): constants and the pure functions that fix
its bytes. The compiler's writer and the runner's reader both import this module, so they cannot
drift apart. No I/O and no validation live here: runner/blob.py checks, compiler/blob.py writes.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from enum import StrEnum

import numpy as np

MAGIC = b"KEELBLOB"
VERSION = 5  # 5: io buffers carry their io slot in "slot", no longer in "offset"
# magic, version, header_size, flags, file_size, manifest_offset, manifest_size,
# manifest_sha256, file_sha256, producer, target  (little-endian, 176 bytes)
HEADER = struct.Struct("<8sIIQQQQ32s32s32s32s")
FILE_SHA256_AT = 80  # the file hash reads these 32 bytes (the field itself) as zeros
SECTION_ALIGN = 4096
# Sections, in file order: the weights every variant reads, each variant's own weights, then each
# variant's programs and graph; a variant's are named after its target ("programs.cpu-avx512").
# A variant is one build of the model for one target: a `cpu` blob holds cpu-avx2 and
# cpu-avx512, other blobs one. A variant's kernels see its weights as one region starting at
# section "weights": its own section lies further on in the file, at the offset layout gives it.
WEIGHTS = "weights"
PER_VARIANT = ("weights", "programs", "graph", "binaries")
CHUNK_BYTES = 4 << 20  # sections are hashed in chunks of this size, in parallel
MAX_INT = 2**63 - 1  # manifest integers must fit an int64 / uint64 on the C side
DEFAULT_ENTRY = "main"  # the one entry of a blob compiled from one ONNX model
# an entry point's name: openpilot's own "1928x1208/run_policy" is one (kernels are named after
# their entry's index and name, made an identifier: compiler/pipeline.py)
ENTRY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,63}")


def entry_name_ok(name) -> bool:
    return type(name) is str and ENTRY_NAME.fullmatch(name) is not None
class Region(StrEnum):
    """Where a buffer lives; the manifest spells each by its value."""
    ARENA = "arena"
    WEIGHTS = "weights"
    INPUT = "input"
    OUTPUT = "output"


REGIONS = tuple(Region)
DEVICE_REGIONS = (Region.ARENA, Region.WEIGHTS)  # device memory the plan lays out
IO_REGIONS = (Region.INPUT, Region.OUTPUT)  # io slots, bound at each run
DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64")

# The graph section: the replay table. A u32 count pair, then one fixed-size record per launch,
# then every launch's argument buffer ids back to back (record i owns args[first : first + n]).
# Fixed-size records let a queue device read the table with one numpy view.
MAX_DIMS = 3
GRAPH_HEAD = struct.Struct("<II")  # launch count, argument count
LAUNCH = np.dtype([("program", "<u4"), ("flags", "<u4"), ("dims", "<u4"),
                   ("global_size", "<u4", MAX_DIMS), ("local_size", "<u4", MAX_DIMS),
                   ("first_arg", "<u4"), ("arg_count", "<u4")])
BARRIER = 1  # flags bit: wait for every earlier launch's memory effects before this one
FLAGS = BARRIER  # every defined bit
U32 = 2**32 - 1


# The binaries section: device binaries of the variant's programs (qcom: tools/compile.py
# --embed-binaries), empty when it has none. A header (magic, index length), the JSON index
# {"device": {...}, "programs": {name: {..., "at": byte, "size": bytes}}}, then the binaries,
# each at its "at" from the end of the index.
BINARIES = struct.Struct("<8sI")
BINARIES_MAGIC = b"KEELBIN1"


def pack_binaries(device: dict, programs: dict[str, tuple[dict, bytes]]) -> bytes:
    """device: what the binaries are bound to; programs: name -> (its facts, its bytes)."""
    index, at = {}, 0
    for name, (facts, data) in programs.items():
        index[name] = {**facts, "at": at, "size": len(data)}
        at += len(data)
    head = canonical_json({"device": device, "programs": index})
    return BINARIES.pack(BINARIES_MAGIC, len(head)) + head + \
        b"".join(data for _, data in programs.values())


def unpack_binaries(data) -> tuple[dict, memoryview]:
    """(the index, the bytes its "at" offsets count from); ValueError for what is not a
    binaries section (its fields are the reader's to check: runner/blob.py)."""
    view = memoryview(data)
    if len(view) < BINARIES.size:
        raise ValueError(f"{len(view)} bytes, shorter than its {BINARIES.size}-byte header")
    magic, n = BINARIES.unpack_from(view)
    if magic != BINARIES_MAGIC or BINARIES.size + n > len(view):
        raise ValueError(f"header: expected magic {BINARIES_MAGIC!r} and an index within the "
                         f"section, got {bytes(magic)!r} and {n} bytes of {len(view)}")
    return json.loads(bytes(view[BINARIES.size:BINARIES.size + n])), view[BINARIES.size + n:]


def section_names(variants: list[str]) -> list[str]:
    """The section names of a blob holding these variants (their targets), in file order."""
    return [WEIGHTS] + [f"{WEIGHTS}.{v}" for v in variants] + \
        [f"{kind}.{v}" for v in variants for kind in PER_VARIANT[1:]]


def variant_sections(variant: str) -> list[str]:
    """The sections one variant reads: shared weights, its own weights, programs, graph,
    binaries."""
    return [WEIGHTS] + [f"{kind}.{variant}" for kind in PER_VARIANT]


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def pack_graph(launches: list[tuple]) -> bytes:
    """(program, barrier, args, global_size, local_size | None) per launch -> the graph section.
    Unused dims hold 1 in global_size; a local_size of None is stored as zeros (device's choice)."""
    table = np.zeros(len(launches), LAUNCH)
    args: list[int] = []
    for rec, (program, barrier, a, gs, ls) in zip(table, launches):
        if not 1 <= len(gs) <= MAX_DIMS or max(program, *a, *gs, *(ls or ())) > U32:
            raise ValueError(f"launch of program {program}: sizes {gs} / {ls} and args {a} must "
                             f"fit {MAX_DIMS} dims of u32")
        rec["program"], rec["flags"], rec["dims"] = program, BARRIER if barrier else 0, len(gs)
        rec["global_size"] = tuple(gs) + (1,) * (MAX_DIMS - len(gs))
        rec["local_size"] = (0,) * MAX_DIMS if ls is None else tuple(ls) + (1,) * (MAX_DIMS - len(ls))
        rec["first_arg"], rec["arg_count"] = len(args), len(a)
        args += a
    return GRAPH_HEAD.pack(len(launches), len(args)) + table.tobytes() + \
        np.asarray(args, "<u4").tobytes()


def section_offsets(sizes: list[int]) -> list[int]:
    """Where sections of these sizes start, in order: the first at SECTION_ALIGN (the header's
    page stays to itself), each next one at the first SECTION_ALIGN multiple at or after the end
    of the one before. The manifest starts right after the last section."""
    offsets, end = [], SECTION_ALIGN
    for size in sizes:
        offsets.append(end)
        end = -(-(end + size) // SECTION_ALIGN) * SECTION_ALIGN
    return offsets


def chunk_sha256(section) -> list[str]:
    """SHA-256 (hex) of each CHUNK_BYTES piece of a section, in order; the last may be shorter."""
    view = memoryview(section).cast("B")
    return [hashlib.sha256(view[i:i + CHUNK_BYTES]).hexdigest()
            for i in range(0, len(view), CHUNK_BYTES)]


def file_sha256(data, sections) -> bytes:
    """The file digest: SHA-256 of every byte outside the sections, in file order, with the 32
    bytes at FILE_SHA256_AT read as zeros. `sections` are (offset, size) in file order, past the
    header and not overlapping. Since the manifest lists every chunk's digest, this one digest
    binds every byte of the file (docs/blob.md)."""
    data = memoryview(data).cast("B")
    h = hashlib.sha256(data[:FILE_SHA256_AT])
    h.update(bytes(32))
    pos = FILE_SHA256_AT + 32
    for offset, size in sections:
        h.update(data[pos:offset])
        pos = offset + size
    h.update(data[pos:])
    return h.digest()
