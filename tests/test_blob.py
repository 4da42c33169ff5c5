import hashlib
import json

import pytest
from hypothesis import given, settings, strategies as st

from compiler.blob import assemble, blob_bytes, write_blob
from runner.blob import (FILE_SHA256_AT, HEADER, SECTION_ALIGN, canonical_json, file_sha256,
                         graph_section, parse_blob, read_blob)
from runner.errors import BlobError
from tests.hand_graphs import CHAIN_W, chain_artifact

ARTIFACT = chain_artifact()
BLOB = blob_bytes(ARTIFACT)


def _manifest(blob: bytes) -> dict:
    fields = HEADER.unpack_from(blob)
    return json.loads(blob[fields[5]:fields[5] + fields[6]])


def _regions(blob: bytes) -> dict[str, tuple[int, int]]:
    m, fields = _manifest(blob), HEADER.unpack_from(blob)
    regions = {s["name"]: (s["offset"], s["offset"] + s["size"]) for s in m["sections"]}
    return {"header": (0, HEADER.size), "manifest": (fields[5], fields[5] + fields[6]), **regions}


def test_round_trip_preserves_every_field():
    blob = parse_blob(BLOB)
    assert blob.target == "cpu" and blob.producer.startswith("keel")
    assert bytes(blob.weights) == CHAIN_W.tobytes() and bytes(blob.programs) == ARTIFACT.programs
    assert blob.arena_bytes == ARTIFACT.arena_bytes
    assert blob.manifest["arena_lower_bound_bytes"] == ARTIFACT.arena_lower_bound_bytes
    assert [(b.name, b.shape, str(b.dtype), b.offset) for b in blob.inputs] == \
        [(b.name, b.shape, b.dtype, b.offset) for b in ARTIFACT.inputs]
    assert [(l.kernel, l.args) for l in blob.launches] == \
        [(l.kernel, l.args) for l in ARTIFACT.launches]
    assert {b.id: (b.region, b.offset, b.nbytes) for b in blob.buffers.values()} == \
        {b.id: (b.region, b.offset, b.nbytes) for b in ARTIFACT.buffers}
    assert blob.manifest["meta"] == ARTIFACT.meta


def test_same_artifact_gives_identical_bytes():
    assert blob_bytes(chain_artifact()) == BLOB


def test_sections_are_4k_aligned_and_weights_are_a_zero_copy_view(tmp_path):
    path = tmp_path / "m.blob"
    write_blob(ARTIFACT, path)
    assert path.read_bytes() == BLOB
    blob = read_blob(path)
    assert all(s["offset"] % SECTION_ALIGN == 0 for s in blob.manifest["sections"])
    assert blob.weights.readonly and blob.weights.obj is blob.programs.obj  # one mapping


def test_every_truncation_is_a_blob_error():
    cuts = sorted({*range(0, len(BLOB), 37), *(e for r in _regions(BLOB).values() for e in r)})
    for cut in cuts:
        if cut < len(BLOB):
            with pytest.raises(BlobError):
                parse_blob(BLOB[:cut])
    with pytest.raises(BlobError, match="file size"):
        parse_blob(BLOB + b"\0")


def _flip(blob: bytes, pos: int, mask: int = 1) -> bytes:
    out = bytearray(blob)
    out[pos] ^= mask
    return bytes(out)


@pytest.mark.parametrize("region", ["header", "manifest", "weights", "programs", "graph"])
def test_bit_flips_in_each_region_are_blob_errors(region):
    start, end = _regions(BLOB)[region]
    for pos in range(start, end, max(1, (end - start) // 200)):
        for bit in (0, 7):
            with pytest.raises(BlobError):
                parse_blob(_flip(BLOB, pos, 1 << bit))


def test_bit_flips_in_padding_and_file_hash_are_blob_errors():
    for pos in (HEADER.size, SECTION_ALIGN - 1, FILE_SHA256_AT, FILE_SHA256_AT + 31):
        with pytest.raises(BlobError, match="SHA-256"):
            parse_blob(_flip(BLOB, pos))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(BLOB) - 1), st.integers(1, 255)), min_size=1,
                max_size=4, unique_by=lambda t: t[0]))
def test_random_byte_corruption_is_always_a_blob_error(edits):
    out = bytearray(BLOB)
    for pos, mask in edits:
        out[pos] ^= mask
    with pytest.raises(BlobError):
        parse_blob(bytes(out))


