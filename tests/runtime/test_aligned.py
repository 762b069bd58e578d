"""Outputs derivgen allocates start on a 64-byte boundary, so the C kernels can stream short
rows from registers (derivgen.runtime.aligned_empty)."""

import numpy as np
import pytest

import derivgen
from derivgen.runtime import aligned_empty


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (7,), (65, 3), (2, 3, 5)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16])
def test_aligned_empty_starts_on_a_line(shape, dtype):
    a = aligned_empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    assert a.size == 0 or a.ctypes.data % 64 == 0  # an empty array's address means nothing
    a[...] = 1
    assert np.all(a == 1)


@pytest.mark.parametrize("backend", ["c", "numpy"])
def test_forward_and_backward_allocate_aligned_outputs(backend):
    k = derivgen.load("layernorm", backend=backend)
    rng = np.random.default_rng(0)
    for rows in (3, 300):
        x = rng.standard_normal((rows, 128)).astype(np.float32)
        g, b = np.ones(128, np.float32), np.zeros(128, np.float32)
        y, cache = k.forward(x, g, b)
        grads = k.backward(rng.standard_normal(x.shape).astype(np.float32), cache)
        assert y.ctypes.data % 64 == 0
        for field, value in grads._asdict().items():
            assert np.asarray(value).ctypes.data % 64 == 0, field
