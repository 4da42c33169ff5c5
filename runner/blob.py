"""Blob format v1 (docs/blob.md): the layout constants, and the reader that validates everything.

`read_blob` maps the file and checks the header, the manifest (structure, types, every field), the
layout, every SHA-256, every buffer's bounds, the io slots and the launch table before returning.
Nothing in a blob runs until all of that has passed. The compiler's writer imports the layout from
here, so reader and writer cannot drift apart.

Every byte of the file is hashed exactly once: the sections as CHUNK_BYTES chunks whose digests the
manifest lists, everything else (header, padding, manifest) into the file digest. The chunks are
spread over threads (hashlib releases the GIL on large buffers) while the calling thread validates
the manifest, then joins in: load costs about one pass over the file divided by the cores.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
import threading
from dataclasses import dataclass

import numpy as np

from runner.device import TARGETS
from runner.errors import BlobError

MAGIC = b"KEELBLOB"
VERSION = 1
# magic, version, header_size, flags, file_size, manifest_offset, manifest_size,
# manifest_sha256, file_sha256, producer, target  (little-endian, 176 bytes)
HEADER = struct.Struct("<8sIIQQQQ32s32s32s32s")
FILE_SHA256_AT = 80  # the file hash reads these 32 bytes (the field itself) as zeros
SECTION_ALIGN = 4096
SECTIONS = ("weights", "programs", "graph")  # in file order
CHUNK_BYTES = 4 << 20  # sections are hashed in chunks of this size, in parallel
MAX_INT = 2**63 - 1  # manifest integers must fit an int64 / uint64 on the C side
MAX_HASH_THREADS = 8
REGIONS = ("arena", "weights", "input", "output")
DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64")
_NP_DTYPES = {name: np.dtype(name) for name in DTYPES}


@dataclass(frozen=True)
class BufferSpec:
    id: int
    region: str
    offset: int  # bytes into the arena / weights section; io slot (inputs, then outputs) for io
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    name: str


@dataclass(frozen=True)
class LaunchSpec:
    kernel: str
    args: tuple[int, ...]
    global_size: tuple[int, ...]
    local_size: tuple[int, ...] | None


@dataclass(frozen=True)
class Blob:
    target: str
    producer: str
    manifest: dict  # the validated JSON, for tools
    buffers: dict[int, BufferSpec]
    inputs: list[BufferSpec]  # in io slot order
    outputs: list[BufferSpec]
    launches: list[LaunchSpec]
    arena_bytes: int
    weights: memoryview  # zero-copy views into the mapped file
    programs: memoryview
    graph: memoryview


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def graph_section(launches: list[dict]) -> bytes:
    """The launch table as backends consume it: [kernel, args, global_size, local_size] rows."""
    return canonical_json([[l["kernel"], l["args"], l["global_size"], l["local_size"]]
                           for l in launches])


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


def read_blob(path) -> Blob:
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise BlobError(f"{path}: file is empty, expected a keel blob")
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise BlobError(f"cannot read blob {path}: {e}") from None
    return parse_blob(memoryview(data))


def parse_blob(data: memoryview) -> Blob:
    data = memoryview(data).cast("B")
    target, producer, m_start, m_end = _header(data)
    manifest = _manifest(data[m_start:m_end])
    table = manifest["sections"]
    _check_layout(table, m_start)
    if file_sha256(data, [(s["offset"], s["size"]) for s in table]) != \
            bytes(data[FILE_SHA256_AT:FILE_SHA256_AT + 32]):
        raise BlobError("file SHA-256 does not match the header (corrupt header, padding or "
                        "manifest)")
    sections = {s["name"]: data[s["offset"]:s["offset"] + s["size"]] for s in table}
    # the manifest is now known intact: check its meaning while other threads hash the sections
    with _ChunkCheck(sections, table) as chunks:
        buffers = _buffers(manifest["buffers"])
        _check_regions(buffers, manifest, len(sections["weights"]))
        launches = _launches(manifest["launches"], buffers)
        inputs = _io(manifest["inputs"], buffers, "input", first_slot=0)
        outputs = _io(manifest["outputs"], buffers, "output", first_slot=len(manifest["inputs"]))
        chunks.finish()
    if bytes(sections["graph"]) != graph_section(manifest["launches"]):
        raise BlobError("graph section does not match the manifest's launch table")
    return Blob(target=target, producer=producer, manifest=manifest, buffers=buffers,
                inputs=inputs, outputs=outputs, launches=launches,
                arena_bytes=manifest["arena_bytes"], **sections)


def _header(data: memoryview) -> tuple[str, str, int, int]:
    if len(data) < HEADER.size:
        raise BlobError(f"file is {len(data)} bytes, shorter than the {HEADER.size}-byte header")
    (magic, version, header_size, flags, file_size, m_offset, m_size, m_sha, _, producer,
     target) = HEADER.unpack_from(data)
    expect = [("magic", MAGIC, magic), ("format version", VERSION, version),
              ("header size", HEADER.size, header_size), ("flags", 0, flags)]
    for what, want, got in expect:
        if want != got:
            raise BlobError(f"header {what}: expected {want!r}, got {got!r}")
    if file_size != len(data):
        what = "truncated" if file_size > len(data) else "trailing bytes"
        raise BlobError(f"{what}: the header says {file_size} bytes, the file has {len(data)}")
    target, producer = _cstr(target, "target"), _cstr(producer, "producer")
    if target not in TARGETS:
        raise BlobError(f"header target: expected one of {sorted(TARGETS)}, got {target!r}")
    if m_offset < SECTION_ALIGN or m_offset + m_size != file_size:
        raise BlobError(f"manifest [{m_offset}, {m_offset + m_size}): expected to start at or "
                        f"after {SECTION_ALIGN} and end the {file_size}-byte file")
    if hashlib.sha256(data[m_offset:m_offset + m_size]).digest() != m_sha:
        raise BlobError("manifest SHA-256 does not match the header")
    return target, producer, m_offset, m_offset + m_size


def _cstr(field: bytes, what: str) -> str:
    text, _, pad = field.partition(b"\0")
    if pad.strip(b"\0") or not all(0x20 <= c < 0x7F for c in text):
        raise BlobError(f"header {what}: expected NUL-padded printable ASCII, got {field!r}")
    return text.decode()


# Manifest schema: each checker takes a value and returns nothing or raises _Invalid. The path to
# the bad value is collected while the exception unwinds, so valid manifests pay for no strings.

class _Invalid(Exception):
    def __init__(self, want: str, got):
        self.want, self.got, self.path = want, got, []

    def error(self) -> BlobError:
        where = "".join(f"[{k}]" if type(k) is int else f".{k}" for k in reversed(self.path))
        return BlobError(f"manifest {where.lstrip('.')}: expected {self.want}, "
                         f"got {repr(self.got)[:80]}")


def _int(v):
    if type(v) is not int or not 0 <= v <= MAX_INT:
        raise _Invalid("an integer in [0, 2**63)", v)


def _str(v):
    if type(v) is not str:
        raise _Invalid("a string", v)


def _sha256(v):
    if type(v) is not str or len(v) != 64 or v.strip("0123456789abcdef"):
        raise _Invalid("64 lowercase hex digits", v)


def _dict(v):
    if type(v) is not dict:
        raise _Invalid("an object", v)


def _one_of(choices):
    want, choices = f"one of {list(choices)}", frozenset(choices)

    def check(v):
        if type(v) is not str or v not in choices:
            raise _Invalid(want, v)
    return check


def _list(item):
    def check(v):
        if type(v) is not list:
            raise _Invalid("a list", v)
        x = None
        try:
            for x in v:
                item(x)
        except _Invalid as e:  # x is the first bad item: every equal item before it passed
            e.path.append(next(i for i, y in enumerate(v) if y is x))
            raise
    return check


def _nullable(check):
    def nullable(v):
        if v is not None:
            check(v)
    return nullable


def _obj(fields):
    keys, items = fields.keys(), tuple(fields.items())

    def check(v):
        if type(v) is not dict:
            raise _Invalid("an object", v)
        if v.keys() != keys:
            raise _Invalid(f"keys {sorted(keys)}", sorted(v))
        k = None
        try:
            for k, item in items:
                item(v[k])
        except _Invalid as e:
            e.path.append(k)
            raise
    return check


_MANIFEST = _obj({
    "arena_bytes": _int,
    "arena_lower_bound_bytes": _int,
    "buffers": _list(_obj({"id": _int, "region": _one_of(REGIONS), "offset": _int,
                           "nbytes": _int, "dtype": _one_of(DTYPES), "shape": _list(_int),
                           "name": _str})),
    "inputs": _list(_int),
    "outputs": _list(_int),
    "launches": _list(_obj({"kernel": _str, "args": _list(_int), "global_size": _list(_int),
                            "local_size": _nullable(_list(_int))})),
    "sections": _list(_obj({"name": _one_of(SECTIONS), "offset": _int, "size": _int,
                            "chunk_sha256": _list(_sha256)})),
    "meta": _dict,
})


def _no_duplicates(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise BlobError(f"manifest: duplicate keys in object with keys {[k for k, _ in pairs]}")
    return obj


def _no_constants(name):
    raise BlobError(f"manifest: expected finite numbers, got {name}")


def _manifest(raw: memoryview) -> dict:
    try:
        manifest = json.loads(bytes(raw).decode(), object_pairs_hook=_no_duplicates,
                              parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:  # ValueError: bad UTF-8, bad JSON, huge integers
        raise BlobError(f"manifest is not valid UTF-8 JSON: {e}") from None
    try:
        _MANIFEST(manifest)
    except _Invalid as e:
        raise e.error() from None
    if manifest["arena_lower_bound_bytes"] > manifest["arena_bytes"]:
        raise BlobError(f"manifest arena_lower_bound_bytes: expected <= arena_bytes "
                        f"{manifest['arena_bytes']}, got {manifest['arena_lower_bound_bytes']}")
    return manifest


def _check_layout(table: list[dict], m_start: int) -> None:
    """Sections in file order at exactly the offsets docs/blob.md gives, the manifest right after
    the last one: the layout follows from the sizes, so there is nothing to overlap or skip."""
    names = [s["name"] for s in table]
    if names != list(SECTIONS):
        raise BlobError(f"section table: expected sections {list(SECTIONS)} in this order, "
                        f"got {names}")
    for s, want in zip(table, section_offsets([s["size"] for s in table])):
        if s["offset"] != want:
            raise BlobError(f"section {s['name']}: offset expected {want}, got {s['offset']}")
        chunks = -(-s["size"] // CHUNK_BYTES)
        if len(s["chunk_sha256"]) != chunks:
            raise BlobError(f"section {s['name']}: expected {chunks} chunk digests for "
                            f"{s['size']} bytes, got {len(s['chunk_sha256'])}")
    end = table[-1]["offset"] + table[-1]["size"]
    if m_start != end:
        raise BlobError(f"manifest offset: expected {end} (the end of section {SECTIONS[-1]}), "
                        f"got {m_start}")


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class _ChunkCheck:
    """Checks every section chunk's SHA-256. Worker threads start hashing at once; finish() lends
    the calling thread to the remaining chunks, joins the workers and raises on a mismatch.
    Leaving the `with` block early stops the workers after their current chunk."""

    def __init__(self, sections: dict[str, memoryview], table: list[dict]):
        self._jobs = [(s["name"], i, want, sections[s["name"]][i * CHUNK_BYTES:][:CHUNK_BYTES])
                      for s in table for i, want in enumerate(s["chunk_sha256"])]
        self._got: list[str | None] = [None] * len(self._jobs)
        self._todo = iter(range(len(self._jobs)))  # shared: next() on it is atomic under the GIL
        self._stop = False
        self._errors: list[BaseException] = []
        big = sum(s["size"] for s in table) > CHUNK_BYTES  # below that a thread costs more
        n = min(_cpus(), len(self._jobs), MAX_HASH_THREADS) - 1 if big else 0
        self._threads = []
        for _ in range(n):
            t = threading.Thread(target=self._work, daemon=True, name="keel-sha256")
            try:
                t.start()
            except RuntimeError:  # no more threads: the ones we have do the work
                break
            self._threads.append(t)
        self.threads = 1 + len(self._threads)  # the calling thread hashes too

    def _work(self) -> None:
        try:
            for i in self._todo:
                if self._stop:
                    return
                self._got[i] = hashlib.sha256(self._jobs[i][3]).hexdigest()
        except BaseException as e:  # re-raised by finish() in the calling thread
            self._stop = True
            self._errors.append(e)

    def finish(self) -> None:
        self._work()
        self._join()
        if self._errors:
            raise self._errors[0]
        for (name, i, want, chunk), got in zip(self._jobs, self._got):
            if got != want:
                start = i * CHUNK_BYTES
                raise BlobError(f"section {name}: SHA-256 mismatch in chunk {i} (bytes "
                                f"[{start}, {start + len(chunk)}) of the section), expected "
                                f"{want}, got {got}")

    def _join(self) -> None:
        for t in self._threads:
            t.join()
        self._threads = []

    def __enter__(self) -> "_ChunkCheck":
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._join()


def _buffers(records: list[dict]) -> dict[int, BufferSpec]:
    buffers = {}
    for r in records:
        if r["id"] in buffers:
            raise BlobError(f"manifest buffers: id {r['id']} appears twice")
        buffers[r["id"]] = BufferSpec(r["id"], r["region"], r["offset"], r["nbytes"],
                                      _NP_DTYPES[r["dtype"]], tuple(r["shape"]), r["name"])
    return buffers


def _check_regions(buffers: dict[int, BufferSpec], manifest: dict, weights_bytes: int) -> None:
    limits = {"arena": manifest["arena_bytes"], "weights": weights_bytes}
    for b in buffers.values():
        if b.region in limits and b.offset + b.nbytes > limits[b.region]:
            raise BlobError(f"buffer {b.id}: [{b.offset}, {b.offset + b.nbytes}) exceeds the "
                            f"{limits[b.region]}-byte {b.region} region")
        if b.region in ("input", "output"):
            want = math.prod(b.shape) * b.dtype.itemsize  # exact: int64 could wrap
            if b.nbytes != want:
                raise BlobError(f"buffer {b.id} ({b.name!r}): nbytes expected {want} for "
                                f"{b.dtype} {b.shape}, got {b.nbytes}")


def _io(ids: list[int], buffers: dict[int, BufferSpec], region: str,
        first_slot: int) -> list[BufferSpec]:
    """io slots number inputs first, then outputs: output j is slot len(inputs) + j."""
    slots = [buffers.get(i) for i in ids]
    for slot, (i, b) in enumerate(zip(ids, slots), start=first_slot):
        if b is None or b.region != region or b.offset != slot:
            got = "no such buffer" if b is None else f"region {b.region!r} slot {b.offset}"
            raise BlobError(f"manifest {region}s[{slot - first_slot}]: buffer {i} expected region "
                            f"{region!r} slot {slot}, got {got}")
    declared = sorted(b.id for b in buffers.values() if b.region == region)
    if declared != sorted(ids):
        raise BlobError(f"manifest {region}s: expected every {region} buffer {declared}, got {ids}")
    names = [b.name for b in slots]
    if "" in names or len(set(names)) != len(names):
        raise BlobError(f"manifest {region}s: names must be non-empty and unique, got {names}")
    return slots


def _launches(records: list[dict], buffers: dict[int, BufferSpec]) -> list[LaunchSpec]:
    launches = []
    for i, r in enumerate(records):
        missing = [a for a in r["args"] if a not in buffers]
        if missing:
            raise BlobError(f"launch {i} ({r['kernel']}): args reference unknown buffers {missing}")
        glob, local = r["global_size"], r["local_size"]
        if not glob or 0 in glob or (local is not None and (len(local) != len(glob) or 0 in local)):
            raise BlobError(f"launch {i} ({r['kernel']}): expected positive sizes with equal rank, "
                            f"got global {glob} local {local}")
        launches.append(LaunchSpec(r["kernel"], tuple(r["args"]), tuple(glob),
                                   None if local is None else tuple(local)))
    return launches
