"""A PyTorch module or function read as a spec: :func:`from_torch`.

The forward is traced with ``torch.export`` and decomposed to core ATen; the graph is then
walked once, node by node, and each node mapped to the spec language:

* reductions over the group's dimensions (``mean``, ``sum``, ``var``, ``amax``, ``amin``)
  become statistics (``mean()``, ``sum()``, ``max()``, ``min()``); group values that element
  values read are named statistics too (after the source line's variable where the line
  assigns one, else after the operation: ``rstd``, ``std``, or ``s1, s2, ...``);
* elementwise ATen operations become expressions (``rsqrt`` as ``1/sqrt``, ``pow`` as ``**``,
  ``tanh``, ``exp``, ``clamp`` as ``clip`` ...); views and broadcasts of parameters and of
  group values are dropped (the layout places them);
* the module's parameters keep their names (``weight``, ``bias``, ``alpha``); Python numbers
  added to a statistic (an ``eps``) and numbers the module keeps as float attributes become
  options, named after the attribute, with their values as defaults;
* the layout follows from the reduced dimensions and the parameters' shapes (``trailing``:
  reductions over the last dims, parameters spanning them; ``channels``: per-channel
  parameters, reductions over space (``instance``), batch and space (``batch``), channels
  (``position``));
* dtype casts (``x.float()`` ... ``.to(input_dtype)``) are dropped and recorded in a comment;
* ``native_layer_norm`` and ``native_group_norm``, which core ATen keeps whole, are read as
  the catalogue's layer and group normalization.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from derivgen.spec.model import Spec, SpecError, parse_spec, reserved_reason

__all__ = ["TorchImportError", "from_torch", "from_torch_toml", "import_command_main", "resolve_target"]


class TorchImportError(SpecError):
    """The forward cannot be read as a spec; the one-line message names the operation and the
    source line."""


# precedence of the expression text a node stands for (higher binds tighter)
_ADD, _MUL, _NEG, _POW, _ATOM = 1, 2, 3, 4, 9

_CONST, _GROUP, _ELEM = 0, 1, 2  # a value's level: parameters and numbers, one per group, per element

# what each operation that no spec construct computes is, for the refusal
_WHY = {
    "sort": "no spec construct computes a sort",
    "argsort": "no spec construct computes a sort",
    "topk": "no spec construct computes a top-k selection",
    "kthvalue": "no spec construct computes an order statistic",
    "median": "no spec construct computes a median",
    "cumsum": "no spec construct computes a running sum",
    "cumprod": "no spec construct computes a running product",
    "mm": "a matrix product mixes the elements of the normalized axis; a spec computes element values and group means",
    "bmm": "a matrix product mixes the elements of the normalized axis; a spec computes element values and group means",
    "addmm": "a matrix product mixes the elements of the normalized axis; a spec computes element values and group means",
    "matmul": "a matrix product mixes the elements of the normalized axis; a spec computes element values and group means",
    "convolution": "a convolution mixes elements; a spec computes element values and group means",
    "gather": "indexing by a tensor has no spec construct",
    "index": "indexing by a tensor has no spec construct",
    "index_put": "an in-place update of some elements has no spec construct",
    "slice_scatter": "an in-place update of a slice has no spec construct",
    "select_scatter": "an in-place update of a slice has no spec construct",
    "scatter": "a scatter has no spec construct",
    "where": "a data-dependent selection has no spec construct (maximum/minimum/clip are the selections)",
    "gt": "a comparison of values has no spec construct",
    "lt": "a comparison of values has no spec construct",
    "ge": "a comparison of values has no spec construct",
    "le": "a comparison of values has no spec construct",
    "eq": "a comparison of values has no spec construct",
    "rand": "random numbers have no spec construct",
    "randn": "random numbers have no spec construct",
    "bernoulli": "random numbers have no spec construct",
    "native_dropout": "random numbers have no spec construct",
    "cat": "a concatenation changes the group's shape",
    "slice": "a slice of x changes the group's shape",
    "select": "a selection of some elements of x changes the group's shape",
    "permute": "a permutation of x's axes changes its layout",
    "transpose": "a permutation of x's axes changes its layout",
    "item": "a tensor read as a Python number makes the forward depend on the data",
}

_UNARY = {
    "sqrt": "sqrt",
    "exp": "exp",
    "log": "log",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "abs": "abs",
    "erf": "erf",
}

_SCATTERS = {"select_scatter", "slice_scatter", "index_put", "scatter", "masked_scatter", "copy"}
_IGNORED = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "_assert_async"}
_VIEWS = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "alias", "clone", "contiguous"}


@dataclass
class _V:
    """What a graph node stands for: expression text, its precedence, its level."""

    text: str
    prec: int
    level: int
    affine: bool = False  # a*x + b with per-group a, b (candidates for the normalized coordinate)
    scaled: bool = False  # ... and multiplied by a statistic (a normalized coordinate)
    name: str | None = None  # a declared name (statistic, parameter, option, the normalized coordinate)
    src: Any = None  # the graph node that computed it


@dataclass
class _Layout:
    kind: str = "trailing"
    reduce: str | None = None
    axes: int = 1
    dims: tuple[int, ...] | None = None  # the reduced dims of x, positive


@dataclass
class _State:
    ndim: int
    shape: tuple[int, ...]
    layout: _Layout = field(default_factory=_Layout)
    params: dict[str, dict] = field(default_factory=dict)  # name -> toml entry
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    options: dict[str, dict] = field(default_factory=dict)
    statistics: list[tuple[str, str]] = field(default_factory=list)
    normalized: tuple[str, str] | None = None
    taken: set[str] = field(default_factory=set)
    casts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    float_attrs: dict[float, str] = field(default_factory=dict)
    counter: int = 0


def _wrap(v: _V, prec: int, strict: bool = False) -> str:
    if v.prec < prec or (strict and v.prec == prec):
        return f"({v.text})"
    return v.text


def _num(value: Any) -> _V:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    text = repr(value)
    return _V(text, _ATOM if value >= 0 else _NEG, _CONST)


class _Walker:
    def __init__(self, torch: Any, ep: Any, module: Any, state: _State, fn_name: str) -> None:
        self.torch = torch
        self.ep = ep
        self.module = module
        self.st = state
        self.fn_name = fn_name
        self.def_line: int | None = None  # a function's first line, where export records none
        self.values: dict[str, Any] = {}
        self.feeds_reduction: set[str] = set()
        self.line_last: dict[tuple[str, int], str] = {}  # (file, line) -> the last node it produced

    # -- errors and source lines -------------------------------------------------------------
    def where(self, node: Any) -> tuple[str, int | None, str]:
        """(function, line, code) of the source line that made the node; a function imported
        through the wrapper module, whose lines export does not record, by its own name."""
        trace = node.meta.get("stack_trace") or ""
        found = re.findall(r'File "([^"]*)", line (\d+), in (\S+)\n\s*(.*)', trace)
        found = [f for f in found if Path(f[0]).resolve() != Path(__file__).resolve()]
        if not found:
            return self.fn_name, None, ""
        _file, line, fn, code = found[-1]
        return fn, int(line), code

    def refuse(self, node: Any, what: str, why: str) -> TorchImportError:
        fn, line, _ = self.where(node)
        at = f"{fn}, line {line}" if line is not None else fn
        if line is None and self.def_line is not None:
            at = f"{fn} (defined at line {self.def_line})"
        return TorchImportError(f"{what} in {at}: {why}")

    @staticmethod
    def op_name(node: Any) -> tuple[str, str]:
        """(namespace, operation) of a call node."""
        target = node.target
        name = getattr(target, "__name__", str(target))  # "sort.default"
        ns = getattr(target, "namespace", "aten")
        return ns, name.split(".")[0]

    def display(self, node: Any) -> str:
        ns, op = self.op_name(node)
        if ns == "aten" and op in ("mm", "bmm", "addmm", "matmul"):
            code = self.where(node)[2]
            return "a linear layer" if "linear" in code.lower() else "torch.matmul"
        return f"torch.{op}" if ns == "aten" else f"custom operator {ns}::{op}"

    # -- names ---------------------------------------------------------------------------------
    def fresh(self, preferred: str | None, fallback: str = "s") -> str:
        for cand in (preferred,):
            if cand and self.ok(cand):
                self.st.taken.add(cand)
                return cand
        while True:
            self.st.counter += 1
            cand = f"{fallback}{self.st.counter}"
            if self.ok(cand):
                self.st.taken.add(cand)
                return cand

    def ok(self, name: str) -> bool:
        return name not in self.st.taken and reserved_reason(name) is None

    def source_name(self, node: Any) -> str | None:
        """The variable the node's source line assigns, when the node is the line's last."""
        fn, line, code = self.where(node)
        if line is None or self.line_last.get((fn, line)) != node.name:
            return None
        m = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=[^=]", code)
        if not m:
            return None
        name = m.group(1).lower()
        return name if len(name) <= 31 else None

    # -- the walk --------------------------------------------------------------------------------
    def run(self) -> str:
        graph = self.ep.graph_module.graph
        sig = self.ep.graph_signature
        nodes = list(graph.nodes)
        for node in nodes:
            if node.op == "call_function":
                fn, line, _ = self.where(node)
                if line is not None:
                    self.line_last[(fn, line)] = node.name
        self.mark_reductions(nodes)
        inputs_to_params = dict(sig.inputs_to_parameters)
        inputs_to_buffers = dict(sig.inputs_to_buffers)
        user_inputs = list(sig.user_inputs)
        mutated = {**getattr(sig, "user_inputs_to_mutate", {}), **getattr(sig, "buffers_to_mutate", {})}
        if mutated:
            out = next(n for n in nodes if n.op == "output")
            for arg in out.args[0]:
                if getattr(arg, "name", None) in mutated:
                    target = mutated[arg.name]
                    what = "the input x" if target in user_inputs else f"the buffer {target}"
                    raise self.refuse(
                        arg, f"an in-place update of {what}", "a spec's forward changes none of its inputs"
                    )
        if len(user_inputs) != 1:
            raise TorchImportError(
                f"{self.fn_name}: takes {len(user_inputs)} tensor inputs; the importer reads layers of one input x"
            )
        for node in nodes:
            if node.op == "placeholder":
                self.values[node.name] = self.placeholder(node, inputs_to_params, inputs_to_buffers, user_inputs)
            elif node.op == "call_function":
                v = self.call(node)
                if isinstance(v, _V) and v.src is None:
                    v.src = node
                self.values[node.name] = v
            elif node.op == "output":
                outs = [a for a in node.args[0]]
                if len(outs) != 1:
                    raise TorchImportError(
                        f"{self.fn_name}: returns {len(outs)} tensors; the importer reads layers of one output y"
                    )
                v = self.values[outs[0].name]
                if isinstance(v, tuple) or v.level != _ELEM:
                    raise self.refuse(outs[0], "the output", "y must be an element value of x")
                return self.normalize(v).text
            else:
                raise self.refuse(node, f"graph node {node.op}", "not an operation the importer reads")
        raise TorchImportError(f"{self.fn_name}: the traced graph has no output")

    def mark_reductions(self, nodes: list) -> None:
        """Every node some reduction reads, directly or through others."""
        for node in reversed(nodes):
            if node.op != "call_function":
                continue
            _, op = self.op_name(node)
            if op in ("mean", "sum", "var", "var_mean", "amax", "amin") or node.name in self.feeds_reduction:
                for a in node.all_input_nodes:
                    self.feeds_reduction.add(a.name)

    def placeholder(self, node: Any, to_params: dict, to_buffers: dict, user_inputs: list) -> _V:
        torch = self.torch
        if node.name in user_inputs:
            return _V("x", _ATOM, _ELEM, affine=True)
        if node.name in to_params:
            target = to_params[node.name]
            tensor = self.module.get_parameter(target)
            name = target.replace(".", "_").lower()
            if reserved_reason(name) is not None or name in self.st.taken:
                raise TorchImportError(
                    f"{self.fn_name}: parameter {target!r}: {reserved_reason(name) or 'name taken'}; rename it"
                )
            self.st.taken.add(name)
            entry: dict = {}
            flat = tensor.detach().reshape(-1)
            if flat.numel() == 1:
                entry["shape"] = "scalar"
            self.st.param_shapes[name] = tuple(tensor.shape)
            if flat.numel() and bool(torch.all(flat == flat[0])):
                init = float(flat[0])
                entry["role"] = "shift" if init == 0 else "scale"
                if init not in (0.0, 1.0) or entry.get("shape") == "scalar":
                    entry["init"] = init
            self.st.params[name] = entry
            return _V(name, _ATOM, _CONST, name=name)
        constants = dict(getattr(self.ep.graph_signature, "inputs_to_lifted_tensor_constants", {}))
        if node.name in constants:
            value = self.ep.constants.get(constants[node.name])
            if value is not None and value.dim() == 0 and not value.dtype.is_complex:
                return _num(value.item())
        what = to_buffers.get(node.name, node.name)
        raise TorchImportError(
            f"{self.fn_name}: reads the buffer or constant tensor {what!r}; "
            "the importer reads parameters and Python numbers only"
        )

    # -- helpers for call nodes ---------------------------------------------------------------------
    def val(self, node: Any, arg: Any) -> _V:
        if hasattr(arg, "name") and hasattr(arg, "op"):
            v = self.values[arg.name]
            if isinstance(v, tuple):
                raise self.refuse(node, self.display(node), "reads a tuple")
            return v
        try:
            return _num(arg)
        except TypeError:
            raise self.refuse(node, self.display(node), f"an argument {arg!r} the importer cannot read") from None

    def stat(self, v: _V, node: Any, preferred: str | None) -> _V:
        """A group value an element value reads, named as a statistic."""
        if v.level != _GROUP or v.name is not None:
            return v
        name = self.fresh(self.source_name(v.src if v.src is not None else node) or preferred)
        self.st.statistics.append((name, v.text))
        return _V(name, _ATOM, _GROUP, name=name)

    def option(self, value: float, eps: bool) -> _V:
        name = self.st.float_attrs.get(value)
        if name is None and not eps:
            return _num(value)
        name = name or "eps"
        name = name.lower()
        if name in self.st.options and self.st.options[name]["default"] == value:
            return _V(name, _ATOM, _CONST, name=name)
        if name in self.st.taken or reserved_reason(name) is not None:
            name = self.fresh(None, "eps")
        self.st.taken.add(name)
        entry = {"default": value}
        if eps and value >= 0:
            entry["min"] = 0
        self.st.options[name] = entry
        return _V(name, _ATOM, _CONST, name=name)

    def reduced(self, node: Any, dims: Any, keepdim: bool) -> None:
        """Check a reduction's dims against (or fix) the layout."""
        nd = self.st.ndim
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = tuple(range(nd))
        dims = tuple(sorted({d % nd for d in dims}))
        if self.st.layout.dims is None:
            self.st.layout.dims = dims
        elif self.st.layout.dims != dims:
            raise self.refuse(
                node,
                self.display(node),
                f"reduces over dims {list(dims)}, another reduction over {list(self.st.layout.dims)}; "
                "a spec's group is one set of axes",
            )

    # -- call nodes ------------------------------------------------------------------------------
    def call(self, node: Any) -> Any:
        ns, op = self.op_name(node)
        args, kwargs = node.args, node.kwargs
        if ns != "aten":
            raise self.refuse(node, self.display(node), "derivgen cannot see inside an operator it does not know")
        if op in _IGNORED:
            return _V("0", _ATOM, _CONST)
        if op == "_to_copy" or op == "to":
            if set(kwargs) - {"dtype", "memory_format", "layout", "device"}:
                raise self.refuse(node, self.display(node), "a copy the importer cannot read")
            dtype = kwargs.get("dtype")
            if dtype is not None:
                self.st.casts.append(str(dtype).replace("torch.", ""))
            return self.val(node, args[0])
        if op in _VIEWS:
            v = self.val(node, args[0])
            if v.level == _ELEM and op not in ("alias", "clone", "contiguous"):
                shape = tuple(node.meta["val"].shape)
                if shape != self.st.shape:
                    raise self.refuse(node, f"torch.{op}", "reshapes x; a spec's layout is fixed by x's shape")
            return v
        if op == "detach":
            v = self.val(node, args[0])
            return v if v.level == _CONST else _V(f"stop_gradient({v.text})", _ATOM, v.level)
        if op in ("native_layer_norm", "native_group_norm"):
            return self.builtin_norm(node, op)
        if op in ("mean", "sum", "var", "var_mean", "amax", "amin"):
            return self.reduction(node, op)
        if op == "getitem":
            v = self.values[args[0].name]
            if not isinstance(v, tuple):
                raise self.refuse(node, "an index", "the importer reads indices of tuples only")
            return v[args[1]]
        return self.elementwise(node, op)

    def reduction(self, node: Any, op: str) -> Any:
        args, kwargs = node.args, node.kwargs
        v = self.val(node, args[0])
        if v.level != _ELEM:
            raise self.refuse(node, self.display(node), "a reduction of group values or parameters")
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
        self.reduced(node, dims, keepdim)
        if op == "mean":
            text, pref = f"mean({v.text})", ("mean" if v.text == "x" else "ms" if v.text == "x**2" else None)
        elif op == "sum":
            text, pref = f"sum({v.text})", None
        elif op in ("amax", "amin"):
            text, pref = f"{'max' if op == 'amax' else 'min'}({v.text})", None
        else:
            correction = kwargs.get("correction", 1)
            if kwargs.get("unbiased") is False:
                correction = 0
            m = self.stat(_V(f"mean({v.text})", _ATOM, _GROUP), node, "mean" if v.text == "x" else None)
            centred = f"({v.text} - {m.text})**2"
            text = f"mean({centred})"
            if correction:
                text = f"{text}*N/(N - {correction})"
            var = self.stat(_V(text, _MUL if correction else _ATOM, _GROUP), node, "var")
            return (var, m) if op == "var_mean" else var
        named = self.stat(_V(text, _ATOM, _GROUP), node, pref)
        return named

    def builtin_norm(self, node: Any, op: str) -> tuple:
        args = node.args
        x = self.val(node, args[0])
        if x.text != "x":
            raise self.refuse(node, self.display(node), "a layer or group norm of something other than x")
        if op == "native_layer_norm":
            shape, weight, bias, eps = args[1], args[2], args[3], args[4]
            k = len(shape)
            self.reduced(node, tuple(range(self.st.ndim - k, self.st.ndim)), True)
        else:
            weight, bias, _n, _c, _hw, groups, eps = args[1:8]
            if self.st.layout.dims is not None:
                raise self.refuse(node, self.display(node), "a group norm beside other reductions")
            self.st.layout = _Layout("channels", "group", 1, (-1,))
            self.st.notes.append(f"num_groups = {groups}: the generated forward takes it as its num_groups= argument")
        mean = self.stat(_V("mean(x)", _ATOM, _GROUP), node, "mean")
        var = self.stat(_V(f"mean((x - {mean.text})**2)", _ATOM, _GROUP), node, "var")
        rstd = self.stat(_V(f"1/sqrt({var.text} + {self.option(float(eps), True).text})", _MUL, _GROUP), node, "rstd")
        name = self.fresh("xhat")
        self.st.normalized = (name, f"(x - {mean.text})*{rstd.text}")
        y = _V(name, _ATOM, _ELEM, name=name)
        if weight is not None:
            w = self.val(node, weight)
            y = _V(f"{w.text}*{y.text}", _MUL, _ELEM)
        if bias is not None:
            b = self.val(node, bias)
            y = _V(f"{y.text} + {b.text}", _ADD, _ELEM)
        return (y, mean, rstd)

    def elementwise(self, node: Any, op: str) -> _V:
        args, kwargs = node.args, node.kwargs
        if op not in _ELEMENTWISE:
            why = _WHY.get(op.rstrip("_"), "not an operation the spec language has")
            first = self.values.get(getattr(args[0], "name", None)) if args else None
            if op in ("permute", "transpose", "t") and getattr(first, "name", None) in self.st.params:
                why = f"transposes the parameter {first.name}: a spec's parameters are per-feature values or scalars, not matrices"
            line = self.where(node)[:2]
            for other in node.graph.nodes:
                if (
                    other.op == "call_function"
                    and self.op_name(other)[1] in _SCATTERS
                    and self.where(other)[:2] == line
                ):
                    raise self.refuse(
                        node,
                        "an assignment to part of a tensor",
                        "an in-place update of some elements has no spec construct",
                    )
            raise self.refuse(node, self.display(node), why)
        # a Python number added to a group value is an eps: an option
        vals = []
        for i, a in enumerate(args[: _ELEMENTWISE[op]]):
            if isinstance(a, float) and not isinstance(a, bool) and op in ("add", "sub"):
                other = args[1 - i] if len(args) > 1 else None
                is_group = (
                    other is not None
                    and hasattr(other, "name")
                    and getattr(self.values.get(other.name), "level", None) == _GROUP
                )
                vals.append(self.option(a, is_group))
            elif isinstance(a, float) and not isinstance(a, bool) and op in ("mul", "div", "rsub", "clamp"):
                vals.append(self.option(a, False))
            else:
                vals.append(self.val(node, a))
        level = max(v.level for v in vals)
        if level == _ELEM:  # element values read group values by name
            vals = [self.stat(v, node, self.pref_for(v)) for v in vals]
            if node.name not in self.feeds_reduction:
                vals = [self.normalize(v) for v in vals]
        v = self.apply(node, op, vals, kwargs)
        v.level = level
        return v

    @staticmethod
    def pref_for(v: _V) -> str | None:
        if v.text.startswith("1/sqrt("):
            return "rstd"
        if v.text.startswith("sqrt("):
            return "std"
        return None

    def normalize(self, v: _V) -> _V:
        """The first normalized value an element value reads becomes the normalized coordinate."""
        if not v.scaled or v.name is not None or v.level != _ELEM:
            return v
        if self.st.normalized is not None:
            return v
        name = self.fresh("xhat")
        self.st.normalized = (name, v.text)
        return _V(name, _ATOM, _ELEM, name=name)

    def apply(self, node: Any, op: str, vals: list[_V], kwargs: dict) -> _V:
        def group_factor(v: _V) -> bool:
            return v.level == _GROUP

        if op in ("add", "sub"):
            a, b = vals
            alpha = kwargs.get("alpha", 1)
            if alpha != 1:
                b = _V(f"{_wrap(_num(alpha), _MUL)}*{_wrap(b, _MUL)}", _MUL, b.level)
            sign = "+" if op == "add" else "-"
            if b.text.startswith("-") and op == "add" and b.prec >= _MUL:
                text = f"{_wrap(a, _ADD)} - {b.text[1:]}"
            else:
                text = f"{_wrap(a, _ADD)} {sign} {_wrap(b, _ADD, strict=op == 'sub')}"
            affine = (a.affine and b.level <= _GROUP) or (b.affine and a.level <= _GROUP)
            if b.level != _CONST and a.level != _CONST and a.affine and b.affine:
                affine = False
            aff_ok = affine and not any(v.level == _CONST and v.name in self.st.params for v in (a, b))
            return _V(text, _ADD, 0, affine=aff_ok, scaled=False)
        if op == "rsub":
            a, b = vals
            return self.apply(node, "sub", [b, a], kwargs)
        if op in ("mul", "div"):
            a, b = vals
            if op == "mul":
                text = f"{_wrap(a, _MUL)}*{_wrap(b, _MUL)}"
            else:
                text = f"{_wrap(a, _MUL)}/{_wrap(b, _MUL, strict=True)}"
            param = any(v.name in self.st.params for v in (a, b))
            affine = not param and (
                (a.affine and b.level <= _GROUP) or (op == "mul" and b.affine and a.level <= _GROUP)
            )
            scaled = affine and ((a.affine and group_factor(b)) or (op == "mul" and b.affine and group_factor(a)))
            return _V(text, _MUL, 0, affine=affine, scaled=scaled)
        if op == "neg":
            return _V(f"-{_wrap(vals[0], _POW)}", _NEG, 0)
        if op in ("pow", "square"):
            base = vals[0]
            exp = _num(2) if op == "square" else vals[1]
            if exp.level != _CONST or exp.name is not None and exp.name in self.st.params:
                raise self.refuse(node, self.display(node), "an exponent that is not a number")
            if op == "pow" and node.target.__name__.startswith("pow.Scalar"):
                raise self.refuse(node, self.display(node), "a number raised to a power of x; write exp(x*log(b))")
            return _V(f"{_wrap(base, _ATOM)}**{_wrap(exp, _ATOM)}", _POW, 0)
        if op == "rsqrt":
            return _V(f"1/sqrt({vals[0].text})", _MUL, 0)
        if op == "reciprocal":
            return _V(f"1/{_wrap(vals[0], _MUL, strict=True)}", _MUL, 0)
        if op in _UNARY:
            return _V(f"{_UNARY[op]}({vals[0].text})", _ATOM, 0)
        if op == "log1p":
            return _V(f"log(1 + {vals[0].text})", _ATOM, 0)
        if op == "expm1":
            return _V(f"exp({vals[0].text}) - 1", _ADD, 0)
        if op == "relu":
            return _V(f"maximum({vals[0].text}, 0)", _ATOM, 0)
        if op in ("maximum", "minimum"):
            return _V(f"{op}({vals[0].text}, {vals[1].text})", _ATOM, 0)
        if op == "clamp":
            lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
            hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
            e = vals[0].text
            if lo is not None and hi is not None:
                return _V(f"clip({e}, {self.val(node, lo).text}, {self.val(node, hi).text})", _ATOM, 0)
            if lo is not None:
                return _V(f"maximum({e}, {self.val(node, lo).text})", _ATOM, 0)
            return _V(f"minimum({e}, {self.val(node, hi).text})", _ATOM, 0)
        if op == "softplus":
            beta = node.args[1] if len(node.args) > 1 else 1
            if beta != 1:
                return _V(f"softplus({beta!r}*{_wrap(vals[0], _MUL)})/{beta!r}", _MUL, 0)
            return _V(f"softplus({vals[0].text})", _ATOM, 0)
        raise self.refuse(node, self.display(node), "not an operation the spec language has")


