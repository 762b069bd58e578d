"""Per-call kernel plans: the C kernels called directly on tensors' data pointers.

The first call with a given signature (shapes, dtypes, contiguity, groups, layout) is
validated in full (:mod:`derivgen.torch.validate`: clear errors naming the argument); a
signature that passed is a *plan*: the kernels' ctypes functions with their argument
types declared and the layout, called directly on the tensors' data pointers (a strided
tensor is copied once first). Per call that leaves allocating the outputs and the
option range checks (8x1024 layer norm: a few microseconds of Python around each
kernel). A simple plan (contiguous tensors, no per-group inputs, no buffers passed) has
a twin in the C++ extension (:mod:`derivgen.torch.ext`) that does the same per call
without Python, checking first that a call's tensors, options and groups are the
plan's.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import torch

from derivgen import runtime as rt
from derivgen.runtime.abi import call_runs, reads_buffers
from derivgen.runtime.cbind import CKernel, input_pairs
from derivgen.torch import ext
from derivgen.torch.protocol import Layer
from derivgen.torch.schema import by_spec_name
from derivgen.torch.tensors import (
    SUFFIX,
    as_tuple,
    channels_last_format,
    fresh_like,
    is_channels_last,
    per_group_input_grad,
)
from derivgen.torch.validate import check_forward

# x with fewer values runs on one thread: a fork and join of the kernel's threads costs more
# than splitting a few microseconds of work saves (torch's at::internal::GRAIN_SIZE)
SERIAL_BELOW = 32768


def threads(kernel: CKernel) -> int:
    """The threads a kernel call uses: the layer's own setting (``set_num_threads`` of its
    C module), else torch's (``torch.set_num_threads``), so one setting governs both."""
    return kernel.threads or torch.get_num_threads()


def plan_threads(plan: KernelPlan) -> int:
    """The threads a plan's call uses: :func:`threads`, or one for a small x."""
    return 1 if plan.serial else threads(plan.kernel)


class KernelLibraries:
    """A layer's C libraries: float and double NCHW kernels in the layer's own build; the
    bfloat16 and channels-last ones in a second build of the same source
    (-DDG_EXTRAS_ONLY), compiled on first use."""

    def __init__(self, main: CKernel) -> None:
        self.main = main
        self._extras: CKernel | None = None

    def for_call(self, dtype: torch.dtype, nhwc: bool = False) -> CKernel:
        """The library holding the kernels of a dtype and layout."""
        if dtype != torch.bfloat16 and not nhwc:
            return self.main
        if self._extras is None:
            m = self.main
            self._extras = CKernel(m.meta, m.source, m.threads, cflags=m.cflags, extra=["-DDG_EXTRAS_ONLY"])
        return self._extras

    def cfunc(self, mode: str, direction: str, dtype: torch.dtype, nhwc: bool = False) -> ctypes._CFuncPtr:
        """The forward or backward kernel of a dtype and layout, argument types declared."""
        return self.for_call(dtype, nhwc).cfunc(mode, direction, ("nhwc_" if nhwc else "") + SUFFIX[dtype])


