"""Split reductions (derivgen.torch.sync): SyncBatchNorm and Module(spec, sync=True) on
2, 3 and 4 gloo processes on localhost with unequal parts (one empty) against one process
on the whole batch; DDP training after convert_sync_batchnorm; bad input on one process is
an error on every process; statistics over micro-batches without torch.distributed.
Every multi-process run is bounded: a hung collective fails the test, not CI."""

import os
import signal
import subprocess
import sys

import pytest
import specfuzz
from conftest import QUICK_CFLAGS, ROOT, fuzz_corpus, require_module

torch = require_module("torch")
import derivgen.torch as dt
from derivgen.runtime.cbind import input_pairs
from derivgen.torch import sync
from derivgen.torch.ops import layer


def run(case: str, world: int, timeout: int = 240, cflags: str | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **({"CFLAGS": cflags} if cflags else {}))
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "sync_driver.py"), case, str(world)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"{case} on {world} processes did not finish in {timeout} s:\n{out}\n{err[-3000:]}")
    assert p.returncode == 0, out + err[-3000:]
    assert f"{case} with {world} processes: ok" in out, out
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sync_batchnorm_matches_one_process(world):
    out = run("batchnorm", world)
    assert "torch.float32 step 1 dweight" in out and "torch.float64 eval y" in out


def test_user_spec_with_a_batch_reduction():
    out = run("spec", 3, cflags=QUICK_CFLAGS)  # a user spec: built as the regression specs are
    assert "spec dgamma" in out


def test_layers_with_tensor_inputs_split_across_processes():
    """masked, conditional and SPADE batch norm with sync=True on 3 processes (parts of 5, 3 and
    0 samples, each with its part of the tensors) against one process on the whole batch:
    y, dx, the tensors' and parameters' gradients, float64, float32 and a channels-last part."""
    out = run("multi", 3)
    assert "spade torch.float64 channels_last dgamma" in out and "masked_batchnorm torch.float32 dweight" in out


def test_ddp_training_with_convert_sync_batchnorm():
    out = run("train", 2)
    assert "train 1.running_var" in out and "train 4.num_batches_tracked" not in out


@pytest.mark.parametrize("case,world", [("badshape", 2), ("baddtype", 3)])
def test_bad_part_is_an_error_on_every_process(case, world):
    out = run(case, world)
    assert sum(f"rank {r} raised SyncError" in out for r in range(world)) == world, out


def test_a_process_that_dies_mid_step_is_an_error_on_the_others():
    """One process exits before the layer: the others get gloo's error from the header
    collective (its peer is gone) instead of waiting forever."""
    out = run("raise", 3, timeout=180)
    assert "rank 0 got RuntimeError" in out and "rank 2 got RuntimeError" in out, out


def test_statistics_over_micro_batches_equal_the_whole_batch():
    """The split without torch.distributed: statistics accumulated over parts (one in
    memory at a time), then each part normalized, equal the one-batch layer."""
    lay = layer("batchnorm")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(11, 4, 3, 5, generator=g, dtype=torch.float64) * 3 + 2
    params = {
        "gamma": torch.rand(4, generator=g, dtype=torch.float64) + 0.5,
        "beta": torch.randn(4, generator=g, dtype=torch.float64),
    }
    options = {"eps": 1e-5, "momentum": 0.1}
    parts = [x[:4], x[4:4], x[4:9], x[9:]]
    stats, n = sync.statistics_over(lay, parts, params, options)
    assert n == 11 * 15
    y = torch.cat([sync.apply_statistics(lay, p, stats, params, options) for p in parts])
    ref = torch.nn.functional.batch_norm(x, None, None, params["gamma"], params["beta"], training=True, eps=1e-5)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats["var"].reshape(-1), x.var(dim=(0, 2, 3), unbiased=False), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="groups span the batch"):
        sync.statistics_over(layer("layernorm"), parts, {}, {})


