"""`derivgen check`: table, JSON, failures, and the torch-missing rule."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIRST_USE, ROOT

import derivgen
from derivgen.tools import check as chk
from derivgen.tools import check_report, progress


def run(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "derivgen", "check", *args], capture_output=True, text=True, timeout=600, env=env
    )


def test_check_json_covers_every_check():
    r = run("rmsnorm", "--json", "--prove-sizes", "2-3")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["failed"] == 0
    checks = {(row["backend"], row["dtype"], row["check"]) for row in data["rows"]}
    for b in ("numpy", "c"):
        for d in ("float32", "float64"):
            assert (b, d, "spec + finite differences") in checks
            assert (b, d, "torch") in checks
        assert ("c~numpy", "float32", "other backend") in checks
    assert any(row["check"].startswith("proof") and row["status"] == "ok" for row in data["rows"])
    for row in data["rows"]:
        for v in row["errors"].values():
            assert np.isfinite(v)


def test_check_table_and_progress():
    r = run("batchnorm", "--backend", "c", "--dtype", "float64", "--prove-sizes", "2")
    assert r.returncode == 0, r.stderr
    assert "eval" in r.stdout and "train" in r.stdout
    assert "worst rel. error" in r.stdout
    assert r.stdout.strip().splitlines()[-1].endswith("0 failed")
    assert max(len(line) for line in r.stdout.splitlines()) <= 100
    # progress only on a terminal; a cold build cache announces its builds, one line each
    assert all(FIRST_USE.match(line) for line in r.stderr.splitlines()), r.stderr


def test_progress_on_a_terminal_only(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    step = progress.stderr_progress(2)
    step("one")
    step.done()
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    step = progress.stderr_progress(2)
    step("one")
    step.done()
    assert "1/2 one" in capsys.readouterr().err


def test_a_spec_file_is_checked_against_torch_autograd_of_its_forward():
    spec = derivgen.load_spec(ROOT / "examples" / "dynamic_tanh.toml")
    rows = chk.check_layer(spec, ("numpy",), ("float64",), prove_sizes=(2,), in_ci=False)
    torch_rows = [r for r in rows if r.check.startswith("torch")]
    assert [r.check for r in torch_rows] == ["torch", "torch second order"]
    assert all(r.status == "ok" and r.errors for r in torch_rows), torch_rows
    assert set(torch_rows[0].errors) == {"y", "dx", "dalpha", "dgamma", "dbeta"}


def test_the_spec_forward_in_torch_catches_a_wrong_closed_form(monkeypatch):
    spec = derivgen.load_spec(ROOT / "examples" / "scalenorm.toml")
    real = chk._run

    def broken(mod, spec_, x, dy, params, kw, seeds=None):
        out = real(mod, spec_, x, dy, params, kw, seeds)
        out["dx"] = out["dx"] * 1.001
        return out

    monkeypatch.setattr(chk, "_run", broken)
    rows = chk.check_layer(spec, ("numpy",), ("float64",), prove_sizes=(2,), in_ci=False)
    assert [r.failed for r in rows if r.check == "torch"] == [True]


@pytest.mark.parametrize(
    "args, needle",
    [(["--backend", "fortran"], "--backend"), (["--dtype", "float16"], "--dtype"), (["nosuch"], "unknown layer")],
)
def test_check_bad_options(args, needle):
    r = run(*args)
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_torch_missing_is_a_skip_locally_and_a_failure_in_ci(monkeypatch):
    import derivgen.tools.torch_ref as tr

    monkeypatch.setattr(tr, "torch_available", lambda: False)
    spec = derivgen.load_spec("rmsnorm")
    local = chk.check_layer(spec, ("numpy",), ("float64",), prove_sizes=(2,), in_ci=False)
    ci = chk.check_layer(spec, ("numpy",), ("float64",), prove_sizes=(2,), in_ci=True)
    assert [r.status for r in local if r.check == "torch"] == ["skipped: torch not installed"]
    assert [r.failed for r in ci if r.check == "torch"] == [True]


def test_a_broken_backend_is_reported(monkeypatch):
    spec = derivgen.load_spec("layernorm")
    real = chk._run

    def broken(mod, spec_, x, dy, params, kw, seeds=None):
        out = real(mod, spec_, x, dy, params, kw, seeds)
        out["dx"] = out["dx"] * 1.001
        out["bb.ddy"] = out["bb.ddy"] * 1.001  # the second-order rows catch their own outputs
        return out

    monkeypatch.setattr(chk, "_run", broken)
    rows = chk.check_layer(spec, ("numpy",), ("float64",), prove_sizes=(2,), in_ci=False)
    bad = {r.check for r in rows if r.failed}
    assert "spec + finite differences" in bad and "torch" in bad
    assert "second order: finite differences" in bad and "torch second order" in bad


def test_stop_gradient_leaves_finite_differences_to_y_and_torch_judges_the_gradient():
    spec = derivgen.load_spec("batch_renorm")
    rows = chk.check_layer(spec, ("numpy",), ("float64",), prove_sizes=(2,), in_ci=False)
    assert not [r for r in rows if r.failed], rows
    fd = [r for r in rows if r.check == "spec + finite differences"]
    assert fd and all(set(r.errors) == {"y"} and r.status == "ok (y only: stop_gradient)" for r in fd)
    assert all(r.status.startswith("n/a") for r in rows if r.check == "second order: finite differences")
    torch_rows = [r for r in rows if r.check == "torch"]
    assert torch_rows and all(r.status == "ok" and "dx" in r.errors for r in torch_rows)


def test_the_table_fits_100_columns_with_long_names():
    rows = [
        chk.Row(
            "weight_standardization", "train", "c~numpy", "float32", "torch second order", {"bb.dweight_x": 1e-7}, 2e-5
        ),
        chk.Row("batch_renorm", "train", "numpy", "float64", "second order: finite differences", status=chk.NO_FD),
    ]
    table = check_report.format_table(rows)
    assert max(len(line) for line in table.splitlines()) <= 100
    assert "n/a: stop_gradient" in table


def test_group_max_layers_are_checked_against_the_spec_and_torch():
    rows = chk.check_layer(derivgen.load_spec("softmax"), ("numpy",), ("float64",), prove_sizes=(2,), in_ci=False)
    assert not [r for r in rows if r.failed], rows
    assert any(r.check == "torch" and r.status == "ok" and "dx" in r.errors for r in rows)


SOFTPLUS_SPEC = """
name = "ln_mish"
[layout]
kind = "trailing"
[params]
gamma = { role = "scale" }
[options]
eps = { default = 1e-5, min = 0 }
[statistics]
mean = "mean(x)"
var = "mean((x - mean)**2)"
rstd = "1/sqrt(var + eps)"
[normalized]
name = "xhat"
expr = "(x - mean)*rstd"
[output]
y = "gamma*xhat*tanh(softplus(xhat))"
"""


def test_a_function_with_extra_torch_arguments_is_checked_against_torch(tmp_path):
    """softplus is torch.logaddexp(u, 0): the spec's forward in torch passes the table's
    extra constants, and the layer (layer norm then Mish) passes every check."""
    from derivgen.spec import parse_spec

    spec = parse_spec(SOFTPLUS_SPEC, source="ln_mish.toml")
    rows = chk.check_layer(spec, prove_sizes=(2,))
    assert rows and not [r for r in rows if r.failed]
    assert any(r.check.startswith("torch") and r.status == "ok" for r in rows)