class KernelPlan:
    """A validated call signature of one layer and mode: the kernels' ctypes functions,
    the layout and everything else fixed by the shapes, so that a call only allocates
    its outputs and passes data pointers."""

    __slots__ = (
        "bfn",
        "bsig",
        "copy",
        "dims",
        "ext",
        "ffn",
        "fsig",
        "groups",
        "kernel",
        "lay",
        "mode",
        "n_groups",
        "name",
        "nhwc",
        "nin",
        "npar",
        "null_bufs",
        "opts_ok",
        "run_backward",
        "run_forward",
        "serial",
        "simple",
        "stat_offsets",
        "stats_like",
    )

    def __init__(self, lay: Layer, mode: str, L: rt.Layout, tens: list, nhwc: bool, groups: int) -> None:
        x = tens[0]
        self.lay, self.mode, self.groups, self.name = lay, mode, groups, lay.meta.name
        self.ffn = lay.libraries.cfunc(mode, "forward", x.dtype, nhwc)
        self.bfn = lay.libraries.cfunc(mode, "backward", x.dtype, nhwc)
        self.kernel = lay.ckernel._kernel
        self.fsig = self.kernel.signatures[(mode, "forward")]
        self.bsig = self.kernel.signatures[(mode, "backward")]
        self.dims, self.n_groups, self.nhwc = (L.O, L.G, L.Cg, L.S), L.n_groups, nhwc
        self.serial = L.O * L.G * L.Cg * L.S < SERIAL_BELOW
        self.npar, self.nin = len(lay.params), len(lay.inputs)
        # a strided tensor (or a channels-last one where this layer has no such kernel) is copied
        self.copy = not all(t.is_contiguous() for t in (tens[1:] if nhwc else tens))
        takes_buffers = reads_buffers(lay.meta, mode)
        self.null_bufs = [] if takes_buffers else [None] * len(lay.buffers)
        nstat = len(lay.meta.stats[mode])
        self.stat_offsets = [8 * L.n_groups * k for k in range(nstat)]
        self.stats_like = torch.empty((nstat, L.n_groups), dtype=torch.float64)
        # contiguous tensors, no per-group inputs, no buffers passed
        self.simple = not self.copy and not self.nin and not (takes_buffers and lay.buffers)
        # the options of the last call, known to be in range (and handed to the C++ plan); None
        # before the first, so that a layer without options hands its C++ plan () too
        self.opts_ok: tuple | None = None
        # the common case's calls, the arguments in the order the signature's packers check
        self.run_forward = _fast_forward(self) if self.simple else None
        self.run_backward = _fast_backward(self) if self.simple and not nhwc else None
        # the same calls without Python, through the C++ extension (derivgen.torch.ext), where it is built
        self.ext = _ext_plan(self, tens) if self.run_backward is not None else None

    def forward(
        self, tens: list[torch.Tensor], opts: tuple[float, ...], blob: bool
    ) -> tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]]:
        """y and the statistics by the forward kernel on validated tensors. The statistics
        are one float64 tensor per statistic, or with ``blob`` one (statistics, groups)
        tensor (one allocation: the eager path keeps them together)."""
        if self.simple and blob:
            return self.run_forward(tens, opts)
        return _forward_general(self, tens, opts, blob)

    def backward(
        self, dy: torch.Tensor, tens: list[torch.Tensor], stat_ptrs: list[int], opts: tuple[float, ...]
    ) -> tuple:
        """(dx, dparams..., dinputs...) by the backward kernel. ``tens`` are the forward's
        tensors (x, params, inputs[, buffers]); dy has x's shape and dtype."""
        if self.run_backward:
            return self.run_backward(dy, tens, stat_ptrs, opts)
        return _backward_general(self, dy, tens, stat_ptrs, opts)


