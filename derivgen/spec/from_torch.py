"""A PyTorch module or function read as a spec: :func:`from_torch`.

The forward is traced with ``torch.export`` and decomposed to core ATen; the graph is then
walked once, node by node, and each node mapped to the spec language:

* reductions over the group's dimensions (``mean``, ``sum``, ``var``, ``amax``, ``amin``)
  become statistics (``mean()``, ``sum()``, ``max()``, ``min()``); group values that element
  values read are named statistics too (after the source line's variable where the line
  assigns one, else after the operation: ``rstd``, ``std``, or ``s1, s2, ...``);
* elementwise ATen operations become expressions (``rsqrt`` as ``1/sqrt``, ``pow`` as ``**``,
  ``tanh``, ``exp``, ``clamp`` as ``clip``, ``gelu`` and ``silu`` through ``erf``, ``tanh`` and
  ``sigmoid`` ...); views and broadcasts of parameters and of
  group values are dropped (the layout places them);
* the module's parameters keep their names (``weight``, ``bias``, ``alpha``); Python numbers
  added to a statistic (an ``eps``) and numbers the module keeps as float attributes become
  options, named after the attribute, with their values as defaults;
* the layout follows from the reduced dimensions and the parameters' shapes (``trailing``:
  reductions over the last dims, parameters spanning them; ``channels``: per-channel
  parameters, reductions over space (``instance``), batch and space (``batch``), channels
  (``position``));
* dtype casts (``x.float()`` ... ``.to(input_dtype)``) are dropped and recorded in a comment;
* tensor arguments after x are ``[tensors]`` (x's shape, one value per sample, per position;
  a bool one a mask), the value the statistics read through x and those tensors a
  ``[values]`` entry, tensors returned after y outputs beside it; x permuted (and permuted
  back) or its channels reshaped into groups (``reduce = "group"``) keep x's layout;
* ``native_layer_norm`` and ``native_group_norm``, which core ATen keeps whole, are read as
  the catalogue's layer and group normalization; batch norm (training mode: its running-buffer
  updates as ``[buffers]`` with their momentum update; eval mode: the same spec, whose eval
  mode reads the buffers), instance norm, softmax, log-softmax and local response norm's
  window as the catalogue's and zoo's specs (:mod:`~derivgen.spec.torch_builtins`).

What no spec can say is refused with one line naming the operation and its source line, as a
:class:`TorchImportError` (a :class:`SpecError`, which the CLI prints without a traceback).
torch is imported only when a function here is called.

torch.export rather than torch.fx's symbolic tracing: export runs the forward on fake tensors,
so shapes (the layout's evidence) are known at every node, casts and in-place updates are
explicit (functionalized) nodes, data-dependent Python control flow is an error naming its
line instead of a silently specialized trace, and the torch.nn functionals (``rms_norm``,
``F.normalize``) arrive decomposed into the same few core ATen operations a hand-written
forward gives.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import time
from pathlib import Path
from typing import Any

from derivgen.spec.model import Spec, SpecError
from derivgen.spec.parse import parse_spec
from derivgen.spec.torch_graph import _Walker
from derivgen.spec.torch_ops import TorchImportError, _State
from derivgen.spec.torch_toml import _infer_layout, _render, _snake

__all__ = ["TorchImportError", "from_torch", "from_torch_toml", "import_command_main", "resolve_target"]


def _torch() -> Any:
    """torch, imported on first use; a TorchImportError saying how to get it otherwise."""
    try:
        import torch
    except ImportError:
        raise TorchImportError("importing a PyTorch layer needs PyTorch: pip install torch") from None
    return torch


# -- the entry points -----------------------------------------------------------------------------
def _export(torch: Any, module: Any, xs: tuple, fn_name: str) -> Any:
    import logging
    import warnings

    was = logging.root.manager.disable
    try:
        # torch logs a failed trace's traceback (fake_tensor's "failed while attempting to run
        # meta"): the error below is said in one line instead
        logging.disable(logging.CRITICAL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(module, xs, strict=False)
            return ep.run_decompositions()
    except TorchImportError:
        raise
    except Exception as exc:  # noqa: BLE001 -- torch's own errors: one line naming the source line
        msg = str(exc)
        found = re.findall(r'File "([^"]*)", line (\d+), in (\S+)\n\s*(.*)', msg)
        data_dep = "data-dependent" in msg or "GuardOnDataDependent" in type(exc).__name__
        if found:
            _, line, fn, code = found[-1]
            what = f"`{code.strip()}`"
            why = (
                "Python control flow on tensor values; a spec's forward is one program for every x"
                if data_dep
                else msg.strip().splitlines()[0][:200]
            )
            raise TorchImportError(f"{what} in {fn}, line {line}: {why}") from None
        first = msg.strip().splitlines()[0][:200] if msg.strip() else type(exc).__name__
        raise TorchImportError(f"{fn_name}: torch.export cannot trace the forward: {first}") from None
    finally:
        logging.disable(was)


def from_torch_toml(
    module_or_function: Any, example_input: Any, *, name: str | None = None, _timing: dict | None = None
) -> str:
    """The spec of ``module_or_function`` (a ``torch.nn.Module`` or a function of tensors) as
    TOML text, traced on ``example_input`` (a tensor, or a shape: a float64 tensor of that
    shape; a tuple of them for a forward of several tensors: x first); see :func:`from_torch`."""
    torch = _torch()

    start = time.perf_counter()
    inputs = _example_inputs(torch, example_input)
    if isinstance(module_or_function, torch.nn.Module):
        module = module_or_function
        fn_name = type(module).__name__
        origin_obj: Any = type(module)
        names = _argument_names(module.forward, len(inputs))
    elif callable(module_or_function):
        fn = module_or_function

        class _Function(torch.nn.Module):
            def forward(self, *xs):
                return fn(*xs)

        module = _Function()
        fn_name = getattr(fn, "__name__", "function")
        origin_obj = fn
        names = _argument_names(fn, len(inputs))
    else:
        raise TorchImportError("from_torch: expected a torch.nn.Module or a function of tensors")
    for sub in module.modules():  # what export reports as data-dependent control flow, said plainly
        bn = isinstance(sub, torch.nn.modules.batchnorm._BatchNorm)
        if bn and sub.training and sub.momentum is None and sub.track_running_stats:
            raise TorchImportError(
                f"{fn_name}: {type(sub).__name__} with momentum=None: the cumulative average of the "
                "running statistics (1/num_batches_tracked) has no spec construct; give a momentum"
            )
    ep = _export(torch, module, inputs, fn_name)
    x = inputs[0]
    st = _State(ndim=x.dim(), shape=tuple(x.shape))
    for attr, value in vars(module).items():
        if isinstance(value, float) and not attr.startswith("_") and value not in st.float_attrs:
            st.float_attrs[value] = attr
    walker = _Walker(torch, ep, module, st, fn_name)
    walker.input_names = names
    code = getattr(origin_obj, "__code__", None)
    walker.def_line = code.co_firstlineno if code is not None else None
    output = walker.run()
    _infer_layout(st, fn_name)
    try:
        source = sys.modules[origin_obj.__module__].__file__ if origin_obj.__module__ in sys.modules else None
    except AttributeError:
        source = None
    qual = f"{origin_obj.__module__}.{origin_obj.__qualname__}"
    origin = f"{origin_obj.__qualname__} ({qual}{', ' + Path(source).name if source else ''})"
    origin = re.sub(r"[\\\x00-\x1f\"]|\*/|/\*", "", origin)
    text = _render(st, name or _snake(fn_name), origin, output)
    if _timing is not None:
        _timing["seconds"] = time.perf_counter() - start
    return text


def _example_inputs(torch: Any, example_input: Any) -> tuple:
    """The example tensors: one tensor or shape, or a tuple (list) of them (x first)."""

    def one(e: Any) -> Any:
        if isinstance(e, (tuple, list)) and e and all(isinstance(d, int) and not isinstance(d, bool) for d in e):
            return torch.randn(*e, dtype=torch.float64)
        if isinstance(e, torch.Tensor):
            return e
        raise TorchImportError(
            "from_torch: example_input must be a tensor or a shape (a tuple of ints), or a tuple of them "
            f"for a forward of several tensors; got {type(e).__name__}"
        )

    several = (
        isinstance(example_input, (tuple, list))
        and example_input
        and not all(isinstance(d, int) for d in example_input)
    )
    return tuple(one(e) for e in example_input) if several else (one(example_input),)


def _argument_names(fn: Any, count: int) -> list[str]:
    """The names of the forward's first ``count`` positional parameters (``x``, then the names
    the tensors beside it keep); ``t1, t2, ...`` where the signature does not say."""
    import inspect

    try:
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"t{i}" for i in range(count)]


def from_torch(module_or_function: Any, example_input: Any, *, name: str | None = None) -> Spec:
    """Read a ``torch.nn.Module`` (or a function of tensors) as a :class:`Spec`.

    The forward is traced with ``torch.export`` on ``example_input`` (a tensor, or a shape:
    a float64 tensor of that shape; a tuple of them for a forward of several tensors) and its core ATen graph mapped to the spec language: see
    this module's docstring. ``name`` names the layer (default: the class or function name in
    snake case). What cannot be a spec raises :class:`TorchImportError` with one line naming
    the operation and the source line."""
    text = from_torch_toml(module_or_function, example_input, name=name)
    try:
        return parse_spec(text, source=f"<imported {name or 'layer'}>")
    except TorchImportError:
        raise
    except SpecError as exc:
        raise TorchImportError(f"the imported spec is not valid: {exc}") from None


def resolve_target(target: str) -> Any:
    """``PATH:NAME`` (a Python file and a class or function in it) or ``package.module:NAME``:
    the object named. A TorchImportError naming what is missing otherwise."""
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr:
        raise TorchImportError(f"{target}: expected PATH:NAME or package.module:NAME")
    path = Path(where)
    try:
        if path.suffix == ".py" or path.exists():
            if not path.is_file():
                raise TorchImportError(f"{target}: {where} is not a file")
            spec = importlib.util.spec_from_file_location(f"_derivgen_import_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            sys.modules[spec.name] = module  # type: ignore[union-attr]
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(where)
    except TorchImportError:
        raise
    except Exception as exc:  # noqa: BLE001 -- the user's file: any error it raises on import
        raise TorchImportError(f"{target}: cannot import {where}: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TorchImportError(f"{target}: {where} has no {attr}")
        obj = getattr(obj, part)
    return obj


def import_command_main(
    target: str,
    shape: tuple,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    name: str | None = None,
) -> tuple[str, float]:
    """What ``derivgen import PATH:NAME --shape 2,8 [--args ...] -o out.toml`` does: resolve the
    target, instantiate a class with ``args``/``kwargs`` (a function is used as it is), trace
    it on a float64 tensor of ``shape`` (a tuple of shapes: one tensor each, x first) and return (the spec's TOML text, seconds taken). The
    text has been checked by the spec parser. Errors are :class:`TorchImportError` (one line)."""
    torch = _torch()

    obj = resolve_target(target)
    if isinstance(obj, type):
        if not issubclass(obj, torch.nn.Module):
            raise TorchImportError(f"{target}: {obj.__name__} is not a torch.nn.Module")
        try:
            obj = obj(*args, **(kwargs or {}))
        except Exception as exc:  # noqa: BLE001 -- the user's constructor
            raise TorchImportError(f"{target}: {obj.__name__}(...) failed: {type(exc).__name__}: {exc}") from None
    elif not callable(obj):
        raise TorchImportError(f"{target}: not a class or function")
    timing: dict = {}
    text = from_torch_toml(obj, tuple(shape), name=name, _timing=timing)
    try:
        parse_spec(text, source=target)
    except SpecError as exc:
        raise TorchImportError(f"the imported spec is not valid: {exc}") from None
    return text, timing["seconds"]
