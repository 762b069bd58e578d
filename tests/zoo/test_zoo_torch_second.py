"""Second order and forward mode through every zoo layer's ``derivgen.torch.Module``, against
PyTorch's autograd of the paper's forward (the references of test_zoo.py), float64, in every
mode, on each path a module call takes (derivgen/torch/autograd.py, ``call_forward``):

* eager, through the C++ extension's autograd node where the plan is simple (contiguous
  tensors, no per-group inputs, no buffers read), else the Python per-call path
  (``_Eager``): the double backward (create_graph=True, then the VJP of every first-order
  gradient, dy's included, with random cotangents);
* eager with the extension off: the same on the Python per-call path;
* forward-mode AD with dual numbers (``torch.autograd.forward_ad``: ``_Eager.jvp``, the
  derived JVP kernel);
* ``torch.func.jvp`` (one jvp level: ``_Functional``, the JVP operator);
* ``torch.func.jvp`` of ``torch.func.vjp`` (nested transforms: the generated PyTorch
  forward), forward over reverse, against the reference's Hessian-vector product;
* within ``dt.portable()`` (``generic.Portable``): the double backward and dual numbers.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from conftest import QUICK_CFLAGS, require_module, require_torch_extension

torch = require_module("torch")
import torch.autograd.forward_ad as fwad
from test_zoo import CASES, Problem, _modes, _rel, single_tensor_zoo
from torch.func import functional_call

import derivgen.torch as dt
from derivgen.runtime.abi import reads_buffers
from derivgen.torch import ext
from derivgen.torch.ops import layer

TOL = 1e-9  # float64, relative to the largest reference value (test_zoo's second-order bound)

# eager calls of these run the Python per-call path though their plans are simple: their
# backward kernel passes more pointers than the extension's calls take (MAX_TAIL)
TOO_WIDE_FOR_THE_EXTENSION = {"switchnorm"}


@pytest.fixture(autouse=True)
def _compile_at_o1(monkeypatch):
    """Built as test_zoo.py builds the zoo's C modules (-O1): the same cached libraries."""
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)


class Setup:
    """One zoo layer's module (called with a Problem's parameters through functional_call),
    the reference, and the primals, tangents and cotangents of x, the parameters and the inputs."""

    def __init__(self, name: str):
        self.prob = prob = Problem(name, seed=3)
        features = prob.x.shape[1] if prob.spec.layout == "channels" else prob.x.shape[-1]
        self.module = dt.Module(name, features, **prob.layout_options).double()
        self.pnames, self.inames, self.bnames = list(prob.params), list(prob.inputs), list(prob.buffers)
        values = [prob.x, *prob.params.values(), *prob.inputs.values()]
        gen = torch.Generator().manual_seed(7)
        self.primals = [torch.tensor(v) for v in values]
        self.tangents = [torch.randn(np.shape(v), generator=gen, dtype=torch.float64) for v in values]
        self.cots = [torch.randn(np.shape(v), generator=gen, dtype=torch.float64) for v in values]
        self.dy = torch.tensor(prob.dy)

    def buffers(self) -> list[torch.Tensor]:
        """Fresh running buffers as the Problem gives them (a training call updates them)."""
        return [torch.tensor(v) for v in self.prob.buffers.values()]

    def _split(self, args) -> tuple:
        n, m = len(self.pnames), len(self.inames)
        x, rest = args[0], args[1:]
        ps, ins = dict(zip(self.pnames, rest[:n])), dict(zip(self.inames, rest[n : n + m]))
        return x, ps, ins, dict(zip(self.bnames, rest[n + m :]))

    def reference(self, training: bool, *args: torch.Tensor) -> torch.Tensor:
        """The paper's forward of (x, params..., inputs...), fresh buffers."""
        x, ps, ins, _ = self._split(args)
        return self.prob.torch_forward(x, ps, ins, training)

    def ours(self, training: bool, *args: torch.Tensor) -> torch.Tensor:
        """The module on (x, params..., inputs..., buffers...): under torch.func the buffers
        a training call updates must be inputs of the transformed function, as torch.nn's."""
        self.module.train(training)
        x, ps, ins, bufs = self._split(args)
        return functional_call(self.module, {**ps, **bufs}, (x,), ins)


