"""`pip install .` gives working commands and an importable onnx.backend: keel is built and
installed into a temporary folder (offline: --no-deps --no-build-isolation, the dependencies
are this environment's), and the installed commands run from outside the checkout."""
from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from tests.graphs import make_model

# building and installing keel: ~20 s of pip on 2 cores
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent

def _sources() -> list[str]:
    """What a build reads: the metadata files and every package setup.cfg includes."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    packages = cfg["options.packages.find"]["include"].replace("*", "").split(",")
    return ["setup.cfg", "pyproject.toml", "README.md"] + [p.strip() for p in packages]


COMMANDS = ["keel-compile", "keel-run", "keel-blobinfo", "keel-profile", "keel-bisect",
            "keel-soak", "keel-modeld", "keel-roofline"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(prefix the package is installed in, the environment that imports from it)."""
    prefix = tmp_path_factory.mktemp("site")
    source = tmp_path_factory.mktemp("source")  # a copy: a build writes build/ and egg-info
    for name in _sources():
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--no-build-isolation", "--no-index", "--target", prefix, source],
                          capture_output=True, text=True, timeout=600, cwd=source)
    assert proc.returncode == 0, proc.stderr
    env = {**os.environ, "PYTHONPATH": str(prefix),
           "PATH": f"{prefix / 'bin'}:{os.environ['PATH']}"}
    return prefix, env


def _run(args, env, cwd):
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_every_command_is_installed_and_imports_the_installed_package(installed, tmp_path):
    prefix, env = installed
    for cmd in COMMANDS:
        assert (prefix / "bin" / cmd).is_file(), cmd
        proc = _run([cmd, "--help"], env, tmp_path)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (cmd, proc.stderr)
    where = _run([sys.executable, "-c", "import compiler, runner, tools, keel.backend; "
                  "print(compiler.__file__, runner.__file__, tools.__file__, keel.__file__)"],
                 env, tmp_path)
    assert where.returncode == 0, where.stderr
    assert all(Path(p).is_relative_to(prefix) for p in where.stdout.split()), where.stdout


def test_installed_commands_compile_run_and_inspect_a_model(installed, tmp_path):
    _, env = installed
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [("x", (2, 8), np.float32)],
                       [("y", (2, 8), np.float32)])
    onnx.save(model, tmp_path / "relu.onnx")
    compiled = _run(["keel-compile", "relu.onnx", "-o", "relu.blob", "--target", "cpu-avx2"],
                    env, tmp_path)
    assert compiled.returncode == 0 and "wrote relu.blob" in compiled.stdout, compiled.stderr
    ran = _run(["keel-run", "relu.blob", "--check", "relu.onnx"], env, tmp_path)
    assert ran.returncode == 0 and "check y: max abs err 0.000e+00" in ran.stdout, ran.stderr
    info = _run(["keel-blobinfo", "relu.blob", "--json"], env, tmp_path)
    assert info.returncode == 0 and '"target": "cpu-avx2"' in info.stdout, info.stderr
    bad = _run(["keel-run", "missing.blob"], env, tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_installed_backend_runs_a_model_like_onnxruntime_backend(installed, tmp_path):
    _, env = installed
    code = ("import numpy as np, onnx, keel.backend as backend\n"
            "from onnx import helper\n"
            "node = helper.make_node('Add', ['a', 'b'], ['c'])\n"
            "a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)\n"
            "print(backend.supports_device('CPU'), backend.run_node(node, [a, b])[0].tolist())\n")
    proc = _run([sys.executable, "-c", code], {**env, "KEEL_CACHE_DIR": str(tmp_path)}, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(" ", 1) == ["True", "[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]\n"]