# operation -> how many leading positional arguments are operands
_ELEMENTWISE = {
    "add": 2,
    "sub": 2,
    "rsub": 2,
    "mul": 2,
    "div": 2,
    "neg": 1,
    "pow": 2,
    "square": 1,
    "rsqrt": 1,
    "reciprocal": 1,
    "log1p": 1,
    "expm1": 1,
    "relu": 1,
    "maximum": 2,
    "minimum": 2,
    "clamp": 1,
    "softplus": 1,
    **{k: 1 for k in _UNARY},
}


# -- layout ---------------------------------------------------------------------------------------
def _infer_layout(st: _State, fn_name: str) -> None:
    lay = st.layout
    nd, shape = st.ndim, st.shape
    channel_params = {n: s for n, s in st.param_shapes.items() if st.params[n].get("shape") != "scalar"}
    if lay.kind == "channels" and lay.reduce == "group":
        _check_channel_params(st, channel_params, fn_name)
        return
    dims = lay.dims
    if dims is None:  # elementwise: the parameters say which axes are features
        spans = {len(_strip(s)) for s in channel_params.values()}
        k = max(spans) if spans else 1
        dims = tuple(range(nd - k, nd))
    trailing = dims == tuple(range(nd - len(dims), nd)) and len(dims) < nd
    if trailing:
        k = len(dims)
        lay.kind, lay.axes = "trailing", k
        want = shape[nd - k :]
        for n, s in channel_params.items():
            if tuple(_strip(s)) != tuple(want) or len(s) > k and any(d != 1 for d in s[: len(s) - k]):
                raise TorchImportError(
                    f"{fn_name}: parameter {n} of shape {tuple(s)} does not span the normalized axes {tuple(want)}"
                )
        if channel_params and k > 1:
            lay.axes = k  # the parameters say it; kept for a reader
        return
    if nd < 2:
        raise TorchImportError(f"{fn_name}: reduces over all of a 1-d x; give x a batch axis")
    space = tuple(range(2, nd))
    kinds = {space: "instance", (0, *space): "batch", (1,): "position", tuple(range(nd)): "all"}
    if dims not in kinds or (kinds[dims] == "instance" and not space):
        raise TorchImportError(
            f"{fn_name}: reduces over dims {list(dims)} of a {nd}-d x: neither the trailing axes nor a "
            "channel layout's (space, batch and space, channels, all)"
        )
    lay.kind, lay.reduce = "channels", kinds[dims]
    _check_channel_params(st, channel_params, fn_name)


