"""The C target's layout: its package split by concern with imports one way, one naming
table of element loads, and templates that read names from the plan."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import ROOT

from derivgen.api import load_spec
from derivgen.codegen.c import ATYPES, CTYPES, c_load, c_store, plan_kernel  # noqa: F401  (the face emit reads)
from derivgen.codegen.c.names import X, load_table

PACKAGE = ROOT / "derivgen" / "codegen" / "c"
# the modules in the order they may import each other: each imports only those before it
ORDER = ["ctext", "types", "floats", "names", "blocks", "hoist", "layouts", "windows", "sweep", "second", "plan"]
C_TEMPLATES = [
    "kernel.c.j2",
    "kernel.h.j2",
    "derivgen-kernels.h.j2",
    "_nhwc.j2",
    "_position.j2",
    *sorted(p.name for p in (ROOT / "templates").glob("_c_*.j2")),
]


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("derivgen.codegen.c."):
            out.add(node.module.rsplit(".", 1)[1])
    return out


def test_modules_import_one_way_and_stay_small():
    assert sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__") == sorted(ORDER)
    for k, name in enumerate(ORDER):
        path = PACKAGE / f"{name}.py"
        assert _imports(path) <= set(ORDER[:k]), name
        assert len(path.read_text().splitlines()) <= 600, name


@pytest.mark.parametrize("name", C_TEMPLATES)
def test_templates_stay_small_and_name_no_load(name):
    text = (ROOT / "templates" / name).read_text()
    assert len(text.splitlines()) <= 600
    assert not re.search(r"\bXv\b", text), "x's local name comes from the plan (GroupSelect.x)"
    assert "cplan" not in text


def test_one_naming_table():
    # the element loads' names are spelled in names.py only
    for path in PACKAGE.glob("*.py"):
        if path.stem != "names":
            assert '"Xv"' not in path.read_text() and '"Dyv"' not in path.read_text(), path.name
    spec = load_spec("layernorm")
    table = load_table(spec, [])
    assert table["x"].local == X and table["x"].line("float", "float") == "const float Xv = x[Idx];"
    assert [n for n, ld in table.items() if ld.index == "Ch"] == [p.name for p in spec.params if not p.scalar]
