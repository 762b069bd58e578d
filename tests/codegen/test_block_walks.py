"""Block means walked together (derivgen.codegen.c.types.block_groups, kernel.c.j2's
block_group): the block passes of one level of the dependencies share one walk over the group,
each with its own lanes, so each mean keeps the bits of its own walk; a pass whose loads clash
walks alone."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import uuid
from pathlib import Path

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


def _compiled(files: dict[str, str], where: Path, tag: str):
    """The C binding of emitted ``files``, written into ``where``/``tag`` and imported from there
    (derivgen.load would give the module it loaded for the same spec before, whatever the
    templates print now)."""
    folder = where / tag
    folder.mkdir()
    for rel, text in files.items():
        if rel.startswith("c/"):
            (folder / rel[2:]).write_text(text)
    name = f"walks_{tag}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, folder / "walks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _data(dtype, shape):
    rng = np.random.default_rng(4)
    x = rng.normal(100.0, 3.0, shape).astype(dtype)
    gamma = rng.normal(1.0, 0.2, shape[1]).astype(dtype)
    dy = rng.normal(size=shape).astype(dtype)
    return x, gamma, dy


def _run(monkeypatch, where: Path, tag: str, *, fused=True, shared=True):
    """The walks layer's C (``fused``: the passes of a level walk together; ``shared``: the
    threads share its one group) and a function running it on some threads."""
    if not fused:  # every pass a walk of its own
        monkeypatch.setitem(
            targets.C.globals,
            "block_groups",
            lambda ps: tuple(BlockPassGroup((p,), p.chan_loads, p.elem_loads) for p in ps),
        )
    if not shared:  # the C target planning its one group on one thread
        alone = dataclasses.replace(targets.C, plan=lambda layer: {**targets.C.plan(layer), "shared_group": False})
        monkeypatch.setitem(targets.TARGETS, "c", alone)
    emit_module._ENVS.clear()
    try:
        files = emit_module.emit(derivgen.derive(parse_spec(SPEC, source="walks.toml")), ("c",)).files
    finally:
        monkeypatch.undo()
        emit_module._ENVS.clear()
    k = _compiled(files, where, tag)

    def run(dtype, threads, shape=(29, 4, 3, 5)):
        x, gamma, dy = _data(dtype, shape)
        k.set_num_threads(threads)
        y, cache = k.forward(x, gamma)
        g = k.backward(dy, cache)
        return [y, g.dx, g.dgamma]

    return files["c/walks.c"], run


def test_walking_together_keeps_every_bit(monkeypatch, tmp_path):
    fused_src, fused = _run(monkeypatch, tmp_path, "fused")
    alone_src, alone = _run(monkeypatch, tmp_path, "alone", fused=False)
    assert "one walk, 2 block means" in fused_src and "one walk" not in alone_src
    for dtype in (np.float32, np.float64):
        a, b = fused(dtype, 2), alone(dtype, 2)
        for u, v in zip(a, b):
            assert np.array_equal(u, v)
        assert np.isfinite(a[0]).all()


def test_one_group_shared_by_the_threads_keeps_the_bits_of_one(monkeypatch, tmp_path):
    """reduce = "all": every thread walks its share of the one group's samples; the block
    means and the group sums are the bits of one thread's walk on any thread count."""
    alone_src, alone = _run(monkeypatch, tmp_path, "one", shared=False)
    shared_src, shared = _run(monkeypatch, tmp_path, "shared")
    assert "B_lo" not in alone_src and "Dg_share(Blocks, &B_lo, &B_hi)" in shared_src
    for dtype in (np.float32, np.float64):
        one = alone(dtype, 1)
        for threads in (1, 2, 3):
            got = shared(dtype, threads)
            assert np.array_equal(got[0], one[0]) and np.array_equal(got[1], one[1])
            # the parameter gradients: each thread's runs summed apart, added in thread order
            np.testing.assert_allclose(got[2], one[2], rtol=1e-6 if dtype == np.float32 else 1e-13)
