"""Batch statistics over a batch that no single process holds: the split reduction.

A layer whose groups span the batch (batch norm, and any spec with ``reduce =
"batch"``) computes its statistics level by level (``split_levels`` in
derivgen.codegen.emit: the forward program's sweeps): each process sums its own part of
every group, one ``all_reduce`` adds the sums of a level, and every process
finishes the level's statistics from the totals and the global group size. The
mean's sums come first, then the sums of squared deviations from the *global*
mean: the same two-pass numerics as one process, never E[x^2] - E[x]^2. The
backward needs the sums of its reductions (for batch norm, of g and g*x_hat):
one more all_reduce, then each process applies the closed form to its part.

The functions come from the generated PyTorch target (``partial_<mode>``,
``finish_<mode>``, ``apply_<mode>``, ``backward_partial_<mode>``,
``backward_apply_<mode>``), computed in float64 whatever the input dtype.
Before the first level, one small ``all_gather`` exchanges each process's
element count, channel count and dtype, and whether its input passed the checks,
so that a bad input on one process is an error on every process instead of a hang.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from derivgen import runtime as rt
from derivgen.runtime.abi import native, sums_own
from derivgen.runtime.cbind import input_pairs
from derivgen.symbolic.reduce import SELECTIONS
from derivgen.torch.multi_plan import as_x_came
from derivgen.torch.plan import threads
from derivgen.torch.protocol import Layer
from derivgen.torch.schema import tensor_inputs
from derivgen.torch.tensors import fresh_like, full_tensor, tensor_grad

_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.bfloat16: 3}


class SyncError(ValueError):
    """Raised on every process when the processes' inputs do not fit together."""


def _check_tensors(lay: Layer, x: torch.Tensor, params: dict, tensors: dict) -> str | None:
    """This process's tensor inputs' problems (None when they are fine): each given, of x's
    dtype (float32 or float64: the C split kernels'), of its declared shape for this part,
    a mask 0 or 1."""
    meta = lay.meta
    name = meta.name
    if x.dtype not in (torch.float32, torch.float64):
        return f"{name}: x has dtype {x.dtype}; a layer with tensor inputs splits in float32 and float64"
    L = rt.split_layout(meta, tuple(x.shape), {p: tuple(t.shape) for p, t in params.items()})
    for t in tensor_inputs(meta):
        v = tensors.get(t)
        if not isinstance(v, torch.Tensor):
            return f"{name}: the tensor input {t} is required (a torch.Tensor)"
        want = rt.tensor_shape(meta, meta.tensors[t][0], L)
        if v.dtype != x.dtype or tuple(v.shape) != tuple(want):
            return f"{name}: {t} must be {x.dtype} of shape {tuple(want)}, got {v.dtype} {tuple(v.shape)}"
        if meta.tensors[t][2] and v.numel() and not bool(((v == 0) | (v == 1)).all()):
            return f"{name}: {t} is a mask: every value must be 0 or 1"
    return None


def _check_part(lay: Layer, x: torch.Tensor, params: dict, channels: int) -> str | None:
    """This process's input problems (None when it is fine)."""
    name = lay.meta.name
    if not isinstance(x, torch.Tensor):
        return f"{name}: x must be a torch.Tensor, got {type(x).__name__}"
    if x.device.type != "cpu":
        return f"{name}: x is on {x.device}; derivgen's split reduction runs on the CPU"
    if x.dtype not in _DTYPE_CODES:
        return f"{name}: x has dtype {x.dtype}; supported are float32, float64 and bfloat16"
    if x.dim() < 2 or x.shape[1] != channels:
        return f"{name}: x must have shape (N, {channels}, ...), got {tuple(x.shape)}"
    for p, t in params.items():
        if t.dtype != x.dtype:
            return f"{name}: {p} has dtype {t.dtype} but x has {x.dtype}"
    return None


