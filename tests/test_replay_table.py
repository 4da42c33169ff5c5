"""The blob format's replay table (the graph section), image layouts in the buffer table, the
hazard pass that sets each launch's barrier flag, and what a v1 or v2 blob gets."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from compiler import toolchain
from compiler.artifact import Buffer, Launch
from compiler.blob import assemble, blob_bytes
from compiler.pipeline import compile_model
from compiler.link.hazards import mark_barriers
from runner.blob import parse_blob
from runner.errors import BlobError
from runner.format import GRAPH_HEAD, HEADER, LAUNCH, VERSION, pack_graph
from tests.hand_graphs import HOST, chain_artifact
from tests.test_opencl import mlp

ARTIFACT = chain_artifact()
BLOB = blob_bytes(ARTIFACT)


def _manifest() -> dict:
    fields = HEADER.unpack_from(BLOB)
    m = json.loads(BLOB[fields[5]:fields[5] + fields[6]])
    del m["sections"]
    return m


def _with(graph: bytes = None, edit=lambda m: None) -> bytes:
    """The chain blob with this graph section and its one variant's record edited."""
    m = _manifest()
    edit(m["variants"][0])
    return assemble(HOST, m, {"weights": ARTIFACT.weights, f"weights.{HOST}": b"",
                              f"programs.{HOST}": ARTIFACT.programs,
                              f"graph.{HOST}": _graph() if graph is None else graph})


def _graph(**changes) -> bytes:
    """The chain blob's table with fields of launch 1 changed."""
    raw = bytearray(pack_graph([(0, False, [4, 0, 3], (64,), None), (1, True, [2, 4, 1], (64,),
                                                                      None)]))
    rec = np.frombuffer(raw, LAUNCH, 2, GRAPH_HEAD.size)[1:].copy()
    for k, v in changes.items():
        rec[0][k] = v
    raw[GRAPH_HEAD.size + LAUNCH.itemsize:GRAPH_HEAD.size + 2 * LAUNCH.itemsize] = rec.tobytes()
    return bytes(raw)


def test_round_trip_keeps_programs_args_sizes_and_barriers():
    blob = parse_blob(BLOB)
    assert blob.program_names == ["scale", "bias"]
    assert [(l.kernel, l.args, l.global_size, l.local_size, l.barrier) for l in blob.launches] == \
        [("scale", (4, 0, 3), (64,), None, False), ("bias", (2, 4, 1), (64,), None, True)]
    assert bytes(blob.graph) == _graph()


def test_the_writer_refuses_sizes_that_do_not_fit_the_table():
    with pytest.raises(ValueError, match="must fit 3 dims of u32"):
        pack_graph([(0, False, [1], (1, 1, 1, 1), None)])
    with pytest.raises(ValueError, match="must fit 3 dims of u32"):
        pack_graph([(0, False, [1], (2**32,), None)])


@pytest.mark.parametrize("graph, message", [
    (b"\1\0\0", "graph section: 3 bytes, shorter than its 8-byte head"),
    (_graph()[:-4], "graph section: 2 launches and 6 args need 120 bytes, got 116"),
    (GRAPH_HEAD.pack(2**32 - 1, 0), f"need {8 + (2**32 - 1) * 44} bytes, got 8"),
    (_graph(program=2), r"graph launch 1: program 2 expected < 2"),
    (_graph(flags=2), r"launch 1 \(bias\): expected flags within 0x1 and 1..3 dims, got flags 0x2"),
    (_graph(dims=0), "got flags 0x1 dims 0"),
    (_graph(global_size=(0, 1, 1)), r"expected positive sizes, 1 past 1 dims"),
    (_graph(global_size=(64, 2, 1)), r"got global \[64, 2, 1\]"),
    (_graph(local_size=(8, 0, 1)), r"local all zero or all positive, got global"),
    (_graph(first_arg=2), r"args \[2, 5\) expected to start at 3"),
    (_graph(arg_count=4), r"args \[3, 7\) expected to start at 3, be non-empty and end within"),
    (_graph(arg_count=0), "expected to start at 3, be non-empty"),
    (GRAPH_HEAD.pack(0, 1) + bytes(4), "graph section: launches use 0 args, the head says 1"),
])
def test_every_bad_replay_table_field_is_a_blob_error_naming_it(graph, message):
    with pytest.raises(BlobError, match=message):
        parse_blob(_with(graph))


