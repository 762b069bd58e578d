"""The code-generation targets as data (:mod:`derivgen.codegen.targets`).

Every record's spellings of the elementary functions cover ``symbolic/functions.py``'s table
and name something at run time; and a target is one record plus its folder: a toy target
(a plain-Python printer here, its template in ``toy_target/``) registered by this test alone
is emitted for every catalogue layer, loaded with ``derivgen.load`` and agrees with the NumPy
target's forward and backward.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import sympy
from oracle import CASES, make_inputs
from sympy.printing.str import StrPrinter

import derivgen
from derivgen.codegen import targets
from derivgen.codegen.emit import emit
from derivgen.codegen.printers import SpecPrinter
from derivgen.spec import reserved
from derivgen.symbolic import functions

TOY_DIR = Path(__file__).parent / "toy_target"


# ------------------------------------------------------------------ every record


@pytest.mark.parametrize("name", list(targets.TARGETS))
def test_function_spellings_cover_the_table(name):
    """Each target spells every table function, and each spelling names something at run time."""
    target = targets.TARGETS[name]
    if target.requires and importlib.util.find_spec(target.requires) is None:
        pytest.skip(f"{target.requires} is not installed")
    for fn in functions.TABLE.values():
        spellings = target.spell(fn)
        assert spellings and all(spellings), (name, fn.name)
        missing = [s for s in spellings if not target.resolves(s)]
        assert not missing, f"target {name}: {fn.name} is spelled {missing}, which names nothing"


def test_records_are_whole():
    """Each record's files lie in its own folder and are nobody else's, its templates exist,
    its reserved words are a kind the spec stage checks, and the registry lists the five."""
    assert targets.names() == ("numpy", "c", "torch", "jax", "triton")
    assert targets.names(loadable=True) == ("numpy", "c", "torch", "triton")
    paths = [p for t in targets.TARGETS.values() for _, p in t.files]
    assert len(paths) == len(set(paths))
    for t in targets.TARGETS.values():
        assert set(t.reserved) <= set(reserved.RESERVED), t.name
        for template, path in t.files:
            assert (t.template_dir or targets.template_dir()).joinpath(template).is_file(), template
            assert path.startswith(t.folder + "/")
        assert t.package_doc.startswith('"""') and t.package_doc.endswith('"""\n')


def test_buffer_reads_once():
    """Which modes read the running buffers is computed once, by the spec; the contract
    the generated modules embed carries it."""
    from derivgen.codegen.emit import emit

    assert derivgen.load_spec("batchnorm").buffer_reads == ("eval",)
    assert emit(derivgen.derive("batchnorm"), ["numpy"]).meta["buffer_reads"] == ["eval"]
    assert emit(derivgen.derive("layernorm"), ["numpy"]).meta["buffer_reads"] == []


# ------------------------------------------------------------------ a toy target


class ToyPrinter(functions.SpellsFunctions, StrPrinter):
    """Plain Python over whole NumPy arrays: group means as ``_mean``, table functions by
    their NumPy spelling (``_np.`` or ``_rt.``)."""

    def _print_Mean(self, expr):
        return f"_mean({self._print(expr.args[0])})"

    def _print_GroupMax(self, expr):
        return f"_max({self._print(expr.args[0])})"

    def _print_GroupMin(self, expr):
        return f"_min({self._print(expr.args[0])})"

    def _print_elementary(self, fn, expr):
        return f"{toy_spelling(fn)}({', '.join(self._print(a) for a in expr.args)})"

    def _print_Pow(self, expr, rational=False):
        root = functions.half_power_sign(expr)
        if root:
            text = f"{toy_spelling(functions.half_power())}({self._print(expr.base)})"
            return text if root > 0 else f"(1/{text})"
        return super()._print_Pow(expr, rational)

    def _print_Pi(self, expr):
        return "_np.pi"

    def _print_Exp1(self, expr):
        return "_np.e"


def toy_spelling(fn: functions.Elementary) -> str:
    """``_np.<name>`` or ``_rt.<name>``: the toy's modules for the table entry's NumPy name."""
    return functions.numpy_path(fn).replace("numpy.", "_np.").replace("runtime.", "_rt.")


def _toy_resolves(spelling: str) -> bool:
    alias, _, attr = spelling.partition(".")
    module = {"_np": np, "_rt": derivgen.runtime}.get(alias)
    return module is not None and hasattr(module, attr)


def _toy_print(printer: SpecPrinter, e: sympy.Expr) -> str:
    return ToyPrinter().doprint(sympy.sympify(e))


def _toy_refuses(d) -> str | None:
    spec = d.spec
    if spec.windows or spec.masks:
        return f"{spec.name}: the toy target takes no windows or position masks"
    return None


TOY = targets.Target(
    name="toy",
    label="toy",
    files=(("toy.py.j2", "toy/{name}.py"),),
    package_doc='"""A test\'s toy target."""\n',
    spell=lambda fn: (toy_spelling(fn),),
    resolves=_toy_resolves,
    template_dir=TOY_DIR,
    filters={"py": _toy_print},
    multi=False,
    blocks=False,
    refuses=_toy_refuses,
    committed=False,
)


@pytest.fixture
def toy():
    targets.register(TOY)
    try:
        yield TOY
    finally:
        targets.unregister(TOY.name)


def test_toy_target_spells_the_table(toy):
    for fn in functions.TABLE.values():
        assert all(toy.resolves(s) for s in toy.spell(fn)), fn.name


def test_toy_target_is_not_generated_by_default(toy):
    from derivgen.tools import generate

    assert "toy" not in generate.TARGETS
    assert targets.names(committed=False) == ("toy",)
    with pytest.raises(ValueError, match="'numpy', 'c', 'torch', 'triton' or 'toy'"):
        derivgen.load("layernorm", backend="nope")


def test_toy_target_refuses_what_its_record_says(toy):
    d = derivgen.derive("add_rmsnorm")  # a tensor beside x: the toy does not take them
    with pytest.raises(NotImplementedError, match="not yet for toy"):
        emit(d, ("toy",))


def _call(mod, case, x, params, kw):
    kw = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in kw.items()}  # buffers change
    return mod.forward(x, *params.values(), **kw)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_toy_target_round_trips_the_catalogue(toy, case):
    """The toy's module, loaded as any target's, computes the NumPy target's numbers."""
    assert {c[0] for c in CASES} == set(derivgen.names())  # every catalogue layer
    spec = derivgen.load_spec(case[0])
    files = emit(derivgen.derive(spec), ("toy",)).files
    assert list(files) == [f"toy/{spec.name}.py"]
    mod, ref = derivgen.load(spec, backend="toy"), derivgen.load(spec, backend="numpy")
    x, params, kw, dy = make_inputs(case, np.float64)
    y, cache = _call(mod, case, x, params, kw)
    y_ref, cache_ref = _call(ref, case, x, params, kw)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    grads, grads_ref = mod.backward(dy, cache), ref.backward(dy, cache_ref)
    assert grads._fields == grads_ref._fields
    for field, got, want in zip(grads._fields, grads, grads_ref, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"{case[0]}: {field}")
