"""PyTorch autograd references for the catalogue layers (an optional oracle).

Each reference runs the layer in torch float64 under autograd. PyTorch has no
online layer norm: it is written here with torch operations from its
definition, independently of derivgen's derivation.

PyTorch is optional: every ``import torch`` here is inside the function that needs it,
so this module imports without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

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
    name: str, x: np.ndarray, params: dict[str, np.ndarray], kw: dict, dy: np.ndarray
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray | None]]:
    """Layer ``name``'s forward and backward by PyTorch autograd in float64: (y, gradients keyed
    ``dx``, ``d<param>``, ``d<input>``, the running buffers after the call (None where absent))."""
    import torch  # optional dependency

    tparams = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    extra_in = {}
    if name == "online_layernorm":
        extra_in = {
            k: torch.tensor(np.asarray(kw[k], dtype=np.float64), requires_grad=True) for k in ("prev_mean", "prev_std")
        }
    y, buffers = _forward(name, tx, tparams, extra_in, kw, x, params)
    y.backward(torch.tensor(dy, dtype=torch.float64))
    grads = {"dx": tx.grad.numpy()}
    for k, v in tparams.items():
        grads["d" + k] = v.grad.numpy()
    for k, v in extra_in.items():
        grads["d" + k] = v.grad.numpy()
    bufs = {k: (v.numpy() if v is not None else None) for k, v in buffers.items()}
    return y.detach().numpy(), grads, bufs


def torch_second_reference(
    name: str, x: np.ndarray, params: dict[str, np.ndarray], kw: dict, dy: np.ndarray, bb_seeds: dict, jvp_seeds: dict
) -> dict[str, np.ndarray]:
    """PyTorch's own second order, float64: the double backward by
    ``torch.autograd.grad(..., create_graph=True)`` and a second grad (keys ``bb.dx``,
    ``bb.ddy``, ``bb.d<p>``, ``bb.d<input>``), and ``torch.func.jvp`` of the forward
    (``jvp.ty``). Seeds are dicts by the backward's field names (dx, d<p>, d<input>) and
    by the forward's argument names (x, <p>, <input>)."""
    import torch  # optional dependency

    f64 = torch.float64
    names = list(params)
    inputs = ["prev_mean", "prev_std"] if name == "online_layernorm" else []
    tx = torch.tensor(x, dtype=f64, requires_grad=True)
    tparams = {k: torch.tensor(v, dtype=f64, requires_grad=True) for k, v in params.items()}
    ins = {k: torch.tensor(np.asarray(kw[k], dtype=np.float64), requires_grad=True) for k in inputs}
    tdy = torch.tensor(dy, dtype=f64, requires_grad=True)
    # without the running buffers in training: their update is no part of the second order
    kw_nb = {k: v for k, v in kw.items() if k not in ("running_mean", "running_var") or not kw.get("training", True)}
    y, _ = _forward(name, tx, tparams, ins, kw_nb, x, params)
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
        return _forward(name, xx, pp, ii, kw_nb, x, params)[0]

    primals = (tx.detach(), *(v.detach() for v in tparams.values()), *(v.detach() for v in ins.values()))
    tangents = tuple(torch.as_tensor(np.asarray(jvp_seeds[k], dtype=np.float64)) for k in ["x", *names, *inputs])
    _, ty = torch.func.jvp(fwd, primals, tangents)
    out["jvp.ty"] = ty.detach().numpy()
    return out


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