def test_unknown_argument_buffers_and_bad_program_names_are_blob_errors():
    table = pack_graph([(0, False, [4, 0, 3], (64,), None), (1, True, [2, 9, 1], (64,), None)])
    with pytest.raises(BlobError, match=r"launch 1 \(bias\): args reference unknown buffers \[9\]"):
        parse_blob(_with(table))
    with pytest.raises(BlobError, match="manifest programs: expected unique C identifiers"):
        parse_blob(_with(edit=lambda m: m.update(programs=["scale", "scale"])))


def _image(edit):
    def apply(m):
        m["buffers"][4]["image"] = {"width": 16, "height": 1, "pitch": 16}
        edit(m["buffers"][4])
    return apply


@pytest.mark.parametrize("edit, message", [
    (lambda b: b["image"].update(pitch=8), r"image \(width 16, height 1, pitch 8\)"),
    (lambda b: b["image"].update(height=2), "covering float32 \\(64,\\)"),
    (lambda b: b.update(dtype="int32"), "expected float16/float32 arena or weights rows"),
    (lambda b: b["image"].update(width="16"), r"buffers\[4\].image.width: expected an integer"),
])
def test_image_layouts_are_typed_and_checked_fields_of_the_buffer_table(edit, message):
    parse_blob(_with(edit=_image(lambda b: None)))  # a consistent layout passes
    with pytest.raises(BlobError, match=message):
        parse_blob(_with(edit=_image(edit)))


def test_images_travel_in_the_buffer_table_not_in_the_program_text():
    model, _ = mlp(np.random.default_rng(1))
    art = compile_model(model, target="opencl", images=True)
    blob = parse_blob(blob_bytes(art))
    want = {b.id: (b.image.width, b.image.height, b.image.pitch, b.image.channels)
            for b in art.buffers if b.image}
    assert want and {i: b.image for i, b in blob.buffers.items() if b.image} == want
    assert b"// keel" not in art.programs and "images" not in art.meta


@pytest.mark.parametrize("version", [1, 2, 4])
def test_an_older_blob_names_its_version_and_says_to_recompile(version):
    old = bytearray(BLOB)
    struct.pack_into("<I", old, 8, version)
    with pytest.raises(BlobError, match=f"blob format version {version}: this runner reads "
                                        f"version {VERSION}; recompile the model"):
        parse_blob(bytes(old))


def _buf(i, region, offset, nbytes=16):
    return Buffer(i, region, offset, nbytes, "float32", (nbytes // 4,))


@pytest.mark.parametrize("reads, writes, want", [
    ([(1,), (0,)], [0, 2], [False, True]),  # reads what launch 0 wrote
    ([(1,), (3,)], [2, 1], [False, True]),  # overwrites what launch 0 read
    ([(1,), (3,)], [0, 2], [False, False]),  # independent: no barrier
    ([(1,), (1,)], [0, 2], [False, False]),  # two readers of one buffer
    ([(1,), (1,)], [0, 4], [False, True]),  # arena bytes overlap another buffer's range
])
def test_hazard_pass_sets_a_barrier_exactly_where_memory_is_shared(reads, writes, want):
    buffers = {0: _buf(0, "arena", 0), 1: _buf(1, "weights", 0), 2: _buf(2, "arena", 32),
               3: _buf(3, "weights", 16), 4: _buf(4, "arena", 8)}
    launches = [Launch(f"k{i}", (w, *r)) for i, (w, r) in enumerate(zip(writes, reads))]
    assert [ln.barrier for ln in mark_barriers(launches, buffers)] == want


def test_compiled_cpu_programs_put_a_barrier_where_the_table_has_one(monkeypatch):
    sources = []
    build = toolchain.build_shared
    monkeypatch.setattr(toolchain, "build_shared", lambda src, t, *early: sources.append(src) or
                        build(src, t, *early))
    model, _ = mlp(np.random.default_rng(2))
    art = compile_model(model)
    flags = [ln.barrier for ln in art.launches]
    assert flags[0] is False and all(flags[1:])  # a chain: each launch reads the one before
    rows = sources[0].split("keel_rows[")[1].split("};")[0].split("= {", 1)[1]
    table = [int(row.split(",")[1]) for row in rows.strip("{} ").split("}, {")]
    assert table == [int(f) for f in flags]  # {kernel, barrier, nargs, first} per launch