def exchange(lay: Layer, pg: dist.ProcessGroup, x: torch.Tensor, problem: str | None, channels: int) -> int:
    """The header collective: every process's count of values per group, channels, dtype
    and status. Raises SyncError on every process if any process failed its checks or
    the parts disagree; returns the global group size."""
    name = lay.meta.name
    ok = problem is None
    per = (math.prod(x.shape) // max(1, x.shape[1])) if ok else 0
    code = _DTYPE_CODES.get(getattr(x, "dtype", None), 0)
    mine = torch.tensor([int(ok), per, x.shape[1] if ok else channels, code], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(every, mine, group=pg)
    rows = [tuple(int(v) for v in t) for t in every]
    if not ok:
        raise SyncError(problem + " (every process of the group raises)")
    bad = [r for r, row in enumerate(rows) if row[0] == 0]
    if bad:
        raise SyncError(f"{name}: process(es) {bad} of the group failed their input checks (see their error)")
    if len({row[2] for row in rows}) > 1:
        raise SyncError(
            f"{name}: the processes' inputs have different channel counts: "
            f"{[row[2] for row in rows]} (by rank in the group)"
        )
    if len({row[3] for row in rows}) > 1:
        names = {v: k for k, v in _DTYPE_CODES.items()}
        raise SyncError(f"{name}: the processes' inputs have different dtypes: {[names[row[3]] for row in rows]}")
    n = sum(row[1] for row in rows)
    need = lay.meta.min_group_size["train"]
    if n < need:
        raise SyncError(
            f"{name}: the group's processes hold {n} values per channel together; training mode needs at least {need}"
        )
    return n


def _all_reduce(parts: tuple, pg) -> tuple:
    """One all_reduce for all of a level's sums."""
    if not parts:
        return parts
    flat = torch.cat([p.reshape(-1) for p in parts])
    dist.all_reduce(flat, group=pg)
    out, at = [], 0
    for p in parts:
        out.append(flat[at : at + p.numel()].reshape(p.shape))
        at += p.numel()
    return tuple(out)


class _CSplit:
    """The generated C split kernels of a layer (float32/float64, NCHW-contiguous parts),
    called with the arguments their signatures (derivgen.runtime.abi) lay out."""

    KINDS = ("partial", "finish", "apply", "bpartial", "bapply")

    def __init__(self, lay: Layer, dtype: torch.dtype) -> None:
        sfx = {torch.float32: "f32", torch.float64: "f64"}[dtype]
        k = lay.ckernel._kernel
        self.fn = {kind: k.split_cfunc(kind, sfx) for kind in self.KINDS}
        self.sig = {kind: k.signatures[("train", "split_" + kind)] for kind in self.KINDS}
        self.kernel = k
        self.split = lay.meta.split
        self.nstat = len(lay.meta.stats["train"])

    def _call(self, kind: str, leading: dict, **sections) -> int:
        """One split kernel's status, from the leading sections and the kernel's own."""
        return self.fn[kind](*self.sig[kind].pack({**leading, **sections}))

    @staticmethod
    def _leading(L, params, opts, ins, tens=()) -> dict:
        """The leading sections; ``tens``: the tensor inputs beside x at the part's x shape."""
        lead = {
            "dims": (L.O, L.G, L.Cg, L.S),
            "params": [p.data_ptr() for p in params],
            "options": opts,
            "inputs": input_pairs(ins),
        }
        if tens:
            lead["tensors"] = [t.data_ptr() for t in tens]
        return lead

    def forward(self, L, x, params, opts, ins, n, pg, tens=()):
        """y and the (statistics, groups) float64 statistics of the whole batch, one
        all_reduce per statistics level."""
        lead = self._leading(L, params, opts, ins, tens)
        nth = (threads(self.kernel),)
        stats = torch.zeros((self.nstat, L.n_groups), dtype=torch.float64)
        for level, nsums in enumerate(self.split.levels):
            sums = torch.zeros((nsums, L.n_groups), dtype=torch.float64)
            if nsums:
                if (
                    L.O
                    and self._call(
                        "partial",
                        lead,
                        x=(x.data_ptr(),),
                        level=(level,),
                        stats=(stats.data_ptr(),),
                        count=(float(n),),
                        sums=(sums.data_ptr(),),
                        nthreads=nth,
                    )
                    != 0
                ):
                    raise RuntimeError("split partial kernel failed")
                dist.all_reduce(sums, group=pg)
            if (
                self._call(
                    "finish",
                    lead,
                    level=(level,),
                    sums=(sums.data_ptr(),),
                    count=(float(n),),
                    stats=(stats.data_ptr(),),
                )
                != 0
            ):
                raise RuntimeError("split finish kernel failed")
        y = fresh_like(x)
        if (
            L.O
            and self._call(
                "apply",
                lead,
                x=(x.data_ptr(),),
                stats=(stats.data_ptr(),),
                count=(float(n),),
                y=(y.data_ptr(),),
                nthreads=nth,
            )
            != 0
        ):
            raise MemoryError("split apply kernel could not allocate its work buffer")
        return y, stats

    def backward(self, L, x, dy, params, opts, ins, stats, n, pg, group_terms, tens=(), dts=()):
        """dx and this part's parameter gradients, one all_reduce of the backward's sums;
        the tensors' element gradients written into ``dts`` (x's shape)."""
        lead = self._leading(L, params, opts, ins, tens)
        nth = (threads(self.kernel),)
        sums = torch.zeros((self.split.backward, L.n_groups), dtype=torch.float64)
        if self.split.backward:
            if (
                L.O
                and self._call(
                    "bpartial",
                    lead,
                    x=(x.data_ptr(),),
                    dy=(dy.data_ptr(),),
                    stats=(stats.data_ptr(),),
                    count=(float(n),),
                    sums=(sums.data_ptr(),),
                    nthreads=nth,
                )
                != 0
            ):
                raise RuntimeError("split bpartial kernel failed")
            dist.all_reduce(sums, group=pg)
        dx = fresh_like(x)
        dparams = [torch.empty_like(p) for p in params]
        dinputs = [torch.empty(L.n_groups, dtype=x.dtype) for _ in ins]
        if L.O == 0:
            for d in dts:
                d.zero_()
            return dx, [d.zero_() for d in dparams]
        if (
            self._call(
                "bapply",
                lead,
                x=(x.data_ptr(),),
                dy=(dy.data_ptr(),),
                stats=(stats.data_ptr(),),
                sums=(sums.data_ptr(),),
                count=(float(n),),
                group_terms=(int(group_terms),),
                dx=(dx.data_ptr(), *(d.data_ptr() for d in dts)),
                dparams=[d.data_ptr() for d in dparams],
                dinputs=[d.data_ptr() for d in dinputs],
                nthreads=nth,
            )
            != 0
        ):
            raise MemoryError("split bapply kernel could not allocate its work buffer")
        return dx, dparams


class _SyncFunction(torch.autograd.Function):
    """y of a batch-reduced layer over a batch split across processes, with the
    split backward (one all_reduce of the backward's sums). float32/float64 parts in
    the NCHW layout run the generated C split kernels; other parts (bfloat16, channels
    last, strided) the generated PyTorch target in float64."""

    @staticmethod
    def forward(ctx, lay, pg, n, options, kw_inputs, x, *params):
        """y of this process's part, with statistics reduced over every process's part."""
        L = rt.split_layout(lay.meta, tuple(x.shape), {p: tuple(t.shape) for p, t in zip(lay.params, params)})
        ctx.lay, ctx.pg, ctx.n, ctx.L = lay, pg, n, L
        names = lay.meta.stats["train"]
        if x.dtype in (torch.float32, torch.float64) and x.is_contiguous() and lay.meta.split:
            c = lay._csplit.get(x.dtype)
            if c is None:
                c = lay._csplit[x.dtype] = _CSplit(lay, x.dtype)
            params_c = [t.contiguous() for t in params]
            ins = [kw_inputs[i].to(x.dtype).contiguous() for i in lay.inputs]
            opts = [options[o] for o in lay.options]
            y, stats = c.forward(L, x, params_c, opts, ins, n, pg)
            ctx.c, ctx.opts, ctx.ins, ctx.stats = c, opts, ins, stats
            ctx.save_for_backward(x, *params_c)
            st = [stats[k].clone() for k in range(len(names))]
        else:
            target = lay.target
            kw = _kw(lay, x, L, dict(zip(lay.params, params)), options, kw_inputs)
            x4 = x.detach().double().reshape(L.view4)
            stats = {}
            for level in range(target.SPLIT_LEVELS_TRAIN):
                sums = _all_reduce(target.partial_train(level, x4, **kw, _L=L, _stats=stats), pg)
                stats.update(target.finish_train(level, sums, **kw, _stats=stats, N=n))
            y = target.apply_train(x4, **kw, _stats=stats).reshape(x.shape).to(x.dtype)
            ctx.c, ctx.kw, ctx.stats = None, kw, stats
            ctx.save_for_backward(x, *params)
            st = [stats[s].detach().reshape(-1).clone() for s in names]
        ctx.mark_non_differentiable(*st)
        return (y, *st)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, *dstats):
        """The gradients of this part, with the backward's reductions summed over every process."""
        lay, pg, n, L = ctx.lay, ctx.pg, ctx.n, ctx.L
        x, *params = ctx.saved_tensors
        first = dist.get_rank(pg) == 0
        if ctx.c is not None:
            dx, dps = ctx.c.backward(L, x, dy.contiguous(), params, ctx.opts, ctx.ins, ctx.stats, n, pg, first)
            return (None, None, None, None, None, dx, *dps)
        target = lay.target
        x4 = x.double().reshape(L.view4)
        dy4 = dy.double().reshape(L.view4)
        sums = _all_reduce(target.backward_partial_train(dy4, x4, **ctx.kw, _L=L, _stats=ctx.stats, N=n), pg)
        dx, dparams, _ = target.backward_apply_train(
            dy4, x4, **ctx.kw, _L=L, _stats=ctx.stats, _sums=sums, N=n, _group_terms=first
        )
        grads = [dparams[p].reshape(t.shape).to(t.dtype) for p, t in zip(lay.params, params)]
        return (None, None, None, None, None, dx.reshape(x.shape).to(x.dtype), *grads)


class _SyncTensors(torch.autograd.Function):
    """A batch-reduced layer with tensor inputs beside x over a batch split across processes:
    the generated C split kernels (float32/float64) on NCHW-contiguous copies of the part and
    its tensors (those of x's shape; the per-(sample, channel) and per-position ones at their
    own); y and dx in x's memory format, each tensor's gradient over this part (a broadcast
    one summed over its broadcast axes, by the kernel for a per-(sample, channel) one)."""

    @staticmethod
    def forward(ctx, lay, pg, n, options, kw_inputs, ntens, x, *rest):
        """y of this process's part, with statistics reduced over every process's part."""
        meta = lay.meta
        tens, params = rest[:ntens], rest[ntens:]
        L = rt.split_layout(meta, tuple(x.shape), {p: tuple(t.shape) for p, t in zip(lay.params, params)})
        ctx.lay, ctx.pg, ctx.n, ctx.L, ctx.like = lay, pg, n, L, x
        c = lay._csplit.get(x.dtype)
        if c is None:
            c = lay._csplit[x.dtype] = _CSplit(lay, x.dtype)
        xc = x.contiguous()
        # at x's shape, but the per-(sample, channel) and per-position ones, which the kernels
        # read at their own shape (derivgen.runtime.abi.native)
        full = [
            v.contiguous() if native(meta, meta.tensors[t][0]) else full_tensor(meta, t, v, L).contiguous()
            for t, v in zip(tensor_inputs(meta), tens)
        ]
        params_c = [t.contiguous() for t in params]
        ins = [kw_inputs[i].to(x.dtype).contiguous() for i in lay.inputs]
        opts = [options[o] for o in lay.options]
        y, stats = c.forward(L, xc, params_c, opts, ins, n, pg, full)
        ctx.c, ctx.opts, ctx.ins, ctx.stats, ctx.ntens = c, opts, ins, stats, ntens
        ctx.tshapes = [tuple(t.shape) for t in tens]
        ctx.save_for_backward(xc, *full, *params_c)
        st = [stats[k].clone() for k in range(len(meta.stats["train"]))]
        ctx.mark_non_differentiable(*st)
        return (as_x_came(y, x, True), *st)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, *dstats):
        """dx, the tensors' and the parameters' gradients of this part."""
        L, meta = ctx.L, ctx.lay.meta
        xc, *rest = ctx.saved_tensors
        full, params = rest[: ctx.ntens], rest[ctx.ntens :]
        names = tensor_inputs(meta)
        grads = [t for t in names if meta.tensors[t][1]]
        # a per-(sample, channel) tensor's gradient the kernel sums; the others' at x's shape
        own = {t: sums_own(meta, meta.tensors[t][0]) for t in grads}
        shapes = dict(zip(names, ctx.tshapes))
        dts = [xc.new_empty(shapes[t]) if own[t] else torch.empty_like(xc) for t in grads]
        first = dist.get_rank(ctx.pg) == 0
        dx, dps = ctx.c.backward(
            L, xc, dy.contiguous(), params, ctx.opts, ctx.ins, ctx.stats, ctx.n, ctx.pg, first, full, dts
        )
        by_name = dict(zip(grads, dts))
        dtens = []
        for t, shape in zip(names, ctx.tshapes):
            d = by_name.get(t)
            if d is not None:
                if meta.tensors[t][0] == "x":
                    d = as_x_came(d, ctx.like, True)
                elif not own[t]:
                    d = tensor_grad(meta, t, d, L, shape)
            dtens.append(d)
        return (None, None, None, None, None, None, as_x_came(dx, ctx.like, True), *dtens, *dps)


