"""derivgen.torch's modules as drop-in torch.nn twins: constructor variants, state_dict,
convert, training parity (eager and torch.compile), eval outputs and running buffers."""

from __future__ import annotations

import copy

import pytest
from conftest import require_module

torch = require_module("torch")
from torch import nn

import derivgen.torch as dt

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.float64: {"rtol": 1e-10, "atol": 1e-12}}

VARIANTS = [
    ("LayerNorm", lambda: nn.LayerNorm(12), (5, 12)),
    ("LayerNorm-2d-shape", lambda: nn.LayerNorm((3, 4)), (2, 5, 3, 4)),
    ("LayerNorm-nobias", lambda: nn.LayerNorm(12, bias=False), (5, 12)),
    ("LayerNorm-noaffine", lambda: nn.LayerNorm(12, elementwise_affine=False), (5, 12)),
    ("RMSNorm", lambda: nn.RMSNorm(12), (4, 3, 12)),
    ("RMSNorm-eps", lambda: nn.RMSNorm([12], eps=1e-3), (4, 12)),
    ("RMSNorm-noaffine", lambda: nn.RMSNorm(12, elementwise_affine=False), (4, 12)),
    ("BatchNorm1d-NC", lambda: nn.BatchNorm1d(6), (7, 6)),
    ("BatchNorm1d-NCL", lambda: nn.BatchNorm1d(6), (3, 6, 5)),
    ("BatchNorm2d", lambda: nn.BatchNorm2d(4), (3, 4, 5, 6)),
    ("BatchNorm2d-cma", lambda: nn.BatchNorm2d(4, momentum=None), (3, 4, 5, 6)),
    ("BatchNorm2d-untracked", lambda: nn.BatchNorm2d(4, track_running_stats=False), (3, 4, 5, 6)),
    ("BatchNorm2d-noaffine", lambda: nn.BatchNorm2d(4, affine=False), (3, 4, 5, 6)),
    ("BatchNorm2d-nobias", lambda: nn.BatchNorm2d(4, bias=False), (3, 4, 5, 6)),
    ("BatchNorm3d", lambda: nn.BatchNorm3d(3, momentum=0.3), (2, 3, 2, 3, 4)),
    ("InstanceNorm1d", lambda: nn.InstanceNorm1d(4), (3, 4, 9)),
    ("InstanceNorm1d-unbatched", lambda: nn.InstanceNorm1d(4, affine=True), (4, 9)),
    ("InstanceNorm2d-affine", lambda: nn.InstanceNorm2d(4, affine=True), (3, 4, 5, 6)),
    ("InstanceNorm2d-tracked", lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True), (3, 4, 5, 6)),
    ("InstanceNorm3d", lambda: nn.InstanceNorm3d(2, affine=True), (2, 2, 3, 3, 3)),
    ("GroupNorm", lambda: nn.GroupNorm(3, 6), (4, 6, 5, 2)),
    ("GroupNorm-noaffine", lambda: nn.GroupNorm(2, 6, affine=False), (4, 6, 7)),
]


