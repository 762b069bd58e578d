"""ctypes binding of generated C kernels, driven by the layer's metadata."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from derivgen import runtime as rt
from derivgen.runtime.abi import KernelSignature, grad_tensor_names, kernel_signatures, takes_samples, tensor_names
from derivgen.runtime.base import aligned_empty
from derivgen.runtime.build import build_shared, build_target
from derivgen.runtime.machine import machine
from derivgen.runtime.meta import MetaLike, layer_meta
from derivgen.runtime.tensors import kernel_view, samples

_SFX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}


_SCALARS = {"int64_t": ctypes.c_int64, "double": ctypes.c_double, "int": ctypes.c_int}

# the kernels a layer's second library holds (kernel.c.j2's DG_SECOND_ONLY)
SECOND_KINDS = frozenset({"bb", "jvp"})


def _ptr(a: np.ndarray | None) -> int | None:
    """An array's data address (None: NULL)."""
    return None if a is None else a.ctypes.data


def argtypes(sig: KernelSignature) -> list:
    """The ctypes argument types of a kernel: ``c_void_p`` for every pointer."""
    return [ctypes.c_void_p if a.pointer else _SCALARS[a.ctype] for a in sig.args]


def input_pairs(values: Iterable[Any]) -> list[int]:
    """Per-group inputs (arrays or tensors) as the kernels take them: pointer, then stride
    (0 for a scalar, 1 for one value per group)."""
    pairs = []
    for v in values:
        pairs += [_address(v), 0 if _size(v) == 1 else 1]
    return pairs


def _address(v: Any) -> int:
    """The data address of an array or a tensor."""
    return v.ctypes.data if isinstance(v, np.ndarray) else v.data_ptr()


def _size(v: Any) -> int:
    """The number of elements of an array or a tensor."""
    return v.size if isinstance(v, np.ndarray) else v.numel()


