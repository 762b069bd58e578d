"""User-defined layers: the examples derive, prove, generate and check like the
catalogue; malicious and malformed specs are rejected quickly with no side effects."""

import inspect
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, require_module

import derivgen
from derivgen.spec import SpecError, parse_spec
from derivgen.tools.check import check_layer

EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "derivgen", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_derives_generates_and_checks(path, tmp_path):
    r = cli("derive", "--spec", str(path), "--format", "text", "--prove-sizes", "2-4")
    assert r.returncode == 0, r.stderr
    assert "N = 4: proven" in r.stdout
    out = tmp_path / "gen"
    r = cli("generate", "--spec", str(path), "--out", str(out))
    assert r.returncode == 0, r.stderr
    name = derivgen.load_spec(path).name
    for rel in (f"numpy/{name}.py", f"c/{name}.c", f"c/{name}.h", f"c/{name}.py"):
        assert (out / rel).is_file(), rel
    rows = check_layer(derivgen.load_spec(path), prove_sizes=(2, 3))
    bad = [(r.check, r.backend, r.dtype, r.status, r.errors) for r in rows if r.failed]
    assert not bad, bad
    assert {r.check for r in rows} >= {"spec + finite differences", "other backend"}


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_load_by_path(backend):
    k = derivgen.load(str(ROOT / "examples" / "scalenorm.toml"), backend=backend)
    x = np.random.default_rng(0).normal(size=(3, 7))
    y, c = k.forward(x, np.array(2.0))
    np.testing.assert_allclose(y, 2 * x / np.sqrt((x**2).sum(-1, keepdims=True) + 1e-5))
    g = k.backward(np.ones_like(x), c)
    assert g.dscale.shape == () and g.dx.shape == x.shape
    np.testing.assert_allclose(g.dscale, (y / 2).sum())


def test_material_sigma_is_what_it_says():
    k = derivgen.load(str(ROOT / "examples" / "material_sigma.toml"))
    x = np.random.default_rng(1).normal(size=(4, 9))
    y, _ = k.forward(x, np.ones(9), np.zeros(9), eps=0.0)
    # sigma = std/sqrt(N): the output is sqrt(N) times layer norm's
    ln = (x - x.mean(-1, keepdims=True)) / x.std(-1, keepdims=True)
    np.testing.assert_allclose(y, 3.0 * ln, rtol=1e-12)


BASE = """
name = "t"
[layout]
kind = "trailing"
[params]
gamma = {}
[statistics]
mean = "mean(x)"
[output]
y = "gamma*(x - mean)"
"""

