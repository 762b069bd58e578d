"""The spec lint (derivgen/spec/lint.py) and `derivgen lint`: no false warning on any spec the
project ships or keeps, each kind of warning caught on a small bad spec, the mistakes a
mutation of the fuzzer's specs makes caught, and the command line's exit codes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import specfuzz
from conftest import ROOT

from derivgen.spec import load_spec_file, parse_spec
from derivgen.spec.lint import LintWarning, lint

CORPUS = sorted(
    [
        *(ROOT / "derivgen" / "spec" / "catalogue").glob("*.toml"),
        *(ROOT / "derivgen" / "spec" / "zoo").glob("*.toml"),
        *(ROOT / "examples").glob("*.toml"),
        *(ROOT / "tests" / "regressions").glob("*.toml"),
        *(ROOT / "tests" / "regressions" / "tensors").glob("*.toml"),
    ]
)

# Regression specs that keep a name nothing uses. Each is a true warning, kept on purpose: the
# spec reproduces a fuzzer draw as it was (the fuzzer declares previous moments and parameters
# it does not always use), and what broke was how the pipeline treated that very spec.
TRUE_WARNINGS = {
    # an unused input (a previous moment the draw did not mix in)
    "g_holds_a_window.toml": {"inputs.m_t"},
    "param_name_ends_in_digits.toml": {"inputs.shift"},
    "second_order_derivative_of_sign.toml": {"inputs.prev_mean"},
    "second_order_unused_seed.toml": {"inputs.sdoc9is"},
    "split_level_reads_no_statistics.toml": {"inputs.shift"},
    "masked_second_order_time.toml": {"inputs.s_t"},
    # an unused parameter: what broke was its zero gradient (numpy AxisError, a torch None)
    "unused_channel_param.toml": {"params.w"},
    "unused_param_in_torch_reference.toml": {"params.total"},
    "second_order_abs_diracdelta.toml": {"params.w", "options.tau"},
    "window_inside_a_mean.toml": {"params.weight"},
    # an option the draw declared and did not use
    "window_without_parameters.toml": {"options.tau"},
    "statistic_of_parameters_only.toml": {"options.eps"},
}


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_corpus_is_all_there():
    assert len(CORPUS) > 90
    assert {p.name for p in CORPUS} >= set(TRUE_WARNINGS)


@pytest.mark.parametrize("path", CORPUS, ids=[_name(p) for p in CORPUS])
def test_no_false_warning(path):
    """Every catalogue, zoo, example and regression spec is lint-clean, but for the unused names
    TRUE_WARNINGS lists (regression specs only)."""
    spec = load_spec_file(path)
    found = lint(spec)
    expected = TRUE_WARNINGS.get(path.name, set()) if "regressions" in path.parts else set()
    assert {w.field for w in found} == expected, "\n".join(map(str, found))
    assert all(w.kind == "unused" for w in found)
    for w in found:
        assert str(w) == f"{path.name}: {w.field}: {w.message}" and "\n" not in str(w)


def test_all_zero_groups_are_reported_on_request():
    """A value only the group of zeros makes zero is the layer's own (weight normalization divides
    by the norm of v, absmax scaling by max|x|: both undefined at 0 as published), so lint() leaves
    it out unless asked; asked, those two zoo layers are the only ones the corpus has."""
    found = {}
    for path in CORPUS:
        extra = set(lint(load_spec_file(path), all_zero=True)) - set(lint(load_spec_file(path)))
        if extra:
            found[path.name] = sorted(w.field for w in extra)
    assert found == {"absmax_scale.toml": ["output"], "weight_norm.toml": ["output"]}


# ---------------------------------------------------------------- each kind on a small bad spec

LAYER = """\
name = "my"
title = "My layer"
[layout]
kind = "trailing"
[params]
gamma = {{ role = "scale" }}
{params}
[options]
eps = {{ default = 1e-5, min = 0 }}
{options}
[inputs]
{inputs}
[statistics]
mean = "mean(x)"
{stats}
[normalized]
name = "xhat"
expr = "(x - mean)*rstd"
[output]
y = "{y}"
"""


def layer(params="", options="", inputs="", stats='var = "mean((x - mean)**2)"\nrstd = "1/sqrt(var + eps)"', y=None):
    text = LAYER.format(params=params, options=options, inputs=inputs, stats=stats, y=y or "gamma*xhat")
    return lint(parse_spec(text, source="myspec.toml"))


def one(found: tuple[LintWarning, ...]) -> LintWarning:
    assert len(found) == 1, "\n".join(map(str, found))
    return found[0]


def test_a_clean_layer_is_clean():
    assert layer() == ()


def test_unused_parameter():
    w = one(layer(params='alpha = { shape = "scalar" }'))
    assert str(w) == "myspec.toml: params.alpha: used nowhere (its gradient is 0 and training leaves it unchanged)"
    assert w.kind == "unused"


def test_parameter_only_inside_stop_gradient():
    w = one(layer(params='t = { shape = "scalar" }', y="gamma*xhat*stop_gradient(t)"))
    assert w.field == "params.t" and "stop_gradient" in w.message and "gradient is 0" in w.message


def test_unused_option_input_and_statistic():
    found = layer(
        options="k = 3",
        inputs="prev = {}",
        stats='var = "mean((x - mean)**2)"\nm4 = "mean((x - mean)**4)"\nrstd = "1/sqrt(var + eps)"',
    )
    assert [w.field for w in found] == ["options.k", "inputs.prev", "statistics.m4"]
    assert all(w.kind == "unused" for w in found)


def test_a_statistic_read_only_by_a_buffer_update_is_used():
    text = LAYER.format(
        params="",
        options="momentum = 0.1",
        inputs="",
        stats='var = "mean((x - mean)**2)"\nrstd = "1/sqrt(var + eps)"',
        y="gamma*xhat",
    )
    text = text.replace(
        "[statistics]", '[buffers]\nrm = { update = "(1 - momentum)*rm + momentum*mean" }\n[statistics]'
    )
    assert lint(parse_spec(text, source="myspec.toml")) == ()


def test_unused_normalized_coordinate():
    w = one(layer(y="gamma*(x - mean)*rstd"))
    assert w.field == "normalized.name" and "xhat is used nowhere" in w.message


def test_division_by_a_variance_without_eps():
    """The issue's silent mistake: proven, then NaN groups at run time."""
    found = layer(stats='var = "mean((x - mean)**2)"\nrstd = "1/sqrt(var)"')
    assert [w.field for w in found] == ["options.eps", "statistics.rstd"]  # eps declared, not used
    w = found[1]
    assert str(w) == (
        "myspec.toml: statistics.rstd: division by sqrt(var), which is zero when every element of a group "
        "is equal (add eps where it is 0)"
    )
    assert w.kind == "domain"


