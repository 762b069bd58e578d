"""The code-generation targets, as data: one :class:`Target` record per target.

A record says everything the rest of derivgen needs to know of a target: the templates it
renders and the files they become (under ``generated/<name>/``), what its planner adds to
the templates' context, the filters its templates print with, the specs it refuses, the
reserved words its code needs (:data:`derivgen.spec.reserved.RESERVED`), how its code spells
the elementary functions of :mod:`derivgen.symbolic.functions`, and its run-time side (the
package its modules call, what :func:`derivgen.load` does with them). :mod:`~derivgen.codegen.emit`
renders from the records; ``derivgen.api.load``, ``derivgen.tools.generate``, the CLI and
``derivgen.torch``'s registration read them. Adding a target is one record here (or
:func:`register` from anywhere) and its folder (``codegen/<name>/``: printer, planner).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Protocol

from derivgen.codegen.c import ATYPES, CTYPES, c_load, c_store, plan_kernel
from derivgen.codegen.c.names import native_names, position_names, summed_names
from derivgen.codegen.c.types import block_groups
from derivgen.codegen.ir import ModeIR, SecondIR
from derivgen.codegen.jax import jax_expr, jax_monomial, plan_jax
from derivgen.codegen.printers import SpecPrinter
from derivgen.codegen.triton import plan_triton
from derivgen.derive.first import ModeDerivation
from derivgen.derive.second import SecondOrder
from derivgen.runtime.abi import kernel_signature
from derivgen.spec.model import Spec
from derivgen.symbolic import functions
from derivgen.symbolic.functions import Elementary


class LayerDerivation(Protocol):
    """What code generation reads of a layer's derivation (``derivgen.derive``'s result)."""

    spec: Spec
    modes: Mapping[str, ModeDerivation]

    def second(self, mode: str) -> SecondOrder:
        """The second order of one mode."""

    def memo(self, key: tuple, compute: Callable[[], object]) -> object:
        """``compute()``, once per ``key`` for this derivation (the IR and the kernel plans)."""


@dataclass(frozen=True)
class Layer:
    """What a target's planner reads: the derivation, the layer's printer and its IR (each
    mode's, and its second order's by kind, "bb" and "jvp"), computed once per emit."""

    d: LayerDerivation
    printer: SpecPrinter
    irs: Mapping[str, ModeIR]
    second_irs: Mapping[str, Mapping[str, SecondIR]]

    @property
    def spec(self) -> Spec:
        """The layer's spec."""
        return self.d.spec

    @property
    def has_blocks(self) -> bool:
        """Whether a mode has block statistics (:mod:`derivgen.symbolic.block`)."""
        return has_blocks(self.d)


def has_blocks(d: LayerDerivation) -> bool:
    """Whether a mode of ``d`` has block statistics (:mod:`derivgen.symbolic.block`)."""
    return any(m.blocks for m in d.modes.values())


Printing = Callable[..., str]  # f(printer, value, *args): text, with the layer's SpecPrinter


