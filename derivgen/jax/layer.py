"""A layer as a JAX function whose derivatives are derivgen's closed forms.

``f = derivgen.jax.function("layernorm")``; ``y = f(x, gamma, beta, eps=1e-5)``. The
forward is the generated ``jax.numpy`` program; it is a :func:`jax.custom_jvp` whose
rule is the JVP derivgen derived, so forward mode (``jvp``, ``jacfwd``, ``hessian``,
forward-over-reverse) runs the closed form, and JAX obtains reverse mode (``grad``,
``vjp``, ``jacrev``) by transposing it. ``rule="vjp"`` makes it a
:func:`jax.custom_vjp` over the derived closed-form backward instead (reverse mode
only, as every ``custom_vjp``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp

from derivgen.jax.layout import JaxLayout, make_layout
from derivgen.jax.load import module, spec_of
from derivgen.runtime.meta import LayerMeta, layer_meta
from derivgen.runtime.validate import bind_arguments, check_float, layout_from_shapes
from derivgen.spec.model import Spec

RULES = ("jvp", "vjp")


def compute_dtype(dtype) -> jnp.dtype:
    """The arithmetic's dtype for inputs of ``dtype``: float32 at least (bfloat16 and float16
    inputs are normalized in float32; float64 stays float64)."""
    return jnp.promote_types(jnp.dtype(dtype), jnp.float32)


def _kw(meta: LayerMeta, options: dict, params, inputs, buffers, tensors=()) -> dict:
    return {
        **dict(zip(meta.tensors, tensors)),
        **dict(zip(meta.params, params)),
        **dict(zip(meta.inputs, inputs)),
        **dict(zip(meta.buffers, buffers)),
        **options,
    }


@functools.lru_cache(maxsize=512)
def rule(mod: ModuleType, mode: str, L: JaxLayout, options: tuple, kind: str = "jvp"):
    """``core(x, params, inputs, buffers) -> y`` on views (tuples of arrays in spec order),
    for one mode, layout and set of options: a ``custom_jvp`` with the derived JVP as its
    rule (``kind="jvp"``), or a ``custom_vjp`` with the derived VJP (``kind="vjp"``)."""
    meta = layer_meta(mod.META)
    opts = dict(options)
    forward = mod.FORWARD[mode]
    if meta.tensors or meta.outputs:
        return _multi_rule(mod, mode, L, opts, kind)
    if kind == "jvp":
        _, seed_p, seed_i = mod.JVP_SEEDS[mode]
        jvp = mod.JVP[mode]

        @jax.custom_jvp
        def core(x, params, inputs, buffers):
            return forward(x, **_kw(meta, opts, params, inputs, buffers), _L=L)[0]

        @core.defjvp
        def core_jvp(primals, tangents):
            x, params, inputs, buffers = primals
            tx, tparams, tinputs, _ = tangents  # buffers are constants (the caller stops their gradient)
            kw = _kw(meta, opts, params, inputs, buffers)
            y, stats = forward(x, **kw, _L=L)
            seeds = {seed_p[p]: t for p, t in zip(meta.params, tparams)}
            seeds.update({seed_i[i]: t for i, t in zip(meta.inputs, tinputs)})
            return y, jvp(x, tx, **seeds, **kw, _stats=stats, _L=L)

        return core
    if kind != "vjp":
        raise ValueError(f"rule must be one of {RULES}, got {kind!r}")
    backward = mod.BACKWARD[mode]

    @jax.custom_vjp
    def core(x, params, inputs, buffers):
        return forward(x, **_kw(meta, opts, params, inputs, buffers), _L=L)[0]

    def fwd(x, params, inputs, buffers):
        y, stats = forward(x, **_kw(meta, opts, params, inputs, buffers), _L=L)
        return y, (x, params, inputs, buffers, stats)

    def bwd(res, dy):
        x, params, inputs, buffers, stats = res
        dx, dparams, dinputs = backward(dy, x, **_kw(meta, opts, params, inputs, buffers), _stats=stats, _L=L)
        dp = tuple(dparams[p].reshape(v.shape).astype(v.dtype) for p, v in zip(meta.params, params))
        di = tuple(
            jnp.sum(dinputs[i]).reshape(v.shape) if v.size == 1 else dinputs[i].reshape(v.shape)
            for i, v in zip(meta.inputs, inputs)
        )
        return dx, dp, di, tuple(jnp.zeros_like(b) for b in buffers)

    core.defvjp(fwd, bwd)
    return core


def _multi_rule(mod: ModuleType, mode: str, L: JaxLayout, opts: dict, kind: str):
    """``core(x, tensors, params, inputs, buffers) -> (y, *outputs)`` for a layer with tensor
    inputs beside x (views of x's shape) or outputs beside y: a ``custom_jvp`` with the derived
    JVP along x, the tensors with a gradient, the parameters and the inputs (a tensor without a
    gradient, a mask, is a constant), or a ``custom_vjp`` over the derived VJP, whose backward
    takes a cotangent per output."""
    meta = layer_meta(mod.META)
    forward, backward = mod.FORWARD[mode], mod.BACKWARD[mode]
    names = list(meta.tensors)
    grads = {t for t, (_, grad, _) in meta.tensors.items() if grad}
    outs = list(meta.outputs)

    def outputs(y):
        return y if outs else (y,)

    if kind == "jvp":
        _, seed_p, seed_i, seed_t = mod.JVP_SEEDS[mode]
        jvp = mod.JVP[mode]

        @jax.custom_jvp
        def core_jvp(x, tensors, params, inputs, buffers):
            return outputs(forward(x, **_kw(meta, opts, params, inputs, buffers, tensors), _L=L)[0])

        @core_jvp.defjvp
        def core_rule(primals, tangents):
            x, tensors, params, inputs, buffers = primals
            tx, ttensors, tparams, tinputs, _ = tangents  # buffers and masks are constants
            kw = _kw(meta, opts, params, inputs, buffers, tensors)
            y, stats = forward(x, **kw, _L=L)
            seeds = {seed_p[p]: t for p, t in zip(meta.params, tparams)}
            seeds.update({seed_i[i]: t for i, t in zip(meta.inputs, tinputs)})
            seeds.update({seed_t[t]: v for t, v in zip(names, ttensors) if t in grads})
            return outputs(y), outputs(jvp(x, tx, **seeds, **kw, _stats=stats, _L=L))

        return core_jvp
    if kind != "vjp":
        raise ValueError(f"rule must be one of {RULES}, got {kind!r}")

    @jax.custom_vjp
    def core(x, tensors, params, inputs, buffers):
        return outputs(forward(x, **_kw(meta, opts, params, inputs, buffers, tensors), _L=L)[0])

    def fwd(x, tensors, params, inputs, buffers):
        y, stats = forward(x, **_kw(meta, opts, params, inputs, buffers, tensors), _L=L)
        return outputs(y), (x, tensors, params, inputs, buffers, stats)

    def bwd(res, cts):
        x, tensors, params, inputs, buffers, stats = res
        kw = _kw(meta, opts, params, inputs, buffers, tensors)
        cot = {"d" + o: c for o, c in zip(outs, cts[1:])}
        dx, dparams, dinputs, dtensors = backward(cts[0], x, **cot, **kw, _stats=stats, _L=L)
        dp = tuple(dparams[p].reshape(v.shape).astype(v.dtype) for p, v in zip(meta.params, params))
        di = tuple(
            jnp.sum(dinputs[i]).reshape(v.shape) if v.size == 1 else dinputs[i].reshape(v.shape)
            for i, v in zip(meta.inputs, inputs)
        )
        dt = tuple(dtensors[t] if t in grads else jnp.zeros_like(v) for t, v in zip(names, tensors))
        return dx, dt, dp, di, tuple(jnp.zeros_like(b) for b in buffers)

    core.defvjp(fwd, bwd)
    return core


class Function:
    """A layer as a JAX function (see :func:`function`)."""

    def __init__(self, spec: Spec | str | Path, rule: str = "jvp"):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        self.spec = spec_of(spec)
        self.module = module(self.spec)
        self.meta = layer_meta(self.module.META)
        self.rule = rule
        m = self.meta
        self.__doc__ = f"derivgen layer {m.name} in JAX: f(x, {', '.join(m.params)}, **options)"

    def _arguments(self, params: tuple, kw: dict) -> tuple[dict, dict, dict, dict]:
        """(parameters, inputs, options, buffers) by name, checked as derivgen.torch.function does."""
        meta = self.meta
        name = meta.name
        kw = bind_arguments(meta, params, kw)
        options = {}
        whole = set(meta.integer_options)
        for o, (default, lo, hi) in meta.options.items():
            v = kw.get(o, default)
            if v is None:
                raise TypeError(f"{name}: option {o} is required")
            if isinstance(v, jax.core.Tracer):
                raise TypeError(f"{name}: option {o} must be a Python number (options are static), got a tracer")
            options[o] = check_float(f"{name}: {o}", v, lo, hi)
            if o in whole and options[o] != int(options[o]):
                raise ValueError(f"{name}: {o} must be a whole number (a window's size), got {options[o]}")
        for i in meta.inputs:
            if i not in kw:
                raise TypeError(f"{name}: input {i} is required")
        bufs = {b: kw[b] for b in meta.buffers if kw.get(b) is not None}
        if bufs and len(bufs) != len(meta.buffers):
            raise TypeError(f"{name}: pass all of the buffers {meta.buffers} or none")
        return (
            {p: kw[p] for p in meta.params},
            {i: kw[i] for i in meta.inputs},
            options,
            bufs,
        )

    def __call__(
        self,
        x,
        *params,
        training: bool = True,
        num_groups: int | None = None,
        axis_name=None,
        channels_last: bool = False,
        return_stats: bool = False,
        **kw,
    ):
        """y; with running buffers given, ``(y, new buffers)``; with ``return_stats``, the
        statistics (a dict, per-group shapes, not differentiated) come last."""
        meta = self.meta
        name = meta.name
        tnames = list(meta.tensors)
        if tnames:  # the tensor inputs come first, after x (or by name)
            given = dict(zip(tnames, params))
            params = params[len(tnames) :]
            for t in tnames[len(given) :]:
                if t not in kw:
                    raise TypeError(f"{name}: tensor input {t} is required")
                given[t] = kw.pop(t)
            if channels_last:
                raise NotImplementedError(f"{name}: channels_last with tensor inputs is not supported yet")
        pv, iv, options, bufs = self._arguments(params, kw)
        mode = "train" if training or "eval" not in meta.modes else "eval"
        if mode == "eval" and not bufs:
            raise ValueError(f"{name}: training=False normalizes with the buffers {meta.buffers}; pass them")
        if axis_name is not None and self.rule == "vjp":
            raise ValueError(f"{name}: axis_name needs rule='jvp' (the default)")
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}: x must be a floating-point array, got {x.dtype}")
        ct = compute_dtype(x.dtype)
        pv = {p: jnp.asarray(v) for p, v in pv.items()}
        L = make_layout(
            meta,
            x.shape,
            {p: v.shape for p, v in pv.items()},
            num_groups,
            ct,
            channels_last=channels_last,
            axis_name=axis_name,
        )
        least = meta.min_group_size[mode]
        if axis_name is None and L.n_local < least:
            raise ValueError(f"{name}: {mode} mode needs at least {least} values per group, got {L.n_local}")
        scalar = set(meta.scalar_params)
        p4 = tuple(pv[p].astype(ct).reshape(L.scalar_view if p in scalar else L.param_view) for p in meta.params)
        i4 = tuple(self._per_group(n, iv[n], L, ct) for n in meta.inputs)
        b4 = tuple(jax.lax.stop_gradient(self._per_group(b, bufs[b], L, ct)) for b in bufs)
        if not bufs:  # the forward programs name the buffers: eval mode has them, train mode ignores them
            b4 = tuple(jnp.zeros(L.stat_view, ct) for _ in meta.buffers)
        core = rule(self.module, mode, L, tuple(sorted(options.items())), self.rule)
        if meta.tensors or meta.outputs:
            t4 = tuple(self._tensor(t, given[t], x, pv, num_groups, ct, L) for t in tnames)
            ys = core(x.astype(ct).reshape(L.view), t4, p4, i4, b4)
            y = tuple(v.reshape(x.shape).astype(x.dtype) for v in ys)
            y = y if len(y) > 1 else y[0]
        else:
            t4 = ()
            y = core(x.astype(ct).reshape(L.view), p4, i4, b4).reshape(x.shape).astype(x.dtype)
        out = [y]
        stats = None
        if (bufs and mode == "train") or return_stats:
            kw4 = _kw(meta, options, p4, i4, b4, t4)
            stats = self.module.STATISTICS[mode](jax.lax.stop_gradient(x.astype(ct).reshape(L.view)), **kw4, _L=L)
            stats = {k: jax.lax.stop_gradient(v) for k, v in stats.items()}
        if bufs:
            new = dict(bufs)
            if mode == "train":
                upd = self.module.update_buffers(
                    **{s: stats[s] for s in meta.stats["train"]},
                    **dict(zip(meta.buffers, b4)),
                    **options,
                    N=L.N,
                )
                new = {b: upd[b].reshape(jnp.shape(bufs[b])).astype(jnp.asarray(bufs[b]).dtype) for b in bufs}
            out.append(new)
        if return_stats:
            out.append({k: v.reshape(L.group_shape) for k, v in stats.items()})
        return out[0] if len(out) == 1 else tuple(out)

    def _tensor(self, t: str, v, x, pv: dict, num_groups, ct, L: JaxLayout):
        """A tensor input of its declared shape (checked), broadcast to x and viewed as x is:
        JAX sums its gradient over the broadcast axes."""
        from derivgen.runtime.tensors import broadcast_axes, tensor_shape

        meta = self.meta
        v = jnp.asarray(v)
        layout = layout_from_shapes(meta, x.shape, {p: a.shape for p, a in pv.items()}, num_groups)
        kind = meta.tensors[t][0]
        want = tensor_shape(meta, kind, layout)
        if tuple(v.shape) != want:
            raise ValueError(
                f"{meta.name}: {t} must have shape {want} ({kind!r} for x of shape {x.shape}), got {v.shape}"
            )
        shape = list(x.shape)
        for a in broadcast_axes(meta, kind, layout):
            shape[a] = 1
        return jnp.broadcast_to(v.astype(ct).reshape(shape), x.shape).reshape(L.view)

    @staticmethod
    def _per_group(what: str, v, L: JaxLayout, ct):
        """A per-group value (an input or buffer: a scalar, or one value per group) as a view."""
        v = jnp.asarray(v, dtype=ct)
        if v.size == 1:
            return v.reshape(L.scalar_view)
        if tuple(v.shape) != tuple(L.group_shape):
            raise ValueError(
                f"{what} must be a scalar or of shape {L.group_shape} (one value per group), got {v.shape}"
            )
        return v.reshape(L.stat_view)


def function(spec: Spec | str | Path, *, rule: str = "jvp") -> Function:
    """A layer as a JAX function: ``f = function("layernorm")``, then ``f(x, gamma, beta, eps=1e-5)``.

    Parameters come positionally in the spec's order (or as keywords by name), per-group
    inputs and options as keywords (options default as in the spec and are static
    Python numbers). ``training=False`` normalizes with the running buffers, passed as
    keywords; a layer given its buffers returns ``(y, new_buffers)`` (training mode
    updates them by the spec's rule; they are not differentiated). ``num_groups`` for
    group layouts; ``channels_last=True`` takes x as (N, *spatial, C) (Flax's order);
    ``axis_name`` (batch layouts) makes the statistics collective over that named axis
    (``pmap``/``shard_map``); ``return_stats=True`` also returns the statistics.
    bfloat16/float16 inputs are normalized in float32; y has x's dtype.
    """
    return Function(spec, rule)
