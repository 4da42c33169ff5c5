"""C source -> shared object bytes for one CPU target.

One freestanding translation unit in, one shared object out, built with clang-19 (any target from
any host) or gcc (host target only, when clang-19 is missing). The object may still import
memcpy/memset that the compiler emits for large copies: the runner resolves them from the libc
already loaded in its process.

A source that carries `units` (renderers/c.py:Program: one per kernel, one for the entry points)
is built by units instead: each unit is found in a cached object (compiler/cache.py, keyed by its
name, text, the command and the compiler's version), or compiled with the other missing ones in
one batch per core (one translation unit each, whose object is cached for all of its units), and
the objects are linked. An edited model recompiles only the kernels it changed; an unchanged one
only links.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import struct
import subprocess
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from compiler import cache as disk
from compiler.errors import CompileError
from runner import abi, targets
from runner.targets import Target

CLANG = "clang-19"
GCC = "gcc"
# -ffp-contract=fast: kernels bind every value to a variable, so a*b+c spans statements;
# only "fast" lets the compiler fuse it into an FMA (one rounding instead of two).
# -fno-unroll-loops: kernels come unrolled where it pays (register tiles, reduce steps, windows);
# clang's own unrolling took a fifth of its time and sped no bench model up (docs/perf.md).
CODE_FLAGS = ("-O2", "-fno-unroll-loops", "-ffreestanding", "-fno-math-errno",
              "-ffp-contract=fast", "-fPIC")
LINK_FLAGS = ("-shared", "-nostdlib")
TIMEOUT = 1800  # seconds for one compiler process: the largest model's kernels take ~30 s
ENTRY_UNIT = abi.GRAPH  # renderers/c.py's unit of entry points; every other unit is a kernel
REPO = Path(__file__).parent.parent  # Toolchain.sources are named from here
# what clang calls for an op the Hexagon v65 has no instruction for, by that op
HELPER_OPS = {"__hexagon_adddf3": "float64 Add", "__hexagon_subdf3": "float64 Sub",
              "__hexagon_muldf3": "float64 Mul", "__hexagon_divdf3": "float64 Div",
              "__hexagon_fmadf4": "float64 multiply-add", "__hexagon_fmadf5": "float64 multiply-add"}


# the targets whose programs are C this module builds, with their triples and flags
TARGETS: dict[str, Target] = {n: t for n, t in targets.TARGETS.items() if t.toolchain}


def host_target() -> str:
    """The CPU target whose objects this machine can load."""
    for name in TARGETS:
        if can_run(name):
            return name
    raise CompileError(f"no keel CPU target for host {platform.system()}/{platform.machine()}; "
                       f"known: {sorted(TARGETS)}")


def can_run(target: str) -> bool:
    host = _target(target).host
    return host is not None and host.system == platform.system() and \
        platform.machine() in host.machines


@dataclass
class Early:
    """precompile's work: the units it compiles (their keys) and, when done, {unit key: (object
    key, object bytes)}."""
    keys: set[str]
    objects: Future
    cached: set[str]  # the keys the cache held when it started


def build_shared(source: str, target: str, early: Early | None = None) -> bytes:
    """Compile `source` (one C translation unit, or a Program with units) into a shared object
    for `target`. `early`: from precompile, objects that hold some of its units; the others
    (the entry points) compile while it runs."""
    chain = _target(target).toolchain
    units = None if chain.one_unit else getattr(source, "units", None)
    with tempfile.TemporaryDirectory(prefix="keel-cc-") as tmp:
        # relative names only: a file's name lands in its object's symbol table, keep it stable
        if not units:
            Path(tmp, "graph.c").write_text("".join([source, *map(_text, chain.sources)]))
            _run([*_command(target), "graph.c", "-o", "graph.so"], tmp, target)
            return _checked(Path(tmp, "graph.so").read_bytes(), target)
        keys = _unit_keys(units, target)
        later = [u for u in units if early and keys[u[0]] in early.keys]
        have = _objects([u for u in units if u not in later], target, tmp, {})
        if later:
            have.update(_objects(later, target, tmp, early.objects.result()))
        objs = [f"{obj}.o" for obj in dict.fromkeys(have[name] for name, _ in units)]
        _run([*_link_command(target), *_gc_flags(target), *objs, "-o", "graph.so"], tmp, target)
        return Path(tmp, "graph.so").read_bytes()


@cache
def _text(path: str) -> str:
    return (REPO / path).read_text()


def _checked(so: bytes, target: str) -> bytes:
    """`so`, once every symbol it imports is one its loader provides: on the DSP a missing one
    would only surface when the runtime loads the blob."""
    allowed = _target(target).toolchain.imports
    missing = [] if allowed is None else sorted(set(undefined_symbols(so)) - allowed)
    if missing:
        ops = ", ".join(f"{HELPER_OPS.get(s, 'an op')} (it calls {s})" for s in missing)
        hint = "; Hexagon v65 computes float64 in software: convert the model to float32" \
            if set(missing) <= set(HELPER_OPS) else ""
        raise CompileError(f"target {target!r} cannot run {ops}: the DSP runtime does not "
                           f"provide {'it' if len(missing) == 1 else 'them'}{hint}")
    return so


def undefined_symbols(so: bytes) -> list[str]:
    """The names an ELF32 little-endian shared object imports (its undefined dynamic symbols)."""
    shoff, = struct.unpack_from("<I", so, 0x20)
    shentsize, shnum = struct.unpack_from("<HH", so, 0x2e)
    sections = [struct.unpack_from("<10I", so, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, off, size, link, _, _, entsize in sections:
        if kind != 11:  # SHT_DYNSYM
            continue
        strtab = sections[link][4]
        for at in range(off + entsize, off + size, entsize):  # entry 0 is the null symbol
            name, _, _, _, _, shndx = struct.unpack_from("<3IBBH", so, at)
            if shndx == 0 and name:
                names.append(so[strtab + name:so.index(b"\0", strtab + name)].decode())
    return names


def precompile(units: list[tuple[str, str]], target: str) -> Early | None:
    """Start compiling kernel units (in a thread; the compilers are processes), so they compile
    while the caller plans and renders the entry points; build_shared takes the result. None
    where a program is one unit."""
    if _target(target).toolchain.one_unit:
        return None
    keys = set(_unit_keys(units, target).values())
    cached = {k for k in keys if _cached_object(k) is not None}
    return Early(keys, _EARLY.submit(_precompile, units, target), cached)


_EARLY = ThreadPoolExecutor(4, thread_name_prefix="keel-cc")


def _precompile(units: list[tuple[str, str]], target: str) -> dict[str, tuple[str, bytes]]:
    with tempfile.TemporaryDirectory(prefix="keel-cc-") as tmp:
        have, keys = _objects(units, target, tmp, {}), _unit_keys(units, target)
        return {keys[n]: (obj, Path(tmp, f"{obj}.o").read_bytes()) for n, obj in have.items()}


def cached_units(source: str, target: str, early: Early | None = None) -> dict[str, int]:
    """How many of the source's units build_shared compiles, and how many it has cached; those
    of `early` as the cache held them when precompile started (it may have filled it since)."""
    units = (None if _target(target).toolchain.one_unit else getattr(source, "units", None)) \
        or [("graph", source)]
    keys = _unit_keys(units, target).values()
    hit = sum(k in early.cached if early and k in early.keys else _cached_object(k) is not None
              for k in keys)
    return {"compiled": len(units) - hit, "cached": hit}


def _compile_command(target: str) -> list[str]:
    # a section per function: the link drops the kernels no entry point calls (_objects)
    return [*_command(target, link=False), "-ffunction-sections", "-c"]


def _unit_keys(units: list[tuple[str, str]], target: str) -> dict[str, str]:
    """The object cache's key per unit: its name (it lands in the object), its text, the
    command and the compiler's version."""
    tag = _tag(target)
    return {n: hashlib.sha256(tag + n.encode() + b"\0" + src.encode()).hexdigest()
            for n, src in units}


