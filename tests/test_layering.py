"""The package's layers depend one way: every import of a project module, at module level or inside a function,
points to a lower layer or stays within its own package, and no two modules import each other, directly or through
others. docs/architecture.md draws this order; a change that needs an upward import must move the shared piece
down (or pass it in) instead."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sglang_exl3"

# Lowest first. A package may import from any package on a lower level, never from its own level or above.
LEVELS = {
    "native_paths": 0,
    "knobs": 1,
    "format": 1,
    "codec": 2,
    "kernels": 3, "synth": 3, "tools": 3,
    "runtime": 4,
    "layers": 5,
    "integration": 6,
    "cli": 7,
    "__main__": 8,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that `name` imports anywhere in its source (`from pkg import submodule` names the
    submodule)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


def test_every_package_has_a_level():
    packages = {_package(m) for m in GRAPH} - {""}
    assert packages <= set(LEVELS), f"add {sorted(packages - set(LEVELS))} to LEVELS (and to docs/architecture.md)"


def test_imports_point_down():
    upward = []
    for module, targets in GRAPH.items():
        src = _package(module)
        for target in targets:
            dst = _package(target)
            if src and dst and src != dst and LEVELS[dst] >= LEVELS[src]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not point to a lower layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_check_sees_imports_inside_functions(tmp_path):
    """The graph must include imports placed inside functions (the usual way to hide a cycle)."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from sglang_exl3.format.validate import validate_checkpoint\n")
    assert "sglang_exl3.format.validate" in _imports("sglang_exl3.format.x", src, _modules())
