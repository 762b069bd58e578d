"""Flax NNX modules computed by derivgen (Flax's documentation leads with NNX).

Each catalogue twin *is* its ``flax.nnx`` namesake (a subclass): the same constructor,
defaults, parameter names (``scale``, ``bias``), variable collections (``nnx.Param``,
``nnx.BatchStat`` ``mean``/``var``) and ``train()``/``eval()`` behaviour, and
``isinstance(m, nnx.LayerNorm)`` holds. Only the arithmetic is replaced: the forward is
:func:`derivgen.jax.function` (the generated forward, differentiated through the derived
JVP), the statistics two-pass (``use_fast_variance`` is accepted and has no effect).
Options derivgen does not implement (``mask``, other reduction or feature axes,
``axis_index_groups``) raise ``NotImplementedError``.

:class:`Module` makes any spec (a catalogue name or a spec file) an NNX module.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from derivgen.jax.layer import function
from derivgen.spec.model import Spec

__all__ = ["BatchNorm", "GroupNorm", "LayerNorm", "Module", "RMSNorm"]


def _unsupported(name: str, **given) -> None:
    for k, v in given.items():
        if v:
            raise NotImplementedError(f"derivgen.jax.nnx.{name}: {k} is not supported")


def _affine(m, x):
    """(x, scale, bias) promoted as Flax promotes them; a missing scale or bias as its identity."""
    scale = m.scale[...] if getattr(m, "scale", None) is not None else None
    bias = m.bias[...] if getattr(m, "bias", None) is not None else None
    x, scale, bias = m.promote_dtype((x, scale, bias), dtype=m.dtype)
    out = dtypes.canonicalize_dtype(*(a for a in (x, scale, bias) if a is not None), dtype=m.dtype)
    n = x.shape[-1]
    scale = jnp.ones(n, x.dtype) if scale is None else scale
    bias = jnp.zeros(n, x.dtype) if bias is None else bias
    return x, scale, bias, out


def _last_axis(name: str, x, *axes) -> None:
    for a in axes:
        if a not in (-1, x.ndim - 1, (-1,), (x.ndim - 1,)):
            raise NotImplementedError(f"derivgen.jax.nnx.{name}: only the last axis (-1), got {a}")


class LayerNorm(nnx.LayerNorm):
    """flax.nnx.LayerNorm, computed by derivgen's layer ``layernorm``."""

    def __call__(self, x, *, mask=None):
        _unsupported("LayerNorm", mask=mask is not None, axis_name=self.axis_name is not None)
        _last_axis("LayerNorm", x, self.reduction_axes, self.feature_axes)
        x, scale, bias, out = _affine(self, x)
        return function("layernorm")(x, scale, bias, eps=self.epsilon).astype(out)


class RMSNorm(nnx.RMSNorm):
    """flax.nnx.RMSNorm, computed by derivgen's layer ``rmsnorm``."""

    def __call__(self, x, mask=None):
        _unsupported("RMSNorm", mask=mask is not None, axis_name=self.axis_name is not None)
        _last_axis("RMSNorm", x, self.reduction_axes, self.feature_axes)
        x, scale, _, out = _affine(self, x)
        return function("rmsnorm")(x, scale, eps=self.epsilon).astype(out)


class GroupNorm(nnx.GroupNorm):
    """flax.nnx.GroupNorm (x of shape (N, *spatial, C)), computed by derivgen's layer ``groupnorm``."""

    def __call__(self, x, *, mask=None):
        _unsupported(
            "GroupNorm",
            mask=mask is not None,
            axis_name=self.axis_name is not None,
            reduction_axes=self.reduction_axes is not None,
        )
        x, scale, bias, out = _affine(self, x)
        f = function("groupnorm")
        return f(x, scale, bias, num_groups=self.num_groups, eps=self.epsilon, channels_last=True).astype(out)