def _cached_object(unit_key: str) -> str | None:
    """The key of a cached object that holds the unit, if there is one."""
    obj = disk.get("units", unit_key)
    return obj.decode() if obj is not None and disk.has("objects", obj.decode()) else None


def _tag(target: str) -> bytes:
    """What every cached object depends on besides its source: the command, the compiler."""
    cmd = _compile_command(target)
    return repr((cmd, _cc_version(cmd[0]))).encode()


def _objects(units: list[tuple[str, str]], target: str, tmp: str,
             early: dict[str, tuple[str, bytes]]) -> dict[str, str]:
    """Object files in `tmp` that hold every unit ({unit: object key}, each in `tmp` as
    key.o): from `early` (precompile), from the cache, or compiled.

    The missing units are compiled in batches: the kernel units of one compiler process as one
    translation unit (clang pays a start-up and a front end per file: docs/perf.md). A batch's
    object is cached whole, and every unit it holds points to it (cache.py `units/`), so an
    edited model compiles one batch of the kernels it changed and links it with the old objects.
    Kernels are weak and hidden: a kernel's symbol is a hash of its text (renderers/c.py), so
    two objects that hold it hold the same code and the linker keeps one; a kernel no entry
    point calls (an old version in an old batch) is dropped by the link's section garbage
    collection (`-ffunction-sections`, `_gc_flags`).
    """
    keys, have = _unit_keys(units, target), {}
    for name, _ in units:
        hit = early.get(keys[name])  # the disk cache only for what precompile did not build
        obj, data = hit if hit else (_cached_object(keys[name]), None)
        if obj is not None and (obj in have.values() or
                                _stage(data or disk.get("objects", obj), obj, tmp)):
            have[name] = obj
    missing = [(name, src) for name, src in units if name not in have]
    kernels = [u for u in missing if u[0] != ENTRY_UNIT]
    # the entry points stay a unit of their own (a kernel beside them would be inlined into
    # them), compiled by the last process: it starts with their size
    entry = [(src, [(name, src)]) for name, src in missing if name == ENTRY_UNIT]
    shares = [[0, []] for _ in range(max(1, min(compile_jobs(), len(kernels))))]
    shares[-1][0] = sum(len(src) for src, _ in entry)
    for unit in sorted(kernels, key=lambda u: -len(u[1])):  # largest first, onto the lightest
        share = min(shares, key=lambda s: s[0])
        share[0] += len(unit[1])
        share[1].append(unit)
    batches = [(_batch_source(held), held) for _, held in shares if held] + entry
    tag = _tag(target)
    objs = [(hashlib.sha256(tag + text.encode()).hexdigest()[:40], text, held)
            for text, held in batches]
    for obj, text, _ in objs:
        Path(tmp, f"{obj}.c").write_text(text)
    # a compiler process per kernel batch, the entry unit with the last one
    files = [[f"{obj}.c"] for obj, _, held in objs if held[0][0] != ENTRY_UNIT] or [[]]
    files[-1] += [f"{obj}.c" for obj, _, held in objs if held[0][0] == ENTRY_UNIT]
    _compile_all([[*_compile_command(target), *f] for f in files if f], tmp, target)
    for obj, _, held in objs:
        disk.put("objects", obj, Path(tmp, f"{obj}.o").read_bytes())
        for name, _ in held:
            disk.put("units", keys[name], obj.encode())
            have[name] = obj
    return have


