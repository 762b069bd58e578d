"""Small facts about tensors that the operator modules share: supported dtypes and their
kernel suffixes, the channels-last test, the runtime's 4-D view of x, NumPy views, and
the shape of an operator's result."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from derivgen import runtime as rt

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
GENERIC_DTYPES = (*DTYPES, torch.float16)  # the device-agnostic path's
SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}  # the C kernels' names


def check_tensor(name: str, what: str, t: Any, any_device: bool = False) -> None:
    """``t`` is a tensor of a supported dtype: float32, float64 or bfloat16 on the CPU (the C
    kernels) or the meta device; with ``any_device`` (the device-agnostic path) float16 too,
    on any device. Else an error naming ``what``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if any_device:
        if t.dtype not in GENERIC_DTYPES:
            raise TypeError(
                f"{name}: {what} has dtype {t.dtype}; derivgen.torch supports float16, bfloat16, float32 and float64"
            )
        return
    if t.device.type not in ("cpu", "meta"):
        raise ValueError(f"{name}: {what} is on {t.device}; derivgen's C kernels run on the CPU")
    if t.dtype not in DTYPES:
        raise TypeError(f"{name}: {what} has dtype {t.dtype}; derivgen.torch supports float32, float64 and bfloat16")


def wide(device: torch.device) -> torch.dtype:
    """The dtype of statistics and buffer updates on a device: float64, or float32 where the
    device has no float64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def layout(meta: dict, x_shape: Sequence[int], param_shapes: dict, groups: int) -> rt.Layout:
    """The runtime's 4-D view of x, from shapes (``groups`` 0 for layers without groups)."""
    return rt.layout_from_shapes(meta, x_shape, param_shapes, groups if meta["reduce"] == "group" else None)


def channels_last_format(t: torch.Tensor) -> torch.memory_format:
    """The channels-last memory format of a 4-D (NHWC) or 5-D (NDHWC) tensor."""
    return torch.channels_last if t.dim() == 4 else torch.channels_last_3d


def is_channels_last(t: torch.Tensor) -> bool:
    """A channels-last tensor (NHWC / NDHWC) that is not also plain contiguous."""
    return t.dim() in (4, 5) and not t.is_contiguous() and t.is_contiguous(memory_format=channels_last_format(t))


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a NumPy array (no copy; the runtime copies a
    non-contiguous one once, as for NumPy callers)."""
    return t.detach().numpy()


def op_result(values: tuple) -> torch.Tensor | tuple:
    """An operator with one output returns a Tensor, not a 1-tuple (its schema says ``-> Tensor``)."""
    return values[0] if len(values) == 1 else values


def as_tuple(out: torch.Tensor | Sequence[torch.Tensor]) -> tuple:
    """An operator's result as a tuple (one Tensor: a 1-tuple)."""
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def per_group_input_grad(d: torch.Tensor, given: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A per-group input's gradient from the kernel's one value per group: summed (in
    float64) for an input given as one value, else in the input's shape."""
    return d.sum(dtype=torch.float64).to(dtype).reshape(given.shape) if given.numel() == 1 else d.reshape(given.shape)