def check_syncable(lay: Layer) -> None:
    """Raise ValueError unless ``lay``'s statistics can be split across processes: groups
    that span the batch (layout channels, reduce batch), statistics that are means (one
    all_reduce of sums per level; a group max()/min() would need another reduction)."""
    meta = lay.meta
    if lay.spec.outputs:
        raise ValueError(f"{meta.name}: a split reduction across processes takes no layer with outputs beside y")
    if meta.layout != "channels" or meta.reduce != "batch":
        raise ValueError(
            f"{meta.name}: a split reduction across processes needs a layer whose groups span "
            f"the batch (layout channels, reduce batch); this one is {meta.layout}/{meta.reduce}"
        )
    selected = [st.name for st in lay.spec.modes[0].statistics if st.expr.has(*SELECTIONS)]
    if selected:
        raise ValueError(
            f"{meta.name}: a split reduction across processes sums means; the statistic(s) "
            f"{', '.join(selected)} take a group max()/min(), which it does not reduce"
        )


def sync_group(process_group: dist.ProcessGroup | None, training: bool) -> dist.ProcessGroup | None:
    """The process group a split reduction runs over, or None when there is nothing to
    split (not training, torch.distributed not initialized, or one process)."""
    if not (training and dist.is_available() and dist.is_initialized()):
        return None
    pg = process_group if process_group is not None else dist.group.WORLD
    return pg if dist.get_world_size(pg) > 1 else None


