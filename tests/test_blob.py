import dataclasses
import hashlib
import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import runner.blob
from compiler.blob import BlobWriter, assemble, blob_bytes, write_blob
from runner.blob import parse_blob, read_blob
from runner.format import (BINARIES, BINARIES_MAGIC, CHUNK_BYTES, FILE_SHA256_AT, HEADER,
                           SECTION_ALIGN, canonical_json, file_sha256, pack_binaries)
from runner.errors import BlobError
from tests.hand_graphs import CHAIN_W, HOST, chain_artifact

ARTIFACT = chain_artifact()
BLOB = blob_bytes(ARTIFACT)
PROGRAMS, GRAPH = f"programs.{HOST}", f"graph.{HOST}"  # its one variant's sections


def _manifest(blob: bytes) -> dict:
    fields = HEADER.unpack_from(blob)
    return json.loads(blob[fields[5]:fields[5] + fields[6]])


def _regions(blob: bytes) -> dict[str, tuple[int, int]]:
    m, fields = _manifest(blob), HEADER.unpack_from(blob)
    regions = {s["name"]: (s["offset"], s["offset"] + s["size"]) for s in m["sections"]}
    return {"header": (0, HEADER.size), "manifest": (fields[5], fields[5] + fields[6]), **regions}


def test_round_trip_preserves_every_field():
    blob = parse_blob(BLOB)
    assert blob.target == blob.variant == HOST and blob.variants == (HOST,)
    assert blob.producer.startswith("keel")
    assert bytes(blob.weights) == CHAIN_W.tobytes() and bytes(blob.programs) == ARTIFACT.programs
    assert blob.arena_bytes == ARTIFACT.arena_bytes
    assert blob.variant_manifest["arena_lower_bound_bytes"] == ARTIFACT.arena_lower_bound_bytes
    assert [(b.name, b.shape, str(b.dtype), b.slot) for b in blob.inputs] == \
        [(b.name, b.shape, b.dtype, b.slot) for b in ARTIFACT.inputs]
    assert [(l.kernel, l.args) for l in blob.launches] == \
        [(l.kernel, l.args) for l in ARTIFACT.launches]
    assert {b.id: (b.region, b.offset, b.slot, b.nbytes) for b in blob.buffers.values()} == \
        {b.id: (b.region, b.offset, b.slot, b.nbytes) for b in ARTIFACT.buffers}
    assert blob.manifest["meta"] == ARTIFACT.meta


def test_same_artifact_gives_identical_bytes():
    assert blob_bytes(chain_artifact()) == BLOB


def test_weights_written_before_the_programs_give_the_same_file(tmp_path):
    # tools/compile.py writes the weights region while the kernels still compile
    # (compile_model's writer); the file must be the one write_blob makes
    path = tmp_path / "m.blob"
    with BlobWriter(path) as out:
        out.weights((ARTIFACT.weights, (len(ARTIFACT.weights), 0)))
        out.finish(ARTIFACT)
    assert path.read_bytes() == BLOB
    # a compile that fails after its weights were written leaves neither file nor temporary
    with pytest.raises(RuntimeError, match="kernel failed"):
        with BlobWriter(tmp_path / "n.blob") as out:
            out.weights((ARTIFACT.weights, (len(ARTIFACT.weights), 0)))
            raise RuntimeError("kernel failed")
    assert [p.name for p in tmp_path.iterdir()] == ["m.blob"]


def test_weights_laid_out_in_the_blob_file_give_the_same_file(tmp_path):
    # a big model's region is the blob file itself (BlobWriter.region), its pages let go as
    # they are written: the file must still be the one write_blob makes
    path = tmp_path / "m.blob"
    sizes = (len(ARTIFACT.weights), 0)
    with BlobWriter(path) as out:
        region = out.region(sizes)
        region[:] = ARTIFACT.weights
        region.release(0, len(region))
        out.weights((region, sizes))
        out.finish(dataclasses.replace(ARTIFACT, weights=region))
    assert path.read_bytes() == BLOB


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
    with pytest.raises(BlobError, match="trailing bytes: the header says"):
        parse_blob(BLOB + b"\0")


def _flip(blob: bytes, pos: int, mask: int = 1) -> bytes:
    out = bytearray(blob)
    out[pos] ^= mask
    return bytes(out)


