"""The calling convention of the generated C kernels, as data.

One description, derived from a layer's metadata (the ``_META`` dict of the generated
bindings, ``derivgen.codegen.emit.layer_meta``), of every kernel's argument list: the C
templates render their prototypes from it, :mod:`derivgen.runtime.cbind` declares ctypes
argument types and packs NumPy calls with it, :mod:`derivgen.torch` packs its calls
on tensors' data pointers with it.

A kernel's arguments come in *sections* (the dims, x, the parameters, the options, the
per-group inputs, ...), in order; :meth:`KernelSignature.pack` lays out the values of
each section in that order. Every kernel is generated for each element type (float,
double, bfloat16; the element type is the placeholder ``ELEM`` here), each layout
(NCHW and channels last) and each mode (``train``; ``eval`` where the spec has one):
the argument lists depend only on the mode and the kind of kernel.

Kinds: ``forward``, ``backward``, the second order ``bb`` (double backward) and ``jvp``,
and for layers whose groups span the batch (``meta.split``, training mode) the split
reduction ``split_partial``, ``split_finish``, ``split_apply``, ``split_bpartial``,
``split_bapply``.

This module is the bottom of the code-generation stack: it imports nothing from
derivgen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from derivgen.runtime.meta import LayerMeta, MetaLike, layer_meta

ELEM = "ELEM"  # the kernel's element type: float, double or dg_bf16
KINDS = ("forward", "backward", "bb", "jvp")
SPLIT_KINDS = ("split_partial", "split_finish", "split_apply", "split_bpartial", "split_bapply")


@dataclass(frozen=True)
class Arg:
    """One C parameter.

    ``ctype`` is the pointee type of a pointer, else the parameter's type: ``ELEM``,
    ``double``, ``int64_t`` or ``int``. ``section`` names the group of arguments it
    belongs to (see :meth:`KernelSignature.pack`); ``same_line`` keeps it on the line of
    the previous parameter in the rendered prototype (the dims, an input's stride).
    """

    name: str
    section: str
    ctype: str
    pointer: bool = False
    const: bool = False
    same_line: bool = False

    def c_decl(self, elem: str) -> str:
        """The C declaration, e.g. ``const float *restrict gamma`` or ``double eps``."""
        ctype = elem if self.ctype == ELEM else self.ctype
        if not self.pointer:
            return f"{ctype} {self.name}"
        return f"{'const ' if self.const else ''}{ctype} *restrict {self.name}"


@dataclass(frozen=True)
class KernelSignature:
    """The arguments of one kernel (one mode and kind), in order, and its sections."""

    layer: str
    mode: str
    kind: str
    args: tuple[Arg, ...]
    sections: tuple[str, ...]
    sizes: tuple[int, ...] = ()  # arguments per section (derived)

    def __post_init__(self):
        object.__setattr__(self, "sizes", tuple(sum(1 for a in self.args if a.section == s) for s in self.sections))
        object.__setattr__(self, "_section_set", frozenset(self.sections))

    def symbol(self, sfx: str) -> str:
        """The C function's name for a suffix (``f32``, ``f64``, ``bf16``, ``nhwc_f32`` ...)."""
        return f"{self.layer}_{self.mode}_{self.kind}_{sfx}"

    def c_lines(self, elem: str) -> list[str]:
        """The prototype's parameter lines for an element type, without the separating commas."""
        lines: list[list[str]] = []
        for a in self.args:
            if a.same_line and lines:
                lines[-1].append(a.c_decl(elem))
            else:
                lines.append([a.c_decl(elem)])
        return [", ".join(line) for line in lines]

    def c_prototype(self, sfx: str, elem: str) -> str:
        """``int <symbol>(\\n    <params>,\\n    ...)`` as the C header declares it (no ``;``)."""
        return f"int {self.symbol(sfx)}(\n" + ",\n".join("    " + line for line in self.c_lines(elem)) + ")"

    def section_size(self, section: str) -> int:
        """How many C arguments a section has."""
        return self.sizes[self.sections.index(section)]

    def section_args(self, section: str) -> tuple[Arg, ...]:
        """A section's arguments, in order."""
        return tuple(a for a in self.args if a.section == section)

    def pack(self, values: Mapping[str, Sequence[Any]]) -> list:
        """The argument list of a call from each section's values (a sequence per section,
        in the section's order; sections without arguments may be left out). Raises
        ValueError when the number of values does not match the signature (naming the first
        section whose count is off) or a section is unknown. Like :meth:`packer`, each call
        checks the total and the section names; the per-section counts are looked at only to
        explain a mismatch."""
        out: list = []
        for s in self.sections:
            v = values.get(s)
            if v:
                out += v
        if len(out) != len(self.args) or not values.keys() <= self._section_set:
            self._explain_mismatch(values)
        return out

    def _explain_mismatch(self, values: Mapping[str, Sequence[Any]]) -> None:
        """Raise the ValueError that says which section of ``values`` does not fit."""
        unknown = sorted(set(values) - set(self.sections))
        if unknown:
            raise ValueError(f"{self.symbol('*')}: no section(s) {unknown}; sections are {self.sections}")
        for s, n in zip(self.sections, self.sizes):
            got = len(values.get(s) or ())
            if got != n:
                raise ValueError(f"{self.symbol('*')}: section {s} takes {n} values, got {got}")

    def packer(self, names: Sequence[str], merged: Mapping[str, Sequence[str]] | None = None) -> Callable[..., list]:
        """A fast :meth:`pack` for a hot call site: ``packer(names)(*seqs)`` concatenates one
        sequence per name. ``names`` are sections in the signature's order (the sections
        without arguments may be left out); ``merged`` lets one name stand for consecutive
        sections (``{"x_params": ("x", "params")}``: one list of x's and the parameters'
        pointers). The order is checked here, once; each call checks the total count."""
        merged = dict(merged or {})
        expanded = [s for n in names for s in merged.get(n, (n,))]
        wanted = [s for s, n in zip(self.sections, self.sizes) if n or s in expanded]
        if expanded != wanted:
            raise ValueError(f"{self.symbol('*')}: sections {expanded} do not follow the signature's {wanted}")
        total, where, join = len(self.args), self.symbol("*"), chain.from_iterable

        def pack(*seqs) -> list:
            out = list(join(seqs))
            if len(out) != total:
                raise ValueError(f"{where}: {total} arguments expected, got {len(out)}")
            return out

        return pack


def call_runs(sig: KernelSignature) -> tuple[int, int, int] | None:
    """A signature as runs of argument classes: ``(lead, doubles, tail)`` when its arguments
    are ``lead`` 64-bit integers or pointers, then ``doubles`` doubles, then ``tail``
    pointers, then one ``int`` (the thread count); None for any other shape (per-group
    inputs' strides among the pointers, a level, a count). A caller that passes pointers
    as 64-bit integers (the same register or stack slot on 64-bit ABIs) can then call
    every such kernel through one function type per (lead, doubles, tail):
    ``derivgen.torch``'s C++ extension does."""
    args = sig.args
    if not args or args[-1].pointer or args[-1].ctype != "int":
        return None
    body = args[:-1]
    k = 0
    while k < len(body) and (body[k].pointer or body[k].ctype == "int64_t"):
        k += 1
    lead = k
    while k < len(body) and not body[k].pointer and body[k].ctype == "double":
        k += 1
    doubles = k - lead
    if not all(a.pointer for a in body[k:]):
        return None
    return lead, doubles, len(body) - k


class _Builder:
    """Collects the arguments of one signature, section by section."""

    def __init__(self):
        self.args: list[Arg] = []
        self.sections: list[str] = []

    def add(self, section: str, args: Iterable[Arg]) -> _Builder:
        """Append arguments to the signature being built."""
        if section in self.sections:
            raise ValueError(f"section {section} twice")
        self.sections.append(section)
        self.args.extend(args)
        return self


def _dims() -> list[Arg]:
    return [Arg(n, "dims", "int64_t", same_line=k > 0) for k, n in enumerate(("O", "G", "Cg", "S"))]


def _elems(section: str, names: Iterable[str], const: bool) -> list[Arg]:
    return [Arg(n, section, ELEM, pointer=True, const=const) for n in names]


def _doubles(section: str, names: Iterable[str], const: bool) -> list[Arg]:
    return [Arg(n, section, "double", pointer=True, const=const) for n in names]


def _pairs(section: str, names: Iterable[str], pointer_sfx: str, stride_sfx: str) -> list[Arg]:
    """Per-group inputs: a pointer and a stride (0: a scalar, 1: one value per group) each."""
    out = []
    for n in names:
        out += [
            Arg(n + pointer_sfx, section, ELEM, pointer=True, const=True),
            Arg(n + stride_sfx, section, "int64_t", same_line=True),
        ]
    return out


def _one(section: str, name: str, ctype: str, pointer: bool = False, const: bool = False) -> list[Arg]:
    return [Arg(name, section, ctype, pointer=pointer, const=const)]


def tensor_names(meta: MetaLike) -> list[str]:
    """The tensor inputs beside x, in order (each read at x's shape by the kernels, but a
    :func:`native` one, read at its own)."""
    meta = layer_meta(meta)
    return list(meta.tensors)


def native(meta: MetaLike, kind: str) -> bool:
    """Do the C kernels read a tensor input declared ``kind`` at its own shape? The
    ``sample`` tensors (one value per sample and feature, or per sample and channel) and the
    ``position`` ones (one value per sample and position; :mod:`derivgen.runtime.tensors`)."""
    return kind in ("sample", "position")


def sums_own(meta: MetaLike, kind: str) -> bool:
    """Does the backward kernel sum the gradient of a tensor input declared ``kind`` over
    the axes it is broadcast over (writing it at its own shape)? The ``sample`` tensors;
    a ``position`` one's element gradients are written at x's shape and summed over the
    channels by the caller (a sum across the groups, which threads share out)."""
    return kind == "sample"


def takes_samples(meta: MetaLike) -> bool:
    """Does a layer's kernels take the ``samples`` section after the dims (the samples a
    trailing layout's per-sample tensor holds, which its (O, G, Cg, S) view does not say)?"""
    meta = layer_meta(meta)
    return meta.layout == "trailing" and any(t.shape == "sample" for t in meta.tensors.values())


def grad_tensor_names(meta: MetaLike) -> list[str]:
    """The tensor inputs with a gradient, in order."""
    meta = layer_meta(meta)
    return [t for t, (_, grad, _) in meta.tensors.items() if grad]


def _leading(meta: LayerMeta, data: Sequence[str]) -> _Builder:
    """dims, the data arrays (``x``; ``x`` and ``dy``), the tensor inputs beside x and the
    cotangents of the outputs beside y (a layer that has them), parameters, options and
    inputs: what every kernel starts with."""
    b = _Builder().add("dims", _dims())
    if takes_samples(meta):
        b.add("samples", _one("samples", "Samples", "int64_t"))
    for d in data:
        b.add(d, _elems(d, [d], True))
    if tensor_names(meta):
        b.add("tensors", _elems("tensors", tensor_names(meta), True))
    if "dy" in data and meta.outputs:
        b.add("cotangents", _elems("cotangents", ["d" + o for o in meta.outputs], True))
    return (
        b.add("params", _elems("params", meta.params, True))
        .add("options", [Arg(o, "options", "double") for o in meta.options])
        .add("inputs", _pairs("inputs", meta.inputs, "_In", "_Stride"))
    )


def reads_buffers(meta: MetaLike, mode: str) -> bool:
    """Do ``mode``'s statistics read the running buffers (so its calls must pass them)?
    Eval modes do (batch norm); a training mode may (batch renormalization's r and d)."""
    meta = layer_meta(meta)
    return bool(meta.buffers) and mode in meta.buffer_reads


def _forward(meta: LayerMeta, mode: str) -> _Builder:
    return (
        _leading(meta, ["x"])
        .add("buffers", _elems("buffers", meta.buffers, mode == "eval"))
        .add("y", _elems("y", ["y", *(o + "_Out" for o in meta.outputs)], False))
        .add("stats", _doubles("stats", [s + "_Out" for s in meta.stats[mode]], False))
        .add("nthreads", _one("nthreads", "Nthreads", "int"))
    )


def _backward(meta: LayerMeta, mode: str) -> _Builder:
    return (
        _leading(meta, ["x", "dy"])
        .add("stats", _doubles("stats", [s + "_In" for s in meta.stats[mode]], True))
        .add("dx", _elems("dx", ["dx", *("d" + t for t in grad_tensor_names(meta))], False))
        .add("dparams", _elems("dparams", ["d" + p for p in meta.params], False))
        .add("dinputs", _elems("dinputs", ["d" + i for i in meta.inputs], False))
        .add("nthreads", _one("nthreads", "Nthreads", "int"))
    )


def _second(meta: LayerMeta, mode: str, kind: str) -> _Builder:
    b = (
        _leading(meta, ["x", "dy"] if kind == "bb" else ["x"])
        .add("stats", _doubles("stats", [s + "_In" for s in meta.stats[mode]], True))
        .add("seed_x", _elems("seed_x", ["Seed_x"], True))
        .add("seed_params", _elems("seed_params", [p + "_Seed" for p in meta.params], True))
        .add("seed_inputs", _pairs("seed_inputs", meta.inputs, "_Seed_In", "_Seed_Stride"))
    )
    if grad_tensor_names(meta):  # the seeds of the tensors with a gradient, at x's shape
        b.add("seed_tensors", _elems("seed_tensors", [t + "_Seed" for t in grad_tensor_names(meta)], True))
    outputs = meta.outputs
    if kind == "bb":
        b = b.add("out_dx", _elems("out_dx", ["Out_dx"], False)).add("out_ddy", _elems("out_ddy", ["Out_ddy"], False))
        if outputs:  # L2's gradients with respect to the outputs' cotangents
            b.add("out_ddouts", _elems("out_ddouts", ["Out_dd" + o for o in outputs], False))
        if grad_tensor_names(meta):  # the tensors' gradients at x's shape (summed by the caller, native ones too)
            b.add("out_dtensors", _elems("out_dtensors", ["Out_d" + t for t in grad_tensor_names(meta)], False))
        b = b.add("out_params", _elems("out_params", [p + "_Out" for p in meta.params], False)).add(
            "out_inputs", _elems("out_inputs", [i + "_Out" for i in meta.inputs], False)
        )
    else:  # the tangents of y and of the outputs beside it
        b = b.add("out_ty", _elems("out_ty", ["Out_ty", *("Out_t" + o for o in outputs)], False))
    return b.add("nthreads", _one("nthreads", "Nthreads", "int"))


def _split(meta: LayerMeta, kind: str) -> _Builder:
    data = {
        "split_partial": ["x"],
        "split_finish": [],
        "split_apply": ["x"],
        "split_bpartial": ["x", "dy"],
        "split_bapply": ["x", "dy"],
    }[kind]
    b = _leading(meta, data)
    level = _one("level", "Level", "int")
    count = _one("count", "N_total", "double")
    nthreads = _one("nthreads", "Nthreads", "int")
    if kind == "split_partial":
        return (
            b.add("level", level)
            .add("stats", _one("stats", "Stats", "double", True, True))
            .add("count", count)
            .add("sums", _one("sums", "Sums", "double", True))
            .add("nthreads", nthreads)
        )
    if kind == "split_finish":
        return (
            b.add("level", level)
            .add("sums", _one("sums", "Sums", "double", True, True))
            .add("count", count)
            .add("stats", _one("stats", "Stats", "double", True))
        )
    if kind == "split_apply":
        return (
            b.add("stats", _one("stats", "Stats", "double", True, True))
            .add("count", count)
            .add("y", _elems("y", ["y"], False))
            .add("nthreads", nthreads)
        )
    if kind == "split_bpartial":
        return (
            b.add("stats", _one("stats", "Stats", "double", True, True))
            .add("count", count)
            .add("sums", _one("sums", "Sums", "double", True))
            .add("nthreads", nthreads)
        )
    return (
        b.add("stats", _one("stats", "Stats", "double", True, True))
        .add("sums", _one("sums", "Sums", "double", True, True))
        .add("count", count)
        .add("group_terms", _one("group_terms", "Group_terms", "int"))
        .add("dx", _elems("dx", ["dx", *("d" + t for t in grad_tensor_names(meta))], False))
        .add("dparams", _elems("dparams", ["d" + p for p in meta.params], False))
        .add("dinputs", _elems("dinputs", ["d" + i for i in meta.inputs], False))
        .add("nthreads", nthreads)
    )


def kernel_signature(meta: MetaLike, mode: str, kind: str) -> KernelSignature:
    """The signature of one kernel of a layer (``kind``: one of :data:`KINDS` or
    :data:`SPLIT_KINDS`; the split kernels exist for ``meta.split`` layers in train mode)."""
    meta = layer_meta(meta)
    if mode not in meta.modes:
        raise ValueError(f"{meta.name}: no mode {mode!r}; modes are {meta.modes}")
    if kind == "forward":
        b = _forward(meta, mode)
    elif kind == "backward":
        b = _backward(meta, mode)
    elif kind in ("bb", "jvp"):
        b = _second(meta, mode, kind)
    elif kind in SPLIT_KINDS:
        if not meta.split or mode != "train":
            raise ValueError(f"{meta.name}: no split kernels in mode {mode!r}")
        b = _split(meta, kind)
    else:
        raise ValueError(f"unknown kernel kind {kind!r}; kinds are {KINDS + SPLIT_KINDS}")
    return KernelSignature(meta.name, mode, kind, tuple(b.args), tuple(b.sections))


def kernel_signatures(meta: MetaLike) -> dict[tuple[str, str], KernelSignature]:
    """Every kernel's signature of a layer, by (mode, kind)."""
    meta = layer_meta(meta)
    out = {}
    for mode in meta.modes:
        kinds = KINDS
        kinds += SPLIT_KINDS if meta.split and mode == "train" else ()
        for kind in kinds:
            out[(mode, kind)] = kernel_signature(meta, mode, kind)
    return out
