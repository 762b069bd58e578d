"""Emit code from derivations: one IR per mode, one Jinja template per target.

A layer's derivation (plain data: its spec and per-mode derivations) becomes the
IR of :mod:`derivgen.codegen.ir`, and every C kernel's plan (:mod:`derivgen.codegen.c.plan`) is
computed once, before rendering; the templates receive plain data and only lay
out text. Expressions are printed by one :class:`derivgen.codegen.printers.SpecPrinter`
per layer. Every name the generated code makes is in derivgen's own namespace
(see :mod:`derivgen.symbolic.naming`).
"""

from __future__ import annotations

import pprint
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import jinja2

from derivgen.codegen import targets as registry
from derivgen.codegen.ir import ModeIR, build_mode_ir, build_second_ir
from derivgen.codegen.printers import SpecPrinter
from derivgen.codegen.targets import SHARED_HEADER, Layer, LayerDerivation, Target, template_dir
from derivgen.runtime.build import cache_dir
from derivgen.spec.model import N as GROUP_SIZE
from derivgen.spec.model import Spec
from derivgen.symbolic.block import blocks
from derivgen.symbolic.reduce import SELECTIONS, Mean

__all__ = ["SHARED_HEADER", "Emitted", "LayerDerivation", "emit", "layer_meta", "template_dir"]


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
        "buffer_reads": list(spec.buffer_reads),
        # block statistics: the C library has no channels-last kernels (NCHW copies are run)
        **({"blocks": True} if any(m.blocks for m in spec.modes) else {}),
        # tensor inputs beside x: (shape, gradient, mask) by name, in order; outputs beside y
        **({"tensors": {t.name: (t.shape, t.grad, t.mask) for t in spec.tensors}} if spec.tensors else {}),
        **({"outputs": [o.name for o in spec.outputs]} if spec.outputs else {}),
    }


def _split_meta(spec: Spec, irs: Mapping[str, ModeIR]) -> dict | None:
    """The split reduction's shape (batch layouts, training mode): sums per level of the
    forward and sums of the backward, per group. None where there is no split reduction:
    other layouts, training statistics that read running buffers (batch renormalization's r
    and d), which the split kernels do not take, or group maxima, and outputs beside y. Tensor
    inputs beside x (a mask inside the means, a modulation) are element values of every part."""
    if spec.layout != "channels" or spec.reduce != "batch" or "train" not in irs or spec.outputs:
        return None
    buffers = {b.symbol for b in spec.buffers}
    if any(st.expr.free_symbols & buffers or st.expr.has(*SELECTIONS) for st in spec.modes[0].statistics):
        return None
    ir = irs["train"]
    return {"levels": [len(sums) for sums, _ in ir.levels], "backward": len(ir.bwd_loop)}


def _printing(f: Callable[..., str]) -> Callable[..., str]:
    """A Jinja filter or function ``f(printer, value, *args)`` that prints with the layer's
    printer, the render context's ``printer``."""

    @jinja2.pass_context
    def printing(ctx, *args):
        return f(ctx["printer"], *args)

    return printing


_ENVS: dict[str, jinja2.Environment] = {}  # per target: its compiled templates kept for every layer
registry.on_change(_ENVS.clear)


def _bytecode_cache() -> jinja2.BytecodeCache | None:
    """The templates compiled to Python bytecode once, kept in the derivgen cache directory
    (``jinja/``) for the next process: compiling them is most of a small layer's first
    ``load()``. Jinja keys each entry by the template's path and checks its source's checksum,
    so an edited template is compiled again; entries are written to a temporary file and
    renamed, so processes may share the directory. None where it cannot be made."""
    folder = cache_dir() / "jinja"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return jinja2.FileSystemBytecodeCache(str(folder))


def _env(target: Target) -> jinja2.Environment:
    """The Jinja environment of one target: its templates (then the shared ones in
    ``templates/``), the shared filters and the target's own."""
    if target.name not in _ENVS:
        dirs = [str(target.template_dir)] if target.template_dir is not None else []
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader([*dirs, str(template_dir())]),
            bytecode_cache=_bytecode_cache(),
            undefined=jinja2.StrictUndefined,
            keep_trailing_newline=True,
            trim_blocks=True,
            lstrip_blocks=True,
            autoescape=False,
        )
        env.filters["pyrepr"] = repr
        env.filters["pformat"] = lambda v: pprint.pformat(v, width=96, sort_dicts=False)
        env.filters["code"] = _printing(SpecPrinter.code)
        env.globals["mean_of"] = Mean
        env.filters.update({k: _printing(f) for k, f in target.filters.items()})
        env.globals.update({k: _printing(f) for k, f in target.calls.items()})
        env.globals.update(target.globals)
        _ENVS[target.name] = env
    return _ENVS[target.name]


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


