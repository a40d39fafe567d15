"""Package structure rules: no import cycles, no per-architecture constants in Python."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tilegen

PACKAGE = Path(tilegen.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every tilegen module `name` imports, at any level (lazy imports inside functions too)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if is_pkg else name.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rsplit(".", 1)[0]
                base = f"{pkg}.{base}" if base else pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            # a submodule importing its own package is Python's implicit parent import
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


#: Hardware facts that must come from targets/*.toml, never from Python: architecture names,
#: and the numbers that describe one chip (warp / wave size, register files, shared memory).
ARCH_NAMES = re.compile(r"""["'](sm_90a?|sm_100a?|gfx942)["']""")
CHIP_NUMBERS = re.compile(r"(?<![\w.])(65536|232448|233472|49152|65535|2147483647)(?![\w.])")


def test_no_per_architecture_constants_in_python():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if "not a hardware fact" in line:  # a file format's number, marked as such
                continue
            if ARCH_NAMES.search(code) or CHIP_NUMBERS.search(code):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{lineno}: {line.strip()}")
    assert not offenders, "per-architecture constants in Python:\n" + "\n".join(offenders)