BAD = [
    ("eval-call", BASE.replace('"mean(x)"', "\"__import__('os').system('touch PWNED')\""), "only calls"),
    ("attribute", BASE.replace('"gamma*(x - mean)"', '"x.__class__.__bases__"'), "Attribute"),
    ("lambda", BASE.replace('"mean(x)"', '"(lambda: 1)()"'), "only calls"),
    ("comprehension", BASE.replace('"mean(x)"', '"sum([x for x in x])"'), "ListComp"),
    ("generator", BASE.replace('"mean(x)"', '"sum(x for x in x)"'), "GeneratorExp"),
    ("huge-exponent", BASE.replace('"mean(x)"', '"mean(x**999999999)"'), "exponent"),
    ("power-tower", BASE.replace('"mean(x)"', '"mean(x**(9**9**9))"'), "exponent"),
    ("long", BASE.replace('"mean(x)"', '"' + "x+" * 5000 + 'x"'), "characters long|too long"),
    ("deep", BASE.replace('"mean(x)"', '"' + "(" * 300 + "x" + ")" * 300 + '"'), "deeper|parse|nested"),
    ("big-int", BASE.replace('"mean(x)"', '"mean(x) + 99999999999999999999"'), "too large"),
    ("string", BASE.replace('"mean(x)"', "\"'abc'\""), "numeric constants"),
    ("kwargs", BASE.replace('"mean(x)"', '"sqrt(x=1)"'), "takes no keyword arguments"),
    ("unknown-func", BASE.replace('"mean(x)"', '"open(x)"'), "unknown function"),
    ("subscript", BASE.replace('"mean(x)"', '"x[0]"'), "Subscript"),
    ("walrus", BASE.replace('"mean(x)"', '"(y := 1)"'), "NamedExpr"),
    ("fstring", BASE.replace('"mean(x)"', "\"f'{x}'\""), "JoinedStr|numeric"),
    ("bad-ident", BASE.replace("gamma = {}", '"gamma; system(1)" = {}'), "invalid or reserved name"),
    ("dunder", BASE.replace("gamma = {}", "__class__ = {}"), "invalid or reserved name"),
    ("keyword", BASE.replace("gamma = {}", "for = {}"), "invalid or reserved name"),
    ("c-keyword", BASE.replace("gamma = {}", "double = {}"), "invalid or reserved name"),
    ("libm", BASE.replace("gamma = {}", "sqrt = {}"), "invalid or reserved name"),
    ("module-attribute", BASE.replace("gamma = {}", "cuda = {}"), "attribute of derivgen.torch.Module"),
    ("docstring-escape", BASE.replace('name = "t"', 'name = "t"\ntitle = \'x """ ; import os\''), "must not contain"),
    ("comment-escape", BASE.replace('name = "t"', 'name = "t"\nsummary = "x */ int evil; /*"'), "must not contain"),
    ("newline", BASE.replace('name = "t"', 'name = "t"\nsummary = "a\\nimport os"'), "control character"),
    ("tex", BASE.replace("gamma = {}", 'gamma = { latex = "\\\\input{/etc/passwd}" }'), "TeX primitives"),
    (
        "cycle",
        BASE.replace('mean = "mean(x)"', 'a = "mean(x) + b"\nb = "mean(x) + a"\nmean = "mean(x)"'),
        "used before it is defined",
    ),
    ("undefined", BASE.replace('"gamma*(x - mean)"', '"gamma*(x - mu)"'), "unknown name 'mu'"),
    ("missing-output", BASE.replace('[output]\ny = "gamma*(x - mean)"', ""), "output: missing"),
    (
        "stats-not-a-table",
        BASE.replace('[statistics]\nmean = "mean(x)"', "")
        .replace("- mean", "- 1")
        .replace('name = "t"', 'name = "t"\nstatistics = 3'),
        "statistics: must be a table",
    ),
    ("x-outside-mean", BASE.replace('"mean(x)"', '"x + 1"'), "x appears outside mean"),
    ("channel-param-outside-mean", BASE.replace('"mean(x)"', '"mean(x) + gamma"'), "per-channel parameter gamma"),
    ("sqrt-of-negative", BASE.replace('"mean(x)"', '"sqrt(-mean(x**2) - 1)"'), "non-integer power of a negative"),
    (
        "log-of-nonpositive",
        BASE.replace('"mean(x)"', '"log(-mean(x**2))"'),
        "logarithm of a value that is never positive",
    ),
    ("normalized-not-affine", BASE + '[normalized]\nname = "z"\nexpr = "x**2"\n', "affine in x"),
    ("unknown-field", BASE + "\nextra = 1\n", "unknown field"),
    ("bad-layout", BASE.replace('kind = "trailing"', 'kind = "diagonal"'), "layout.kind"),
    ("reduction-in-output", BASE.replace('"gamma*(x - mean)"', '"gamma*(x - mean(x))"'), "group reduction"),
    ("collide", BASE.replace("gamma = {}", "gamma = {}\ndgamma = {}"), "collide"),
    ("bad-toml", "name = \n", "invalid TOML"),
    ("name-path", BASE.replace('name = "t"', 'name = "../../etc/x"'), "lower-case identifier"),
    (
        "leading-of-a-number",
        BASE.replace('"mean(x)"', '"mean(leading(0.5)*x)"'),
        "leading\\(\\) takes the name of an option",
    ),
    ("leading-of-a-param", BASE.replace('"mean(x)"', '"mean(leading(gamma)*x)"'), "takes the name of an option"),
    (
        "leading-outside-mean",
        BASE.replace('"mean(x)"', '"mean(x) + leading(p)"') + "[options]\np = 0.5\n",
        "leading\\(p\\) varies within a normalization group",
    ),
    (
        "leading-in-max",
        BASE.replace('"mean(x)"', '"max(leading(p)*x)"') + "[options]\np = 0.5\n",
        "max\\(\\) of an expression with leading\\(\\)",
    ),
    (
        "leading-in-channels",
        BASE.replace('kind = "trailing"', 'kind = "channels"').replace('"mean(x)"', '"mean(leading(p)*x)"')
        + "[options]\np = 0.5\n",
        "statistics.mean.expr: leading\\(p\\) needs a 'trailing' layout",
    ),
    ("leading-declared", BASE.replace("gamma = {}", "leading = {}"), "invalid or reserved name"),
]


@pytest.mark.parametrize("label, text, needle", BAD, ids=[b[0] for b in BAD])
def test_malformed_and_malicious_specs_are_rejected(label, text, needle, tmp_path):
    import re

    t0 = time.perf_counter()
    with pytest.raises(SpecError) as info:
        parse_spec(text, source="bad.toml")
    assert time.perf_counter() - t0 < 1.0
    msg = str(info.value)
    assert msg.startswith("bad.toml: ")
    assert re.search(needle, msg), msg


