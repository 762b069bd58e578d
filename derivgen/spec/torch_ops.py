"""The PyTorch importer's vocabulary (:mod:`derivgen.spec.from_torch`): the error it raises,
what a node of the traced graph stands for (:class:`_V`: expression text, precedence, level),
the state the walk fills (:class:`_State`), and the tables of ATen operations: the ones it
reads as elementwise, ignores, reads as views, and refuses (with the reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from derivgen.spec.model import SpecError


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
_BUILTINS = {
    "native_layer_norm",
    "native_group_norm",
    "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit",
    "_softmax",
    "_log_softmax",
}
_REDUCTIONS = {"mean", "sum", "var", "var_mean", "amax", "amin", "avg_pool2d", "avg_pool3d"} | _BUILTINS
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
    tag: tuple | None = None  # a value only a known construct reads: a buffer, a repeated parameter, a view of x
    tensor: str | None = None  # a tensor input beside x, as it was passed (views of it broadcast it)
    # an element value seen in another arrangement of x's axes: ("perm", axes) (x.permute(axes)),
    # ("groups", G, shape) (x's channels split into G groups: (N, G, C/G, *S) or (N, G, -1))
    view: tuple | None = None


@dataclass
class _Layout:
    kind: str = "trailing"
    reduce: str | None = None
    axes: int = 1
    dims: tuple[int, ...] | None = None  # the reduced dims of x, positive
    groups: int | None = None  # reduce = "group" from x's channels split into groups: how many


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
    buffers: dict[str, dict] = field(default_factory=dict)  # name -> toml entry (init, update)
    eval_statistics: list[tuple[str, str]] = field(default_factory=list)  # [modes.eval.statistics]
    min_group_size: int | None = None  # [modes.train]
    counter: int = 0
    tensors: dict[str, dict] = field(default_factory=dict)  # tensor inputs beside x: name -> toml entry
    tensor_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    value: tuple[str, str] | None = None  # the core value the statistics read: (name, expression)
    outputs: list[tuple[str, str]] = field(default_factory=list)  # outputs beside y: (name, expression)


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
    "gelu": 1,
    "silu": 1,
    "maximum": 2,
    "minimum": 2,
    "clamp": 1,
    "softplus": 1,
    **{k: 1 for k in _UNARY},
}