def _stage(data: bytes | None, obj: str, tmp: str) -> bool:
    """Write a cached object into `tmp`; False when it could not be read (its units recompile)."""
    if data is not None:
        Path(tmp, f"{obj}.o").write_bytes(data)
    return data is not None


def _gc_flags(target: str) -> list[str]:
    """The linker's flag that drops sections nothing reaches (a kernel no entry point calls)."""
    host = _target(target).host
    return ["-Wl,-dead_strip" if host and host.system == "Darwin" else "-Wl,--gc-sections"]


def _batch_source(units: list[tuple[str, str]]) -> str:
    """Kernel units as one translation unit, each kernel weak and hidden (_objects)."""
    return "".join(f"#pragma weak {name}\n#pragma GCC visibility push(hidden)\n{src}\n"
                   f"#pragma GCC visibility pop\n" for name, src in units)


def _compile_all(cmds: list[list[str]], cwd: str, target: str) -> None:
    procs = [subprocess.Popen(c, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    errors = []
    for p in procs:  # every process is waited for, so none outlives the temporary folder
        try:
            _wait(p, target)
        except CompileError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def _run(cmd: list[str], cwd: str, target: str) -> None:
    _wait(subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True), target)


def _wait(proc: subprocess.Popen, target: str) -> None:
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise CompileError(f"{proc.args[0]} took over {TIMEOUT} s for target {target!r}") from None
    if proc.returncode != 0:
        raise CompileError(f"{proc.args[0]} failed for target {target!r} (exit {proc.returncode}):\n"
                           f"{err.strip()}")


@cache
def _cc_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout


def compile_jobs() -> int:
    """Processes a compile may run at once (kernel builders, clang): KEEL_COMPILE_JOBS, or one
    per core this process may use."""
    text = os.environ.get("KEEL_COMPILE_JOBS", "")
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)


