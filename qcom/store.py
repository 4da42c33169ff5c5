"""Where the qcom device's programs come from: built (the mock's source "binaries", or the vendor
compiler through qcom/vendor.py), cached, or embedded in the blob.

The cache holds the parsed programs (JSON), keyed by compiler kind, chip id, driver version and
source, in the blob's `.clcache` folder or, without one, in the cache's qcom/ folder
(runner/cache.py: ~/.cache/keel/qcom; KEEL_CACHE_DIR= turns both off). A blob compiled with
`tools/compile.py --target qcom --embed-binaries` carries them in its binaries section
(runner/format.py pack_binaries, checked by runner/blob.py); programs built for another chip,
driver or source are rebuilt once, with a warning naming both.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

from qcom.program import ParamKind, Program, Regs
from runner import cache
from runner.format import pack_binaries

CACHE_FORMAT = "qcom-programs-2"  # bump when Program's fields change


def build(source: str, compiler: str) -> dict[str, Program]:
    if compiler == "mock":  # the mock KGSL's programs: only KEEL_KGSL=mock opens that driver
        from sim.qcom.program import mock_build
        return mock_build(source)
    from qcom import vendor  # libOpenCL: on a device, on a cache miss
    return vendor.build(source)


def to_json(p: Program) -> dict:
    return p._replace(binary=p.binary.hex())._asdict()


def from_json(d: dict) -> Program:
    """A cached Program; ValueError/KeyError/TypeError for an entry of another shape."""
    return _program({k: v for k, v in d.items() if k != "binary"}, bytes.fromhex(d["binary"]))


def _program(facts: dict, binary: bytes) -> Program:
    p = Program(binary=binary, **facts)
    regs = Regs(*p.regs)
    offsets = tuple(None if o is None else int(o) for o in p.offsets)
    if len(offsets) != len(p.params):
        raise ValueError("cached program's parameters and offsets disagree")
    params = tuple(map(ParamKind, p.params))  # ValueError for another kind
    return p._replace(params=params, offsets=offsets,
                      regs=regs, imms=tuple(tuple(map(int, x)) for x in p.imms))


def cache_path(compiler: str, chip_id: int, driver: str, source: str,
               cache_dir: str | None) -> Path | None:
    """Where the parsed programs are cached; None with caching off, and for mock programs
    without a blob folder."""
    folder = Path(cache_dir) if cache_dir else None if compiler == "mock" else cache.folder("qcom")
    if folder is None:
        return None
    key = hashlib.sha256("\0".join([CACHE_FORMAT, compiler, f"{chip_id:#x}", driver,
                                    source]).encode())
    return folder / f"qcom-{key.hexdigest()[:32]}.json"


def load(source: str, compiler: str, chip_id: int, driver: str, cache_dir: str | None):
    """Programs by kernel name, from the cache when its key (chip, driver, source) matches."""
    path = cache_path(compiler, chip_id, driver, source, cache_dir)
    if path is not None and path.exists():
        try:
            return {name: from_json(d) for name, d in json.loads(path.read_text()).items()}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or stale: rebuilt below
    progs = build(source, compiler)
    if path is None:
        return progs
    cache.write(path, json.dumps({n: to_json(p) for n, p in progs.items()}).encode())
    return progs


# ---- binaries embedded in the blob (tools/compile.py --embed-binaries; docs/blob.md) ----------
def embedded(source: str, compiler: str, chip_id: int, driver: str) -> bytes:
    """The binaries section holding this device's parsed programs for `source`."""
    progs = load(source, compiler, chip_id, driver, None)
    device = {"compiler": compiler, "chip_id": chip_id, "driver": driver,
              "source_sha256": hashlib.sha256(source.encode()).hexdigest()}
    return pack_binaries(device, {n: ({k: v for k, v in to_json(p).items() if k != "binary"},
                                      p.binary) for n, p in progs.items()})


def embed_here(source: str) -> bytes:
    """`embedded` for the KGSL device of this machine (KEEL_KGSL selects the mock)."""
    from qcom import kgsl
    k = kgsl.Kgsl()
    try:
        return embedded(source, *identity(k))
    finally:
        k.close()


def from_blob(binaries, source: str, compiler: str, chip_id: int, driver: str,
              cache_dir: str | None) -> dict[str, Program]:
    """The blob's own programs (`binaries`: runner/blob.py Binaries, checked as read) when they
    were built by this compiler, chip and driver from this source; otherwise `load` (built
    once, then cached), with a warning naming both when the blob carried binaries for another
    device."""
    if binaries is not None:
        d = binaries.device
        have = (d["compiler"], d["chip_id"], d["driver"])
        if have == (compiler, chip_id, driver) and \
                d["source_sha256"] == hashlib.sha256(source.encode()).hexdigest():
            return {n: _program({k: v for k, v in facts.items() if k not in ("at", "size")},
                                bytes(data)) for n, (facts, data) in binaries.programs.items()}
        warnings.warn(f"qcom: the blob's binaries were built by {_who(*have)}, this device is "
                      f"{_who(compiler, chip_id, driver)} (or the source differs): building "
                      f"them once here (cached)", stacklevel=3)
    return load(source, compiler, chip_id, driver, cache_dir)


def identity(kgsl) -> tuple[str, int, str]:
    """(compiler kind, chip id, driver version) of an open Kgsl: what programs are bound to.
    Refuses unvalidated chips."""
    info, v = kgsl.check_chip(), kgsl.version()
    return (getattr(kgsl.driver, "compiler", "vendor"), info.chip_id,
            f"{v.drv_major}.{v.drv_minor}/{v.dev_major}.{v.dev_minor}")


def _who(compiler, chip_id, driver) -> str:
    return f"{compiler} compiler, chip {chip_id:#010x}, driver {driver}"
