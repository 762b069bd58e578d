"""Small facts about tensors that the operator modules share: supported dtypes and their
kernel suffixes, the channels-last test, the runtime's 4-D view of x, fresh outputs (large
ones advised to take huge pages), NumPy views, and the shape of an operator's result."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from derivgen import runtime as rt
from derivgen.runtime.meta import LayerMeta, MetaLike, layer_meta
from derivgen.runtime.tensors import broadcast_axes

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


def layout(meta: MetaLike, x_shape: Sequence[int], param_shapes: dict, groups: int) -> rt.Layout:
    """The runtime's 4-D view of x, from shapes (``groups`` 0 for layers without groups)."""
    meta = layer_meta(meta)
    return rt.layout_from_shapes(meta, x_shape, param_shapes, groups if meta.reduce == "group" else None)


def channels_last_format(t: torch.Tensor) -> torch.memory_format:
    """The channels-last memory format of a 4-D (NHWC) or 5-D (NDHWC) tensor."""
    return torch.channels_last if t.dim() == 4 else torch.channels_last_3d


def is_channels_last(t: torch.Tensor) -> bool:
    """A channels-last tensor (NHWC / NDHWC) that is not also plain contiguous."""
    return t.dim() in (4, 5) and not t.is_contiguous() and t.is_contiguous(memory_format=channels_last_format(t))


HUGE_PAGE = 2 << 20  # bytes: an x86-64 (and 4K-granule arm64) transparent huge page
HUGE_MIN = 4 << 20  # bytes: the smallest fresh output advised to take huge pages (NumPy's rule)
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, on Linux; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def huge_pages_wanted() -> bool:
    """Whether fresh large outputs ask for transparent huge pages (``DERIVGEN_HUGE_PAGES`` is
    not ``0``)."""
    return os.environ.get("DERIVGEN_HUGE_PAGES", "1").strip().lower() not in ("0", "off", "false", "no")


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside ``[address, address + nbytes)`` with
    transparent huge pages, before anything touches them; True when the advice was taken.

    glibc maps an allocation of 32 MiB or more fresh on every call, and the first touch of
    each 4 KiB page is a page fault: filling a fresh 8192x1024 float32 tensor took 9-12 ms
    in 4 KiB pages and 2.3 ms advised (AMD EPYC guest, 2 threads), against 0.8 ms to fill it
    again. NumPy advises its own arrays of 4 MiB or more so; torch only under
    ``THP_MEM_ALLOC_ENABLE=1``. Regions under :data:`HUGE_MIN` bytes are not advised, nor any
    with ``DERIVGEN_HUGE_PAGES=0``. The advice belongs to the pages: an mmapped block drops it
    when freed, heap memory keeps it."""
    fn = _madvise()
    if fn is None or nbytes < HUGE_MIN or not huge_pages_wanted():
        return False
    lo = -(-address // HUGE_PAGE) * HUGE_PAGE
    hi = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return hi > lo and fn(lo, hi - lo, _MADV_HUGEPAGE) == 0


def fresh_like(t: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(t)``, advised to take transparent huge pages when it is a large CPU
    tensor (:func:`advise_huge_pages`): the outputs the kernels write whole (y, dx)."""
    out = torch.empty_like(t)
    if out.device.type == "cpu":
        advise_huge_pages(out.data_ptr(), out.numel() * out.element_size())
    return out


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


def tensor_kind(meta: LayerMeta, name: str) -> str:
    """How a tensor input beside x is shaped: ``x``, ``sample`` or ``position``
    (:mod:`derivgen.runtime.tensors`)."""
    return meta.tensors[name][0]


def broadcast_shape(meta: LayerMeta, name: str, L: rt.Layout) -> tuple[int, ...]:
    """A tensor input's shape with x's rank: x's shape with 1 on the axes it is broadcast over."""
    shape = list(L.x_shape)
    for ax in broadcast_axes(meta, tensor_kind(meta, name), L):
        shape[ax] = 1
    return tuple(shape)


def full_tensor(meta: LayerMeta, name: str, t: torch.Tensor, L: rt.Layout) -> torch.Tensor:
    """A tensor input at x's shape: itself (one of x's shape), else a broadcast view
    (stride 0 along the axes it is broadcast over; autograd sums its gradient over them)."""
    if tensor_kind(meta, name) == "x":
        return t
    return t.reshape(broadcast_shape(meta, name, L)).expand(tuple(L.x_shape))


def tensor_grad(meta: LayerMeta, name: str, d: torch.Tensor, L: rt.Layout, shape: Sequence[int]) -> torch.Tensor:
    """A tensor input's gradient from its element gradients ``d`` (x's shape): summed over
    the axes it is broadcast over (in float64 for a low-precision dtype's accuracy), shaped
    like the tensor; one of x's shape is ``d`` itself."""
    kind = tensor_kind(meta, name)
    if kind == "x":
        return d.reshape(tuple(shape))
    axes = broadcast_axes(meta, kind, L)
    if not axes:
        return d.reshape(tuple(shape))
    wide_sum = d.dtype in (torch.float16, torch.bfloat16, torch.float32) and d.device.type == "cpu"
    total = d.sum(dim=axes, keepdim=True, dtype=torch.float64) if wide_sum else d.sum(dim=axes, keepdim=True)
    return total.to(d.dtype).reshape(tuple(shape))
