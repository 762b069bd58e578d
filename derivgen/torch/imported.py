"""``convert(model, import_unknown=True, example_inputs=...)``: every leaf submodule whose
forward :func:`derivgen.from_torch` imports as a spec (of x alone, or of x and the tensors
beside it, returning y or y and the outputs beside it) replaced by a :class:`Module` over that
spec, holding the module's own parameter and buffer tensors under their own names; and the
:class:`ConvertReport` of what was replaced and what was left, and why."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from derivgen.spec import Spec, SpecError
from derivgen.spec.from_torch import from_torch
from derivgen.torch.module import Module
from derivgen.torch.ops import layer

__all__ = ["ConvertReport", "convert_imported"]

_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


@dataclass
class ConvertReport:
    """What :func:`derivgen.torch.convert` did: ``replaced`` maps each replaced submodule's path
    (``"model.layers.0.input_layernorm"``; ``""`` the root) to the derivgen layer it now runs,
    ``left`` each leaf submodule it examined and left to the reason, in one line.
    ``print(report)`` lists both."""

    replaced: dict[str, str] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"replaced {len(self.replaced)} submodule(s), left {len(self.left)}"]
        lines += [f"  replaced {p or '(root)'}: {s}" for p, s in self.replaced.items()]
        lines += [f"  left {p or '(root)'}: {r}" for p, r in self.left.items()]
        return "\n".join(lines)


@dataclass
class _Call:
    """A leaf's first call in the example forward: its inputs' shapes and dtypes (x first, then
    the tensors beside it) and device, or why it cannot be imported from that call alone."""

    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    device: torch.device | None = None
    refused: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.shapes[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.dtypes[0]

    def example(self) -> tuple[torch.Tensor, ...]:
        """Random inputs like the recorded ones (a bool input: a mask of mostly ones)."""
        return tuple(
            torch.rand(s, device=self.device) < 0.8 if d == torch.bool else torch.randn(s, dtype=d, device=self.device)
            for s, d in zip(self.shapes, self.dtypes)
        )


def _leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if next(m.children(), None) is None]


def _record_calls(model: nn.Module, example_inputs: Sequence, example_kwargs: dict) -> dict[int, _Call]:
    """One forward of the example (no grad; the running buffers and the RNG restored after),
    with a pre-hook on every leaf recording its first call."""
    calls: dict[int, _Call] = {}

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if id(mod) in calls:
            return
        x = args[0] if args else None
        others = [
            a
            for a in args[1:]
            if not isinstance(a, torch.Tensor) or not (a.is_floating_point() or a.dtype == torch.bool)
        ]
        if not args or kwargs or others:
            why = f"called with {len(args)} positional argument(s)" + (
                f" and keywords {sorted(kwargs)}" if kwargs else ""
            )
            calls[id(mod)] = _Call(refused=why + ": modules of positional tensors only are imported")
        elif not isinstance(x, torch.Tensor) or not x.is_floating_point():
            what = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
            calls[id(mod)] = _Call(refused=f"its input is {what}, not a floating-point tensor")
        else:
            calls[id(mod)] = _Call(tuple(tuple(a.shape) for a in args), tuple(a.dtype for a in args), x.device)

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for _, m in _leaves(model)]
    saved = {k: b.detach().clone() for k, b in model.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*example_inputs, **example_kwargs)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(saved[k])
    return calls


def _key(m: nn.Module, call: _Call) -> tuple:
    """What an import depends on: the class, the mode, the simple attributes, the shapes of
    the parameters and buffers and the input (equal keys share one import)."""
    simple = (int, float, bool, str, type(None), tuple)
    attrs = tuple(sorted((k, repr(v)) for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, simple)))
    tensors = tuple((k, tuple(t.shape)) for k, t in [*m._parameters.items(), *m._buffers.items()] if t is not None)
    return (type(m), m.training, attrs, tensors, call.shapes, call.dtypes)


def _import(m: nn.Module, call: _Call) -> Spec:
    """The spec of ``m``'s forward, traced on random inputs like the recorded ones; refused
    (SpecError) when the other mode (train/eval) traces another layer."""
    x = call.example()
    spec = from_torch(m, x)
    if not spec.params and not any(md.statistics for md in spec.modes):
        raise SpecError("an activation (no statistics, no parameters): left to PyTorch")
    if all(md.name != "eval" for md in spec.modes):  # one traced mode: the other must be the same layer
        was = m.training
        try:
            m.train(not was)
            other = from_torch(m, x)
        except SpecError as e:
            raise SpecError(f"imported in {'train' if was else 'eval'} mode only; the other: {e}") from None
        finally:
            m.train(was)
        same = {f: getattr(spec, f) for f in ("source", "title", "summary", "notes")}
        if dataclasses.replace(other, **same) != spec:
            raise SpecError(f"imported as {spec.name}, but its train and eval modes trace different layers")
    return spec


def _replacement(m: nn.Module, spec: Spec, call: _Call) -> Module:
    """A :class:`Module` over ``spec`` holding ``m``'s own parameter and buffer tensors, its
    options set to ``m``'s values, its hooks and mode; checked against ``m`` on a random input."""
    meta = layer(spec).meta
    size = call.shape[1:2] if meta.layout == "channels" else call.shape[len(call.shape) - meta.axes :]
    groups = (getattr(m, "num_groups", None) or getattr(m, "groups", None)) if meta.reduce == "group" else None
    options = {o: getattr(m, o) for o in meta.options if isinstance(getattr(m, o, None), (int, float))}
    new = Module(spec, size, num_groups=groups, device="meta", **options)
    for p in meta.params:
        new._parameters[p] = m._parameters[p]
    for b in meta.buffers:
        new._buffers[b] = m._buffers[b]
    if set(new.state_dict(keep_vars=True)) != set(m.state_dict(keep_vars=True)):
        raise SpecError(
            f"imported as {spec.name}, whose state_dict keys {sorted(new.state_dict())} are not the module's "
            f"{sorted(m.state_dict())}"
        )
    for h in _HOOKS:
        setattr(new, h, getattr(m, h))
    new.train(m.training)
    _check_forward(m, new, spec, call)
    return new


