"""The package structure ARCHITECTURE.md describes, enforced: every import of a
derivgen module (at module level or inside a function) points to the same stage
or one below it, and no set of modules imports itself round in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "derivgen"

# Stages, lowest first. A module may import modules of its own stage and of the
# stages listed as below it; nothing else of derivgen's.
BELOW: dict[str, set[str]] = {
    "symbolic": set(),
    "runtime": set(),
    "spec": {"symbolic"},
    "derive": {"symbolic", "spec"},
    "prove": {"symbolic", "spec", "derive"},
    "explain": {"symbolic", "spec", "derive", "prove"},
    "codegen": {"symbolic", "spec", "derive", "runtime"},
    "api": {"symbolic", "spec", "derive", "prove", "explain", "codegen", "runtime"},
    "triton": {"symbolic", "spec", "derive", "codegen", "runtime", "api"},
    "torch": {"symbolic", "spec", "derive", "codegen", "runtime", "api", "triton"},
    "jax": {"symbolic", "spec", "derive", "codegen", "runtime", "api"},
    "tools": {"symbolic", "spec", "derive", "prove", "explain", "codegen", "runtime", "api", "triton", "torch", "jax"},
    "cli": {
        *("symbolic", "spec", "derive", "prove", "explain", "codegen", "runtime", "api"),
        *("triton", "torch", "jax", "tools"),
    },
}

# modules whose stage is not their folder's
STAGE_OF_MODULE = {
    "derivgen": "api",  # the package face re-exports the API
    "derivgen.api": "api",
    "derivgen.cbind": "runtime",  # the import path the generated bindings use
    "derivgen.cli": "cli",
    "derivgen.__main__": "cli",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def stage(module: str) -> str:
    if module in STAGE_OF_MODULE:
        return STAGE_OF_MODULE[module]
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in BELOW:
        raise AssertionError(f"{module}: not in any stage; add its folder to BELOW or the module to STAGE_OF_MODULE")
    return parts[1]


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported derivgen module, line) for every import in the file, wherever it is."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "derivgen"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "derivgen":
                continue
            for a in node.names:  # `from derivgen.x import y`: y may be a module itself
                sub = f"{target}.{a.name}"
                found.append((sub if _is_module(sub) else target, node.lineno))
    return found


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel.with_suffix(".py")).is_file() or (ROOT / rel / "__init__.py").is_file()


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def graph() -> dict[str, set[str]]:
    mods = all_modules()
    edges = {}
    for m, p in mods.items():
        edges[m] = set()
        for target, _ in imports(p):
            while target not in mods and "." in target:
                target = target.rpartition(".")[0]
            if target in mods and target != m:
                edges[m].add(target)
    return edges


def test_every_module_belongs_to_a_stage():
    for m in all_modules():
        stage(m)


def test_imports_point_down_the_stages():
    wrong = []
    for m, p in all_modules().items():
        own = stage(m)
        for target, line in imports(p):
            other = stage(target) if target != "derivgen" else "api"
            if other != own and other not in BELOW[own]:
                wrong.append(f"{p.relative_to(ROOT)}:{line}: {own} imports {target} ({other})")
    assert not wrong, "imports that point up the stages:\n" + "\n".join(wrong)


def test_no_import_circles():
    edges = graph()
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    # a package face importing its own modules, which import each other only downwards, is no circle;
    # a module importing its package's face is: the face imports it back
    assert not cycles, f"import circles: {cycles}"


@pytest.mark.parametrize(
    "name",
    [
        "derivgen.spec",
        "derivgen.derive",
        "derivgen.prove",
        "derivgen.explain",
        "derivgen.codegen",
        "derivgen.runtime",
        "derivgen.symbolic",
        "derivgen.tools",
    ],
)
def test_each_stage_has_a_documented_face(name):
    path = ROOT / Path(*name.split(".")) / "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), f"{name}/__init__.py has no docstring saying what the stage does"
    assert name.split(".")[1] in (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
