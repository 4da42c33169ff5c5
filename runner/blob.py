"""Blob format v3 (docs/blob.md; its definition is runner/format.py): the reader.

`read_blob` reads the file into private memory as it goes (_PrivateCopy) and checks the header,
the manifest (structure, types, every field) and the layout, picks the variant this host runs
(runner/host.py), then checks that variant's SHA-256s, every buffer's bounds, its io slots and
its replay table before returning. Nothing in a blob runs until all of that has passed.

Every byte the chosen variant uses is hashed exactly once: its sections as CHUNK_BYTES chunks
whose digests the manifest lists (of the shared weights, the chunks its buffers touch),
everything else (header, padding, manifest) into the file digest. Other variants' code and
weights are never read. The chunks are spread over threads (hashlib releases the GIL on large
buffers) while the calling thread validates the manifest, then joins in: load costs about one
pass over the variant's bytes divided by the cores.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from runner.errors import BlobError, ConfigError
from runner.files import open_regular
from runner.format import (BARRIER, CHUNK_BYTES, DEVICE_REGIONS, DTYPES, ENTRY_NAME,
                           FILE_SHA256_AT, FLAGS, GRAPH_HEAD, HEADER, IO_REGIONS, LAUNCH, MAGIC,
                           MAX_DIMS, MAX_INT, REGIONS, SECTION_ALIGN, VERSION, Region,
                           entry_name_ok, file_sha256, section_names, section_offsets,
                           unpack_binaries, variant_sections)
from runner.host import choose
from runner.targets import TARGETS, device_of

MAX_HASH_THREADS = 8
_NP_DTYPES = {name: np.dtype(name) for name in DTYPES}


class ImageSpec(NamedTuple):
    """A buffer kernels read as a 2D image (compiler/artifact.py Image): rows of `width`
    texels, `pitch` texels apart; a texel is 4 float elements (RGBA) or 1 uint8 (R8 uint)."""
    width: int
    height: int
    pitch: int
    channels: int = 4


@dataclass(frozen=True)
class BufferSpec:
    id: int
    region: Region
    offset: int  # bytes into the arena / weights section; 0 for io
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    name: str
    image: ImageSpec | None = None  # GPU images
    slot: int | None = None  # io: the io slot (inputs, then outputs); None elsewhere


@dataclass(frozen=True)
class LaunchSpec:
    kernel: str  # the program's name
    args: tuple[int, ...]
    global_size: tuple[int, ...]
    local_size: tuple[int, ...] | None
    barrier: bool  # wait for every earlier launch's memory effects first


@dataclass(frozen=True)
class EntrySpec:
    """One entry point: its io buffers in slot order (state ones included) and its launches,
    a range of the one replay table."""
    name: str
    inputs: tuple[BufferSpec, ...]
    outputs: tuple[BufferSpec, ...]
    launches: range


@dataclass(frozen=True)
class StateSpec:
    """A persistent buffer (docs/blob.md "state"): the input buffers that read it, the output
    buffers whose value replaces it after a run, its initial value (a weights buffer; None:
    zeros). Every one of them has its dtype and shape, but a ring's (`step` > 0: a queue that
    shifts `step` rows in per run) writes and `mirrors`, which are those rows."""
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    reads: tuple[BufferSpec, ...]
    writes: tuple[BufferSpec, ...]
    init: BufferSpec | None
    step: int = 0
    mirrors: tuple[BufferSpec, ...] = ()
    windows: tuple[BufferSpec, ...] = ()  # a ring's: inputs that read the written value


@dataclass(frozen=True)
class Blob:
    target: str  # the header's: what it was compiled for (`cpu` holds several variants)
    producer: str
    manifest: dict  # the validated JSON, for tools
    variant: str  # the target of the variant loaded: the code that runs
    variants: tuple[str, ...]  # every variant the file holds, in file order
    variant_manifest: dict  # the loaded variant's part of the manifest (buffers, programs...)
    buffers: dict[int, BufferSpec]
    inputs: list[BufferSpec]  # in io slot order
    outputs: list[BufferSpec]
    launches: list[LaunchSpec]
    arena_bytes: int
    weights: memoryview  # zero-copy views into the private copy of the file (read_blob)
    programs: memoryview
    graph: memoryview
    program_names: list[str]  # program index -> kernel name
    # input index -> the weights buffer of its default value (read when a run does not feed it)
    defaults: dict[int, BufferSpec] = field(default_factory=dict)
    entries: tuple[EntrySpec, ...] = ()
    state: tuple[StateSpec, ...] = ()
    binaries: "Binaries | None" = None  # the variant's device binaries (section binaries.*)


@dataclass(frozen=True)
class Binaries:
    """Device binaries of a variant's programs, checked (_binaries): `device` says what they
    are bound to (the qcom backend's compiler, chip_id, driver and source_sha256), `programs`
    maps a program to its facts (the backend's) and its bytes."""
    device: dict
    programs: dict[str, tuple[dict, memoryview]]


def read_blob(path, variant: str | None = None) -> Blob:
    """variant: which of the blob's variants (targets) to load; None: the one this host runs
    best, or KEEL_CPU_VARIANT's (runner/host.py:choose)."""
    try:
        copy = _PrivateCopy(path)
    except OSError as e:
        raise BlobError(f"cannot read blob {e.filename or path}: {e.strerror or e}") from None
    try:
        return parse_blob(memoryview(copy.mem).toreadonly(), variant, copy.fill)
    finally:
        os.close(copy.fd)


class _PrivateCopy:
    """The file's bytes in anonymous memory, read as the reader needs them (fill): what is
    hashed is what runs, and a later write, replacement or truncation of the file cannot reach
    it (a shared mapping would run the new file's weights with the old code, or die of SIGBUS).
    The hashing threads read each chunk just before they hash it, so the copy costs little more
    than the hashing's own pass (docs/perf.md, issue 33); other variants' sections are never
    read and their pages never touched."""

    def __init__(self, path):
        self.path, self.fd = path, open_regular(path)
        try:
            self.size = os.fstat(self.fd).st_size
            if self.size == 0:
                raise BlobError(f"{path}: file is empty, expected a keel blob")
            self.mem = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except BaseException:
            os.close(self.fd)
            raise
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.mem.madvise(mmap.MADV_HUGEPAGE)  # weights on huge pages: fewer TLB misses
        self.view = memoryview(self.mem)

    def fill(self, start: int, end: int) -> None:
        pos, end = start, min(end, self.size)
        while pos < end:
            n = os.preadv(self.fd, [self.view[pos:end]], pos)
            if n == 0:
                raise BlobError(f"{self.path}: the file ended at byte {pos} while it was read; "
                                f"it had {self.size} bytes when it was opened")
            pos += n


def parse_blob(data: memoryview, variant: str | None = None, fill=None) -> Blob:
    """fill(start, end): makes data[start:end] hold the file's bytes before they are read (a
    private copy filled on demand, read_blob); None: data is complete."""
    data = memoryview(data).cast("B")
    fill = fill or (lambda start, end: None)
    fill(0, HEADER.size)
    target, producer, m_start, m_end = _header(data, fill)
    manifest = _manifest(data[m_start:m_end], target)
    table = manifest["sections"]
    names = [v["target"] for v in manifest["variants"]]
    _check_layout(table, m_start, section_names(names))
    pos = 0
    for s in table:  # everything outside the sections: the file digest covers it
        fill(pos, s["offset"])
        pos = s["offset"] + s["size"]
    fill(pos, len(data))
    if file_sha256(data, [(s["offset"], s["size"]) for s in table]) != \
            bytes(data[FILE_SHA256_AT:FILE_SHA256_AT + 32]):
        raise BlobError("file SHA-256 does not match the header (corrupt header, padding or "
                        "manifest)")
    name = choose(names) if variant is None else variant
    if name not in names:
        raise ConfigError(f"variant {name!r}: expected one of this blob's variants {names}")
    vm = _variant_manifest(manifest["variants"], names.index(name))
    sections = {s["name"]: s for s in table}
    shared, own, programs, graph, bins = (sections[n] for n in variant_sections(name))
    # its kernels see the shared weights and its own as one region from the shared section on
    weights = data[shared["offset"]:max(shared["offset"] + shared["size"],
                                        own["offset"] + own["size"] if own["size"] else 0)]
    spans = [(0, shared["size"]), (own["offset"] - shared["offset"], own["size"])]
    # the manifest is now known intact: check its meaning while other threads hash the sections
    # the replay table is read while the other sections are hashed: read it first, and once
    g_start, g_end = graph["offset"], graph["offset"] + graph["size"]
    fill(g_start, g_end)
    rest = lambda start, end: None if g_start <= start < g_end else fill(start, end)  # noqa: E731
    with _ChunkCheck(data, [shared, own, programs, graph, bins], rest) as chunks:
        buffers = _buffers(vm["buffers"])
        _check_regions(buffers, vm, spans)
        graph = _view(data, graph)
        launches = _launches(graph, vm["programs"], buffers)
        inputs = _io(vm["inputs"], buffers, Region.INPUT, first_slot=0)
        outputs = _io(vm["outputs"], buffers, Region.OUTPUT, first_slot=len(vm["inputs"]))
        _provenance(vm.get("provenance"), len(launches))
        defaults = _defaults(vm.get("defaults", []), inputs, buffers)
        entries = _entries(vm["entries"], buffers, inputs, outputs, launches)
        state = _state(vm["state"], buffers, entries)
        chunks.finish()
        binaries = _binaries(_view(data, bins), vm["programs"])  # read once hashed
    return Blob(target=target, producer=producer, manifest=manifest, variant=name,
                variants=tuple(names), variant_manifest=vm, buffers=buffers, inputs=inputs,
                outputs=outputs, launches=launches, arena_bytes=vm["arena_bytes"],
                program_names=vm["programs"], weights=weights,
                programs=_view(data, programs), graph=graph, entries=entries, state=state,
                defaults=defaults, binaries=binaries)


def _view(data: memoryview, section: dict) -> memoryview:
    return data[section["offset"]:section["offset"] + section["size"]]


def _header(data: memoryview, fill) -> tuple[str, str, int, int]:
    if len(data) < HEADER.size:
        raise BlobError(f"file is {len(data)} bytes, shorter than the {HEADER.size}-byte header")
    (magic, version, header_size, flags, file_size, m_offset, m_size, m_sha, _, producer,
     target) = HEADER.unpack_from(data)
    if magic == MAGIC and version != VERSION:
        raise BlobError(f"blob format version {version}: this runner reads version {VERSION}; "
                        f"recompile the model with this keel (tools/compile.py)")
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
    fill(m_offset, file_size)
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


def _channels(v):
    if type(v) is not int or v not in (1, 4):
        raise _Invalid("1 (R8 uint) or 4 (RGBA)", v)


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


def _obj(fields, optional=None):
    """Exactly the keys of `fields`, plus any of `optional` (keys a manifest may omit)."""
    optional = optional or {}
    keys, every = fields.keys(), {**fields, **optional}

    def check(v):
        if type(v) is not dict:
            raise _Invalid("an object", v)
        if v.keys() != keys and not keys <= v.keys() <= every.keys():
            extra = f" (optional {sorted(optional)})" if optional else ""
            raise _Invalid(f"keys {sorted(keys)}{extra}", sorted(v))
        k = None
        try:
            for k in v:
                every[k](v[k])
        except _Invalid as e:
            e.path.append(k)
            raise
    return check


_BUFFER = _obj({"id": _int, "region": _one_of(REGIONS), "offset": _int, "slot": _nullable(_int),
                "nbytes": _int,
                "dtype": _one_of(DTYPES), "shape": _list(_int), "name": _str,
                "image": _nullable(_obj({"width": _int, "height": _int, "pitch": _int},
                                        {"channels": _channels}))})
_VARIANT = _obj({
    "target": _one_of(TARGETS),
    "arena_bytes": _int,
    "arena_lower_bound_bytes": _int,
    "buffers": _list(_BUFFER),
    "inputs": _list(_int),
    "outputs": _list(_int),
    "programs": _list(_str),
    # named graphs over one replay table, and the state they share (_entries, _state)
    "entries": _list(_obj({"name": _str, "inputs": _list(_int), "outputs": _list(_int),
                           "launches": _list(_int)})),
    "state": _list(_obj({"name": _str, "reads": _list(_int), "writes": _list(_int),
                         "init": _nullable(_int)},
                        optional={"ring": _obj({"step": _int, "mirrors": _list(_int),
                                                 "windows": _list(_int)})})),
}, optional={
    # which ONNX nodes each launch computes (tools: profile, bisect, blobinfo); checked against
    # the replay table in _provenance
    "provenance": _obj({"nodes": _list(_list(_str)), "launches": _list(_list(_int))}),
    # [input index, weights buffer id]: an input's default value (_defaults)
    "defaults": _list(_list(_int)),
})


def _variant_target(v):
    """What the manifest check reads of a variant: its target. The rest of it is checked
    when it is the one loaded (_variant_manifest): a reader pays for the variant it runs."""
    if type(v) is not dict or "target" not in v:
        raise _Invalid("an object with a target", v)
    try:
        _one_of(TARGETS)(v["target"])
    except _Invalid as e:
        e.path.append("target")
        raise


_MANIFEST = _obj({
    "meta": _dict,
    "sections": _list(_obj({"name": _str, "offset": _int, "size": _int,
                            "chunk_sha256": _list(_sha256)})),
    # one per build of the model (a `cpu` blob: cpu-avx2 and cpu-avx512); the weights they share
    "variants": _list(_variant_target),
})


def _no_duplicates(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise BlobError(f"manifest: duplicate keys in object with keys {[k for k, _ in pairs]}")
    return obj


def _no_constants(name):
    raise BlobError(f"manifest: expected finite numbers, got {name}")


def _manifest(raw: memoryview, target: str) -> dict:
    try:
        manifest = json.loads(bytes(raw).decode(), object_pairs_hook=_no_duplicates,
                              parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:  # ValueError: bad UTF-8, bad JSON, huge integers
        raise BlobError(f"manifest is not valid UTF-8 JSON: {e}") from None
    try:
        _MANIFEST(manifest)
    except _Invalid as e:
        raise e.error() from None
    _variants(manifest["variants"], target)
    return manifest


def _variants(variants: list[dict], target: str) -> None:
    """At least one variant, each of another target, all run by the header target's device."""
    names = [v["target"] for v in variants]
    if not names or len(set(names)) != len(names) or \
            any(device_of(n) != device_of(target) for n in names):
        raise BlobError(f"manifest variants: expected distinct targets run by the "
                        f"{device_of(target)!r} device (the header target is {target!r}), got "
                        f"{names}")


def _variant_manifest(variants: list[dict], i: int) -> dict:
    """Variant i's part of the manifest, checked against the schema (docs/blob.md)."""
    r = variants[i]
    try:
        _VARIANT(r)
    except _Invalid as e:
        e.path += [i, "variants"]
        raise e.error() from None
    if r["arena_lower_bound_bytes"] > r["arena_bytes"]:
        raise BlobError(f"manifest variants[{i}].arena_lower_bound_bytes: expected <= "
                        f"arena_bytes {r['arena_bytes']}, got {r['arena_lower_bound_bytes']}")
    return r


def _check_layout(table: list[dict], m_start: int, names: list[str]) -> None:
    """Sections in file order (`names`: runner/format.py's section_names of the variants) at
    exactly the offsets docs/blob.md gives, the manifest right after the last one: the layout
    follows from the sizes, so there is nothing to overlap or skip."""
    if [s["name"] for s in table] != names:
        raise BlobError(f"section table: expected sections {names} in this order, "
                        f"got {[s['name'] for s in table]}")
    for s, want in zip(table, section_offsets([s["size"] for s in table])):
        if s["offset"] != want:
            raise BlobError(f"section {s['name']}: offset expected {want}, got {s['offset']}")
        chunks = -(-s["size"] // CHUNK_BYTES)
        if len(s["chunk_sha256"]) != chunks:
            raise BlobError(f"section {s['name']}: expected {chunks} chunk digests for "
                            f"{s['size']} bytes, got {len(s['chunk_sha256'])}")
    end = table[-1]["offset"] + table[-1]["size"]
    if m_start != end:
        raise BlobError(f"manifest offset: expected {end} (the end of section {names[-1]}), "
                        f"got {m_start}")


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class _ChunkCheck:
    """Checks every section chunk's SHA-256. Worker threads start hashing at once; finish() lends
    the calling thread to the remaining chunks, joins the workers and raises on a mismatch.
    Leaving the `with` block early stops the workers after their current chunk."""

    def __init__(self, data: memoryview, table: list[dict], fill=None):
        """Checks the chunks of the sections in `table` (entries of the manifest's table), each
        after fill(start, end) of its bytes (parse_blob)."""
        self._jobs = [(s["name"], i, want, _view(data, s)[i * CHUNK_BYTES:][:CHUNK_BYTES])
                      for s in table for i, want in enumerate(s["chunk_sha256"])]
        self._spans = [(s["offset"] + i * CHUNK_BYTES,
                        s["offset"] + min((i + 1) * CHUNK_BYTES, s["size"]))
                       for s in table for i in range(len(s["chunk_sha256"]))]
        self._fill = fill or (lambda start, end: None)
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
                self._fill(*self._spans[i])
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


def _bool(v):
    if type(v) is not bool:
        raise _Invalid("true or false", v)


_PROGRAM_BINARY = _obj({"kernel": _str, "params": _list(_one_of(("buffer", "image"))),
                        "half": _bool, "source": _str, "offsets": _list(_nullable(_int)),
                        "regs": _list(_int), "imms": _list(_list(_int)), "at": _int, "size": _int})
_BINARIES = _obj({"device": _obj({"compiler": _str, "chip_id": _int, "driver": _str,
                                  "source_sha256": _sha256}),
                  "programs": _dict})


def _binaries(section: memoryview, programs: list[str]) -> Binaries | None:
    """The variant's binaries section, checked: None when empty; BlobError naming what is
    wrong otherwise (every byte of it is hashed already, so this is what its writer wrote)."""
    if not len(section):
        return None
    try:
        index, data = unpack_binaries(section)
        _BINARIES(index)
        for name, facts in index["programs"].items():
            try:
                _PROGRAM_BINARY(facts)
            except _Invalid as e:
                e.path += [name, "programs"]
                raise
    except ValueError as e:  # JSON too
        raise BlobError(f"binaries section: {e}") from None
    except _Invalid as e:
        where = "".join(f"[{k}]" if type(k) is int else f".{k}" for k in reversed(e.path))
        raise BlobError(f"binaries section index{where}: expected {e.want}, got "
                        f"{repr(e.got)[:80]}") from None
    out = {}
    for name, facts in index["programs"].items():
        if name not in programs or facts["at"] + facts["size"] > len(data):
            raise BlobError(f"binaries section: program {name!r}: expected one of the variant's "
                            f"programs with bytes [at, at + size) within the section's "
                            f"{len(data)}, got [{facts['at']}, {facts['at'] + facts['size']})")
        out[name] = (facts, data[facts["at"]:facts["at"] + facts["size"]])
    return Binaries(index["device"], out)


def _provenance(prov: dict | None, n_launches: int) -> None:
    if prov is None:
        return
    nodes, per = prov["nodes"], prov["launches"]
    if any(len(n) != 2 for n in nodes):
        raise BlobError(f"manifest provenance.nodes: expected [name, op_type] pairs, got "
                        f"{next(n for n in nodes if len(n) != 2)!r:.80}")
    if len(per) != n_launches or any(i >= len(nodes) for p in per for i in p):
        raise BlobError(f"manifest provenance.launches: expected one list per launch "
                        f"({n_launches}) of indices below {len(nodes)}, got {len(per)} lists")


def launch_nodes(blob: Blob) -> list[list[tuple[str, str]]]:
    """Per launch, the (name, op_type) of the ONNX nodes it computes; empty lists for a blob
    written without provenance."""
    prov = blob.variant_manifest.get("provenance")
    if prov is None:
        return [[] for _ in blob.launches]
    return [[tuple(prov["nodes"][i]) for i in p] for p in prov["launches"]]


def _buffers(records: list[dict]) -> dict[int, BufferSpec]:
    buffers = {}
    for r in records:
        if r["id"] in buffers:
            raise BlobError(f"manifest buffers: id {r['id']} appears twice")
        img = r["image"] and ImageSpec(r["image"]["width"], r["image"]["height"],
                                       r["image"]["pitch"], r["image"].get("channels", 4))
        buffers[r["id"]] = BufferSpec(r["id"], Region(r["region"]), r["offset"], r["nbytes"],
                                      _NP_DTYPES[r["dtype"]], tuple(r["shape"]), r["name"], img,
                                      r["slot"])
    return buffers


def _check_regions(buffers: dict[int, BufferSpec], vm: dict,
                   weights: list[tuple[int, int]]) -> None:
    """weights: (start, size) of the shared weights section and the variant's own, relative to
    the region the kernels see: a weights buffer lies within one of them, so every byte a kernel
    reads has been hashed."""
    for b in buffers.values():
        if b.image is not None:
            _image(b)
        end = b.offset + b.nbytes
        if b.region is Region.ARENA and end > vm["arena_bytes"]:
            raise BlobError(f"buffer {b.id}: [{b.offset}, {end}) exceeds the "
                            f"{vm['arena_bytes']}-byte arena region")
        if b.region is Region.WEIGHTS and \
                not any(s <= b.offset and end <= s + n for s, n in weights):
            raise BlobError(f"buffer {b.id}: [{b.offset}, {end}) lies outside the weights "
                            f"sections {[(s, s + n) for s, n in weights]} of its variant")
        if (b.slot is None) != (b.region not in IO_REGIONS) or b.slot is not None and b.offset:
            raise BlobError(f"buffer {b.id} ({b.region.value}): expected "
                            f"{'a slot and offset 0' if b.region in IO_REGIONS else 'no slot'}, "
                            f"got slot {b.slot} offset {b.offset}")
        if b.region in IO_REGIONS:
            want = math.prod(b.shape) * b.dtype.itemsize  # exact: int64 could wrap
            if b.nbytes != want:
                raise BlobError(f"buffer {b.id} ({b.name!r}): nbytes expected {want} for "
                                f"{b.dtype} {b.shape}, got {b.nbytes}")


def _io(ids: list[int], buffers: dict[int, BufferSpec], region: Region,
        first_slot: int) -> list[BufferSpec]:
    """io slots number inputs first, then outputs: output j is slot len(inputs) + j."""
    found = [buffers.get(i) for i in ids]
    for slot, (i, b) in enumerate(zip(ids, found), start=first_slot):
        if b is None or b.region != region or b.slot != slot:
            got = "no such buffer" if b is None else f"region {b.region.value!r} slot {b.slot}"
            raise BlobError(f"manifest {region}s[{slot - first_slot}]: buffer {i} expected region "
                            f"{region.value!r} slot {slot}, got {got}")
    declared = sorted(b.id for b in buffers.values() if b.region == region)
    if declared != sorted(ids):
        raise BlobError(f"manifest {region}s: expected every {region} buffer {declared}, got {ids}")
    names = [b.name for b in found]
    if "" in names:  # unique within each entry (_entries)
        raise BlobError(f"manifest {region}s: names must be non-empty, got {names}")
    return found


def _defaults(pairs: list[list[int]], inputs: list[BufferSpec],
              buffers: dict[int, BufferSpec]) -> dict[int, BufferSpec]:
    out = {}
    for k, pair in enumerate(pairs):
        i, bid = pair if len(pair) == 2 else (None, None)
        b, spec = buffers.get(bid), inputs[i] if i is not None and i < len(inputs) else None
        if spec is None or b is None or b.region is not Region.WEIGHTS or b.image is not None or \
                (b.dtype, b.shape) != (spec.dtype, spec.shape) or i in out:
            raise BlobError(f"manifest defaults[{k}]: expected [input index, weights buffer of "
                            f"that input's dtype and shape], once per input, got {pair}")
        out[i] = b
    return out


def _image(b: BufferSpec) -> None:
    """An image is RGBA rows of `width` texels, `pitch` apart, over the whole tensor; or, R8,
    a uint8 graph input's first `height` rows of `width` bytes (the caller's own layout)."""
    width, height, pitch, channels = b.image
    if channels == 1:
        if b.dtype != np.dtype("uint8") or b.region != "input" or not 1 <= width == pitch or \
                height < 1 or width * height > math.prod(b.shape):
            raise BlobError(f"buffer {b.id} ({b.name!r}): R8 image (width {width}, height "
                            f"{height}, pitch {pitch}) expected a uint8 input holding height "
                            f"rows of pitch == width bytes, got {b.region} {b.dtype} {b.shape}")
        return
    texel = 4 * b.dtype.itemsize
    if b.dtype not in (np.dtype("float16"), np.dtype("float32")) or \
            b.region not in DEVICE_REGIONS or not 1 <= width <= pitch or \
            4 * width * height != math.prod(b.shape) or b.nbytes != height * pitch * texel:
        raise BlobError(f"buffer {b.id}: image (width {width}, height {height}, pitch {pitch}) "
                        f"expected float16/float32 arena or weights rows covering {b.dtype} "
                        f"{b.shape} in nbytes = height * pitch * {texel}, got {b.region} "
                        f"nbytes {b.nbytes}")


def _launches(graph: memoryview, programs: list[str],
              buffers: dict[int, BufferSpec]) -> list[LaunchSpec]:
    """The graph section's replay table (runner/format.py), every field checked."""
    if len(set(programs)) != len(programs) or not all(p.isascii() and p.isidentifier()
                                                      for p in programs):
        raise BlobError(f"manifest programs: expected unique C identifiers, got {programs[:8]}")
    if len(graph) < GRAPH_HEAD.size:
        raise BlobError(f"graph section: {len(graph)} bytes, shorter than its "
                        f"{GRAPH_HEAD.size}-byte head")
    n, n_args = GRAPH_HEAD.unpack_from(graph)
    want = GRAPH_HEAD.size + n * LAUNCH.itemsize + 4 * n_args
    if len(graph) != want:
        raise BlobError(f"graph section: {n} launches and {n_args} args need {want} bytes, "
                        f"got {len(graph)}")
    table = np.frombuffer(graph, LAUNCH, n, GRAPH_HEAD.size)
    args = np.frombuffer(graph, "<u4", n_args, GRAPH_HEAD.size + n * LAUNCH.itemsize).tolist()
    launches, at = [], 0
    for i, rec in enumerate(table.tolist()):
        launches.append(_parse_launch(i, rec, args, at, programs, buffers))
        at += rec[-1]
    if at != n_args:
        raise BlobError(f"graph section: launches use {at} args, the head says {n_args}")
    return launches


def _parse_launch(i: int, rec: tuple, args: list[int], at: int, programs: list[str],
            buffers: dict[int, BufferSpec]) -> LaunchSpec:
    """Launch i's args must start where launch i - 1's end (`at`): one byte, one meaning."""
    program, flags, dims, glob, local, first, count = rec
    glob, local = tuple(glob.tolist()), tuple(local.tolist())
    what = f"graph launch {i}"
    if program >= len(programs):
        raise BlobError(f"{what}: program {program} expected < {len(programs)} (manifest programs)")
    what += f" ({programs[program]})"
    if flags & ~FLAGS or not 1 <= dims <= MAX_DIMS:
        raise BlobError(f"{what}: expected flags within {FLAGS:#x} and 1..{MAX_DIMS} dims, "
                        f"got flags {flags:#x} dims {dims}")
    pad = (1,) * (MAX_DIMS - dims)
    no_local = not any(local)
    if 0 in glob or glob[dims:] != pad or not (no_local or 0 not in local and local[dims:] == pad):
        raise BlobError(f"{what}: expected positive sizes, 1 past {dims} dims, local all zero or "
                        f"all positive, got global {list(glob)} local {list(local)}")
    if first != at or count == 0 or first + count > len(args):
        raise BlobError(f"{what}: args [{first}, {first + count}) expected to start at {at}, be "
                        f"non-empty and end within the {len(args)} args")
    a = tuple(args[first:first + count])
    missing = [b for b in a if b not in buffers]
    if missing:
        raise BlobError(f"{what}: args reference unknown buffers {missing}")
    return LaunchSpec(programs[program], a, tuple(glob[:dims]),
                      None if no_local else tuple(local[:dims]), bool(flags & BARRIER))


def _entries(records: list[dict], buffers: dict[int, BufferSpec], inputs: list[BufferSpec],
             outputs: list[BufferSpec], launches: list[LaunchSpec]) -> tuple[EntrySpec, ...]:
    """At least one entry, named uniquely (format.ENTRY_NAME); their launch ranges back to back over
    the whole replay table; every io buffer in exactly one entry, in slot order, and read or
    written only by that entry's launches."""
    names = [e["name"] for e in records]
    if not names or len(set(names)) != len(names) or \
            not all(entry_name_ok(n) for n in names):
        raise BlobError(f"manifest entries: expected at least one, with unique names of "
                        f"{ENTRY_NAME.pattern!r}, got {names}")
    entries, at, owner = [], 0, {}
    for e in records:
        what = f"manifest entry {e['name']!r}"
        if len(e["launches"]) != 2 or e["launches"][0] != at:
            raise BlobError(f"{what}: launches expected [first, count] with first {at} (where "
                            f"the entry before it ends), got {e['launches']}")
        first, count = e["launches"]
        if first + count > len(launches):
            raise BlobError(f"{what}: launches [{first}, {first + count}) past the replay "
                            f"table's {len(launches)}")
        io = []
        for key, declared in (("inputs", inputs), ("outputs", outputs)):
            ids, slots = e[key], {b.id: b.slot for b in declared}
            if not all(i in slots for i in ids) or \
                    [slots[i] for i in ids] != sorted({slots[i] for i in ids}):
                raise BlobError(f"{what}: {key} expected {key[:-1]} buffer ids in slot order, "
                                f"got {ids}")
            for i in ids:
                if owner.setdefault(i, e["name"]) != e["name"]:
                    raise BlobError(f"{what}: {key[:-1]} buffer {i} is in entry "
                                    f"{owner[i]!r} too")
            io.append(tuple(buffers[i] for i in ids))
            names = [buffers[i].name for i in ids]
            if len(set(names)) != len(names):
                raise BlobError(f"{what}: {key} names must be non-empty and unique, got {names}")
        entries.append(EntrySpec(e["name"], *io, range(first, first + count)))
        at = first + count
    unowned = [b.id for b in (*inputs, *outputs) if b.id not in owner]
    if at != len(launches) or unowned:
        raise BlobError(f"manifest entries: expected to cover the {len(launches)} launches and "
                        f"every io buffer, got launches up to {at}, io buffers {unowned} in none")
    for e in entries:
        for i in e.launches:
            foreign = [b for b in launches[i].args if b in owner and owner[b] != e.name]
            if foreign:
                raise BlobError(f"graph launch {i} ({launches[i].kernel}) of entry {e.name!r} "
                                f"uses io buffers {foreign} of another entry")
    return tuple(entries)


def _state(records: list[dict], buffers: dict[int, BufferSpec],
           entries: tuple[EntrySpec, ...]) -> tuple[StateSpec, ...]:
    """Unique names; reads are input buffers, writes (and a ring's mirrors) output buffers, each
    of at most one state and at most one read and one write per state per entry; one dtype and
    shape throughout, the initial value's included (a plain weights buffer); a ring's writes
    and mirrors are its step rows (_ring)."""
    names = [r["name"] for r in records]
    if "" in names or len(set(names)) != len(names):
        raise BlobError(f"manifest state: expected unique non-empty names, got {names}")
    entry_of = {b.id: e.name for e in entries for b in (*e.inputs, *e.outputs)}
    used, states = set(), []
    for r in records:
        what = f"manifest state {r['name']!r}"
        ring = r.get("ring")
        io = []
        for key, region, ids in (("reads", Region.INPUT, r["reads"]),
                                 ("writes", Region.OUTPUT, r["writes"]),
                                 ("ring mirrors", Region.OUTPUT, ring["mirrors"] if ring else []),
                                 ("ring windows", Region.INPUT, ring["windows"] if ring else [])):
            got = [buffers.get(i) for i in ids]
            if any(b is None or b.region != region or b.id in used for b in got):
                raise BlobError(f"{what}: {key} expected {region} buffers of no other state, "
                                f"got {ids}")
            per_entry = [entry_of[b.id] for b in got]
            if len(set(per_entry)) != len(per_entry):
                raise BlobError(f"{what}: {key} expected at most one buffer per entry, got "
                                f"entries {per_entry}")
            used.update(ids)
            io.append(tuple(got))
        init = None if r["init"] is None else buffers.get(r["init"])
        every = [*io[0], *([init] if r["init"] is not None else []), *io[3]]
        every += [] if ring else io[1]
        if not io[0] and not io[1] or any(b is None for b in every) or \
                len({(b.dtype, b.shape) for b in every}) != 1 or \
                init is not None and (init.region is not Region.WEIGHTS or init.image is not None or
                                      init.nbytes != every[0].nbytes):
            raise BlobError(f"{what}: expected reads or writes, all of one dtype and shape, and "
                            f"init null or a plain weights buffer of that dtype and shape, got "
                            f"reads {r['reads']} writes {r['writes']} init {r['init']}")
        step = _ring(what, ring, every[0], *io[1:], entry_of) if ring else 0
        states.append(StateSpec(r["name"], every[0].dtype, every[0].shape, *io[:2], init, step,
                                *io[2:]))
    return tuple(states)


def _ring(what: str, ring: dict, state: BufferSpec, writes: tuple, mirrors: tuple,
          windows: tuple, entry_of: dict) -> int:
    """A ring's step k: 0 < k < M rows with k | M (M: the state's rows, so it needs a read);
    each write and its mirror are k of those rows, in the same entry; a window (M rows, checked
    by the caller) only in an entry that writes."""
    k, m = ring["step"], state.shape[0] if state.region == "input" and state.shape else 0
    rows = (k, *state.shape[1:])
    writers = [entry_of[b.id] for b in writes]
    if not (0 < k < m and m % k == 0) or len(mirrors) != len(writes) or any(
            b.dtype != state.dtype or b.shape != rows for b in (*writes, *mirrors)) or \
            [entry_of[b.id] for b in mirrors] != writers or \
            any(entry_of[b.id] not in writers for b in windows):
        raise BlobError(f"{what}: ring expected a read of M rows, a step k with 0 < k < M and "
                        f"k | M, per write a mirror in its entry, both {state.dtype} of shape "
                        f"{list(rows)}, and windows only in writing entries; got step {k}, "
                        f"M {m}, writes {[b.id for b in writes]}, mirrors {ring['mirrors']}, "
                        f"windows {ring['windows']}")
    return k
