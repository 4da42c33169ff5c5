"""The DSP-side programs built from source with clang-19 and ld.lld-19 (no Hexagon SDK), once per
source and flags, in a per-user temp cache:

  runtime  dsp/runtime.c as a static Hexagon Linux program for qemu-hexagon (KEEL_FASTRPC=mock);
  skel     dsp/skel.c as libkeel_dsp_skel.so, the library a cDSP user PD loads (dsp/fastrpc.py
           serves its bytes to the DSP's loader through the reverse-RPC listener).

Both share dsp/graph_runner.h (the graph, the launch table, the profile). The runner never
imports the compiler, so the blob's -mcpu and HVX flags (compiler/toolchain.py "dsp") are
repeated here.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from runner.errors import DeviceError

CLANG = "clang-19"
PACKAGES = {"qemu-hexagon": "qemu-user", CLANG: "clang-19", "ld.lld-19": "lld-19"}  # -> Debian
HERE = Path(__file__).parent
LIBC = HERE.parent / "runner" / "freestanding.h"  # included by runtime.c
HVX = ("-mcpu=hexagonv65", "-mhvx", "-mhvx-length=128b", "-O2", "-Wall", "-Werror",
       "-ffreestanding", "-nostdlib", "-fuse-ld=lld")
# KEEL_QEMU: per-kernel costs from qemu's packet and HVX counters instead of the cycle counter
RUNTIME = ("--target=hexagon-unknown-linux-musl", *HVX, "-static", "-DKEEL_QEMU")
# the DSP's loader maps a library section by section: every section on its own 4 KiB page (what
# tinygrad found "fixes the invoke problem"), notes and the GNU hash table dropped; -G0: no
# small-data (GP-relative) section, which a position-independent library cannot use
SECTIONS = ("text", "rela.plt", "rela.dyn", "plt", "rodata", "data", "bss", "hash", "dynamic",
            "got", "got.plt", "dynsym", "dynstr")
SKEL = ("--target=hexagon-unknown-none-elf", *HVX, "-G0", "-fPIC", "-shared",
        "-Wl,--hash-style=sysv")
SKEL_NAME = "libkeel_dsp_skel.so"
# linked into every programs library by the compiler (compiler/toolchain.py, target "dsp"): the
# square roots v65 has no instruction for
MATH = HERE / "math.c"
# everything a programs library may import: the DSP's C library has these, and dsp/runtime.c's
# LIBC table provides them under qemu (tests/test_dsp_math.py checks that the two agree). The
# compiler refuses a library that imports anything else, naming the op (compiler/toolchain.py).
IMPORTS = frozenset({"memcpy", "memmove", "memset", "__hexagon_udivsi3", "__hexagon_umodsi3",
                     "__hexagon_divsi3", "__hexagon_modsi3", "__hexagon_udivdi3",
                     "__hexagon_umoddi3", "__hexagon_divdi3", "__hexagon_moddi3"})


def missing(tools=tuple(PACKAGES)) -> str | None:
    """The tool that is not installed, with the Debian package that provides it, or None."""
    for tool in tools:
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian package {PACKAGES[tool]})"
    return None


def runtime_elf() -> Path:
    """dsp/runtime.c built for qemu-hexagon."""
    why = missing()
    if why:
        raise DeviceError(f"KEEL_FASTRPC=mock needs {why}")
    return _build("runtime", HERE / "runtime.c", RUNTIME, f"-I{LIBC.parent}")


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
    return _build("skel", HERE / "skel.c", SKEL, script=script)


def _build(name: str, source: Path, flags: tuple, *extra: str, script: str = "") -> Path:
    parts = (source, HERE / "skel.c", HERE / "graph_runner.h", LIBC)  # runtime.c includes all
    text = b"".join(p.read_bytes() for p in parts)
    key = hashlib.sha256(text + " ".join((*flags, *extra, script)).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir(), f"keel-dsp-{os.getuid()}", f"{name}-{key}")
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}")
    ld = [f"-Wl,-T,{tmp}.ld"] if script else []
    if script:
        Path(f"{tmp}.ld").write_text(script)
    proc = subprocess.run([CLANG, *flags, *extra, *ld, str(source), "-o", str(tmp)],
                          capture_output=True, text=True)
    if script:
        os.unlink(f"{tmp}.ld")
    if proc.returncode != 0:
        raise DeviceError(f"{CLANG} failed to build {source.name}:\n{proc.stderr.strip()}")
    os.replace(tmp, out)  # atomic: a concurrent load sees the whole program or none
    return out


if __name__ == "__main__":
    print(skel_so())
