"""Block means (``mean(e, kind)``) in the spec language: what a layout admits, what a block
statistic may read, and the exact rewrites of the engine (derivgen.symbolic.block)."""

from __future__ import annotations

import pytest
import sympy

from derivgen.spec import SpecError, X, parse_spec
from derivgen.symbolic.block import BlockFacts, block_kinds, block_mean

BASE = """
name = "blk"
[layout]
kind = "channels"
reduce = "{reduce}"
[statistics]
{stats}
[output]
y = "{out}"
"""


def spec(stats: str, out: str = "x - m", reduce: str = "batch"):
    return parse_spec(BASE.format(reduce=reduce, stats=stats, out=out), source="blk.toml")


def test_layouts_hold_the_blocks_inside_their_groups():
    assert block_kinds("channels", "batch") == {"instance": "block", "batch": "group"}
    assert block_kinds("channels", "group") == {"instance": "block"}
    assert block_kinds("channels", "all") == {"instance": "block", "sample": "block", "batch": "block"}
    assert block_kinds("channels", "instance") == {"instance": "group"}
    assert block_kinds("trailing", "features") == {}


def test_a_block_statistic_is_an_element_value_of_its_mode():
    s = spec("m = { expr = 'mean(x, \"instance\")' }\nv = { expr = 'mean((x - m)**2, \"instance\")' }", "(x - m)/v")
    mode = s.mode()
    assert mode.statistics == ()
    assert [b.name for b in mode.blocks] == ["m", "v"]
    assert all(b.kinds == {"instance"} for b in mode.blocks)


def test_the_kind_that_spans_the_group_is_the_group_mean():
    s = spec("m = { expr = 'mean(x, \"batch\")' }")
    assert [st.name for st in s.mode().statistics] == ["m"] and s.mode().blocks == ()


@pytest.mark.parametrize(
    "stats, reduce, message",
    [
        ("m = { expr = 'mean(x, \"sample\")' }", "batch", "block kind 'sample' is not one of this layout's"),
        ("m = { expr = 'mean(x, \"instance\")' }", "position", "none: the layout's groups hold no smaller blocks"),
        ('m = { expr = "mean(x, 3)" }', "batch", "block kind in quotes"),
        ("m = { expr = 'x*mean(x, \"instance\")' }", "batch", "must be one value per block"),
        (
            'b = { expr = \'mean(x, "instance")\' }\nm = { expr = "mean(b)" }',
            "batch",
            "group reduction of a block mean",
        ),
        ("m = { expr = 'mean(mean(x), \"instance\")' }", "batch", "may not hold a group reduction"),
        # block sizes cannot be written (yet): an unbiased instance variance is refused, saying so
        (
            "m = { expr = 'sum(x**2, \"instance\")/(N - 1)' }",
            "batch",
            "sum(e, 'instance') needs the size of an instance block, and block sizes cannot be written yet",
        ),
        ("m = { expr = 'sum(1, \"sample\")' }", "all", "block sizes cannot be written yet"),
        ('m = { expr = \'mean(x, "instance")/size("instance")\' }', "batch", "size() is not part of the"),
        ("m = { expr = 'sum(x, \"sample\")' }", "batch", "block kind 'sample' is not one of this layout's"),
    ],
)
def test_bad_block_means_are_refused_naming_the_field(stats, reduce, message):
    with pytest.raises(SpecError, match="statistics.[mb].expr") as info:
        spec(stats, reduce=reduce)
    assert message in str(info.value)


def test_a_sum_over_the_group_kind_is_the_group_sum():
    from derivgen.spec.model import N
    from derivgen.symbolic.reduce import Mean

    s = spec("m = { expr = 'sum(x, \"batch\")/N' }")
    assert [st.expr for st in s.mode().statistics] == [N * Mean(X) / N]


def test_block_means_are_rewritten_exactly():
    m, g, c = sympy.symbols("m g c", real=True)
    facts = BlockFacts({X, g, m}, {m: frozenset({"instance"})}, set(), {block_mean(X, "instance"): m})
    assert facts.rewrite(block_mean(c * (X - m), "instance")) == 0  # B(x - B(x)) = 0, c per block
    assert facts.rewrite(block_mean(m * g, "instance")) == m * block_mean(g, "instance")
    # an instance statistic is not one value on a sample's blocks: it stays inside
    assert facts.rewrite(block_mean(m * g, "sample")) == block_mean(m * g, "sample")


def test_the_closed_form_collects_each_block_mean_once():
    """EvoNorm-B0's dx carries its one instance mean once, times (imean - x), as a person
    writes it, not once per element monomial (x·⟨…⟩ and imean·⟨…⟩ apart)."""
    import derivgen
    from derivgen.symbolic.block import blocks

    d = derivgen.derive("evonorm_b0")
    imean = next(b.symbol for b in d.modes["train"].blocks if b.name == "imean")
    for mode, m in d.modes.items():
        terms = sympy.Add.make_args(m.dx_lowered)
        means = blocks(m.dx_lowered)
        assert len(means) == 1, (mode, means)
        with_mean = [t for t in terms if t.has(*means)]
        assert len(with_mean) == 1, (mode, with_mean)
        assert with_mean[0].has(imean - X) or with_mean[0].has(X - imean), with_mean[0]