@pytest.mark.parametrize("region", ["header", "manifest", "weights", PROGRAMS, GRAPH])
def test_bit_flips_in_each_region_are_blob_errors(region):
    start, end = _regions(BLOB)[region]
    for pos in range(start, end, max(1, (end - start) // 200)):
        for bit in (0, 7):
            with pytest.raises(BlobError):
                parse_blob(_flip(BLOB, pos, 1 << bit))


def test_bit_flips_in_padding_and_file_hash_are_blob_errors():
    regions = _regions(BLOB)
    between = [regions["weights"][1], regions[PROGRAMS][0] - 1, regions[PROGRAMS][1]]
    for pos in (HEADER.size, SECTION_ALIGN - 1, FILE_SHA256_AT, FILE_SHA256_AT + 31, *between):
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


def _graph(blob: bytes) -> bytes:
    start, end = _regions(blob)[GRAPH]
    return blob[start:end]


def _resigned(edit=lambda m: None, target=HOST, graph=None, weights=ARTIFACT.weights,
              binaries=b"") -> bytes:
    """A blob with a wrong-but-well-hashed manifest: only semantic validation can catch it."""
    m = _manifest(BLOB)
    del m["sections"]
    edit(m)
    payloads = {"weights": weights, f"weights.{HOST}": b"", PROGRAMS: ARTIFACT.programs,
                GRAPH: _graph(BLOB) if graph is None else graph, f"binaries.{HOST}": binaries}
    for v in m["variants"]:  # a variant edited to another target: its sections follow it
        payloads.update({f"{k}.{v.get('target')}": payloads[f"{k}.{HOST}"]
                         for k in ("weights", "programs", "graph")})
    return assemble(target, m, payloads)


def _set(path, value, top=False):
    """Set the value at `path` in the manifest (top) or in its one variant's record."""
    def edit(m):
        *keys, last = path if top else ["variants", 0, *path]
        for k in keys:
            m = m[k]
        m[last] = value
    return edit


@pytest.mark.parametrize("edit, message", [
    (_set(["buffers", 3, "offset"], 4),
     r"buffer 3: \[4, 260\) lies outside the weights sections \[\(0, 256\), \(4096, 4096\)\]"),
    (_set(["buffers", 4, "offset"], 256), r"\[256, 512\) exceeds the 384-byte arena region"),
    (_set(["buffers", 0, "nbytes"], 65), r"nbytes expected 64 for uint8 \(1, 64\), got 65"),
    (_set(["buffers", 0, "dtype"], "complex64"), r"buffers\[0\].dtype: expected one of"),
    (_set(["buffers", 1, "slot"], 0), r"inputs\[1\]: buffer 1 expected region 'input' slot 1"),
    (_set(["buffers", 1, "region"], "arena"), r"buffer 1 \(arena\): expected no slot, got slot 1"),
    (_set(["buffers", 2, "slot"], 0), r"outputs\[0\]: buffer 2 expected region 'output' slot 2, "
                                        r"got region 'output' slot 0"),
    (_set(["buffers", 2, "offset"], 8), r"buffer 2 \(output\): expected a slot and offset 0, "
                                        r"got slot 2 offset 8"),
    (_set(["buffers", 2, "slot"], None), r"buffer 2 \(output\): expected a slot and offset 0"),
    (_set(["buffers", 4, "slot"], 0), r"buffer 4 \(arena\): expected no slot, got slot 0"),
    (_set(["inputs"], [0]), r"expected every input buffer \[0, 1\], got \[0\]"),
    (_set(["buffers", 1, "name"], "x"), "names must be non-empty and unique"),
    (_set(["arena_lower_bound_bytes"], 10**6), "expected <= arena_bytes 384"),
    (_set(["arena_bytes"], -1), r"arena_bytes: expected an integer in \[0, 2\*\*63\), got -1"),
    (_set(["arena_bytes"], True), r"arena_bytes: expected an integer .*, got True"),
    (_set(["buffers", 3, "nbytes"], 2**63), r"buffers\[3\].nbytes: expected an integer in"),
    (_set(["buffers", 0, "shape"], [2**32, 2**32, 4]), f"nbytes expected {2**66} for uint8"),
    (_set(["buffers", 0, "region"], ["input"]), r"buffers\[0\].region: expected one of"),
    (_set(["buffers", 0, "shape"], "1x64"), r"buffers\[0\].shape: expected a list"),
    (_set(["meta"], [], top=True), "meta: expected an object"),
    (_set(["buffers", 2, "extra"], 1), r"buffers\[2\]: expected keys"),
    (lambda m: m["variants"][0].pop("programs"), "expected keys"),
    (_set(["target"], "tpu"), r"variants\[0\].target: expected one of"),
    (_set(["target"], "opencl"), "manifest variants: expected distinct targets run by the 'cpu'"),
    (_set(["variants"], [], top=True), "manifest variants: expected distinct targets"),
    # entries (docs/blob.md "Entries and state")
    (_set(["entries"], []), r"manifest entries: expected at least one, with unique names"),
    (_set(["entries", 0, "name"], "not an id"), r"unique names of .*, got \['not an id'\]"),
    (_set(["entries", 0, "launches"], [1, 1]), r"entry 'main': launches expected \[first, "
                                                r"count\] with first 0"),
    (_set(["entries", 0, "launches"], [0, 3]), r"launches \[0, 3\) past the replay table's 2"),
    (_set(["entries", 0, "launches"], [0, 1]), r"expected to cover the 2 launches"),
    (_set(["entries", 0, "inputs"], [1, 0]), r"inputs expected input buffer ids in slot order"),
    (_set(["entries", 0, "inputs"], [0, 2]), r"inputs expected input buffer ids in slot order"),
    (_set(["entries", 0, "outputs"], []), r"io buffers \[2\] in none"),
    (lambda m: m["variants"][0]["entries"].append(
        {"name": "b", "inputs": [1], "outputs": [], "launches": [2, 0]}),
     r"entry 'b': input buffer 1 is in entry 'main' too"),
    (lambda m: m["variants"][0]["entries"][0].pop("launches"), r"entries\[0\]: expected keys"),
    # state
    (_set(["state"], [{"name": "s", "reads": [1], "writes": [2], "init": None, "x": 1}]),
     r"state\[0\]: expected keys"),
    (_set(["state"], [{"name": "s", "reads": [2], "writes": [], "init": None}]),
     r"state 's': reads expected input buffers of no other state"),
    (_set(["state"], [{"name": "s", "reads": [], "writes": [1], "init": None}]),
     r"state 's': writes expected output buffers"),
    (_set(["state"], [{"name": "s", "reads": [], "writes": [], "init": None}]),
     r"state 's': expected reads or writes"),
    (_set(["state"], [{"name": "s", "reads": [0], "writes": [2], "init": None}]),
     r"state 's': expected reads or writes, all of one dtype and shape"),
    (_set(["state"], [{"name": "s", "reads": [1], "writes": [2], "init": 4}]),
     r"init null or a plain weights buffer"),
    (_set(["state"], [{"name": "s", "reads": [1], "writes": [2], "init": 9}]),
     r"init null or a plain weights buffer"),
    (_set(["state"], [{"name": "s", "reads": [1], "writes": [2], "init": None},
                      {"name": "s", "reads": [], "writes": [], "init": None}]),
     r"manifest state: expected unique non-empty names"),
    (_set(["state"], [{"name": "s", "reads": [1], "writes": [2], "init": None},
                      {"name": "t", "reads": [1], "writes": [], "init": None}]),
     r"state 't': reads expected input buffers of no other state"),
    # a ring (compiler/ring.py): its step must leave kept rows, its mirrors are output buffers
    (_set(["state"], [{"name": "s", "reads": [1], "writes": [2], "init": None,
                       "ring": {"step": 1, "mirrors": [2], "windows": []}}]),
     r"state 's': ring mirrors expected output buffers of no other state"),
    (_set(["state"], [{"name": "s", "reads": [1], "writes": [], "init": None,
                       "ring": {"step": 1, "mirrors": [], "windows": []}}]),
     r"state 's': ring expected a read of M rows, a step k with 0 < k < M and k \| M"),
    (_set(["state"], [{"name": "s", "reads": [1], "writes": [2], "init": None,
                       "ring": {"step": 1, "mirrors": []}}]), r"state\[0\].ring: expected keys"),
])
def test_semantic_errors_name_the_field_expected_and_got(edit, message):
    with pytest.raises(BlobError, match=message):
        parse_blob(_resigned(edit))


def test_unknown_target_is_a_blob_error():
    with pytest.raises(BlobError, match="header target: expected one of .* got 'tpu'"):
        parse_blob(_resigned(target="tpu"))


def _with_manifest_bytes(raw: bytes) -> bytes:
    """Replace the manifest with these bytes, as they are, and re-sign the header."""
    fields = list(HEADER.unpack_from(BLOB))
    out = bytearray(BLOB[:fields[5]] + raw)
    fields[4], fields[6], fields[7] = len(out), len(raw), hashlib.sha256(raw).digest()
    HEADER.pack_into(out, 0, *fields)
    spans = [(s["offset"], s["size"]) for s in _manifest(BLOB)["sections"]]
    out[FILE_SHA256_AT:FILE_SHA256_AT + 32] = file_sha256(out, spans)
    return bytes(out)


@pytest.mark.parametrize("raw, message", [
    (b'{"meta":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not valid UTF-8 JSON"),
    (b'{"arena_bytes":' + b"9" * 5000 + b"}", "not valid UTF-8 JSON"),
    (b'{"meta":{},"meta":{}}', "duplicate keys"),
    (b'{"meta":NaN}', "expected finite numbers, got NaN"),
    (b'{"meta":"\xff"}', "not valid UTF-8 JSON"),
])
def test_hostile_manifest_json_is_a_blob_error(raw, message):
    with pytest.raises(BlobError, match=message):
        parse_blob(_with_manifest_bytes(raw))


def _with_section_table(edit) -> bytes:
    """Rewrite the section table, keeping the manifest and file hashes valid."""
    m = _manifest(BLOB)
    edit(m["sections"])
    manifest = canonical_json(m)
    fields = list(HEADER.unpack_from(BLOB))
    out = bytearray(BLOB[:fields[5]] + manifest)
    fields[4], fields[6], fields[7] = len(out), len(manifest), hashlib.sha256(manifest).digest()
    HEADER.pack_into(out, 0, *fields)
    spans = [(s["offset"], s["size"]) for s in m["sections"]]
    out[FILE_SHA256_AT:FILE_SHA256_AT + 32] = file_sha256(out, spans)
    return bytes(out)


def _swap(i, j):
    def edit(table):
        table[i], table[j] = table[j], table[i]
    return edit


SECTION_NAMES = (rf"\['weights', 'weights.{HOST}', 'programs.{HOST}', 'graph.{HOST}', "
                 rf"'binaries.{HOST}'\]")


@pytest.mark.parametrize("edit, message", [
    (_set([2, "offset"], SECTION_ALIGN + 4, top=True),
     f"section {PROGRAMS}: offset expected 8192, got 4100"),
    (_set([2, "offset"], SECTION_ALIGN, top=True),
     f"section {PROGRAMS}: offset expected 8192, got 4096"),
    (lambda table: table[4].update(size=5000, chunk_sha256=["0" * 64]),  # the last section
     rf"manifest offset: expected \d+ \(the end of section binaries.{HOST}\)"),
    (_set([3, "size"], 10**9, top=True),
     f"section {GRAPH}: expected 239 chunk digests for 1000000000 bytes"),
    (lambda table: table.pop(), f"expected sections {SECTION_NAMES}"),
    (_swap(0, 1), f"expected sections {SECTION_NAMES} in this order"),
    (lambda table: table[0]["chunk_sha256"].append("0" * 64),
     "section weights: expected 1 chunk digests for 256 bytes, got 2"),
    (_set([0, "chunk_sha256", 0], "0" * 64, top=True),
     r"section weights: SHA-256 mismatch in chunk 0 \(bytes \[0, 256\) of the section\)"),
    # takes in a byte of padding: changes what is hashed
    (_set([0, "size"], 257, top=True), "SHA-256"),
])
def test_section_table_errors_name_the_section(edit, message):
    with pytest.raises(BlobError, match=message):
        parse_blob(_with_section_table(edit))


# A blob whose weights span three chunks, the last one short: the chunked hashing, its threads and
# the chunk boundaries. Only the weights grow, so every other region is the small blob's.
BIG_WEIGHTS = 2 * CHUNK_BYTES + 1000


@pytest.fixture(scope="module")
def big() -> bytes:
    return _resigned(weights=np.random.default_rng(1).bytes(BIG_WEIGHTS))


@pytest.fixture(params=[1, 2, 5], ids=lambda n: f"{n}cpu")
def cpus(request, monkeypatch):
    """Hash with this many threads (the calling one included)."""
    monkeypatch.setattr(runner.blob, "_cpus", lambda: request.param)
    return request.param


def test_big_blob_round_trips_with_one_digest_per_chunk(big, cpus):
    blob = parse_blob(big)
    assert len(blob.weights) == BIG_WEIGHTS
    weights = blob.manifest["sections"][0]
    assert len(weights["chunk_sha256"]) == 3
    assert weights["chunk_sha256"][2] == \
        hashlib.sha256(big[weights["offset"] + 2 * CHUNK_BYTES:][:1000]).hexdigest()


def test_a_flipped_byte_in_the_weights_is_detected_in_every_chunk(big, cpus):
    start, _ = _regions(big)["weights"]
    for pos in (0, 1234567, CHUNK_BYTES - 1, CHUNK_BYTES, 2 * CHUNK_BYTES - 1, 2 * CHUNK_BYTES,
                BIG_WEIGHTS - 1):
        chunk = pos // CHUNK_BYTES
        with pytest.raises(BlobError, match=f"section weights: SHA-256 mismatch in chunk {chunk} "):
            parse_blob(_flip(big, start + pos, 0x80))


def test_big_blob_truncated_at_chunk_boundaries_is_a_blob_error(big):
    start, end = _regions(big)["weights"]
    for cut in (start + CHUNK_BYTES, start + 2 * CHUNK_BYTES, end, len(big) - 1):
        with pytest.raises(BlobError, match="truncated: the header says"):
            parse_blob(big[:cut])


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_byte_corruption_of_the_big_blob_is_always_a_blob_error(big, data):
    pos = data.draw(st.one_of(st.integers(0, len(big) - 1),
                              st.sampled_from([k * CHUNK_BYTES + d + SECTION_ALIGN
                                               for k in range(3) for d in (-1, 0, 1)])))
    with pytest.raises(BlobError):
        parse_blob(_flip(big, pos, data.draw(st.integers(1, 255))))


def test_a_manifest_error_found_while_hashing_stops_the_hash_threads(cpus):
    threads = threading.active_count()
    bad = _resigned(_set(["buffers", 4, "offset"], 256),
                    weights=np.random.default_rng(1).bytes(BIG_WEIGHTS))
    with pytest.raises(BlobError, match="arena region"):
        parse_blob(bad)
    assert threading.active_count() == threads


def test_missing_file_is_a_blob_error(tmp_path):
    with pytest.raises(BlobError, match="cannot read blob"):
        read_blob(tmp_path / "nope.blob")
    (tmp_path / "empty.blob").write_bytes(b"")
    with pytest.raises(BlobError, match="empty"):
        read_blob(tmp_path / "empty.blob")


DEVICE = {"compiler": "mock", "chip_id": 0x06030001, "driver": "3.1/1.0",
          "source_sha256": "ab" * 32}
FACTS = {"kernel": "scale", "params": ["buffer", "buffer"], "half": False, "source": "",
         "offsets": [0, 2], "regs": [0, 0, 0, 0, 0], "imms": []}


def test_a_binaries_section_round_trips_typed_and_hashed():
    """Device binaries (qcom --embed-binaries) in their own section: read back as bytes with
    their facts; a blob without them has an empty section and no binaries."""
    blob = parse_blob(_resigned(binaries=pack_binaries(DEVICE, {"scale": (FACTS, b"\1\2\3"),
                                                                "bias": (FACTS, b"\4")})))
    assert blob.binaries.device == DEVICE
    facts, data = blob.binaries.programs["scale"]
    assert bytes(data) == b"\1\2\3" and facts["params"] == ["buffer", "buffer"]
    assert bytes(blob.binaries.programs["bias"][1]) == b"\4"
    assert parse_blob(BLOB).binaries is None


def _index(index: bytes) -> bytes:
    return BINARIES.pack(BINARIES_MAGIC, len(index)) + index


@pytest.mark.parametrize("section, message", [
    (b"KEELBIN0" + bytes(8), r"binaries section: header: expected magic b'KEELBIN1'"),
    (BINARIES_MAGIC + (1000).to_bytes(4, "little"), r"an index within the section, got .* 1000"),
    (_index(b"{not json"), r"binaries section: Expecting property name"),
    (_index(canonical_json({"programs": {}})), r"index: expected keys \['device', 'programs'\]"),
    (pack_binaries({**DEVICE, "source_sha256": "xyz"}, {}),
     r"index.device.source_sha256: expected 64 lowercase hex digits"),
    (pack_binaries(DEVICE, {"scale": ({**FACTS, "params": ["texture"]}, b"")}),
     r"index.programs.scale.params\[0\]: expected one of \['buffer', 'image'\]"),
    (pack_binaries(DEVICE, {"other": (FACTS, b"")}), r"program 'other': expected one of the "),
    (_index(canonical_json({"device": DEVICE, "programs": {"scale": {**FACTS, "at": 0,
                                                                      "size": 9}}})) + b"123",
     r"program 'scale': .* within the section's 3, got \[0, 9\)"),
])
def test_a_malformed_binaries_section_is_a_blob_error(section, message):
    with pytest.raises(BlobError, match=message):
        parse_blob(_resigned(binaries=section))
