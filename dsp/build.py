"""The DSP-side programs built from source with clang-19 and ld.lld-19 (no Hexagon SDK), once per
source and flags, in the cache's dsp/ folder (runner/cache.py):

  skel     dsp/skel.c as libkeel_dsp_skel.so, the library a cDSP user PD loads (dsp/fastrpc.py
           serves its bytes to the DSP's loader through the reverse-RPC listener);
  runtime  sim/dsp/runtime.c as a static Hexagon Linux program for qemu-hexagon
           (KEEL_FASTRPC=mock; sim/dsp/mock.py builds it with `build`).

Both share dsp/graph_runner.h (the graph, the launch table, the profile), and the blob's -mcpu
and HVX flags (runner/targets.py "dsp", which the compiler builds the blob's programs with).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from runner import cache
from runner.errors import DeviceError
from runner.targets import TARGETS

CLANG = "clang-19"
PACKAGES = {"qemu-hexagon": "qemu-user", CLANG: "clang-19", "ld.lld-19": "lld-19"}  # -> Debian
HERE = Path(__file__).parent
RUNNER = HERE.parent / "runner"
LIBC, ABI = RUNNER / "freestanding.h", RUNNER / "keel_abi.h"  # included by the programs
DSP = TARGETS["dsp"].toolchain
HVX = (*DSP.code_flags, "-O2", "-Wall", "-Werror", "-ffreestanding", "-nostdlib", *DSP.link_flags)
# the DSP's loader maps a library section by section: every section on its own 4 KiB page (what
# tinygrad found "fixes the invoke problem"), notes and the GNU hash table dropped
SECTIONS = ("text", "rela.plt", "rela.dyn", "plt", "rodata", "data", "bss", "hash", "dynamic",
            "got", "got.plt", "dynsym", "dynstr")
SKEL = (f"--target={DSP.triple}", *HVX, "-fPIC", "-shared", "-Wl,--hash-style=sysv")
SKEL_NAME = "libkeel_dsp_skel.so"


def missing(tools=tuple(PACKAGES)) -> str | None:
    """The tool that is not installed, with the Debian package that provides it, or None."""
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian package {PACKAGES[tool]})"
    return None


def skel_so() -> Path:
    """dsp/skel.c built for the cDSP: KEEL_DSP_SKEL if set (a device without clang-19 gets the
    library built elsewhere, `python -m dsp.build`), else built here."""
    given = os.environ.get("KEEL_DSP_SKEL")
    if given:
        if not Path(given).is_file():
            raise DeviceError(f"KEEL_DSP_SKEL={given!r} is not a file; expected {SKEL_NAME} "
                              f"built by `python -m dsp.build`")
        return Path(given)
    why = missing((CLANG, "ld.lld-19"))
    if why:
        raise DeviceError(f"building {SKEL_NAME} needs {why}; or build it elsewhere with "
                          f"`python -m dsp.build` and set KEEL_DSP_SKEL to its path")
    script = "SECTIONS { . = 0; " + " ".join(f".{s} : ALIGN(4096) {{ *(.{s} .{s}.*) }}"
                                             for s in SECTIONS) \
        + " /DISCARD/ : { *(.note .note.* .gnu.hash .comment) } }"
    return build("skel", HERE / "skel.c", SKEL, script=script)


def build(name: str, source: Path, flags: tuple, *extra: str, script: str = "") -> Path:
    """`source` (which may include skel.c, graph_runner.h, keel_abi.h and freestanding.h) built
    once per text and flags, into the cache's dsp/ folder (a private one with caching off)."""
    parts = (source, HERE / "skel.c", HERE / "graph_runner.h", ABI, LIBC)
    extra = (f"-I{HERE}", f"-I{RUNNER}", *extra)
    text = b"".join(p.read_bytes() for p in parts)
    key = hashlib.sha256(text + " ".join((*flags, *extra, script)).encode()).hexdigest()[:16]
    out = cache.workdir("dsp") / f"{name}-{key}"
    if not out.exists():
        cache.create(out, lambda tmp: _compile(source, flags, extra, script, tmp))
    return out


def _compile(source: Path, flags: tuple, extra: tuple, script: str, out: Path) -> None:
    ld = [f"-Wl,-T,{out}.ld"] if script else []
    if script:
        Path(f"{out}.ld").write_text(script)
    proc = subprocess.run([CLANG, *flags, *extra, *ld, str(source), "-o", str(out)],
                          capture_output=True, text=True)
    if script:
        os.unlink(f"{out}.ld")
    if proc.returncode != 0:
        raise DeviceError(f"{CLANG} failed to build {source.name}:\n{proc.stderr.strip()}")


if __name__ == "__main__":
    print(skel_so())