def _check_forward(m: nn.Module, new: Module, spec: Spec, call: _Call) -> None:
    """The replacement's outputs equal the module's on random inputs (buffers restored after)."""
    xs = call.example()
    saved = {k: b.detach().clone() for k, b in m.named_buffers()}
    try:
        with torch.no_grad():
            want, got = m(*xs), new(*xs)
    finally:
        with torch.no_grad():
            for k, b in m.named_buffers():
                b.copy_(saved[k])
    tol = 1e-3 if call.dtype in (torch.float16, torch.bfloat16) else 1e-4
    want = want if isinstance(want, tuple) else (want,)
    got = got if isinstance(got, tuple) else (got,)
    if len(want) != len(got) or any(not isinstance(w, torch.Tensor) or w.shape != g.shape for w, g in zip(want, got)):
        raise SpecError(
            f"imported as {spec.name}, but the module does not return {len(got)} tensor(s) of its outputs' shapes"
        )
    for w, g, o in zip(want, got, ["y", *(o.name for o in spec.outputs)]):
        if not torch.allclose(g, w.to(g.dtype), rtol=tol, atol=tol):
            diff = (g - w).abs().max().item()
            raise SpecError(
                f"imported as {spec.name}, but its forward differs from the module's (max |d{o}| = {diff:.3g})"
            )


def convert_imported(
    model: nn.Module,
    example_inputs: Sequence,
    example_kwargs: dict | None,
    report: ConvertReport,
    known: Callable[[nn.Module], nn.Module | None],
) -> nn.Module:
    """Replace, in place, each leaf submodule ``known`` gives a twin for by it, and each other
    leaf whose forward imports as a spec by a :class:`Module` over it; ``report``
    filled. Returns the model (its replacement when the root itself is replaced)."""
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            "convert: example_inputs must be a tuple of the model's positional inputs, e.g. (x,); "
            f"got {type(example_inputs).__name__}"
        )
    calls = _record_calls(model, example_inputs, example_kwargs or {})
    done: dict[tuple, Spec | SpecError] = {}
    swaps: list[tuple[str, nn.Module]] = []
    for path, m in _leaves(model):
        twin = known(m)
        if twin is not None:
            swaps.append((path, twin))
            report.replaced[path] = ", ".join(twin._DG_LAYERS)
            continue
        call = calls.get(id(m))
        if call is None or call.refused:
            report.left[path] = call.refused if call else "not called by the example forward"
            continue
        key = _key(m, call)
        try:
            if key not in done:
                try:
                    done[key] = _import(m, call)
                except SpecError as e:
                    done[key] = e
            if isinstance(done[key], SpecError):
                raise done[key]
            new = _replacement(m, done[key], call)
        except Exception as e:  # noqa: BLE001 - any failure leaves the module, with its reason
            report.left[path] = _one_line(e)
            continue
        swaps.append((path, new))
        report.replaced[path] = new.layer_name
    for path, new in swaps:
        if not path:
            return new
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, new)
    return model


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
