"""Run a `cpu-aarch64` blob under qemu-aarch64: the comma 3X's CPU code, executed on x86 CI.

harness.c is built once into a static, libc-free aarch64 executable (no aarch64 sysroot needed);
it loads the blob's programs section itself and calls keel_graph once. `run_blob` lays the io
slots out in one file, runs the harness under qemu and reads the outputs back.

qemu's `-cpu cortex-a76` is the closest model qemu 7.2 has to the comma 3X's Kryo 385 gold cores
(Cortex-A75 derivatives, Armv8.2): the same instructions the blob is built for (-mcpu=cortex-a75)
and none of the later ones (SVE, Armv8.4+), so code the device could not run fails here too.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

from runner.blob import read_blob

QEMU, CLANG, LLD = "qemu-aarch64", "clang-19", "ld.lld-19"
OBJDUMP, READELF = "llvm-objdump-19", "llvm-readelf-19"  # for the tests' checks on the objects
PACKAGES = {QEMU: "qemu-user", CLANG: "clang-19", LLD: "lld-19", OBJDUMP: "llvm-19",
            READELF: "llvm-19"}  # tool -> Debian package
CPU = "cortex-a76"
SOURCE = Path(__file__).with_name("harness.c")
LIBC = Path(__file__).parents[2] / "runner" / "freestanding.h"  # included by SOURCE
ALIGN = 64  # io slots start on cache lines, as the runner's aligned arrays do
FLAGS = ["--target=aarch64-linux-gnu", "-mcpu=cortex-a75", "-O2", "-Wall", "-Werror",
         "-ffreestanding", "-fno-stack-protector", "-fno-pic", "-nostdlib", "-static",
         "-fuse-ld=lld"]


def missing() -> str | None:
    """The tool that is not installed, with the Debian package that provides it, or None."""
    for tool, package in PACKAGES.items():
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian package {package})"
    return None


def build_harness(out_dir: Path) -> Path:
    exe = Path(out_dir) / "harness"
    proc = subprocess.run([CLANG, *FLAGS, f"-I{LIBC.parent}", str(SOURCE), "-o", str(exe)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{CLANG} failed to build {SOURCE.name}:\n{proc.stderr}")
    return exe


def run_blob(harness: Path, blob_path: Path, feeds: dict, work: Path,
             qemu_args: tuple[str, ...] = (), threads: int = 1) -> dict[str, np.ndarray]:
    """The blob's outputs from one run under qemu (keel_graph_mt on `threads` threads if > 1)."""
    blob = read_blob(blob_path)
    ins = [np.ascontiguousarray(feeds[b.name], b.dtype).reshape(b.shape) for b in blob.inputs]
    outs = run(harness, blob.programs, blob.weights, blob.arena_bytes, ins,
               [(b.shape, b.dtype) for b in blob.outputs], work, qemu_args, threads)
    return {b.name: a for b, a in zip(blob.outputs, outs)}


def run(harness: Path, programs, weights, arena_bytes: int, inputs: list[np.ndarray],
        outputs: list[tuple], work: Path, qemu_args: tuple[str, ...] = (),
        threads: int = 1) -> list[np.ndarray]:
    """Call keel_graph in `programs` once, io slots = inputs then outputs ((shape, dtype) each).
    Output slots start as 0xff bytes (NaN for floats), so an output the code never writes cannot
    pass for a computed one."""
    work = Path(work)
    (work / "programs.so").write_bytes(programs)
    (work / "weights.bin").write_bytes(weights)
    sizes = [a.nbytes for a in inputs] + [int(np.prod(s)) * np.dtype(d).itemsize
                                          for s, d in outputs]
    offsets = np.cumsum([0] + [-(-max(n, 1) // ALIGN) * ALIGN for n in sizes])
    image = np.full(offsets[-1], 0xff, np.uint8)
    for a, off in zip(inputs, offsets):
        image[off:off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    image.tofile(work / "io.bin")
    names = ["programs.so", "weights.bin", "io.bin", "out.bin"]
    cmd = [QEMU, "-cpu", CPU, *qemu_args, str(harness), *names, str(arena_bytes), str(threads),
           *map(str, offsets[:-1])]
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"harness exit {proc.returncode} under {QEMU}: {proc.stderr.strip()}")
    out = np.fromfile(work / "out.bin", np.uint8)
    return [out[off:off + n].view(d).reshape(s).copy()
            for (s, d), off, n in zip(outputs, offsets[len(inputs):], sizes[len(inputs):])]
