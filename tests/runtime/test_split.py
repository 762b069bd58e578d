"""The split reduction in the generated NumPy and C modules (batch layouts): a batch held in
parts (micro-batches, one of them empty) gives the statistics, outputs and gradients of the
one-piece forward and backward, for the catalogue's batch norm, the zoo's EvoNorm-B0 (block
statistics), the zoo's batch layers with tensor inputs beside x (a position mask inside the
means, per-(sample, channel) and per-element modulations: each part passes its own slice), the
regression specs with a batch reduction and fuzzed batch specs (of the tensor family too); and
bad calls are errors naming the argument."""

import itertools

import numpy as np
import pytest
import specfuzz
from conftest import QUICK_CFLAGS, ROOT, fuzz_corpus

import derivgen


def _run_split(mod, parts, dys, params, kw, tens=None):
    """The split functions over the parts; ``tens``: each part's tensor inputs by name (a
    layer with tensor inputs beside x)."""
    meta = mod._META
    options = {o: kw[o] for o in meta["options"] if o in kw}
    inputs = {i: kw[i] for i in meta["inputs"]}
    count = sum(p.size // p.shape[1] for p in parts)
    tk = [{"tensors": t} for t in tens] if tens is not None else [{} for _ in parts]
    stats = None
    for level, nsums in enumerate(meta["split"]["levels"]):
        sums = sum(mod.split_partial(level, p, params, options, inputs, stats=stats, **t) for p, t in zip(parts, tk))
        stats = mod.split_finish(level, sums, count, params, options, inputs, stats=stats)
    ys = [mod.split_apply(p, params, stats, count, options, inputs, **t) for p, t in zip(parts, tk)]
    bsums = sum(
        mod.split_backward_partial(d, p, params, stats, count, options, inputs, **t) for p, d, t in zip(parts, dys, tk)
    )
    grads = [
        mod.split_backward_apply(d, p, params, stats, bsums, count, options, inputs, group_terms=j == 0, **t)
        for j, (p, d, t) in enumerate(zip(parts, dys, tk))
    ]
    return stats, ys, grads


def _tensors(spec, shape, rng, dtype) -> dict:
    """A layer's tensor inputs beside x for x of ``shape`` (N, C, T), of their declared shapes:
    masks 0/1 with a valid value in every channel."""
    out = {}
    for t in spec.tensors:
        s = {"x": shape, "sample": shape[:2]}.get(t.shape, (shape[0], 1, *shape[2:]))
        if t.mask:
            v = (rng.random(s) < 0.7).astype(dtype)
            v[0] = 1
        else:
            v = (rng.normal(size=s) * 0.7 + 0.4).astype(dtype)
        out[t.name] = v
    return out


def _check(spec, backend, dtype, seed=0):
    mod = derivgen.load(spec, backend)
    meta = mod._META
    rng = np.random.default_rng(seed)
    c = 3
    x = (rng.normal(size=(6, c, 5)) * 1.3 + 0.3).astype(dtype)
    dy = rng.normal(size=x.shape).astype(dtype)
    params = [
        np.asarray(rng.random(() if p in meta["scalar_params"] else (c,)) + 0.5, dtype=dtype) for p in meta["params"]
    ]
    kw = {}
    for o, (default, lo, hi) in meta["options"].items():
        kw[o] = 1e-3 if o == "eps" else (default if default is not None else (lo if lo is not None else 0.5))
    for i in meta["inputs"]:
        kw[i] = (rng.random(c) + 0.5).astype(dtype)
    spec_ = derivgen.load_spec(spec)
    tens = _tensors(spec_, x.shape, rng, dtype)
    y_ref, cache = mod.forward(x, *tens.values(), *params, **kw)
    g_ref = mod.backward(dy, cache)
    cuts = [0, 2, 2, 6]  # parts of 2, 0 and 4 samples
    parts = [x[a:b] for a, b in itertools.pairwise(cuts)]
    dys = [dy[a:b] for a, b in itertools.pairwise(cuts)]
    tparts = [{t: v[a:b] for t, v in tens.items()} for a, b in itertools.pairwise(cuts)] if tens else None
    stats, ys, grads = _run_split(mod, parts, dys, params, kw, tparts)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == np.float64 else {"rtol": 2e-4, "atol": 2e-5}
    for k, s in enumerate(meta["stats"]["train"]):
        np.testing.assert_allclose(
            stats[k], cache.stats[s], rtol=1e-9 if dtype == np.float32 else 1e-12, atol=1e-12, err_msg=s
        )
    np.testing.assert_allclose(np.concatenate(ys), y_ref, **tol)
    np.testing.assert_allclose(np.concatenate([g.dx for g in grads]), g_ref.dx, **tol)
    for t in spec_.grad_tensors:  # every tensor shape of a channel layout has the samples first: each part's rows
        got = np.concatenate([getattr(g, "d" + t.name) for g in grads])
        np.testing.assert_allclose(got, getattr(g_ref, "d" + t.name), **tol, err_msg=t.name)
    for p in meta["params"]:
        total = sum(np.asarray(getattr(g, "d" + p), dtype=np.float64) for g in grads)
        np.testing.assert_allclose(total, getattr(g_ref, "d" + p), **tol, err_msg=p)
    for i in meta["inputs"]:
        total = sum(np.asarray(getattr(g, "d" + i), dtype=np.float64) for g in grads)
        np.testing.assert_allclose(total, getattr(g_ref, "d" + i), **tol, err_msg=i)


def _has_split(path) -> bool:
    """A batch-reduced spec whose training statistics are sums (a group max()/min() is not)."""
    from derivgen.symbolic.reduce import SELECTIONS

    spec = derivgen.load_spec(path)
    return not any(st.expr.has(*SELECTIONS) for st in spec.modes[0].statistics)


BATCH_REGRESSIONS = [
    str(p)
    for p in sorted((ROOT / "tests" / "regressions").glob("*.toml"))
    if 'reduce = "batch"' in p.read_text() and _has_split(p)
]


def test_a_group_maximum_has_no_split_reduction():
    path = ROOT / "tests" / "regressions" / "group_max_over_batch_blocks.toml"
    assert not _has_split(path)
    for backend in ("numpy", "c"):
        k = derivgen.load(path, backend=backend)
        assert k._META["split"] is None and not hasattr(k, "split_partial")


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
# evonorm_b0: instance statistics inside the batch group (a part holds whole instance blocks)
# masked_batchnorm, conditional_batchnorm, spade: tensor inputs beside x (position, sample, x)
@pytest.mark.parametrize(
    "spec", ["batchnorm", "evonorm_b0", "masked_batchnorm", "conditional_batchnorm", "spade"] + BATCH_REGRESSIONS
)
def test_split_equals_one_piece(spec, backend, dtype, monkeypatch):
    if spec not in derivgen.names():  # as the zoo's and the regressions' tests build them
        monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)
    _check(spec, backend, dtype)