def test_logarithm_and_root_of_a_value_that_may_be_negative():
    w = one(layer(stats='var = "mean(x**2) - mean**2"\nl = "log(var)"\nrstd = "exp(-l/2) + eps"'))
    assert w.field == "statistics.l" and w.message.startswith("logarithm of") and "every element" in w.message
    w = one(layer(stats='var = "mean(x**2) - 2*mean**2"\nrstd = "1/sqrt(var + eps)"'))
    assert w.field == "statistics.rstd" and "is negative when every element of a group is equal" in w.message


def test_a_group_of_one_element():
    w = one(layer(stats='var = "sum((x - mean)**2)/(N - 1)"\nrstd = "1/sqrt(var + eps)"'))
    assert w.field == "statistics.var"
    assert "division by N - 1, which is zero for a group of one element" in w.message
    assert "min_group_size = 2" in w.message


def test_a_division_in_the_output():
    w = one(layer(y="gamma*xhat/(mean - 1)"))
    assert w.field == "output" and w.kind == "domain"
    assert w.message == "division by mean - 1, which is zero when every element of a group is 1"


def test_constant_statistics():
    w = one(layer(stats='var = "mean(x - mean)**2"\nrstd = "1/sqrt(var + eps)"'))
    assert w.field == "statistics.var" and w.kind == "constant" and "is 0 on every group" in w.message
    w = one(layer(stats='c = "2"\nvar = "mean((x - mean)**2)"\nrstd = "c/sqrt(var + eps)"'))
    assert w.field == "statistics.c" and w.kind == "constant" and "it is 2 on every group" in w.message