def _randomize(m, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) + 0.5)
        for name, b in m.named_buffers():
            if b.is_floating_point():
                b.copy_(torch.rand(b.shape, generator=g, dtype=b.dtype) + 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("name,make,shape", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_twin_matches_torch_nn(name, make, shape, dtype):
    """Three training steps and one eval step: outputs, every gradient, running buffers
    and num_batches_tracked agree with torch.nn."""
    ref = make().to(dtype)
    _randomize(ref, 1)
    twin = dt.convert(copy.deepcopy(ref))
    assert type(twin).__name__ == type(ref).__name__ and isinstance(twin, type(ref))
    assert type(twin).__module__ == "derivgen.torch.nn"
    g = torch.Generator().manual_seed(2)
    for step in range(4):
        if step == 3:
            ref.eval(), twin.eval()
        x = torch.randn(shape, generator=g, dtype=dtype) * 2 + 0.5
        dy = torch.randn(shape, generator=g, dtype=dtype)
        outs = []
        for m in (ref, twin):
            xx = x.clone().requires_grad_(True)
            y = m(xx)
            grads = torch.autograd.grad(y, [xx, *m.parameters()], dy)
            outs.append((y, grads))
        torch.testing.assert_close(outs[1][0], outs[0][0], **TOL[dtype])
        for a, b in zip(outs[1][1], outs[0][1]):
            torch.testing.assert_close(a, b, **TOL[dtype])
        for (k, a), (k2, b) in zip(twin.state_dict().items(), ref.state_dict().items()):
            assert k == k2
            torch.testing.assert_close(a, b, **TOL[dtype])


def test_constructor_attributes_and_state_dict_keys_are_torch_nn():
    for cls_name in (
        "LayerNorm",
        "RMSNorm",
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "InstanceNorm1d",
        "InstanceNorm2d",
        "InstanceNorm3d",
        "GroupNorm",
    ):
        ours, theirs = getattr(dt, cls_name), getattr(nn, cls_name)
        args = (2, 4) if cls_name == "GroupNorm" else (4,)
        a, b = ours(*args), theirs(*args)
        assert list(a.state_dict()) == list(b.state_dict()), cls_name
        assert repr(a) == repr(b), cls_name
        for attr in (
            "eps",
            "momentum",
            "affine",
            "track_running_stats",
            "normalized_shape",
            "elementwise_affine",
            "num_groups",
            "num_channels",
            "num_features",
        ):
            assert getattr(a, attr, None) == getattr(b, attr, None), (cls_name, attr)
    a = dt.BatchNorm2d(3, affine=False, track_running_stats=False)
    assert a.weight is None and a.running_mean is None and list(a.state_dict()) == []


def test_state_dict_round_trips_both_ways():
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.GroupNorm(2, 4), nn.Flatten(), nn.LazyLinear(5))
    ref(torch.randn(2, 3, 6, 6))
    _randomize(ref, 3)
    ours = dt.convert(copy.deepcopy(ref))
    fresh_ref = copy.deepcopy(ref)
    _randomize(fresh_ref, 4)
    fresh_ref.load_state_dict(ours.state_dict())
    for (k, a), (_, b) in zip(fresh_ref.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k
    fresh_ours = dt.convert(copy.deepcopy(fresh_ref))
    _randomize(fresh_ours, 5)
    fresh_ours.load_state_dict(ref.state_dict())
    for (k, a), (_, b) in zip(fresh_ours.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k


def test_convert_every_supported_norm_shares_tensors():
    model = nn.ModuleDict(
        {
            "ln": nn.LayerNorm(4),
            "rms": nn.RMSNorm(4),
            "bn1": nn.BatchNorm1d(4),
            "bn2": nn.BatchNorm2d(4),
            "bn3": nn.BatchNorm3d(4),
            "in1": nn.InstanceNorm1d(4),
            "in2": nn.InstanceNorm2d(4),
            "in3": nn.InstanceNorm3d(4),
            "gn": nn.GroupNorm(2, 4),
            "nested": nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)),
            "sync": nn.SyncBatchNorm(4),  # not a supported norm: left alone
        }
    )
    model.eval()
    weight = model["ln"].weight
    dt.convert(model)
    for k in ("ln", "rms", "bn1", "bn2", "bn3", "in1", "in2", "in3", "gn"):
        assert type(model[k]).__module__ == "derivgen.torch.nn", k
        assert not model[k].training
    assert type(model["nested"][1]) is dt.LayerNorm
    assert type(model["sync"]) is nn.SyncBatchNorm
    assert model["ln"].weight is weight  # an optimizer built before keeps working
    assert type(dt.convert(nn.LayerNorm(3))) is dt.LayerNorm
    with pytest.raises(TypeError, match="convert: model must be a torch.nn.Module"):
        dt.convert("model")


# ------------------------------------------------------------------ training parity


class Block(nn.Module):
    """A small pre-norm transformer block: LayerNorm, attention, RMSNorm, MLP."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return self.head(x).mean(dim=(1, 2))


class CNN(nn.Module):
    """BatchNorm2d, GroupNorm and InstanceNorm2d (tracked running statistics)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.GroupNorm(4, 8),
            nn.ReLU(),
            nn.Conv2d(8, 6, 3, padding=1),
            nn.InstanceNorm2d(6, affine=True, track_running_stats=True),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(6, 1),
        )

    def forward(self, x):
        return self.net(x).squeeze(1)


