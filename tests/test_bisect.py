"""tools/bisect.py on real networks: onnx's light SqueezeNet (105 nodes, IR version 3) and the
tools' light net (tests/light_net.py, against a compiled blob). No divergence as compiled, and
with one middle node perturbed the tool names exactly that node, on CPU and on OpenCL. Each case
compiles one debug build (every node output exported), ~5-10 s."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.deps import needs, opencl_missing
from tests.graphs import compiled_blob
from tests.light_net import light_net
from tools import bisect

TOOL = str(Path(__file__).resolve().parent.parent / "tools" / "bisect.py")
SQUEEZENET = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / "light_squeezenet.onnx"


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bisect") / "light.onnx"
    onnx.save(light_net(), str(path))
    return path


def middle(model: onnx.ModelProto, op_type: str) -> str:
    """A node of `op_type` near the middle of the graph, so nodes both before and after it are
    compared."""
    nodes = [(i, n) for i, n in enumerate(model.graph.node) if n.op_type == op_type]
    i, n = min(nodes, key=lambda p: abs(p[0] - len(model.graph.node) // 2))
    assert 0 < i < len(model.graph.node) - 3
    return bisect.node_name(n, i)


def test_a_faithful_build_has_no_divergence(model_file):
    blob = compiled_blob(onnx.load(str(model_file)))
    out = subprocess.run([sys.executable, TOOL, str(model_file), str(blob),
                          "--json"], capture_output=True, text=True, check=True).stdout
    rep = json.loads(out)
    assert rep["first_divergence"] is None
    assert rep["nodes_compared"] == len(onnx.load(str(model_file)).graph.node)
    assert rep["blob_outputs_diverge"] == []
    assert all(r["max_abs_err"] is not None and not r["diverges"] for r in rep["nodes"])


def test_a_real_network_compiled_faithfully_has_no_divergence():
    rep = bisect.bisect(str(SQUEEZENET), "cpu")
    assert rep["first_divergence"] is None
    assert rep["nodes_compared"] == len(onnx.load(str(SQUEEZENET)).graph.node)


def test_perturbing_a_middle_node_on_cpu_names_exactly_that_node():
    model = onnx.load(str(SQUEEZENET))
    op_type = "Conv"
    node = middle(model, op_type)
    rep = bisect.bisect(str(SQUEEZENET), "cpu", perturb=node)
    first = rep["first_divergence"]
    assert first["node"] == node and first["op_type"] == op_type
    launch, kernel = first["kernel"].split()  # "<launch index> <kernel name>"
    assert launch.isdigit() and kernel.startswith(f"k{launch}_")
    # the perturbation is 1% of the tensor's scale: far above the float32 tolerance
    assert first["max_abs_err"] > 1e-3
    # every node before it in execution order matches
    names = [r["node"] for r in rep["nodes"]]
    assert not any(r["diverges"] for r in rep["nodes"][:names.index(node)])


@needs("pocl-opencl-icd", opencl_missing())
def test_perturbing_a_middle_node_on_opencl_names_exactly_that_node(capsys):
    model = onnx.load(str(SQUEEZENET))
    node = middle(model, "Conv")
    rep = bisect.bisect(str(SQUEEZENET), "opencl", perturb=node)
    assert rep["first_divergence"]["node"] == node
    bisect.print_text(rep)
    assert f"first divergence: node {node!r} (Conv)" in capsys.readouterr().out


def test_an_unknown_node_to_perturb_is_a_clear_error(model_file):
    r = subprocess.run([sys.executable, TOOL, str(model_file), "cpu", "--perturb",
                        "no_such_node"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "--perturb no_such_node: no such node" in r.stderr


def test_the_comparison_tolerates_rounding_but_not_a_lost_term():
    ref = np.linspace(-3, 3, 64, dtype=np.float32)
    assert not bisect.error(ref * np.float32(1 + 1e-6), ref)[1]
    wrong = ref.copy()
    wrong[5] += ref[6]
    assert bisect.error(wrong, ref)[1]
    assert bisect.error(np.array([1, 2], np.int32), np.array([1, 3], np.int32))[1]
    nan = np.array([np.nan, 1], np.float32)
    assert not bisect.error(nan, nan)[1] and bisect.error(nan, np.ones(2, np.float32))[1]
