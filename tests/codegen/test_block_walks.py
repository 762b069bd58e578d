"""Block means walked together (derivgen.codegen.c.types.block_groups, kernel.c.j2's
block_group): the block passes of one level of the dependencies share one walk over the group,
each with its own lanes, so each mean keeps the bits of its own walk; a pass whose loads clash
walks alone."""

from __future__ import annotations

import importlib

import numpy as np

import derivgen
from derivgen.codegen import targets
from derivgen.codegen.c.types import BlockPass, BlockPassGroup, block_groups
from derivgen.spec import parse_spec

emit_module = importlib.import_module("derivgen.codegen.emit")  # the module (the package exports its emit())


def _pass(slot: int, deps=(), elem=("const double Xv = (double)x[Idx];",), chan=()) -> BlockPass:
    return BlockPass(
        slot, f"Bm{slot} = ...", "Blocks", "(double)(S)", "Blk", tuple(chan), tuple(elem), "Xv", tuple(deps)
    )


def test_passes_of_one_level_walk_together_dependencies_first():
    a, b, c, d = _pass(0), _pass(1), _pass(2, deps=(0,)), _pass(3, deps=(2, 1))
    groups = block_groups((a, b, c, d))
    assert [[p.slot for p in g.passes] for g in groups] == [[0, 1], [2], [3]]
    assert groups[0].elem_loads == ("const double Xv = (double)x[Idx];",)  # each load once
    # a dependency an earlier sweep computed (not among the passes) is there already
    assert [[p.slot for p in g.passes] for g in block_groups((_pass(5, deps=(4,)), _pass(6)))] == [[5, 6]]


def test_a_pass_whose_loads_clash_walks_alone():
    a = _pass(0, elem=("const double T = Xv*Xv;",))
    b = _pass(1, elem=("const double T = Xv + 1;",))  # the same name, another value
    c = _pass(2, elem=("const double T = Xv*Xv;", "const double U = T;"))
    groups = block_groups((a, b, c))
    assert [[p.slot for p in g.passes] for g in groups] == [[1], [0, 2]]
    assert groups[1] == BlockPassGroup((a, c), (), ("const double T = Xv*Xv;", "const double U = T;"))


SPEC = """
name = "walks"
[layout]
kind = "channels"
reduce = "all"
[params]
gamma = { role = "scale" }
[statistics]
m_in = 'mean(x, "instance")'
m_bn = 'mean(x, "batch")'
v_in = 'mean((x - m_in)**2, "instance")'
[output]
y = "gamma*(x - m_in - m_bn)/sqrt(v_in + 1)"
"""


def _run(monkeypatch, fused: bool):
    if not fused:  # every pass a walk of its own
        monkeypatch.setitem(
            targets.C.globals,
            "block_groups",
            lambda ps: tuple(BlockPassGroup((p,), p.chan_loads, p.elem_loads) for p in ps),
        )
    emit_module._ENVS.clear()
    try:
        spec = parse_spec(SPEC, source="walks.toml")
        source = emit_module.emit(derivgen.derive(spec), ("c",)).files["c/walks.c"]
        k = derivgen.load(spec, backend="c")
        rng = np.random.default_rng(3)
        x = rng.normal(0.5, 2.0, (3, 4, 5, 7)).astype(np.float32)
        gamma = rng.normal(1.0, 0.2, 4).astype(np.float32)
        dy = rng.normal(size=x.shape).astype(np.float32)
        y, cache = k.forward(x, gamma)
        g = k.backward(dy, cache)
        return source, [y, g.dx, g.dgamma]
    finally:
        monkeypatch.undo()
        emit_module._ENVS.clear()


def test_walking_together_keeps_every_bit(monkeypatch):
    fused_src, fused = _run(monkeypatch, True)
    alone_src, alone = _run(monkeypatch, False)
    assert "one walk, 2 block means" in fused_src and "one walk" not in alone_src
    for a, b in zip(fused, alone):
        assert np.array_equal(a, b)
    assert np.isfinite(fused[0]).all()
