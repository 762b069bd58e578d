"""The C kernels of the layers with tensor inputs beside x and outputs beside y
(:mod:`derivgen.torch.multi`): a plan per call signature (:class:`MultiPlan`, validated on
the signature's first call; a mask's 0/1 values on every call), the plans of a layer
(:class:`MultiPlans`), and the CPU implementations of its forward and backward operators."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from derivgen import runtime as rt
from derivgen.runtime.abi import native, reads_buffers, sums_own, takes_samples
from derivgen.runtime.cbind import input_pairs
from derivgen.runtime.tensors import samples
from derivgen.torch.plan import SERIAL_BELOW, call_key, options_in_range, threads
from derivgen.torch.protocol import Layer
from derivgen.torch.schema import (
    by_spec_name,
    differentiable,
    extra_outputs,
    grad_tensors,
    tensor_count,
    tensor_inputs,
)
from derivgen.torch.tensors import (
    SUFFIX,
    channels_last_format,
    fresh_like,
    full_tensor,
    is_channels_last,
    op_result,
    per_group_input_grad,
    tensor_grad,
    tensor_kind,
)
from derivgen.torch.validate import check_cotangent, check_on_tensors, check_tensor_inputs

LOW = (torch.float16, torch.bfloat16)


def check_call(lay: Layer, mode: str, a: dict, *, any_device: bool = False, values: bool = True) -> rt.Layout:
    """A forward call's contract by spec name: x, the parameters, inputs and read buffers
    (:func:`derivgen.torch.validate.check_on_tensors`), then the tensor inputs (their
    declared shapes; a mask's values with ``values``); the layout of x."""
    L = check_on_tensors(lay.meta, mode, a, any_device)
    check_tensor_inputs(lay.meta, a, L, any_device, values)
    return L


def _masks(lay: Layer) -> list[tuple[int, str]]:
    """(position among the forward's tensors, name) of each mask among the tensor inputs."""
    return [(1 + k, t) for k, t in enumerate(tensor_inputs(lay.meta)) if lay.meta.tensors[t][2]]


def as_x_came(t: torch.Tensor, like: torch.Tensor, channels: bool) -> torch.Tensor:
    """An element-level result (x's shape, computed NCHW-contiguous) in x's memory format:
    channels last where x came so (a channel layout's)."""
    if channels and is_channels_last(like):
        return t.contiguous(memory_format=channels_last_format(like))
    return t


def dense_as_x(t: torch.Tensor, like: torch.Tensor, channels: bool) -> torch.Tensor:
    """A tensor of x's shape dense in x's memory format (channels last where x is, a channel
    layout's; else contiguous): a cotangent as the backward kernels read it, copied only where
    it is not so already."""
    if channels and is_channels_last(like):
        return t.contiguous(memory_format=channels_last_format(like))
    return t.contiguous()


def forward_tensor_names(lay: Layer, mode: str) -> list[str]:
    """The spec names of the forward operator's tensor arguments, in order."""
    return [a.spec for a in lay.schemas[mode].forward if a.type == "Tensor"]


# ------------------------------------------------------------------ the C kernels


class MultiPlan:
    """A validated forward call signature of a multi layer and mode: the kernels' ctypes
    functions and what the shapes fix (the layout, the tensor inputs' shapes, whether x is
    channels last), so that a call passes the per-sample and per-position tensors at their
    own shape (the backward kernel sums the per-sample ones' gradients; a per-position one's
    element gradients come at x's shape and are summed here), allocates its outputs and
    passes data pointers.

    With ``nhwc`` (a channel layout's channels-last x) the channels-last kernels run: every
    array of x's shape (x, the tensor inputs written out at x's shape, dy, the outputs'
    cotangents, y, the outputs beside it, dx and the tensors' element gradients) is
    channels-last memory, read and written at x's NHWC index."""

    def __init__(
        self, lay: Layer, mode: str, L: rt.Layout, tens: list[torch.Tensor], groups: int, nhwc: bool = False
    ) -> None:
        meta = lay.meta
        x = tens[0]
        self.lay, self.mode, self.groups, self.name, self.L = lay, mode, groups, meta.name, L
        self.nhwc = nhwc
        self.fmt = channels_last_format(x) if nhwc else torch.contiguous_format
        self.ffn = lay.libraries.cfunc(mode, "forward", x.dtype, nhwc)
        self.bfn = lay.libraries.cfunc(mode, "backward", x.dtype, nhwc)
        self.kernel = lay.ckernel._kernel
        self.fsig = self.kernel.signatures[(mode, "forward")]
        self.bsig = self.kernel.signatures[(mode, "backward")]
        self.dims, self.n_groups = (L.O, L.G, L.Cg, L.S), L.n_groups
        self.serial = math.prod(self.dims) < SERIAL_BELOW
        self.channels = meta.layout == "channels"
        self.tnames, self.gnames, self.outputs = tensor_inputs(meta), grad_tensors(meta), extra_outputs(meta)
        self.kinds = {t: tensor_kind(meta, t) for t in self.tnames}
        self.tshapes = {t: tuple(rt.tensor_shape(meta, self.kinds[t], L)) for t in self.tnames}
        # the tensors the kernels read at their own shape, and those whose gradients they sum
        self.native = {t: native(meta, self.kinds[t]) for t in self.tnames}
        self.summed = {t: sums_own(meta, self.kinds[t]) for t in self.tnames}
        self.samples = (samples(meta, L),) if takes_samples(meta) else ()
        self.nt, self.npar, self.nin = len(self.tnames), len(lay.params), len(lay.inputs)
        self.null_bufs = [] if reads_buffers(meta, mode) else [None] * len(lay.buffers)
        nstat = len(meta.stats[mode])
        self.stat_offsets = [8 * L.n_groups * k for k in range(nstat)]
        self.stats_like = torch.empty((nstat, L.n_groups), dtype=torch.float64)
        self.masks = _masks(lay)
        # a mask's 0/1 values, checked on every call by one read in C (torch's comparisons
        # wrote and read x-sized boolean tensors: most of masked layer norm's forward)
        self.mask_check = lay.libraries.for_call(x.dtype, nhwc).mask_check(SUFFIX[x.dtype]) if self.masks else None
        self.opts_ok: tuple | None = None  # the options of the last call, known to be in range
        # each forward tensor's gradient among the backward's outputs (None: it has none)
        diff = differentiable(meta)
        self.grad_slots = [diff.index(n) if n in diff else None for n in forward_tensor_names(lay, mode)]
        # the kernels' sections in the order of their arguments (those they have)
        self.fsections = [s for s in self.fsig.sections if s in _FORWARD_SECTIONS]
        self.bsections = [s for s in self.bsig.sections if s in _BACKWARD_SECTIONS]
        self.fpack = self.fsig.packer(self.fsections)
        self.bpack = self.bsig.packer(self.bsections)

    def nthreads(self) -> int:
        """The kernel call's threads: one for a small x, else the layer's or torch's setting."""
        return 1 if self.serial else threads(self.kernel)

    def _operands(self, tens: Sequence[torch.Tensor]) -> tuple:
        """x and the tensor inputs as the kernels read them: at x's shape in the plan's memory
        format (NCHW- or channels-last-contiguous), or the per-sample and per-position ones
        C-contiguous at their own shape; the parameters, inputs and buffers C-contiguous
        (copied where they are not)."""
        meta, k, fmt = self.lay.meta, 1 + self.nt, self.fmt
        x = tens[0].contiguous(memory_format=fmt)
        full = [
            v.contiguous() if self.native[t] else full_tensor(meta, t, v, self.L).contiguous(memory_format=fmt)
            for t, v in zip(self.tnames, tens[1:k])
        ]
        params = [t.contiguous() for t in tens[k : k + self.npar]]
        ins = [t.contiguous() for t in tens[k + self.npar : k + self.npar + self.nin]]
        bufs = [t.contiguous() for t in tens[k + self.npar + self.nin :]]
        return x, full, params, ins, bufs

    def grads_by_tensor(self, grads: Sequence) -> tuple:
        """The backward's outputs, one per forward tensor (None where it has no gradient)."""
        return tuple(None if k is None else grads[k] for k in self.grad_slots)

    def forward(self, tens: Sequence[torch.Tensor], opts: tuple[float, ...], blob: bool) -> tuple:
        """(y, [outputs beside y], statistics) by the forward kernel: the statistics one
        float64 tensor per statistic, or with ``blob`` one (statistics, groups) tensor."""
        like = tens[0]
        x, full, params, ins, bufs = self._operands(tens)
        y = fresh_like(x)
        outs = [fresh_like(x) for _ in self.outputs]
        if blob:
            st = torch.empty_like(self.stats_like)
            sp = [st.data_ptr() + o for o in self.stat_offsets]
        else:
            st = [torch.empty(self.n_groups, dtype=torch.float64) for _ in self.stat_offsets]
            sp = [t.data_ptr() for t in st]
        values = {
            "dims": self.dims,
            "samples": self.samples,
            "x": (x.data_ptr(),),
            "tensors": [t.data_ptr() for t in full],
            "params": [p.data_ptr() for p in params],
            "options": opts,
            "inputs": input_pairs(ins),
            "buffers": [b.data_ptr() for b in bufs] or self.null_bufs,
            "y": (y.data_ptr(), *(o.data_ptr() for o in outs)),
            "stats": sp,
            "nthreads": (self.nthreads(),),
        }
        if self.ffn(*self.fpack(*[values[k] for k in self.fsections])) != 0:
            raise MemoryError(f"{self.name}: forward kernel could not allocate its work buffer")
        back = self.channels
        return as_x_came(y, like, back), [as_x_came(o, like, back) for o in outs], st

    def backward(
        self,
        dy: torch.Tensor,
        cots: Sequence[torch.Tensor],
        tens: Sequence[torch.Tensor],
        stat_ptrs: Sequence[int],
        opts: tuple[float, ...],
    ) -> tuple:
        """(dx, d<tensor>..., dparams..., dinputs...) by the backward kernel, on the
        forward's tensors; dy and the outputs' cotangents have x's shape and dtype."""
        like = tens[0]
        meta, L = self.lay.meta, self.L
        x, full, params, ins, _ = self._operands(tens)  # the backward kernels read no buffers
        dy = dy.contiguous(memory_format=self.fmt)
        cots = [c.contiguous(memory_format=self.fmt) for c in cots]
        dx = fresh_like(x)
        # a broadcast tensor's element gradients at x's shape, summed below; the kernel sums
        # those of a per-sample tensor
        dts = [
            fresh_like(x)
            if self.kinds[t] == "x"
            else x.new_empty(self.tshapes[t])
            if self.summed[t]
            else torch.empty_like(x)
            for t in self.gnames
        ]
        dps = [torch.empty_like(p) for p in params]
        dis = [torch.empty(self.n_groups, dtype=x.dtype) for _ in ins]
        values = {
            "dims": self.dims,
            "samples": self.samples,
            "x": (x.data_ptr(),),
            "dy": (dy.data_ptr(),),
            "tensors": [t.data_ptr() for t in full],
            "cotangents": [c.data_ptr() for c in cots],
            "params": [p.data_ptr() for p in params],
            "options": opts,
            "inputs": input_pairs(ins),
            "stats": list(stat_ptrs),
            "dx": (dx.data_ptr(), *(d.data_ptr() for d in dts)),
            "dparams": [d.data_ptr() for d in dps],
            "dinputs": [d.data_ptr() for d in dis],
            "nthreads": (self.nthreads(),),
        }
        if self.bfn(*self.bpack(*[values[k] for k in self.bsections])) != 0:
            raise MemoryError(f"{self.name}: backward kernel could not allocate its work buffer")
        back = self.channels
        # a broadcast tensor's sums are taken over NCHW-contiguous element gradients, so that
        # they are the same bits whichever memory format x came in
        dtens = [
            as_x_came(d, like, back)
            if self.kinds[t] == "x"
            else d
            if self.summed[t]
            else tensor_grad(meta, t, d.contiguous(), L, self.tshapes[t])
            for t, d in zip(self.gnames, dts)
        ]
        return (
            as_x_came(dx, like, back),
            *dtens,
            *dps,
            *(per_group_input_grad(d, t, x.dtype) for t, d in zip(ins, dis)),
        )


# the sections of the kernels' arguments a plan passes (runtime/abi.py; a layer's kernels have
# those it needs: no ``tensors`` without tensor inputs, no ``cotangents`` without outputs beside y)
_FORWARD_SECTIONS = (
    *("dims", "samples", "x", "tensors", "params", "options", "inputs"),
    *("buffers", "y", "stats", "nthreads"),
)
_BACKWARD_SECTIONS = (
    *("dims", "samples", "x", "dy", "tensors", "cotangents", "params", "options", "inputs"),
    *("stats", "dx", "dparams", "dinputs", "nthreads"),
)


def check_masks(plan: MultiPlan, tens: Sequence[torch.Tensor]) -> None:
    """Every mask among a call's tensor inputs 0 or 1 (its shape and dtype are the plan's),
    counted by the C kernels' library in one read of the mask."""
    for k, t in plan.masks:
        v = tens[k].contiguous()
        n = v.numel()
        if n and plan.mask_check(v.data_ptr(), n, 1 if n < SERIAL_BELOW else plan.nthreads()):
            raise ValueError(f"{plan.name}: {t} is a mask: every value must be 0 or 1")


class MultiPlans:
    """A multi layer's plans by mode and call signature: validated on first use, and again
    whenever the options are out of range (so that the error names them). Stands where the
    other layers have a :class:`derivgen.torch.plan.PlanCache`."""

    def __init__(self, lay: Layer) -> None:
        self.lay = lay
        # a channel layout's channels-last x runs the channels-last kernels (a position
        # layout has none: the C kernels refuse it for these layers; nor has reduce = "all")
        meta = lay.meta
        self.channel_layout = meta.layout == "channels" and meta.reduce not in ("position", "all") and not meta.blocks
        self.ranges = [lay.meta.options[o] for o in lay.options]
        self._plans: dict = {}
        self.last_ext: dict = {}  # the C++ extension's plans: none for these layers

    def options_ok(self, opts: Sequence) -> bool:
        """Every option of a call (in spec order) within its declared range."""
        return options_in_range(opts, self.ranges)

    def forward(self, mode: str, tens: list, opts: tuple, groups: int) -> MultiPlan:
        """The plan of a forward call (tensors, options and groups in operator order), its
        masks checked."""
        try:
            key, nhwc = call_key(tens, 0, groups, self.channel_layout)
            plan = self._plans.get((mode, key))
        except AttributeError:  # not a tensor: the validation names it
            key, nhwc, plan = None, False, None
        if plan is None or (opts != plan.opts_ok and not options_in_range(opts, self.ranges)):
            plan = self.validated(mode, tens, opts, groups, key, nhwc)
        else:
            check_masks(plan, tens)
        plan.opts_ok = opts
        return plan

    def validated(
        self, mode: str, tens: list, opts: tuple, groups: int, key: tuple | None, nhwc: bool = False
    ) -> MultiPlan:
        """Validate a forward call's arguments (raising on bad input: CPU tensors of the
        kernels' dtypes) and remember its plan (``nhwc``: x is channels last)."""
        fargs = self.lay.schemas[mode].forward
        a = by_spec_name(fargs, [*tens, *opts, groups])
        L = check_call(self.lay, mode, a)
        plan = MultiPlan(self.lay, mode, L, list(tens), a["num_groups"], nhwc)
        if key is not None:
            self._plans[(mode, key)] = plan
        return plan


def forward_impl(lay: Layer, mode: str) -> Callable:
    """The forward operator's CPU implementation: (y, outputs..., statistics...)."""
    ntens, nopt = tensor_count(lay.schemas[mode].forward), len(lay.options)

    def impl(*args):
        tens, opts = list(args[:ntens]), tuple(args[ntens : ntens + nopt])
        plan = lay.plans.forward(mode, tens, opts, args[-1])
        y, outs, st = plan.forward(tens, opts, blob=False)
        return op_result((y, *outs, *st))

    return impl


def backward_impl(lay: Layer, mode: str) -> Callable:
    """The backward operator's CPU implementation: the plan of the forward's signature;
    dy, the cotangents and the statistics checked against it."""
    s = lay.schemas[mode]
    meta, nout = lay.meta, s.outputs
    ntens, nstat, nopt = tensor_count(s.forward), len(meta.stats[mode]), len(lay.options)
    outputs = extra_outputs(meta)

    def impl(*args):
        dy, cots = args[0], args[1 : 1 + nout]
        k = 1 + nout
        tens, stats = list(args[k : k + ntens]), args[k + ntens : k + ntens + nstat]
        opts = tuple(args[k + ntens + nstat : k + ntens + nstat + nopt])
        plan = lay.plans.forward(mode, tens, opts, args[-1])
        x = tens[0]
        check_cotangent(meta, "dy", dy, x)
        for o, c in zip(outputs, cots):
            check_cotangent(meta, "d" + o, c, x)
        for name, t in zip(meta.stats[mode], stats):
            if t.dtype != torch.float64 or t.numel() != plan.n_groups:
                raise ValueError(
                    f"{meta.name}: statistic {name} must be float64 with one value per group "
                    f"({plan.n_groups}), as the forward returns them; got {t.dtype} {tuple(t.shape)}"
                )
        st = [t.contiguous() for t in stats]
        return op_result(plan.backward(dy, cots, tens, [t.data_ptr() for t in st], opts))

    return impl
