"""The simulators stand apart from the on-device runtime (sim/, chosen by runner/simulators.py),
and every cache follows one policy (runner/cache.py): KEEL_CACHE_DIR= (empty) caches nothing."""
import ast
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from runner import cache
from runner.errors import ConfigError
from runner.simulators import SIMULATORS, simulator
from tests.deps import needs_tool
from tests.graphs import compiled_blob, single_node_model
from tests.test_layout import ON_DEVICE, ROOT, project_modules
from tests.test_opencl import needs_opencl

RUNTIME = "import runner, qcom.device, dsp.device, am.device, usbgpu.pci"


def _python(code: str, env: dict | None = None) -> str:
    """stdout of `code` in a fresh interpreter on this tree (it must exit 0)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_on_device_runtime_loads_no_simulator_module():
    env = {v: "" for v in SIMULATORS}
    loaded = json.loads(_python(f"import json, sys; {RUNTIME}; print(json.dumps(sorted("
                                f"sys.modules)))", env))
    assert "qcom.device" in loaded and "am.device" in loaded  # the imports did run
    assert [m for m in loaded if m.split(".")[0] == "sim"] == []


def test_the_runtime_works_without_the_sim_package_and_says_so_when_asked_for_it():
    """An on-device install leaves sim/ out: hide it, import the runtime, ask for a simulator."""
    code = f"""
import importlib.abc, sys
class NoSim(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "sim":
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, NoSim())
{RUNTIME}
from runner.errors import ConfigError
from runner.simulators import simulator
try:
    simulator("KEEL_KGSL")
except ConfigError as e:
    print(e)
"""
    out = _python(code, {"KEEL_KGSL": "mock"})
    assert "KEEL_KGSL=mock: the simulators (package `sim`) are not installed here" in out


def test_no_runtime_module_imports_a_simulator_at_import_time():
    """Top-level imports only: a simulator is reached through runner/simulators.py when its
    variable asks for it (and qcom/store.py builds mock programs once the mock KGSL is open)."""
    bad = []
    for m, p in project_modules().items():
        if m.split(".")[0] not in ON_DEVICE:
            continue
        for node in ast.parse(p.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{m} imports {n}" for n in names if n.split(".")[0] == "sim"]
    assert not bad, bad


@pytest.mark.parametrize("var", sorted(SIMULATORS))
def test_each_switch_is_the_hardware_unset_or_device_and_a_simulator_when_mock(var, monkeypatch):
    for hardware in ("", "device", " "):
        monkeypatch.setenv(var, hardware)
        assert simulator(var) is None
    monkeypatch.delenv(var)
    assert simulator(var) is None
    monkeypatch.setenv(var, "mock")
    module, name = SIMULATORS[var].split(":")
    assert simulator(var).__module__ == module and simulator(var).__name__ == name
    monkeypatch.setenv(var, "mok")
    with pytest.raises(ConfigError, match=rf"{var}='mok': expected 'mock' \(the simulator, "
                                          rf"{module}\) or unset/'device' \(the hardware\)"):
        simulator(var)


# ---- the cache policy ---------------------------------------------------------------------------
def test_the_cache_root_is_home_by_default_a_named_folder_or_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv(cache.VAR, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.root() == tmp_path / ".cache" / "keel"
    assert cache.beside("/x/m.blob") == "/x/m.blob.clcache"
    monkeypatch.setenv(cache.VAR, str(tmp_path / "c"))
    assert cache.folder("qcom") == tmp_path / "c" / "qcom" == cache.workdir("qcom")
    monkeypatch.setenv(cache.VAR, "")
    assert cache.root() is None and cache.folder("qcom") is None
    assert cache.beside("/x/m.blob") is None


def test_with_caching_off_the_work_folder_is_private_and_gone_at_exit(tmp_path):
    code = ("from runner import cache; d = cache.workdir('dsp'); d.mkdir(parents=True); "
            "(d / 'x').write_bytes(b'1'); print(d)")
    folder = _python(code, {cache.VAR: "", "HOME": str(tmp_path)}).strip()
    assert folder and not folder.startswith(str(tmp_path))
    assert not os.path.exists(folder)
    assert not os.path.exists(os.path.dirname(folder))


def test_an_entry_is_all_or_nothing(tmp_path):
    path = tmp_path / "layer" / "key"
    assert cache.write(path, b"abc") and path.read_bytes() == b"abc"

    def half_then_fail(tmp):
        tmp.write_bytes(b"ab")
        raise RuntimeError("the compiler died")
    with pytest.raises(RuntimeError, match="the compiler died"):
        cache.create(path, half_then_fail)
    assert path.read_bytes() == b"abc" and os.listdir(path.parent) == ["key"]


def test_a_cache_that_cannot_be_written_costs_only_the_entry(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    assert cache.write(tmp_path / "file" / "key", b"abc") is False  # its folder is a file


@needs_opencl
@needs_tool("clang-19", "clang-19")
def test_a_qcom_blob_on_the_simulator_writes_nothing_under_home_with_caching_off(tmp_path):
    """Float and half programs both: the mock GPU runs them on PoCL and on clang `_Float16`
    libraries, each of which keeps a cache when caching is on."""
    home, blobs = tmp_path / "home", tmp_path / "blobs"
    home.mkdir()
    blobs.mkdir()
    model = single_node_model("Mul", [([2, 8], np.float32), np.full((2, 8), 3, np.float32)])
    for half in (False, True):
        shutil.copy(compiled_blob(model, target="qcom", float16=half), blobs / f"m{half:d}.blob")
    code = """
import numpy as np, sys
from runner import Model
x = np.arange(16, dtype=np.float32).reshape(2, 8)
for p in sys.argv[1:]:
    m = Model.load(p, device="qcom")
    print(float(np.abs(m.run({"x0": x})["y"] - 3 * x).max()))
    m.close()
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(home), cache.VAR: "",
           "KEEL_KGSL": "mock"}
    env.pop("XDG_CACHE_HOME", None)
    env.pop("POCL_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", code, *map(str, sorted(blobs.iterdir()))],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # exact: 3 * x is exact in float and in half for these small integers
    assert proc.stdout.split() == ["0.0", "0.0"]
    assert list(home.rglob("*")) == []
    assert sorted(p.name for p in blobs.iterdir()) == ["m0.blob", "m1.blob"]  # no .clcache
