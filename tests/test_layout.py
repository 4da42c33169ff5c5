"""The tree's shape: no import cycle among the project's modules, the on-device runtime (runner/
and the device backends) stands alone, and compiler/ keeps files and functions short enough to
read in one sitting."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compiler", "runner", "tools", "models", "qcom", "dsp", "am", "usbgpu", "sim")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(tree: ast.AST, name: str, is_package: bool, known) -> set[str]:
    """Project modules that the module `name` imports anywhere (function-level imports too).
    `from a.b import c` is an edge to a.b.c when that is a module, else to a.b."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".")[:len(name.split(".")) - node.level + is_package]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {m: imports_of(ast.parse(p.read_text()), m, p.name == "__init__.py", mods)
            for m, p in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (depth-first search, colouring)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None
    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_imports_resolve_submodules_and_relative_imports():
    known = {"p", "p.q", "p.r"}
    tree = ast.parse("from p import q, x\nfrom . import r\ndef f():\n    import p.r\n")
    assert imports_of(tree, "p.s", False, known) == {"p", "p.q", "p.r"}


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph()
    assert len(graph) > 50 and graph["compiler.pipeline"], "the walk found too few modules"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_import_cycle_among_the_compilers_packages():
    """The stages import forward only (onnx, schedule, codegen, link...): compiler.X.* -> X, with
    TYPE_CHECKING imports counted like any other (ast.walk sees them)."""
    def package(m: str) -> str:
        return ".".join(m.split(".")[:2])
    graph: dict[str, set[str]] = {}
    for m, deps in import_graph().items():
        if m.startswith("compiler."):
            graph.setdefault(package(m), set()).update(
                package(d) for d in deps if d.startswith("compiler.") and package(d) != package(m))
    assert {"compiler.schedule", "compiler.codegen", "compiler.link"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


ON_DEVICE = ("runner", "qcom", "dsp", "am", "usbgpu")  # the runtime and its device backends


def test_the_on_device_runtime_never_imports_the_compiler_or_onnx():
    bad = []
    for m, p in project_modules().items():
        if m.split(".")[0] not in ON_DEVICE:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{m} imports {n}" for n in names if n.split(".")[0] in ("compiler", "onnx")]
    assert not bad, bad


def too_long(source: str, where: str) -> list[str]:
    """Why `source` is too long to read in one sitting: the file, or one of its functions
    (methods and nested functions included; decorators not counted)."""
    out = []
    if source.count("\n") > MAX_FILE_LINES:
        out.append(f"{where}: {source.count(chr(10))} lines > {MAX_FILE_LINES}")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out.append(f"{where}:{node.lineno} {node.name}: {n} lines > {MAX_FUNCTION_LINES}")
    return out


def test_the_length_check_catches_a_long_function_and_a_long_file():
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    assert too_long(f"def f():\n{body}", "f.py") == ["f.py:1 f: 61 lines > 60"]
    assert too_long(f"def f():\n{body[:-len('    x59 = 59')-1]}", "f.py") == []
    assert too_long("x = 1\n" * 501, "big.py") == ["big.py: 501 lines > 500"]


def test_compiler_files_and_functions_are_short():
    paths = sorted((ROOT / "compiler").rglob("*.py"))
    assert len(paths) > 30
    bad = [msg for p in paths for msg in too_long(p.read_text(), str(p.relative_to(ROOT)))]
    assert not bad, "\n".join(bad)


def test_the_c_entry_abi_is_declared_once_and_included_everywhere_else():
    """The generated programs, the runner's cffi declaration, the DSP-side programs and the qemu
    harness share runner/keel_abi.h: a field missing in one copy would read another's memory
    (the harness once lacked the deadline fields), so there are no copies."""
    from compiler.renderers.c import TICKS
    from runner.abi import declarations
    sources = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".c", ".h") and
               ".git" not in p.parts and p.name != "keel_abi.h" and p.name != "test_layout.py"]
    declaring = [str(p.relative_to(ROOT)) for p in sources if "} keel_sync;" in p.read_text()]
    assert declaring == []
    assert declarations() in TICKS
    for user in ("dsp/graph_runner.h", "tests/aarch64/harness.c"):
        assert '#include "keel_abi.h"' in (ROOT / user).read_text(), user
