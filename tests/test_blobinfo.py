"""tools/blobinfo.py: provenance in the launch table, the memory plan as data and as a PNG
(opened and checked pixel by pixel), and the blob reader's handling of the provenance key."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from compiler.blob import assemble
from runner import BlobError
from runner.blob import launch_nodes, read_blob
from tests.graphs import compiled_blob
from tests.hand_graphs import chain_artifact, write
from tests.light_net import light_net
from tools import blobinfo
from tools.png import PALETTE, read_png

TOOL = str(Path(__file__).resolve().parent.parent / "tools" / "blobinfo.py")


@pytest.fixture(scope="module")
def blob_path():
    return str(compiled_blob(light_net()))


def test_every_computed_node_is_in_exactly_the_launches_that_compute_it(blob_path):
    nodes = launch_nodes(read_blob(blob_path))
    seen = [n for per in nodes for n in per]
    ops = {op for _, op in seen}
    assert {"Conv", "BatchNormalization", "Sigmoid", "Mul", "GlobalAveragePool", "Gemm"} <= ops
    assert len(seen) == len(set(seen))  # nothing recomputed: each node in one launch
    model = light_net()
    computed = {n.name for n in model.graph.node if n.op_type != "Flatten"}  # Flatten: a view
    assert computed == {name for name, _ in seen}


def test_memory_plan_live_buffers_never_share_bytes_and_peak_is_the_bound(blob_path):
    mem = blobinfo.describe(blob_path)["memory"]
    assert 0 < mem["peak"]["bytes"] <= mem["lower_bound_bytes"] <= mem["arena_bytes"]
    for step in range(mem["launches"]):
        live = sorted((b["offset"], b["offset"] + b["nbytes"]) for b in mem["buffers"]
                      if b["first"] <= step <= b["last"])
        assert all(a[1] <= b[0] for a, b in zip(live, live[1:]))
        assert sum(e - s for s, e in live) == mem["live_bytes"][step]
    assert mem["peak"]["bytes"] == max(mem["live_bytes"])


def test_memory_png_has_its_size_a_rectangle_per_buffer_and_the_marks(blob_path, tmp_path):
    png = tmp_path / "plan.png"
    proc = subprocess.run([sys.executable, TOOL, blob_path, "--memory", str(png)],
                          capture_output=True, text=True, check=True)
    assert "largest live set:" in proc.stdout and "Conv" in proc.stdout
    px = read_png(png.read_bytes())
    assert px.shape == (blobinfo.H, blobinfo.W, 3)
    mem = blobinfo.describe(blob_path)["memory"]
    pw, ph = blobinfo.W - blobinfo.LEFT - blobinfo.RIGHT, blobinfo.H - blobinfo.TOP - \
        blobinfo.BOTTOM
    for i, b in enumerate(mem["buffers"]):  # each rectangle's bottom right corner, inside it
        x = int(blobinfo.LEFT + (b["last"] + 1) * pw / mem["launches"]) - 3
        y = int(blobinfo.H - blobinfo.BOTTOM - b["offset"] * ph / mem["arena_bytes"]) - 3
        if b["nbytes"] * ph / mem["arena_bytes"] > 8:  # tall enough to have an inside
            assert tuple(px[y, x]) == PALETTE[i % len(PALETTE)], b
    red = np.all(px == blobinfo.RED, axis=2)
    lb_row = int(round(blobinfo.H - blobinfo.BOTTOM -
                       mem["lower_bound_bytes"] * ph / mem["arena_bytes"]))
    assert red[lb_row - 1:lb_row + 1].any(axis=0).sum() > pw // 2  # the dashed lower bound
    peak_x = int(blobinfo.LEFT + (mem["peak"]["launch"] + 0.5) * pw / mem["launches"])
    assert red[blobinfo.TOP - 6, peak_x]  # the peak's column is marked


def test_blobinfo_names_the_variants_and_the_one_this_host_runs(blob_path):
    """A `cpu` blob holds both x86-64 levels; the tool says which this host (KEEL_CPU_VARIANT
    forcing it here) runs, and --variant describes another without running it."""
    env = {**os.environ, "KEEL_CPU_VARIANT": "cpu-avx2"}
    text = subprocess.run([sys.executable, TOOL, blob_path], capture_output=True, text=True,
                          check=True, env=env).stdout
    assert "variants: 2; this host runs cpu-avx2\n" in text
    lines = [ln.split() for ln in text.splitlines() if ln.startswith("  variant ")]
    assert [ln[1] for ln in lines] == ["cpu-avx2", "cpu-avx512"]
    d = blobinfo.describe(blob_path, "cpu-avx512")
    assert d["variant"] == "cpu-avx512" and d["host_variant"] in ("cpu-avx2", "cpu-avx512")
    assert [v["target"] for v in d["variants"]] == ["cpu-avx2", "cpu-avx512"]
    assert d["programs_bytes"] == d["variants"][1]["programs_bytes"] > 0
    bad = subprocess.run([sys.executable, TOOL, blob_path, "--variant", "cpu-avx9"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "expected one of this blob's variants" in bad.stderr


def test_a_blob_without_provenance_still_reads(tmp_path):
    blob = read_blob(write(chain_artifact(), tmp_path / "chain.blob"))
    assert "provenance" not in blob.variant_manifest
    assert launch_nodes(blob) == [[] for _ in blob.launches]


def test_provenance_must_cover_every_launch(blob_path, tmp_path):
    blob = read_blob(blob_path)
    m = {k: v for k, v in blob.manifest.items() if k != "sections"}
    r = m["variants"][blob.variants.index(blob.variant)]
    r["provenance"] = {**r["provenance"], "launches": r["provenance"]["launches"][:-1]}
    data = Path(blob_path).read_bytes()
    payloads = {s["name"]: data[s["offset"]:s["offset"] + s["size"]]
                for s in blob.manifest["sections"]}
    bad = tmp_path / "bad.blob"
    bad.write_bytes(assemble(blob.target, m, payloads))
    with pytest.raises(BlobError, match="provenance.launches: expected one list per launch"):
        read_blob(bad)
    r["provenance"] = {"nodes": [["a"]], "launches": []}
    bad.write_bytes(assemble(blob.target, m, payloads))
    with pytest.raises(BlobError, match=r"provenance.nodes: expected \[name, op_type\] pairs"):
        read_blob(bad)
