"""What the generated PyTorch modules (``generated/torch/<layer>.py``) call.

The printed expressions name their functions ``_t.sqrt``, ``_t.exp``, ``_t.maximum`` ...
(each function's name in :mod:`derivgen.symbolic.functions`): here they take tensors and
plain numbers alike (a group size N is a Python int, a statistic a tensor). The reductions are over the 4-D view (O, G, Cg, S) of
:class:`derivgen.runtime.Layout`, as in the NumPy target.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from derivgen.runtime.validate import Layout, leading_count
from derivgen.symbolic import functions

pi = math.pi


# torch functions that are constant between their jumps but have no forward-mode formula
# (torch.heaviside: the masks step and indicator): called on detached arguments, which is
# exact (their derivative is zero wherever it is defined) and lets forward-mode AD and
# torch.func.jvp through them
_PIECEWISE_CONSTANT = frozenset({"heaviside"})


def _unary(fn: functions.Elementary) -> Callable:
    """The table function ``fn`` for tensors (torch.<fn.torch>, with its extra constants) or
    plain numbers (fn.scalar); plain numbers beside a tensor become tensors of its dtype."""
    tfn = getattr(torch, fn.torch)
    detach = fn.torch in _PIECEWISE_CONSTANT

    def f(*args: torch.Tensor | float) -> torch.Tensor | float:
        like = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if like is None:
            return fn.scalar(*args)
        if len(args) == 1 and not fn.torch_extra:
            return tfn(args[0].detach() if detach else args[0])
        full = [a if isinstance(a, torch.Tensor) else like.new_tensor(a) for a in (*args, *fn.torch_extra)]
        return tfn(*(a.detach() for a in full) if detach else full)

    f.__name__ = fn.name
    return f


# sqrt, exp, log, abs, tanh, sign, maximum ...: one module attribute per table entry, by its name
globals().update({fn.name: _unary(fn) for fn in functions.TABLE.values()})


def __getattr__(name: str) -> Callable:
    """A function registered in derivgen.symbolic.functions after this module was imported."""
    fn = functions.TABLE.get(name)
    if fn is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _unary(fn)


def group_mean(L: Layout) -> Callable[[torch.Tensor], torch.Tensor]:
    """``_mean``: the mean over each normalization group, keeping the 4 dimensions.
    An operand constant along some reduced axes (a parameter) has the same mean
    as its broadcast, so it is not expanded."""
    dims = L.reduce_axes

    def mean(a: torch.Tensor) -> torch.Tensor:
        return a.mean(dim=dims, keepdim=True)

    return mean


def group_max(L: Layout) -> Callable[[torch.Tensor], torch.Tensor]:
    """``_max``: the maximum over each normalization group, keeping the 4 dimensions
    (autograd splits its gradient evenly among ties, as the derivation does)."""
    dims = L.reduce_axes
    return lambda a: a.amax(dim=dims, keepdim=True)


def group_min(L: Layout) -> Callable[[torch.Tensor], torch.Tensor]:
    """``_min``: the minimum over each normalization group, keeping the 4 dimensions."""
    dims = L.reduce_axes
    return lambda a: a.amin(dim=dims, keepdim=True)


def group_sum(L: Layout, x: torch.Tensor) -> Callable[[torch.Tensor | float], torch.Tensor]:
    """``_sum``: the sum over each group's elements held here (keeping the 4 dimensions);
    an operand constant along reduced axes (a parameter) counts once per element."""
    dims = L.reduce_axes

    def total(a: torch.Tensor | float) -> torch.Tensor:
        return _full(a, x).sum(dim=dims, keepdim=True)

    return total


def group_mean_prod(L: Layout) -> Callable[..., torch.Tensor]:
    """``_mean_prod(a, b)`` and ``_mean_sq(a)`` (one argument): the group mean of a*b."""
    mean = group_mean(L)

    def mean_prod(a: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return mean(a * (a if b is None else b))

    return mean_prod


def _full(a: torch.Tensor | float, x: torch.Tensor) -> torch.Tensor:
    """``a`` as a tensor of x's shape (a broadcast view, not a copy)."""
    a = a if isinstance(a, torch.Tensor) else torch.as_tensor(a, dtype=x.dtype, device=x.device)
    return a.expand(x.shape) if tuple(a.shape) != tuple(x.shape) else a


def leading_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """``leading(p)`` for the 4-D view x of a trailing layout: 1 on the first ⌊p·Cg⌋
    features, 0 on the rest, shaped (1, 1, Cg, 1) in x's dtype and device."""
    n = x.shape[2]
    return (torch.arange(n, device=x.device) < leading_count(float(p), n)).to(x.dtype).view(1, 1, n, 1)


def window_sum(u: torch.Tensor | float, k: float, transposed: bool, x: torch.Tensor) -> torch.Tensor:
    """``window(u, k)`` along the group's axis (axis 2 of the 4-D view x): at each element
    the sum of u over elements i - ⌊k/2⌋ .. i + ⌊(k-1)/2⌋ inside the group, zero padded
    (``transposed``: i - ⌊(k-1)/2⌋ .. i + ⌊k/2⌋); differentiable, on any device."""
    u = _full(u, x)
    k = int(k)
    lo, hi = k // 2, (k - 1) // 2
    if transposed:
        lo, hi = hi, lo
    n = x.shape[2]
    padded = torch.nn.functional.pad(u, (0, 0, lo, hi))  # zeros before and after along axis 2
    out = padded.narrow(2, 0, n)
    for d in range(1, lo + hi + 1):  # offsets -lo .. hi, summed in that order
        out = out + padded.narrow(2, d, n)
    return out


def block_mean(u: torch.Tensor | float, axes: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    """``mean(u, kind)`` (derivgen.symbolic.block): at each element the mean of u over the
    ``axes`` of the 4-D view x one block spans, shaped like x; differentiable, on any device."""
    return _full(u, x).mean(dim=axes, keepdim=True).expand(x.shape)


def elementwise(a: torch.Tensor | float, x: torch.Tensor) -> torch.Tensor:
    """An element-level result (y, dx) with the shape of the 4-D x."""
    return _full(a, x)


def per_group(a: torch.Tensor | float, x: torch.Tensor, L: Layout) -> torch.Tensor:
    """A group-level value as a (O, G, 1, 1) or (1, G, 1, 1) tensor."""
    a = a if isinstance(a, torch.Tensor) else torch.as_tensor(a, dtype=x.dtype, device=x.device)
    return a.expand(L.stat4)


def param_sum(a: torch.Tensor | float, x: torch.Tensor, L: Layout, scalar: bool) -> torch.Tensor:
    """A parameter gradient: the element contributions summed over the axes the
    parameter does not span ((0, 3) of the view), or over everything for a scalar."""
    full = _full(a, x)
    return full.sum() if scalar else full.sum(dim=L.param_axes, keepdim=True)


def group_total(a: torch.Tensor | float, x: torch.Tensor, L: Layout) -> torch.Tensor:
    """The sum over all groups of a group-level value (a scalar parameter in the statistics)."""
    return per_group(a, x, L).sum()
