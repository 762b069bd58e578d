"""Emit code from derivations: one IR per mode, one Jinja template per target.

A layer's derivation (plain data: its spec and per-mode derivations) becomes the
IR of :mod:`derivgen.codegen.ir`, and every C kernel's plan (:mod:`derivgen.codegen.c.plan`) is
computed once, before rendering; the templates receive plain data and only lay
out text. Expressions are printed by one :class:`derivgen.codegen.printers.SpecPrinter`
per layer. Every name the generated code makes is in derivgen's own namespace
(see :mod:`derivgen.symbolic.naming`).
"""

from __future__ import annotations

import functools
import pprint
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import jinja2

from derivgen.codegen.c import ATYPES, CTYPES, c_load, c_store, plan_kernel
from derivgen.codegen.ir import ModeIR, build_mode_ir, build_second_ir
from derivgen.codegen.jax import jax_expr
from derivgen.codegen.printers import SpecPrinter
from derivgen.codegen.triton import plan_triton
from derivgen.derive.first import ModeDerivation
from derivgen.derive.second import SecondOrder
from derivgen.runtime.abi import kernel_signature
from derivgen.spec.model import N as GROUP_SIZE
from derivgen.spec.model import Spec
from derivgen.symbolic.block import blocks
from derivgen.symbolic.reduce import SELECTIONS, Mean

TEMPLATE_FILES = {
    "numpy": "numpy.py.j2",
    "torch": "torch.py.j2",
    "jax": "jax.py.j2",
    "triton": "triton.py.j2",
    "c": "kernel.c.j2",
    "h": "kernel.h.j2",
    "cbind": "cbinding.py.j2",
    "kernels": "derivgen-kernels.h.j2",
}
SHARED_HEADER = "derivgen-kernels.h"  # no spec name has a hyphen: it cannot collide with a layer


class LayerDerivation(Protocol):
    """What code generation reads of a layer's derivation (``derivgen.derive``'s result)."""

    spec: Spec
    modes: Mapping[str, ModeDerivation]

    def second(self, mode: str) -> SecondOrder:
        """The second order of one mode."""

    def memo(self, key: tuple, compute: Callable[[], object]) -> object:
        """``compute()``, once per ``key`` for this derivation (the IR and the kernel plans)."""


def template_dir() -> Path:
    """The directory of the Jinja templates (the source tree's, else the installed copy)."""
    src = Path(__file__).resolve().parents[2] / "templates"  # a source checkout
    if (src / "numpy.py.j2").is_file():
        return src
    return Path(__file__).resolve().parents[1] / "templates"  # installed: derivgen/templates


# ------------------------------------------------------------------- rendering


@dataclass
class Emitted:
    """One layer's generated files."""

    name: str
    files: dict[str, str] = field(default_factory=dict)  # relative path -> text
    meta: dict = field(default_factory=dict)  # the calling contract (layer_meta)


def _grad_fields(spec: Spec) -> list[str]:
    return [
        "dx",
        *("d" + t.name for t in spec.grad_tensors),
        *("d" + p.name for p in spec.params),
        *("d" + i.name for i in spec.inputs),
    ]


def layer_meta(spec: Spec, irs: Mapping[str, ModeIR]) -> dict:
    """The calling contract, as plain data (embedded in generated files)."""
    return {
        "name": spec.name,
        "layout": spec.layout,
        "reduce": spec.reduce,
        "params": [p.name for p in spec.params],
        "scalar_params": [p.name for p in spec.params if p.scalar],
        "axes": spec.axes,
        "param_init": {p.name: p.init for p in spec.params},
        "options": {o.name: (o.default, o.min, o.max) for o in spec.options},
        **(
            {"integer_options": [o.name for o in spec.options if o.integer]}
            if any(o.integer for o in spec.options)
            else {}
        ),
        "inputs": [i.name for i in spec.inputs],
        "buffers": [b.name for b in spec.buffers],
        "buffer_init": {b.name: b.init for b in spec.buffers},
        "modes": [m.name for m in spec.modes],
        "min_group_size": {m.name: m.min_group_size for m in spec.modes},
        "stats": {m: list(ir.stats) for m, ir in irs.items()},
        "split": _split_meta(spec, irs),
        "buffer_reads": _buffer_reads(spec),
        # block statistics: the C library has no channels-last kernels (NCHW copies are run)
        **({"blocks": True} if any(m.blocks for m in spec.modes) else {}),
        # tensor inputs beside x: (shape, gradient, mask) by name, in order; outputs beside y
        **({"tensors": {t.name: (t.shape, t.grad, t.mask) for t in spec.tensors}} if spec.tensors else {}),
        **({"outputs": [o.name for o in spec.outputs]} if spec.outputs else {}),
    }


def _buffer_reads(spec: Spec) -> list[str]:
    """The modes whose statistics read the running buffers (batch norm's eval mode; batch
    renormalization's training mode too): their kernels and operators take the buffers."""
    buffers = {b.symbol for b in spec.buffers}
    return [m.name for m in spec.modes if any(st.expr.free_symbols & buffers for st in m.statistics)]


