"""Collective batch statistics in derivgen.jax (``axis_name``), on 4 CPU devices: run by
tests/jax/test_jax_sync.py in a process of its own (XLA_FLAGS must be set before JAX starts).
Prints one JSON object of largest differences."""

from __future__ import annotations

import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax

jax.config.update("jax_enable_x64", True)
import flax.linen as fnn
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import derivgen.jax as dj


def err(a, b):
    return max(
        float(jnp.max(jnp.abs(jnp.asarray(u) - jnp.asarray(v))))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def main():
    out = {"devices": len(jax.devices())}
    mesh = Mesh(np.array(jax.devices()), ("b",))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0.4, 1.3, (8, 3, 5)))  # (N, C, L): 2 samples per device
    g, b = jnp.asarray(rng.normal(1, 0.2, 3)), jnp.asarray(rng.normal(0, 0.2, 3))
    rm, rv = jnp.asarray(rng.normal(size=3)), jnp.asarray(rng.uniform(0.5, 2, 3))
    w = jnp.asarray(rng.normal(size=x.shape))
    bn = dj.function("batchnorm")

    def loss(y):
        return jnp.sum(jnp.sin(y) * w)

    # the whole batch on one device: the reference
    def whole(x, g, b):
        y, new = bn(x, g, b, running_mean=rm, running_var=rv)
        return y, new

    y0, new0 = whole(x, g, b)
    grads0 = jax.grad(lambda x, g, b: loss(whole(x, g, b)[0]), (0, 1, 2))(x, g, b)
    t = tuple(jnp.asarray(rng.normal(size=a.shape)) for a in (x, g, b))
    ty0 = jax.jvp(lambda x, g, b: whole(x, g, b)[0], (x, g, b), t)[1]

    # shard_map: the batch split over the devices, statistics collective
    def part(x, g, b, w):
        y, new = bn(x, g, b, running_mean=rm, running_var=rv, axis_name="b")
        return y, new

    smap = jax.shard_map(part, mesh=mesh, in_specs=(P("b"), P(), P(), P("b")), out_specs=(P("b"), P()))
    y1, new1 = jax.jit(smap)(x, g, b, w)
    out["shard_map_y"] = err(y1, y0)
    out["shard_map_buffers"] = err(new1, new0)

    def part_loss(x, g, b, w):
        y, _ = part(x, g, b, w)
        return jax.lax.psum(jnp.sum(jnp.sin(y) * w), "b")

    gsmap = jax.shard_map(
        jax.grad(part_loss, (0, 1, 2)), mesh=mesh, in_specs=(P("b"), P(), P(), P("b")), out_specs=(P("b"), P(), P())
    )
    grads1 = jax.jit(gsmap)(x, g, b, w)
    out["shard_map_grads"] = err(grads1, grads0)

    def part_jvp(x, g, b, tx, tg, tb):
        return jax.jvp(lambda x, g, b: part(x, g, b, None)[0], (x, g, b), (tx, tg, tb))[1]

    jsmap = jax.shard_map(part_jvp, mesh=mesh, in_specs=(P("b"), P(), P(), P("b"), P(), P()), out_specs=P("b"))
    out["shard_map_jvp"] = err(jax.jit(jsmap)(x, g, b, *t), ty0)

    # pmap: one shard per device
    xs, ws = x.reshape(4, 2, 3, 5), w.reshape(4, 2, 3, 5)
    yp = jax.pmap(lambda x: bn(x, g, b, axis_name="b"), axis_name="b")(xs)
    out["pmap_y"] = err(yp.reshape(x.shape), y0)
    # (under pmap each device differentiates its own part of the loss; the statistics' psum
    # transposes to a psum, which brings the other parts' terms: flax's convention)
    gp = jax.pmap(jax.grad(lambda x, w: jnp.sum(jnp.sin(bn(x, g, b, axis_name="b")) * w)), axis_name="b")(xs, ws)
    out["pmap_grad_x"] = err(gp.reshape(x.shape), grads0[0])

    # flax.linen.BatchNorm(axis_name=...) under shard_map, channels last (Flax's order)
    xl, wl = jnp.moveaxis(x, 1, -1), jnp.moveaxis(w, 1, -1)
    fbn = fnn.BatchNorm(use_running_average=False, axis_name="b", use_fast_variance=False, epsilon=1e-5)
    variables = {"params": {"scale": g, "bias": b}, "batch_stats": {"mean": rm, "var": rv}}

    def flax_loss(x, scale, bias, w):
        y, _ = fbn.apply({**variables, "params": {"scale": scale, "bias": bias}}, x, mutable=["batch_stats"])
        return jax.lax.psum(jnp.sum(jnp.sin(y) * w), "b"), y

    def ours_loss(x, scale, bias, w):
        y = bn(x, scale, bias, axis_name="b", channels_last=True)
        return jax.lax.psum(jnp.sum(jnp.sin(y) * w), "b"), y

    def both(x, g, b, w):
        r = []
        for f in (flax_loss, ours_loss):
            (_, y), grads = jax.value_and_grad(f, (0, 1, 2), has_aux=True)(x, g, b, w)
            r.append((y, grads))
        return r

    fsmap = jax.shard_map(
        both, mesh=mesh, in_specs=(P("b"), P(), P(), P("b")), out_specs=[(P("b"), (P("b"), P(), P()))] * 2
    )
    (yf, gf), (yo, go) = jax.jit(fsmap)(xl, g, b, wl)
    out["flax_y"] = err(yo, yf)
    out["flax_grads"] = err(go, gf)
    out["flax_vs_whole_y"] = err(yf, jnp.moveaxis(y0, 1, -1))

    # a per-sample layout needs no axis_name: every device holds whole rows
    ln = dj.function("layernorm")
    xr = jnp.asarray(rng.normal(size=(8, 6)))
    gr, br = jnp.ones(6) * 1.1, jnp.zeros(6) + 0.1
    lsmap = jax.shard_map(jax.grad(lambda x: jnp.sum(ln(x, gr, br) ** 3)), mesh=mesh, in_specs=P("b"), out_specs=P("b"))
    out["layernorm_shard_map_grad"] = err(jax.jit(lsmap)(xr), jax.grad(lambda x: jnp.sum(ln(x, gr, br) ** 3))(xr))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