@dataclass(frozen=True)
class Target:
    """One code-generation target.

    ``files``: (template, path) in the order they are rendered, the path relative to
    ``generated/`` with ``{name}`` for the layer's name; every path lies in the folder
    ``<name>/``. ``template_dir``: where its templates are (None: ``templates/``; the shared
    includes such as ``_api.j2`` are found there too). ``plan``: the planner, what it adds
    to the templates' context (the C kernels' plans, the Triton kernels'). ``filters`` and
    ``calls``: Jinja filters and functions that print with the layer's printer, each
    ``f(printer, value, *args)``; ``globals``: plain Jinja functions. ``multi``: it takes
    tensors, values and outputs beside y (``Spec.multi``); ``blocks``: block statistics;
    ``refuses``: any other spec it does not take, as the message (None: it takes it).
    ``reserved``: the kinds of :data:`derivgen.spec.reserved.RESERVED` its code needs.
    ``spell``: its code's spellings of a table function; ``resolves``: whether a spelling
    names something at run time (``tests/codegen/test_targets.py`` checks both over the
    table). ``package_doc``: its ``generated/<name>/__init__.py``; ``committed``: written into
    ``generated/`` by ``derivgen generate`` by default. ``loadable``: ``derivgen.load(spec,
    backend=name)`` imports its module ``module`` (a file name with ``{name}``); ``cflags``:
    it takes ``cflags=``; ``after_load(module, spec)``: what ``load`` does with the module.
    ``runtime``: the package its modules and operators run on; ``requires``: the module
    that must be importable for it to run (None: none beyond derivgen's own);
    ``dispatch``: the PyTorch dispatch key whose ``derivgen::`` forward and backward its
    ``<runtime>.ops`` implements (``forward_impl``, ``backward_impl``).
    """

    name: str
    label: str
    files: tuple[tuple[str, str], ...]
    package_doc: str
    spell: Callable[[Elementary], tuple[str, ...]]
    resolves: Callable[[str], bool]
    reserved: tuple[str, ...] = ("python",)
    template_dir: Path | None = None
    plan: Callable[[Layer], Mapping[str, object]] | None = None
    filters: Mapping[str, Printing] = field(default_factory=dict)
    calls: Mapping[str, Printing] = field(default_factory=dict)
    globals: Mapping[str, object] = field(default_factory=dict)
    multi: bool = True
    blocks: bool = True
    refuses: Callable[[LayerDerivation], str | None] | None = None
    committed: bool = True
    loadable: bool = True
    module: str = "{name}.py"
    cflags: bool = False
    after_load: Callable[[ModuleType, Spec], None] | None = None
    runtime: str = "derivgen.runtime"
    requires: str | None = None
    dispatch: str | None = None

    def __post_init__(self) -> None:
        bad = [p for _, p in self.files if not p.startswith(f"{self.name}/")]
        if bad:
            raise ValueError(f"target {self.name!r}: its files lie in {self.name}/, not {bad}")

    @property
    def folder(self) -> str:
        """Its folder in ``generated/``: its name."""
        return self.name

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The endings of the files it writes (``.py``; the C target: ``.h``, ``.c``, ``.py``)."""
        return tuple(dict.fromkeys(Path(p).suffix for _, p in self.files))

    def paths(self, layer: str) -> dict[str, str]:
        """Template -> the relative path it is written to, for the layer named ``layer``."""
        return {t: p.format(name=layer) for t, p in self.files}


# ------------------------------------------------------------------- the registry

TARGETS: dict[str, Target] = {}
"""The targets by name, in the order ``derivgen generate`` writes them and the CLI lists them."""

_listeners: list[Callable[[], None]] = []  # called on every change (emit's template environments)


def register(target: Target) -> Target:
    """Add ``target`` (a name already there is an error); returns it."""
    if target.name in TARGETS:
        raise ValueError(f"target {target.name!r} is already registered")
    TARGETS[target.name] = target
    for f in _listeners:
        f()
    return target


def unregister(name: str) -> None:
    """Remove the target ``name`` (tests that register one of their own)."""
    del TARGETS[name]
    for f in _listeners:
        f()


def on_change(f: Callable[[], None]) -> None:
    """Call ``f()`` whenever a target is registered or removed."""
    _listeners.append(f)


def get(name: str) -> Target:
    """The target ``name``; a ValueError naming the targets for another."""
    if name not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(map(repr, TARGETS))}, got {name!r}")
    return TARGETS[name]


def names(*, committed: bool | None = None, loadable: bool | None = None) -> tuple[str, ...]:
    """The targets' names in registry order; only those ``committed`` (in ``generated/``) or
    ``loadable`` (by ``derivgen.load``) where asked."""
    return tuple(
        t.name
        for t in TARGETS.values()
        if (committed is None or t.committed == committed) and (loadable is None or t.loadable == loadable)
    )


def one_of(words: list[str]) -> str:
    """'a', 'a or b', 'a, b or c' (each as its repr)."""
    quoted = [repr(w) for w in words]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def and_list(words: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


# ------------------------------------------------------------------- what the records share


def _module_has(modules: Mapping[str, str]) -> Callable[[str], bool]:
    """``resolves`` for printed code that calls ``alias.name``: the module ``modules[alias]``
    (imported when asked) has ``name``."""

    def resolves(spelling: str) -> bool:
        alias, _, attr = spelling.partition(".")
        if alias not in modules or not attr.isidentifier():
            return False
        return hasattr(importlib.import_module(modules[alias]), attr)

    return resolves


def template_dir() -> Path:
    """The directory of the Jinja templates (the source tree's, else the installed copy)."""
    src = Path(__file__).resolve().parents[2] / "templates"  # a source checkout
    if (src / "numpy.py.j2").is_file():
        return src
    return Path(__file__).resolve().parents[1] / "templates"  # installed: derivgen/templates


def _kernels_header(name: str = "derivgen-kernels.h.j2") -> str:
    """The shared C header's template (its ``Dg_`` functions), with the templates it includes."""
    text = (template_dir() / name).read_text(encoding="utf-8")
    included = re.findall(r"""{%-?\s*include\s+["']([^"']+)["']""", text)
    return "\n".join([text, *map(_kernels_header, included)])


# the C99 <math.h> functions the table's C spellings may name
C_MATH = frozenset({"sqrt", "sqrtf", "fabs", "fabsf", "fmax", "fmaxf", "fmin", "fminf", "erf", "erff", "pow", "powf"})


def _c_resolves(spelling: str) -> bool:
    """A C spelling is C text with ``{0}`` or a function of <math.h> or the shared header."""
    if "{0}" in spelling:
        return True
    if spelling in C_MATH:
        return True
    return re.search(rf"\b{re.escape(spelling)}\s*\(", _kernels_header()) is not None


# ------------------------------------------------------------------- the C target


def _c_plan(layer: Layer) -> dict[str, object]:
    """The C kernels' plans, per mode and element type (computed once per derivation), and
    the layout facts the C templates branch on."""
    spec, has_blocks = layer.spec, layer.has_blocks
    kernels = layer.d.memo(
        ("c plans",),
        lambda: {
            (m, sfx): plan_kernel(layer.printer, ir, layer.second_irs[m], ct)
            for m, ir in layer.irs.items()
            for sfx, ct in CTYPES.items()
        },
    )
    return {
        "kernels": kernels,
        "ctypes": CTYPES,
        "atypes": ATYPES,
        "per_sample": spec.reduce not in ("batch", "all"),
        # one group, the whole tensor: the first-order kernels' threads share its blocks
        "shared_group": spec.reduce == "all",
        # the tensors read at their own shape (derivgen.runtime.abi.native): a trailing layout's,
        # and those of them whose gradients the backward kernel sums per unit of rows
        "native": native_names(spec) if spec.layout == "trailing" else [],
        "native_grads": [t.name for t in spec.tensors if t.grad and t.name in native_names(spec)]
        if spec.layout == "trailing"
        else [],
        # a channel layout's per-(sample, channel) ones: read at Tn + Ch (Tn: the sample's first
        # value), their gradients summed per (sample, channel) by the parameter-gradient lanes
        # (CLoop.tensor_out); its per-position ones: read at Pi (the element's sample and position)
        "chan_native": summed_names(spec) if spec.layout != "trailing" else [],
        "pos_native": position_names(spec),
        "blocks": has_blocks,  # block statistics: no channels-last C kernels
        # the channels-last C kernels (not for block statistics, nor for reduce = "all", whose one
        # group spans the channels: the batch kernels take a group as one channel): tensor inputs
        # beside x and the outputs' cotangents are read, and the outputs beside y written, at x's
        # NHWC index
        "nhwc": spec.layout != "trailing" and spec.reduce not in ("position", "all") and not has_blocks,
    }


def _c_refuses(d: LayerDerivation) -> str | None:
    spec, blocked = d.spec, has_blocks(d)
    if spec.multi and (spec.windows or blocked or spec.reduce == "position"):
        return (
            f"{spec.source}: the C kernels take tensor inputs and outputs beside y in layouts without windows, "
            "block statistics or a position layout; this layer has one"
        )
    if blocked and spec.windows:
        return f"{spec.name}: the C kernels take block statistics or windows, not both in one layer"
    return None


SHARED_HEADER = "derivgen-kernels.h"  # no spec name has a hyphen: it cannot collide with a layer

C = Target(
    name="c",
    label="C",
    files=(
        ("kernel.h.j2", "c/{name}.h"),
        ("kernel.c.j2", "c/{name}.c"),
        ("cbinding.py.j2", "c/{name}.py"),
        ("derivgen-kernels.h.j2", f"c/{SHARED_HEADER}"),
    ),
    package_doc='"""C kernels generated by derivgen with their Python bindings: `from generated.c import layernorm`."""\n',
    spell=lambda fn: (fn.c_double, fn.c_float),
    resolves=_c_resolves,
    reserved=("python", "c", "c_library"),
    plan=_c_plan,
    globals={"cload": c_load, "cstore": c_store, "kernel_signature": kernel_signature, "block_groups": block_groups},
    refuses=_c_refuses,
    cflags=True,
)


# ------------------------------------------------------------------- the Python targets

NUMPY = Target(
    name="numpy",
    label="NumPy",
    files=(("numpy.py.j2", "numpy/{name}.py"),),
    package_doc='"""NumPy modules generated by derivgen: `from generated.numpy import layernorm`."""\n',
    spell=lambda fn: (functions.numpy_path(fn),),
    resolves=_module_has({"numpy": "numpy", "runtime": "derivgen.runtime"}),
    filters={"np": SpecPrinter.numpy, "npsum": SpecPrinter.np_sum},
    calls={"np_store": lambda printer, target, e: printer.np_store(target, e)},
)

TORCH = Target(
    name="torch",
    label="PyTorch",
    files=(("torch.py.j2", "torch/{name}.py"),),
    package_doc='"""PyTorch operations generated by derivgen (the closed forms, differentiable to any '
    'order; used by derivgen.torch). Do not edit."""\n',
    spell=lambda fn: (f"_t.{fn.name}",),
    resolves=_module_has({"_t": "derivgen.torch._target"}),
    reserved=("python", "torch_module"),
    filters={"torch": SpecPrinter.torch},
    runtime="derivgen.torch",
    requires="torch",
)

JAX = Target(
    name="jax",
    label="JAX",
    files=(("jax.py.j2", "jax/{name}.py"),),
    package_doc='"""jax.numpy functions generated by derivgen (the forward, the derived JVP and VJP; used by '
    'derivgen.jax). Do not edit."""\n',
    spell=lambda fn: (f"_j.{fn.numpy}",),
    resolves=_module_has({"_j": "derivgen.jax._target"}),
    plan=plan_jax,
    filters={
        "jax": lambda printer, e: jax_expr(e, printer.spec),
        "jaxmono": lambda printer, e: jax_monomial(e, printer.spec),
    },
    loadable=False,  # derivgen.jax.function loads it (derivgen.jax.load)
    runtime="derivgen.jax",
    requires="jax",
)


def _triton_after_load(module: ModuleType, spec: Spec) -> None:
    module.LAYER.spec = spec  # its second order runs the spec's PyTorch closed forms


TRITON = Target(
    name="triton",
    label="Triton",
    files=(("triton.py.j2", "triton/{name}.py"),),
    package_doc='"""Triton kernels generated by derivgen (forward, backward and the partial parameter sums; '
    'used by derivgen.triton). Do not edit."""\n',
    spell=lambda fn: (f"_tt.{fn.triton_name}",),
    resolves=_module_has({"_tt": "derivgen.triton._target"}),
    reserved=("python", "triton"),
    # the Triton kernels' plans, computed here like the C kernels'
    plan=lambda layer: {"tplans": {m: plan_triton(layer.spec, ir) for m, ir in layer.irs.items()}},
    blocks=False,  # its kernels have no per-block sums
    after_load=_triton_after_load,
    runtime="derivgen.triton",
    requires="triton",
    dispatch="CUDA",
)

for _t in (NUMPY, C, TORCH, JAX, TRITON):
    register(_t)