def _data(kind, dtype):
    g = torch.Generator().manual_seed(7)
    shape = (4, 6, 16) if kind == "block" else (6, 3, 8, 8)
    return [
        (torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape[0], generator=g, dtype=dtype))
        for _ in range(4)
    ]


def _train(model, data, steps=20, compile_=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run = torch.compile(model, fullgraph=True, backend="aot_eager") if compile_ else model
    losses = []
    for step in range(steps):
        x, t = data[step % len(data)]
        opt.zero_grad()
        loss = ((run(x) - t) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    model.eval()
    with torch.no_grad():
        ev = run(data[0][0])
    return torch.stack(losses), ev


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["block", "cnn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_training_parity(kind, dtype, compile_):
    """20 SGD steps with torch.nn norms and with their derivgen twins (convert): losses, final
    parameters, running buffers and eval outputs agree (float32 1e-5 relative, float64 1e-10);
    compiled with torch.compile(fullgraph=True), which fails on any graph break."""
    torch.manual_seed(0)
    ref = (Block() if kind == "block" else CNN()).to(dtype)
    ours = dt.convert(copy.deepcopy(ref))
    data = _data(kind, dtype)
    if compile_:
        torch._dynamo.reset()
    l_ref, e_ref = _train(ref, data, compile_=compile_)
    l_ours, e_ours = _train(ours, data, compile_=compile_)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(l_ours, l_ref, **tol)
    torch.testing.assert_close(e_ours, e_ref, **tol)
    for (k, a), (k2, b) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(a, b, **tol, msg=lambda m, k=k: f"{k}: {m}")


def test_generic_module_for_any_spec(tmp_path):
    """Module(spec): the online layer norm in the material's notation, trained a few steps,
    with its per-group inputs as keywords; its gradients match autograd through the
    generated PyTorch target."""
    from conftest import ROOT

    spec = str(ROOT / "examples" / "online_layernorm_notation.toml")
    m = dt.Module(spec, 8, alpha=0.25).double()
    names = [n for n, _ in m.named_parameters()]
    assert names == list(m._layer.meta.params)
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    kw = {i: torch.rand(5, dtype=torch.float64) + 0.5 for i in m._layer.meta.inputs}
    y = m(x, **kw)
    assert y.shape == x.shape
    assert torch.autograd.gradcheck(lambda x: m(x, **kw), (x,))
    with pytest.raises(TypeError, match="forward takes the per-group inputs"):
        m(x)
    with pytest.raises(TypeError, match="option alpha is required"):
        dt.Module(spec, 8)
    with pytest.raises(TypeError, match="unknown option"):
        dt.Module(spec, 8, alpha=0.2, beta2=3)


@pytest.mark.parametrize(
    "args, kw, error, needle",
    [
        (("instancenorm", (3, 4)), {}, ValueError, "number of channels C"),
        (("instancenorm", 6.0), {}, TypeError, "size must be a positive int"),
        (("layernorm", -1), {}, TypeError, "size must be a positive int"),
        (("layernorm", (4, 0)), {}, TypeError, "size must be a positive int"),
        (("instancenorm", 4), {"num_groups": 2}, TypeError, "num_groups applies to a layout with reduce = 'group'"),
        (("groupnorm", 4), {"num_groups": 3}, ValueError, "divisible by num_groups"),
        (("groupnorm", 4), {}, TypeError, "num_groups must be a positive int"),
    ],
)
def test_module_checks_its_size_and_groups_at_construction(args, kw, error, needle):
    with pytest.raises(error, match=needle):
        dt.Module(*args, **kw)


def test_module_names_x_with_the_wrong_channel_count():
    m = dt.Module("instancenorm", 3)
    with pytest.raises(ValueError, match=r"x has 4 channels .* made for 3"):
        m(torch.randn(2, 4, 5))


def test_online_layernorm_module_against_plain_torch_autograd():
    """OnlineLayerNorm's output and gradients (x, gamma, beta and the running moments)
    against the material's definition written in plain torch and differentiated by autograd."""
    torch.manual_seed(3)
    m = dt.OnlineLayerNorm(7, alpha=0.3, eps=1e-4).double()
    _randomize(m, 9)
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    pm = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ps = (torch.rand(4, dtype=torch.float64) + 0.5).requires_grad_(True)
    y = m(x, pm, ps)
    mu = 0.3 * x.mean(-1) + 0.7 * pm
    s = (((x - mu[:, None]) ** 2).sum(-1) / 6 + 1e-4).sqrt()
    sd = 0.3 * s + 0.7 * ps
    ref = m.gamma * (x - mu[:, None]) / sd[:, None] + m.beta
    dy = torch.randn_like(ref)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(y, (x, m.gamma, m.beta, pm, ps), dy)
    want = torch.autograd.grad(ref, (x, m.gamma, m.beta, pm, ps), dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_function_takes_parameters_by_position():
    f = dt.function("layernorm")
    x, w, b = torch.randn(3, 5), torch.rand(5), torch.randn(5)
    torch.testing.assert_close(f(x, w, b, eps=1e-3), nn.functional.layer_norm(x, (5,), w, b, 1e-3))
    torch.testing.assert_close(f(x, w, beta=b), f(x, gamma=w, beta=b))
    with pytest.raises(TypeError, match="given both by position and by keyword"):
        f(x, w, gamma=w, beta=b)
    with pytest.raises(TypeError, match="positionally, got 3"):
        f(x, w, b, b)


def test_demo_runs_and_float64_training_agrees():
    """`make demo`'s PyTorch part: exits 0 only when the float64 runs agree to 1e-10."""
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run(
        [sys.executable, "-m", "derivgen.tools.demo"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("the same in float64") == 2


BF16_CASES = [
    ("LayerNorm", lambda: nn.LayerNorm(256), (64, 256)),
    ("RMSNorm", lambda: nn.RMSNorm(256), (64, 256)),
    ("BatchNorm2d", lambda: nn.BatchNorm2d(8), (4, 8, 5, 6)),
    ("GroupNorm", lambda: nn.GroupNorm(4, 8), (4, 8, 5, 6)),
    ("InstanceNorm2d", lambda: nn.InstanceNorm2d(8, affine=True), (4, 8, 5, 6)),
]


@pytest.mark.parametrize("name,make,shape", BF16_CASES, ids=[c[0] for c in BF16_CASES])
def test_bfloat16_matches_torch_within_bf16_rounding(name, make, shape):
    """bfloat16 in and out, computed in float inside the kernels: the output and every gradient
    agree with torch.nn's own bfloat16 results within bfloat16 rounding, and are as close as
    torch's to the exact (float64) values of the same bfloat16 inputs. In eval mode too."""
    ref = make()
    _randomize(ref, 5)
    ref = ref.to(torch.bfloat16)
    ours = dt.convert(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(6)
    exact = copy.deepcopy(ref).double()
    for step in range(2):
        if step == 1:
            for m in (ref, ours, exact):
                m.eval()
        x = (torch.randn(shape, generator=g) * 2 + 3).to(torch.bfloat16)
        dy = torch.randn(shape, generator=g).to(torch.bfloat16)
        res = []
        for m, dtype in ((ref, torch.bfloat16), (ours, torch.bfloat16), (exact, torch.float64)):
            xx = x.to(dtype).requires_grad_(True)
            y = m(xx)
            res.append([y, *torch.autograd.grad(y, [xx, *m.parameters()], dy.to(dtype))])
        for k, (a, b, e) in enumerate(zip(*res)):
            assert a.dtype == b.dtype == torch.bfloat16
            torch.testing.assert_close(b, a, rtol=1.6e-2, atol=1.6e-2 * float(a.detach().abs().max()))
            a, b, e = a.detach(), b.detach(), e.detach()
            err_ours = float((b.double() - e).abs().max() / e.abs().max())
            err_torch = float((a.double() - e).abs().max() / e.abs().max())
            assert err_ours <= max(1.25 * err_torch, 2**-8), (k, err_ours, err_torch)
    for (k, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize(
    "name,make,shape",
    [
        v
        for v in VARIANTS
        if v[0] in ("LayerNorm", "RMSNorm", "BatchNorm2d", "BatchNorm1d-NC", "InstanceNorm2d-affine", "GroupNorm")
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_modules_gradgradcheck(name, make, shape):
    """Every module's backward is differentiable (float64): gradgradcheck through the module."""
    m = dt.convert(make()).double()
    _randomize(m, 8)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    params = list(m.parameters())

    def f(x, *ps):
        return torch.func.functional_call(m, dict(zip([n for n, _ in m.named_parameters()], ps)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params))
    assert torch.autograd.gradgradcheck(f, (x, *params))


def test_whole_model_pickles_and_deep_copies():
    """torch.save(model) / torch.load and copy.deepcopy of converted models (EMA copies,
    checkpoints of whole modules): the layer bindings are looked up again, not pickled."""
    import io

    m = dt.convert(nn.Sequential(nn.LayerNorm(8), nn.BatchNorm1d(8), nn.GroupNorm(2, 8)))
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    m2 = torch.load(buf, weights_only=False)
    m3 = copy.deepcopy(m)
    x = torch.randn(4, 8)
    m.eval(), m2.eval(), m3.eval()
    assert torch.equal(m(x), m2(x)) and torch.equal(m(x), m3(x))
    assert type(m2[0]) is dt.LayerNorm


CL_MODULES = [
    ("bn", lambda: nn.BatchNorm2d(6)),
    ("bn-eval", lambda: nn.BatchNorm2d(6).eval()),
    ("bn3d", lambda: nn.BatchNorm3d(6)),
    ("gn", lambda: nn.GroupNorm(3, 6)),
    ("gn-2", lambda: nn.GroupNorm(2, 6)),
    ("in", lambda: nn.InstanceNorm2d(6, affine=True)),
    ("in-tracked", lambda: nn.InstanceNorm2d(6, affine=True, track_running_stats=True)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("name,make", CL_MODULES, ids=[c[0] for c in CL_MODULES])
def test_channels_last_is_bit_for_bit_the_contiguous_result(name, make, dtype):
    """A channels_last input runs the channels-last kernels (in its own layout, no transposing
    copy) and gives a channels_last output with the contiguous input's bits: output, every
    gradient and the running buffers, at spatial sizes that are and are not multiples of the
    kernels' 32 lanes, and past the DG_PEND lane blocks a float parameter lane holds (17x19:
    ten blocks and a rest)."""
    for shape in ((3, 6, 5, 4), (2, 6, 8, 8), (2, 6, 7, 9), (2, 6, 17, 19)) if "3d" not in name else ((2, 6, 3, 4, 5),):
        _same_bits_in_both_formats(make, shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
def test_channels_last_batch_norm_lane_by_lane_is_the_contiguous_result(dtype):
    """Batch norm's channels-last sums take whole chunks of 256 positions lane by lane (the sums
    in registers) and the rest row by row: with more channels than one block of 64 (70: 64 and
    6), one and two whole chunks and rests of rows and of positions past the last whole lane
    block, the bits are the contiguous kernels'."""
    for shape in ((2, 70, 16, 17), (3, 70, 23, 23), (1, 130, 16, 16)):
        _same_bits_in_both_formats(lambda c=shape[1]: nn.BatchNorm2d(c), shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.InstanceNorm2d(70, affine=True),
        lambda: nn.GroupNorm(35, 70),
        lambda: nn.GroupNorm(10, 70),
    ],
    ids=["in-70", "gn-35x2", "gn-10x7"],
)
def test_channels_last_group_norm_lane_by_lane_is_the_contiguous_result(make, dtype):
    """Group and instance norm's channels-last sums take whole chunks of 256 positions of a
    channel lane by lane and the rest row by row: with more groups than one block of 64
    (instance norm's 70: 64 and 6), several channels per group (a channel's first position
    falls mid-lane when S is not a multiple of 32), one and two whole chunks and rests past
    the last whole lane block, the bits are the contiguous kernels'."""
    for shape in ((2, 70, 16, 17), (1, 70, 23, 23)):
        _same_bits_in_both_formats(make, shape, dtype)


def _same_bits_in_both_formats(make, shape, dtype):
    m = dt.convert(make()).to(dtype)
    _randomize(m, 11)
    m2 = copy.deepcopy(m)
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(shape, generator=g) * 2 + 1).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    xc = x.contiguous(memory_format=fmt).requires_grad_(True)
    xn = x.clone().requires_grad_(True)
    yc, yn = m(xc), m2(xn)
    assert yc.is_contiguous(memory_format=fmt) and not yc.is_contiguous()
    assert torch.equal(yc, yn)
    gc = torch.autograd.grad(yc, [xc, *m.parameters()], dy)
    gn = torch.autograd.grad(yn, [xn, *m2.parameters()], dy)
    assert gc[0].is_contiguous(memory_format=fmt)
    for a, b in zip(gc, gn):
        assert torch.equal(a, b)
    for a, b in zip(m.buffers(), m2.buffers()):
        assert torch.equal(a, b)


def test_channels_last_operators_opcheck():
    """The operators on channels_last tensors: fake kernels give the real strides."""
    from derivgen.torch.ops import layer

    for name, groups in (("batchnorm", 0), ("groupnorm", 3), ("instancenorm", 0)):
        lay = layer(name)
        x = torch.randn(2, 6, 5, 3, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
        w, b = torch.rand(6, dtype=torch.float64) + 0.5, torch.randn(6, dtype=torch.float64)
        opts = [1e-5] + ([0.1] if name == "batchnorm" else [])
        res = torch.library.opcheck(lay.modes["train"].forward, (x.requires_grad_(True), w, b, *opts, groups))
        assert all(v == "SUCCESS" for v in res.values()), res
        y, *stats = lay.modes["train"].forward(x.detach(), w, b, *opts, groups)
        assert y.is_contiguous(memory_format=torch.channels_last)
        dy = torch.randn_like(y)
        res = torch.library.opcheck(lay.modes["train"].backward, (dy, x.detach(), w, b, *stats, *opts, groups))
        assert all(v == "SUCCESS" for v in res.values()), res


@pytest.mark.parametrize(
    "make",
    [lambda: nn.BatchNorm2d(6), lambda: nn.GroupNorm(3, 6), lambda: nn.InstanceNorm2d(6, affine=True)],
    ids=["bn", "gn", "in"],
)
def test_channels_last_input_keeps_its_format_and_values(make):
    """A channels_last input gives a channels_last output (so the convolutions after it stay in
    that format), with the contiguous input's values; gradients too. (The kernels compute in
    the contiguous layout today: see the README.)"""
    ref = dt.convert(make()).double()
    x = torch.randn(3, 6, 5, 4, dtype=torch.float64)
    xc = x.contiguous(memory_format=torch.channels_last).requires_grad_(True)
    xn = x.clone().requires_grad_(True)
    yc, yn = ref(xc), ref(xn)
    assert yc.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(yc, yn)
    dy = torch.randn_like(yn)
    gc = torch.autograd.grad(yc, xc, dy)[0]
    gn = torch.autograd.grad(yn, xn, dy)[0]
    assert torch.equal(gc, gn)
