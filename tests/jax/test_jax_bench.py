"""``derivgen bench --jax`` on small shapes: every implementation timed, the ratios to Flax."""

from __future__ import annotations

import json

from click.testing import CliRunner
from conftest import require_module

require_module("jax")
require_module("flax")

import derivgen.tools.bench_jax as jb
from derivgen.cli import cli


def test_bench_jax_cli(monkeypatch, tmp_path):
    monkeypatch.setattr(jb, "CASES", [("LayerNorm", "layernorm", (64, 32)), ("BatchNorm", "batchnorm", (4, 3, 3, 8))])
    out = tmp_path / "jax.json"
    r = CliRunner().invoke(cli, ["bench", "--jax", "--repeat", "3", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(x["layer"], x["impl"]) for x in rows] == [
        (layer, impl)
        for layer in ("LayerNorm", "BatchNorm")
        for impl in ("derivgen.jax (transposed JVP)", "derivgen.jax rule=vjp (derived VJP)", "flax.nnx")
    ]
    assert all(x["step_ms"] > 0 for x in rows)
    assert all(abs(x["vs_flax"] - x["step_ms"] / rows[3 * (k // 3) + 2]["step_ms"]) < 1e-12 for k, x in enumerate(rows))
    assert "x flax" in r.output and report["machine"]["cpu"] in r.output
    bad = CliRunner().invoke(cli, ["bench", "--jax", "--torch"])
    assert bad.exit_code != 0 and "--jax benches its own fixed cases" in bad.output
