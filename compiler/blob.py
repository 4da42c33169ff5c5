"""Artifact -> one .blob file (format v3, docs/blob.md). Same artifact, same bytes.

The format's definition (constants, the replay table's record, the layout and digests) is
runner/format.py, which the reader uses too, so the writer cannot disagree with the reader.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat

from compiler.artifact import Artifact, Buffer
from runner.format import (FILE_SHA256_AT, HEADER, MAGIC, VERSION, WEIGHTS, canonical_json,
                           chunk_sha256, file_sha256, pack_graph, section_names, section_offsets)

PRODUCER = "keel-compiler 0.1"


def write_blob(artifact: Artifact, path) -> None:
    data = blob_bytes(artifact)
    check_output(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # a reader never sees half a blob
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def check_output(path) -> None:
    """Raise FileExistsError unless `path` is a regular file or does not exist: replacing it
    would turn a device node, a FIFO or a symlink's name into a regular file (as root, even
    /dev/null), and a directory cannot be replaced."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
        raise FileExistsError(errno.EEXIST, f"exists and is {kind}; not replacing it", str(path))


_KINDS = [(stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket")]


def blob_bytes(artifact: Artifact) -> bytes:
    """The artifact and the variants attached to it (artifact.variants), which share its
    weights region: one record, programs and graph section per variant, the weights once."""
    variants = [artifact, *artifact.variants]
    names = [a.variant or a.target for a in variants]
    if len(set(names)) != len(names) or any(a.weights is not artifact.weights and
                                            a.weights != artifact.weights for a in variants):
        raise ValueError(f"blob variants {names}: expected distinct targets sharing one weights "
                         f"region")
    payloads = {WEIGHTS: bytes(artifact.weights)}
    records = []
    for a, name in zip(variants, names):
        record, payloads[f"programs.{name}"], payloads[f"graph.{name}"] = _variant(a, name)
        records.append(record)
    return assemble(artifact.target, {"meta": artifact.meta, "variants": records}, payloads)


def _variant(a: Artifact, name: str) -> tuple[dict, bytes, bytes]:
    """A variant's manifest record, programs and graph section."""
    programs = list(dict.fromkeys(l.kernel for l in a.launches))  # first-use order
    index = {p: i for i, p in enumerate(programs)}
    graph = pack_graph([(index[l.kernel], l.barrier, list(l.args), l.global_size, l.local_size)
                        for l in a.launches])
    record = {
        "target": name,
        "arena_bytes": a.arena_bytes,
        "arena_lower_bound_bytes": a.arena_lower_bound_bytes,
        "buffers": [_buffer_record(b) for b in a.buffers],
        "inputs": [b.id for b in a.inputs],
        "outputs": [b.id for b in a.outputs],
        "programs": programs,
    }
    if a.provenance is not None:
        record["provenance"] = a.provenance
    return record, bytes(a.programs), graph


def assemble(target: str, manifest: dict, payloads: dict[str, bytes]) -> bytes:
    """Lay out the sections (in the order the manifest's variants give), add their table to
    `manifest`, write the header and the hashes. Takes the manifest as data so tests can build
    blobs that are well-formed but wrong."""
    names = section_names([v.get("target") for v in manifest.get("variants", [])])
    sizes = [len(payloads[name]) for name in names]
    offsets = section_offsets(sizes)
    table = [{"name": name, "offset": offset, "size": size,
              "chunk_sha256": chunk_sha256(payloads[name])}
             for name, offset, size in zip(names, offsets, sizes)]
    manifest_offset = offsets[-1] + sizes[-1]
    manifest_json = canonical_json({**manifest, "sections": table})
    out = bytearray(manifest_offset + len(manifest_json))
    for s in table:
        out[s["offset"]:s["offset"] + s["size"]] = payloads[s["name"]]
    out[manifest_offset:] = manifest_json
    HEADER.pack_into(out, 0, MAGIC, VERSION, HEADER.size, 0, len(out), manifest_offset,
                     len(manifest_json), hashlib.sha256(manifest_json).digest(), bytes(32),
                     _cstr(PRODUCER, "producer"), _cstr(target, "target"))
    out[FILE_SHA256_AT:FILE_SHA256_AT + 32] = file_sha256(out, zip(offsets, sizes))
    return bytes(out)


def _buffer_record(b: Buffer) -> dict:
    image = None if b.image is None else \
        {"width": b.image.width, "height": b.image.height, "pitch": b.image.pitch}
    return {"id": b.id, "region": b.region, "offset": b.offset, "nbytes": b.nbytes,
            "dtype": b.dtype, "shape": list(b.shape), "name": b.name, "image": image}


def _cstr(text: str, what: str) -> bytes:
    if len(text) > 32 or not (text.isascii() and text.isprintable()):
        raise ValueError(f"blob {what}: expected printable ASCII of at most 32 bytes, got {text!r}")
    return text.encode().ljust(32, b"\0")
