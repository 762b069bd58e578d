"""Every derived layer as PyTorch operators in the ``derivgen`` namespace.

For each mode of a layer (``train``; ``eval`` where the spec has one) two
operators, defined with explicit schemas and no mutation::

    derivgen::<layer>_<mode>_forward(x, params..., inputs..., [buffers...], options..., groups)
        -> (y, statistic...)
    derivgen::<layer>_<mode>_backward(dy, x, params..., inputs..., [buffers...], statistics...,
                                      options..., groups)
        -> (dx, dparam..., dinput...)

Their CPU kernels are the generated C (``derivgen.load(spec, "c")``), called
on the tensors' own memory: a contiguous float32/float64 tensor is passed
without a copy, and the kernels run without the GIL. Statistics are float64,
one value per normalization group, and are not differentiable (they are what
the backward needs; a loss that uses them gets an error, not a silent zero).

* ``register_fake`` gives shapes and dtypes, so ``torch.compile`` traces a
  model through the operators without graph breaks;
* the forward's ``register_autograd`` calls the backward operator;
* the backward operator's own ``register_autograd`` is the derived double
  backward (derivgen.derive.second): a third operator per mode,
  ``derivgen::<layer>_<mode>_bb``, over the generated C kernels; a fourth,
  ``derivgen::<layer>_<mode>_jvp``, is forward mode (``torch.func.jvp``,
  ``torch.autograd.forward_ad``). bfloat16, channels last and third order
  differentiate the generated PyTorch target (``derivgen.load(spec, "torch")``)
  under torch.func instead: exact at any order.

Running buffers are not touched by the operators: :mod:`derivgen.torch.nn`
updates them with the spec's update rule (``update_buffers`` of the torch
target), so the operators stay functional.
"""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.autograd.forward_ad as _fwad

from derivgen import runtime as rt
from derivgen.api import load, load_spec, materialize
from derivgen.runtime.cbind import CKernel, input_pairs
from derivgen.spec.model import Spec, catalogue_names, load_catalogue
from derivgen.runtime.validate import (check_buffer_shape, check_group_size, check_input_shape, check_not_empty, check_options,
                        check_param_shapes, check_same_dtype)

_LIB = torch.library.Library("derivgen", "FRAGMENT")
_LOCK = threading.RLock()
_LAYERS: dict[str, "TorchLayer"] = {}
_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_SFX = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}


def layer(spec_or_name) -> "TorchLayer":
    """The operators of a catalogue layer (by name), a spec file or a Spec,
    registered on first use."""
    spec = spec_or_name if isinstance(spec_or_name, Spec) else load_spec(spec_or_name)
    base = op_base(spec)
    with _LOCK:
        if base not in _LAYERS:
            _LAYERS[base] = TorchLayer(spec, base)
        return _LAYERS[base]


def op_base(spec: Spec) -> str:
    """A catalogue layer's operators are named after it; any other spec's carry the
    digest of its generated code too, so two specs with one name never collide."""
    if spec.name in catalogue_names() and load_catalogue(spec.name) == spec:
        return spec.name
    return f"{spec.name}_{materialize(spec, 'c')[1][:12]}"


@dataclass(frozen=True)
class ModeOps:
    mode: str
    forward: object        # torch._ops.OpOverload
    backward: object
    bb: object = None      # the double backward (derived kernels)
    jvp: object = None     # the forward-mode derivative (derived kernels)


def layout(meta: dict, x_shape, param_shapes: dict, groups: int) -> rt.Layout:
    """The runtime's 4-D view of x, from shapes (``groups`` 0 for layers without groups)."""
    return rt.layout_from_shapes(meta, x_shape, param_shapes, groups if meta["reduce"] == "group" else None)


def _check(name: str, what: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "meta"):
        raise ValueError(f"{name}: {what} is on {t.device}; derivgen's kernels run on the CPU")
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name}: {what} has dtype {t.dtype}; derivgen.torch supports float32, float64 and bfloat16")


def _ret(values: tuple):
    """An operator with one output returns a Tensor, not a 1-tuple (its schema says ``-> Tensor``)."""
    return values[0] if len(values) == 1 else values


def _tup(out) -> tuple:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _cl(t: torch.Tensor):
    return torch.channels_last if t.dim() == 4 else torch.channels_last_3d


def _nhwc(t: torch.Tensor) -> bool:
    """A channels-last tensor (NHWC / NDHWC) that is not also plain contiguous."""
    return t.dim() in (4, 5) and not t.is_contiguous() and t.is_contiguous(memory_format=_cl(t))