def _fast_forward(plan: KernelPlan):
    """``run(tens, opts) -> (y, statistics)`` for a simple plan: the forward kernel called
    with its arguments in the order ``fpack`` checked when the plan was made (dims, x and
    the parameters, options, the buffers it does not read, y, statistics, threads)."""
    plan.fsig.packer(  # raises unless the signature has its sections in this order
        ("dims", "x_params", "options", "buffers", "y", "stats", "nthreads"), merged={"x_params": ("x", "params")}
    )
    ffn, dims, nulls, offs, like = plan.ffn, plan.dims, plan.null_bufs, plan.stat_offsets, plan.stats_like
    kernel, serial, name, empty_like = plan.kernel, plan.serial, plan.name, torch.empty_like

    def run(tens: Sequence[torch.Tensor], opts: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        y = fresh_like(tens[0])
        st = empty_like(like)
        p = st.data_ptr()
        nth = 1 if serial else threads(kernel)
        if ffn(*dims, *[t.data_ptr() for t in tens], *opts, *nulls, y.data_ptr(), *[p + o for o in offs], nth):
            raise MemoryError(f"{name}: forward kernel could not allocate its work buffer")
        return y, st

    return run


def _fast_backward(plan: KernelPlan):
    """``run(dy, tens, stat_ptrs, opts) -> (dx, dparams...)`` for a simple plan (not
    channels last): the backward kernel with its arguments in the order its signature's
    packer checks (dims, x, dy, parameters, options, statistics, dx, parameter gradients,
    threads)."""
    plan.bsig.packer(  # raises unless the signature has its sections in this order
        ("dims", "x_dy", "params", "options", "stats", "dx", "dparams", "nthreads"), merged={"x_dy": ("x", "dy")}
    )
    bfn, dims, kernel, serial, name, empty_like = (
        plan.bfn,
        plan.dims,
        plan.kernel,
        plan.serial,
        plan.name,
        torch.empty_like,
    )

    def run(
        dy: torch.Tensor, tens: Sequence[torch.Tensor], stat_ptrs: Sequence[int], opts: tuple[float, ...]
    ) -> tuple[torch.Tensor, ...]:
        x = tens[0]
        if not dy.is_contiguous():
            dy = dy.contiguous()
        dx = fresh_like(x)
        dps = [empty_like(p) for p in tens[1:]]
        nth = 1 if serial else threads(kernel)
        if bfn(
            *dims,
            x.data_ptr(),
            dy.data_ptr(),
            *[t.data_ptr() for t in tens[1:]],
            *opts,
            *stat_ptrs,
            dx.data_ptr(),
            *[t.data_ptr() for t in dps],
            nth,
        ):
            raise MemoryError(f"{name}: backward kernel could not allocate its work buffer")
        return (dx, *dps)

    return run


def _ext_plan(plan: KernelPlan, tens: list[torch.Tensor]) -> Any:
    """The plan in the C++ extension (``ext.Plan``: called with (tensors, options, groups), it
    returns (y, statistics), or None when they do not fit): for a simple plan whose kernels'
    arguments come in the runs the extension calls (see
    :func:`derivgen.runtime.abi.call_runs`), in the sections' order that
    :func:`_fast_forward` and :func:`_fast_backward` checked. None where the extension is
    not available."""
    mod = ext.module()
    if mod is None:
        return None
    npar, nopt, nstat, nnull = plan.npar, len(plan.lay.options), len(plan.stat_offsets), len(plan.null_bufs)
    fruns = _split_runs(call_runs(plan.fsig), 4 + 1 + npar)
    bruns = _split_runs(call_runs(plan.bsig), 4 + 2 + npar)
    if (
        len(tens) != 1 + npar
        or fruns != (4 + 1 + npar, nopt, nnull + 1 + nstat)
        or bruns != (4 + 2 + npar, nopt, nstat + 1 + npar)
        or max(fruns[0], bruns[0]) > mod.MAX_LEAD
        or nopt > mod.MAX_OPTS
        or max(fruns[2], bruns[2]) > mod.MAX_TAIL
    ):
        return None
    lay, mode, groups = plan.lay, plan.mode, plan.groups

    def differentiable_backward(dy, *args):
        """The backward operator (its autograd is the derived double backward): a backward
        with create_graph=True. A tuple, one gradient per tensor (x, then the parameters),
        also where the operator returns dx alone (as a bare tensor)."""
        *ts, st, opts = args
        return as_tuple(lay.modes[mode].backward(dy.contiguous(), *ts, *st.unbind(0), *opts, groups))

    def address(f: ctypes._CFuncPtr) -> int:
        return ctypes.cast(f, ctypes.c_void_p).value

    return mod.Plan(
        plan.name,
        (address(plan.ffn), *fruns),
        (address(plan.bfn), *bruns),
        list(plan.dims),
        [list(t.shape) for t in tens],
        [t.dtype for t in tens],
        nnull,
        nstat,
        plan.n_groups,
        groups,
        plan.serial,
        plan.kernel,
        differentiable_backward,
    )


def _split_runs(runs: tuple[int, int, int] | None, lead: int) -> tuple[int, int, int] | None:
    """A kernel's runs (:func:`derivgen.runtime.abi.call_runs`) with the integers before its
    outputs (the dims and the pointers it reads, ``lead`` of them) a run of their own. A kernel
    without options has one run of integers, ``(lead + tail, 0, 0)``: the same call as
    ``(lead, 0, tail)``, which is the extension's split."""
    if runs is None or runs[1] or runs[0] < lead:
        return runs
    return (lead, 0, runs[0] - lead + runs[2])


def _contiguous_operands(plan: KernelPlan, tens: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors, copied where strided (x keeps its channels-last layout where the
    plan has channels-last kernels)."""
    return [tens[0] if plan.nhwc else tens[0].contiguous()] + [t.contiguous() for t in tens[1:]]


def _forward_general(plan: KernelPlan, tens: list[torch.Tensor], opts: tuple[float, ...], blob: bool) -> tuple:
    """:meth:`KernelPlan.forward` with per-group inputs, buffers or tensors to copy; a
    channels-last x of a layout without channels-last kernels (a position's channels) is
    read contiguous and y given back channels last, as x came."""
    like = tens[0]
    if plan.copy:
        tens = _contiguous_operands(plan, tens)
    x = tens[0]
    y = fresh_like(x)  # x's layout: contiguous or channels last
    if blob:
        st = torch.empty_like(plan.stats_like)
        sp = [st.data_ptr() + o for o in plan.stat_offsets]
    else:
        st = [torch.empty(plan.n_groups, dtype=torch.float64) for _ in plan.stat_offsets]
        sp = [t.data_ptr() for t in st]
    k = 1 + plan.npar
    ptrs = [t.data_ptr() for t in tens]
    if (
        plan.ffn(
            *plan.fsig.pack(
                {
                    "dims": plan.dims,
                    "x": ptrs[:1],
                    "params": ptrs[1:k],
                    "options": opts,
                    "inputs": input_pairs(tens[k : k + plan.nin]),
                    "buffers": ptrs[k + plan.nin :] or plan.null_bufs,
                    "y": (y.data_ptr(),),
                    "stats": sp,
                    "nthreads": (plan_threads(plan),),
                }
            )
        )
        != 0
    ):
        raise MemoryError(f"{plan.name}: forward kernel could not allocate its work buffer")
    return _as_x_came(y, like, plan), st


def _as_x_came(t: torch.Tensor, like: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
    """An element-level result computed contiguous, in the memory format ``like`` (x as the
    caller gave it) has when that is channels last and the plan had no kernels for it."""
    if plan.nhwc or plan.lay.meta.layout != "channels" or not is_channels_last(like):
        return t
    return t.contiguous(memory_format=channels_last_format(like))


def _backward_general(
    plan: KernelPlan, dy: torch.Tensor, tens: list[torch.Tensor], stat_ptrs: list[int], opts: tuple[float, ...]
) -> tuple:
    """:meth:`KernelPlan.backward` with per-group inputs, buffers, channels last or tensors to copy."""
    like = tens[0]
    if plan.copy:
        tens = _contiguous_operands(plan, tens)
    x, k = tens[0], 1 + plan.npar
    dy = dy.contiguous(memory_format=channels_last_format(x)) if plan.nhwc else dy.contiguous()
    params, ins = tens[1:k], tens[k : k + plan.nin]
    dx = fresh_like(x)
    dps = [torch.empty_like(p) for p in params]
    dis = [torch.empty(plan.n_groups, dtype=x.dtype) for _ in ins]
    if (
        plan.bfn(
            *plan.bsig.pack(
                {
                    "dims": plan.dims,
                    "x": (x.data_ptr(),),
                    "dy": (dy.data_ptr(),),
                    "params": [p.data_ptr() for p in params],
                    "options": opts,
                    "inputs": input_pairs(ins),
                    "stats": stat_ptrs,
                    "dx": (dx.data_ptr(),),
                    "dparams": [t.data_ptr() for t in dps],
                    "dinputs": [t.data_ptr() for t in dis],
                    "nthreads": (plan_threads(plan),),
                }
            )
        )
        != 0
    ):
        raise MemoryError(f"{plan.name}: backward kernel could not allocate its work buffer")
    return (_as_x_came(dx, like, plan), *dps, *(per_group_input_grad(d, t, x.dtype) for t, d in zip(ins, dis)))


def options_in_range(opts: Sequence[Any], ranges: Sequence[tuple]) -> bool:
    """Every option a finite float within its declared range (``ranges``: (default, lo, hi))."""
    for v, (_, lo, hi) in zip(opts, ranges):
        if (
            not (isinstance(v, float) and math.isfinite(v))
            or (lo is not None and v < lo)
            or (hi is not None and v > hi)
        ):
            return False
    return True


def call_key(tens: Sequence[torch.Tensor], xi: int, groups: int, channel_layout: bool) -> tuple[tuple, bool]:
    """A call's signature, and whether x (``tens[xi]``) is channels last."""
    nhwc = channel_layout and is_channels_last(tens[xi])
    return (*[(t.shape, t.dtype, t.is_cpu, t.is_contiguous()) for t in tens], groups, nhwc), nhwc


class PlanCache:
    """A layer's plans by mode and call signature: validated on first use, and again
    whenever the options are out of range (so that the error names them)."""

    def __init__(self, lay: Layer) -> None:
        self.lay = lay
        self.ranges = [lay.meta.options[o] for o in lay.options]
        # the layouts with channels-last kernels; a position layout's channels-last x is made
        # contiguous (its kernels walk channels-first memory)
        # a channel layout's channels-last tensors run the channels-last kernels (a layer with
        # block statistics has none, nor the reduce = "all" layout, whose one group spans the
        # channels: their tensors are made NCHW-contiguous)
        meta = lay.meta
        self.channel_layout = meta.layout == "channels" and meta.reduce not in ("position", "all") and not meta.blocks
        self._plans: dict = {}
        self.last_ext: dict = {}  # mode -> the C++ plan of the last call through the extension

    def forward(self, mode: str, tens: list[torch.Tensor], opts: tuple[float, ...], groups: int) -> KernelPlan:
        """The plan of a forward call (tensors, options and groups in operator order)."""
        try:
            key, nhwc = call_key(tens, 0, groups, self.channel_layout)
            plan = self._plans.get((mode, key))
        except AttributeError:  # not a tensor: the validation names it
            key = nhwc = plan = None
        if plan is None or (opts != plan.opts_ok and not options_in_range(opts, self.ranges)):
            plan = self.validated(mode, [*tens, *opts, groups], key, nhwc)
        if plan.opts_ok != opts:
            plan.opts_ok = opts  # in range: the next call with the same options skips the check
            if plan.ext is not None:
                plan.ext.set_options(opts)
        return plan

    def options_ok(self, opts: Sequence[Any]) -> bool:
        """Every option of a call (in spec order) within its declared range."""
        return options_in_range(opts, self.ranges)

    def validated(self, mode: str, args: list, key: tuple | None, nhwc: bool) -> KernelPlan:
        """Validate a forward call's arguments (raising on bad input) and remember its plan."""
        fargs = self.lay.schemas[mode].forward
        a = by_spec_name(fargs, args)
        L = check_forward(self.lay.meta, mode, a, nhwc)
        tens = [v for arg, v in zip(fargs, args) if arg.type == "Tensor"]
        plan = KernelPlan(self.lay, mode, L, tens, nhwc, a["num_groups"])
        self._plans[(mode, key)] = plan
        return plan
