"""An empty x in the NumPy and C modules (derivgen.load), as torch.nn treats empty batches:
empty outputs, zero parameter gradients, running buffers left as they are, and no
floating-point warnings, in every catalogue layer and mode."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import derivgen


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_empty_in_numpy_and_c_modules(backend):
    """derivgen.load's modules: every catalogue layer and mode, an empty x (no groups, or
    groups of no values) gives empty outputs, zero parameter gradients, untouched running
    buffers and no floating-point warnings."""
    rng = np.random.default_rng(0)
    for name in derivgen.names():
        m = derivgen.load(name, backend)
        meta = m._META
        if meta["layout"] == "trailing":
            shapes, psize = [(0, 5), (2, 0, 5)], (5,)
        else:
            shapes, psize = [(0, 4, 3), (2, 4, 0)], (4,)
        for shape in shapes:
            for training in [True, False] if "eval" in meta["modes"] else [True]:
                x = np.zeros(shape)
                params = [rng.random(() if p in meta["scalar_params"] else psize) + 0.5 for p in meta["params"]]
                kw = {"num_groups": 2} if meta["reduce"] == "group" else {}
                kw.update({o: d if d is not None else 0.5 for o, (d, _, _) in meta["options"].items()})
                kw.update({i: 0.7 for i in meta["inputs"]})
                bufs = {b: rng.random(psize) + 0.5 for b in meta["buffers"]}
                before = {b: v.copy() for b, v in bufs.items()}
                if "eval" in meta["modes"]:
                    kw["training"] = training
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    y, cache = m.forward(x, *params, **kw, **bufs)
                    g = m.backward(np.ones(shape), cache)
                    s = m.backward_backward(np.ones(shape), cache, np.ones(shape))
                    t = m.jvp(cache, np.ones(shape))
                assert y.shape == shape and g.dx.shape == shape and s.dx.shape == shape and t.shape == shape
                for f in g._fields[1:]:
                    assert not np.any(getattr(g, f)), (name, shape, f)
                for b, v in bufs.items():
                    assert np.array_equal(v, before[b]), (name, shape, b)