def _strip(s: tuple[int, ...]) -> tuple[int, ...]:
    s = tuple(s)
    while s and s[0] == 1:
        s = s[1:]
    return s


def _check_channel_params(st: _State, params: dict, fn_name: str) -> None:
    c = st.shape[1]
    for n, s in params.items():
        # (C,), (C, 1, 1) or (1, C, 1, 1)
        ok = _strip(s) and _strip(s)[0] == c and all(d == 1 for d in _strip(s)[1:])
        if not ok:
            raise TorchImportError(f"{fn_name}: parameter {n} of shape {tuple(s)} is not one value per channel ({c})")


# -- TOML ---------------------------------------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _table(entry: dict) -> str:
    return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in entry.items()) + " }"


def _render(st: _State, name: str, origin: str, output: str) -> str:
    lay = st.layout
    lines = [f"# Imported by derivgen.from_torch from {origin} (torch.export, core ATen)."]
    if any(c == "float32" for c in st.casts):
        lines.append(
            "# The layer computes in float32 (x.float() ... .to(input_dtype) in its forward); the casts "
            "are dropped: the spec's arithmetic is the same in every dtype."
        )
    lines += [f"# {n}" for n in st.notes]
    lines += [
        f'name = "{name}"',
        f"title = {_toml_value(origin.split(' ')[0])}",
        f"summary = {_toml_value('Imported from ' + origin.split(' ')[0] + ' by derivgen.from_torch.')}",
        "",
        "[layout]",
        f'kind = "{lay.kind}"',
    ]
    if lay.kind == "channels":
        lines.append(f'reduce = "{lay.reduce}"')
    elif lay.axes != 1 and not any(e.get("shape") != "scalar" for e in st.params.values()):
        lines.append(f"axes = {lay.axes}")
    if st.params:
        lines += ["", "[params]"] + [f"{n} = {_table(e)}" for n, e in st.params.items()]
    if st.options:
        lines += ["", "[options]"] + [f"{n} = {_table(e)}" for n, e in st.options.items()]
    if st.statistics:
        lines += ["", "[statistics]"] + [f"{n} = {_toml_value(e)}" for n, e in st.statistics]
    if st.normalized:
        lines += ["", "[normalized]", f'name = "{st.normalized[0]}"', f"expr = {_toml_value(st.normalized[1])}"]
    lines += ["", "[output]", f"y = {_toml_value(output)}", ""]
    return "\n".join(lines)


