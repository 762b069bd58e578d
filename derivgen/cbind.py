"""ctypes binding of generated C kernels, driven by the layer's metadata."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np

from . import runtime as rt
from .build import build_shared

_SFX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}


def _ptr(a):
    return None if a is None else ctypes.c_void_p(a.ctypes.data)


class CKernel:
    """Loads ``<name>.c`` (compiled on first use) and calls its kernels."""

    def __init__(self, meta: dict, source: Path, threads: int = 0, cflags: list[str] | None = None,
                 extra: list[str] | None = None):
        self.meta = meta
        self.source = Path(source)
        self.threads = threads
        self.cflags = cflags          # None: $CFLAGS or the defaults (see derivgen.build)
        self.extra = extra            # added to the flags: -DDG_EXTRAS_ONLY for the bfloat16 and channels-last library
        self._lib = None
        self._lock = threading.Lock()

    @property
    def lib(self):
        if self._lib is None:
            with self._lock:
                if self._lib is None:
                    lib = ctypes.CDLL(str(build_shared(self.source, cflags=self.cflags, extra=self.extra)))
                    self._configure(lib)
                    self._lib = lib
        return self._lib

    def _configure(self, lib):
        """Tell the kernels this machine's cache sizes (see derivgen.machine); a build
        that fixed them with -DDG_STREAM_BYTES / -DDG_TILE_BYTES keeps its own."""
        from .machine import machine
        m = machine()
        fn = lib[f"{self.meta['name']}_configure"]
        fn.restype = None
        fn.argtypes = [ctypes.c_int64, ctypes.c_int64]
        fn(m.stream_bytes, m.tile_bytes)

    @property
    def isa(self) -> str:
        """The instruction sets this build of the kernels targets ("avx2 fma sse2", ...)."""
        fn = self.lib[f"{self.meta['name']}_isa"]
        fn.restype = ctypes.c_char_p
        return fn().decode()

    def cfunc(self, mode: str, direction: str, sfx: str) -> ctypes._CFuncPtr:
        """A fresh ctypes function object for one kernel (``sfx``: f32, f64, bf16, nhwc_f32 ...)
        with its argument types declared, so pointers may be passed as plain ints (derivgen.torch
        calls it on tensors' data pointers)."""
        m = self.meta
        fn = self.lib[f"{m['name']}_{mode}_{direction}_{sfx}"]    # lib[...] makes a new object
        V, I64 = ctypes.c_void_p, ctypes.c_int64
        args = [I64] * 4 + [V] * (1 if direction == "forward" else 2) + [V] * len(m["params"])
        args += [ctypes.c_double] * len(m["options"]) + [V, I64] * len(m["inputs"])
        nst = len(m["stats"][mode])
        if direction == "forward":
            args += [V] * len(m["buffers"]) + [V] + [V] * nst
        else:
            args += [V] * nst + [V] + [V] * len(m["params"]) + [V] * len(m["inputs"])
        fn.argtypes = args + [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn

    def split_cfunc(self, kind: str, sfx: str) -> ctypes._CFuncPtr:
        """A split-reduction kernel of a batch layout's training mode (``kind``: partial,
        finish, apply, bpartial, bapply; ``sfx``: f32 or f64), argument types declared."""
        m = self.meta
        fn = self.lib[f"{m['name']}_train_split_{kind}_{sfx}"]
        V, I64, D, Int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
        common = [V] * len(m["params"]) + [D] * len(m["options"]) + [V, I64] * len(m["inputs"])
        args = {
            "partial": [I64] * 4 + [V] + common + [Int, V, D, V, Int],
            "finish": [I64] * 4 + common + [Int, V, D, V],
            "apply": [I64] * 4 + [V] + common + [V, D, V, Int],
            "bpartial": [I64] * 4 + [V, V] + common + [V, D, V, Int],
            "bapply": [I64] * 4 + [V, V] + common + [V, V, D, Int, V] + [V] * len(m["params"])
                      + [V] * len(m["inputs"]) + [Int],
        }[kind]
        fn.argtypes = args
        fn.restype = ctypes.c_int
        return fn

    def _fn(self, mode: str, direction: str, dtype) -> ctypes._CFuncPtr:
        fn = getattr(self.lib, f"{self.meta['name']}_{mode}_{direction}_{_SFX[np.dtype(dtype)]}")
        fn.restype = ctypes.c_int
        return fn

    def _leading(self, L, arrays, params, options, inputs) -> list:
        """The arguments both kernels start with: dims, data arrays, parameters, options,
        per-group inputs (pointer and stride: 0 for a scalar, 1 for one value per group)."""
        m = self.meta
        args = [ctypes.c_int64(L.O), ctypes.c_int64(L.G), ctypes.c_int64(L.Cg), ctypes.c_int64(L.S)]
        args += [_ptr(a) for a in arrays]
        args += [_ptr(params[p]) for p in m["params"]]
        args += [ctypes.c_double(options[o]) for o in m["options"]]
        for i in m["inputs"]:
            v = inputs[i]
            args += [_ptr(v), ctypes.c_int64(0 if v.size == 1 else 1)]
        return args

    def forward(self, call: rt.ForwardCall):
        L, m = call.layout, self.meta
        stats = {s: np.empty(L.n_groups, dtype=np.float64) for s in m["stats"][call.mode]}
        args = self._leading(L, [call.x], call.params, call.options, call.inputs)
        bufs = {}
        for b in m["buffers"]:
            buf = call.buffers[b]
            if buf is not None and not buf.flags.c_contiguous:
                bufs[b] = np.ascontiguousarray(buf)
            else:
                bufs[b] = buf
            args.append(_ptr(bufs[b]))
        args.append(_ptr(call.out))
        args += [_ptr(stats[s]) for s in m["stats"][call.mode]]
        args.append(ctypes.c_int(self.threads))
        if self._fn(call.mode, "forward", call.dtype)(*args) != 0:
            raise MemoryError(f"{m['name']}: forward kernel could not allocate its work buffer")
        for b, buf in bufs.items():
            if buf is not None and buf is not call.buffers[b]:
                call.buffers[b][...] = buf
        return call.out, call.cache(stats)

    def backward(self, call: rt.BackwardCall, grads_type):
        c, m = call.cache, self.meta
        L = c.layout
        dinputs = {i: np.empty(L.n_groups, dtype=c.dtype) for i in m["inputs"]}
        args = self._leading(L, [c.x, call.dy], c.params, c.options, c.inputs)
        args += [_ptr(c.stats[s]) for s in m["stats"][c.mode]]
        args.append(_ptr(call.outs["dx"]))
        args += [_ptr(call.outs["d" + p]) for p in m["params"]]
        args += [_ptr(dinputs[i]) for i in m["inputs"]]
        args.append(ctypes.c_int(self.threads))
        if self._fn(c.mode, "backward", c.dtype)(*args) != 0:
            raise MemoryError(f"{m['name']}: backward kernel could not allocate its work buffer")
        values = {"dx": call.outs["dx"], **{"d" + p: call.outs["d" + p] for p in m["params"]}}
        for i in m["inputs"]:
            values["d" + i] = rt.finish_input_grad(c, i, dinputs[i])
        return grads_type(**values)

    # ------------------------------------------------------------------ second order

    def second_cfunc(self, mode: str, kind: str, sfx: str) -> ctypes._CFuncPtr:
        """The double backward (``kind`` "bb") or JVP ("jvp") kernel, argument types declared."""
        m = self.meta
        fn = self.lib[f"{m['name']}_{mode}_{kind}_{sfx}"]
        V, I64 = ctypes.c_void_p, ctypes.c_int64
        args = [I64] * 4 + [V] * (2 if kind == "bb" else 1) + [V] * len(m["params"])
        args += [ctypes.c_double] * len(m["options"]) + [V, I64] * len(m["inputs"])
        args += [V] * len(m["stats"][mode]) + [V] + [V] * len(m["params"]) + [V, I64] * len(m["inputs"])
        if kind == "bb":
            args += [V, V] + [V] * len(m["params"]) + [V] * len(m["inputs"])
        else:
            args += [V]
        fn.argtypes = args + [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn

    def second(self, call: rt.SecondCall, kind: str, grads_type=None):
        """``backward_backward`` (kind "bb", returns grads_type) or ``jvp`` (returns y's tangent)."""
        c, m = call.cache, self.meta
        L = c.layout
        args = self._leading(L, [c.x] + ([call.dy] if kind == "bb" else []), c.params, c.options, c.inputs)
        args += [_ptr(c.stats[s]) for s in m["stats"][c.mode]]
        args.append(_ptr(call.seed_x))
        args += [_ptr(call.seed_params[p]) for p in m["params"]]
        for i in m["inputs"]:
            v = call.seed_inputs[i]
            args += [_ptr(v), ctypes.c_int64(0 if v.size == 1 else 1)]
        dinputs = {i: np.empty(L.n_groups, dtype=c.dtype) for i in m["inputs"]}
        if kind == "bb":
            args += [_ptr(call.outs["dx"]), _ptr(call.outs["ddy"])]
            args += [_ptr(call.outs["d" + p]) for p in m["params"]] + [_ptr(dinputs[i]) for i in m["inputs"]]
        else:
            args.append(_ptr(call.outs["ty"]))
        args.append(ctypes.c_int(self.threads))
        fn = getattr(self.lib, f"{m['name']}_{c.mode}_{kind}_{_SFX[np.dtype(c.dtype)]}")
        fn.restype = ctypes.c_int
        if fn(*args) != 0:
            raise MemoryError(f"{m['name']}: second-order kernel could not allocate its work buffer")
        if kind != "bb":
            return call.outs["ty"]
        values = {"dx": call.outs["dx"], "ddy": call.outs["ddy"], **{"d" + p: call.outs["d" + p] for p in m["params"]}}
        for i in m["inputs"]:
            values["d" + i] = rt.finish_input_grad(c, i, dinputs[i])
        return grads_type(**values)

    # ------------------------------------------------------------------ split reduction
    # (batch layouts, training mode; see the split_* functions of the generated modules)

    def _split(self, kind: str, call: rt.SplitCall) -> ctypes._CFuncPtr:
        return self._fn("train", "split_" + kind, call.dtype)

    def split_partial(self, call: rt.SplitCall, level: int) -> np.ndarray:
        m, L = self.meta, call.layout
        levels = m["split"]["levels"]
        level = rt.split_level(m, level)
        if level > 0 and call.stats is None:
            raise TypeError(f"{m['name']}: level {level} needs the statistics of the earlier levels: "
                            f"stats= (from split_finish)")
        stats = call.stats if call.stats is not None else np.zeros((len(m["stats"]["train"]), L.n_groups))
        sums = np.zeros((levels[level], L.n_groups))
        if L.O and levels[level]:
            args = self._leading(L, [call.x], call.params, call.options, call.inputs)
            args += [ctypes.c_int(int(level)), _ptr(stats), ctypes.c_double(call.count or 0.0), _ptr(sums),
                     ctypes.c_int(self.threads)]
            if self._split("partial", call)(*args) != 0:
                raise ValueError(f"{m['name']}: split partial kernel refused level {level}")
        return sums

    def split_finish(self, call: rt.SplitCall, level: int, sums) -> np.ndarray:
        m, L = self.meta, call.layout
        levels = m["split"]["levels"]
        level = rt.split_level(m, level)
        sums = rt.check_sums(m, sums, levels[level], L)
        out = rt.stats_array(m, call)
        args = self._leading(L, [], call.params, call.options, call.inputs)
        args += [ctypes.c_int(int(level)), _ptr(sums), ctypes.c_double(call.count), _ptr(out)]
        if self._split("finish", call)(*args) != 0:
            raise ValueError(f"{m['name']}: split finish kernel refused level {level}")
        return out

    def split_apply(self, call: rt.SplitCall, out) -> np.ndarray:
        L = call.layout
        y = rt.check_out("out", out, call.x.shape, call.dtype)
        if L.O:
            args = self._leading(L, [call.x], call.params, call.options, call.inputs)
            args += [_ptr(call.stats), ctypes.c_double(call.count), _ptr(y), ctypes.c_int(self.threads)]
            if self._split("apply", call)(*args) != 0:
                raise MemoryError(f"{self.meta['name']}: split apply kernel could not allocate its work buffer")
        return y

    def split_backward_partial(self, call: rt.SplitCall, dy) -> np.ndarray:
        m, L = self.meta, call.layout
        dy = rt.check_dy(m, dy, call)
        sums = np.zeros((m["split"]["backward"], L.n_groups))
        if L.O and len(sums):
            args = self._leading(L, [call.x, dy], call.params, call.options, call.inputs)
            args += [_ptr(call.stats), ctypes.c_double(call.count), _ptr(sums), ctypes.c_int(self.threads)]
            if self._split("bpartial", call)(*args) != 0:
                raise RuntimeError(f"{m['name']}: split backward partial kernel failed")
        return sums

    def split_backward_apply(self, call: rt.SplitCall, dy, sums, group_terms: bool, grads_type):
        m, L = self.meta, call.layout
        dy = rt.check_dy(m, dy, call)
        sums = rt.check_sums(m, sums, m["split"]["backward"], L)
        dx = np.empty(call.x.shape, dtype=call.dtype)
        dparams = {p: np.zeros(call.params[p].shape, dtype=call.dtype) for p in m["params"]}
        dinputs = {i: np.zeros(L.n_groups, dtype=call.dtype) for i in m["inputs"]}
        if L.O:
            args = self._leading(L, [call.x, dy], call.params, call.options, call.inputs)
            args += [_ptr(call.stats), _ptr(sums), ctypes.c_double(call.count), ctypes.c_int(int(bool(group_terms))),
                     _ptr(dx)] + [_ptr(dparams[p]) for p in m["params"]] + [_ptr(dinputs[i]) for i in m["inputs"]]
            args.append(ctypes.c_int(self.threads))
            if self._split("bapply", call)(*args) != 0:
                raise MemoryError(f"{m['name']}: split backward apply kernel could not allocate its work buffer")
        values = {"dx": dx, **{"d" + p: v for p, v in dparams.items()}}
        for i in m["inputs"]:
            v = dinputs[i]
            values["d" + i] = (np.asarray(v.sum(dtype=np.float64), dtype=call.dtype) if call.inputs[i].size == 1
                               else v.reshape(L.group_shape))
        return grads_type(**values)