def _split_meta(spec: Spec, irs: Mapping[str, ModeIR]) -> dict | None:
    """The split reduction's shape (batch layouts, training mode): sums per level of the
    forward and sums of the backward, per group. None where there is no split reduction:
    other layouts, and training statistics that read running buffers (batch
    renormalization's r and d), which the split kernels do not take, or group maxima."""
    if spec.layout != "channels" or spec.reduce != "batch" or "train" not in irs or spec.multi:
        return None
    buffers = {b.symbol for b in spec.buffers}
    if any(st.expr.free_symbols & buffers or st.expr.has(*SELECTIONS) for st in spec.modes[0].statistics):
        return None
    ir = irs["train"]
    return {"levels": [len(sums) for sums, _ in ir.levels], "backward": len(ir.bwd_loop)}


@jinja2.pass_context
def _np(ctx, e) -> str:
    return ctx["printer"].numpy(e)


@jinja2.pass_context
def _torch(ctx, e) -> str:
    return ctx["printer"].torch(e)


@jinja2.pass_context
def _jax(ctx, e) -> str:
    return jax_expr(e, ctx["printer"].spec)


@jinja2.pass_context
def _npsum(ctx, e, axes: str) -> str:
    return ctx["printer"].np_sum(e, axes)


@jinja2.pass_context
def _code(ctx, e) -> str:
    return ctx["printer"].code(e)