def _np(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a NumPy array (no copy; the runtime copies a
    non-contiguous one once, as for NumPy callers)."""
    return t.detach().numpy()


class TorchLayer:
    """One spec's operators, the generated C and PyTorch modules behind them, and
    the argument bookkeeping the modules share."""

    def __init__(self, spec: Spec, base: str):
        self.spec, self.base = spec, base
        self.ckernel = load(spec, "c")
        self.target = load(spec, "torch")
        self.meta = self.ckernel._META
        m = self.meta
        self.params, self.inputs, self.buffers = list(m["params"]), list(m["inputs"]), list(m["buffers"])
        self.options = list(m["options"])
        self._ranges = [m["options"][o] for o in self.options]
        self.grads_type = rt.grads_type(spec.name, rt.grad_fields(m))
        self._impls: dict = {}
        self._plans: dict = {}
        self._csplit: dict = {}         # dtype -> derivgen.torch.sync._CSplit
        self._extras = None
        self._channel_layout = self.meta["layout"] == "channels"
        self._fargs = {mode: self._args(mode) for mode in m["modes"]}
        self.modes = {mode: self._register(mode) for mode in m["modes"]}

    # one object per spec and process: copies of a module share it, a pickle names the spec
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (layer, (self.spec,))

    # ---------------------------------------------------------------- schema
    def _args(self, mode: str) -> list[tuple[str, str, str]]:
        """(schema type, schema name, spec name) of a forward operator's arguments."""
        a = [("Tensor", "x", "x")]
        a += [("Tensor", f"p{k}", p) for k, p in enumerate(self.params)]
        a += [("Tensor", f"i{k}", i) for k, i in enumerate(self.inputs)]
        if mode == "eval":
            a += [("Tensor", f"b{k}", b) for k, b in enumerate(self.buffers)]
        a += [("float", f"o{k}", o) for k, o in enumerate(self.options)]
        a.append(("int", "groups", "num_groups"))
        return a

    def _register(self, mode: str) -> ModeOps:
        fargs = self._args(mode)
        stats = self.meta["stats"][mode]
        fname, bname = f"{self.base}_{mode}_forward", f"{self.base}_{mode}_backward"
        fschema = "(" + ", ".join(f"{t} {n}" for t, n, _ in fargs) + ") -> (" + ", ".join(
            ["Tensor"] * (1 + len(stats))) + ")"
        tensor_args = [a for a in fargs if a[0] == "Tensor"]
        bargs = [("Tensor", "dy", "dy")] + tensor_args + [("Tensor", f"s{k}", s) for k, s in enumerate(stats)] + [
            a for a in fargs if a[0] != "Tensor"]
        nout = 1 + len(self.params) + len(self.inputs)
        bschema = "(" + ", ".join(f"{t} {n}" for t, n, _ in bargs) + ") -> (" + ", ".join(["Tensor"] * nout) + ")"
        _LIB.define(fname + fschema)
        _LIB.define(bname + bschema)
        fimpl, bimpl = self._forward_impl(mode, fargs), self._backward_impl(mode, bargs)
        self._impls[mode] = (fimpl, bimpl)
        _LIB.impl(fname, fimpl, "CPU")
        _LIB.impl(bname, bimpl, "CPU")
        fop = getattr(torch.ops.derivgen, fname).default
        bop = getattr(torch.ops.derivgen, bname).default
        torch.library.register_fake(fop, self._forward_fake(mode, fargs), lib=_LIB)
        torch.library.register_fake(bop, self._backward_fake(mode, bargs), lib=_LIB)
        bbop, jvpop = self._register_second(mode, fargs, bargs)
        self._register_autograd(mode, fop, bop, fargs, bargs, bbop)
        return ModeOps(mode, fop, bop, bbop, jvpop)

    # ---------------------------------------------------------------- second order
    # derivgen::<layer>_<mode>_bb(dy, x, params..., inputs..., [buffers...], statistics..., ddx,
    #     ddparams..., ddinputs..., options..., groups) -> (dx, ddy, dparams..., dinputs...)
    # derivgen::<layer>_<mode>_jvp(x, params..., inputs..., [buffers...], statistics..., tx,
    #     tparams..., tinputs..., options..., groups) -> ty
    # float32/float64 run the derived C kernels (derivgen.derive.second); bfloat16 and channels-last
    # tensors take the generated PyTorch closed form through torch.func (the same derivatives).
    def _second_args(self, mode, fargs, bargs):
        diff = ["x", *self.params, *self.inputs]
        tens_b = [a for a in bargs if a[0] == "Tensor"]
        scal = [a for a in fargs if a[0] != "Tensor"]
        bb = tens_b + [("Tensor", f"c{k}", "c_" + n) for k, n in enumerate(diff)] + scal
        tens_f = [a for a in bargs if a[0] == "Tensor" and a[2] != "dy"]
        jv = tens_f + [("Tensor", f"t{k}", "t_" + n) for k, n in enumerate(diff)] + scal
        return bb, jv

    def _register_second(self, mode, fargs, bargs):
        bbargs, jvargs = self._second_args(mode, fargs, bargs)
        self._bbargs = getattr(self, "_bbargs", {})
        self._bbargs[mode] = bbargs
        nout = 2 + len(self.params) + len(self.inputs)
        bbname, jvname = f"{self.base}_{mode}_bb", f"{self.base}_{mode}_jvp"
        _LIB.define(bbname + "(" + ", ".join(f"{t} {n}" for t, n, _ in bbargs) + ") -> ("
                    + ", ".join(["Tensor"] * nout) + ")")
        _LIB.define(jvname + "(" + ", ".join(f"{t} {n}" for t, n, _ in jvargs) + ") -> Tensor")
        _LIB.impl(bbname, self._second_impl(mode, "bb", bbargs), "CPU")
        _LIB.impl(jvname, self._second_impl(mode, "jvp", jvargs), "CPU")
        bbop = getattr(torch.ops.derivgen, bbname).default
        jvop = getattr(torch.ops.derivgen, jvname).default

        def bb_fake(*args):
            a = self._split(bbargs, args)
            x = a["x"]
            return (torch.empty_like(x), torch.empty_like(x), *(torch.empty_like(a[p]) for p in self.params),
                    *(torch.empty_like(a[i]) for i in self.inputs))

        def jvp_fake(*args):
            return torch.empty_like(self._split(jvargs, args)["x"])
        torch.library.register_fake(bbop, bb_fake, lib=_LIB)
        torch.library.register_fake(jvop, jvp_fake, lib=_LIB)

        def setup_bb(ctx, inputs, output):
            ctx.inputs = inputs
            ctx.save_for_backward(*(v for (t, _, _), v in zip(bbargs, inputs) if t == "Tensor"))

        def bb_backward(ctx, *cots):
            # third order: the generated PyTorch closed form, differentiated by torch.func
            tnames = [s for t, _, s in bbargs if t == "Tensor"]
            a = dict(zip(tnames, ctx.saved_tensors))
            a.update({s: v for (t, _, s), v in zip(bbargs, ctx.inputs) if t != "Tensor"})
            diff = ["x", *self.params, *self.inputs]
            wrt = ["dy", *diff, *("c_" + n for n in diff)]
            outs = self._generic_bb(mode, a)
            cot = tuple(torch.zeros_like(o) if c is None else c for c, o in zip(cots, outs))

            def f(*primals):
                b = dict(a)
                b.update(zip(wrt, primals))
                return self._generic_bb(mode, b)
            _, vjp = torch.func.vjp(f, *(a[w] for w in wrt))
            g = dict(zip(wrt, vjp(cot)))
            return tuple(g.get(s) if t == "Tensor" else None for t, _, s in bbargs)
        torch.library.register_autograd(bbop, bb_backward, setup_context=setup_bb, lib=_LIB)

        def setup_jvp(ctx, inputs, output):
            ctx.inputs = inputs
            ctx.save_for_backward(*(v for (t, _, _), v in zip(jvargs, inputs) if t == "Tensor"))

        def jvp_backward(ctx, cot):
            # reverse over forward (jacrev of jacfwd, a loss on a tangent): the generated
            # PyTorch closed form, differentiated by torch.func
            tnames = [s for t, _, s in jvargs if t == "Tensor"]
            a = dict(zip(tnames, ctx.saved_tensors))
            a.update({s: v for (t, _, s), v in zip(jvargs, ctx.inputs) if t != "Tensor"})
            diff = ["x", *self.params, *self.inputs]
            wrt = [*diff, *("t_" + n for n in diff)]

            def f(*primals):
                b = dict(a)
                b.update(zip(wrt, primals))
                return self._generic_jvp(mode, b)
            _, vjp = torch.func.vjp(f, *(a[w] for w in wrt))
            g = dict(zip(wrt, vjp(cot)))
            return tuple(g.get(s) if t == "Tensor" else None for t, _, s in jvargs)
        torch.library.register_autograd(jvop, jvp_backward, setup_context=setup_jvp, lib=_LIB)
        return bbop, jvop

    def _generic_bb(self, mode: str, a: dict) -> tuple:
        """The double backward as torch.func's VJP of the generated PyTorch backward
        (bfloat16, channels last, third order)."""
        diff = ["x", *self.params, *self.inputs]
        wrt = ["dy", *diff]

        def f(*primals):
            b = dict(a)
            b.update(zip(wrt, primals))
            return self.target_backward(mode, b)
        _, vjp = torch.func.vjp(f, *(a[w] for w in wrt))
        g = vjp(tuple(a["c_" + n] for n in diff))
        by = dict(zip(wrt, g))
        return (by["x"], by["dy"], *(by[p] for p in self.params), *(by[i] for i in self.inputs))

    def _generic_jvp(self, mode: str, a: dict):
        diff = ["x", *self.params, *self.inputs]

        def f(*primals):
            b = dict(a)
            b.update(zip(diff, primals))
            L = layout(self.meta, b["x"].shape, {p: b[p].shape for p in self.params}, b["num_groups"])
            return self.target.FORWARD[mode](b["x"].reshape(L.view4), **self.views(b, L, mode))[0].reshape(
                b["x"].shape)
        return torch.func.jvp(f, tuple(a[n] for n in diff), tuple(a["t_" + n] for n in diff))[1]

    def _second_fast(self, a: dict) -> bool:
        x = a["x"]
        return x.dtype in (torch.float32, torch.float64) and not (self._channel_layout and _nhwc(x))

    def _second_call(self, mode: str, kind: str, a: dict):
        """The derived C kernel on contiguous float32/float64 tensors."""
        m = self.meta
        x = a["x"].contiguous()
        L = layout(m, tuple(x.shape), {p: tuple(a[p].shape) for p in self.params}, a["num_groups"])
        fn = self._kernel_for(x.dtype).second_cfunc(mode, kind, _SFX[x.dtype])
        c = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
        pre = "c_" if kind == "bb" else "t_"
        for n in ["x", *self.params, *self.inputs]:
            if c[pre + n].dtype != x.dtype:
                c[pre + n] = c[pre + n].to(x.dtype)
        sig = self._kernel_for(x.dtype).signatures[(mode, kind)]
        sections = {"dims": (L.O, L.G, L.Cg, L.S), "x": (x.data_ptr(),),
                    "params": [c[p].data_ptr() for p in self.params], "options": [c[o] for o in self.options],
                    "inputs": input_pairs([c[i] for i in self.inputs]),
                    "stats": [c[s].data_ptr() for s in m["stats"][mode]], "seed_x": (c[pre + "x"].data_ptr(),),
                    "seed_params": [c[pre + p].data_ptr() for p in self.params],
                    "seed_inputs": input_pairs([c[pre + i] for i in self.inputs]),
                    "nthreads": (threads(self.ckernel._kernel),)}
        if kind == "bb":
            outs = [torch.empty_like(x), torch.empty_like(x), *(torch.empty_like(c[p]) for p in self.params)]
            dis = [torch.empty(L.n_groups, dtype=x.dtype) for _ in self.inputs]
            sections.update({"dy": (c["dy"].data_ptr(),), "out_dx": (outs[0].data_ptr(),),
                             "out_ddy": (outs[1].data_ptr(),), "out_params": [t.data_ptr() for t in outs[2:]],
                             "out_inputs": [t.data_ptr() for t in dis]})
        else:
            outs = [torch.empty_like(x)]
            dis = []
            sections["out_ty"] = (outs[0].data_ptr(),)
        args = sig.pack(sections)
        if fn(*args) != 0:
            raise MemoryError(f"{m['name']}: second-order kernel could not allocate its work buffer")
        if kind != "bb":
            return outs[0].reshape(a["x"].shape)
        for i, d in zip(self.inputs, dis):
            t = a[i]
            outs.append(d.sum(dtype=torch.float64).to(x.dtype).reshape(t.shape) if t.numel() == 1
                        else d.reshape(t.shape))
        return tuple(outs)

    def _second_impl(self, mode, kind, names):
        def impl(*args):
            a = self._split(names, args)
            if self._second_fast(a):
                return self._second_call(mode, kind, a)
            return getattr(self, "_generic_" + kind)(mode, a)      # _generic_bb, _generic_jvp
        return impl

    def _split(self, names, args) -> dict:
        return {spec_name: v for (_, _, spec_name), v in zip(names, args)}

    # ---------------------------------------------------------------- kernels
    def _prepare(self, mode: str, a: dict, out: torch.Tensor | None) -> rt.ForwardCall:
        name = self.meta["name"]
        for k in ["x", *self.params, *self.inputs, *(self.buffers if mode == "eval" else ())]:
            _check(name, k, a[k])
        return rt.prepare_forward(
            self.meta, _np(a["x"]), {p: _np(a[p]) for p in self.params}, {o: a[o] for o in self.options},
            {i: _np(a[i]) for i in self.inputs},
            {b: (_np(a[b]) if mode == "eval" else None) for b in self.buffers},
            training=mode == "train", num_groups=a["num_groups"] if self.meta["reduce"] == "group" else None,
            out=None if out is None else _np(out))

    # The first call with a given signature (shapes, dtypes, contiguity, groups, layout)
    # is validated in full (clear errors naming the argument: the NumPy runtime's checks
    # for float32/float64, the same checks on tensors for bfloat16 and channels last);
    # a signature that passed is a *plan*: the kernels' ctypes functions with their
    # argument types declared and the layout, called directly on the tensors' data
    # pointers (a strided tensor is copied once first). Per call that leaves allocating
    # the outputs and the option range checks.

    def _cfn(self, mode: str, direction: str, dtype, nhwc: bool = False) -> ctypes._CFuncPtr:
        return self._kernel_for(dtype, nhwc).cfunc(mode, direction, ("nhwc_" if nhwc else "") + _SFX[dtype])

    def _kernel_for(self, dtype, nhwc: bool = False):
        """The C library: float and double NCHW kernels in the layer's own build; the bfloat16
        and channels-last ones in a second build of the same source (-DDG_EXTRAS_ONLY),
        compiled on first use."""
        main = self.ckernel._kernel
        if dtype != torch.bfloat16 and not nhwc:
            return main
        if self._extras is None:
            self._extras = CKernel(self.meta, main.source, main.threads, cflags=main.cflags,
                                   extra=["-DDG_EXTRAS_ONLY"])
        return self._extras

    def _options_ok(self, opts) -> bool:
        for v, (_, lo, hi) in zip(opts, self._ranges):
            if not (isinstance(v, float) and math.isfinite(v)) or (lo is not None and v < lo) \
                    or (hi is not None and v > hi):
                return False
        return True

    def _validate(self, mode: str, a: dict) -> rt.Layout:
        """The argument contract of derivgen.runtime.validate, on tensors (for what NumPy lacks:
        bfloat16, the channels-last view)."""
        m = self.meta
        x = a["x"]
        tensors = ["x", *self.params, *self.inputs, *(self.buffers if mode == "eval" else ())]
        for k in tensors:
            _check(m["name"], k, a[k])
            check_same_dtype(m, k, a[k].dtype, x.dtype, "; use one dtype for all")
        check_not_empty(m, tuple(x.shape))
        L = layout(m, tuple(x.shape), {p: tuple(a[p].shape) for p in self.params}, a["num_groups"])
        check_param_shapes(m, {p: a[p].shape for p in self.params}, L)
        check_group_size(m, mode, L)
        check_options(m, {o: a[o] for o in self.options})
        for i in self.inputs:
            check_input_shape(m, i, tuple(a[i].shape), L)
        for b in (self.buffers if mode == "eval" else ()):
            check_buffer_shape(m, b, tuple(a[b].shape), L)
        return L

    def _key(self, tens, xi: int, groups):
        """A call's signature, and whether x (``tens[xi]``) is channels last."""
        nhwc = self._channel_layout and _nhwc(tens[xi])
        return tuple([(t.shape, t.dtype, t.is_cpu, t.is_contiguous()) for t in tens]) + (groups, nhwc), nhwc

    def _plan(self, mode: str, tens, opts, groups) -> "_Plan":
        """The plan of a forward call's signature, validated (and remembered) on first use
        and whenever the options are out of range (so that the error names them)."""
        try:
            key, nhwc = self._key(tens, 0, groups)
            plan = self._plans.get((mode, key))
        except AttributeError:          # not a tensor: the validation names it
            key = nhwc = plan = None
        if plan is None or not self._options_ok(opts):
            plan = self._forward_plan(mode, self._fargs[mode], [*tens, *opts, groups], key, nhwc)
        return plan

    def _forward_plan(self, mode: str, fargs, args, key, nhwc: bool) -> "_Plan":
        """Validate a forward signature (raising on bad input) and remember its plan."""
        a = self._split(fargs, args)
        x = a["x"]
        if nhwc or (isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16):
            L = self._validate(mode, a)         # NumPy has neither bfloat16 nor our channels-last view
        else:
            L = self._prepare(mode, a, None).layout
        tens = [v for (t, _, _), v in zip(fargs, args) if t == "Tensor"]
        plan = _Plan(self, mode, L, tens, nhwc, a["num_groups"])
        self._plans[(mode, key)] = plan
        return plan

    def _forward_impl(self, mode, fargs):
        ntens = sum(1 for t, _, _ in fargs if t == "Tensor")
        nopt = len(self.options)

        def impl(*args):
            tens = args[:ntens]
            opts = args[ntens:ntens + nopt]
            plan = self._plan(mode, tens, opts, args[-1])
            y, st = plan.forward(tens, opts, blob=False)
            return _ret((y, *st))
        return impl

    def _backward_impl(self, mode, bargs):
        stats = self.meta["stats"][mode]
        ntens = sum(1 for t, _, _ in bargs if t == "Tensor")
        nstat, nopt = len(stats), len(self.options)
        name = self.meta["name"]
        plans: dict = {}

        def impl(*args):
            tens = args[:ntens]
            key, nhwc = self._key(tens, 1, args[-1])
            plan = plans.get(key)
            opts = args[ntens:ntens + nopt]
            if plan is None or not self._options_ok(opts):
                a = self._split(bargs, args)
                fargs = [v for (t, _, s), v in zip(bargs, args) if s != "dy" and s not in stats]
                plan = self._forward_plan(mode, self._args(mode), fargs, self._key(fargs[:ntens - 1 - nstat], 0,
                                                                                 args[-1])[0], nhwc)
                _check(name, "dy", a["dy"])
                if a["dy"].dtype != a["x"].dtype or tuple(a["dy"].shape) != tuple(a["x"].shape):
                    raise ValueError(f"{name}: dy must have the shape and dtype of x {tuple(a['x'].shape)} "
                                     f"{a['x'].dtype}, got {tuple(a['dy'].shape)} {a['dy'].dtype}")
                for s in stats:
                    t = a[s]
                    if t.dtype != torch.float64 or t.numel() != plan.n_groups:
                        raise ValueError(f"{name}: statistic {s} must be float64 with one value per group "
                                         f"({plan.n_groups}), as the forward returns them; got {t.dtype} "
                                         f"{tuple(t.shape)}")
                plans[key] = plan
            st = [t.contiguous() for t in tens[ntens - nstat:]]
            return _ret(plan.backward(tens[0], tens[1:ntens - nstat], [t.data_ptr() for t in st], opts))
        return impl

    # ---------------------------------------------------------------- fake
    def _forward_fake(self, mode, fargs):
        stats = self.meta["stats"][mode]

        def fake(*args):
            a = self._split(fargs, args)
            x = a["x"]
            L = layout(self.meta, x.shape, {p: a[p].shape for p in self.params}, a["num_groups"])
            y = torch.empty_like(x) if self._channel_layout and _nhwc(x) else x.new_empty(x.shape)
            return _ret((y, *(x.new_empty((L.n_groups,), dtype=torch.float64) for _ in stats)))
        return fake

    def _backward_fake(self, mode, bargs):
        def fake(*args):
            a = self._split(bargs, args)
            x = a["x"]
            dx = torch.empty_like(x) if self._channel_layout and _nhwc(x) else x.new_empty(x.shape)
            return _ret((dx, *(x.new_empty(a[p].shape) for p in self.params),
                         *(x.new_empty(a[i].shape) for i in self.inputs)))
        return fake

    # ---------------------------------------------------------------- autograd
    def _register_autograd(self, mode, fop, bop, fargs, bargs, bbop):
        n_fwd_tensors = sum(1 for t, _, _ in fargs if t == "Tensor")
        diff = ["x", *self.params, *self.inputs]

        def setup_forward(ctx, inputs, output):
            ctx.inputs = inputs
            tensors = [v for (t, _, _), v in zip(fargs, inputs) if t == "Tensor"]
            output = _tup(output)
            ctx.save_for_backward(*tensors, *output[1:])
            if len(output) > 1:
                ctx.mark_non_differentiable(*output[1:])

        def backward_forward(ctx, dy, *dstats):
            saved = ctx.saved_tensors
            tensors, stats = saved[:n_fwd_tensors], saved[n_fwd_tensors:]
            scalars = [v for (t, _, _), v in zip(fargs, ctx.inputs) if t != "Tensor"]
            grads = _tup(bop(dy.contiguous(), *tensors, *stats, *scalars))
            by_name = dict(zip(diff, grads))
            return tuple(by_name.get(sname) if t == "Tensor" else None for t, _, sname in fargs)

        torch.library.register_autograd(fop, backward_forward, setup_context=setup_forward, lib=_LIB)

        def setup_backward(ctx, inputs, output):
            ctx.inputs = inputs
            ctx.save_for_backward(*(v for (t, _, _), v in zip(bargs, inputs) if t == "Tensor"))

        def backward_backward(ctx, *cotangents):
            # the derived double backward (derivgen.derive.second): one operator, derived kernels
            tensors = ctx.saved_tensors
            tnames = [s for t, _, s in bargs if t == "Tensor"]
            a = dict(zip(tnames, tensors))
            scal = [v for (t, _, _), v in zip(bargs, ctx.inputs) if t != "Tensor"]
            outs = [a["x"], *(a[p] for p in self.params), *(a[i] for i in self.inputs)]
            cot = [torch.zeros_like(o) if c is None else c for c, o in zip(cotangents, outs)]
            got = _tup(bbop(*tensors, *cot, *scal))
            g = dict(zip(["x", "dy", *self.params, *self.inputs], got))
            return tuple(g.get(s) if t == "Tensor" else None for t, _, s in bargs)

        torch.library.register_autograd(bop, backward_backward, setup_context=setup_backward, lib=_LIB)

    # ---------------------------------------------------------------- torch target
    def views(self, a: dict, L: rt.Layout, mode: str) -> dict:
        """Keyword arguments of the generated PyTorch functions: 4-D views."""
        kw = {"_L": L}
        for p in self.params:
            kw[p] = a[p].reshape((1, 1, 1, 1) if p in self.meta["scalar_params"] else L.param4)
        for i in self.inputs:
            kw[i] = a[i].reshape((1, 1, 1, 1) if a[i].numel() == 1 else L.stat4)
        for b in self.buffers:
            v = a.get(b) if mode == "eval" else None
            kw[b] = None if v is None else v.reshape(L.stat4)
        for o in self.options:
            kw[o] = a[o]
        return kw

    def target_backward(self, mode: str, a: dict) -> tuple:
        """(dx, dparams..., dinputs...) by the generated PyTorch closed form, shaped as
        the backward operator returns them."""
        x = a["x"]
        L = layout(self.meta, x.shape, {p: a[p].shape for p in self.params}, a["num_groups"])
        dx, dp, di = self.target.BACKWARD[mode](a["dy"].reshape(L.view4), x.reshape(L.view4),
                                                **self.views(a, L, mode))
        out = [dx.reshape(x.shape)]
        out += [dp[p].reshape(a[p].shape) for p in self.params]
        for i in self.inputs:
            v = di[i]
            out.append(v.sum().reshape(a[i].shape) if a[i].numel() == 1 else v.reshape(a[i].shape))
        return tuple(out)

    # ---------------------------------------------------------------- calling
    def forward(self, x, params: dict, inputs: dict, options: dict, *, training: bool = True,
                buffers: dict | None = None, num_groups: int = 0, stats: bool = True):
        """(y, {statistic: float64 per-group tensor}) through the operators (autograd-aware);
        (y, None) with ``stats=False``."""
        mode = "train" if training or "eval" not in self.modes else "eval"
        tens = [x, *[params[p] for p in self.params], *[inputs[i] for i in self.inputs]]
        if mode == "eval":
            tens += [buffers[b] for b in self.buffers]
        return self.call(mode, tens, tuple([float(options[o]) for o in self.options]), int(num_groups or 0), stats)

    def call(self, mode: str, tens: list, opts: tuple, groups: int, stats: bool = True):
        """:meth:`forward` with the arguments in operator order: tensors (x, parameters,
        inputs, and in eval mode buffers), options (floats), groups (0 without groups)."""
        x = tens[0]
        if isinstance(x, torch.Tensor) and x.is_cpu and not torch.compiler.is_compiling() \
                and torch._C._are_functorch_transforms_active():
            # torch.func (jvp, vjp, grad, ...): an autograd.Function over the operators, with the
            # derived backward and JVP (vmap, and so jacfwd/jacrev/hessian, is not supported:
            # the registered operators have no batching rule)
            self._plan(mode, tens, opts, groups)
            out = _Functional.apply(self, mode, opts, groups, *tens)
            return out[0], dict(zip(self.meta["stats"][mode], out[1:]))
        if isinstance(x, torch.Tensor) and x.is_cpu and not torch.compiler.is_compiling():
            plan = self._plan(mode, tens, opts, groups)
            if (torch.is_grad_enabled() and any([t.requires_grad for t in tens])) or _fwad._current_level >= 0:
                box = []
                y = _eager_apply(plan, opts, box, *tens)
                st = box[0]
            else:
                y, st = plan.forward(tens, opts, blob=True)
            return y, (dict(zip(self.meta["stats"][mode], st.unbind(0))) if stats else None)
        for k, t in zip(["x", *self.params, *self.inputs], tens):
            _check(self.meta["name"], k, t)      # a CUDA tensor: an error naming it, not a dispatch failure
        out = _tup(self.modes[mode].forward(*tens, *opts, groups))
        return out[0], dict(zip(self.meta["stats"][mode], out[1:]))

    def update_buffers(self, stats: dict, buffers: dict, options: dict, group_size, reduce_dims=()) -> None:
        """Apply the spec's running-buffer updates in place (no autograd). Statistics are
        per-group float64 tensors shaped like the buffers, or with extra leading
        ``reduce_dims`` to average over (instance norm's per-sample statistics)."""
        with torch.no_grad():
            shape = next(iter(buffers.values())).shape
            vals = {}
            for s, t in stats.items():
                vals[s] = t.reshape(*reduce_dims, *shape)
            bufs64 = {b: v.to(torch.float64) for b, v in buffers.items()}
            opts = {o: (v.to(torch.float64) if isinstance(v, torch.Tensor) else v) for o, v in options.items()}
            new = self.target.update_buffers(**vals, **bufs64, **opts, N=group_size)
            for b, v in new.items():
                if reduce_dims:
                    v = v.mean(dim=tuple(range(len(reduce_dims))))
                buffers[b].copy_(v)


class _Eager(torch.autograd.Function):
    """Eager calls on CPU tensors skip the dispatcher: a validated plan's kernels under a
    plain autograd.Function (the dispatcher's Python autograd wrapper costs more than
    the 8x1024 layer norm kernels themselves). The same kernels, the same numbers;
    torch.compile, torch.func transforms and non-CPU tensors go through the registered
    operators. The statistics are one (statistics, groups) tensor, kept on the context
    (not an output: autograd has nothing to track for them) and handed to the caller
    through ``box``. The backward
    reuses the forward's plan: autograd hands it a gradient of y's shape and dtype,
    and the saved tensors are the validated ones (version counters catch in-place
    changes). A backward that must be differentiable (create_graph=True) calls the
    backward operator, whose registered autograd differentiates the generated
    PyTorch target."""

    @staticmethod
    def forward(ctx, plan, opts, box, *tens):
        y, st = plan.forward(tens, opts, blob=True)
        ctx.plan, ctx.opts, ctx.st = plan, opts, st
        ctx.save_for_backward(*tens)
        ctx.save_for_forward(*tens)
        box.append(st)
        return y

    @staticmethod
    def jvp(ctx, _plan, _opts, _box, *tangents):
        """Forward mode (torch.autograd.forward_ad): the derived JVP kernel."""
        plan, tens = ctx.plan, ctx.saved_tensors
        t = [torch.zeros_like(v) if d is None else d for d, v in zip(tangents, tens)]
        n = 1 + len(plan.lay.params) + len(plan.lay.inputs)
        return plan.lay.modes[plan.mode].jvp(*tens, *ctx.st.unbind(0), *t[:n], *ctx.opts, plan.groups)

    @staticmethod
    def backward(ctx, dy):
        plan, st = ctx.plan, ctx.st
        tens = ctx.saved_tensors
        if torch.is_grad_enabled():
            grads = _tup(plan.lay.modes[plan.mode].backward(dy.contiguous(), *tens, *st.unbind(0), *ctx.opts,
                                                            plan.groups))
        else:
            base = st.data_ptr()
            grads = plan.backward(dy, tens, [base + o for o in plan.stat_offsets], ctx.opts)
        return (None, None, None, *grads, *([None] * (len(tens) - len(grads))))


class _Functional(torch.autograd.Function):
    """The operators under torch.func transforms (``torch.func.jvp``, ``vjp``, ``grad``...):
    the backward operator for reverse mode (its own autograd is the derived double
    backward) and the JVP operator for forward mode, both from derivgen.derive.second."""

    @staticmethod
    def forward(lay, mode, opts, groups, *tens):
        return _tup(lay.modes[mode].forward(*tens, *opts, groups))

    @staticmethod
    def setup_context(ctx, inputs, output):
        lay, mode, opts, groups, *tens = inputs
        ctx.lay, ctx.mode, ctx.opts, ctx.groups, ctx.ntens = lay, mode, opts, groups, len(tens)
        ctx.save_for_backward(*tens, *output[1:])
        ctx.save_for_forward(*tens, *output[1:])
        ctx.mark_non_differentiable(*output[1:])

    @staticmethod
    def backward(ctx, dy, *dstats):
        lay, saved = ctx.lay, ctx.saved_tensors
        tens, st = saved[:ctx.ntens], saved[ctx.ntens:]
        grads = _tup(lay.modes[ctx.mode].backward(dy.contiguous(), *tens, *st, *ctx.opts, ctx.groups))
        return (None, None, None, None, *grads, *([None] * (ctx.ntens - len(grads))))

    @staticmethod
    def jvp(ctx, _lay, _mode, _opts, _groups, *tangents):
        lay, saved = ctx.lay, ctx.saved_tensors
        tens, st = saved[:ctx.ntens], saved[ctx.ntens:]
        n = 1 + len(lay.params) + len(lay.inputs)
        t = [torch.zeros_like(v) if d is None else d for d, v in zip(tangents[:n], tens)]
        ty = lay.modes[ctx.mode].jvp(*tens, *st, *t, *ctx.opts, ctx.groups)
        return (ty, *(None for _ in st))


def threads(kernel) -> int:
    """The threads a kernel call uses: the layer's own setting (``set_num_threads`` of its
    C module), else torch's (``torch.set_num_threads``), so one setting governs both."""
    return kernel.threads or torch.get_num_threads()


# _Eager.apply without torch.autograd.Function.apply's Python wrapper (default-argument
# binding and the functorch branch), which is not needed here: only reached with no
# functorch transform active, and _Eager has no setup_context
_eager_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Eager)