def sync_forward(
    lay: Layer,
    pg: dist.ProcessGroup | None,
    x: torch.Tensor,
    params: dict,
    options: dict,
    inputs: dict | None = None,
    tensors: dict | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """(y, {statistic: per-group float64 tensor}, N) of a batch-reduced layer in
    training mode over the batch the processes of ``pg`` hold together (``pg`` None:
    the default group); ``tensors``: this part's tensor inputs beside x by name (a layer
    with them). Autograd-aware; the parameters' gradients are this process's part
    (DistributedDataParallel adds them up)."""
    meta = lay.meta
    check_syncable(lay)
    pg = pg if pg is not None else dist.group.WORLD
    channels = next((t.shape[0] for p, t in params.items() if p not in meta.scalar_params), x.shape[1])
    problem = _check_part(lay, x, params, channels)
    if problem is None and meta.tensors:
        problem = _check_tensors(lay, x, params, tensors or {})
    n = exchange(lay, pg, x, problem, channels)
    opts = {o: float(options[o]) for o in lay.options}
    ins = {i: inputs[i] for i in lay.inputs} if inputs else {}
    if set(ins) != set(lay.inputs):
        raise ValueError(f"{meta.name}: the per-group inputs {lay.inputs} are required")
    if meta.tensors:
        tens = [tensors[t] for t in tensor_inputs(meta)]
        out = _SyncTensors.apply(lay, pg, n, opts, ins, len(tens), x, *tens, *(params[p] for p in lay.params))
    else:
        out = _SyncFunction.apply(lay, pg, n, opts, ins, x, *(params[p] for p in lay.params))
    y, st = out[0], out[1:]
    return y, dict(zip(meta.stats["train"], st)), n


def statistics_over(
    lay: Layer,
    parts: Sequence[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
    params: dict,
    options: dict,
) -> tuple[dict, int]:
    """The training statistics of a batch-reduced layer over a batch held in parts (a
    sequence of tensors (n_k, C, ...), or a callable returning a fresh iterable of them:
    the parts are read once per statistics level), one part in memory at a time. Returns
    ({statistic: per-group float64 tensor (1, C, 1, 1)}, values per group); then
    ``apply_statistics`` normalizes each part. The arithmetic of one process with the
    whole batch, in float64: the split reduction without torch.distributed."""
    meta = lay.meta
    check_syncable(lay)
    if lay.meta.tensors:  # the generated PyTorch split functions do not take tensor inputs beside x
        raise ValueError(
            f"{lay.meta.name}: statistics_over takes no layer with tensor inputs beside x; the NumPy and C "
            "modules' split_* functions do (tensors=)"
        )
    again = parts if callable(parts) else (lambda: parts)
    target = lay.target
    stats: dict = {}
    n = None
    for level in range(target.SPLIT_LEVELS_TRAIN):
        total, count = None, 0
        for x in again():
            L = rt.split_layout(lay.meta, tuple(x.shape), {p: tuple(t.shape) for p, t in params.items()})
            kw = _kw(lay, x, L, params, options)
            sums = target.partial_train(level, x.detach().double().reshape(L.view4), **kw, _L=L, _stats=stats)
            total = sums if total is None else tuple(a + b for a, b in zip(total, sums))
            count += L.O * L.Cg * L.S
        if count == 0:
            raise ValueError(f"{meta.name}: the parts hold no values")
        n = count
        stats.update(target.finish_train(level, total, **_kw(lay, x, L, params, options), _stats=stats, N=n))
    return stats, n


def apply_statistics(lay: Layer, x: torch.Tensor, stats: dict, params: dict, options: dict) -> torch.Tensor:
    """y of one part, normalized with statistics from :func:`statistics_over`."""
    L = rt.split_layout(lay.meta, tuple(x.shape), {p: tuple(t.shape) for p, t in params.items()})
    y = lay.target.apply_train(x.detach().double().reshape(L.view4), **_kw(lay, x, L, params, options), _stats=stats)
    return y.reshape(x.shape).to(x.dtype)


def _kw(lay: Layer, x: torch.Tensor, L: rt.Layout, params: dict, options: dict, inputs: dict | None = None) -> dict:
    """The generated PyTorch module's keyword arguments for a part, in float64 (no ``_L``)."""
    a = {"x": x, **{p: t.detach().double() for p, t in params.items()}, **options}
    a.update({i: v.detach().double() for i, v in (inputs or {}).items()})
    kw = lay.views(a, L, "train")
    kw.pop("_L")
    return kw
