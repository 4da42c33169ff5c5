"""openpilot's metadata end to end: `output_slices` as openpilot writes it (a base64 pickle of
{name: slice} in metadata_props) compiles into plain JSON in the manifest, and the runner serves
named zero-copy views with neither pickle nor onnx. The compiler's unpickler refuses every class
but slice and dict; the runner checks the JSON it reads.
"""
import base64
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from compiler.blob import write_blob
from compiler.errors import CompileError
from compiler.onnx.metadata import output_slices
from compiler.pipeline import compile_model
from models.openpilot import make_toy
from runner import BlobError, InputError, Model
from tests.graphs import compiled_blob

OUT = [("outputs", (1, 56))]


def _b64(obj) -> str:
    return base64.encodebytes(pickle.dumps(obj)).decode()


def test_slices_reach_the_runner_without_pickle_or_onnx(tmp_path):
    blob = compiled_blob(make_toy())
    manifest = json.dumps(Model.load(blob).blob.manifest["meta"])
    assert "output_slices" in manifest and "gASV" not in manifest  # gASV: a protocol 4 pickle
    # a fresh interpreter where onnx cannot be imported and every pickle loader raises (numpy
    # itself imports the pickle module, so the module cannot simply be absent)
    code = f"""
import sys, pickle
sys.modules["onnx"] = None
def refuse(*a, **k): raise AssertionError("the runner unpickled something")
pickle.loads = pickle.load = refuse
pickle.Unpickler = refuse
import numpy as np
from runner import Model
m = Model.load({str(blob)!r}, device="cpu")
out = {{n: np.empty(s, d) for n, (s, d) in m.outputs.items()}}
views = m.output_views(out)
m.run({{n: np.full(s, 3, d) for n, (s, d) in m.inputs.items()}}, out=out)
flat = out["outputs"].reshape(-1)
for name, s in m.output_slices.items():
    assert np.shares_memory(views[name], out["outputs"]) and (views[name] == flat[s]).all()
print({{k: [s.start, s.stop, s.step] for k, s in m.output_slices.items()}})
assert "onnx" not in sys.modules or sys.modules["onnx"] is None
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "{'plan': [0, 40, 1], 'hidden_state': [40, 56, 1]}"


def test_openpilot_pickle_decodes_to_plain_json():
    s = {"plan": slice(0, 40), "lead": slice(40, None, 2), "hidden_state": slice(None, 56)}
    for protocol in (0, 2, pickle.HIGHEST_PROTOCOL):  # 0 and 2 name builtins "__builtin__"
        text = base64.encodebytes(pickle.dumps(s, protocol)).decode()
        assert output_slices(text, OUT) == {"output": "outputs", "slices": [
            ["plan", 0, 40, 1], ["lead", 40, 56, 2], ["hidden_state", 0, 56, 1]]}


class _Boom:
    """Unpickling this would call os.mkdir: the unpickler must refuse before calling it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


@pytest.mark.parametrize("obj, why", [
    ("boom", "mkdir is not allowed"),
    ({"plan": "boom"}, "mkdir is not allowed"),
    (np.arange(3), "is not allowed"),
    ([slice(0, 1)], "got list"),
    ({"plan": (0, 40)}, "'str': 'tuple'"),
    ({"plan": slice(0, 57)}, "within output 'outputs''s 56 elements"),
    ({"plan": slice(-4, None)}, "non-negative"),
    ({"plan": slice(0, 4, 0)}, "step >= 1"),
    ({"plan": slice(0.5, 4)}, "non-negative int"),
])
def test_hostile_or_wrong_slices_are_refused(tmp_path, obj, why):
    target = tmp_path / "created_by_pickle"
    boom = _Boom(str(target))
    if isinstance(obj, str):
        obj = boom
    elif isinstance(obj, dict) and obj.get("plan") == "boom":
        obj = {"plan": boom}
    with pytest.raises(CompileError, match="output_slices") as e:
        output_slices(_b64(obj), OUT)
    assert why in str(e.value)
    assert not target.exists()


def test_not_base64_or_not_a_pickle_or_several_outputs():
    with pytest.raises(CompileError, match="not base64"):
        output_slices("ünïcode", OUT)
    with pytest.raises(CompileError, match="UnpicklingError|EOFError"):
        output_slices(base64.encodebytes(b"\x80\x04junk").decode(), OUT)
    with pytest.raises(CompileError, match="one output; this model has 2 outputs"):
        output_slices(_b64({"a": slice(0, 1)}), OUT * 2)


def _with_meta(tmp_path, value) -> str:
    art = compile_model(make_toy(), target="cpu")
    art.meta["output_slices"] = value
    path = tmp_path / "bad.blob"
    write_blob(art, path)
    return str(path)


def test_runner_checks_the_slices_it_reads(tmp_path):
    path = _with_meta(tmp_path, {"output": "outputs", "slices": [["plan", 0, 57, 1]]})
    with pytest.raises(BlobError, match=r"meta.output_slices.slices\[0\].*stop <= 56"):
        Model.load(path)
    path = _with_meta(tmp_path, {"output": "nope", "slices": []})
    with pytest.raises(BlobError, match="one of \\['outputs'\\]"):
        Model.load(path)
    path = _with_meta(tmp_path, None)  # as in blobs compiled without output_slices
    art_meta = Model.load(path).meta
    assert art_meta["output_slices"] is None


def test_blob_without_slices(tmp_path):
    art = compile_model(make_toy(), target="cpu")
    del art.meta["output_slices"]
    write_blob(art, tmp_path / "plain.blob")
    m = Model.load(str(tmp_path / "plain.blob"))
    assert m.output_slices == {}
    with pytest.raises(InputError, match="no output_slices"):
        m.output_views({"outputs": np.empty((1, 56), np.float32)})

