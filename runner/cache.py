"""Where keel caches what it builds, and how an entry is written: one policy for every cache.

KEEL_CACHE_DIR names the root (default ~/.cache/keel). KEEL_CACHE_DIR= (empty) turns every cache
off: the compiler's (compiler/cache.py), the parsed qcom programs (qcom/store.py), the OpenCL
program binaries beside a blob (`<blob>.clcache`, runner/opencl.py and qcom/store.py), the DSP
programs (dsp/build.py), the simulators' host libraries (sim/qcom/hostcl.py) and PoCL's own
kernel cache under them (runner/cl.py; with caching on, PoCL keeps ~/.cache/pocl as it always
does). What must be a file to run at all (a DSP program, a host library, PoCL's kernels) is then
built in a private temporary folder, removed when the process exits.

Folders under the root, one per cache: the compiler's kernels/, objects/, units/ and valid/;
qcom/, dsp/, hostcl/ and tools/bench.py's bench/; the tests' onnx_backend/ and models/
(tests/onnx_backend.py, tests/graphs.py).
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

VAR = "KEEL_CACHE_DIR"
_scratch: list[str] = []  # the private folder, once made (caching off)


def root() -> Path | None:
    """The cache root, or None when caching is off."""
    d = os.environ.get(VAR)
    if d is None:
        return Path.home() / ".cache" / "keel"
    return Path(d) if d else None


def folder(name: str) -> Path | None:
    """The cache `name`'s folder (not created), or None when caching is off."""
    r = root()
    return None if r is None else r / name


def beside(blob_path) -> str | None:
    """The blob's own cache folder, `<blob>.clcache`, or None when caching is off."""
    return None if root() is None else f"{blob_path}.clcache"


def workdir(name: str) -> Path:
    """A folder for built files a run needs on disk: the cache `name`, or with caching off a
    private temporary folder of this process (removed at exit)."""
    cached = folder(name)
    if cached is not None:
        return cached
    if not _scratch:
        _scratch.append(tempfile.mkdtemp(prefix="keel-"))
        atexit.register(shutil.rmtree, _scratch[0], True)
    return Path(_scratch[0]) / name


def create(path: Path, make: Callable[[Path], None]) -> Path:
    """Make the file `path` atomically: `make` writes a temporary file in its folder, which is
    then renamed into place, so a concurrent reader sees all of it or none and the last writer
    of equal bytes wins. What `make` raises propagates (the temporary file removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        make(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def write(path: Path, data: bytes) -> bool:
    """A cache entry, written atomically (`create`). Best effort: a full or read-only disk costs
    a rebuild next time, never the run. True if written."""
    try:
        create(path, lambda tmp: tmp.write_bytes(data))
        return True
    except OSError:
        return False
