"""Blob format v1 (docs/blob.md): the layout constants, and the reader that validates everything.

`read_blob` maps the file and checks the header, the manifest (structure, types, every field), the
section table, every SHA-256, every buffer's bounds, the io slots and the launch table before
returning. Nothing in a blob runs until all of that has passed. The compiler's writer imports the
layout from here, so reader and writer cannot drift apart.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from runner.device import TARGETS
from runner.errors import BlobError

MAGIC = b"KEELBLOB"
VERSION = 1
# magic, version, header_size, flags, file_size, manifest_offset, manifest_size,
# manifest_sha256, file_sha256, producer, target  (little-endian, 176 bytes)
HEADER = struct.Struct("<8sIIQQQQ32s32s32s32s")
FILE_SHA256_AT = 80  # the file hash covers the whole file with these 32 bytes read as zeros
SECTION_ALIGN = 4096
SECTIONS = ("weights", "programs", "graph")
REGIONS = ("arena", "weights", "input", "output")
DTYPES = ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64")


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


def file_sha256(data) -> bytes:
    h = hashlib.sha256(data[:FILE_SHA256_AT])
    h.update(bytes(32))
    h.update(data[FILE_SHA256_AT + 32:])
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
    # hashlib drops the GIL on large buffers: hash the whole file while the sections are hashed
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(file_sha256, data)
        sections = _sections(data, manifest["sections"], m_start, m_end)
        if whole.result() != bytes(data[FILE_SHA256_AT:FILE_SHA256_AT + 32]):
            raise BlobError("file SHA-256 does not match the header (corrupt header or padding)")
    buffers = _buffers(manifest["buffers"])
    _check_regions(buffers, manifest, len(sections["weights"]))
    launches = _launches(manifest["launches"], buffers)
    if bytes(sections["graph"]) != graph_section(manifest["launches"]):
        raise BlobError("graph section does not match the manifest's launch table")
    return Blob(target=target, producer=producer, manifest=manifest, buffers=buffers,
                inputs=_io(manifest["inputs"], buffers, "input", first_slot=0),
                outputs=_io(manifest["outputs"], buffers, "output",
                            first_slot=len(manifest["inputs"])),
                launches=launches, arena_bytes=manifest["arena_bytes"], **sections)


def _header(data: memoryview) -> tuple[str, str, int, int]:
    if len(data) < HEADER.size:
        raise BlobError(f"file is {len(data)} bytes, shorter than the {HEADER.size}-byte header")
    (magic, version, header_size, flags, file_size, m_offset, m_size, m_sha, _, producer,
     target) = HEADER.unpack_from(data)
    expect = [("magic", MAGIC, magic), ("format version", VERSION, version),
              ("header size", HEADER.size, header_size), ("flags", 0, flags),
              ("file size", len(data), file_size)]
    for what, want, got in expect:
        if want != got:
            raise BlobError(f"header {what}: expected {want!r}, got {got!r}")
    target, producer = _cstr(target, "target"), _cstr(producer, "producer")
    if target not in TARGETS:
        raise BlobError(f"header target: expected one of {sorted(TARGETS)}, got {target!r}")
    if m_offset < HEADER.size or m_offset + m_size > file_size:
        raise BlobError(f"manifest [{m_offset}, {m_offset + m_size}) is outside the file body "
                        f"[{HEADER.size}, {file_size})")
    if hashlib.sha256(data[m_offset:m_offset + m_size]).digest() != m_sha:
        raise BlobError("manifest SHA-256 does not match the header")
    return target, producer, m_offset, m_offset + m_size


def _cstr(field: bytes, what: str) -> str:
    text, _, pad = field.partition(b"\0")
    if pad.strip(b"\0") or not all(0x20 <= c < 0x7F for c in text):
        raise BlobError(f"header {what}: expected NUL-padded printable ASCII, got {field!r}")
    return text.decode()


# Manifest schema: each checker takes (value, where) and returns the value or raises BlobError.

def _fail(where: str, want: str, got) -> BlobError:
    text = repr(got)
    return BlobError(f"manifest {where}: expected {want}, got {text[:80]}")


def _int(v, where):
    if type(v) is not int or v < 0:
        raise _fail(where, "a non-negative integer", v)
    return v


def _str(v, where):
    if type(v) is not str:
        raise _fail(where, "a string", v)
    return v


def _sha256(v, where):
    if type(v) is not str or len(v) != 64 or v.strip("0123456789abcdef"):
        raise _fail(where, "64 lowercase hex digits", v)
    return v


def _dict(v, where):
    if type(v) is not dict:
        raise _fail(where, "an object", v)
    return v


def _one_of(choices):
    def check(v, where):
        if v not in choices:
            raise _fail(where, f"one of {list(choices)}", v)
        return v
    return check


def _list(item):
    def check(v, where):
        if type(v) is not list:
            raise _fail(where, "a list", v)
        return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]
    return check


def _nullable(check):
    return lambda v, where: None if v is None else check(v, where)


def _obj(fields):
    def check(v, where):
        _dict(v, where)
        if v.keys() != fields.keys():
            raise _fail(where, f"keys {sorted(fields)}", sorted(v))
        return {k: fields[k](v[k], f"{where}.{k}".lstrip(".")) for k in fields}
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
                            "sha256": _sha256})),
    "meta": _dict,
})


def _manifest(raw: memoryview) -> dict:
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise BlobError(f"manifest: duplicate keys in object with keys {keys}")
        return dict(pairs)

    def no_constants(name):
        raise BlobError(f"manifest: expected finite numbers, got {name}")
    try:
        manifest = json.loads(bytes(raw).decode(), object_pairs_hook=no_duplicates,
                              parse_constant=no_constants)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BlobError(f"manifest is not valid UTF-8 JSON: {e}") from None
    manifest = _MANIFEST(manifest, "")
    if manifest["arena_lower_bound_bytes"] > manifest["arena_bytes"]:
        raise BlobError(f"manifest arena_lower_bound_bytes: expected <= arena_bytes "
                        f"{manifest['arena_bytes']}, got {manifest['arena_lower_bound_bytes']}")
    return manifest


def _sections(data: memoryview, table: list[dict], m_start: int, m_end: int) -> dict:
    names = [s["name"] for s in table]
    if sorted(names) != sorted(SECTIONS):
        raise BlobError(f"section table: expected sections {list(SECTIONS)}, got {names}")
    busy = [(0, HEADER.size, "header"), (m_start, m_end, "manifest")]
    for s in table:
        start, end = s["offset"], s["offset"] + s["size"]
        if start % SECTION_ALIGN:
            raise BlobError(f"section {s['name']}: offset {start} is not {SECTION_ALIGN}-aligned")
        if end > len(data):
            raise BlobError(f"section {s['name']}: [{start}, {end}) runs past the end of the "
                            f"{len(data)}-byte file")
        busy.append((start, end, f"section {s['name']}"))
    busy.sort()
    for (_, a_end, a), (b_start, _, b) in zip(busy, busy[1:]):
        if b_start < a_end:
            raise BlobError(f"{b} starts at {b_start}, inside {a} which ends at {a_end}")
    views = {}
    for s in table:
        view = data[s["offset"]:s["offset"] + s["size"]]
        if hashlib.sha256(view).hexdigest() != s["sha256"]:
            raise BlobError(f"section {s['name']}: SHA-256 mismatch, expected {s['sha256']}, "
                            f"got {hashlib.sha256(view).hexdigest()}")
        views[s["name"]] = view
    return views


def _buffers(records: list[dict]) -> dict[int, BufferSpec]:
    buffers = {}
    for r in records:
        if r["id"] in buffers:
            raise BlobError(f"manifest buffers: id {r['id']} appears twice")
        buffers[r["id"]] = BufferSpec(r["id"], r["region"], r["offset"], r["nbytes"],
                                      np.dtype(r["dtype"]), tuple(r["shape"]), r["name"])
    return buffers


def _check_regions(buffers: dict[int, BufferSpec], manifest: dict, weights_bytes: int) -> None:
    limits = {"arena": manifest["arena_bytes"], "weights": weights_bytes}
    for b in buffers.values():
        if b.region in limits and b.offset + b.nbytes > limits[b.region]:
            raise BlobError(f"buffer {b.id}: [{b.offset}, {b.offset + b.nbytes}) exceeds the "
                            f"{limits[b.region]}-byte {b.region} region")
        if b.region in ("input", "output"):
            want = int(np.prod(b.shape, dtype=np.int64)) * b.dtype.itemsize
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