@jinja2.pass_context
def _np_store(ctx, target: str, e) -> str:
    return ctx["printer"].np_store(target, e)


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    """The Jinja environment (its compiled templates are kept for every layer): the
    printing filters print with the layer's printer, the render context's ``printer``."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["pyrepr"] = repr
    env.filters["pformat"] = lambda v: pprint.pformat(v, width=96, sort_dicts=False)
    env.filters["np"] = _np
    env.filters["torch"] = _torch
    env.filters["jax"] = _jax
    env.filters["npsum"] = _npsum
    env.filters["code"] = _code
    env.globals["mean_of"] = Mean
    env.globals["cload"] = c_load
    env.globals["cstore"] = c_store
    env.globals["np_store"] = _np_store
    env.globals["kernel_signature"] = kernel_signature
    return env


def _formulas(d: LayerDerivation, printer: SpecPrinter) -> dict[str, list[str]]:
    """Human-readable formulas for headers, per mode."""
    spec = d.spec
    out = {}
    code = printer.code
    for mname, first in d.modes.items():
        lines = ["forward:"] + [
            f"  {st.name} = {code(st.expr)}" + ("  (named by derivgen)" if st.aux else "") for st in first.statistics
        ]
        if spec.normalized is not None:
            lines.append(f"  {spec.normalized.name} = {code(first.normalized_expr)}")
        lines.append(f"  y = {code(spec.output)}")
        if first.coordinate is not None and first.coordinate.name != getattr(spec.normalized, "name", None):
            lines.append(
                f"  ({first.coordinate.name} = {code(first.coordinate_expr)}: the centred coordinate of the backward)"
            )
        for b in spec.buffers if mname == "train" else ():
            lines.append(f"  {b.name} <- {code(b.update)}  (in place, not differentiated)")
        lines.append("backward (closed form, derived by derivgen):")
        if first.g is not None:
            lines.append(f"  g = {code(first.g)}")
        for r in first.reductions:
            lines.append(f"  {r.name} = mean({code(r.arg)})")
        lines.append(f"  dx = {code(first.dx_lowered)}")
        for p in spec.params:
            where = "all elements" if p.scalar else f"the axes {p.name} does not span"
            lines.append(f"  d{p.name} = sum of {code(first.lowered(first.grads[p.name].element))} over {where}")
            if first.grads[p.name].group != 0:
                lines.append(f"      + sum over groups of {code(first.lowered(first.grads[p.name].group))}")
        for i, e in first.dinputs.items():
            lines.append(f"  d{i} = {code(first.lowered(e))}  (per group; summed for a scalar input)")
        out[mname] = lines
    return out


# the targets that take tensor inputs, values and outputs beside y (Spec.multi)
MULTI_TARGETS = frozenset({"numpy", "c", "jax", "torch", "triton"})

# the targets whose kernels have no per-block sums (block statistics: derivgen.symbolic.block)
BLOCKLESS = ("triton",)


def emit(d: LayerDerivation, targets: Collection[str] = ("numpy", "c")) -> Emitted:
    """Render a layer's derivation ``d`` (``derivgen.derive``'s result) for ``targets``
    ("numpy", "c", "torch", "jax", "triton"): the IR and every C kernel's plan are computed here, once;
    the templates lay them out."""
    spec = d.spec
    if spec.multi and set(targets) - MULTI_TARGETS:
        raise NotImplementedError(
            f"{spec.source}: tensors, values and outputs beside y are derived and proven (derivgen derive, "
            f"derivgen prove) and generated for the {', '.join(sorted(MULTI_TARGETS))} target; not yet for "
            f"{', '.join(sorted(set(targets) - MULTI_TARGETS))}"
        )
    blocked = sorted(t for t in targets if t in BLOCKLESS) if any(m.blocks for m in d.modes.values()) else []
    if blocked:
        raise NotImplementedError(
            f"{spec.name}: block statistics (mean(e, kind)) are generated for the NumPy, C, PyTorch and "
            f"JAX targets; the {', '.join(blocked)} target{'s do' if len(blocked) > 1 else ' does'} not take them"
        )
    has_blocks = any(m.blocks for m in d.modes.values())
    if spec.multi and "c" in targets and (spec.windows or has_blocks or spec.reduce == "position"):
        raise NotImplementedError(
            f"{spec.source}: the C kernels take tensor inputs and outputs beside y in layouts without windows, "
            "block statistics or a position layout; this layer has one"
        )
    if has_blocks and spec.windows and "c" in targets:
        raise NotImplementedError(f"{spec.name}: the C kernels take block statistics or windows, not both in one layer")
    printer = SpecPrinter(spec)
    env = _env()
    # planned once per derivation, whichever targets ask (a layer is often emitted for several)
    irs = d.memo(("ir",), lambda: {m: build_mode_ir(first) for m, first in d.modes.items()})
    second_irs = d.memo(
        ("second ir",),
        lambda: {
            m: {"bb": build_second_ir(d.second(m), "bb"), "jvp": build_second_ir(d.second(m), "jvp")} for m in d.modes
        },
    )
    kernels = (
        d.memo(
            ("c plans",),
            lambda: {
                (m, sfx): plan_kernel(printer, ir, second_irs[m], ct)
                for m, ir in irs.items()
                for sfx, ct in CTYPES.items()
            },
        )
        if "c" in targets
        else {}
    )
    meta = layer_meta(spec, irs)
    ctx = {
        "printer": printer,
        "spec": spec,
        "meta": meta,
        "irs": irs,
        "second_irs": second_irs,
        "modes": list(irs),
        "formulas": _formulas(d, printer),
        "source": spec.source,
        "kernels": kernels,
        "grad_fields": _grad_fields(spec),
        "ctypes": CTYPES,
        "atypes": ATYPES,
        "per_sample": spec.reduce not in ("batch", "all"),
        "trailing": spec.layout == "trailing",
        "first_chain": sorted({k for m in d.modes.values() for k in m.chain}),  # x and the tensors in the core
        "position": spec.reduce == "position",
        "blocks": has_blocks,  # block statistics: no channels-last C kernels
        # the channels-last C kernels (not for block statistics, nor tensor inputs beside x yet)
        "nhwc": spec.layout != "trailing" and spec.reduce != "position" and not has_blocks and not spec.multi,
        "selects": any(st.expr.has(*SELECTIONS) for m in d.modes.values() for st in m.statistics),
        # the modes a split reduction computes: sums only (a group max()/min() is not a sum)
        # the modes whose output uses the group size N (the PyTorch forward then defines it)
        "forward_uses_n": [m for m, ir in irs.items() if any(e.has(GROUP_SIZE) for _, e in ir.fwd_elem)],
        # (and none whose blocks span the samples: a part of the batch holds no whole one)
        "split_modes": [
            m
            for m, dm in d.modes.items()
            if not any(st.expr.has(*SELECTIONS) for st in dm.statistics)
            and not any(0 in a.axes for b in dm.blocks for a in blocks(b.expr))
        ],
    }
    out = Emitted(spec.name, meta=meta)
    if "numpy" in targets:
        ctx_np = dict(ctx, template=TEMPLATE_FILES["numpy"])
        out.files[f"numpy/{spec.name}.py"] = env.get_template(TEMPLATE_FILES["numpy"]).render(**ctx_np)
    if "torch" in targets:
        ctx_t = dict(ctx, template=TEMPLATE_FILES["torch"])
        out.files[f"torch/{spec.name}.py"] = env.get_template(TEMPLATE_FILES["torch"]).render(**ctx_t)
    if "jax" in targets:
        ctx_j = dict(ctx, template=TEMPLATE_FILES["jax"])
        out.files[f"jax/{spec.name}.py"] = env.get_template(TEMPLATE_FILES["jax"]).render(**ctx_j)
    if "triton" in targets:  # the Triton kernels' plans, computed here like the C kernels'
        ctx_tr = dict(
            ctx, template=TEMPLATE_FILES["triton"], tplans={m: plan_triton(spec, ir) for m, ir in irs.items()}
        )
        out.files[f"triton/{spec.name}.py"] = env.get_template(TEMPLATE_FILES["triton"]).render(**ctx_tr)
    if "c" in targets:
        for key, path in (
            ("h", f"c/{spec.name}.h"),
            ("c", f"c/{spec.name}.c"),
            ("cbind", f"c/{spec.name}.py"),
            ("kernels", f"c/{SHARED_HEADER}"),
        ):
            out.files[path] = env.get_template(TEMPLATE_FILES[key]).render(**dict(ctx, template=TEMPLATE_FILES[key]))
    return out
