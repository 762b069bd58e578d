"""The Triton kernels beyond the catalogue, under Triton's interpreter: the examples/ specs,
the zoo and a slice of the spec fuzzer's, against the NumPy backend in float64 (one tile
per group, and swept in tiles); and the CUDA implementation of the derivgen:: operators
(derivgen.triton.ops) called directly on CPU tensors."""

from __future__ import annotations

import pytest
from conftest import ROOT, assert_refuses_blocks, block_layer, fuzz_corpus, require_module, spec_file_corpus

torch = require_module("torch")
require_module("triton")
import specfuzz
import triton_cases as tc

import derivgen
from derivgen.spec import load_spec_file, parse_spec
from derivgen.torch.schema import mode_schemas
from derivgen.triton import ops
from derivgen.triton.launch import tile_limit

EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
# the layers with tensor inputs or outputs beside y: tests/triton/test_triton_multi.py
ZOO = [p for p in sorted((ROOT / "derivgen" / "spec" / "zoo").glob("*.toml")) if not load_spec_file(p).multi]
# every layout kind, scalar parameters, per-group inputs, buffers with eval modes; maximum,
# stop_gradient, clip, sigmoid, erf, minimum, a group minimum and a group maximum
# 37 and 58: a group minimum of a channel layout
FUZZ_SEEDS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 27, 37, 38, 58, 67, 70, 80]


def _check(spec, tol=1e-5):
    for tile in (4096, 16):
        with tile_limit(tile):
            for case in tc.cases(spec):
                tc.compare(spec, case, torch.float32, tol)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples(path):
    _check(load_spec_file(path))


# make test: the zoo's layers that together have every feature of the zoo (the zoo's own tests
# run every layer on NumPy, C and PyTorch)
@pytest.mark.parametrize("path", spec_file_corpus(ZOO))
def test_zoo(path):
    spec = load_spec_file(path)
    if block_layer(spec):
        assert_refuses_blocks(spec, "triton")
        return
    _check(spec)


@pytest.mark.parametrize("seed", fuzz_corpus(FUZZ_SEEDS))
def test_fuzzed_specs(seed):
    spec = parse_spec(specfuzz.generate(seed), source=f"fuzz{seed}.toml")
    _check(spec, tol=2e-5)


@pytest.mark.parametrize("name", ["layernorm", "batchnorm", "groupnorm"])
def test_operator_implementations(name):
    """What the CUDA dispatch key runs, on CPU tensors (interpreted), against the NumPy backend."""
    spec = derivgen.load_spec(name)
    meta = derivgen.load(spec, "triton").META
    for case in tc.cases(spec):
        x, dy, params, kw = tc.inputs(spec, case)
        s = mode_schemas(meta, case.mode)
        a = {"x": torch.tensor(x, dtype=torch.float32), "num_groups": kw.get("num_groups", 0)}
        a.update({p.name: torch.tensor(v, dtype=torch.float32) for p, v in zip(spec.params, params)})
        a.update({o.name: kw.get(o.name, o.default) for o in spec.options})
        a.update({b.name: torch.tensor(kw[b.name], dtype=torch.float32) for b in spec.buffers})
        fwd = ops.forward_impl(spec, case.mode, [arg.spec for arg in s.forward], None)
        y, *stats = fwd(*(a[arg.spec] for arg in s.forward))
        assert all(t.dtype == torch.float64 for t in stats)
        a.update(dict(zip(meta["stats"][case.mode], stats)))
        a["dy"] = torch.tensor(dy, dtype=torch.float32)
        bwd = ops.backward_impl(spec, case.mode, [arg.spec for arg in s.backward], None)
        got = bwd(*(a[arg.spec] for arg in s.backward))
        ref_kw = {k: v for k, v in kw.items() if k != "training" or "eval" in meta["modes"]}
        ry, rgrads, _ = tc.reference(
            spec, x, dy, params, {k: v.copy() if hasattr(v, "copy") else v for k, v in ref_kw.items()}
        )
        assert tc.relerr(y, ry) < 1e-5
        for g, r in zip(got, rgrads):
            assert tc.relerr(g, r) < 1e-5


def test_operators_have_a_cuda_kernel():
    """derivgen.torch registers the Triton kernels for the CUDA key of the forward and backward."""
    from derivgen.torch.ops import layer

    lay = layer(derivgen.load_spec("rmsnorm"))
    ops_ = lay.modes["train"]
    for op in (ops_.forward, ops_.backward):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA")
    for op in (ops_.bb, ops_.jvp):  # the second order keeps the PyTorch closed forms
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA")
