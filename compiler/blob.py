"""Artifact -> one .blob file (format v4, docs/blob.md). Same artifact, same bytes.

The format's definition (constants, the replay table's record, the layout and digests) is
runner/format.py, which the reader uses too, so the writer cannot disagree with the reader.
"""
from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import threading

from compiler.artifact import Artifact, Buffer, Entry
from compiler.link.weights import Spilled, Streamed, weight_starts

from runner.files import check_output
from runner.format import (CHUNK_BYTES, DEFAULT_ENTRY, FILE_SHA256_AT, HEADER, MAGIC, VERSION,
                           canonical_json, chunk_sha256, file_sha256, pack_graph, section_names,
                           section_offsets)

PRODUCER = "keel-compiler 0.1"
SPILL_BYTES = 1 << 20  # smaller packed weights stay in memory: one map each is not worth it


def write_blob(artifact: Artifact, path) -> None:
    with BlobWriter(path) as out:
        out.finish(artifact)


class BlobWriter:
    """A blob written in two steps: the weights region as soon as it is final (`weights`, on
    a thread: compile_model's writer, while the kernels compile), then the rest (`finish`).
    The weights come first in the file, so their place does not wait for the programs; given
    `region` (compile_model's weights_region) they are laid out in the file itself, streamed
    to it as they are copied in. Written to a temporary file and renamed: a reader never sees
    half a blob, and an error or an interrupt leaves nothing behind."""

    def __init__(self, path, inputs=()):
        check_output(path, inputs)
        self.path, self.tmp = path, f"{path}.tmp{os.getpid()}"
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.spill_fd: int | None = None  # scratch file of the packed weights (`spill`)
        self.spill_end = 0
        self.early: tuple | None = None  # (region, chunk digests of its sections)
        self.thread: threading.Thread | None = None
        self.failed: OSError | None = None  # what writing the weights on the thread raised

    def region(self, sizes: tuple[int, ...]):
        """A weights region of sections `sizes`: the blob file's own bytes where the weights go,
        mapped shared (`Streamed`)."""
        _, end = weight_starts(sizes)
        if not end:
            return bytearray()
        at = section_offsets(list(sizes))[0]
        os.ftruncate(self.fd, at + end)
        return Streamed(self.fd, end, offset=at)

    def spill(self, data) -> memoryview:
        """`data`'s bytes out of memory: written to a scratch file beside the blob (unlinked as
        soon as it is made: nothing is left behind) and mapped back read-only, so they cost
        memory only while read (share_weights copies them into the region). Small ones stay."""
        view = memoryview(data).cast("B")
        if len(view) < SPILL_BYTES:
            return view
        if self.spill_fd is None:
            scratch = f"{self.path}.spill{os.getpid()}"
            self.spill_fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.unlink(scratch)
        at = self.spill_end
        _pwrite_all(self.spill_fd, view, at)
        self.spill_end = -(-(at + len(view)) // mmap.ALLOCATIONGRANULARITY) * \
            mmap.ALLOCATIONGRANULARITY
        return memoryview(Spilled(self.spill_fd, len(view), offset=at, access=mmap.ACCESS_READ))

    def weights(self, weights: tuple[bytes, tuple[int, ...]]) -> None:
        self.thread = threading.Thread(target=self._weights, args=weights, daemon=True)
        self.thread.start()

    def _weights(self, region: bytes, sizes: tuple[int, ...]) -> None:
        try:
            starts, _ = weight_starts(sizes)
            digests = [_streamed_digests(region, s, n) for s, n in zip(starts, sizes)]
            if not isinstance(region, Streamed):  # else it is in the file already
                _pwrite_all(self.fd, region, section_offsets(list(sizes))[0])
            self.early = (region, digests)
        except OSError as e:  # ENOSPC: raised by finish() in the caller's thread, once
            self.failed = e

    def finish(self, artifact: Artifact) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.failed is not None:
            raise self.failed
        region, digests = self.early if self.early and self.early[0] is artifact.weights \
            else (None, None)
        pos = 0
        for piece in blob_pieces(artifact, digests):
            if region is None or piece.obj is not region:  # the region's pieces are written
                _pwrite_all(self.fd, piece, pos)
            pos += len(piece)
        os.close(self.fd)
        self.fd = None
        self._close_spill()
        os.replace(self.tmp, self.path)

    def _close_spill(self) -> None:
        if self.spill_fd is not None:  # its maps, if any are left, keep the file open
            os.close(self.spill_fd)
            self.spill_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.thread is not None:
            self.thread.join()
        self._close_spill()
        if self.fd is not None:  # not finished: an error
            os.close(self.fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)


def _streamed_digests(region, start: int, size: int) -> list[str]:
    """chunk_sha256 of a section of `region`; a Streamed region's pages are let go after each
    chunk is hashed, so hashing does not map the whole region back in."""
    view = memoryview(region)
    if not isinstance(region, Streamed):
        return chunk_sha256(view[start:start + size])
    digests = []
    for at in range(start, start + size, CHUNK_BYTES):
        n = min(CHUNK_BYTES, start + size - at)
        digests += chunk_sha256(view[at:at + n])
        region.release(at, n)
    return digests


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def blob_bytes(artifact: Artifact) -> bytes:
    return b"".join(blob_pieces(artifact))


def blob_pieces(artifact: Artifact, weight_digests: list | None = None) -> list[memoryview]:
    """The blob's bytes in file order, as pieces (`_layout`; the weights sections are views of
    the artifact's region). `weight_digests`: their chunk digests, if computed already. The
    artifact and the variants attached to it (artifact.variants), which share its
    weights region: one manifest part, weights, programs and graph section per variant, and the
    weights they all read once."""
    variants = [artifact, *artifact.variants]
    names = [a.variant or a.target for a in variants]
    sizes = artifact.weight_sections or (len(artifact.weights),) + (0,) * len(names)
    starts, end = weight_starts(sizes)
    if len(set(names)) != len(names) or len(sizes) != 1 + len(names) or \
            len(artifact.weights) != end or \
            any(a.weights is not artifact.weights and a.weights != artifact.weights
                for a in variants):
        raise ValueError(f"blob variants {names}: expected distinct targets sharing one weights "
                         f"region of sections {sizes}")
    region = memoryview(artifact.weights)
    payloads = {name: region[s:s + n] for name, s, n in zip(section_names(names), starts, sizes)}
    parts = []
    for a, name in zip(variants, names):
        part, payloads[f"programs.{name}"], payloads[f"graph.{name}"] = _variant(a, name)
        payloads[f"binaries.{name}"] = a.binaries
        parts.append(part)
    known = dict(zip(section_names(names), weight_digests or []))
    return _layout(artifact.target, {"meta": artifact.meta, "variants": parts}, payloads, known)


def _variant(a: Artifact, name: str) -> tuple[dict, bytes, bytes]:
    """A variant's part of the manifest, its programs and its graph section (its binaries:
    blob_pieces)."""
    programs = list(dict.fromkeys(l.kernel for l in a.launches))  # first-use order
    index = {p: i for i, p in enumerate(programs)}
    graph = pack_graph([(index[l.kernel], l.barrier, list(l.args), l.global_size, l.local_size)
                        for l in a.launches])
    part = {
        "target": name,
        "arena_bytes": a.arena_bytes,
        "arena_lower_bound_bytes": a.arena_lower_bound_bytes,
        "buffers": [_buffer_record(b) for b in a.buffers],
        "inputs": [b.id for b in a.inputs],
        "outputs": [b.id for b in a.outputs],
        "programs": programs,
    }
    part["entries"] = [{"name": e.name, "inputs": list(e.inputs), "outputs": list(e.outputs),
                          "launches": [e.first, e.count]} for e in _entries(a)]
    part["state"] = [{"name": x.name, "reads": list(x.reads), "writes": list(x.writes),
                      "init": x.init, **({"ring": {"step": x.step, "mirrors": list(x.mirrors),
                                                   "windows": list(x.windows)}}
                                         if x.step else {})} for x in a.state]
    if a.provenance is not None:
        part["provenance"] = a.provenance
    if a.defaults:
        part["defaults"] = a.defaults
    return part, bytes(a.programs), graph


def _entries(a: Artifact) -> list[Entry]:
    """An artifact built without entries (by hand, in tests) is one entry: all of it."""
    return a.entries or [Entry(DEFAULT_ENTRY, tuple(b.id for b in a.inputs),
                               tuple(b.id for b in a.outputs), 0, len(a.launches))]


def assemble(target: str, manifest: dict, payloads: dict[str, bytes]) -> bytes:
    """The blob of these sections and this manifest. Takes the manifest as data so tests can
    build blobs that are well-formed but wrong."""
    return b"".join(_layout(target, manifest, payloads))


def _layout(target: str, manifest: dict, payloads: dict, digests: dict | None = None) -> list:
    """Lay out the sections (in the order the manifest's variants give), add their table to
    `manifest`, write the header and the hashes; -> the file's pieces in order: header,
    (padding, section)..., manifest. A 144 MiB blob is written from its pieces, never copied
    into one buffer."""
    names = section_names([v.get("target") for v in manifest.get("variants", [])])
    payloads = {**{n: b"" for n in names if n.startswith("binaries.")}, **payloads}  # none
    sizes = [len(payloads[name]) for name in names]
    offsets = section_offsets(sizes)
    digests = digests or {}
    table = [{"name": name, "offset": offset, "size": size,
              "chunk_sha256": digests.get(name) or chunk_sha256(payloads[name])}
             for name, offset, size in zip(names, offsets, sizes)]
    manifest_offset = offsets[-1] + sizes[-1]
    manifest_json = canonical_json({**manifest, "sections": table})
    pieces, pos = [bytearray(HEADER.size)], HEADER.size
    for s in table:
        pieces += [bytes(s["offset"] - pos), payloads[s["name"]]]
        pos = s["offset"] + s["size"]
    pieces.append(manifest_json)
    total = manifest_offset + len(manifest_json)
    HEADER.pack_into(pieces[0], 0, MAGIC, VERSION, HEADER.size, 0, total, manifest_offset,
                     len(manifest_json), hashlib.sha256(manifest_json).digest(), bytes(32),
                     _cstr(PRODUCER, "producer"), _cstr(target, "target"))
    # every byte outside the sections: the header, the padding and the manifest
    outside = b"".join(pieces[0:1] + pieces[1:-1:2] + pieces[-1:])
    pieces[0][FILE_SHA256_AT:FILE_SHA256_AT + 32] = file_sha256(outside, [])
    return [memoryview(p) for p in pieces]


def _buffer_record(b: Buffer) -> dict:
    image = None if b.image is None else \
        {"width": b.image.width, "height": b.image.height, "pitch": b.image.pitch}
    if b.image is not None and b.image.channels != 4:  # RGBA blobs stay as they were
        image["channels"] = b.image.channels
    return {"id": b.id, "region": b.region, "offset": b.offset, "slot": b.slot,
            "nbytes": b.nbytes, "dtype": b.dtype, "shape": list(b.shape), "name": b.name,
            "image": image}


def _cstr(text: str, what: str) -> bytes:
    if len(text) > 32 or not (text.isascii() and text.isprintable()):
        raise ValueError(f"blob {what}: expected printable ASCII of at most 32 bytes, got {text!r}")
    return text.encode().ljust(32, b"\0")