# the targets that take tensor inputs, values and outputs beside y (Spec.multi), and those whose
# kernels have no per-block sums (block statistics: derivgen.symbolic.block), as the registry
# holds them when derivgen is imported
MULTI_TARGETS = frozenset(t.name for t in registry.TARGETS.values() if t.multi)
BLOCKLESS = tuple(t.name for t in registry.TARGETS.values() if not t.blocks)


def _refusal(d: LayerDerivation, chosen: list[Target]) -> str | None:
    """Why the targets ``chosen`` do not take the layer ``d`` (the first reason), or None."""
    spec = d.spec
    if spec.multi and any(not t.multi for t in chosen):
        multi = sorted(t.name for t in registry.TARGETS.values() if t.multi)
        return (
            f"{spec.source}: tensors, values and outputs beside y are derived and proven (derivgen derive, "
            f"derivgen prove) and generated for the {', '.join(multi)} target; not yet for "
            f"{', '.join(sorted(t.name for t in chosen if not t.multi))}"
        )
    blocked = sorted(t.name for t in chosen if not t.blocks) if registry.has_blocks(d) else []
    if blocked:
        takers = [t.label for t in registry.TARGETS.values() if t.blocks]
        return (
            f"{spec.name}: block statistics (mean(e, kind)) are generated for the {registry.and_list(takers)} "
            f"targets; the {', '.join(blocked)} target{'s do' if len(blocked) > 1 else ' does'} not take them"
        )
    for t in chosen:
        why = t.refuses(d) if t.refuses is not None else None
        if why:
            return why
    return None


def emit(d: LayerDerivation, targets: Collection[str] = ("numpy", "c")) -> Emitted:
    """Render a layer's derivation ``d`` (``derivgen.derive``'s result) for ``targets`` (names
    of :data:`derivgen.codegen.targets.TARGETS`: "numpy", "c", "torch", "jax", "triton"): the
    IR and every target's plans are computed here, once; the templates lay them out."""
    spec = d.spec
    chosen = [registry.get(t) for t in dict.fromkeys(targets)]
    why = _refusal(d, chosen)
    if why:
        raise NotImplementedError(why)
    printer = SpecPrinter(spec)
    # planned once per derivation, whichever targets ask (a layer is often emitted for several)
    irs = d.memo(("ir",), lambda: {m: build_mode_ir(first) for m, first in d.modes.items()})
    second_irs = d.memo(
        ("second ir",),
        lambda: {
            m: {"bb": build_second_ir(d.second(m), "bb"), "jvp": build_second_ir(d.second(m), "jvp")} for m in d.modes
        },
    )
    layer = Layer(d, printer, irs, second_irs)
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
        "grad_fields": _grad_fields(spec),
        "trailing": spec.layout == "trailing",
        "first_chain": sorted({k for m in d.modes.values() for k in m.chain}),  # x and the tensors in the core
        "position": spec.reduce == "position",
        "selects": any(st.expr.has(*SELECTIONS) for m in d.modes.values() for st in m.statistics),
        # the modes whose output uses the group size N (the PyTorch forward then defines it)
        "forward_uses_n": [m for m, ir in irs.items() if any(e.has(GROUP_SIZE) for _, e in ir.fwd_elem)],
        # the modes a split reduction computes: sums only (a group max()/min() is not a sum)
        # (and none whose blocks span the samples: a part of the batch holds no whole one)
        "split_modes": [
            m
            for m, dm in d.modes.items()
            if not any(st.expr.has(*SELECTIONS) for st in dm.statistics)
            and not any(0 in a.axes for b in dm.blocks for a in blocks(b.expr))
        ],
    }
    out = Emitted(spec.name, meta=meta)
    for target in registry.TARGETS.values():
        if target not in chosen:
            continue
        tctx = dict(ctx, **target.plan(layer)) if target.plan is not None else ctx
        env = _env(target)
        for template, path in target.paths(spec.name).items():
            out.files[path] = env.get_template(template).render(**dict(tctx, template=template))
    return out