def test_eval_mode_statistics_set_to_numbers_are_not_constant_warnings():
    """Batch renormalization's eval mode sets r = 1, d = 0: that switches them off."""
    spec = load_spec_file(ROOT / "derivgen" / "spec" / "zoo" / "batch_renorm.toml")
    assert lint(spec) == ()


# ---------------------------------------------------------------- mutations of the fuzzer's specs


def _add_to_table(text: str, table: str, line: str, first: bool = True) -> str:
    """``line`` added to ``[table]`` (first in it), or a new table before [output]."""
    head = f"[{table}]\n"
    if head in text:
        return text.replace(head, head + line + "\n", 1)
    return text.replace("[output]\n", f"{head}{line}\n[output]\n", 1)


def _y(text: str, f) -> str:
    """The output y rewritten by ``f`` (its expression text in, the new text out)."""
    m = re.search(r'^y = "(.*)"$', text, re.MULTILINE)
    assert m, text
    return text[: m.start()] + f'y = "{f(m.group(1))}"' + text[m.end() :]


def _eps(text: str) -> str:
    return re.search(r"^(\w+) = \{ default = [0-9.e-]+, min = (0|1e-8) \}$", text, re.MULTILINE).group(1)


def drop_eps(text: str) -> str | None:
    """eps taken out of every expression (the option left declared)."""
    eps = _eps(text)
    lines = text.split("\n")
    out = []
    for line in lines:
        if "=" in line and not line.startswith(f"{eps} = "):
            line = re.sub(rf"\s*\+\s*{eps}\b(?!\s*\*)", "", line)
            line = re.sub(rf"\b(?<!\*)(?<!\*\*){eps}\s*\+\s*", "", line)
        out.append(line)
    new = "\n".join(out)
    if re.search(rf"\b{eps}\b", new.replace(f"{eps} = {{", "")):
        return None  # eps is used in a way this mutation does not take out
    return new


MUTATIONS = {
    # name: (mutate the TOML text, the (field, kind) lint must add)
    "unused parameter": (
        lambda t: _add_to_table(t, "params", 'zz_alpha = { shape = "scalar" }'),
        ("params.zz_alpha", "unused"),
    ),
    "unused option": (lambda t: _add_to_table(t, "options", "zz_k = 3"), ("options.zz_k", "unused")),
    "unused input": (lambda t: _add_to_table(t, "inputs", "zz_prev = {}"), ("inputs.zz_prev", "unused")),
    "unused statistic": (
        lambda t: _add_to_table(t, "statistics", 'zz_m4 = "mean(x**4)"'),
        ("statistics.zz_m4", "unused"),
    ),
    "eps dropped": (drop_eps, ("options.EPS", "unused")),
    "1/sqrt(var) without eps": (
        lambda t: _y(
            _add_to_table(t, "statistics", 'zz_r = "1/sqrt(mean((x - mean(x))**2))"'), lambda y: f"({y})*zz_r"
        ),
        ("statistics.zz_r", "domain"),
    ),
    "log of a variance": (
        lambda t: _y(
            _add_to_table(t, "statistics", 'zz_l = "log(mean((x - mean(x))**2))"'), lambda y: f"({y})*exp(zz_l)"
        ),
        ("statistics.zz_l", "domain"),
    ),
    "unbiased variance, groups of one": (
        lambda t: _y(
            _add_to_table(
                re.sub(r"\[modes\.train\]\nmin_group_size = 2\n", "", t),
                "statistics",
                'zz_v = "sum((x - mean(x))**2)/(N - 1)"',
            ),
            lambda y: f"({y})*zz_v",
        ),
        ("statistics.zz_v", "domain"),
    ),
    "mean of the centred x": (
        lambda t: _y(_add_to_table(t, "statistics", 'zz_c = "mean(x - mean(x))"'), lambda y: f"{y} + zz_c"),
        ("statistics.zz_c", "constant"),
    ),
    "a statistic that is a number": (
        lambda t: _y(_add_to_table(t, "statistics", 'zz_two = "2"'), lambda y: f"({y})*zz_two"),
        ("statistics.zz_two", "constant"),
    ),
    "parameter under stop_gradient": (
        lambda t: _y(_add_to_table(t, "params", 'zz_t = { shape = "scalar" }'), lambda y: f"({y})*stop_gradient(zz_t)"),
        ("params.zz_t", "unused"),
    ),
    "parameter multiplied by zero": (
        lambda t: _y(_add_to_table(t, "params", 'zz_s = { shape = "scalar" }'), lambda y: f"{y} + 0*zz_s"),
        ("params.zz_s", "unused"),
    ),
}

