"""The built-in layers: the catalogue (``catalogue/*.toml``, whose code is committed in
``generated/``) and the zoo of published layers (``zoo/*.toml``, generated on demand),
found by name inside the installed package; and a spec read from a file of one's own.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from derivgen.spec.model import IDENT, Spec, SpecError
from derivgen.spec.parse import parse_spec

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


def catalogue_dir() -> Traversable:
    """The folder of the built-in layers' TOML files (inside the installed package)."""
    return resources.files("derivgen.spec") / "catalogue"


def catalogue_names() -> list[str]:
    """The names of the built-in layers, sorted."""
    return sorted(p.name[:-5] for p in catalogue_dir().iterdir() if p.name.endswith(".toml"))


def zoo_dir() -> Traversable:
    """The folder of the zoo: published layers written as specs, shipped with the package."""
    return resources.files("derivgen.spec") / "zoo"


def zoo_names() -> list[str]:
    """The names of the zoo's layers, sorted (none is also a catalogue name)."""
    return sorted(p.name[:-5] for p in zoo_dir().iterdir() if p.name.endswith(".toml"))


def load_catalogue(name: str) -> Spec:
    """The built-in layer ``name`` -- of the catalogue, else of the zoo -- parsed; SpecError
    for a name that is neither."""

    def unknown() -> SpecError:
        return SpecError(
            f"unknown layer {name!r}; the catalogue has {', '.join(catalogue_names())} "
            f"(and the zoo {len(zoo_names())} more: `derivgen list`)"
        )

    if not isinstance(name, str) or not IDENT.match(name):
        raise unknown()
    for kind, folder in (("catalogue", catalogue_dir()), ("zoo", zoo_dir())):
        res = folder / f"{name}.toml"
        if res.is_file():
            return parse_spec(res.read_text(encoding="utf-8"), source=f"{kind}/{name}.toml")
    raise unknown()


def load_spec_file(path: str | Path) -> Spec:
    """The spec in the TOML file ``path``, parsed; its source is the file's name, made safe
    to print into generated headers."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"{p}: cannot read spec: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{p}: spec is not UTF-8 text") from None
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", p.name)[:80]  # it is printed into generated headers
    return parse_spec(text, source=safe)