def _snake(name: str) -> str:
    s = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    s = re.sub(r"[^a-z0-9_]", "_", s).strip("_")
    if not s or not s[0].isalpha():
        s = "layer_" + s
    return s[:31]


def _torch() -> Any:
    """torch, imported on first use; a TorchImportError saying how to get it otherwise."""
    try:
        import torch
    except ImportError:
        raise TorchImportError("importing a PyTorch layer needs PyTorch: pip install torch") from None
    return torch


# -- the entry points -----------------------------------------------------------------------------
def _export(torch: Any, module: Any, x: Any, fn_name: str) -> Any:
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(module, (x,), strict=False)
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


def from_torch_toml(
    module_or_function: Any, example_input: Any, *, name: str | None = None, _timing: dict | None = None
) -> str:
    """The spec of ``module_or_function`` (a ``torch.nn.Module`` or a function of one tensor) as
    TOML text, traced on ``example_input`` (a tensor, or a shape: a float64 tensor of that
    shape); see :func:`from_torch`."""
    torch = _torch()

    start = time.perf_counter()
    if isinstance(example_input, (tuple, list)) and all(isinstance(d, int) for d in example_input):
        example_input = torch.randn(*example_input, dtype=torch.float64)
    if not isinstance(example_input, torch.Tensor):
        raise TorchImportError("from_torch: example_input must be a tensor or a shape (a tuple of ints)")
    if isinstance(module_or_function, torch.nn.Module):
        module = module_or_function
        fn_name = type(module).__name__
        origin_obj: Any = type(module)
    elif callable(module_or_function):
        fn = module_or_function

        class _Function(torch.nn.Module):
            def forward(self, x):
                return fn(x)

        module = _Function()
        fn_name = getattr(fn, "__name__", "function")
        origin_obj = fn
    else:
        raise TorchImportError("from_torch: expected a torch.nn.Module or a function of one tensor")
    ep = _export(torch, module, example_input, fn_name)
    st = _State(ndim=example_input.dim(), shape=tuple(example_input.shape))
    for attr, value in vars(module).items():
        if isinstance(value, float) and not attr.startswith("_") and value not in st.float_attrs:
            st.float_attrs[value] = attr
    walker = _Walker(torch, ep, module, st, fn_name)
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


def from_torch(module_or_function: Any, example_input: Any, *, name: str | None = None) -> Spec:
    """Read a ``torch.nn.Module`` (or a function of one tensor) as a :class:`Spec`.

    The forward is traced with ``torch.export`` on ``example_input`` (a tensor, or a shape:
    a float64 tensor of that shape) and its core ATen graph mapped to the spec language: see
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
    shape: tuple[int, ...],
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    name: str | None = None,
) -> tuple[str, float]:
    """What ``derivgen import PATH:NAME --shape 2,8 [--args ...] -o out.toml`` does: resolve the
    target, instantiate a class with ``args``/``kwargs`` (a function is used as it is), trace
    it on a float64 tensor of ``shape`` and return (the spec's TOML text, seconds taken). The
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
