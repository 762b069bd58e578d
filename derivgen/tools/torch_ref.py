"""PyTorch autograd references for the catalogue layers (an optional oracle).

Each reference runs the layer in torch float64 under autograd. PyTorch has no
online layer norm: it is written here with torch operations from its
definition, independently of derivgen's derivation.

PyTorch is optional: every ``import torch`` here is inside the function that needs it,
so this module imports without it.
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING

import numpy as np
import sympy

from derivgen.runtime import Layout, leading_mask
from derivgen.spec.model import N, Spec, X
from derivgen.symbolic import functions
from derivgen.symbolic.block import BlockMean
from derivgen.symbolic.reduce import GroupMax, GroupMin, Mean
from derivgen.symbolic.window import Window

if TYPE_CHECKING:  # for the annotations only; at run time torch is imported where it is used
    import torch

# the catalogue layers that have a reference here
HAS_REFERENCE = ("layernorm", "rmsnorm", "batchnorm", "instancenorm", "groupnorm", "online_layernorm")


def torch_available() -> bool:
    """Whether PyTorch can be imported."""
    try:
        import torch  # noqa: F401 -- only whether it imports
    except ImportError:
        return False
    return True


def torch_reference(
    name: str,
    x: np.ndarray,
    params: dict[str, np.ndarray],
    kw: dict,
    dy: np.ndarray,
    forward: SpecForward | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray | None]]:
    """Layer ``name``'s forward and backward by PyTorch autograd in float64: (y, gradients keyed
    ``dx``, ``d<param>``, ``d<input>``, the running buffers after the call (None where absent)).
    With ``forward`` (any spec's :class:`SpecForward`), autograd runs through it instead."""
    import torch  # optional dependency

    tparams = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    extra_in = {
        k: torch.tensor(np.asarray(kw[k], dtype=np.float64), requires_grad=True) for k in _input_names(name, forward)
    }
    if forward is not None:
        y, buffers = forward(tx, tparams, extra_in, kw)
    else:
        y, buffers = _forward(name, tx, tparams, extra_in, kw, x, params)
    y.backward(torch.tensor(dy, dtype=torch.float64))

    def grad_of(t: torch.Tensor) -> np.ndarray:
        """t's gradient (zero where y does not use t: autograd leaves it None)."""
        return t.grad.numpy() if t.grad is not None else np.zeros(tuple(t.shape))

    grads = {"dx": grad_of(tx)}
    for k, v in tparams.items():
        grads["d" + k] = grad_of(v)
    for k, v in extra_in.items():
        grads["d" + k] = grad_of(v)
    bufs = {k: (v.numpy() if v is not None else None) for k, v in buffers.items()}
    return y.detach().numpy(), grads, bufs


def torch_second_reference(
    name: str,
    x: np.ndarray,
    params: dict[str, np.ndarray],
    kw: dict,
    dy: np.ndarray,
    bb_seeds: dict,
    jvp_seeds: dict,
    forward: SpecForward | None = None,
) -> dict[str, np.ndarray]:
    """PyTorch's own second order, float64: the double backward by
    ``torch.autograd.grad(..., create_graph=True)`` and a second grad (keys ``bb.dx``,
    ``bb.ddy``, ``bb.d<p>``, ``bb.d<input>``), and ``torch.func.jvp`` of the forward
    (``jvp.ty``). Seeds are dicts by the backward's field names (dx, d<p>, d<input>) and
    by the forward's argument names (x, <p>, <input>). With ``forward``, through it."""
    import torch  # optional dependency

    f64 = torch.float64
    names = list(params)
    inputs = list(_input_names(name, forward))
    run = forward if forward is not None else (lambda tx, tp, ti, k: _forward(name, tx, tp, ti, k, x, params))
    tx = torch.tensor(x, dtype=f64, requires_grad=True)
    tparams = {k: torch.tensor(v, dtype=f64, requires_grad=True) for k, v in params.items()}
    ins = {k: torch.tensor(np.asarray(kw[k], dtype=np.float64), requires_grad=True) for k in inputs}
    tdy = torch.tensor(dy, dtype=f64, requires_grad=True)
    # without the running buffers in training: their update is no part of the second order
    # (a spec's own forward updates nothing, and may read the buffers in training too)
    if forward is not None:
        kw_nb = kw
    else:
        kw_nb = {
            k: v for k, v in kw.items() if k not in ("running_mean", "running_var") or not kw.get("training", True)
        }
    y, _ = run(tx, tparams, ins, kw_nb)
    wrt = [tx, *tparams.values(), *ins.values()]
    first = torch.autograd.grad(y, wrt, tdy, create_graph=True, allow_unused=True)
    fields = ["dx", *("d" + k for k in names), *("d" + k for k in inputs)]
    l2 = sum(
        (torch.as_tensor(np.asarray(bb_seeds[f], dtype=np.float64)) * g).sum()
        for f, g in zip(fields, first)
        if g is not None
    )
    second = torch.autograd.grad(l2, [tx, tdy, *tparams.values(), *ins.values()], allow_unused=True)
    out = {}
    for f, v, ref in zip(
        ["dx", "ddy", *("d" + k for k in names), *("d" + k for k in inputs)],
        second,
        [tx, tdy, *tparams.values(), *ins.values()],
    ):
        out["bb." + f] = (torch.zeros_like(ref) if v is None else v).detach().numpy()

    def fwd(xx: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        """y as a function of x, the parameters and the inputs (in that order), for torch.func.jvp."""
        pp = dict(zip(names, rest[: len(names)]))
        ii = dict(zip(inputs, rest[len(names) :]))
        return run(xx, pp, ii, kw_nb)[0]

    primals = (tx.detach(), *(v.detach() for v in tparams.values()), *(v.detach() for v in ins.values()))
    tangents = tuple(torch.as_tensor(np.asarray(jvp_seeds[k], dtype=np.float64)) for k in ["x", *names, *inputs])
    _, ty = torch.func.jvp(fwd, primals, tangents)
    out["jvp.ty"] = ty.detach().numpy()
    return out


def _input_names(name: str, forward: SpecForward | None) -> tuple[str, ...]:
    """The layer's inputs (per-group values with gradients): the spec's, or online layer norm's."""
    if forward is not None:
        return forward.inputs
    return ("prev_mean", "prev_std") if name == "online_layernorm" else ()


def _forward(
    name: str, tx: torch.Tensor, tparams: dict, extra_in: dict, kw: dict, x: np.ndarray, params: dict
) -> tuple:
    """y of the layer in torch operations, and the running buffers it updated."""
    import torch  # optional dependency
    import torch.nn.functional as F

    buffers = {}
    if name == "layernorm":
        y = F.layer_norm(tx, tuple(params["gamma"].shape), tparams["gamma"], tparams["beta"], kw.get("eps", 1e-5))
    elif name == "rmsnorm":
        y = F.rms_norm(tx, tuple(params["gamma"].shape), tparams["gamma"], kw.get("eps", 1e-6))
    elif name == "batchnorm":
        rm = torch.tensor(kw["running_mean"], dtype=torch.float64) if kw.get("running_mean") is not None else None
        rv = torch.tensor(kw["running_var"], dtype=torch.float64) if kw.get("running_var") is not None else None
        y = F.batch_norm(
            tx,
            rm,
            rv,
            tparams["gamma"],
            tparams["beta"],
            kw.get("training", True),
            kw.get("momentum", 0.1),
            kw.get("eps", 1e-5),
        )
        buffers = {"running_mean": rm, "running_var": rv}
    elif name == "instancenorm":
        y = F.instance_norm(tx, weight=tparams["gamma"], bias=tparams["beta"], eps=kw.get("eps", 1e-5))
    elif name == "groupnorm":
        y = F.group_norm(tx, kw["num_groups"], tparams["gamma"], tparams["beta"], kw.get("eps", 1e-5))
    elif name == "online_layernorm":
        alpha, eps = kw["alpha"], kw.get("eps", 0.0)
        pm, ps = extra_in["prev_mean"], extra_in["prev_std"]
        k = params["gamma"].ndim
        axes = tuple(range(x.ndim - k, x.ndim))
        D = int(np.prod(x.shape[x.ndim - k :]))
        expand = (...,) + (None,) * k
        mu = alpha * tx.mean(axes) + (1 - alpha) * pm
        s = torch.sqrt(((tx - mu[expand]) ** 2).sum(axes) / (D - 1) + eps)
        sigma = alpha * s + (1 - alpha) * ps
        y = tparams["gamma"] * (tx - mu[expand]) / sigma[expand] + tparams["beta"]
    else:
        raise KeyError(name)
    return y, buffers


class SpecForward:
    """A spec's own forward in torch operations, for any layer: the mode's statistics, the
    normalized coordinate and the output as the spec writes them, walked as expressions with
    each mean over the group's axes of ``layout``'s (O, G, Cg, S) view. It reads nothing the
    engine derived, so autograd through it is a reference independent of the closed forms.
    Called as ``_forward`` is: (x, parameters, inputs, keyword arguments) -> (y, no buffers)."""

    def __init__(self, spec: Spec, mode: str, layout: Layout):
        self.spec, self.mode, self.layout = spec, spec.mode(mode), layout
        self.inputs = tuple(i.name for i in spec.inputs)

    def __call__(self, tx: torch.Tensor, tparams: dict, extra_in: dict, kw: dict) -> tuple:
        import torch  # optional dependency

        spec, layout = self.spec, self.layout

        def group(v: object) -> torch.Tensor:
            """A per-group value as a 0-d tensor (one value) or in the statistics' shape."""
            t = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v, dtype=np.float64))
            return t.reshape(()) if t.numel() == 1 else t.reshape(layout.stat4)

        env: dict = {X: tx.reshape(layout.view4), N: float(layout.group_size)}
        for p in spec.params:
            v = tparams[p.name]
            env[p.symbol] = v.reshape(()) if p.scalar else v.reshape(layout.param4)
        for o in spec.options:
            if kw.get(o.name, o.default) is not None:
                env[o.symbol] = float(kw.get(o.name, o.default))
        for m in spec.masks:
            env[m.symbol] = torch.as_tensor(leading_mask(layout, env[spec.symbols[m.option].symbol]))
        for i in spec.inputs:
            env[i.symbol] = group(extra_in[i.name])
        for b in spec.buffers:
            if kw.get(b.name) is not None:
                env[b.symbol] = group(kw[b.name])
        for st in (*self.mode.statistics, *self.mode.blocks):  # group values, then block values
            env[st.symbol] = self._eval(st.expr, env)
        if spec.normalized is not None:
            env[spec.normalized.symbol] = self._eval(spec.normalized_expr, env)
        for w in spec.windows:
            env[w.symbol] = self._eval(w.expr, env)
        y = self._eval(spec.output, env) * torch.ones(layout.view4, dtype=torch.float64)
        return y.reshape(layout.x_shape), {}

    def _eval(self, expr: sympy.Expr, env: dict) -> object:
        """``expr`` in torch operations over ``env``; a Mean over the group's axes, kept."""
        import torch  # optional dependency

        if expr.is_Symbol:
            return env[expr]
        if expr.is_Number or expr.is_NumberSymbol:  # 0.5, pi
            return float(expr)
        if isinstance(expr, Mean):
            arg = self._eval(expr.args[0], env) * torch.ones(self.layout.view4, dtype=torch.float64)
            return arg.mean(dim=self.layout.reduce_axes, keepdim=True)
        if isinstance(expr, BlockMean):  # over the axes of the view one block spans
            arg = self._eval(expr.body, env) * torch.ones(self.layout.view4, dtype=torch.float64)
            return arg.mean(dim=expr.axes, keepdim=True)
        if isinstance(expr, Window):  # zero padded along the group's axis (2 of the view), then summed
            arg = self._eval(expr.body, env) * torch.ones(self.layout.view4, dtype=torch.float64)
            k, n = int(self._eval(expr.size, env)), self.layout.Cg
            before, after = ((k - 1) // 2, k // 2) if expr.transposed else (k // 2, (k - 1) // 2)
            padded = torch.cat(
                [
                    arg.new_zeros(arg.shape[:2] + (before, arg.shape[3])),
                    arg,
                    arg.new_zeros(arg.shape[:2] + (after, arg.shape[3])),
                ],
                dim=2,
            )
            return sum(padded[:, :, j : j + n] for j in range(k))
        if isinstance(expr, GroupMax):  # and GroupMin: torch.amax/amin split a tie's gradient evenly
            arg = self._eval(expr.args[0], env) * torch.ones(self.layout.view4, dtype=torch.float64)
            pick = torch.amin if isinstance(expr, GroupMin) else torch.amax
            return pick(arg, dim=self.layout.reduce_axes, keepdim=True)
        args = [self._eval(a, env) for a in expr.args]
        if expr.is_Add:
            return functools.reduce(operator.add, args)
        if expr.is_Mul:
            return functools.reduce(operator.mul, args)
        if expr.is_Pow:
            base = torch.as_tensor(args[0], dtype=torch.float64)
            root = functions.half_power_sign(expr)
            if root:
                return torch.sqrt(base) if root > 0 else 1.0 / torch.sqrt(base)
            if expr.exp.is_Integer:
                return base ** int(expr.exp)
            return base ** (float(expr.exp) if expr.exp.is_number else args[1])
        fn = functions.of_node(expr)
        if fn is None:
            raise TypeError(f"cannot evaluate {type(expr).__name__} in torch: {expr}")
        target = torch
        for part in fn.torch.split("."):
            target = getattr(target, part)
        return target(*(torch.as_tensor(a, dtype=torch.float64) for a in (*args, *fn.torch_extra)))