def test_sync_needs_a_batch_reduced_layer(tmp_path):
    with pytest.raises(ValueError, match="groups span the batch"):
        dt.Module("layernorm", 8, sync=True)
    beside = tmp_path / "beside.toml"
    beside.write_text(
        'name = "beside"\ntitle = "t"\n[layout]\nkind = "channels"\nreduce = "batch"\n[tensors]\nr = {}\n'
        '[values]\nh = "x + r"\n[statistics]\nmu = "mean(h)"\n[output]\ny = "h - mu"\nh = "h"\n'
    )
    with pytest.raises(ValueError, match="no layer with outputs beside y"):
        dt.Module(str(beside), 3, sync=True)
    with pytest.raises(ValueError, match="statistics_over takes no layer with tensor inputs"):
        sync.statistics_over(layer("masked_batchnorm"), [torch.ones(2, 3, 4)], {}, {})


def test_sync_batchnorm_alone_is_batchnorm():
    """Without torch.distributed (or with one process) SyncBatchNorm is BatchNorm: same
    constructor, state_dict keys and results as torch.nn.BatchNorm2d."""
    ref = torch.nn.BatchNorm2d(3, momentum=None).double()
    ours = dt.SyncBatchNorm(3, momentum=None).double()
    assert list(ours.state_dict()) == list(torch.nn.SyncBatchNorm(3).state_dict())
    x = torch.randn(4, 3, 5, 2, dtype=torch.float64)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.running_var, ref.running_var, rtol=1e-12, atol=1e-12)
    conv = dt.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.ReLU()))
    assert type(conv[0]) is dt.SyncBatchNorm and conv[0].num_features == 3