# the plain family, the block family (batch, group, all layouts) and the shape family
SEEDS = (*range(8), 100000, 100001, 100002, 200001)


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_lint_catches_the_mistakes_mutations_of_fuzzer_specs_make(mutation):
    mutate, (field, kind) = MUTATIONS[mutation]
    caught = 0
    for seed in SEEDS:
        text = specfuzz.generate(seed)
        new = mutate(text)
        if new is None:
            continue
        before = set(lint(parse_spec(text, source=f"fuzz{seed}.toml")))
        after = set(lint(parse_spec(new, source=f"fuzz{seed}.toml")))
        want = field.replace("EPS", _eps(text))
        added = {(w.field, w.kind) for w in after - before}
        assert (want, kind) in added, f"seed {seed}: {mutation} not caught:\n{new}\n" + "\n".join(map(str, after))
        caught += 1
    assert caught >= 6, f"{mutation}: applies to only {caught} of the seeds"


# ---------------------------------------------------------------- the command line


def run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "derivgen", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


BAD = (ROOT / "tests" / "regressions" / "unused_channel_param.toml").read_text()


def test_cli_lint_prints_warnings_and_exits_0(tmp_path):
    (tmp_path / "bad.toml").write_text(BAD)
    r = run("lint", "bad.toml", "layernorm", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "bad.toml: params.w: used nowhere (its gradient is 0 and training leaves it unchanged)",
        "1 warning(s) in 1 of 2 spec(s)",
    ]
    assert r.stderr == ""
    r = run("lint", "layernorm", "examples/scalenorm.toml", cwd=ROOT)
    assert r.returncode == 0 and r.stdout == "no warnings in 2 spec(s)\n"


def test_cli_lint_strict_is_one_error_line_each_exit_2(tmp_path):
    (tmp_path / "bad.toml").write_text(BAD.replace("g_t = {}", 'g_t = {}\nzz = { shape = "scalar" }'))
    r = run("lint", "--strict", "bad.toml", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "derivgen: error: bad.toml: params.zz: used nowhere (its gradient is 0 and training leaves it unchanged)",
        "derivgen: error: bad.toml: params.w: used nowhere (its gradient is 0 and training leaves it unchanged)",
    ]
    assert run("lint", "--strict", "rmsnorm", cwd=tmp_path).returncode == 0


def test_cli_lint_of_a_bad_spec_is_its_error(tmp_path):
    (tmp_path / "bad.toml").write_text(BAD.replace('"mean(x)"', '"mean(q)"'))
    r = run("lint", "bad.toml", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("derivgen: error: bad.toml: statistics.j")
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_cli_derive_and_check_warn_on_stderr_and_strict_stops_them(tmp_path):
    (tmp_path / "bad.toml").write_text(BAD)
    r = run("derive", "--spec", "bad.toml", "--no-prove", "--format", "text", cwd=tmp_path)
    assert r.returncode == 0
    assert (
        r.stderr
        == "derivgen: warning: bad.toml: params.w: used nowhere (its gradient is 0 and training leaves it unchanged)\n"
    )
    assert "backward pass, derived" in r.stdout
    for cmd in (["derive", "--spec", "bad.toml", "--no-prove"], ["check", "--spec", "bad.toml", "--backend", "numpy"]):
        r = run(*cmd, "--strict", cwd=tmp_path)
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert (
            r.stderr
            == "derivgen: error: bad.toml: params.w: used nowhere (its gradient is 0 and training leaves it unchanged)\n"
        )