def _resigned(edit=lambda m: None, target="cpu", graph=None) -> bytes:
    """A blob with a wrong-but-well-hashed manifest: only semantic validation can catch it."""
    m = _manifest(BLOB)
    del m["sections"]
    edit(m)
    payloads = {"weights": ARTIFACT.weights, "programs": ARTIFACT.programs,
                "graph": graph or graph_section(m.get("launches", []))}
    return assemble(target, m, payloads)


def _set(path, value):
    def edit(m):
        *keys, last = path
        for k in keys:
            m = m[k]
        m[last] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set(["buffers", 3, "offset"], 4), "exceeds the 256-byte weights region"),
    (_set(["buffers", 4, "offset"], 256), r"\[256, 512\) exceeds the 384-byte arena region"),
    (_set(["buffers", 0, "nbytes"], 65), r"nbytes expected 64 for uint8 \(1, 64\), got 65"),
    (_set(["buffers", 0, "dtype"], "complex64"), r"buffers\[0\].dtype: expected one of"),
    (_set(["buffers", 1, "offset"], 0), r"inputs\[1\]: buffer 1 expected region 'input' slot 1"),
    (_set(["buffers", 1, "region"], "arena"), r"region 'input' slot 1, got region 'arena'"),
    (_set(["buffers", 2, "offset"], 0), r"outputs\[0\]: buffer 2 expected region 'output' slot 2, "
                                          r"got region 'output' slot 0"),
    (_set(["inputs"], [0]), r"expected every input buffer \[0, 1\], got \[0\]"),
    (_set(["buffers", 1, "name"], "x"), "names must be non-empty and unique"),
    (_set(["launches", 1, "args"], [2, 9, 1]), r"launch 1 \(bias\): args reference unknown"),
    (_set(["launches", 0, "global_size"], []), "expected positive sizes"),
    (_set(["arena_lower_bound_bytes"], 10**6), "expected <= arena_bytes 384"),
    (_set(["arena_bytes"], -1), "arena_bytes: expected a non-negative integer, got -1"),
    (_set(["arena_bytes"], True), "arena_bytes: expected a non-negative integer, got True"),
    (_set(["buffers", 0, "shape"], "1x64"), r"buffers\[0\].shape: expected a list"),
    (_set(["meta"], []), "meta: expected an object"),
    (_set(["buffers", 2, "extra"], 1), r"buffers\[2\]: expected keys"),
    (lambda m: m.pop("launches"), "expected keys"),
])
def test_semantic_errors_name_the_field_expected_and_got(edit, message):
    with pytest.raises(BlobError, match=message):
        parse_blob(_resigned(edit))


def test_unknown_target_is_a_blob_error():
    with pytest.raises(BlobError, match="header target: expected one of .* got 'tpu'"):
        parse_blob(_resigned(target="tpu"))


def test_graph_section_must_match_the_manifest_launch_table():
    graph = graph_section(_manifest(BLOB)["launches"][:1])
    with pytest.raises(BlobError, match="graph section does not match"):
        parse_blob(_resigned(graph=graph))


def _with_section_table(edit) -> bytes:
    """Rewrite the section table, keeping the manifest and file hashes valid."""
    m = _manifest(BLOB)
    edit(m["sections"])
    manifest = canonical_json(m)
    fields = list(HEADER.unpack_from(BLOB))
    out = bytearray(BLOB[:fields[5]] + manifest)
    fields[4], fields[6], fields[7] = len(out), len(manifest), hashlib.sha256(manifest).digest()
    HEADER.pack_into(out, 0, *fields)
    out[FILE_SHA256_AT:FILE_SHA256_AT + 32] = file_sha256(out)
    return bytes(out)


@pytest.mark.parametrize("edit, message", [
    (_set([1, "offset"], SECTION_ALIGN + 4), "section programs: offset 4100 is not 4096-aligned"),
    (_set([1, "offset"], SECTION_ALIGN), "section programs starts at 4096, inside section weights"),
    (_set([2, "size"], 10**9), r"section graph: \[\d+, \d+\) runs past the end"),
    (lambda table: table.pop(), r"expected sections \['weights', 'programs', 'graph'\]"),
    (_set([0, "sha256"], "0" * 64), "section weights: SHA-256 mismatch"),
])
def test_section_table_errors_name_the_section(edit, message):
    with pytest.raises(BlobError, match=message):
        parse_blob(_with_section_table(edit))


def test_missing_file_is_a_blob_error(tmp_path):
    with pytest.raises(BlobError, match="cannot read blob"):
        read_blob(tmp_path / "nope.blob")
    (tmp_path / "empty.blob").write_bytes(b"")
    with pytest.raises(BlobError, match="empty"):
        read_blob(tmp_path / "empty.blob")