def _split_matches_closed_forms(spec):
    """The generated split functions (partial/finish/apply, backward_partial/apply) of a
    spec's train mode against its one-piece forward and backward: on the whole x, and
    for a layer whose groups span the batch, on x in two parts whose sums are added."""
    from torch_cases import arguments

    import derivgen
    from derivgen import runtime as rt

    target = derivgen.load(spec, "torch")
    meta = target.META
    if not hasattr(target, "partial_train"):  # a group max()/min(): no split reduction (sync refuses it)
        from derivgen.symbolic.reduce import SELECTIONS

        assert any(st.expr.has(*SELECTIONS) for st in derivgen.load_spec(spec).modes[0].statistics)
        return

    class _Lay:  # what torch_cases.arguments reads
        pass

    lay = _Lay()
    lay.meta = meta
    x, params, inputs, options, _, groups = arguments(lay, "train", requires_grad=False)
    x, params = x.detach(), {k: v.detach() for k, v in params.items()}
    inputs = {k: v.detach() for k, v in inputs.items()}

    def layout(xx):
        return rt.layout_from_shapes(
            meta,
            tuple(xx.shape),
            {p: tuple(t.shape) for p, t in params.items()},
            groups if meta["reduce"] == "group" else None,
        )

    def kw(L):
        k = {p: t.reshape((1, 1, 1, 1) if p in meta["scalar_params"] else L.param4) for p, t in params.items()}
        k.update({i: t.reshape((1, 1, 1, 1) if t.numel() == 1 else L.stat4) for i, t in inputs.items()})
        k.update({b: None for b in meta["buffers"]})
        k.update(options)
        return k

    L = layout(x)
    dy = torch.randn(L.view4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    x4 = x.reshape(L.view4)
    y_ref, st_ref = target.forward_train(x4, **kw(L), _L=L)
    dx_ref, dp_ref, _ = target.backward_train(dy, x4, **kw(L), _L=L)
    batch = meta["layout"] == "channels" and meta["reduce"] == "batch" and x.shape[0] > 1
    cuts = [(0, 1), (1, x.shape[0])] if batch else [(0, x.shape[0])]
    parts = [(x4[a:b], dy[a:b]) for a, b in cuts]
    Ls = [
        L
        if not batch
        else rt.Layout(
            O=b - a,
            G=L.G,
            Cg=L.Cg,
            S=L.S,
            per_sample=False,
            x_shape=None,
            param_shape=L.param_shape,
            group_shape=L.group_shape,
        )
        for a, b in cuts
    ]
    k = kw(L)
    stats = {}
    for level in range(target.SPLIT_LEVELS_TRAIN):
        sums = None
        for (xp, _), Lp in zip(parts, Ls):
            s = target.partial_train(level, xp, **k, _L=Lp, _stats=stats)
            sums = s if sums is None else tuple(u + v for u, v in zip(sums, s))
        stats.update(target.finish_train(level, sums, **k, _stats=stats, N=L.group_size))
    for name, v in st_ref.items():
        torch.testing.assert_close(torch.as_tensor(stats[name]).expand_as(v), v, rtol=1e-12, atol=1e-12)
    y = torch.cat([target.apply_train(xp, **k, _stats=stats) for xp, _ in parts])
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    bsums = None
    for (xp, dp), Lp in zip(parts, Ls):
        s = target.backward_partial_train(dp, xp, **k, _L=Lp, _stats=stats, N=L.group_size)
        bsums = s if bsums is None else tuple(u + v for u, v in zip(bsums, s))
    outs = [
        target.backward_apply_train(dp, xp, **k, _L=Lp, _stats=stats, _sums=bsums, N=L.group_size, _group_terms=j == 0)
        for j, ((xp, dp), Lp) in enumerate(zip(parts, Ls))
    ]
    torch.testing.assert_close(torch.cat([o[0] for o in outs]), dx_ref, rtol=1e-10, atol=1e-12)
    for p in params:
        torch.testing.assert_close(sum(o[1][p] for o in outs), dp_ref[p], rtol=1e-10, atol=1e-12)
    if meta["split"] is None:
        return
    # the generated C split kernels, over the same parts
    from derivgen.torch.sync import _CSplit

    class _Pg:
        pass

    lay_c = layer(spec)
    c = _CSplit(lay_c, torch.float64)
    pp = [params[p].contiguous() for p in meta["params"]]
    ins = [inputs[i].contiguous() for i in meta["inputs"]]
    opts = [float(options[o]) for o in meta["options"]]
    y_c, dx_c, dp_c = [], [], [torch.zeros_like(t) for t in pp]
    # forward: the C kernels' partial sums of each part, added here (what all_reduce does)
    import derivgen.torch.sync as S

    orig = S.dist.all_reduce
    parts_x = [x[a:b].contiguous() for a, b in cuts]
    parts_dy = [dy[a:b].reshape(x[a:b].shape).contiguous() for a, b in cuts]
    try:
        sums_by_call = []

        def fake_all_reduce(t, group=None):  # each part's sums, added over the parts
            sums_by_call.append(t)

        S.dist.all_reduce = fake_all_reduce
        # run the parts level by level in lockstep: a level's sums of every part, then finish
        stats_c = torch.zeros((len(meta["stats"]["train"]), L.n_groups), dtype=torch.float64)
        dims = [(lp.O, lp.G, lp.Cg, lp.S) for lp in Ls]
        for level, nsums in enumerate(meta["split"]["levels"]):
            total = torch.zeros((nsums, L.n_groups), dtype=torch.float64)
            for xp, d in zip(parts_x, dims):
                sums = torch.zeros_like(total)
                if nsums:
                    assert (
                        c.fn["partial"](
                            *d,
                            xp.data_ptr(),
                            *[t.data_ptr() for t in pp],
                            *opts,
                            *input_pairs(ins),
                            level,
                            stats_c.data_ptr(),
                            float(L.group_size),
                            sums.data_ptr(),
                            1,
                        )
                        == 0
                    )
                total += sums
            assert (
                c.fn["finish"](
                    *dims[0],
                    *[t.data_ptr() for t in pp],
                    *opts,
                    *input_pairs(ins),
                    level,
                    total.data_ptr(),
                    float(L.group_size),
                    stats_c.data_ptr(),
                )
                == 0
            )
        for i, name in enumerate(meta["stats"]["train"]):
            torch.testing.assert_close(
                stats_c[i].reshape(st_ref[name].shape[1]), st_ref[name].reshape(-1), rtol=1e-12, atol=1e-12
            )
        bt = torch.zeros((meta["split"]["backward"], L.n_groups), dtype=torch.float64)
        for xp, dp, d in zip(parts_x, parts_dy, dims):
            y = torch.empty_like(xp)
            assert (
                c.fn["apply"](
                    *d,
                    xp.data_ptr(),
                    *[t.data_ptr() for t in pp],
                    *opts,
                    *input_pairs(ins),
                    stats_c.data_ptr(),
                    float(L.group_size),
                    y.data_ptr(),
                    1,
                )
                == 0
            )
            y_c.append(y)
            sums = torch.zeros_like(bt)
            if meta["split"]["backward"]:
                assert (
                    c.fn["bpartial"](
                        *d,
                        xp.data_ptr(),
                        dp.data_ptr(),
                        *[t.data_ptr() for t in pp],
                        *opts,
                        *input_pairs(ins),
                        stats_c.data_ptr(),
                        float(L.group_size),
                        sums.data_ptr(),
                        1,
                    )
                    == 0
                )
            bt += sums
        for j, (xp, dp, d) in enumerate(zip(parts_x, parts_dy, dims)):
            dx = torch.empty_like(xp)
            dps = [torch.empty_like(t) for t in pp]
            dis = [torch.empty(L.n_groups, dtype=torch.float64) for _ in ins]
            assert (
                c.fn["bapply"](
                    *d,
                    xp.data_ptr(),
                    dp.data_ptr(),
                    *[t.data_ptr() for t in pp],
                    *opts,
                    *input_pairs(ins),
                    stats_c.data_ptr(),
                    bt.data_ptr(),
                    float(L.group_size),
                    int(j == 0),
                    dx.data_ptr(),
                    *[t.data_ptr() for t in dps],
                    *[t.data_ptr() for t in dis],
                    1,
                )
                == 0
            )
            dx_c.append(dx)
            for acc, t in zip(dp_c, dps):
                acc += t
    finally:
        S.dist.all_reduce = orig
    torch.testing.assert_close(torch.cat(y_c).reshape(L.view4), y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(dx_c).reshape(L.view4), dx_ref, rtol=1e-10, atol=1e-12)
    for p, t in zip(meta["params"], dp_c):
        torch.testing.assert_close(t, dp_ref[p].reshape(t.shape), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "name", sorted(__import__("derivgen").names()) + sorted(str(p) for p in (ROOT / "examples").glob("*.toml"))
)
def test_split_functions_every_layer(name):
    _split_matches_closed_forms(name)


@pytest.mark.parametrize("seed", fuzz_corpus(range(40)))
def test_split_functions_fuzzed_specs(seed, tmp_path):
    p = tmp_path / f"fuzz{seed}.toml"
    p.write_text(specfuzz.generate(seed))
    _split_matches_closed_forms(str(p))


def test_sync_bench_reports_both_sides():
    """``derivgen bench --torch --sync 2``'s machinery (timings are not asserted)."""
    from derivgen.tools import bench_sync

    old = bench_sync.SHAPE
    bench_sync.SHAPE = (4, 3, 8, 8)
    try:
        rep = bench_sync.run_sync_bench(2, repeat=3, timeout=240)
    finally:
        bench_sync.SHAPE = old
    assert len(rep["sync_step_ms"]) == 2 and rep["one_process_ms"] > 0 and rep["bound_ms"] > 0
    assert len(rep["kernels"]) == 5 and all(ms > 0 for _, ms, _, _ in rep["kernels"])
    text = bench_sync.format_sync_report(rep)
    assert "collectives" in text and max(map(len, text.splitlines())) <= 100
