"""derivgen.torch's torch.nn twins name their arguments as torch.nn does: an error about a
parameter says ``weight`` or ``bias``, never the catalogue's ``gamma`` or ``beta``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import derivgen.torch as dt


def _error(module, *args):
    with pytest.raises((TypeError, ValueError)) as info:
        module(*args)
    msg = str(info.value)
    assert "gamma" not in msg and "beta" not in msg, msg
    return msg


def _with(module, name, value):
    getattr(module, name).data = value
    return module


@pytest.mark.parametrize(
    "make, x",
    [
        (lambda: dt.LayerNorm(8), (3, 8)),
        (lambda: dt.RMSNorm(8), (3, 8)),
        (lambda: dt.BatchNorm2d(4), (2, 4, 3, 3)),
        (lambda: dt.BatchNorm1d(4), (2, 4)),
        (lambda: dt.SyncBatchNorm(4), (2, 4, 3)),
        (lambda: dt.InstanceNorm2d(4, affine=True), (2, 4, 3, 3)),
        (lambda: dt.GroupNorm(2, 4), (2, 4, 3)),
    ],
)
def test_parameter_errors_say_weight_and_bias(make, x):
    m = make()
    n = m.weight.shape[0]
    assert "weight" in _error(_with(m, "weight", torch.ones(n + 1)), torch.randn(*x))
    if getattr(m, "bias", None) is not None:
        assert "bias" in _error(_with(make(), "bias", torch.ones(n, dtype=torch.float64)), torch.randn(*x))


def test_eval_mode_and_the_input_too():
    bn = _with(dt.BatchNorm2d(4), "weight", torch.ones(5)).eval()
    assert "weight must have shape (4,), got (5,)" in _error(bn, torch.randn(2, 4, 3, 3))
    msg = _error(dt.LayerNorm(8), torch.randn(3, 7))
    assert msg.startswith("layernorm: weight has shape (8,)"), msg


def test_a_spec_module_keeps_the_spec_names():
    """dt.Module is the spec's API: its parameters are the spec's (gamma, beta)."""
    m = dt.Module("layernorm", 8)
    m.gamma.data = torch.ones(7)
    with pytest.raises(ValueError, match="gamma"):
        m(torch.randn(3, 8))
