"""The PyTorch importer's walk (:mod:`derivgen.spec.from_torch`): the core ATen graph of an
exported forward read once, node by node, into expression text; reductions over the group
become statistics, Python numbers added to them options, parameters keep their names, and
what no spec can say is refused naming the operation and its source line.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from derivgen.spec import torch_builtins as builtins
from derivgen.spec.model import reserved_reason
from derivgen.spec.torch_ops import (
    _ADD,
    _ATOM,
    _CONST,
    _ELEM,
    _ELEMENTWISE,
    _GROUP,
    _IGNORED,
    _MUL,
    _NEG,
    _POW,
    _REDUCTIONS,
    _SCATTERS,
    _UNARY,
    _V,
    _VIEWS,
    _WHY,
    TorchImportError,
    _Layout,
    _num,
    _State,
    _wrap,
)

# the importer's own modules: a frame in one (the wrapper a function is traced through) is not
# the user's source line
_OWN_FILES = frozenset(
    Path(__file__).resolve().with_name(f)
    for f in ("from_torch.py", "torch_graph.py", "torch_ops.py", "torch_toml.py", "torch_builtins.py")
)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


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
        self.counters: set[str] = set()  # the nodes adding 1 to a batch norm's num_batches_tracked
        self.input_names: list[str] | None = None  # the forward's names of its tensor arguments
        self.tensor_of: dict[str, str] = {}  # placeholder -> the tensor input's spec name
        self.core: Any = None  # the node computing the value the statistics read, beside x

    # -- errors and source lines -------------------------------------------------------------
    def where(self, node: Any) -> tuple[str, int | None, str]:
        """(function, line, code) of the source line that made the node; a function imported
        through the wrapper module, whose lines export does not record, by its own name."""
        trace = node.meta.get("stack_trace") or ""
        found = re.findall(r'File "([^"]*)", line (\d+), in (\S+)\n\s*(.*)', trace)
        found = [f for f in found if Path(f[0]).resolve() not in _OWN_FILES]
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
                if getattr(arg, "name", None) in mutated and not builtins.buffer_update(self, arg, mutated[arg.name]):
                    target = mutated[arg.name]
                    what = "the input x" if target in user_inputs else f"the buffer {target}"
                    raise self.refuse(
                        arg, f"an in-place update of {what}", "a spec's forward changes none of its inputs"
                    )
        self.name_tensors(user_inputs, nodes)
        self.core = self.core_value(nodes, user_inputs)
        for node in nodes:
            if node.op == "placeholder":
                self.values[node.name] = self.placeholder(node, inputs_to_params, inputs_to_buffers, user_inputs)
            elif node.name in self.counters:  # num_batches_tracked + 1: no spec value
                self.values[node.name] = _V("0", _ATOM, _CONST, tag=("update",))
            elif node.op == "call_function":
                v = self.call(node)
                if isinstance(v, _V) and v.src is None:
                    v.src = node
                if node is self.core:
                    v = self.core_named(node, v)
                self.values[node.name] = v
            elif node.op == "output":
                return self.outputs(node, mutated)
            else:
                raise self.refuse(node, f"graph node {node.op}", "not an operation the importer reads")
        raise TorchImportError(f"{self.fn_name}: the traced graph has no output")

    # -- tensor inputs beside x, the core value, several outputs ----------------------------------
    def name_tensors(self, user_inputs: list, nodes: list) -> None:
        """The tensor inputs after x, named as the forward names its arguments; a bool tensor
        is a mask (0/1, no gradient)."""
        names = self.input_names or [f"t{i}" for i in range(len(user_inputs))]
        placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
        for i, pname in enumerate(user_inputs[1:], start=1):
            name = names[i].lower() if i < len(names) else f"t{i}"
            if not self.ok(name):
                raise TorchImportError(
                    f"{self.fn_name}: tensor argument {names[i]!r}: {reserved_reason(name) or 'name taken'}; rename it"
                )
            self.st.taken.add(name)
            val = placeholders[pname].meta.get("val")
            shape = tuple(val.shape) if val is not None else self.st.shape
            dtype = getattr(val, "dtype", None)
            entry: dict = {}
            if dtype is not None and dtype == self.torch.bool:
                entry["mask"] = True
            elif dtype is not None and not dtype.is_floating_point:
                raise TorchImportError(
                    f"{self.fn_name}: tensor argument {names[i]!r} is {str(dtype).replace('torch.', '')}; "
                    "a tensor beside x is floating point, or bool for a mask"
                )
            self.st.tensors[name] = entry
            self.st.tensor_shapes[name] = shape
            self.tensor_of[pname] = name

    def core_value(self, nodes: list, user_inputs: list) -> Any:
        """Where the statistics read a tensor input that has a gradient, the node computing the
        value they read (``h = x + residual``): the first element node every path from x and
        those tensors to the reductions and outputs passes through. None where they read x and
        constants only."""
        grads = {p for p in user_inputs[1:] if not self.st.tensors[self.tensor_of[p]].get("mask")}
        read = {p for p in grads if p in self.feeds_reduction}
        if not read:
            return None
        sources = {user_inputs[0], *grads}
        sinks = [
            n for n in nodes if n.op == "output" or (n.op == "call_function" and self.op_name(n)[1] in _REDUCTIONS)
        ]

        def cut_by(cand: Any) -> bool:  # no path from a source to a sink avoids cand
            seen, todo = set(), [n for n in nodes if n.name in sources]
            while todo:
                n = todo.pop()
                if n is cand or n.name in seen:
                    continue
                seen.add(n.name)
                if n in sinks and n.op == "output":
                    return False
                if n.op == "call_function" and self.op_name(n)[1] in _REDUCTIONS:
                    return False
                todo.extend(n.users)
            return True

        for cand in nodes:
            if cand.op != "call_function" or self.op_name(cand)[1] in _REDUCTIONS:
                continue
            if cut_by(cand):
                return cand
        first = next(n for n in nodes if n.name in read)
        name = self.tensor_of[first.name]
        raise TorchImportError(
            f"{self.fn_name}: the statistics read the tensor {name} and x, which are also read apart; "
            "a spec's statistics read x and its tensors through one value (h = x + residual)"
        )

    def core_named(self, node: Any, v: _V) -> _V:
        """The core value as ``[values]``: named after the source's variable (unless that is one
        of the forward's arguments), else ``h``."""
        if v.level != _ELEM:
            raise self.refuse(node, self.display(node), "the value the statistics read is not an element value")
        preferred = self.source_name(node)
        if preferred in {n.lower() for n in (self.input_names or [])}:
            preferred = None
        name = self.fresh(preferred or "h", "h")
        self.st.value = (name, v.text)
        return _V(name, _ATOM, _ELEM, affine=True, name=name, src=node)

    def outputs(self, node: Any, mutated: dict) -> str:
        """y (the first tensor returned) as text; the tensors returned after it as outputs
        beside y, named after the value they are or ``out1, out2, ...``."""
        outs = [a for a in node.args[0] if getattr(a, "name", None) not in mutated]
        if not outs:
            raise TorchImportError(f"{self.fn_name}: returns no tensor")
        texts = []
        for i, a in enumerate(outs):
            v = self.values.get(getattr(a, "name", None))
            if not isinstance(v, _V) or v.level != _ELEM:
                what = "the output" if i == 0 else f"output {i + 1}"
                raise self.refuse(a, what, "y and the outputs beside it must be element values of x")
            if v.view is not None:
                raise self.refuse(
                    a, "the output" if i == 0 else f"output {i + 1}", "x's values with its axes rearranged"
                )
            v = self.normalize(v)
            texts.append(v)
        for v in texts[1:]:
            value = self.st.value
            name = value[0] if value and v.text == value[0] else self.fresh(f"out{len(self.st.outputs) + 1}", "out")
            self.st.outputs.append((name, v.text))
        return texts[0].text

    def mark_reductions(self, nodes: list) -> None:
        """Every node some reduction reads, directly or through others."""
        for node in reversed(nodes):
            if node.op != "call_function":
                continue
            _, op = self.op_name(node)
            if op in _REDUCTIONS or node.name in self.feeds_reduction:
                for a in node.all_input_nodes:
                    self.feeds_reduction.add(a.name)

    def placeholder(self, node: Any, to_params: dict, to_buffers: dict, user_inputs: list) -> _V:
        torch = self.torch
        if node.name in self.tensor_of:
            name = self.tensor_of[node.name]
            return _V(name, _ATOM, _ELEM, name=name, tensor=name)
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
        if node.name in to_buffers:  # read by a batch norm only (val refuses it elsewhere)
            target = to_buffers[node.name]
            name = target.replace(".", "_").lower()
            if reserved_reason(name) is not None or name in self.st.taken:
                raise TorchImportError(
                    f"{self.fn_name}: buffer {target!r}: {reserved_reason(name) or 'name taken'}; rename it"
                )
            self.st.taken.add(name)
            return _V(name, _ATOM, _CONST, name=name, tag=("buffer", target))
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
            if v.tag is not None:
                raise self.tagged(node, v)
            return v
        try:
            return _num(arg)
        except TypeError:
            raise self.refuse(node, self.display(node), f"an argument {arg!r} the importer cannot read") from None

    def tagged(self, node: Any, v: _V) -> TorchImportError:
        """The refusal of an operation reading a value only a whole layer reads."""
        if v.tag[0] == "buffer":
            return self.refuse(
                node,
                self.display(node),
                f"reads the buffer {v.tag[1]!r}; the importer reads buffers as a batch norm's running statistics only",
            )
        if v.tag[0] == "repeat":
            return self.refuse(node, self.display(node), f"reads the parameter {v.name} repeated")
        if v.tag[0] == "update":
            return self.refuse(node, self.display(node), "reads a running statistic's new value")
        return self.refuse(node, self.display(node), "reads x reshaped; a spec's layout is fixed by x's shape")

    def param_arg(self, node: Any, arg: Any) -> _V:
        """A whole layer's weight or bias: a parameter (or the parameter repeated per sample,
        as instance norm passes it to batch norm)."""
        v = self.values[arg.name] if hasattr(arg, "name") else None
        if v is None or v.name not in self.st.params:
            raise self.refuse(node, self.display(node), "a weight or bias that is not one of the module's parameters")
        return _V(v.name, _ATOM, _CONST, name=v.name)

    def stat(self, v: _V, node: Any, preferred: str | None) -> _V:
        """A group value an element value reads, named as a statistic (once: a group value
        read twice, or computed twice alike, is one statistic)."""
        if v.level != _GROUP or v.name is not None:
            return v
        same = next((n for n, text in self.st.statistics if text == v.text), None)
        if same is not None:
            return _V(same, _ATOM, _GROUP, name=same)
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
        arg = node.args[0] if node.args else None
        seen = tuple(arg.meta["val"].shape) if hasattr(arg, "meta") and "val" in arg.meta else self.st.shape
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = tuple(range(len(seen)))
        dims = tuple(sorted({d % len(seen) for d in dims}))
        v = self.values.get(getattr(arg, "name", None))
        if isinstance(v, _V) and v.view is not None:
            dims = self.view_dims(node, v, dims)
            if dims is None:
                return
            seen = self.st.shape
        plain = _squeezed(self.st.shape) == self.st.shape
        if len(seen) != nd and plain and _squeezed(seen) == self.st.shape:  # x seen with size-1 axes inserted
            axes = [i for i, d in enumerate(seen) if d != 1]
            dims = tuple(sorted(axes.index(d) for d in dims if seen[d] != 1))
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
            src = self.values.get(getattr(args[0], "name", None))
            if isinstance(src, _V) and src.tag == ("update",):  # a running statistic cast to its buffer's dtype
                return src
            dtype = kwargs.get("dtype")
            v = self.val(node, args[0])
            if dtype is not None and not (v.tensor is not None and self.st.tensors[v.tensor].get("mask")):
                self.st.casts.append(str(dtype).replace("torch.", ""))
            return v
        if op in _VIEWS:
            return self.view(node, op)
        if op in ("permute", "transpose") and self.permutable(args[0]):
            return self.permute(node, op)
        if op == "repeat":
            v = self.values.get(getattr(args[0], "name", None))
            if v is not None and v.name in self.st.params and v.tag is None:
                return _V(v.name, _ATOM, _CONST, name=v.name, tag=("repeat",))
            raise self.refuse(node, "torch.repeat", "a repetition changes the group's shape")
        if op == "constant_pad_nd":
            return builtins.lrn_pad(self, node)
        if op in ("avg_pool2d", "avg_pool3d"):
            return builtins.lrn_pool(self, node, op)
        if op == "detach":
            v = self.val(node, args[0])
            return v if v.level == _CONST else _V(f"stop_gradient({v.text})", _ATOM, v.level)
        if op in ("native_layer_norm", "native_group_norm"):
            return builtins.layer_or_group_norm(self, node, op)
        if op.startswith("_native_batch_norm_legit"):
            return builtins.batch_norm(self, node, op)
        if op in ("_softmax", "_log_softmax"):
            return builtins.softmax(self, node, op)
        if op in ("mean", "sum", "var", "var_mean", "amax", "amin"):
            return self.reduction(node, op)
        if op == "getitem":
            v = self.values[args[0].name]
            if not isinstance(v, tuple):
                raise self.refuse(node, "an index", "the importer reads indices of tuples only")
            return v[args[1]]
        return self.elementwise(node, op)

    def view(self, node: Any, op: str) -> _V:
        """A view: of a parameter or group value, dropped (the layout places it); of x, only
        with x's shape, or as a whole layer's reshape (instance norm's (1, N*C, ...), local
        response norm's (N, 1, C, ...))."""
        v = self.values[node.args[0].name] if hasattr(node.args[0], "name") else self.val(node, node.args[0])
        if isinstance(v, tuple):
            raise self.refuse(node, self.display(node), "reads a tuple")
        if v.level != _ELEM or op in ("alias", "clone", "contiguous"):
            if v.tag is not None and v.tag[0] in ("buffer", "update"):
                raise self.tagged(node, v)
            return v
        shape, st = tuple(node.meta["val"].shape), self.st
        if v.tensor is not None:  # a tensor beside x broadcast (DiT's scale.unsqueeze(1)): the layout places it
            return v
        if v.view is not None or v.tag is None and self.grouped_shape(shape):
            return self.rearranged(node, op, v, shape)
        if shape == st.shape:
            if v.tag is not None and v.tag[0] not in ("instance", "channel_pooled"):
                raise self.tagged(node, v)
            return _V(v.text, v.prec, v.level, v.affine, v.scaled, v.name, v.src, tensor=v.tensor)
        if v.tag == ("channel_pooled",):
            return v
        reshaped = builtins.instance_view(self, node, v, shape) or builtins.lrn_view(self, node, v, shape)
        if reshaped is not None:
            return reshaped
        if _squeezed(shape) == st.shape and v.tag is None:  # size-1 axes inserted (one group: view(..., 1, D))
            return _V(v.text, v.prec, v.level, v.affine, v.scaled, v.name, v.src, tensor=v.tensor)
        last = st.shape[-1]
        if len(shape) == len(st.shape) + 1 and shape[:-2] == st.shape[:-1] and shape[-2] * shape[-1] == last:
            raise self.refuse(
                node,
                f"torch.{op}",
                f"splits the last axis into {shape[-2]} groups of {shape[-1]}: statistics over groups of "
                "features within a row have no spec construct (one group of all the features imports)",
            )
        raise self.refuse(node, f"torch.{op}", "reshapes x; a spec's layout is fixed by x's shape")

    # -- x's axes rearranged: permuted (timm's LayerNorm2d), channels split into groups (EvoNorm) --
    def permutable(self, arg: Any) -> bool:
        v = self.values.get(getattr(arg, "name", None))
        return isinstance(v, _V) and v.level == _ELEM and v.tag is None and v.name not in self.st.params

    def permute(self, node: Any, op: str) -> _V:
        """x (or an element value) with its axes permuted: the same values, the view recording
        which axis of x each axis is."""
        v = self.values[node.args[0].name]
        nd = self.st.ndim
        if v.view is not None and v.view[0] != "perm":
            raise self.refuse(node, f"torch.{op}", "permutes x's channels split into groups")
        now = v.view[1] if v.view is not None else tuple(range(nd))
        if op == "permute":
            order = [d % nd for d in node.args[1]]
        else:
            a, b = node.args[1] % nd, node.args[2] % nd
            order = list(range(nd))
            order[a], order[b] = b, a
        new = tuple(now[d] for d in order)
        view = None if new == tuple(range(nd)) else ("perm", new)
        return dataclasses.replace(v, view=view, src=None)

    def grouped_shape(self, shape: tuple[int, ...]) -> int | None:
        """G where ``shape`` is x (N, C, *S) with its channels split into G groups: (N, G, C/G, *S),
        or (N, G, C/G·prod(S))."""
        xs = self.st.shape
        if len(xs) < 3 or len(shape) < 3 or shape[0] != xs[0] or shape[1] in (1, xs[1]) or xs[1] % shape[1]:
            return None
        if len(shape) == len(xs) + 1 and shape[1] * shape[2] == xs[1] and shape[3:] == xs[2:]:
            return shape[1]
        if len(shape) == 3 and shape[1] * shape[2] == math.prod(xs[1:]):
            return shape[1]
        return None

    def rearranged(self, node: Any, op: str, v: _V, shape: tuple[int, ...]) -> _V:
        """A view of an element value whose axes are rearranged: a no-op view keeps the
        arrangement; x's shape again ends it; a split of the channels into groups starts one."""
        st = self.st
        if v.view is None:
            return dataclasses.replace(v, view=("groups", self.grouped_shape(shape), shape), src=None)
        if v.view[0] == "perm" and shape == tuple(st.shape[a] for a in v.view[1]):
            return v
        if v.view[0] == "groups" and shape == v.view[2]:
            return v
        if v.view[0] == "groups" and shape == st.shape:
            return dataclasses.replace(v, view=None, src=None)
        raise self.refuse(node, f"torch.{op}", "reshapes x; a spec's layout is fixed by x's shape")

    def view_dims(self, node: Any, v: _V, dims: tuple[int, ...]) -> tuple[int, ...] | None:
        """The reduced dims of a rearranged value as dims of x; None where they are the groups of
        channels (the layout set to reduce = "group")."""
        if v.view[0] == "perm":
            return tuple(sorted(v.view[1][d] for d in dims))
        groups, shape = v.view[1], v.view[2]
        if dims != tuple(range(2, len(shape))):
            raise self.refuse(node, self.display(node), "reduces x's channels split into groups over other dims")
        lay = self.st.layout
        if lay.kind == "channels" and lay.reduce == "group":
            if lay.groups != groups:
                raise self.refuse(node, self.display(node), "reduces over two different splits into groups")
            return None
        if lay.dims is not None:
            raise self.refuse(node, self.display(node), "a reduction over groups of channels beside other reductions")
        self.st.layout = _Layout("channels", "group", 1, (-1,), groups)
        self.st.notes.append(f"num_groups = {groups}: the generated forward takes it as its num_groups= argument")
        return None

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

    def gelu(self, node: Any, u: _V) -> _V:
        """torch's GELU, exact (``u*Φ(u)``) or its tanh approximation, as spec text."""
        how = node.args[1] if len(node.args) > 1 else node.kwargs.get("approximate", "none")
        a, t = _wrap(u, _MUL), u.text
        if how == "tanh":
            return _V(f"{a}*(1 + tanh(sqrt(2/pi)*({t} + 0.044715*{_wrap(u, _POW, strict=True)}**3)))/2", _MUL, 0)
        return _V(f"{a}*(1 + erf(({t})/sqrt(2)))/2", _MUL, 0)

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
            elif isinstance(a, float) and not isinstance(a, bool) and op in ("mul", "div", "rsub", "clamp", "pow"):
                vals.append(self.option(a, False))
            else:
                vals.append(self.val(node, a))
        level = max(v.level for v in vals)
        views = {v.view for v in vals if v.level == _ELEM}
        if len(views) > 1:
            raise self.refuse(node, self.display(node), "combines x's values in two arrangements of its axes")
        if level == _ELEM:  # element values read group values by name
            vals = [self.stat(v, node, self.pref_for(v)) for v in vals]
            if node.name not in self.feeds_reduction:
                vals = [self.normalize(v) for v in vals]
        v = self.apply(node, op, vals, kwargs)
        v.level = level
        v.view = next(iter(views)) if views else None
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
            name, text = self.st.normalized
            return _V(name, _ATOM, _ELEM, name=name) if text == v.text else v
        name = self.fresh(f"{self.st.value[0]}hat" if self.st.value else "xhat")
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
        if op == "silu":
            return _V(f"{_wrap(vals[0], _MUL)}*sigmoid({vals[0].text})", _MUL, 0)
        if op == "gelu":
            return self.gelu(node, vals[0])
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