class BatchNorm(nnx.BatchNorm):
    """flax.nnx.BatchNorm, computed by derivgen's layer ``batchnorm``: batch statistics
    (collective over ``axis_name``), running averages updated as Flax updates them
    (``mean <- momentum*mean + (1 - momentum)*batch mean``, the biased variance likewise)."""

    def __call__(self, x, use_running_average=None, *, mask=None):
        _unsupported("BatchNorm", mask=mask is not None, axis_index_groups=self.axis_index_groups is not None)
        if self.axis not in (-1, x.ndim - 1, 1):
            raise NotImplementedError(f"derivgen.jax.nnx.BatchNorm: axis must be -1 or 1, got {self.axis}")
        use_running_average = nnx.module.first_from(
            use_running_average, self.use_running_average, error_msg="BatchNorm: pass use_running_average"
        )
        last = self.axis != 1 or x.ndim == 2
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, mean, var, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype
        )
        out = dtypes.canonicalize_dtype(*(a for a in (x, scale, bias) if a is not None), dtype=self.dtype)
        n = self.num_features
        scale = jnp.ones(n, x.dtype) if scale is None else scale
        bias = jnp.zeros(n, x.dtype) if bias is None else bias
        f = function("batchnorm")
        if use_running_average:
            y, _ = f(
                x, scale, bias, running_mean=mean, running_var=var, training=False, eps=self.epsilon, channels_last=last
            )
            return y.astype(out)
        y, stats = f(x, scale, bias, eps=self.epsilon, channels_last=last, axis_name=self.axis_name, return_stats=True)
        m = self.momentum
        for v, s in ((self.mean, stats["mean"]), (self.var, stats["var"])):
            v[...] = jax.lax.stop_gradient(m * v[...] + (1 - m) * s).astype(v[...].dtype)
        return y.astype(out)


class Module(nnx.Module):
    """Any derivgen layer as an NNX module: ``Module("my_norm.toml", 256, rngs=nnx.Rngs(0))``.

    ``shape``: the normalized features (trailing layouts: an int or a tuple, the shape
    of the parameters) or the number of channels (channel layouts). Parameters are
    ``nnx.Param`` named as in the spec and initialized to its ``init`` values; running
    buffers are ``nnx.BatchStat`` (updated in training by the spec's rule; used when
    ``use_running_average``, which ``eval()`` sets); options are constructor keywords
    (defaults from the spec). ``channels_last=True`` takes x as (N, *spatial, C).
    ``__call__(x, **inputs)``: the spec's per-group inputs by name.
    """

    def __init__(
        self,
        spec: Spec | str | Path,
        shape: int | Sequence[int] = (),
        *,
        num_groups: int | None = None,
        channels_last: bool = False,
        use_running_average: bool = False,
        axis_name=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs | None = None,
        **options,
    ):
        self.fn = nnx.static(function(spec))  # not a variable: the same for every call
        meta = self._meta
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.options = dict(options)
        self.num_groups = num_groups
        self.channels_last = channels_last
        self.use_running_average = use_running_average
        self.axis_name = axis_name
        for p in meta.params:
            pshape = () if p in meta.scalar_params else shape
            setattr(self, p, nnx.Param(jnp.full(pshape, meta.param_init[p], param_dtype)))
        self.buffer_names = tuple(meta.buffers)
        for b in meta.buffers:
            if meta.reduce != "batch":
                raise NotImplementedError(
                    "derivgen.jax.nnx.Module: buffers of per-sample groups (their shape depends on x)"
                )
            setattr(self, b, nnx.BatchStat(jnp.full(shape, meta.buffer_init[b], jnp.float32)))

    @property
    def _meta(self) -> dict:
        return self.fn.meta

    def __call__(self, x, **inputs):
        meta = self._meta
        params = [getattr(self, p)[...] for p in meta.params]
        kw = dict(num_groups=self.num_groups, channels_last=self.channels_last, **self.options, **inputs)
        if not self.buffer_names:
            return self.fn(x, *params, **kw)
        bufs = {b: getattr(self, b)[...] for b in self.buffer_names}
        training = not self.use_running_average
        y, new = self.fn(x, *params, training=training, axis_name=self.axis_name if training else None, **bufs, **kw)
        if training:
            for b in self.buffer_names:
                getattr(self, b)[...] = jax.lax.stop_gradient(new[b])
        return y