def _target(target: str) -> Target:
    if target not in TARGETS:
        raise CompileError(f"unknown CPU target {target!r}; expected one of {sorted(TARGETS)}")
    return TARGETS[target]


def _command(target: str, link: bool = True) -> list[str]:
    """The compiler command for `target`: compile and link in one go, or (link=False) compile."""
    t = _target(target).toolchain
    if shutil.which(CLANG):
        tail = (*LINK_FLAGS, *t.link_flags) if link else ()
        return [CLANG, f"--target={t.triple}", *t.code_flags, *CODE_FLAGS, *tail]
    if shutil.which(GCC) and target == host_target():
        return [GCC, *t.code_flags, *CODE_FLAGS, *(LINK_FLAGS if link else ())]
    raise CompileError(f"{CLANG} not found; the {GCC} fallback only builds for the host target "
                       f"{host_target()!r}, got {target!r}")


def _link_command(target: str) -> list[str]:
    cc, t = _command(target, link=False)[0], _target(target).toolchain
    if cc == CLANG:
        return [CLANG, f"--target={t.triple}", *LINK_FLAGS, *t.link_flags]
    return [GCC, *LINK_FLAGS]


LLD = "ld.lld-19"
# The OpenCL C the code object was compiled from rides along as a loaded, exported constant: the
# mock GPU's command processor (sim/am/mock_gpu.py) finds it through the dynamic symbol table in GPU
# memory, as it finds kernels, and runs it on PoCL. A real GPU never reads it (it costs its size in VRAM).
SOURCE_SYMBOL = "keel_source"
# -nogpulib: no ROCm device library; the program defines the builtins it calls (renderers/amdgcn.py)
GPU_FLAGS = ("-x", "cl", "-cl-std=CL1.2", "-nogpulib", "-O2", "-ffp-contract=fast")


def build_code_object(source: str, arch: str) -> bytes:
    """OpenCL C -> one HSA code object (an ELF shared object) for AMD GPU `arch` (gfx1100):
    clang-19 compiles, ld.lld-19 links."""
    steps = [[CLANG, "-target", "amdgcn-amd-amdhsa", f"-mcpu={arch}", *GPU_FLAGS, "-c",
              "graph.cl", "-o", "graph.o"],
             [LLD, "-shared", "graph.o", "-o", "graph.hsaco"]]
    with tempfile.TemporaryDirectory(prefix="keel-amd-") as tmp:
        Path(tmp, "graph.cl").write_text(source + _source_constant(source))
        for cmd in steps:
            if not shutil.which(cmd[0]):
                raise CompileError(f"{cmd[0]} not found; target {arch!r} needs clang-19 and "
                                   f"lld-19 (apt-get install clang-19 lld-19)")
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
            if proc.returncode != 0:
                raise CompileError(f"{cmd[0]} failed for {arch} (exit {proc.returncode}):\n"
                                   f"{proc.stderr.strip()}")
        return Path(tmp, "graph.hsaco").read_bytes()


def _source_constant(source: str) -> str:
    """`source` as an exported __constant char array, one string literal per line (octal
    escapes for quotes, backslashes, '?' (trigraphs) and anything not printable ASCII)."""
    def lit(line: str) -> str:
        return '"' + "".join(c if " " <= c <= "~" and c not in '"\\?' else f"\\{ord(c):03o}"
                             for c in line) + '"'
    body = "\n".join(lit(line) for line in source.encode().decode("latin-1").splitlines(True))
    return (f"\n__attribute__((visibility(\"protected\"))) __constant char {SOURCE_SYMBOL}[] =\n"
            f"{body or chr(34) * 2};\n")
