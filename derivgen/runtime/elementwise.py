"""NumPy implementations of the table functions NumPy does not have (generated NumPy
code calls them as ``_rt.sigmoid``, ``_rt.erf`` ...; see ``numpy_in_runtime`` in
:mod:`derivgen.symbolic.functions`). Each keeps the floating dtype of its argument."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def _float(a) -> np.ndarray:
    """``a`` as a floating array (a Python number as float64)."""
    a = np.asarray(a)
    return a if a.dtype.kind == "f" else a.astype(np.float64)


def sigmoid(a):
    """1/(1 + exp(-a)), without overflow: exp of -|a| only."""
    a = _float(a)
    z = np.exp(-np.abs(a))
    return np.where(a >= 0, 1 / (1 + z), z / (1 + z)).astype(a.dtype, copy=False)


def softplus(a):
    """log(1 + exp(a)), without overflow: max(a, 0) + log1p(exp(-|a|))."""
    a = _float(a)
    return np.logaddexp(a, np.zeros((), a.dtype))


_erf = np.frompyfunc(math.erf, 1, 1)


def erf(a):
    """The error function, correctly rounded in double precision (the C library's, one
    element at a time: NumPy has none)."""
    a = _float(a)
    return np.asarray(_erf(a)).astype(a.dtype)


def stop_gradient(a):
    """The value itself (the derivatives are the engine's business)."""
    return a


def step(t):
    """1 where t > 0, 0 where t < 0, 1/2 at 0."""
    return np.heaviside(_float(t), 0.5)


def indicator(t):
    """1 where t >= 0, else 0."""
    return np.heaviside(_float(t), 1.0)


def numpy_function(fn) -> Callable:
    """The NumPy implementation of an entry of derivgen.symbolic.functions' table (``fn``):
    NumPy's ``fn.numpy``, or this module's where ``fn.numpy_in_runtime``."""
    if fn.numpy_in_runtime:
        return globals()[fn.numpy]
    return getattr(np, fn.numpy)