class _Plan:
    """A validated call signature of one layer and mode: the kernels' ctypes functions,
    the layout and everything else fixed by the shapes, so that a call only allocates
    its outputs and passes data pointers (8x1024 layer norm: a few microseconds of
    Python around each kernel)."""

    __slots__ = ("lay", "mode", "groups", "ffn", "bfn", "fsig", "bsig", "fpack", "bpack", "dims", "kernel", "n_groups", "nhwc", "npar", "nin",
                 "copy", "null_bufs", "stat_offsets", "stats_like", "name", "simple")

    def __init__(self, lay: TorchLayer, mode: str, L: rt.Layout, tens: list, nhwc: bool, groups: int):
        x = tens[0]
        self.lay, self.mode, self.groups = lay, mode, groups
        self.name = lay.meta["name"]
        self.ffn = lay._cfn(mode, "forward", x.dtype, nhwc)
        self.bfn = lay._cfn(mode, "backward", x.dtype, nhwc)
        self.fsig = lay.ckernel._kernel.signatures[(mode, "forward")]
        self.bsig = lay.ckernel._kernel.signatures[(mode, "backward")]
        # the common case's packers (no per-group inputs): x with the parameters, x with dy
        self.fpack = self.bpack = None
        if not lay.inputs:
            self.fpack = self.fsig.packer(("dims", "x_params", "options", "buffers", "y", "stats", "nthreads"),
                                          merged={"x_params": ("x", "params")})
            self.bpack = self.bsig.packer(("dims", "x_dy", "params", "options", "stats", "dx", "dparams",
                                           "nthreads"), merged={"x_dy": ("x", "dy")})
        self.dims = (L.O, L.G, L.Cg, L.S)
        self.kernel = lay.ckernel._kernel
        self.n_groups = ng = L.n_groups
        self.nhwc = nhwc
        self.npar, self.nin = npar, nin = len(lay.params), len(lay.inputs)
        # a strided tensor (or a channels-last one where this layer has no such kernel) is copied
        self.copy = not all(t.is_contiguous() for t in (tens[1:] if nhwc else tens))
        self.null_bufs = [None] * len(lay.buffers) if mode == "train" else []
        nstat = len(lay.meta["stats"][mode])
        self.stat_offsets = [8 * ng * k for k in range(nstat)]
        self.stats_like = torch.empty((nstat, ng), dtype=torch.float64)
        # contiguous tensors, no per-group inputs, no buffers passed (train mode)
        self.simple = not self.copy and not nin and (mode == "train" or not lay.buffers)

    def forward(self, tens, opts, blob: bool):
        """y and the statistics by the forward kernel on validated tensors. The statistics
        are one float64 tensor per statistic, or with ``blob`` one (statistics, groups)
        tensor (one allocation: the eager path keeps them together)."""
        if self.simple and blob:                # the common case, with the least Python
            y = torch.empty_like(tens[0])
            st = torch.empty_like(self.stats_like)
            p = st.data_ptr()
            if self.ffn(*self.fpack(self.dims, [t.data_ptr() for t in tens], opts, self.null_bufs,
                                    (y.data_ptr(),), [p + o for o in self.stat_offsets],
                                    (threads(self.kernel),))) != 0:
                raise MemoryError(f"{self.name}: forward kernel could not allocate its work buffer")
            return y, st
        if self.copy:
            tens = [tens[0] if self.nhwc else tens[0].contiguous()] + [t.contiguous() for t in tens[1:]]
        x = tens[0]
        y = torch.empty_like(x)                 # x's layout: contiguous or channels last
        if blob:
            st = torch.empty_like(self.stats_like)
            p = st.data_ptr()
            sp = [p + o for o in self.stat_offsets]
        else:
            st = [torch.empty(self.n_groups, dtype=torch.float64) for _ in self.stat_offsets]
            sp = [t.data_ptr() for t in st]
        k = 1 + self.npar
        ptrs = [t.data_ptr() for t in tens]
        if self.ffn(*self.fsig.pack({
                "dims": self.dims, "x": ptrs[:1], "params": ptrs[1:k], "options": opts,
                "inputs": input_pairs(tens[k:k + self.nin]), "buffers": ptrs[k + self.nin:] or self.null_bufs,
                "y": (y.data_ptr(),), "stats": sp, "nthreads": (threads(self.kernel),)})) != 0:
            raise MemoryError(f"{self.name}: forward kernel could not allocate its work buffer")
        return y, st

    def backward(self, dy, tens, stat_ptrs, opts) -> tuple:
        """(dx, dparams..., dinputs...) by the backward kernel. ``tens`` are the forward's
        tensors (x, params, inputs[, buffers]); dy has x's shape and dtype."""
        if self.simple and not self.nhwc:       # the common case, with the least Python
            x = tens[0]
            dy = dy.contiguous()
            dx = torch.empty_like(x)
            dps = [torch.empty_like(p) for p in tens[1:]]
            if self.bfn(*self.bpack(self.dims, (x.data_ptr(), dy.data_ptr()), [p.data_ptr() for p in tens[1:]],
                                    opts, stat_ptrs, (dx.data_ptr(),), [t.data_ptr() for t in dps],
                                    (threads(self.kernel),))) != 0:
                raise MemoryError(f"{self.name}: backward kernel could not allocate its work buffer")
            return (dx, *dps)
        k = 1 + self.npar
        x = tens[0]
        if self.copy:
            tens = [x if self.nhwc else x.contiguous()] + [t.contiguous() for t in tens[1:]]
            x = tens[0]
        dy = dy.contiguous(memory_format=_cl(x)) if self.nhwc else dy.contiguous()
        params = tens[1:k]
        dx = torch.empty_like(x)
        dps = [torch.empty_like(p) for p in params]
        ins = tens[k:k + self.nin]
        dis = [torch.empty(self.n_groups, dtype=x.dtype) for _ in ins]
        if self.bfn(*self.bsig.pack({
                "dims": self.dims, "x": (x.data_ptr(),), "dy": (dy.data_ptr(),),
                "params": [p.data_ptr() for p in params], "options": opts, "inputs": input_pairs(ins),
                "stats": stat_ptrs, "dx": (dx.data_ptr(),), "dparams": [t.data_ptr() for t in dps],
                "dinputs": [t.data_ptr() for t in dis], "nthreads": (threads(self.kernel),)})) != 0:
            raise MemoryError(f"{self.name}: backward kernel could not allocate its work buffer")
        if not self.nin:
            return (dx, *dps)
        out = [dx, *dps]
        for t, d in zip(ins, dis):
            out.append(d.sum(dtype=torch.float64).to(x.dtype).reshape(t.shape) if t.numel() == 1
                       else d.reshape(t.shape))
        return tuple(out)
