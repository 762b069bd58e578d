"""Drop-in modules for the fused normalizations LLM and SSM code calls by their own
conventions, over the zoo's layers with tensor inputs beside x and outputs beside y
(:mod:`derivgen.torch.multi`):

* :class:`FusedAddRMSNorm`: the residual add fused with RMSNorm, as vLLM's ``RMSNorm``
  called with a residual and Liger-Kernel's ``LigerFusedAddRMSNorm``:
  ``y, h = norm(x, residual)`` with ``h = x + residual`` (zoo layer ``add_rmsnorm``);
* :class:`RMSNormGated`: Mamba-2's gated (group) RMSNorm
  (``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``): ``norm(x, z)`` with the gate
  ``silu(z)`` after the norm (``norm_before_gate=True``: zoo layer ``rmsnorm_gated``) or
  before it (``False``, as Mamba2 builds it: ``rmsnorm_gated_before``).

On the CPU the C kernels run forward and backward in one pass each; elsewhere, under
torch.func and within :func:`derivgen.torch.portable`, the generated PyTorch closed forms.
"""

from __future__ import annotations

import torch
from torch import nn

from derivgen.runtime.validate import check_float
from derivgen.torch.ops import layer

__all__ = ["FusedAddRMSNorm", "RMSNormGated"]


def _eps(name: str, eps: float) -> float:
    """eps as a finite float >= 0, checked when the module is made (as torch.nn checks)."""
    try:
        return check_float("eps", eps, 0.0, None)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None


def _size(name: str, hidden_size: object) -> int:
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
        raise TypeError(f"{name}: hidden_size must be a positive int, got {hidden_size!r}")
    return hidden_size


class _Weighted(nn.Module):
    """What both modules make alike: ``hidden_size`` and ``eps`` checked, and ``weight``, a
    parameter of ones over the last axis that :meth:`reset_parameters` puts back."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.hidden_size = _size(name, hidden_size)
        self.eps = _eps(name, eps)
        self.weight = nn.Parameter(torch.ones(self.hidden_size, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """weight back to ones."""
        nn.init.ones_(self.weight)


class FusedAddRMSNorm(_Weighted):
    """Residual add + RMSNorm, fused: ``forward(x, residual)`` returns ``(y, h)`` with
    ``h = x + residual`` and ``y = h / sqrt(mean(h**2) + eps) * weight`` over the last
    axis (vLLM's ``fused_add_rms_norm``, Liger-Kernel's ``LigerFusedAddRMSNorm`` with
    offset 0): the new hidden state and the sum the next residual add takes. Gradients
    flow into x, residual and weight, and into h's own uses (its cotangent is added to
    what reaches x and residual through y).

    ``residual=None`` is plain RMSNorm and returns y alone (as vLLM's ``RMSNorm`` without
    a residual). ``weight`` starts at ones; ``variance_epsilon`` is vLLM's name for eps.
    x, residual and weight share one dtype (float32, float64, bfloat16 on the CPU's C
    kernels; float16 and other devices through the generated PyTorch)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden_size, eps, device, dtype)
        self._dg = {"add": layer("add_rmsnorm"), "plain": layer("rmsnorm")}

    @property
    def variance_epsilon(self) -> float:
        """eps, by vLLM's name."""
        return self.eps

    def extra_repr(self) -> str:
        """hidden_size and eps, for ``repr``."""
        return f"{self.hidden_size}, eps={self.eps}"

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """``(y, h)``: the normalized sum and the sum itself; y alone without a residual."""
        w = self.weight
        opts = (float(self.eps),)
        if residual is None:
            return self._dg["plain"].call("train", [x, w], opts, 0, stats=False)[0]
        return self._dg["add"].call("train", [x, residual, w], opts, 0, stats=False)[0]


class RMSNormGated(_Weighted):
    """Mamba-2's gated RMSNorm (``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``):
    ``RMSNormGated(hidden_size, eps=1e-5, group_size=None, norm_before_gate=True)``,
    ``forward(x, z=None)`` over the last axis of x.

    * ``norm_before_gate=True``: ``y = x / sqrt(mean(x**2) + eps) * weight * silu(z)``
      (zoo layer ``rmsnorm_gated``);
    * ``norm_before_gate=False`` (Mamba2's choice): ``u = x * silu(z)``, then
      ``y = u / sqrt(mean(u**2) + eps) * weight`` (``rmsnorm_gated_before``);
    * ``z=None``: no gate, plain RMSNorm (the catalogue's ``rmsnorm``);
    * ``group_size``: the last axis split into contiguous groups of ``group_size``
      features, each with its own mean square (``... (g d) -> ... g d``), the full-width
      weight applied after: x and z are viewed as (..., hidden_size // group_size,
      group_size), normalized by the same layers with a weight of ones, and multiplied by
      ``weight`` (one elementwise product more than one group takes). ``None`` (or
      ``hidden_size``) is one group, fused with the weight.

    ``weight`` starts at ones and ``bias`` is None, as in Mamba's class. x, z and weight
    share one dtype."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: int | None = None,
        norm_before_gate: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden_size, eps, device, dtype)
        name = type(self).__name__
        if group_size is not None:
            if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
                raise TypeError(f"{name}: group_size must be a positive int or None, got {group_size!r}")
            if hidden_size % group_size:
                raise ValueError(f"{name}: hidden_size ({hidden_size}) must be divisible by group_size ({group_size})")
        self.group_size = group_size
        self.norm_before_gate = bool(norm_before_gate)
        self.register_parameter("bias", None)
        self._dg = {
            "plain": layer("rmsnorm"),
            "after": layer("rmsnorm_gated"),
            "before": layer("rmsnorm_gated_before"),
        }

    def extra_repr(self) -> str:
        """hidden_size, eps, group_size and norm_before_gate, for ``repr``."""
        return (
            f"{self.hidden_size}, eps={self.eps}, group_size={self.group_size}, "
            f"norm_before_gate={self.norm_before_gate}"
        )

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """The gated (group) RMSNorm of x (gate ``silu(z)``; none when z is None)."""
        n, gs = x.shape[-1], self.group_size
        grouped = gs is not None and gs != n
        w = self.weight
        if grouped:  # (..., n) as (..., n // gs, gs): one mean square per group
            x = x.unflatten(-1, (n // gs, gs))
            z = None if z is None else z.unflatten(-1, (n // gs, gs))
            w = x.new_ones(gs)
        opts = (float(self.eps),)
        if z is None:
            y = self._dg["plain"].call("train", [x, w], opts, 0, stats=False)[0]
        else:
            lay = self._dg["after" if self.norm_before_gate else "before"]
            y = lay.call("train", [x, z, w], opts, 0, stats=False)[0]
        return y.flatten(-2) * self.weight if grouped else y
