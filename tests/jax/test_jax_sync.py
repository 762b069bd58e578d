"""axis_name: batch statistics made collective (a psum of the split reductions) on 4 CPU
devices, under shard_map and pmap, against the whole batch on one device and against
flax.linen.BatchNorm(axis_name=...); a per-sample layer under shard_map needs none."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, require_module

require_module("jax")
require_module("flax")


def test_collective_batch_statistics_on_four_devices():
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "jax_sync_driver.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out.pop("devices") == 4
    assert set(out) == {
        "shard_map_y",
        "shard_map_buffers",
        "shard_map_grads",
        "shard_map_jvp",
        "pmap_y",
        "pmap_grad_x",
        "flax_y",
        "flax_grads",
        "flax_vs_whole_y",
        "layernorm_shard_map_grad",
    }
    bad = {k: v for k, v in out.items() if not v < 1e-12}
    assert not bad, bad