def _double_backward(f, primals, dy, cots) -> tuple[list[torch.Tensor], str]:
    """y, the first-order gradients of <f(primals), dy> (create_graph) and their VJP with the
    cotangents ``cots`` with respect to the primals and dy (zeros where unused); and the name
    of y's grad_fn (the path the call took)."""
    args = [p.detach().clone().requires_grad_() for p in primals]
    dy = dy.detach().clone().requires_grad_()
    y = f(*args)
    grads = torch.autograd.grad(y, args, dy, create_graph=True)
    loss = sum((c * g).sum() for c, g in zip(cots, grads))
    second = torch.autograd.grad(loss, [*args, dy], allow_unused=True, materialize_grads=True)
    return [y.detach(), *(g.detach() for g in grads), *second], y.grad_fn.name()


def _dual_jvp(f, primals, tangents) -> torch.Tensor:
    """f's tangent along ``tangents`` by dual numbers (torch.autograd.forward_ad)."""
    with fwad.dual_level():
        out = f(*(fwad.make_dual(p, t) for p, t in zip(primals, tangents)))
        return fwad.unpack_dual(out).tangent


def _eager_path(name: str, mode: str) -> str:
    """The grad_fn of an eager call: the C++ extension's node where the plan is simple (no
    per-group inputs, no buffers read), else the Python per-call path's."""
    lay = layer(name)
    simple = not lay.inputs and not (reads_buffers(lay.meta, mode) and lay.buffers)
    return "DerivgenBackward" if simple and name not in TOO_WIDE_FOR_THE_EXTENSION else "_EagerBackward"


@pytest.mark.parametrize("name", sorted(CASES))
def test_zoo_module_second_order_and_forward_mode(name, monkeypatch):
    """The double backward on the eager paths (the C++ extension's node where the plan is
    simple, then the Python per-call path with the extension off) and within dt.portable();
    the JVP by dual numbers (eager and portable) and by torch.func.jvp; forward over reverse
    through torch.func; all against autograd of the paper's forward."""
    require_torch_extension()
    s, lay = Setup(name), layer(name)
    P, T, n = s.primals, s.tangents, len(s.primals)
    for training in _modes(s.prob.spec):
        mode = "train" if training else "eval"
        ref = functools.partial(s.reference, training)
        func = functools.partial(s.ours, training)  # under torch.func: the buffers as primals

        def eager(*a, func=func):
            return func(*a, *s.buffers())

        def check(what, got, want, mode=mode):
            assert len(got) == len(want), f"{name} {mode} {what}"
            for k, (a, b) in enumerate(zip(got, want)):
                if not b.abs().max() > 0:  # an exactly zero reference (an unused argument): zero
                    assert float(a.abs().max()) < 1e-12, f"{name} {mode} {what} [{k}]"
                else:
                    assert _rel(a.detach().numpy(), b) < TOL, f"{name} {mode} {what} [{k}]"

        want, _ = _double_backward(ref, P, s.dy, s.cots)
        want_ty = [torch.func.jvp(ref, tuple(P), tuple(T))[1]]
        # forward over reverse is the Hessian-vector product: the tangents as the double backward's cotangents
        want_hvp = _double_backward(ref, P, s.dy, T)[0][1 + n :][:n]

        got, grad_fn = _double_backward(eager, P, s.dy, s.cots)
        assert grad_fn == _eager_path(name, mode), f"{name} {mode}: the eager path"
        check(f"eager ({grad_fn}) double backward", got, want)
        with monkeypatch.context() as mp:  # the Python per-call path
            mp.setattr(ext, "module", lambda: None)
            mp.setattr(lay.plans, "_plans", {})
            mp.setattr(lay.plans, "last_ext", {})
            got, grad_fn = _double_backward(eager, P, s.dy, s.cots)
            assert grad_fn == "_EagerBackward", f"{name} {mode}: the Python path"
            check("Python path double backward", got, want)
        check("dual-number JVP", [_dual_jvp(eager, P, T)], want_ty)
        B = s.buffers()
        Z = [torch.zeros_like(b) for b in B]
        check("torch.func.jvp", [torch.func.jvp(func, (*P, *B), (*T, *Z))[1]], want_ty)

        def grads(*a, func=func):
            return torch.func.vjp(func, *a)[1](s.dy)[:n]

        B = s.buffers()
        check("torch.func forward over reverse", torch.func.jvp(grads, (*P, *B), (*T, *Z))[1], want_hvp)
        with dt.portable():
            got, grad_fn = _double_backward(eager, P, s.dy, s.cots)
            assert grad_fn == "PortableBackward", f"{name} {mode}: the portable path"
            check("portable double backward", got, want)
            check("portable dual-number JVP", [_dual_jvp(eager, P, T)], want_ty)


def test_every_zoo_layer_is_covered():
    assert sorted(CASES) == single_tensor_zoo()
    assert TOO_WIDE_FOR_THE_EXTENSION <= set(CASES)
