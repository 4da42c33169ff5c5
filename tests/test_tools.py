import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.hand_graphs import CHAIN_N, CHAIN_W, chain_artifact, write

REPO = Path(__file__).parents[1]


def _tool(*args):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)


@pytest.fixture(scope="module")
def chain_blob(tmp_path_factory):
    return write(chain_artifact(), tmp_path_factory.mktemp("tools") / "chain.blob")


def _chain_onnx(path: Path) -> str:
    """The hand-written chain graph as ONNX: y = float(x) * w + b."""
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
         helper.make_node("Mul", ["xf", "w"], ["t"]), helper.make_node("Add", ["t", "b"], ["y"])],
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, (1, CHAIN_N)),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, (1, CHAIN_N))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, CHAIN_N))],
        [numpy_helper.from_array(CHAIN_W, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(model, path)
    return str(path)


def test_inspect_json_reports_sizes_arena_kernels_and_io(chain_blob):
    proc = _tool("tools/blobinfo.py", chain_blob, "--json")
    d = json.loads(proc.stdout)
    assert (d["arena_bytes"], d["arena_lower_bound_bytes"], d["weights_bytes"], d["kernels"]) == \
        (384, 256, CHAIN_N * 4, 2)
    assert [i["name"] for i in d["inputs"]] == ["x", "b"] and d["outputs"][0]["name"] == "y"


@pytest.mark.parametrize("tool", ["tools/blobinfo.py", "tools/run.py"])
def test_invalid_blob_gives_one_line_error_and_exit_2(tool, tmp_path):
    bad = tmp_path / "bad.blob"
    bad.write_bytes(b"KEELBLOB" + bytes(300))
    proc = _tool(tool, str(bad))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr and "format version" in proc.stderr


def test_run_check_matches_onnxruntime_on_random_inputs(chain_blob, tmp_path):
    proc = _tool("tools/run.py", chain_blob, "--bench", "20", "--check",
                 _chain_onnx(tmp_path / "chain.onnx"))
    assert proc.returncode == 0, proc.stderr
    assert "output y: float32 (1, 64)" in proc.stdout and "median" in proc.stdout
    assert "check y: max abs err 0.000e+00" in proc.stdout


def test_run_with_npz_missing_an_input_names_it(chain_blob, tmp_path):
    np.savez(tmp_path / "f.npz", x=np.zeros((1, CHAIN_N), np.uint8))
    proc = _tool("tools/run.py", chain_blob, "--inputs", str(tmp_path / "f.npz"))
    assert proc.returncode == 2 and "missing input 'b'" in proc.stderr


def test_demo_times_keel_and_onnxruntime_at_one_thread_and_at_every_core(tmp_path):
    proc = _tool("tools/demo.py", "--onnx", _chain_onnx(tmp_path / "chain.onnx"),
                 "--runs", "3", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "max abs error vs onnxruntime 0" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("latency")]
    cores = len(os.sched_getaffinity(0))
    counts = sorted({1, cores})
    assert len(rows) == len(counts)
    for row, n in zip(rows, counts):
        threads = f"{n} thread" if n == 1 else f"{n} threads"
        assert f"keel ({threads})" in row and f"onnxruntime ({threads})" in row, row


@pytest.mark.parametrize("float16", [False, True], ids=["fp32", "fp16"])
def test_roofline_bound_is_the_larger_of_compute_and_traffic_per_launch(tmp_path, float16):
    """The Adreno 630 roofline (tools/roofline.py) from a --target qcom blob, checked against
    quantities computed here from the blob itself: every launch's bound is the max of its FLOPs
    at the chip's peak and its tensors' bytes at its bandwidth, the total is their sum, and
    every weight is read at least once."""
    from compiler.blob import write_blob
    from compiler.pipeline import compile_model
    from runner.blob import read_blob
    from tests.light_net import light_net
    from tools.roofline import CHIPS, bound

    path = tmp_path / "light.blob"
    write_blob(compile_model(light_net(), target="qcom", float16=float16), path)
    blob, chip = read_blob(path), CHIPS["adreno630"]
    r = bound(blob, chip)
    peak = (chip.fp16_gflops if float16 else chip.fp32_gflops) * 1e9
    assert r["arithmetic"] == ("half" if float16 else "float")
    flops = blob.manifest["meta"]["flops"]
    rows = {x["launch"]: x for x in r["launches_by_bound"]}
    assert sorted(rows) == list(range(len(blob.launches))) and sum(flops) > 0
    for i, ln in enumerate(blob.launches):
        nbytes = sum(int(np.prod(blob.buffers[b].shape)) * blob.buffers[b].dtype.itemsize
                     for b in set(ln.args))
        want = max(flops[i] / peak, nbytes / (chip.gbps * 1e9)) * 1e6
        assert rows[i]["bytes"] == nbytes and rows[i]["bound_us"] == pytest.approx(want)
    assert r["bound_ms"] == pytest.approx(sum(x["bound_us"] for x in rows.values()) / 1e3)
    assert r["bytes_moved"] >= r["weights_bytes"] > 0


@pytest.mark.parametrize("size, n", [(8192, 256), (100, 1000)], ids=["large-source", "small"])
def test_roofline_counts_the_bytes_a_gather_can_touch(size, n):
    """A Gather touches at most one element of its data per output element: the launch counts
    n samples of a large source (a camera frame), and never more than the whole source."""
    from compiler.blob import blob_bytes
    from compiler.pipeline import compile_model
    from runner.blob import parse_blob
    from tests.graphs import make_model
    from tools.roofline import CHIPS, bound

    model = make_model([helper.make_node("Gather", ["frame", "idx"], ["y"], axis=0)],
                       [("frame", (size,), "uint8"), ("idx", (n,), "int32")],
                       [("y", (n,), "uint8")])
    blob = parse_blob(blob_bytes(compile_model(model, target="qcom")))
    ln, = blob.launches
    j = next(j for j, b in enumerate(ln.args) if blob.buffers[b].shape == (size,))
    assert blob.manifest["meta"]["gathers"] == [[[j, n]]]  # the frame's parameter, n samples
    row, = bound(blob, CHIPS["adreno630"])["launches_by_bound"]
    assert row["bytes"] == n + 4 * n + min(n, size)  # y written, idx read, the frame's samples


def test_roofline_cli_names_a_bad_blob(tmp_path):
    bad = tmp_path / "bad.blob"
    bad.write_bytes(b"not a blob")
    r = _tool("tools/roofline.py", str(bad))
    assert r.returncode == 2 and r.stderr.startswith(f"roofline: {bad}: file is 10 bytes")


def test_bench_tinygrad_says_tinygrad_is_optional_when_it_is_missing(tmp_path, monkeypatch,
                                                                     capsys):
    """tinygrad is no keel dependency: without it the tool exits 2 with one line saying so."""
    from tools import bench_tinygrad
    monkeypatch.setitem(sys.modules, "tinygrad", None)  # import tinygrad raises ImportError
    for name in ("DEV", "IMAGE", "FLOAT16", "CC"):  # the tool sets tinygrad's flags: undo them
        monkeypatch.delenv(name, raising=False)
    assert bench_tinygrad.main([_chain_onnx(tmp_path / "chain.onnx")]) == 2
    err = capsys.readouterr().err
    assert "tinygrad is not installed" in err and "optional" in err and "pip install" in err