@pytest.mark.parametrize(
    "label, text, needle",
    [b for b in BAD if b[0] in ("eval-call", "attribute", "docstring-escape", "cycle", "huge-exponent")],
    ids=lambda v: v if isinstance(v, str) and len(v) < 20 else "",
)
def test_cli_rejects_with_exit_2_and_writes_nothing(label, text, needle, tmp_path):
    spec = tmp_path / "evil.toml"
    spec.write_text(text)
    out = tmp_path / "out"
    for args in (
        ["generate", "--spec", str(spec), "--out", str(out)],
        ["derive", "--spec", str(spec)],
        ["check", "--spec", str(spec)],
    ):
        r = cli(*args, cwd=tmp_path)
        assert r.returncode == 2, (args, r.stderr)
        assert "evil.toml" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert "Traceback" not in r.stderr
    assert not out.exists()
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.toml"]


def test_prose_with_code_delimiters_is_rejected_but_safe_prose_is_kept():
    """Titles and summaries reach generated comments; text that could close a comment or
    docstring is refused, and ordinary prose is copied as written into valid files."""
    from derivgen.codegen.emit import emit

    ok = BASE.replace('name = "t"', 'name = "t"\ntitle = "A (weird) title: 50% <ok> & \'quoted\'"')
    out = emit(derivgen.derive(parse_spec(ok, source="ok.toml"))).files
    for rel, body in out.items():
        if rel.endswith(".py"):
            compile(body, rel, "exec")  # still valid Python
    assert "A (weird) title: 50% <ok> & 'quoted'" in out["c/t.c"]


# the fewest run-time reductions each example's backward can have (layer-norm-like 2,
# RMS-like 1, no statistics 0)
MIN_REDUCTIONS = {
    "scalenorm": 1,
    "layernorm_nobias": 2,
    "material_sigma": 2,
    "dynamic_tanh": 0,
    "online_layernorm_notation": 2,
}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_is_minimal_and_proven_symbolically(path):
    from derivgen.prove.proof import prove_mode

    d = derivgen.derive(path)
    assert d.spec.name in MIN_REDUCTIONS, "add the new example to MIN_REDUCTIONS"
    for md in d.modes.values():
        assert len(md.reductions) == MIN_REDUCTIONS[d.spec.name], md.reductions
        proof = prove_mode(md, sizes=(2, 3, 4))
        assert proof.status == "proven", [(r.n, r.status, r.detail) for r in proof.results]


def test_online_layernorm_in_the_notes_notation_matches_the_catalogue():
    """The notes' notation (mu_t, sigma_t, s; one statistic less) gives the catalogue layer."""
    a = derivgen.load(str(ROOT / "examples" / "online_layernorm_notation.toml"))
    b = derivgen.load("online_layernorm")
    rng = np.random.default_rng(5)
    x, g, bb = rng.normal(size=(4, 9)), rng.normal(1, 0.2, 9), rng.normal(size=9)
    pm, ps = rng.normal(size=4), rng.uniform(0.5, 1.5, 4)
    ya, ca = a.forward(x, g, bb, alpha=0.3, mu_prev=pm, sigma_prev=ps)
    yb, cb = b.forward(x, g, bb, alpha=0.3, prev_mean=pm, prev_std=ps)
    np.testing.assert_allclose(ya, yb, rtol=1e-12, atol=1e-12)
    dy = rng.normal(size=x.shape)
    ga, gb = a.backward(dy, ca), b.backward(dy, cb)
    np.testing.assert_allclose(ga.dx, gb.dx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ga.dmu_prev, gb.dprev_mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ga.dsigma_prev, gb.dprev_std, rtol=1e-10, atol=1e-12)


def test_the_module_attribute_names_cover_torch_nn_module():
    """derivgen.torch.Module makes options and parameters its attributes: every public name of
    torch.nn.Module is reserved (the list in derivgen/spec/reserved.py is data, checked here),
    and so is transformers' smart_apply, which it sets on torch.nn.Module when a pretrained
    model initializes its weights (in this process once a test has built one: the torch names
    are those torch itself defines, whatever ran before)."""
    torch = require_module("torch")
    from derivgen.spec.reserved import TORCH_MODULE_NAMES

    def torch_own(name: str) -> bool:
        where = getattr(inspect.getattr_static(torch.nn.Module, name), "__module__", None)
        return where is None or where.split(".")[0] == "torch"

    public = {n for n in dir(torch.nn.Module) if not n.startswith("_") and torch_own(n)}
    assert "forward" in public and "smart_apply" in TORCH_MODULE_NAMES
    assert public <= TORCH_MODULE_NAMES, sorted(public - TORCH_MODULE_NAMES)