class CKernel:
    """Loads ``<name>.c`` (compiled on first use) and calls its kernels."""

    def __init__(
        self,
        meta: MetaLike,
        source: Path,
        threads: int = 0,
        cflags: list[str] | None = None,
        extra: list[str] | None = None,
    ) -> None:
        self.meta = meta = layer_meta(meta)
        self.source = Path(source)
        self.threads = threads
        self.cflags = cflags  # None: $CFLAGS or the defaults (see derivgen.runtime.build)
        self.extra = extra  # added to the flags: -DDG_EXTRAS_ONLY for the bfloat16 and channels-last library
        self.signatures = kernel_signatures(meta)
        self._fns: dict = {}  # (mode, kind, dtype) -> (ctypes function, signature, takes nthreads)
        self._lib = None
        self._second = None
        self._lock = threading.Lock()

    @property
    def lib(self) -> ctypes.CDLL:
        """The shared library, compiled (or found in the build cache) and loaded on first use."""
        if self._lib is None:
            with self._lock:
                if self._lib is None:
                    self._lib = self._load(self.extra)
        return self._lib

    @property
    def second_lib(self) -> ctypes.CDLL:
        """The library of the second-order kernels (double backward, JVP: -DDG_SECOND_ONLY),
        compiled and loaded the first time one is called: they are most of a layer's code, and
        a first-order caller never compiles them."""
        if self._second is None:
            with self._lock:
                if self._second is None:
                    self._second = self._load(self.second_extra)
        return self._second

    @property
    def second_extra(self) -> list[str]:
        """The flags added to build :attr:`second_lib` (its cache key with the source's)."""
        return [*(self.extra or []), "-DDG_SECOND_ONLY"]

    def _load(self, extra: list[str] | None) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(build_shared(self.source, cflags=self.cflags, extra=extra)))
        self._configure(lib)
        return lib

    def _library(self, kind: str) -> ctypes.CDLL:
        """The library that holds the kernels of ``kind`` (forward, backward, bb, jvp, split_...)."""
        return self.second_lib if kind in SECOND_KINDS else self.lib

    def _configure(self, lib: ctypes.CDLL) -> None:
        """Tell the kernels this machine's cache sizes (see derivgen.runtime.machine); a build
        that fixed them with -DDG_STREAM_BYTES / -DDG_TILE_BYTES keeps its own."""
        m = machine()
        fn = lib[f"{self.meta.name}_configure"]
        fn.restype = None
        fn.argtypes = [ctypes.c_int64, ctypes.c_int64]
        fn(m.stream_bytes, m.tile_bytes)

    @property
    def target(self) -> str:
        """The -march this library is built for: the x86-64 level the load-time dispatch
        picked from cpuid ("x86-64-v4", "x86-64-v3", ...), or what $CFLAGS / ``cflags`` name."""
        return build_target(self.cflags)

    @property
    def isa(self) -> str:
        """The instruction sets this build of the kernels targets ("avx2 fma sse2", ...)."""
        fn = self.lib[f"{self.meta.name}_isa"]
        fn.restype = ctypes.c_char_p
        return fn().decode()

    def mask_check(self, sfx: str) -> ctypes._CFuncPtr:
        """The function counting the values of a mask (``m``, ``n`` values) that are neither 0
        nor 1 (``sfx``: f32, f64, bf16), for a layer with mask tensors: one read of the mask,
        over ``nthreads`` threads."""
        fn = self.lib[f"{self.meta.name}_mask_check_{sfx}"]
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        fn.restype = ctypes.c_int64
        return fn

    def _declared(self, fn: ctypes._CFuncPtr, sig: KernelSignature) -> ctypes._CFuncPtr:
        """``fn`` with the argument and result types of ``sig`` declared."""
        fn.argtypes = argtypes(sig)
        fn.restype = ctypes.c_int
        return fn

    def cfunc(self, mode: str, direction: str, sfx: str) -> ctypes._CFuncPtr:
        """A fresh ctypes function object for one kernel (``direction``: forward, backward;
        ``sfx``: f32, f64, bf16, nhwc_f32 ...) with its argument types declared, so pointers
        may be passed as plain ints (derivgen.torch calls it on tensors' data pointers)."""
        sig = self.signatures[(mode, direction)]
        return self._declared(self.lib[sig.symbol(sfx)], sig)  # lib[...] makes a new object

    def split_cfunc(self, kind: str, sfx: str) -> ctypes._CFuncPtr:
        """A split-reduction kernel of a batch layout's training mode (``kind``: partial,
        finish, apply, bpartial, bapply; ``sfx``: f32 or f64), argument types declared."""
        sig = self.signatures[("train", "split_" + kind)]
        return self._declared(self.lib[sig.symbol(sfx)], sig)

    def second_cfunc(self, mode: str, kind: str, sfx: str) -> ctypes._CFuncPtr:
        """The double backward (``kind`` "bb") or JVP ("jvp") kernel, argument types declared."""
        sig = self.signatures[(mode, kind)]
        return self._declared(self._library(kind)[sig.symbol(sfx)], sig)

    def _run(self, mode: str, kind: str, dtype: np.dtype, sections: dict) -> int:
        """Call one kernel of a NumPy call (float32/float64) with its arguments by section
        (the thread count added where the kernel takes one); returns the kernel's status.
        ``sections`` is the caller's fresh dict: the thread count is added to it."""
        entry = self._fns.get((mode, kind, dtype))
        if entry is None:
            sig = self.signatures[(mode, kind)]
            fn = self._declared(self._library(kind)[sig.symbol(_SFX[np.dtype(dtype)])], sig)
            entry = self._fns[(mode, kind, dtype)] = (fn, sig, "nthreads" in sig.sections)
        fn, sig, threaded = entry
        if threaded:
            sections["nthreads"] = (self.threads,)
        return fn(*sig.pack(sections))

    def _leading(self, L: rt.Layout, params: dict, options: dict, inputs: dict) -> dict:
        """The sections every kernel starts with: dims, parameters, options, per-group
        inputs (pointer and stride: 0 for a scalar, 1 for one value per group)."""
        m = self.meta
        out = {
            "dims": (L.O, L.G, L.Cg, L.S),
            "params": [_ptr(params[p]) for p in m.params],
            "options": [options[o] for o in m.options],
            "inputs": input_pairs([inputs[i] for i in m.inputs]),
        }
        if takes_samples(m):
            out["samples"] = (samples(m, L),)
        return out

    def _tensors(self, L: rt.Layout, tensors: dict, keep: list) -> list:
        """The tensor inputs' pointers as the kernels read them (:func:`kernel_view`: at x's
        shape, or a trailing layout's per-sample ones at their own), the arrays in ``keep``."""
        m = self.meta
        views = [kernel_view(m, m.tensors[t][0], tensors[t], L) for t in tensor_names(m)]
        keep += views
        return [_ptr(v) for v in views]

    def forward(self, call: rt.ForwardCall) -> tuple[np.ndarray, rt.Cache]:
        """y and the cache of a validated forward call (buffers updated in place in train mode)."""
        L, m = call.layout, self.meta
        stats = {s: np.empty(L.n_groups, dtype=np.float64) for s in m.stats[call.mode]}
        bufs = {}
        for b in m.buffers:
            buf = call.buffers[b]
            bufs[b] = np.ascontiguousarray(buf) if buf is not None and not buf.flags.c_contiguous else buf
        sections = {
            **self._leading(L, call.params, call.options, call.inputs),
            "x": (_ptr(call.x),),
            "buffers": [_ptr(bufs[b]) for b in m.buffers],
            "y": (_ptr(call.out), *(_ptr(call.outs[o]) for o in m.outputs)),
            "stats": [_ptr(stats[s]) for s in m.stats[call.mode]],
        }
        keep: list = []
        if call.tensors:
            sections["tensors"] = self._tensors(L, call.tensors, keep)
        status = self._run(call.mode, "forward", call.dtype, sections)
        if status != 0:
            raise MemoryError(f"{m.name}: forward kernel could not allocate its work buffer")
        for b, buf in bufs.items():
            if buf is not None and buf is not call.buffers[b]:
                call.buffers[b][...] = buf
        return call.result(stats)

    def backward(self, call: rt.BackwardCall, grads_type: Callable[..., tuple]) -> tuple:
        """``grads_type(dx, d<param>..., d<input>...)`` of a validated backward call."""
        c, m = call.cache, self.meta
        L = c.layout
        dinputs = {i: np.empty(L.n_groups, dtype=c.dtype) for i in m.inputs}
        # a broadcast tensor's element gradients go to x's shape first, then are summed (rt),
        # but where the kernel sums them (a tensor it reads at its own shape)
        dtens = {t: rt.grad_buffer(m, t, L, call.outs["d" + t], c.dtype, summed=True) for t in grad_tensor_names(m)}
        sections = {
            **self._leading(L, c.params, c.options, c.inputs),
            "x": (_ptr(c.x),),
            "dy": (_ptr(call.dy),),
            "stats": [_ptr(c.stats[s]) for s in m.stats[c.mode]],
            "dx": (_ptr(call.outs["dx"]), *(_ptr(dtens[t]) for t in grad_tensor_names(m))),
            "dparams": [_ptr(call.outs["d" + p]) for p in m.params],
            "dinputs": [_ptr(dinputs[i]) for i in m.inputs],
        }
        keep: list = []
        if tensor_names(m):
            sections["tensors"] = self._tensors(L, c.tensors, keep)
        if m.outputs:
            sections["cotangents"] = [_ptr(call.cotangents[o]) for o in m.outputs]
        status = self._run(c.mode, "backward", c.dtype, sections)
        if status != 0:
            raise MemoryError(f"{m.name}: backward kernel could not allocate its work buffer")
        values = {"dx": call.outs["dx"], **{"d" + p: call.outs["d" + p] for p in m.params}}
        for t in grad_tensor_names(m):
            values["d" + t] = rt.finish_tensor_grad(m, t, L, dtens[t], call.outs["d" + t])
        for i in m.inputs:
            values["d" + i] = rt.finish_input_grad(c, i, dinputs[i], call.outs.get("d" + i))
        return grads_type(**values)

    # ------------------------------------------------------------------ second order

    def second(
        self, call: rt.SecondCall, kind: str, grads_type: Callable[..., tuple] | None = None
    ) -> np.ndarray | tuple:
        """``backward_backward`` (kind "bb", returns grads_type) or ``jvp`` (returns y's tangent)."""
        c, m = call.cache, self.meta
        L = c.layout
        sections = {
            **self._leading(L, c.params, c.options, c.inputs),
            "x": (_ptr(c.x),),
            "stats": [_ptr(c.stats[s]) for s in m.stats[c.mode]],
            "seed_x": (_ptr(call.seed_x),),
            "seed_params": [_ptr(call.seed_params[p]) for p in m.params],
            "seed_inputs": input_pairs([call.seed_inputs[i] for i in m.inputs]),
        }
        dinputs = {i: np.empty(L.n_groups, dtype=c.dtype) for i in m.inputs}
        outputs, gts = m.outputs, grad_tensor_names(m)
        keep: list = []
        if tensor_names(m):
            sections["tensors"] = self._tensors(L, c.tensors, keep)
        if gts:
            sections["seed_tensors"] = [_ptr(call.seed_tensors[t]) for t in gts]
        # a broadcast tensor's element gradients go to x's shape first, then are summed (rt)
        dtens = {t: rt.grad_buffer(m, t, L, call.outs["d" + t], c.dtype) for t in gts} if kind == "bb" else {}
        if kind == "bb":
            sections.update(
                {
                    "dy": (_ptr(call.dy),),
                    "out_dx": (_ptr(call.outs["dx"]),),
                    "out_ddy": (_ptr(call.outs["ddy"]),),
                    "out_params": [_ptr(call.outs["d" + p]) for p in m.params],
                    "out_inputs": [_ptr(dinputs[i]) for i in m.inputs],
                }
            )
            if outputs:
                sections["cotangents"] = [_ptr(call.cotangents[o]) for o in outputs]
                sections["out_ddouts"] = [_ptr(call.outs["dd" + o]) for o in outputs]
            if gts:
                sections["out_dtensors"] = [_ptr(dtens[t]) for t in gts]
        else:
            sections["out_ty"] = (_ptr(call.outs["ty"]), *(_ptr(call.outs["t" + o]) for o in outputs))
        if self._run(c.mode, kind, c.dtype, sections) != 0:
            raise MemoryError(f"{m.name}: second-order kernel could not allocate its work buffer")
        if kind != "bb":
            return (call.outs["ty"], *(call.outs["t" + o] for o in outputs)) if outputs else call.outs["ty"]
        values = {"dx": call.outs["dx"], "ddy": call.outs["ddy"], **{"d" + p: call.outs["d" + p] for p in m.params}}
        values.update({"dd" + o: call.outs["dd" + o] for o in outputs})
        for t in gts:
            values["d" + t] = rt.finish_tensor_grad(m, t, L, dtens[t], call.outs["d" + t])
        for i in m.inputs:
            values["d" + i] = rt.finish_input_grad(c, i, dinputs[i], call.outs.get("d" + i))
        return grads_type(**values)

    # ------------------------------------------------------------------ split reduction
    # (batch layouts, training mode; see the split_* functions of the generated modules)

    def _run_split(self, kind: str, call: rt.SplitCall, sections: dict) -> int:
        """Call a split kernel: ``sections`` after the leading ones of ``call`` (its tensor
        inputs at the part's x shape; none for split_finish, which reads no element)."""
        lead = self._leading(call.layout, call.params, call.options, call.inputs)
        keep: list = []
        if tensor_names(self.meta):
            if call.tensors:
                lead["tensors"] = self._tensors(call.layout, call.tensors, keep)
            else:
                lead["tensors"] = [None for _ in tensor_names(self.meta)]
        return self._run("train", "split_" + kind, call.dtype, {**lead, **sections})

    def split_partial(self, call: rt.SplitCall, level: int) -> np.ndarray:
        """This part's sums of statistics level ``level``: float64 (sums, groups)."""
        m, L = self.meta, call.layout
        levels = m.split.levels
        level = rt.split_level(m, level)
        if level > 0 and call.stats is None:
            raise TypeError(
                f"{m.name}: level {level} needs the statistics of the earlier levels: stats= (from split_finish)"
            )
        stats = call.stats if call.stats is not None else np.zeros((len(m.stats["train"]), L.n_groups))
        sums = np.zeros((levels[level], L.n_groups))
        if L.O and levels[level]:
            status = self._run_split(
                "partial",
                call,
                {
                    "x": (_ptr(call.x),),
                    "level": (level,),
                    "stats": (_ptr(stats),),
                    "count": (call.count or 0.0,),
                    "sums": (_ptr(sums),),
                },
            )
            if status != 0:
                raise ValueError(f"{m.name}: split partial kernel refused level {level}")
        return sums

    def split_finish(self, call: rt.SplitCall, level: int, sums: np.ndarray) -> np.ndarray:
        """The statistics with level ``level``'s rows filled from its sums over all parts."""
        m, L = self.meta, call.layout
        levels = m.split.levels
        level = rt.split_level(m, level)
        sums = rt.check_sums(m, sums, levels[level], L)
        out = rt.stats_array(m, call)
        status = self._run_split(
            "finish", call, {"level": (level,), "sums": (_ptr(sums),), "count": (call.count,), "stats": (_ptr(out),)}
        )
        if status != 0:
            raise ValueError(f"{m.name}: split finish kernel refused level {level}")
        return out

    def split_apply(self, call: rt.SplitCall, out: np.ndarray | None) -> np.ndarray:
        """This part's y from the statistics of the whole batch."""
        L = call.layout
        y = rt.check_out("out", out, call.x.shape, call.dtype)
        if L.O:
            status = self._run_split(
                "apply",
                call,
                {"x": (_ptr(call.x),), "stats": (_ptr(call.stats),), "count": (call.count,), "y": (_ptr(y),)},
            )
            if status != 0:
                raise MemoryError(f"{self.meta.name}: split apply kernel could not allocate its work buffer")
        return y

    def split_backward_partial(self, call: rt.SplitCall, dy: np.ndarray) -> np.ndarray:
        """This part's sums for the backward: float64 (sums, groups)."""
        m, L = self.meta, call.layout
        dy = rt.check_dy(m, dy, call)
        sums = np.zeros((m.split.backward, L.n_groups))
        if L.O and len(sums):
            status = self._run_split(
                "bpartial",
                call,
                {
                    "x": (_ptr(call.x),),
                    "dy": (_ptr(dy),),
                    "stats": (_ptr(call.stats),),
                    "count": (call.count,),
                    "sums": (_ptr(sums),),
                },
            )
            if status != 0:
                raise RuntimeError(f"{m.name}: split backward partial kernel failed")
        return sums

    def split_backward_apply(
        self,
        call: rt.SplitCall,
        dy: np.ndarray,
        sums: np.ndarray,
        group_terms: bool,
        grads_type: Callable[..., tuple],
    ) -> tuple:
        """This part's ``grads_type``: dx and the parameters' and inputs' gradients over this part."""
        m, L = self.meta, call.layout
        dy = rt.check_dy(m, dy, call)
        sums = rt.check_sums(m, sums, m.split.backward, L)
        dx = aligned_empty(call.x.shape, call.dtype)
        # a broadcast tensor's element gradients at x's shape, summed over its broadcast axes below
        gts = grad_tensor_names(m)
        douts = {t: np.zeros(rt.tensor_shape(m, m.tensors[t][0], L), dtype=call.dtype) for t in gts}
        dtens = {t: rt.grad_buffer(m, t, L, douts[t], call.dtype, summed=True) for t in gts}
        dparams = {p: np.zeros(call.params[p].shape, dtype=call.dtype) for p in m.params}
        dinputs = {i: np.zeros(L.n_groups, dtype=call.dtype) for i in m.inputs}
        if L.O:
            status = self._run_split(
                "bapply",
                call,
                {
                    "x": (_ptr(call.x),),
                    "dy": (_ptr(dy),),
                    "stats": (_ptr(call.stats),),
                    "sums": (_ptr(sums),),
                    "count": (call.count,),
                    "group_terms": (int(bool(group_terms)),),
                    "dx": (_ptr(dx), *(_ptr(dtens[t]) for t in gts)),
                    "dparams": [_ptr(dparams[p]) for p in m.params],
                    "dinputs": [_ptr(dinputs[i]) for i in m.inputs],
                },
            )
            if status != 0:
                raise MemoryError(f"{m.name}: split backward apply kernel could not allocate its work buffer")
        values = {"dx": dx, **{"d" + p: v for p, v in dparams.items()}}
        for t in gts:
            values["d" + t] = rt.finish_tensor_grad(m, t, L, dtens[t], douts[t]) if L.O else douts[t]
        for i in m.inputs:
            v = dinputs[i]
            values["d" + i] = (
                np.asarray(v.sum(dtype=np.float64), dtype=call.dtype)
                if call.inputs[i].size == 1
                else v.reshape(L.group_shape)
            )
        return grads_type(**values)