def _fuzz_batch_seeds(n=6, limit=200):
    out = []
    for s in range(limit):
        if 'reduce = "batch"' in specfuzz.generate(s):
            out.append(s)
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("seed", fuzz_corpus(_fuzz_batch_seeds()))
@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_split_fuzzed_batch_specs(seed, backend, tmp_path, monkeypatch):
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)
    p = tmp_path / f"fuzz{seed}.toml"
    p.write_text(specfuzz.generate(seed))
    _check(str(p), backend, np.float64, seed)


def _tensor_batch_seeds(n=6, limit=400):
    """The spec fuzzer's tensor family: batch layouts without outputs beside y (those have a
    split reduction), a core value, masks and tensors of every shape among them."""
    from derivgen.spec import parse_spec

    out = []
    for s in range(specfuzz.TENSOR_SEEDS, specfuzz.TENSOR_SEEDS + limit):
        text = specfuzz.generate(s)
        if 'reduce = "batch"' in text and not parse_spec(text, source="f.toml").outputs:
            out.append(s)
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("seed", fuzz_corpus(_tensor_batch_seeds()))
@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_split_fuzzed_tensor_batch_specs(seed, backend, tmp_path, monkeypatch):
    monkeypatch.setenv("CFLAGS", QUICK_CFLAGS)
    p = tmp_path / f"fuzz{seed}.toml"
    p.write_text(specfuzz.generate(seed))
    _check(str(p), backend, np.float64, seed)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_split_bad_calls_name_the_argument(backend):
    mod = derivgen.load("batchnorm", backend)
    x = np.ones((2, 3, 4))
    g, b = np.ones(3), np.zeros(3)
    with pytest.raises(ValueError, match="level must be an int from 0 to 1, got 2"):
        mod.split_partial(2, x, [g, b])
    with pytest.raises(TypeError, match="level 1 needs the statistics"):
        mod.split_partial(1, x, [g, b])
    with pytest.raises(TypeError, match=r"unknown options \['epsilon'\]"):
        mod.split_partial(0, x, [g, b], {"epsilon": 1e-3})
    with pytest.raises(TypeError, match=r"params \['beta'\] are required"):
        mod.split_partial(0, x, {"gamma": g})
    s0 = mod.split_partial(0, x, {"gamma": g, "beta": b})
    with pytest.raises(ValueError, match=r"sums must be float64 of shape \(1, 3\)"):
        mod.split_finish(0, s0[:, :2], 8, [g, b])
    with pytest.raises(ValueError, match="count=1 values per group"):
        mod.split_finish(0, s0, 1, [g, b])
    st = mod.split_finish(0, s0, 8, [g, b])
    with pytest.raises(ValueError, match=r"stats must be float64 of shape \(3, 3\)"):
        mod.split_apply(x, [g, b], st[:2], 8)
    with pytest.raises(ValueError, match="dy must have the shape and dtype of x"):
        mod.split_backward_partial(np.ones((2, 3, 5)), x, [g, b], st, 8)
    with pytest.raises(ValueError, match="gamma must have shape"):
        mod.split_partial(0, x, [np.ones(4), b])
    with pytest.raises(TypeError, match="gamma has dtype float32 but x has float64"):
        mod.split_partial(0, x, [g.astype(np.float32), b])
    ln = derivgen.load("layernorm", backend)
    assert not hasattr(ln, "split_partial")


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_split_tensor_inputs_are_checked_by_name(backend, tmp_path):
    """A layer with tensor inputs beside x takes each part's own as ``tensors=``, a dict by
    name of their declared shapes for the part; a missing, misshapen or non-0/1 mask is an
    error naming it. A layer with outputs beside y has no split reduction."""
    mod = derivgen.load("masked_batchnorm", backend)
    x, w, b = np.ones((2, 3, 4)), np.ones(3), np.zeros(3)
    with pytest.raises(TypeError, match="mask is required"):
        mod.split_partial(0, x, [w, b])
    with pytest.raises(TypeError, match="tensors must be a dict by name"):
        mod.split_partial(0, x, [w, b], tensors=[np.ones((2, 1, 4))])
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 1, 4\)"):
        mod.split_partial(0, x, [w, b], tensors={"mask": np.ones((2, 3, 4))})
    with pytest.raises(ValueError, match="mask is a mask: every value must be 0 or 1"):
        mod.split_partial(0, x, [w, b], tensors={"mask": np.full((2, 1, 4), 0.5)})
    assert mod.split_partial(0, x, [w, b], tensors={"mask": np.ones((2, 1, 4))}).shape == (2, 3)
    beside = tmp_path / "beside.toml"
    beside.write_text(
        'name = "beside"\ntitle = "t"\n[layout]\nkind = "channels"\nreduce = "batch"\n[tensors]\nr = {}\n'
        '[values]\nh = "x + r"\n[statistics]\nmu = "mean(h)"\n[output]\ny = "h - mu"\nh = "h"\n'
    )
    assert derivgen.load(beside, "numpy")._META["split"] is None
