"""The spec fuzzer: random valid specs, written the way users write them, through
the whole pipeline.

``generate(seed)`` writes one spec (TOML text) from a seeded generator: every
layout (trailing over one or two axes; channels over the batch, one instance,
a channel group, or the channels at one position), statistics composed from mean()/sum() of polynomials in x
and earlier statistics (centred or not, biased or unbiased, absolute
deviations, fourth moments), square roots, fractional powers, abs, exp, log
and tanh where their domain holds, eps inside or outside a root, statistics
mixed with per-group inputs (online moments), scalar and per-channel
parameters entering the output in any elementwise way and entering the
statistics (a learnable eps, a per-feature weight inside a mean, a learnable
mixing coefficient), options (required or with defaults), buffers with an eval
mode, with or without a normalized coordinate, and any valid identifier --
single letters, ``_t`` suffixes, and the names derivgen's own generated code
uses for its locals. Seeds from :data:`BLOCK_SEEDS` add block statistics; seeds from
:data:`SHAPE_SEEDS` a Taylor softmax, a per-row scale or a mixture of two kinds'
normalizations (:func:`_shapes`); seeds from :data:`TENSOR_SEEDS` tensor inputs beside x, a
core value the statistics read, masked statistics and outputs beside y (:func:`_tensors`).

``run(text)`` parses, derives, proves at N = 2, 3, generates NumPy and C,
compiles the C (a compiler warning fails the spec, as ``-Werror`` would), and checks both
backends in float32 and float64 against float64 finite differences and each
other (:func:`derivgen.tools.check.check_layer`); a channel layout's channels-last
kernels must give its NCHW kernels' bits (:func:`channels_last_mismatches`). It also
judges the backward's run-time means of ∂L/∂y by kind against the fewest any backward
needs (:func:`reduction_minimum`, :func:`brute_force_minimum`); :func:`run_means` does
only that. A layer with tensor inputs, values or outputs beside y goes through
:func:`run_tensors` instead: NumPy and C against PyTorch autograd of the spec's forward written
from its fields (:func:`_torch_tensors`), finite differences and each other.

    python tests/specfuzz.py --seeds 0-1999 --jobs 2      # the larger corpus (make fuzz)
    python tests/specfuzz.py --seed 17 --show             # one spec, printed
    python tests/specfuzz.py --seeds 200000-200199 --means-only   # the run-time means only
    python tests/specfuzz.py --seeds 300000-300199 --jobs 2      # the tensor family
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import math
import os
import random
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository (for worker processes)

# identifiers users write, and the ones derivgen's generated code uses for itself
TRICKY = """
s m b c k n o t a e z u v w p q r i j l f h base part mine pend idx grp off nxt lane tile head acc
tmp np rt call stats chunk meta cache self cls sp mean sum var std rstd mu_t sigma_t s_t x_t m_t
mean_g mean_g_xhat sum_mean k_xhat k_1 cse0 h0 h0_hi gamma_v xv dyv nthreads nth total blocks ahead
mean_out mean_in prev_in prev_stride alpha beta gamma eps delta tau rho forward backward grads none
true false lanes block_stride n_groups t_y y_r dg_lanes aux1 g_t y_t dx_t mu sigma theta ms rms scale
shift weight bias momentum running_mean stat1 stat_2 a_b a_b_c
""".split()  # noqa: SIM905 - a word list, kept as text to read and edit


class Names:
    """Unique, valid, non-colliding identifiers (gradients are d<name>)."""

    def __init__(self, rng: random.Random):
        from derivgen.spec.model import reserved_reason

        self.rng, self.taken, self._bad = rng, set(), reserved_reason

    def ok(self, n: str) -> bool:
        return (
            self._bad(n) is None
            and n not in self.taken
            and "d" + n not in self.taken
            and not (n.startswith("d") and n[1:] in self.taken)
        )

    def new(self, *prefer: str) -> str:
        pool = [p for p in prefer if self.ok(p)]
        if pool and self.rng.random() < 0.5:
            name = self.rng.choice(pool)
        elif self.rng.random() < 0.7:
            name = self.rng.choice(TRICKY)
        else:
            name = self.rng.choice("abcdefghijklmnopqrstuvwxyz") + "".join(
                self.rng.choice("abcdefghijklmnopqrstuvwxyz0123456789_") for _ in range(self.rng.randint(0, 8))
            )
        if not self.ok(name):
            return self.new(*prefer)
        self.taken.add(name)
        return name


@dataclass
class _Spec:
    rng: random.Random
    names: Names
    layout: dict = field(default_factory=dict)
    params: list = field(default_factory=list)  # (name, fields)
    options: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    stats: list = field(default_factory=list)  # (name, expr)
    eval_stats: list = field(default_factory=list)
    normalized: tuple | None = None
    output: str = ""
    min_group: int = 1
    tensors: list = field(default_factory=list)  # (name, fields): tensor inputs beside x
    values: list = field(default_factory=list)  # (name, expr): element values before the statistics
    outputs: list = field(default_factory=list)  # (name, expr): outputs beside y

    def toml(self, name: str) -> str:
        def tbl(items):
            return "\n".join(f"{k} = {v}" for k, v in items)

        out = [f'name = "{name}"', 'title = "Fuzzed layer"', "[layout]", tbl(self.layout.items())]
        for head, items in (
            ("params", self.params),
            ("options", self.options),
            ("inputs", self.inputs),
            ("tensors", self.tensors),
            ("buffers", self.buffers),
        ):
            if items:
                out += [f"[{head}]", tbl(items)]
        if self.values:
            out += ["[values]", tbl((k, f'"{v}"') for k, v in self.values)]
        if self.stats:
            out += ["[statistics]", tbl((k, f'"{v}"') for k, v in self.stats)]
        if self.min_group > 1:
            out += ["[modes.train]", f"min_group_size = {self.min_group}"]
        if self.eval_stats:
            out += ["[modes.eval.statistics]", tbl((k, f'"{v}"') for k, v in self.eval_stats)]
        if self.normalized:
            out += ["[normalized]", f'name = "{self.normalized[0]}"', f'expr = "{self.normalized[1]}"']
        out += ["[output]", f'y = "{self.output}"', *(f'{k} = "{v}"' for k, v in self.outputs)]
        return "\n".join(out) + "\n"


def generate(seed: int, name_coordinate: bool | None = None) -> str:
    """One random valid spec (TOML text). ``name_coordinate`` forces the normalized
    coordinate to be named in [normalized] (True) or written inline in the output (False);
    every random draw is the same either way, so the two specs are the same layer."""
    rng = random.Random(seed)
    names = Names(rng)
    s = _Spec(rng, names)
    kind = rng.choice(["trailing", "trailing", "trailing2", "batch", "instance", "group"])
    if kind == "instance" and seed % 2 == 0:  # groups within a sample: a channel, or a position's channels
        kind = "position"  # (chosen by the seed alone, so every other draw is as it was)
    tensors = seed >= TENSOR_SEEDS  # the tensor family: tensor inputs, values, outputs beside y
    shapes = SHAPE_SEEDS <= seed < TENSOR_SEEDS  # the shape family: every other seed in a layout with blocks
    blocks = seed >= BLOCK_SEEDS and not tensors and (not shapes or seed % 2 == 1)
    if blocks:  # the block family: a layout whose groups hold blocks (seed alone again)
        kind = ("batch", "group", "all")[seed % 3]
    if kind == "trailing2":
        s.layout = {"kind": '"trailing"', "axes": "2"}
    elif kind == "trailing":
        s.layout = {"kind": '"trailing"'}
    else:
        s.layout = {"kind": '"channels"', "reduce": f'"{kind}"'}
    channel_ok = kind != "trailing2"  # a trailing layout over 2 axes: no per-feature parameter

    # options
    eps = names.new("eps", "delta", "e")
    eps_min = rng.choice(["0", "1e-8"])
    s.options.append((eps, f"{{ default = {rng.choice(['1e-5', '1e-3', '0.01', '0.1'])}, min = {eps_min} }}"))
    mix = None
    if rng.random() < 0.25:
        mix = names.new("alpha", "tau", "rho")
        s.options.append((mix, "{ min = 0, max = 1 }" if rng.random() < 0.5 else "{ default = 0.3, min = 0, max = 1 }"))

    # parameters: a scale and a shift per channel (or scalar), extra scalars, some in the statistics
    gamma = beta = t = None
    if rng.random() < 0.85:
        gamma = names.new("gamma", "weight", "scale", "g_t")
        s.params.append(
            (
                gamma,
                '{ shape = "scalar", init = 1.0 }' if not channel_ok or rng.random() < 0.2 else '{ role = "scale" }',
            )
        )
    if rng.random() < 0.6:
        beta = names.new("beta", "bias", "shift")
        s.params.append(
            (
                beta,
                '{ role = "shift", shape = "scalar" }'
                if not channel_ok or rng.random() < 0.2
                else '{ role = "shift" }',
            )
        )
    if rng.random() < 0.35:
        t = names.new("t", "theta", "s")
        s.params.append((t, f'{{ shape = "scalar", init = {rng.choice(["0.5", "1.0", "0.1"])} }}'))
    w = None  # a per-channel weight inside a mean
    if channel_ok and rng.random() < 0.15:
        w = names.new("w", "weight")
        s.params.append((w, "{ init = 1.0 }"))
    ep = None  # a learnable eps (scalar, enters as ep**2)
    if rng.random() < 0.12:
        ep = names.new("ep", "eps_p", "e")
        s.params.append((ep, '{ shape = "scalar", init = 0.1 }'))
    lmix = None  # a learnable mixing coefficient
    if rng.random() < 0.08:
        lmix = names.new("lam", "alpha_p")
        s.params.append((lmix, '{ shape = "scalar", init = 0.5 }'))

    # per-group inputs (previous moments)
    prev_m = prev_s = None
    if rng.random() < 0.25:
        prev_m = names.new("prev_mean", "mu_prev", "m_t")
        s.inputs.append((prev_m, "{}"))
        if rng.random() < 0.6:
            prev_s = names.new("prev_std", "sigma_prev", "s_t")
            s.inputs.append((prev_s, "{}"))

    def eps_term():
        return f"{ep}**2 + {eps}" if ep else eps

    def stat(expr, *prefer):
        n = names.new(*prefer)
        s.stats.append((n, expr))
        return n

    # ---- statistics
    c = None
    centre = rng.random()
    if centre < 0.7:
        src = rng.choice(["mean(x)", "sum(x)/N", f"mean({w}*x)" if w else "mean(x)"])
        if prev_m and rng.random() < 0.6:
            a = mix or lmix or "0.5"
            raw = stat(src, "row_mean", "xbar", "m")
            c = stat(f"{a}*{raw} + (1 - {a})*{prev_m}", "mu_t", "mean", "mu")
        else:
            c = stat(src, "mean", "mu", "m")
    dev = f"(x - {c})" if c else "x"
    spread = rng.choice(["var", "var", "unbiased", "sumsq", "abs", "fourth", "msq"])
    if spread == "var":
        v = f"mean({dev}**2)"
    elif spread == "unbiased":
        v = f"sum({dev}**2)/(N - 1)"
        s.min_group = 2
    elif spread == "sumsq":
        v = f"sum({dev}**2)"
    elif spread == "abs":
        v = f"mean(abs({dev}))"
    elif spread == "fourth":
        v = f"sqrt(mean({dev}**4))"
    else:
        v = f"mean({dev}**2)*0.5 + mean(x**2)*0.5" if c else "mean(x**2)"
    if w and rng.random() < 0.5:
        v = f"mean(exp({w})*{dev}**2)"
    inline = rng.random() < 0.35
    vname = v if inline else stat(v, "var", "v", "sigma2", "ms")
    vv = f"({vname})" if inline else vname
    form = rng.choice(["rsqrt", "sqrt_in", "sqrt_out", "pow", "log", "plain", "cbrt"])
    divide = False
    if form == "rsqrt":
        r = f"1/sqrt({vv} + {eps_term()})"
    elif form == "sqrt_in":
        r, divide = f"sqrt({vv} + {eps_term()})", True
    elif form == "sqrt_out":
        r, divide = f"sqrt({vv}) + {eps_term()}", True
    elif form == "pow":
        r = f"({vv} + {eps_term()})**{rng.choice(['(-0.5)', '(-0.25)', '(-1.5)', '(-1)'])}"
    elif form == "log":
        r, divide = f"exp(0.5*log({vv} + {eps_term()}))", True
    elif form == "cbrt":
        r, divide = f"({vv} + {eps_term()})**(1/3)", True
    else:
        r, divide = f"{vv} + {eps_term()} + 1", True
    if prev_s and divide and rng.random() < 0.7:
        a = mix or lmix or "0.5"
        own = stat(r, "sample_std", "s", "sd")
        r = f"{a}*{own} + (1 - {a})*{prev_s}"
    rname = stat(r, "rstd", "sigma_t", "sd", "r", "sigma")
    if rng.random() < 0.15:  # an extra statistic the output uses
        extra = stat(
            rng.choice([f"exp(-{rname}**2)", f"tanh({rname})", "abs(mean(x)) + 1", "log(1 + mean(x**2))"]),
            "k",
            "aux1",
            "z",
        )
    else:
        extra = None
    xh = f"{dev}/{rname}" if divide else f"{dev}*{rname}"

    # buffers and an eval mode (running moments, as batch norm)
    if c and c in dict(s.stats) and rng.random() < 0.2:
        mom = names.new("momentum", "m_t")
        s.options.append((mom, "{ default = 0.1, min = 0, max = 1 }"))
        buf = names.new("running_mean", "rm", "b")
        s.buffers.append((buf, f'{{ init = 0, update = "(1 - {mom})*{buf} + {mom}*{c}" }}'))
        if rng.random() < 0.6:
            s.eval_stats.append((c, buf))

    # ---- normalized coordinate and output
    named = rng.random() < 0.75
    if named:
        nname = names.new("xhat", "z", "n", "u")
    elif name_coordinate:  # a name without a random draw: the rest stays the same
        nname = next(n for n in ("xhat", "z", "n", "u", "xhat_0", "xhat_1") if names.ok(n))
        names.taken.add(nname)
    if name_coordinate is not None:
        named = name_coordinate
    if named:
        s.normalized = (nname, xh)
        z = nname
    else:
        z = f"({xh})"
    g = gamma or "1"
    terms = [
        rng.choice(
            [
                f"{g}*{z}",
                f"{g}*tanh({z})",
                f"{z}*{g}",
                f"{g}*{z}**2 + {z}",
                f"{g}*sqrt({z}**2 + 1)",
                f"{g}*abs({z})",
                f"{g}*{z}*exp(-{z}**2/4)",
            ]
        )
    ]
    if beta:
        terms.append(beta)
    if t:
        terms.append(rng.choice([f"{t}*x", f"{t}*{z}", f"exp({t})*{z}"]))
    if extra:
        terms.append(f"{extra}*{z}")
    if prev_m and rng.random() < 0.3:
        terms.append(f"0.1*{prev_m}*{z}")
    _selections_and_friends(random.Random(seed * 7919 + 17), s, names, kind, z, terms, extremes=not tensors)
    if not tensors:  # leading() and window() read x itself, which a core value takes over
        _leading_masks(random.Random(seed * 104729 + 31), s, names, kind, z, xh, terms, eps)
        _windows(random.Random(seed * 15485863 + 47), s, names, kind, z, terms)
    if blocks and not shapes:
        _blocks(random.Random(seed * 32452843 + 59), s, names, kind, terms, eps, c)
    if shapes:
        _shapes(random.Random(seed * 49979687 + 61), s, names, kind, z, terms, eps, gamma, blocks)
    if tensors:
        _tensors(random.Random(seed * 67867967 + 71), s, names, kind, z, terms, channel_ok)
    s.output = " + ".join(terms)
    return s.toml(f"fuzz{seed}")


def _selections_and_friends(
    rng: random.Random, s: _Spec, names: Names, kind: str, z: str, terms: list[str], extremes: bool = True
) -> None:
    """The language's selections (maximum, minimum, clip, group max/min), sigmoid, erf,
    stop_gradient and pi, drawn from a generator of their own so that every earlier draw
    (and so every spec the corpus had before them) stays as it was."""
    u = rng.random()
    if u < 0.08:
        terms[0] = f"maximum({terms[0]}, {rng.choice(['0', '-0.5', z + '/2'])})"
    elif u < 0.14:
        terms[0] = f"minimum({terms[0]}, {rng.choice(['1', '0.5', '-' + z])})"
    elif u < 0.2:
        terms[0] = f"clip({terms[0]}, -{rng.choice(['1', '2'])}, {rng.choice(['1', '1.5'])})"
    u = rng.random()
    if u < 0.08:
        terms.append(f"{rng.choice(['0.5', '2'])}*sigmoid({z})")
    elif u < 0.14:
        terms.append(f"erf({z}/sqrt(2))*{rng.choice(['1', 'sqrt(pi)/2'])}")
    elif u < 0.2:
        terms[0] = f"({terms[0]})*(1 - stop_gradient({rng.choice(['0.1', '0.3'])}*{z}))"
    if extremes and rng.random() < 0.12:  # a group maximum or minimum (any layout; not the tensor family)
        op = rng.choice(["max", "min"])
        mx = names.new("mx", "peak", "m_max")
        if op == "max":
            s.stats.append((mx, "max(abs(x)) + 1"))
        else:
            s.stats.append((mx, "min(x**2) + 1"))
        terms.append(f"x/{mx}")


def _leading_masks(
    rng: random.Random, s: _Spec, names: Names, kind: str, z: str, xh: str, terms: list[str], eps: str
) -> None:
    """``leading(q)`` in trailing layouts: a mean over the leading slice (a statistic the
    output divides by), or the mask as an element value of the output; from a generator of
    its own (earlier draws stay as they were). ``z`` is the coordinate as the output names
    it, ``xh`` as a statistic may write it."""
    if not kind.startswith("trailing") or rng.random() >= 0.12:
        return
    q = names.new("q", "frac", "p_lead")
    s.options.append((q, f"{{ default = {rng.choice(['0.5', '0.25', '0.75'])}, min = 0, max = 1 }}"))
    u = rng.random()
    if u < 0.45:
        e = rng.choice(["x**2", "abs(x)", f"({xh})**2"])
        ms = names.new("ms_lead", "nu_q", "part")
        s.stats.append((ms, f"mean(leading({q})*{e})/mean(leading({q}))"))
        terms.append(f"x/sqrt({ms} + {eps} + 1)")
    elif u < 0.75:
        terms[0] = f"({terms[0]})*(1 + leading({q}))"
    else:
        ms = names.new("ms_lead", "nu_q", "part")
        s.stats.append((ms, f"sum(leading({q})*x)/N"))
        terms.append(f"{ms}*leading({q})*{z}")


def _windows(rng: random.Random, s: _Spec, names: Names, kind: str, z: str, terms: list[str]) -> None:
    """``window(e, k)`` along a trailing layout's features or a position's channels: a
    divisor of the output (local response normalization), or a term of it; k an integer
    option or a literal, even or odd. From a generator of its own (earlier draws stay)."""
    if not (kind.startswith("trailing") or kind == "position") or rng.random() >= 0.12:
        return
    if rng.random() < 0.6:
        k = names.new("size", "width", "span")
        s.options.append((k, f"{{ default = {rng.choice(['2', '3', '5'])}, min = 1, integer = true }}"))
    else:
        k = rng.choice(["2", "3", "4"])
    e = rng.choice(["x**2", "abs(x)", "tanh(x)", "x"])
    u = rng.random()
    if u < 0.5:
        terms[0] = (
            f"({terms[0]})/(1 + {rng.choice(['0.5', '0.1'])}*window({e}, {k})/{k})**{rng.choice(['0.75', '0.5'])}"
        )
    elif u < 0.8:
        terms.append(f"0.1*window({e}, {k})")
    else:
        terms.append(f"{z}*exp(-window({e}, {k})**2/{k})")


# seeds from here on draw the block family: every spec has block statistics (mean(e, kind))
BLOCK_SEEDS = 100_000


def _blocks(rng: random.Random, s: _Spec, names: Names, kind: str, terms: list[str], eps: str, c: str | None) -> None:
    """Block statistics (the block family's seeds only): a block's mean and two-pass variance
    dividing a term, a block mean of a function of x, a block mean of x less a group
    statistic, or (the ``all`` layout) a mixture of two kinds' means; one or two of them."""
    kinds = ["instance", "sample", "batch"] if kind == "all" else ["instance"]
    for _ in range(rng.choice([1, 1, 2])):
        k = rng.choice(kinds)
        u = rng.random()
        bm = names.new("bmean", "m_in", "mu_b")
        if u < 0.4:
            s.stats.append((bm, f"mean(x, '{k}')"))
            bv = names.new("bvar", "v_in", "s2_b")
            s.stats.append((bv, f"mean((x - {bm})**2, '{k}')"))
            terms.append(f"{rng.choice(['0.5', '1'])}*(x - {bm})/sqrt({bv} + {eps} + 0.1)")
        elif u < 0.6:
            e = rng.choice(["x**2", "abs(x)", "tanh(x)", "exp(-x**2)"])
            s.stats.append((bm, f"mean({e}, '{k}')"))
            terms.append(f"x/(1 + {bm})")
        elif u < 0.8 and c is not None:
            s.stats.append((bm, f"mean((x - {c})**2, '{k}')"))  # a group statistic inside a block mean
            terms.append(f"0.3*x*exp(-{bm})")
        else:
            k2 = rng.choice(kinds)
            s.stats.append((bm, f"mean(x, '{k}')"))
            b2 = names.new("bmean2", "m_ln", "mu_c")
            s.stats.append((b2, f"mean(x, '{k2}')"))
            mix = names.new("bmix", "mu_mix", "m_x")
            s.stats.append((mix, f"0.7*{bm} + 0.3*{b2}"))
            terms.append(f"maximum(x - {mix}, -0.5)")


# seeds from here on draw the shape family: every spec has one of the shapes whose fewest
# run-time means the fuzzer judges (:func:`reduction_minimum`), every other one in a layout
# with blocks
SHAPE_SEEDS = 200_000


def _shapes(
    rng: random.Random,
    s: _Spec,
    names: Names,
    kind: str,
    z: str,
    terms: list[str],
    eps: str,
    gamma: str | None,
    blocks: bool,
) -> None:
    """The shape family's seeds: the ordinary draws (or, in a layout with blocks, the block
    family's layout without its block statistics) and, from a generator of their own, a
    polynomial of x in the output, a per-row scale, or both; with blocks a mixture of two
    kinds' normalizations, and now and then one of the others too."""
    if blocks:
        _block_mixture(rng, s, names, kind, terms, eps, gamma)
    u = rng.random()
    poly, row = u < 0.6, u >= 0.4
    if blocks and rng.random() >= 0.25:
        poly = row = False
    if poly:
        _polynomial(rng, s, names, terms, gamma)
    if row:
        _row_scale(rng, s, names, z, terms)


def _polynomial(rng: random.Random, s: _Spec, names: Names, terms: list[str], gamma: str | None) -> None:
    """A polynomial of x in the output: over its group sum or mean (Taylor softmax,
    (1 + x + x²/2)/Σ(1 + x + x²/2), and its kin: even-degree Taylor polynomials of exp and
    other polynomials positive everywhere), or alone, or times the last statistic."""
    poly = rng.choice(["1 + x + x**2/2", "1 + x + x**2/2 + x**3/6 + x**4/24", "2 + x + x**2", "1 + x**2/2"])
    if rng.random() < 0.7:
        total = names.new("tsum", "zsum", "s_t", "total")
        s.stats.append((total, rng.choice([f"sum({poly})", f"mean({poly})"])))
        terms.append(f"{gamma}*({poly})/{total}" if gamma and rng.random() < 0.5 else f"({poly})/{total}")
    elif s.stats and rng.random() < 0.5:
        terms.append(f"0.1*({poly})*{s.stats[-1][0]}")
    else:
        terms.append(f"0.1*({poly})")


def _row_scale(rng: random.Random, s: _Spec, names: Names, z: str, terms: list[str]) -> None:
    """A per-row value ([inputs]) scaling the output: all of it (a norm with a per-row scale,
    as an RMS norm's k·γ·x·ρ), or x, or the normalized value in a term of its own."""
    k = names.new("row_scale", "k_t", "s_row", "scale_t")
    s.inputs.append((k, "{}"))
    u = rng.random()
    if u < 0.5:
        terms[:] = [f"{k}*({' + '.join(terms)})"]
    elif u < 0.75:
        terms.append(f"{rng.choice(['0.5*', ''])}{k}*x")
    else:
        terms.append(f"{k}*{z}")


def _block_mixture(
    rng: random.Random, s: _Spec, names: Names, kind: str, terms: list[str], eps: str, gamma: str | None
) -> None:
    """A mixture of two kinds' normalizations: each kind's mean and two-pass variance -- the
    group's (mean(x)) or a block's (mean(x, kind)) -- mixed by a weight ρ and 1 - ρ (an
    option, a learnable scalar or a number), either the normalized values (ρ·IN + (1 - ρ)·LN,
    batch-instance norm, batch-channel norm) or the statistics (μ = ρ·μ₁ + (1 - ρ)·μ₂ and the
    same of the variances, as switchable normalization)."""
    levels = {"batch": ["group", "instance"], "group": ["group", "instance"]}.get(
        kind, ["group", "sample", "batch", "instance"]
    )
    k1, k2 = rng.sample(levels, 2)
    u = rng.random()
    if u < 0.5:
        w = names.new("rho", "mix_w", "lam")
        s.options.append((w, "{ default = 0.3, min = 0, max = 1 }" if rng.random() < 0.5 else "{ min = 0, max = 1 }"))
    elif u < 0.75:
        w = names.new("rho_p", "lam", "w_mix")
        s.params.append((w, '{ shape = "scalar", init = 0.5 }'))
    else:
        w = rng.choice(["0.3", "0.7"])
    moments = []
    for k in (k1, k2):
        where = "" if k == "group" else f", '{k}'"
        m = names.new("mu_" + k[:2], "m_" + k[:2], "mk")
        s.stats.append((m, f"mean(x{where})"))
        v = names.new("var_" + k[:2], "v_" + k[:2], "vk")
        s.stats.append((v, f"mean((x - {m})**2{where})"))
        moments.append((m, v))
    (m1, v1), (m2, v2) = moments
    g = f"{gamma}*" if gamma and rng.random() < 0.7 else ""
    if rng.random() < 0.5:  # the normalized values mixed
        terms.append(f"{g}({w}*(x - {m1})/sqrt({v1} + {eps}) + (1 - {w})*(x - {m2})/sqrt({v2} + {eps}))")
    else:  # the statistics mixed
        mu = names.new("mu_mix", "m_sw", "mm")
        s.stats.append((mu, f"{w}*{m1} + (1 - {w})*{m2}"))
        var = names.new("var_mix", "v_sw", "vm")
        s.stats.append((var, f"{w}*{v1} + (1 - {w})*{v2}"))
        terms.append(f"{g}(x - {mu})/sqrt({var} + {eps})")


# seeds from here on draw the tensor family: tensor inputs beside x, a core value the statistics
# read in place of x, masked statistics, outputs beside y (judged by :func:`run_tensors`, which
# derivgen.tools.check's check_layer does not take)
TENSOR_SEEDS = 300_000

# names the tensor family prefers for what it declares (beside TRICKY's, which Names draws too)
TENSOR_NAMES = {
    "core": ("h", "u", "pre", "hs", "resid"),
    "residual": ("residual", "r", "res", "skip", "x1"),
    "gate": ("z", "gate", "zg", "act"),
    "scale": ("scale", "mod_s", "s_t", "gamma_t"),
    "shift": ("shift", "mod_b", "b_t", "beta_t"),
    "mask": ("mask", "valid", "m", "keep", "pad"),
    "weight": ("wts", "conf", "logit", "c_w"),
    "constant": ("pos", "noise", "bias_t", "emb"),
    "output": ("y1", "y2", "out1", "y_b", "h_out", "z_out", "aux"),
}


def _with_core(text: str, core: str) -> str:
    """``text`` with x written as the core value (the layer normalizes the core in place of x)."""
    return re.sub(r"(?<![\w])x(?![\w])", core, text)


def _weighted_means(expr: str, weight: str, total: str) -> str:
    """``expr`` with every mean(e) and sum(e) taken with ``weight`` (a mask: over the valid
    elements): mean(weight*(e))/total and sum(weight*(e))/total, ``total`` = mean(weight)."""
    call = re.compile(r"(?<![\w])(mean|sum)\(")
    out, i = [], 0
    while (found := call.search(expr, i)) is not None:
        out.append(expr[i : found.start()])
        j, depth = found.end(), 1
        while depth:
            depth += {"(": 1, ")": -1}.get(expr[j], 0)
            j += 1
        body = _weighted_means(expr[found.end() : j - 1], weight, total)
        out.append(f"({found.group(1)}({weight}*({body}))/{total})")
        i = j
    out.append(expr[i:])
    return "".join(out)


def _tensors(
    rng: random.Random,
    s: _Spec,
    names: Names,
    kind: str,
    z: str,
    terms: list[str],
    channel_ok: bool,
) -> None:
    """The tensor family's seeds: the ordinary draws (no block statistics, windows, leading()
    or group max/min) and, from a generator of their own, some of: a core value the
    statistics read in place of x (x plus a residual or two, x times a scale plus a
    residual, x gated by silu(z) or sigmoid(z), a per-channel weight times x plus a
    residual, a masked sum, a constant added, two values in a row); masked or weighted
    statistics (mean(m*e)/mean(m) for every mean, with a 0/1 mask, a constant weight or a
    weight with a gradient); tensors only in the output (adaLN's modulation, a silu gate,
    also through a value, a scale, a shift, a mask); one or two outputs beside y (the core
    value itself, another affine output of the normalized coordinate, a function of it, the
    coordinate modulated by a tensor, or times a statistic). Tensors of x's shape, or
    broadcast per sample or per position where the layout has them."""
    broadcast = ["sample", "position"] if not kind.startswith("trailing") else ["sample"]
    on_group = {"instance": "sample", "position": "position"}.get(kind)  # one value per group

    def tensor(role: str, shape: str = "x", grad: bool = True, mask: bool = False) -> str:
        n = names.new(*TENSOR_NAMES[role])
        f = [f'shape = "{shape}"'] if shape != "x" else []
        f += ["mask = true"] if mask else ([] if grad else ["grad = false"])
        s.tensors.append((n, "{ " + ", ".join(f) + " }" if f else "{}"))
        return n

    def shape(varying: bool = False) -> str:
        """x's mostly, a broadcast one now and then (``varying``: not one value per group)."""
        return rng.choice([sh for sh in ["x", "x", "x", *broadcast] if not (varying and sh == on_group)])

    core = rng.random() < 0.6
    masked = rng.random() < 0.35
    modulate = rng.random() < 0.5
    n_out = rng.choice([0, 0, 1, 1, 2])
    if not (core or masked or modulate or n_out):
        core = True
    mask = None
    h = None
    if masked:  # statistics over the valid elements, or weighted
        u = rng.random()
        if u < 0.7:
            mask = weight = tensor("mask", shape(varying=True), grad=False, mask=True)
        elif u < 0.85:
            weight = f"exp({tensor('constant', shape(varying=True), grad=False)})"
        else:
            weight = f"sigmoid({tensor('weight', shape(varying=True))})"  # a gradient through the means
        total = names.new("frac", "valid_n", "m_bar", "cnt")
        s.stats = [(total, f"mean({weight})")] + [(k, _weighted_means(v, weight, total)) for k, v in s.stats]
    if core:
        h = names.new(*TENSOR_NAMES["core"])
        form = rng.choice(
            ["add", "add", "add2", "scale_add", "silu", "sigmoid", "param", "mask", "tanh", "const", "two"]
        )
        if form == "param" and not channel_ok:
            form = "add"
        if form == "add":
            expr = f"x + {tensor('residual', shape())}"
        elif form == "add2":
            expr = f"x + {tensor('residual', shape())} + {tensor('residual', shape())}"
        elif form == "scale_add":
            expr = f"x*{tensor('scale', shape())} + {tensor('residual', shape())}"
        elif form == "silu":
            g = tensor("gate", shape())
            expr = f"x*{g}*sigmoid({g})"
        elif form == "sigmoid":
            expr = f"x*sigmoid({tensor('gate', shape())})"
        elif form == "param":
            w = names.new("w_in", "alpha_c", "w0")
            s.params.append((w, "{ init = 1.0 }"))
            expr = f"{w}*x + {tensor('residual', shape())}"
        elif form == "mask":
            m = mask or tensor("mask", shape(varying=True), grad=False, mask=True)
            expr = f"(x + {tensor('residual', shape())})*{m}"
        elif form == "tanh":
            expr = f"x + 0.5*tanh({tensor('residual', shape())})"
        elif form == "const":
            expr = f"x + {tensor('constant', shape(), grad=False)}"
        else:  # two values in a row: the first read only by the core
            a = names.new("pre_add", "a_v", "sum_in")
            s.values.append((a, f"x + {tensor('residual', shape())}"))
            expr = f"{a}*sigmoid({tensor('gate', shape())})"
        s.values.append((h, expr))
        s.stats = [(k, _with_core(v, h)) for k, v in s.stats]
        if s.normalized:
            s.normalized = (s.normalized[0], _with_core(s.normalized[1], h))
        terms[:] = [_with_core(t, h) for t in terms]
        z = _with_core(z, h)
    if modulate:  # tensors in the output only
        form = rng.choice(["adaln", "adaln", "silu", "value", "scale", "shift", "mask"])
        if form == "adaln":
            sc = tensor("scale", rng.choice(["sample", "sample", *broadcast, "x"]))
            terms[0] = f"({terms[0]})*(1 + {sc})"
            terms.append(tensor("shift", rng.choice(["sample", *broadcast, "x"])))
        elif form == "silu":
            g = tensor("gate", shape())
            terms[:] = [f"({' + '.join(terms)})*{g}*sigmoid({g})"]
        elif form == "value":  # the gate as a value of its own (not read by the statistics)
            g = tensor("gate", shape())
            v = names.new("gate_v", "silu_z", "act_v")
            s.values.append((v, f"{g}*sigmoid({g})"))
            terms[:] = [f"({' + '.join(terms)})*{v}"]
        elif form == "scale":
            terms[0] = f"{tensor('scale', shape())}*({terms[0]})"
        elif form == "shift":
            t = tensor("shift", shape())
            terms.append(rng.choice([t, f"0.5*{t}**2"]))
        else:
            m = tensor("mask", shape(), grad=False, mask=True)
            terms[:] = [f"{m}*({' + '.join(terms)})"]
    kinds = ["affine", "affine", "function", "modulated", "statistic"] + (["value"] if h else [])
    for _ in range(n_out):
        form = rng.choice(kinds)
        if form == "value":  # the core value itself, as fused add-norms return it
            kinds = [k for k in kinds if k != "value"]
            s.outputs.append((h, h))
            continue
        o = names.new(*TENSOR_NAMES["output"])
        if form == "affine":
            w = names.new("w1", "weight1", "gamma1", "scale1")
            s.params.append(
                (w, "{ init = 1.0 }" if channel_ok and rng.random() < 0.7 else '{ shape = "scalar", init = 1.0 }')
            )
            b = names.new("b1", "bias1", "beta1", "shift1")
            s.params.append(
                (
                    b,
                    '{ role = "shift" }'
                    if channel_ok and rng.random() < 0.7
                    else '{ role = "shift", shape = "scalar" }',
                )
            )
            expr = f"{w}*{z} + {b}"
        elif form == "function":
            expr = rng.choice([f"tanh({z})", f"{z}**2/2", f"{z}*sigmoid({z})", z])
        elif form == "modulated":
            expr = f"{z}*(1 + {tensor('scale', shape())})"
        else:
            expr = f"{z}*{s.stats[-1][0]}"
        s.outputs.append((o, expr))


# ------------------------------------------------------------------ the fewest run-time means


@dataclass(frozen=True)
class Reductions:
    """One mode's run-time means of ∂L/∂y by kind (``group``, and the block kinds ``sample``,
    ``batch``, ``instance``): the engine's (:func:`engine_reductions`) and the brute-force
    minimum (:func:`brute_force_minimum`)."""

    mode: str
    engine: dict[str, int]
    minimum: dict[str, int]

    @property
    def kinds(self) -> list[str]:
        """The kinds either side counts, coarsest first."""
        return [k for k in MEAN_KINDS if self.engine.get(k) or self.minimum.get(k)]

    @property
    def excess(self) -> dict[str, int]:
        """Kind -> how many means the engine needs beyond the minimum (negative: fewer than the
        brute force says any backward can have -- a bug in one of them)."""
        out = {k: self.engine.get(k, 0) - self.minimum.get(k, 0) for k in self.kinds}
        return {k: v for k, v in out.items() if v}

    @property
    def at_minimum(self) -> bool:
        """The engine's count of every kind is the minimum."""
        return not self.excess

    def __str__(self) -> str:
        per = ", ".join(f"{k} {self.engine.get(k, 0)}/{self.minimum.get(k, 0)}" for k in self.kinds) or "none"
        return f"{self.mode}: {per}"


# the kinds of mean, coarsest first: the group, then the blocks (derivgen.symbolic.block)
MEAN_KINDS = ("group", "sample", "batch", "instance")


def engine_reductions(md) -> dict[str, int]:
    """A mode derivation's run-time means of ∂L/∂y by kind, as the engine counts them
    (``ModeDerivation.reduction_counts``): its ``reductions`` (the group means, every one of
    them), and the distinct block means of ∂L/∂y (or g) of each kind in its closed forms."""
    return {k: n for k, n in md.reduction_counts.items() if n}


def reduction_minimum(spec, derivation=None, seed: int = 0) -> list[Reductions]:
    """Every mode's run-time means: the engine's count by kind against the brute-force
    minimum (``derivation``: the spec's, if already derived)."""
    import derivgen

    d = derivation if derivation is not None else derivgen.derive(spec)
    return [Reductions(m, engine_reductions(md), brute_force_minimum(spec, m, seed, d)) for m, md in d.modes.items()]


class MinimumUnresolved(RuntimeError):
    """The brute force could not tell the rank (too few rows or columns, or no clear gap
    between the singular values it keeps and the ones it drops)."""


# the singular values of a block of the Jacobian that count towards its rank: above TOL_RANK
# times its largest entry (or an input gradient's); one within a factor GAP of that bound is no
# clear rank. Over the corpora the kept ones lie above 1e-7 and the dropped ones below 1e-15
TOL_RANK = 1e-11
GAP = 1e3


def brute_force_minimum(spec, mode: str, seed: int = 0, derivation=None) -> dict[str, int]:
    """The fewest run-time means of ∂L/∂y of each kind any backward of ``mode`` needs
    ({"group": n, "instance": n, ...}: every kind the layout's groups hold, zero where none),
    from the numbers of ∂L/∂x alone: the closed forms evaluated numerically by
    :mod:`derivgen.tools.evaluate` (the tree walk ``derivgen check`` compares the generated code
    against; the proof and :func:`run`'s checks vouch for them), never the engine's list of
    reductions nor the shape of its closed forms.

    **Why a rank.** ∂L/∂x is linear in ∂L/∂y. A backward that reads R means ⟨c_l·∂L/∂y⟩ of a
    group computes ∂L/∂x_i = a_i·∂L/∂y_i + Σ_l b_l,i·⟨c_l·∂L/∂y⟩ (a, b, c element values:
    what the forward left, the parameters, the position), so Jᵀ, the matrix of
    ∂(∂L/∂x_i)/∂(∂L/∂y_k), is a diagonal plus Σ_l b_l c_lᵀ/N. Its block of rows R and
    columns C, disjoint sets of elements, has rank ≤ R whatever the backward, and at a random
    point exactly the number of independent means: the minimum. The gradient of a per-group
    input is a mean of ∂L/∂y too; its row over C joins the block. A scalar parameter's
    gradient is a sum over the whole tensor of an element value times ∂L/∂y and needs no mean
    of its own, so it is left out (a mean only it reads is one too many).

    **Block means.** In a channel layout whose groups hold blocks (``mean(e, kind)``), a mean
    of kind K adds Σ_l b_l c_lᵀ/|block| on the pairs of elements that share a K block. The
    elements are cells (sample u, channel v) of positions; a kind's blocks span some of the
    cell axes (the group: the layout's; ``sample``: the channels; ``batch``: the samples;
    ``instance``: none, one cell). Two elements of one K block that differ on every cell axis
    K spans (for ``instance``: two positions of one cell) share no finer block, so their entry
    of Jᵀ holds only K's means and those of the coarser kinds, whose blocks hold K's. Coarsest
    first, F_K, K's part of Jᵀ, is Jᵀ less the coarser kinds' parts on those pairs; on pairs
    of a K block that also share a finer block it is extrapolated from such pairs around them:
    F_K(e, e') = F_K(e, C)·F_K(R, C)⁺·F_K(R, e') for reference cells R and C that differ from
    e', e and each other on K's axes (exact for a part of rank r where F_K(R, C) has rank r).
    The minimum of kind K is the rank of F_K on one K block's pairs that share no finer block.

    **What is chosen.** The point: :func:`rank_case` (a group of 64 elements, or cells of 16
    positions: 9 samples in a batch layout's group, 9 channels in a group layout's, 6 × 6 in
    the ``all`` layout); another where the first leaves the layer's domain. Rows and columns:
    the values along each axis K spans in interleaved parts, each part once the columns and
    the cells that differ from it on every such axis the rows; the rank is the largest over
    the splits. So an element value held by one element -- a group maximum's mask at its arg
    max -- is a row in some split; that element's row is left out of the finer kinds' blocks
    and of the references (its share of Jᵀ cannot be told apart there). Pairs within a
    window's reach (``window(e, k)`` along the ordered axis) are never used. A rank that fills
    its block, or singular values between TOL_RANK/GAP and TOL_RANK·GAP of the Jacobian's
    largest entry (where no rank is clear), raise :class:`MinimumUnresolved`.
    """
    with _one_blas_thread():
        return _minimum(spec, mode, seed, derivation)


@contextlib.contextmanager
def _one_blas_thread():
    """OpenBLAS on one thread while the ranks are taken (where NumPy's is found in this
    process's maps): on a machine whose cores other processes keep busy, its threads wait
    for each other, and a 64x64 SVD takes ten to fifty times as long."""
    import ctypes

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    knobs = []
    for path in sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", maps))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_{}_num_threads64_", "openblas_{}_num_threads64_", "openblas_{}_num_threads"):
            get, put = getattr(lib, name.format("get"), None), getattr(lib, name.format("set"), None)
            if get is not None and put is not None:
                knobs.append((put, get()))
                put(1)
                break
    try:
        yield
    finally:
        for put, threads in knobs:
            put(threads)


def _minimum(spec, mode: str, seed: int, derivation) -> dict[str, int]:
    """:func:`brute_force_minimum`'s work."""
    import numpy as np

    import derivgen
    from derivgen.symbolic.block import BLOCK_AXES, GROUP_AXES, block_kinds

    md = (derivation or derivgen.derive(spec)).modes[mode]
    if any(m.blocks for m in spec.modes) and spec.multi:
        raise MinimumUnresolved(f"{mode}: block means beside tensor inputs or outputs are not judged")
    for attempt in range(4):  # a point where the layer is defined (x may leave a root's domain)
        case = rank_case(spec, seed + 1000 * attempt)
        with np.errstate(all="ignore"):
            jac, dins = _jacobian(md, case)
        if np.isfinite(jac).all() and np.isfinite(dins).all():
            break
    else:
        raise MinimumUnresolved(f"{mode}: no random point where the layer is defined (four tried)")
    x, scalars, grid = case.x, case.scalars, case.grid
    layout, reduce_ = spec.layout, spec.reduce
    n = len(x)
    wide = (jac.shape[0] // n, jac.shape[1] // n)  # blocks of rows (gradients) and columns (cotangents)

    def widen(elements, blocks):  # the elements' rows or columns in every block
        return [e + b * n for b in range(blocks) for e in elements]

    u, v, _ = np.unravel_index(np.arange(n), grid)

    cells: dict[tuple[int, int], list[int]] = {}
    for e in range(n):
        cells.setdefault((int(u[e]), int(v[e])), []).append(e)
    special = _selected_elements(spec, x)
    ordered = layout == "trailing" or reduce_ == "position"  # the axis windows and leading() run along
    reach = 0
    if spec.windows:  # no pair of rows and columns within a window's reach
        reach = max(int(scalars.get(str(w.size), w.size)) for w in spec.windows) + 1

    def cell_axes(axes) -> tuple[int, ...]:  # view axes -> cell axes (0: u, 1: v)
        return tuple(a for a, view in ((0, {0}), (1, {1, 2})) if view & set(axes))

    kinds = {"group": GROUP_AXES[(layout, reduce_)]}
    kinds.update({k: BLOCK_AXES[k] for k, how in block_kinds(layout, reduce_).items() if how == "block"})
    spans = {k: cell_axes(a) for k, a in kinds.items()}
    coarser = {k: [k2 for k2 in kinds if set(kinds[k]) < set(kinds[k2])] for k in kinds}
    scale = max(1.0, float(np.abs(jac).max()), float(np.abs(dins).max()) if dins.size else 0.0)
    tol = TOL_RANK * scale

    def pinv(a):
        uu, sv, vt = np.linalg.svd(a, full_matrices=False)
        keep = sv > tol
        return (vt[keep].T / sv[keep]) @ uu[:, keep].T

    def same_class(k, cr, cc) -> bool:  # the cells' elements share k's block and no finer one
        ax = spans[k]
        return all(cr[a] != cc[a] for a in ax) if ax else cr == cc

    memo: dict = {}  # (kind, cell, cell) -> its part
    inverses: dict = {}  # (kind, reference rows, reference columns) -> pinv of their part

    def part(k, cr, cc):
        """F_k on the elements of cells cr x cc (one k block)."""
        key = (k, cr, cc)
        if key not in memo:
            if same_class(k, cr, cc):
                out = jac[np.ix_(cells[cr], cells[cc])]
                for k2 in coarser[k]:
                    out = out - part(k2, cr, cc)
            else:
                rr, cs = references(k, cr, cc)
                if (k, rr, cs) not in inverses:
                    mid = np.vstack([np.hstack([part(k, r, c)[ok(r)] for c in cs]) for r in rr])
                    inverses[(k, rr, cs)] = pinv(mid)
                left = np.hstack([part(k, cr, c) for c in cs])
                right = np.vstack([part(k, r, cc)[ok(r)] for r in rr])
                out = left @ inverses[(k, rr, cs)] @ right
            memo[key] = out
        return memo[key]

    def ok(cell):
        """The rows of a cell a reference uses: not a selected element's."""
        return [i for i, e in enumerate(cells[cell]) if e not in special]

    def references(k, cr, cc):
        """Reference cells R (rows) and C (columns) in cr's k block for the pair (cr, cc): along
        each axis k spans, two of three interleaved parts of its values, R's without cc's value,
        C's without cr's (so R x C, cr x C and R x cc are pairs of k's class)."""
        ax = spans[k]
        choice = []
        for a in (0, 1):
            if a not in ax:
                choice.append(([cr[a]], [cr[a]]))
                continue
            vals = sorted({c[a] for c in cells if _same_block(c, cr, ax)})
            thirds = [vals[i::3] for i in range(3)]
            i = next(
                i
                for i in range(3)
                if cc[a] not in thirds[i] and any(cr[a] not in thirds[j] for j in range(3) if j != i)
            )
            j = next(j for j in range(3) if j != i and cr[a] not in thirds[j])
            choice.append((thirds[i], thirds[j]))
        rr = [(a, b) for a in choice[0][0] for b in choice[1][0]]
        cs = [(a, b) for a in choice[0][1] for b in choice[1][1]]
        return tuple(rr), tuple(cs)

    out = {}
    for k in sorted(kinds, key=lambda k: -len(kinds[k])):
        ax = spans[k]
        first = min(cells)
        block = [c for c in cells if _same_block(c, first, ax)]
        best, gaps = 0, []
        for rows, cols in _splits(ax, block, cells, ordered, reach):
            if k == "group":
                m = jac[np.ix_(widen(rows, wide[0]), widen(cols, wide[1]))]
                if len(spec.inputs):
                    m = np.vstack([m, dins[:, widen(cols, wide[1])]])
            else:
                rows = [e for e in rows if e not in special]
                m = _assemble(part, k, rows, cols, cells)
            sv = np.linalg.svd(m, compute_uv=False)
            r = int((sv > tol).sum())
            if r >= min(m.shape) - 1:
                raise MinimumUnresolved(
                    f"{mode}: {k} means: rank {r} fills a {m.shape[0]}x{m.shape[1]} block; more elements needed"
                )
            kept, dropped = sv[r - 1] if r else np.inf, sv[r] if r < len(sv) else 0.0
            gaps.append((kept, dropped))
            best = max(best, r)
        for kept, dropped in gaps:
            if kept < GAP * tol or dropped > tol / GAP:
                raise MinimumUnresolved(
                    f"{mode}: {k} means: no clear rank (singular values {kept:.1e} kept, {dropped:.1e} dropped)"
                )
        out[k] = best
    return out


# the group's grid (samples, channels, positions) per channel layout (a trailing layout's
# group: 64 features along the channel axis): a kind's ranks up to 6 can be told in its
# smallest blocks (an instance's 16 positions, split in two), more in the larger ones
RANK_GRIDS = {
    "instance": (1, 1, 64),
    "position": (1, 64, 1),
    "batch": (9, 1, 16),
    "group": (1, 9, 16),
    "all": (6, 6, 16),
}


@dataclass
class RankCase:
    """One group's values for the brute force: x, the parameters (per element, or scalars),
    the options, inputs and buffers (one value each), the group's grid, and the tensor inputs
    (per element)."""

    x: object
    params: dict
    scalars: dict
    grid: tuple[int, int, int]
    tensors: dict = field(default_factory=dict)


def rank_case(spec, seed: int = 0) -> RankCase:
    """x at random (float64), parameters, inputs and buffers at random, options at random
    near their defaults (0.7 to 1.4 times, inside their bounds: where the layer is meant to
    be defined) or inside their bounds where they have none; a window's size its default
    (else 1..5), a ``leading`` fraction 0.3..0.7 (every part of a split holds both sides of
    its cut); on the layout's grid (:data:`RANK_GRIDS`)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    grid = (1, 64, 1) if spec.layout == "trailing" else RANK_GRIDS[spec.reduce]
    n = math.prod(grid)
    v = np.unravel_index(np.arange(n), grid)[1]
    x = rng.normal(0.3, 1.3, n)
    params = {p.name: rng.normal(1.0, 0.4) if p.scalar else rng.normal(1.0, 0.4, grid[1])[v] for p in spec.params}
    scalars: dict = {}
    masked = {m.option for m in spec.masks}
    for o in spec.options:
        lo = o.min if o.min is not None else (0.0 if o.default is None else min(0.0, o.default))
        hi = o.max if o.max is not None else lo + 1.0
        if o.integer:
            pick = o.default if o.default is not None else rng.integers(max(1, math.ceil(lo)), int(min(5, hi)) + 1)
            scalars[o.name] = int(pick)
        elif o.name in masked:
            scalars[o.name] = float(rng.uniform(0.3, 0.7))
        elif o.default is not None:
            near = float(o.default * rng.uniform(0.7, 1.4))
            scalars[o.name] = float(
                np.clip(near, -np.inf if o.min is None else o.min, np.inf if o.max is None else o.max)
            )
        else:
            scalars[o.name] = float(lo + rng.uniform(0.2, 0.8) * (hi - lo))
    for item in (*spec.inputs, *spec.buffers):
        scalars[item.name] = float(rng.uniform(0.6, 1.4))
    return RankCase(x, params, scalars, grid, _rank_tensors(spec, grid, rng))


def _rank_tensors(spec, grid: tuple[int, int, int], rng) -> dict:
    """The tensor inputs over one group on ``grid`` (samples, channels, positions): one value per
    element, per (sample, channel) for a channel layout's ``sample`` tensor, per (sample,
    position) for a ``position`` one; ~ N(0.4, 0.8²), masks 0/1 with at least two valid."""
    import numpy as np

    n = math.prod(grid)
    u, v, p = np.unravel_index(np.arange(n), grid)
    out = {}
    for t in spec.tensors:
        if t.shape == "x" or spec.layout == "trailing":
            index, size = np.arange(n), n
        elif t.shape == "sample":
            index, size = u * grid[1] + v, grid[0] * grid[1]
        else:
            index, size = u * grid[2] + p, grid[0] * grid[2]
        if t.mask:
            m = (rng.random(size) < 0.7).astype(np.float64)
            m[rng.permutation(size)[:2]] = 1.0
            out[t.name] = m[index]
        else:
            out[t.name] = rng.normal(0.4, 0.8, size)[index]
    return out


def group_evaluator(md, case: RankCase):
    """:class:`derivgen.tools.evaluate.GroupEvaluator` of ``md`` on ``case``'s group, with the
    tensor inputs and the values (the core among them) in its environment."""
    import numpy as np

    from derivgen.spec.model import X
    from derivgen.tools.evaluate import GroupEvaluator, evaluate

    class WithTensors(GroupEvaluator):
        def _env(self, x, params, scalars):
            env = super()._env(x, params, scalars)
            for t in self.spec.tensors:
                env[t.symbol] = np.asarray(case.tensors[t.name], dtype=np.float64)
            for v in self.spec.values:  # in order: x, the tensors, the values before
                env[v.symbol] = evaluate(v.expr, env) * np.ones_like(env[X])
            return env

    return WithTensors(md)


def block_mean(grid: tuple[int, int, int]):
    """``block(values, axes)`` for :mod:`derivgen.tools.evaluate` on a group laid out as
    ``grid``: the mean over the axes of the (O, G, Cg, S) view a block spans, over the last
    axis of ``values`` (leading axes: one group's values per row)."""
    import numpy as np

    view = {0: 0, 1: 1, 2: 1, 3: 2}  # the view's axes on the grid

    def block(values, axes):
        a = np.asarray(values, dtype=np.float64)
        if a.ndim == 0:
            return a
        lead = a.shape[:-1]
        g = a.reshape(*lead, *grid)
        on = tuple(len(lead) + ax for ax in sorted({view[k] for k in axes}))
        return np.broadcast_to(g.mean(axis=on, keepdims=True), g.shape).reshape(a.shape)

    return block


def _jacobian(md, case: RankCase):
    """(Jᵀ, the input gradients' rows): Jᵀ[e, k] = ∂y_k/∂x_e, the ∂L/∂x the closed forms
    give for ∂L/∂y one at element k, and row i of the second ∂L/∂(input i) for it, evaluated
    numerically (:mod:`derivgen.tools.evaluate`, the tree walk derivgen check compares the
    generated code against; its backward is linear in ∂L/∂y, so all k at once: ∂L/∂y the
    identity, each mean over the last axis; one k at a time where a window is).

    With tensor inputs or outputs beside y, Jᵀ is a grid of such blocks: a row of blocks per
    gradient of an element value (∂L/∂x, then each tensor's with a gradient, per element
    before a broadcast tensor's sum), a column of blocks per output's cotangent (y's first),
    and the input gradients' rows span every column; a mean of ∂L/∂y's that any of them reads
    is one rank of it."""
    import numpy as np

    from derivgen.derive.first import G
    from derivgen.tools.evaluate import evaluate

    n = len(case.x)
    block = block_mean(case.grid)
    spec = md.spec

    def mean(values):
        a = np.asarray(values, dtype=np.float64)
        return a if a.ndim == 0 else a.mean(axis=-1, keepdims=True)

    _, env = group_evaluator(md, case).forward(case.x, case.params, case.scalars, block)
    inputs = spec.inputs
    gradients = [md.dx, *(md.dtensors[t.name] for t in spec.grad_tensors)]
    columns, din_columns = [], []
    for cot in spec.cotangents:
        rows, dins = [], []
        for dy in [np.eye(n)] if not spec.windows else list(np.eye(n)):
            e = {**env, **{c: np.zeros_like(dy) for c in spec.cotangents}, cot: dy}
            if md.g is not None:
                e[G] = evaluate(md.g, e, mean, None, block) * np.ones_like(dy)
            rows.append(
                [np.broadcast_to(evaluate(r, e, mean, None, block), dy.shape).reshape(-1, n) for r in gradients]
            )
            shape = (*dy.shape[:-1], 1)
            dins.append([np.broadcast_to(evaluate(md.dinputs[i.name], e, mean, None, block), shape) for i in inputs])
        columns.append([np.vstack([r[k] for r in rows]).T for k in range(len(gradients))])
        din_columns.append(
            np.array([np.concatenate([np.reshape(d[i], -1) for d in dins]) for i in range(len(inputs))]).reshape(
                len(inputs), n
            )
        )
    jac = np.block([[col[k] for col in columns] for k in range(len(gradients))])
    return jac.copy(), np.hstack(din_columns)


def _same_block(c, first, spans) -> bool:
    """Do cells c and first lie in one block of a kind spanning cell axes ``spans``?"""
    return all(c[a] == first[a] for a in (0, 1) if a not in spans)


def _splits(spans, block, cells, ordered: bool, reach: int):
    """(rows, columns) of elements of one block: pairs that differ on every cell axis in
    ``spans`` (none: the positions of one cell). The values along each axis in interleaved
    parts (runs of 8 along an ordered axis, so a window's reach leaves rows between them),
    each part once the columns."""
    if not spans:  # the block is one cell
        elems = cells[block[0]]
        q = 4 if len(elems) >= 48 else 2
        for p in range(q):
            yield [e for i, e in enumerate(elems) if i % q != p], [e for i, e in enumerate(elems) if i % q == p]
        return
    vals = {a: sorted({c[a] for c in block}) for a in spans}
    parts = {}
    for a in spans:
        run = 8 if ordered and a == 1 else 1
        q = 4 if len(vals[a]) >= 32 else (3 if len(vals[a]) >= 6 else 2)
        parts[a] = [[val for i, val in enumerate(vals[a]) if (i // run) % q == p] for p in range(q)]
    import itertools

    for choice in itertools.product(*(parts[a] for a in spans)):
        pick = dict(zip(spans, choice))
        cols = [c for c in block if all(c[a] in pick[a] for a in spans)]
        rows = [c for c in block if all(c[a] not in pick[a] for a in spans)]
        if reach:  # the ordered axis: no row within a window's reach of a column
            taken = [c[1] for c in cols]
            rows = [c for c in rows if min(abs(c[1] - t) for t in taken) > reach]
        yield [e for c in rows for e in cells[c]], [e for c in cols for e in cells[c]]


def _assemble(part, k, rows, cols, cells):
    """F_k on elements rows x cols, cell pair by cell pair."""
    import numpy as np

    where = {e: (c, i) for c, es in cells.items() for i, e in enumerate(es)}
    rcells = sorted({where[e][0] for e in rows})
    ccells = sorted({where[e][0] for e in cols})
    out = np.empty((len(rows), len(cols)))
    for rc in rcells:
        ri = [j for j, e in enumerate(rows) if where[e][0] == rc]
        rp = [where[rows[j]][1] for j in ri]
        for cc in ccells:
            ci = [j for j, e in enumerate(cols) if where[e][0] == cc]
            cp = [where[cols[j]][1] for j in ci]
            out[np.ix_(ri, ci)] = part(k, rc, cc)[np.ix_(rp, cp)]
    return out


def _selected_elements(spec, x) -> set[int]:
    """The elements a group maximum or minimum of the spec's selects at x (arg max, arg min
    of its argument where that is a function of x alone): where an element value of the
    backward is concentrated."""
    import numpy as np
    import sympy

    from derivgen.spec.model import X
    from derivgen.symbolic.reduce import SELECTIONS

    out: set[int] = set()
    for m in spec.modes:
        for st in m.statistics:
            for sel in st.expr.atoms(*SELECTIONS):
                arg = sel.args[0]
                if arg.free_symbols <= {X}:
                    vals = np.broadcast_to(sympy.lambdify(X, arg, "numpy")(x), x.shape)
                    out |= {int(np.argmax(vals)), int(np.argmin(vals))}
    return out


# ------------------------------------------------------------------ the pipeline


@dataclass
class Result:
    seed: int
    ok: bool
    proof: str = ""  # "proven" / "checked numerically" / "FAILED"
    reductions: int = 0
    seconds: float = 0.0
    failure: str = ""
    # per mode, the run-time means of ∂L/∂y by kind, the engine's / the brute-force minimum
    # ("train: group 3/2, instance 2/2"), and whether every count is the minimum (None: not
    # judged -- the spec failed before, or the brute force could not tell: see ``means``)
    means: str = ""
    minimal: bool | None = None


@functools.cache  # the suite's corpora share seeds
def features(seed: int) -> frozenset[str]:
    """What seed's spec exercises (:func:`text_features`), and the shapes whose fewest run-time
    means the fuzzer judges (:func:`shape_features`: features of the fuzzer's seeds only; the
    spec-file corpora, whose tests judge no means, keep their samples)."""
    return text_features(generate(seed), f"fuzz{seed}.toml", shapes=True)


def text_features(text: str, source: str = "spec.toml", shapes: bool = False) -> frozenset[str]:
    """What a spec exercises: its layout and reduction, each function its formulas call
    (mean and sum included), each table its text has ([inputs], [buffers],
    [modes.eval.statistics], [normalized], ...), its kinds of parameter (role, scalar shape)
    and of block statistic; ``shapes``: also its :func:`shape_features`. :func:`covering`
    picks a corpus's sample by them."""
    from derivgen.spec import parse_spec

    spec = parse_spec(text, source=source)
    formulas = [spec.output_text, *(b.update_text for b in spec.buffers)]
    formulas += [st.expr_text for m in spec.modes for st in (*m.statistics, *m.blocks)]
    if spec.normalized_expr is not None:
        formulas.append(str(spec.normalized_expr))
    out = {f"layout {spec.layout}/{spec.reduce}"}
    out |= {f"call {f}" for f in re.findall(r"\b([A-Za-z_]\w*)\(", " ".join(formulas))}
    out |= {f"table {t}" for t in re.findall(r"^\[([\w.]+)\]", text, re.MULTILINE)}
    for key in ("role", "shape"):  # of a parameter: name = { role = "...", shape = "..." }
        out |= {f"{key} {v}" for v in re.findall(rf'^\w+ = \{{[^\n]*\b{key} = "(\w+)"', text, re.MULTILINE)}
    out |= {f"block {k}" for b in (bl for m in spec.modes for bl in m.blocks) for k in b.kinds}
    return frozenset(out | shape_features(spec) | tensor_features(spec) if shapes else out)


def tensor_features(spec) -> set[str]:
    """What a layer with tensor inputs, values or outputs beside y exercises (the tensor
    family's seeds; nothing for other layers): each tensor's shape and kind (``tensor x``,
    ``tensor sample``, ``tensor position``; ``tensor mask``, ``tensor constant``: no gradient
    and not a mask), where tensors are read (``tensor in core``, ``tensor in statistics``,
    ``tensor in output``), ``core value``, ``parameter in core``, ``values beside the core``,
    ``outputs beside y: n`` and ``output is the core value``."""
    out: set[str] = set()
    for t in spec.tensors:
        out.add(f"tensor {t.shape}")
        out.add("tensor mask" if t.mask else ("tensor constant" if not t.grad else "tensor with gradient"))
    syms = spec.tensor_symbols
    stats = [st.expr for m in spec.modes for st in m.statistics]
    if any(e.free_symbols & syms for e in stats):
        out.add("tensor in statistics")
    if any(e.free_symbols & syms for e in (spec.output, *(o.expr for o in spec.outputs))):
        out.add("tensor in output")
    if spec.core is not None:
        out.add("core value")
        if spec.core.expr.free_symbols & syms:
            out.add("tensor in core")
        if spec.core.expr.free_symbols & {p.symbol for p in spec.params}:
            out.add("parameter in core")
        if len(spec.values) > 1:
            out.add("values beside the core")
    elif spec.values:
        out.add("values beside the core")
    if spec.outputs:
        out.add(f"outputs beside y: {len(spec.outputs)}")
    if spec.core is not None and spec.core.name in {o.name for o in spec.outputs}:
        out.add("output is the core value")
    return out


def shape_features(spec) -> set[str]:
    """The shapes of output and statistics the fewest-means judgement is about, from the
    formulas: ``output polynomial in x`` (terms of one sum that are a polynomial of x alone of
    degree two or more, as a Taylor softmax's 1 + x + x²/2), ``output scaled by an input``
    (the whole output a product with a per-group input), ``output input times x`` (x itself)
    or ``... times the coordinate`` (the normalized value, or any factor of x), and
    ``mixture A+B``: w·a + (1 - w)·b (w a symbol, or numbers that add up to one) where a and b
    are one formula over statistics of two levels A and B (the group's, or a block kind's: a
    block statistic's coarsest kind), as ρ·IN + (1 - ρ)·LN or μ = ρ·μ_in + (1 - ρ)·μ_ln."""
    import sympy

    from derivgen.spec.model import X
    from derivgen.symbolic.block import BLOCK_AXES
    from derivgen.symbolic.window import Window

    out: set[str] = set()
    inputs = {i.symbol for i in spec.inputs}
    coordinate = {spec.normalized.symbol} if spec.normalized is not None else set()
    y = spec.output.xreplace({w: sympy.Dummy() for w in spec.output.atoms(Window)})
    for node in sympy.preorder_traversal(y):
        if node.is_Add:
            pure = [a for a in node.args if a.free_symbols <= {X}]
            if len(pure) >= 2 and sympy.degree(sympy.Add(*pure), X) >= 2:
                out.add("output polynomial in x")
        if node.is_Mul and inputs & set(node.args):
            if X in node.args:
                out.add("output input times x")
            elif any(a.has(X) or a in coordinate for a in node.args):
                out.add("output input times the coordinate")
    if y.is_Mul and inputs & set(y.args):
        out.add("output scaled by an input")
    level = {}
    for m in spec.modes:
        level.update({st.symbol: "group" for st in m.statistics})
        level.update({b.symbol: max(b.kinds, key=lambda k: len(BLOCK_AXES[k])) for b in m.blocks})
    formulas = [spec.output, *(st.expr for m in spec.modes for st in (*m.statistics, *m.blocks))]
    for f in formulas:
        for node in sympy.preorder_traversal(f):
            if node.is_Add:
                for i, a in enumerate(node.args):
                    for b in node.args[i + 1 :]:
                        pair = _mixed(a, b, level)
                        if pair:
                            out.add("mixture " + "+".join(sorted(pair)))
    return out


def _mixed(a, b, level: dict) -> set[str] | None:
    """The two levels a and b mix when a + b is w·A + (1 - w)·B of one formula over statistics
    of level A and level B, else None."""
    import sympy

    la, lb = ({level[s] for s in e.free_symbols if s in level} for e in (a, b))
    if len(la) != 1 or len(lb) != 1 or la == lb:
        return None
    a, b = sympy.factor_terms(a), sympy.factor_terms(b)  # 7*x/10 - 7*m/10: 7*(x - m)/10
    ca, ra = a.as_coeff_Mul()
    cb, rb = b.as_coeff_Mul()
    parts = None
    if ca.is_Number and cb.is_Number and ca + cb == 1 and ca not in (0, 1):
        parts = (ra, rb)
    else:
        for x, z in ((a, b), (b, a)):
            rest = sympy.Mul.make_args(z)
            for f in sympy.Mul.make_args(x):
                g = None if f.is_Number else next((g for g in rest if sympy.expand(1 - f - g) == 0), None)
                if g is not None:
                    parts = (x / f, z / g)
                    break
            if parts:
                break
    if not parts:
        return None
    levels = [{level[s] for s in p.free_symbols if s in level} for p in parts]
    if any(len(lv) != 1 for lv in levels) or levels[0] == levels[1]:
        return None
    placeholder = sympy.Symbol("stat")
    shapes = [p.xreplace({s: placeholder for s in p.free_symbols if s in level}) for p in parts]
    return levels[0] | levels[1] if shapes[0] == shapes[1] else None


def covering(items, key=features) -> list:
    """A sample of a corpus with every feature of the whole (``key``: an item's features,
    :func:`features` of a seed by default): greedily the item that adds the most features
    not yet seen, the earlier one on a tie; in the corpus's order. The test suite's quick
    tier runs a backend's corpus as this sample, and the full tier (make test-full) the
    whole corpus."""
    items = list(items)
    todo = {it: key(it) for it in items}
    rank = {it: k for k, it in enumerate(items)}
    seen: set[str] = set()
    picked = []
    while todo:
        best = min(todo, key=lambda it: (-len(todo[it] - seen), rank[it]))
        if not todo[best] - seen:
            break
        seen |= todo.pop(best)
        picked.append(best)
    return sorted(picked, key=rank.__getitem__)


def run(text: str, seed: int = -1, prove_sizes=(2, 3)) -> Result:
    """Parse, derive, prove, generate, compile, check (a layer with tensor inputs, values or
    outputs beside y: :func:`run_tensors`). Never raises: failures are results."""
    from derivgen.spec import parse_spec
    from derivgen.tools.check import check_layer

    t0 = time.perf_counter()
    try:
        spec = parse_spec(text, source=f"fuzz{seed}.toml")
        if spec.multi:
            return run_tensors(text, seed, prove_sizes)
        rows = check_layer(spec, prove_sizes=prove_sizes)
        import derivgen

        d = derivgen.derive(spec, prove=tuple(prove_sizes))
        from derivgen.prove.proof import prove_second_mode

        every, sizes2 = SECOND_ORDER
        if any(m.blocks for m in spec.modes):  # a grid of 2*2*N elements at most: N = 2 is enough
            sizes2 = sizes2[:1]
        second = {m: prove_second_mode(d.second(m), sizes2) for m in d.modes} if seed < 0 or seed % every == 0 else {}
        bad2 = [f"{m} second order: {r.detail or r.status}" for m, pr in second.items() for r in pr.results if not r.ok]
        statuses = {p.status for p in d.proofs.values()}
        proof = (
            "FAILED"
            if "FAILED" in statuses
            else ("checked numerically" if "checked numerically" in statuses else "proven")
        )
        checked = seed < 0 or seed % CHANNELS_LAST_EVERY == 0
        bad3 = channels_last_mismatches(spec) if checked else []
        bad = [r for r in rows if r.failed]
        fail = "; ".join(
            [
                f"{r.mode} {r.backend} {r.dtype} {r.check}: {r.status} "
                + " ".join(f"{k}={v:.1e}" for k, v in r.errors.items())
                for r in bad
            ]
            + bad2
            + bad3
        )
        means, minimal = judge_means(spec, d)
        return Result(
            seed,
            not bad and not bad2 and not bad3,
            proof,
            max(len(m.reductions) for m in d.modes.values()),
            time.perf_counter() - t0,
            fail,
            means,
            minimal,
        )
    except BaseException as exc:  # every failure is a finding
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return Result(seed, False, "", 0, time.perf_counter() - t0, tb[:2000])


# ------------------------------------------------------------------ the tensor family's judge

# x's shape and the normalized axes' (for the layout) per layout, for run_tensors: odd sizes, a
# broadcast axis between a trailing layout's samples and features, groups of 5 to 20 elements
TENSOR_CASES = {
    "trailing": ((3, 4, 5), (5,)),
    "trailing2": ((3, 2, 4, 5), (4, 5)),
    "batch": ((4, 3, 5), (3,)),
    "instance": ((2, 3, 7), (3,)),
    "position": ((2, 5, 2, 3), (5,)),
    "group": ((2, 6, 5), (6,)),
}
# tolerances, relative to max(1, max |reference|): a generated module in float64 against autograd
# of the spec's forward in torch, and against central differences of its own forward; in float32
# against itself in float64 on the same (rounded) arguments (the backends against each other:
# derivgen.tools.check.TOL's "other backend")
TENSOR_TOL = {"torch": 1e-10, "finite differences": 1e-6, "float32": 2e-5}
# the backends run_tensors judges, where they generate these layers (codegen.emit.MULTI_TARGETS;
# the C, in every layout but the position layout): each against PyTorch and finite differences,
# and the C against the NumPy
TENSOR_BACKENDS = ("numpy", "c")
# those whose second order of these layers is generated, judged by second_checks
TENSOR_SECOND_BACKENDS = ("numpy", "c")


def broadcast_shape(spec, tensor, x_shape: tuple, k: int) -> tuple:
    """The shape a tensor declared ``tensor.shape`` has for x of ``x_shape`` (``k``: a trailing
    layout's normalized axes), as the spec language defines it, with 1 on the axes it is
    broadcast over: x's own; trailing ``sample`` (x.shape[0], 1..., *normalized); channels
    ``sample`` (N, C, 1...), ``position`` (N, 1, *spatial)."""
    if tensor.shape == "x":
        return tuple(x_shape)
    if spec.layout == "trailing":
        return (x_shape[0], *(1 for _ in x_shape[1 : len(x_shape) - k]), *x_shape[len(x_shape) - k :])
    if tensor.shape == "sample":
        return (*x_shape[:2], *(1 for _ in x_shape[2:]))
    return (x_shape[0], 1, *x_shape[2:])


def declared_shape(spec, tensor, x_shape: tuple, k: int) -> tuple:
    """The shape the caller passes (the broadcast axes between a trailing layout's samples and
    features left out; a channel layout's ``sample`` tensor (N, C))."""
    full = broadcast_shape(spec, tensor, x_shape, k)
    if tensor.shape == "x" or (spec.layout == "trailing" and len(x_shape) == k + 1):
        return full
    if spec.layout == "trailing":
        return (full[0], *full[len(full) - k :])
    return full[:2] if tensor.shape == "sample" else full


@dataclass
class TensorCase:
    """One call of a tensor-family layer: arguments by name (x, tensors, parameters: float64,
    the shapes the caller passes), keyword arguments (options, inputs, buffers, training,
    num_groups), a cotangent per output (y's first), the layout and the normalized axes."""

    mode: str
    args: dict
    kw: dict
    cotangents: list
    layout: object
    k: int


def tensor_case(spec, mode: str, seed: int = 0) -> TensorCase:
    """Random arguments for ``mode`` on :data:`TENSOR_CASES`'s shapes: x ~ N(0.3, 1.3²), tensors
    ~ N(0.4, 0.8²), masks 0/1 with at least two valid elements in every group (drawn again until
    so), parameters ~ N(1, 0.4²), inputs and buffers in 0.6..1.4, options as derivgen check
    passes them (:func:`derivgen.tools.check.case_options`)."""
    import numpy as np

    from derivgen.runtime import resolve_layout
    from derivgen.tools.check import case_options

    rng = np.random.default_rng(seed)
    key = "trailing2" if spec.layout == "trailing" and spec.axes == 2 else spec.layout
    key = spec.reduce if key == "channels" else key
    x_shape, p_shape = TENSOR_CASES[key]
    kw = dict(case_options(spec, mode))
    if spec.reduce == "group":
        kw["num_groups"] = 3
    meta = {"name": spec.name, "layout": spec.layout, "reduce": spec.reduce, "params": ["p"], "axes": spec.axes}
    layout = resolve_layout(meta, np.empty(x_shape), {"p": np.empty(p_shape)}, kw.get("num_groups"))
    k = len(p_shape)
    args = {"x": rng.normal(0.3, 1.3, x_shape)}
    for t in spec.tensors:
        shape = declared_shape(spec, t, x_shape, k)
        if not t.mask:
            args[t.name] = rng.normal(0.4, 0.8, shape)
            continue
        for attempt in range(50):
            m = (rng.random(shape) < 0.7 + 0.006 * attempt).astype(np.float64)
            full = np.broadcast_to(m.reshape(broadcast_shape(spec, t, x_shape, k)), x_shape).reshape(layout.view4)
            if (full.sum(axis=layout.reduce_axes) >= min(2, layout.group_size)).all():
                break
        else:
            m = np.ones(shape)
        args[t.name] = m
    for p in spec.params:
        args[p.name] = np.asarray(rng.normal(1.0, 0.4, () if p.scalar else p_shape))
    for item in (*spec.inputs, *spec.buffers):
        kw[item.name] = rng.uniform(0.6, 1.4, layout.group_shape)
    cots = [rng.normal(size=x_shape) for _ in spec.cotangents]
    return TensorCase(mode, args, kw, cots, layout, k)


def _call_module(mod, spec, case: TensorCase, args: dict, dtype=None, cotangents=True, preallocated=False):
    """A generated module's outputs (y's first), gradients by field and the keyword arguments
    after the call (buffers updated in place), at ``args`` (cast to ``dtype``); ``cotangents``:
    pass those of the outputs beside y (else none: zero); ``preallocated``: into arrays passed
    as ``out=`` and ``outs=`` (the forward) and ``out=`` (the backward), which must be the
    arrays returned."""
    import numpy as np

    cast = (lambda a: np.asarray(a, dtype)) if dtype is not None else (lambda a: a)
    kw = {k: (cast(v).copy() if isinstance(v, np.ndarray) else v) for k, v in case.kw.items()}
    pos = [cast(args["x"]), *(cast(args[t.name]) for t in spec.tensors), *(cast(args[p.name]) for p in spec.params)]
    given = {}
    if preallocated:
        given["out"] = np.full_like(pos[0], np.nan)
        if spec.outputs:
            given["outs"] = {o.name: np.full_like(pos[0], np.nan) for o in spec.outputs}
    got, cache = mod.forward(*pos, **kw, **given)
    outs = list(got) if spec.outputs else [got]
    if preallocated and not all(a is b for a, b in zip(outs, [given["out"], *given.get("outs", {}).values()])):
        raise AssertionError("the forward did not return the arrays passed as out= and outs=")
    extra = {"d" + o.name: cast(c) for o, c in zip(spec.outputs, case.cotangents[1:])} if cotangents else {}
    if preallocated:
        first = mod.backward(cast(case.cotangents[0]), cache, **extra)
        into = {f: np.full_like(np.asarray(v), np.nan) for f, v in first._asdict().items()}
        grads = mod.backward(cast(case.cotangents[0]), cache, **extra, out=into)
        if not all(getattr(grads, f) is a for f, a in into.items()):
            raise AssertionError("the backward did not return the arrays passed as out=")
    else:
        grads = mod.backward(cast(case.cotangents[0]), cache, **extra)
    return outs, grads, kw


def _torch_tensors(spec, case: TensorCase, args: dict):
    """The spec's forward in torch float64, written from its fields alone (nothing the engine
    derived): the tensors broadcast to x's shape, the values in order, the mode's statistics with
    each mean over the group's axes of the layout's (O, G, Cg, S) view, the normalized
    coordinate, y and the outputs beside it, the buffers' updates; then autograd of the sum of
    each output times its cotangent. Returns (outputs, gradients by the backward's field names,
    buffers after the update by name)."""
    import numpy as np
    import torch

    from derivgen.spec.model import N, X
    from derivgen.tools.torch_ref import SpecForward

    layout = case.layout
    walk = SpecForward(spec, case.mode, layout)  # its expression walk: Mean over the group's axes
    wants = {"x", *(t.name for t in spec.grad_tensors), *(p.name for p in spec.params)}
    leaves = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in wants) for k, v in args.items()}
    ins = {i.name: torch.tensor(case.kw[i.name], dtype=torch.float64, requires_grad=True) for i in spec.inputs}
    x_shape = tuple(args["x"].shape)
    env: dict = {X: leaves["x"].reshape(layout.view4), N: float(layout.group_size)}
    for p in spec.params:
        env[p.symbol] = leaves[p.name].reshape(() if p.scalar else layout.param4)
    for o in spec.options:
        if case.kw.get(o.name, o.default) is not None:
            env[o.symbol] = float(case.kw.get(o.name, o.default))
    for i in spec.inputs:
        env[i.symbol] = ins[i.name].reshape(layout.stat4)
    for b in spec.buffers:
        env[b.symbol] = torch.tensor(case.kw[b.name], dtype=torch.float64).reshape(layout.stat4)
    for t in spec.tensors:
        full = leaves[t.name].reshape(broadcast_shape(spec, t, x_shape, case.k)).expand(x_shape)
        env[t.symbol] = full.reshape(layout.view4)
    for v in spec.values:  # in order, each from x, the tensors and the values before it
        env[v.symbol] = walk._eval(v.expr, env)
    mode = spec.mode(case.mode)
    for st in mode.statistics:
        env[st.symbol] = walk._eval(st.expr, env)
    if spec.normalized is not None:
        env[spec.normalized.symbol] = walk._eval(spec.normalized_expr, env)
    ones = torch.ones(layout.view4, dtype=torch.float64)
    outs = [(walk._eval(e, env) * ones).reshape(x_shape) for e in (spec.output, *(o.expr for o in spec.outputs))]
    buffers = {}
    if case.mode == "train":
        for b in spec.buffers:
            buffers[b.name] = (walk._eval(b.update, env) * torch.ones(layout.stat4, dtype=torch.float64)).detach()
    loss = sum((o * torch.tensor(c)).sum() for o, c in zip(outs, case.cotangents))
    order = [("dx", leaves["x"])]
    order += [("d" + t.name, leaves[t.name]) for t in spec.grad_tensors]
    order += [("d" + p.name, leaves[p.name]) for p in spec.params]
    order += [("d" + i.name, ins[i.name]) for i in spec.inputs]
    got = torch.autograd.grad(loss, [v for _, v in order], allow_unused=True)
    grads = {k: (g.numpy() if g is not None else np.zeros(tuple(v.shape))) for (k, v), g in zip(order, got)}
    return (
        [o.detach().numpy() for o in outs],
        grads,
        {k: v.numpy().reshape(layout.group_shape) for k, v in buffers.items()},
    )


def _tensor_fd(mod, spec, case: TensorCase, h: float = 1e-6) -> dict:
    """Central differences of L = Σ_k sum(cotangent_k · output_k) of the NumPy forward (float64)
    with respect to x, each tensor with a gradient, each parameter and each input, by the
    backward's field names."""
    import numpy as np

    def loss(args, kw) -> float:
        c = dataclasses.replace(case, kw=kw)
        pos = [args["x"], *(args[t.name] for t in spec.tensors), *(args[p.name] for p in spec.params)]
        kk = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in c.kw.items()}
        got, _ = mod.forward(*pos, **kk)
        outs = list(got) if spec.outputs else [got]
        return float(sum(np.sum(o * ct) for o, ct in zip(outs, case.cotangents)))

    out = {}
    names = ["x", *(t.name for t in spec.grad_tensors), *(p.name for p in spec.params)]
    for name in names:
        v = np.asarray(case.args[name], np.float64)
        d = np.empty_like(v)
        for idx in np.ndindex(v.shape):
            plus, minus = dict(case.args), dict(case.args)
            plus[name], minus[name] = v.copy(), v.copy()
            plus[name][idx] += h
            minus[name][idx] -= h
            d[idx] = (loss(plus, case.kw) - loss(minus, case.kw)) / (2 * h)
        out["d" + name] = d
    for i in spec.inputs:
        v = np.asarray(case.kw[i.name], np.float64)
        d = np.empty_like(v)
        for idx in np.ndindex(v.shape):
            kp, km = dict(case.kw), dict(case.kw)
            kp[i.name], km[i.name] = v.copy(), v.copy()
            kp[i.name][idx] += h
            km[i.name][idx] -= h
            d[idx] = (loss(case.args, kp) - loss(case.args, km)) / (2 * h)
        out["d" + i.name] = d
    return out


def _relative(got, want) -> float:
    """max |got - want| / max(1, max |want|); infinite where the shapes differ."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return math.inf
    if not want.size:
        return 0.0
    diff = np.where(np.isnan(got) & np.isnan(want), 0.0, np.abs(got - want))
    return float(diff.max() / max(1.0, float(np.nanmax(np.abs(want)))))


def tensor_checks(spec, mods: dict, case: TensorCase) -> list[str]:
    """Every check of one mode's call, as failures (none: all passed), for each backend of
    ``mods`` (name -> generated module): its outputs, buffers and gradients (field order dx,
    d<tensor with a gradient>, d<param>, d<input>) against autograd of :func:`_torch_tensors`;
    its gradients against central differences of its own forward (not where stop_gradient is:
    they see through it); its float32 run against its float64 run on the same rounded
    arguments; cotangents left out (None) against zeros passed; the arrays passed as out= and
    outs= against the call's own; and every backend against the first in float64 and float32."""
    import numpy as np

    from derivgen.tools.check import TOL, _stops_gradient

    bad = []
    names = ["y", *(o.name for o in spec.outputs)]
    fields = ["dx", *("d" + t.name for t in spec.grad_tensors), *("d" + p.name for p in spec.params)]
    fields += ["d" + i.name for i in spec.inputs]
    want_outs, want_grads, want_bufs = _torch_tensors(spec, case, case.args)
    want = {**dict(zip(names, want_outs)), **want_grads, **want_bufs}
    rounded = dataclasses.replace(
        case,
        args={k: np.asarray(v, np.float32).astype(np.float64) for k, v in case.args.items()},
        cotangents=[np.asarray(c, np.float32).astype(np.float64) for c in case.cotangents],
        kw={
            k: (np.asarray(v, np.float32).astype(np.float64) if isinstance(v, np.ndarray) else v)
            for k, v in case.kw.items()
        },
    )
    runs = {}  # backend -> (float64 results, float32 results) by name
    for backend, mod in mods.items():
        label = f"{case.mode} {backend}"
        outs, grads, kw = _call_module(mod, spec, case, case.args)
        if list(grads._fields) != fields:
            bad.append(f"{label}: backward returns {list(grads._fields)}, not {fields}")
            continue
        got = {**dict(zip(names, outs)), **grads._asdict(), **{b: kw[b] for b in want_bufs}}
        errs = {k: _relative(got[k], v) for k, v in want.items()}
        if not all(e <= TENSOR_TOL["torch"] for e in errs.values()):
            bad.append(f"{label} float64 torch: " + _errors(errs, TENSOR_TOL["torch"]))
        if not _stops_gradient(spec):
            fd = _tensor_fd(mod, spec, case)
            errs = {k: _relative(got[k], v) for k, v in fd.items()}
            if not all(e <= TENSOR_TOL["finite differences"] for e in errs.values()):
                bad.append(f"{label} float64 finite differences: " + _errors(errs, TENSOR_TOL["finite differences"]))
        o64, g64, _ = _call_module(mod, spec, rounded, rounded.args)
        o32, g32, _ = _call_module(mod, spec, rounded, rounded.args, dtype=np.float32)
        r64 = {**dict(zip(names, o64)), **g64._asdict()}
        r32 = {**dict(zip(names, o32)), **g32._asdict()}
        runs[backend] = (r64, r32)
        errs = {k: _relative(r32[k], r64[k]) for k in r64}
        wrong = [k for k, v in r32.items() if np.asarray(v).dtype != np.float32]
        if wrong or not all(e <= TENSOR_TOL["float32"] for e in errs.values()):
            bad.append(
                f"{label} float32: "
                + _errors(errs, TENSOR_TOL["float32"])
                + (f" (not float32: {', '.join(wrong)})" if wrong else "")
            )
        p_outs, p_grads, _ = _call_module(mod, spec, case, case.args, preallocated=True)
        if not all(np.array_equal(a, b) for a, b in zip([*p_outs, *p_grads], [*outs, *grads])):
            bad.append(f"{label}: the arrays passed as out= and outs= hold other values than the call's own")
        if not _stops_gradient(spec) and backend in TENSOR_SECOND_BACKENDS:
            bad += second_checks(spec, mod, case, label)
        if spec.outputs:  # a cotangent left out is zero
            left_out = dataclasses.replace(case, cotangents=case.cotangents[:1])
            _, g_none, _ = _call_module(mod, spec, left_out, case.args, cotangents=False)
            zeros = [case.cotangents[0], *(np.zeros_like(c) for c in case.cotangents[1:])]
            _, g_zero, _ = _call_module(mod, spec, dataclasses.replace(case, cotangents=zeros), case.args)
            if not all(np.array_equal(a, b) for a, b in zip(g_none, g_zero)):
                bad.append(f"{label}: cotangents left out are not zeros passed")
    first = next(iter(runs), None)
    for backend in list(runs)[1:]:  # the backends agree (on the same rounded arguments)
        for k, (dt, col) in enumerate((("float64", 0), ("float32", 1))):
            tol = TOL["other backend"][col]
            errs = {n: _relative(runs[backend][k][n], v) for n, v in runs[first][k].items()}
            if not all(e <= tol for e in errs.values()):
                bad.append(f"{case.mode} {backend}~{first} {dt}: " + _errors(errs, tol))
    return bad


def second_checks(spec, mod, case: TensorCase, label: str, h: float = 1e-6) -> list[str]:
    """The generated second order of one backend, as failures: ``backward_backward`` along a
    random direction u of every input of the backward (x, each tensor with a gradient, each
    parameter and input, dy and each output's cotangent) against central differences of
    L₂ = Σ δ·(the module's own backward), itself judged against PyTorch; ``jvp`` along a random
    tangent of every input of the forward against central differences of the forward."""
    import numpy as np

    rng = np.random.default_rng(7)
    arg_names = ["x", *(t.name for t in spec.grad_tensors), *(p.name for p in spec.params)]
    in_names = [i.name for i in spec.inputs]
    field = {n: ("dx" if n == "x" else "d" + n) for n in [*arg_names, *in_names]}
    seeds = {n: rng.normal(size=np.shape(case.args[n])) for n in arg_names}
    seeds.update({n: rng.normal(size=np.shape(case.kw[n])) for n in in_names})
    u = {n: rng.normal(size=np.shape(v)) for n, v in seeds.items()}
    ucot = [rng.normal(size=np.shape(c)) for c in case.cotangents]

    def moved(eps):
        args = {k: (v + eps * u[k] if k in u else v) for k, v in case.args.items()}
        kw = {k: (v + eps * u[k] if k in u else v) for k, v in case.kw.items()}
        cots = [c + eps * d for c, d in zip(case.cotangents, ucot)]
        return dataclasses.replace(case, args=args, kw=kw, cotangents=cots)

    def l2(eps) -> float:
        c = moved(eps)
        _, grads, _ = _call_module(mod, spec, c, c.args)
        return float(sum(np.sum(seeds[n] * getattr(grads, field[n])) for n in seeds))

    bad = []
    pos = [case.args["x"], *(case.args[t.name] for t in spec.tensors), *(case.args[p.name] for p in spec.params)]
    kw = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in case.kw.items()}
    _, cache = mod.forward(*pos, **kw)
    g = mod.backward_backward(
        case.cotangents[0],
        cache,
        seeds["x"],
        {p.name: seeds[p.name] for p in spec.params},
        ddinputs={n: seeds[n] for n in in_names} or None,
        **({"ddtensors": {t.name: seeds[t.name] for t in spec.grad_tensors}} if spec.multi else {}),
        **{"d" + o.name: c for o, c in zip(spec.outputs, case.cotangents[1:])},
    )
    terms = [getattr(g, field[n]) * u[n] for n in u]
    terms += [g.ddy * ucot[0], *(getattr(g, "dd" + o.name) * c for o, c in zip(spec.outputs, ucot[1:]))]
    got, scale = float(sum(np.sum(t) for t in terms)), float(sum(np.sum(np.abs(t)) for t in terms))
    fd = (l2(h) - l2(-h)) / (2 * h)
    if not abs(got - fd) <= TENSOR_TOL["finite differences"] * max(1.0, scale):
        bad.append(f"{label} backward_backward: {got:.10g} along a direction, finite differences {fd:.10g}")

    tan = {n: rng.normal(size=np.shape(case.args[n])) for n in arg_names}
    tan.update({n: rng.normal(size=np.shape(case.kw[n])) for n in in_names})

    def outputs(eps):
        args = {k: (v + eps * tan[k] if k in tan else v) for k, v in case.args.items()}
        kk = {
            k: ((v + eps * tan[k]) if k in tan else (v.copy() if isinstance(v, np.ndarray) else v))
            for k, v in case.kw.items()
        }
        got, _ = mod.forward(
            *[args["x"], *(args[t.name] for t in spec.tensors), *(args[p.name] for p in spec.params)], **kk
        )
        return list(got) if spec.outputs else [got]

    ty = mod.jvp(
        cache,
        tan["x"],
        {p.name: tan[p.name] for p in spec.params},
        tinputs={n: tan[n] for n in in_names} or None,
        **({"ttensors": {t.name: tan[t.name] for t in spec.grad_tensors}} if spec.multi else {}),
    )
    ty = list(ty) if spec.outputs else [ty]
    fd = [(a - b) / (2 * h) for a, b in zip(outputs(h), outputs(-h))]
    errs = {f"t{k}": _relative(a, b) for k, (a, b) in enumerate(zip(ty, fd))}
    if len(ty) != len(fd) or not all(e <= TENSOR_TOL["finite differences"] for e in errs.values()):
        bad.append(f"{label} jvp finite differences: " + _errors(errs, TENSOR_TOL["finite differences"]))
    return bad


def _errors(errs: dict, tol: float) -> str:
    return " ".join(f"{k}={v:.1e}" for k, v in errs.items() if not v <= tol) + f" (tol {tol:.0e})"


def run_tensors(text: str, seed: int = -1, prove_sizes=(2, 3)) -> Result:
    """A layer with tensor inputs, values or outputs beside y (the tensor family): parse,
    derive, prove at ``prove_sizes``, generate and build NumPy and C (:data:`TENSOR_BACKENDS`; a
    compiler warning fails, as for every spec), and judge every mode's call
    (:func:`tensor_checks`): each backend in float64 against PyTorch autograd of the spec's
    forward and finite differences, float32 against float64, the C against the NumPy; then the
    run-time means against the brute-force minimum. Never raises: failures are results."""
    import derivgen
    from derivgen.codegen.emit import MULTI_TARGETS
    from derivgen.spec import parse_spec

    t0 = time.perf_counter()
    try:
        spec = parse_spec(text, source=f"fuzz{seed}.toml")
        d = derivgen.derive(spec, prove=tuple(prove_sizes))
        statuses = {m: p.status for m, p in d.proofs.items()}
        bad = [f"{m} proof: {st}" for m, st in statuses.items() if st not in ("proven", "checked numerically")]
        proof = "FAILED" if bad else ("checked numerically" if "checked numerically" in statuses.values() else "proven")
        backends = [b for b in TENSOR_BACKENDS if b in MULTI_TARGETS]
        if spec.reduce == "position":  # the C kernels take tensors in no position layout (yet)
            backends = [b for b in backends if b != "c"]
        mods = {b: derivgen.load(spec, backend=b) for b in backends}
        for k, mode in enumerate(spec.modes):
            bad += tensor_checks(spec, mods, tensor_case(spec, mode.name, seed=11 + k))
        if "c" in mods and (seed < 0 or seed % CHANNELS_LAST_EVERY == 0):
            bad += channels_last_tensor_mismatches(spec)
        means, minimal = judge_means(spec, d)
        return Result(
            seed,
            not bad,
            proof,
            max(len(m.reductions) for m in d.modes.values()),
            time.perf_counter() - t0,
            "; ".join(bad),
            means,
            minimal,
        )
    except BaseException as exc:  # every failure is a finding
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return Result(seed, False, "", 0, time.perf_counter() - t0, tb[:2000])


def judge_means(spec, derivation=None) -> tuple[str, bool | None]:
    """(per mode, the engine's run-time means by kind / the brute-force minimum; whether
    every count is the minimum), from :func:`reduction_minimum`; a brute force that cannot
    tell (or fails: a finding about the judge, not about the spec's correctness) is (its
    message, None)."""
    try:
        found = reduction_minimum(spec, derivation)
    except Exception as exc:  # noqa: BLE001 - reported, never raised into the pipeline's result
        return f"not told: {type(exc).__name__}: {exc}"[:500], None
    return "; ".join(map(str, found)), all(r.at_minimum for r in found)


def run_means(text: str, seed: int = -1) -> Result:
    """Parse, derive and judge the run-time means only (no proof, no code, no checks): a quick
    survey of :func:`reduction_minimum`. Never raises."""
    import derivgen
    from derivgen.spec import parse_spec

    t0 = time.perf_counter()
    try:
        spec = parse_spec(text, source=f"fuzz{seed}.toml")
        d = derivgen.derive(spec)
        means, minimal = judge_means(spec, d)
        n = max(len(m.reductions) for m in d.modes.values())
        return Result(seed, True, "", n, time.perf_counter() - t0, "", means, minimal)
    except BaseException as exc:  # every failure is a finding
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return Result(seed, False, "", 0, time.perf_counter() - t0, tb[:2000])


def _torch_for_channels_last() -> bool:
    """Whether torch is there for the channels-last checks; its absence is an error under CI=true."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return True
    if os.environ.get("CI") == "true":
        raise RuntimeError("the channels-last check needs torch (the test extra) under CI=true")
    return False


def channels_last_mismatches(spec) -> list[str]:
    """Where a channel layout's channels-last kernels (derivgen.torch on a channels_last tensor)
    and its NCHW kernels (on the contiguous tensor) differ in any bit: y, the gradients of x and
    the parameters, the running buffers; float32, float64 and bfloat16, every mode, at 70
    channels (a block of 64 channels and 6) and 272 positions (a whole chunk of 256 that the
    batch layouts' sums take lane by lane, and a rest). Needs torch: without it the check is
    left out, except under CI=true, where that is a failure."""

    if spec.layout != "channels" or spec.inputs or (spec.buffers and spec.reduce != "batch"):
        return []  # no channels-last kernels, or no derivgen.torch module (inputs, such buffers)
    if not _torch_for_channels_last():
        return []
    import torch

    import derivgen.torch as dt
    from derivgen.tools.check import case_options

    shape = (2, 70, 16, 17)
    groups = 5 if spec.reduce == "group" else None
    opts = {k: v for k, v in case_options(spec, spec.modes[0].name).items() if k != "training"}
    bad = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        gen = torch.Generator().manual_seed(3)
        m = dt.Module(spec, shape[1], num_groups=groups, dtype=dtype, **opts)
        with torch.no_grad():
            for par in m.parameters():
                par.copy_(torch.randn(par.shape, generator=gen) * 0.3 + 1.0)
        twin = copy.deepcopy(m)
        x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
        dy = torch.randn(shape, generator=gen).to(dtype)
        for mode in spec.modes:
            m.train(mode.name == "train"), twin.train(mode.name == "train")
            xl = x.contiguous(memory_format=torch.channels_last).requires_grad_()
            xn = x.clone().requires_grad_()
            yl, yn = m(xl), twin(xn)
            gl = torch.autograd.grad(yl, [xl, *m.parameters()], dy, allow_unused=True)
            gn = torch.autograd.grad(yn, [xn, *twin.parameters()], dy, allow_unused=True)
            same = [torch.equal(yl, yn)] + [
                (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for a, b in zip(gl, gn)
            ]
            same += [torch.equal(a, b) for a, b in zip(m.buffers(), twin.buffers())]
            if not all(same):
                bad.append(f"{mode.name} channels-last {dtype}: not the NCHW bits ({same})")
    return bad


def _same_bits(a, b) -> bool:
    """Two tensors equal value for value, NaN where the other is NaN (a group a mask leaves
    empty divides by zero alike in both layouts)."""
    import torch

    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def channels_last_tensor_mismatches(spec) -> list[str]:
    """:func:`channels_last_mismatches` for a layer of the tensor family: its channels-last
    kernels (derivgen.torch on a channels_last x, tensors of x's shape channels last too) against
    its NCHW kernels, every output, the gradients of x, of the tensors with one and of the
    parameters, bit for bit; float32, float64 and bfloat16, every mode, at 70 channels and 272
    positions. A position layout has no C kernels for these layers."""

    if spec.layout != "channels" or spec.reduce == "position" or spec.inputs:
        return []
    if spec.buffers and spec.reduce != "batch":
        return []
    if not _torch_for_channels_last():
        return []
    import torch

    import derivgen.torch as dt
    from derivgen.tools.check import case_options

    shape = (2, 70, 16, 17)
    groups = 5 if spec.reduce == "group" else None
    opts = {k: v for k, v in case_options(spec, spec.modes[0].name).items() if k != "training"}
    cl = torch.channels_last
    bad = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        gen = torch.Generator().manual_seed(5)
        m = dt.Module(spec, shape[1], num_groups=groups, dtype=dtype, **opts)
        with torch.no_grad():
            for par in m.parameters():
                par.copy_(torch.randn(par.shape, generator=gen) * 0.3 + 1.0)
        twin = copy.deepcopy(m)
        x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
        tens = []
        for t in spec.tensors:
            tshape = {"x": shape, "sample": shape[:2]}.get(t.shape, (shape[0], 1, *shape[2:]))
            v = (torch.rand(tshape, generator=gen) < 0.7).double() if t.mask else torch.randn(tshape, generator=gen)
            tens.append(v.to(dtype))
        cots = [torch.randn(shape, generator=gen).to(dtype) for _ in range(1 + len(spec.outputs))]
        grads_of = [k for k, t in enumerate(spec.tensors) if t.grad and not t.mask]
        for mode in spec.modes:
            m.train(mode.name == "train"), twin.train(mode.name == "train")
            got = []
            for mod, fmt in ((m, cl), (twin, torch.contiguous_format)):
                xs = x.contiguous(memory_format=fmt).requires_grad_()
                ts = [t.contiguous(memory_format=fmt) if t.shape == shape else t.clone() for t in tens]
                ts = [t.requires_grad_(k in grads_of) for k, t in enumerate(ts)]
                outs = mod(xs, *ts)
                outs = list(outs) if spec.outputs else [outs]
                leaves = [xs, *(ts[k] for k in grads_of), *mod.parameters()]
                loss = sum((o * c.contiguous(memory_format=fmt)).sum() for o, c in zip(outs, cots))
                got.append((outs, torch.autograd.grad(loss, leaves, allow_unused=True)))
            (ol, gl), (on, gn) = got
            same = [_same_bits(a, b) for a, b in zip(ol, on)] + [
                (a is None and b is None) or (a is not None and b is not None and _same_bits(a, b))
                for a, b in zip(gl, gn)
            ]
            same += [torch.equal(a, b) for a, b in zip(m.buffers(), twin.buffers())]
            if not all(same):
                bad.append(f"{mode.name} channels-last {dtype}: not the NCHW bits ({same})")
    return bad


SECONDS = 120  # one spec's whole pipeline, in CPU seconds of its worker; longer is a finding too
# a worker whose spec has not ended this many wall-clock seconds after it started is stuck where
# no signal handler runs (inside a C kernel): the watchdog ends it (a hang, whatever the load)
HANG_SECONDS = 20 * 60
# each proof size's exact arithmetic (derivgen.prove.proof.SYMBOLIC_WORK for fuzzed specs, first and
# second order): a fortieth of the library's, so that no spec's proofs come near SECONDS
PROOF_WORK = 500_000
# the second order's brute-force proof: every k-th seed, at these sizes (its checks against
# finite differences and the other backend run for every seed, in check_layer)
SECOND_ORDER = (1, (2, 3))
# the channels-last kernels against the NCHW ones (channels_last_mismatches): every k-th seed
CHANNELS_LAST_EVERY = 1
# only derive and judge the run-time means (run_means), as --means-only asks
MEANS_ONLY = False


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout(f"took longer than {SECONDS} s of CPU time")


def _run_seed(seed: int) -> Result:
    """One seed, bounded twice: SIGPROF interrupts Python code after SECONDS of the worker's
    CPU time (not wall-clock time: a loaded machine gives the same verdict as an idle one); a
    watchdog thread (faulthandler) ends the whole worker process after HANG_SECONDS of wall
    time if the time is spent where no signal handler can run (inside a C kernel), so a hang
    is a finding, not a stuck corpus."""
    import faulthandler
    import signal

    old = signal.signal(signal.SIGPROF, _alarm)
    signal.setitimer(signal.ITIMER_PROF, SECONDS)
    faulthandler.dump_traceback_later(HANG_SECONDS, exit=True)
    try:
        return (run_means if MEANS_ONLY else run)(generate(seed), seed)
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


def _init_worker(proof_work: int, second_order=None, channels_last_every=None, means_only=False):
    import warnings

    import derivgen.prove.proof
    from derivgen.runtime.build import BuildWarning

    warnings.simplefilter("error", BuildWarning)  # a compiler warning is a finding (as -Werror)
    derivgen.prove.proof.SYMBOLIC_WORK = proof_work  # both orders: a count of work, the same verdict anywhere
    global SECOND_ORDER, CHANNELS_LAST_EVERY, MEANS_ONLY
    if second_order is not None:
        SECOND_ORDER = second_order
    if channels_last_every is not None:
        CHANNELS_LAST_EVERY = channels_last_every
    MEANS_ONLY = means_only
    _die_with_parent()


def _die_with_parent():
    """A worker ends when the process that started it does (Linux): a corpus stopped with
    Ctrl-C or kill leaves no spawned workers behind."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def run_corpus(
    seeds,
    jobs: int = 2,
    proof_work: int = PROOF_WORK,
    on_result=None,
    deadline: float | None = None,
    second_order=None,
    channels_last_every: int | None = None,
    means_only: bool = False,
) -> list[Result]:
    """Every seed through the pipeline (``means_only``: :func:`run_means`) on ``jobs`` worker processes (each spec bounded by
    SECONDS, each proof size by ``proof_work`` units of exact arithmetic); results in seed
    order. Seeds not started within ``deadline`` seconds are failures ("not run").

    Workers are *spawned*, never forked: the calling process may already run OpenMP
    kernels, and a forked child inherits libgomp's thread pool without its threads, so
    its first parallel region waits forever. A worker that dies (the watchdog, a crash in
    C) fails the seeds it held, and a fresh pool takes the rest."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    os.environ.setdefault("DERIVGEN_WERROR", "1")
    seeds = list(seeds)
    t0 = time.monotonic()
    done: dict[int, Result] = {}

    def record(r: Result):
        done[r.seed] = r
        if on_result:
            on_result(r)

    if jobs <= 1:
        _init_worker(proof_work, second_order, channels_last_every, means_only)
        for sd in seeds:
            if deadline is not None and time.monotonic() - t0 > deadline:
                record(Result(sd, False, failure=f"not run: the corpus ran out of its {deadline:.0f} s"))
                continue
            record(_run_seed(sd))
        return [done[sd] for sd in seeds]

    ctx = multiprocessing.get_context("spawn")
    todo = list(reversed(seeds))
    while todo:
        pool = ProcessPoolExecutor(
            jobs,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(proof_work, second_order, channels_last_every, means_only),
        )
        running: dict = {}
        try:
            while todo or running:
                while todo and len(running) < jobs:
                    if deadline is not None and time.monotonic() - t0 > deadline:
                        for sd in reversed(todo):
                            record(Result(sd, False, failure=f"not run: the corpus ran out of its {deadline:.0f} s"))
                        todo = []
                        break
                    sd = todo.pop()
                    running[pool.submit(_run_seed, sd)] = sd
                if not running:
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    try:
                        r = fut.result()
                    except BrokenProcessPool:
                        raise  # the seed stays in `running`: failed below
                    except Exception as exc:  # noqa: BLE001 - a result that could not come back
                        r = Result(running[fut], False, failure=f"worker error: {type(exc).__name__}: {exc}"[:2000])
                    del running[fut]
                    record(r)
        except BrokenProcessPool:
            # the pool is gone: every seed it held failed (the one that killed it among them)
            for fut, sd in running.items():
                record(
                    Result(
                        sd,
                        False,
                        failure="worker process died (a hang in C past the watchdog, "
                        "or a crash); run this seed alone to see it",
                    )
                )
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    return [done[sd] for sd in seeds]


def summary(results: list[Result], seconds: float) -> str:
    """The corpus in figures: specs passed and failed, proofs symbolic and numeric, and the
    specs whose run-time means are at the brute-force minimum (the seeds above it, and those
    the brute force could not tell, by name)."""
    ok = sum(1 for r in results if r.ok)
    sym = sum(1 for r in results if r.proof == "proven")
    num = sum(1 for r in results if r.proof == "checked numerically")
    judged = [r for r in results if r.ok]
    above = [r.seed for r in judged if r.minimal is False]
    unresolved = [r.seed for r in judged if r.minimal is None]
    out = f"{len(results)} specs in {seconds:.0f} s: {ok} passed, {len(results) - ok} failed; "
    if sym or num:
        out += f"proofs: {sym} symbolic, {num} numeric fallback ({100.0 * sym / max(1, sym + num):.1f}% symbolic); "
    out += f"run-time means at the brute-force minimum: {sum(1 for r in judged if r.minimal)} of {len(judged)}"
    if above:
        out += f"; above it: seed{'s' if len(above) > 1 else ''} {_seed_list(above)}"
    if unresolved:
        out += f"; not told: {_seed_list(unresolved)}"
    return out


def _seed_list(seeds: list[int], most: int = 40) -> str:
    return ", ".join(map(str, seeds[:most])) + (f" and {len(seeds) - most} more" if len(seeds) > most else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0-99", help="a range like 0-1999")
    ap.add_argument("--seed", type=int, help="one seed")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--show", action="store_true", help="print the spec(s)")
    ap.add_argument("--progress", action="store_true", help="a line per spec (seed, result, proof, seconds)")
    ap.add_argument(
        "--means-only",
        action="store_true",
        help="derive and judge the run-time means only (no proof, code or checks): a quick survey",
    )
    ap.add_argument(
        "--proof-work",
        type=int,
        default=PROOF_WORK,
        help="units of exact arithmetic (term pairs multiplied) per proof size before 80-digit numbers take over",
    )
    args = ap.parse_args(argv)
    if args.seed is not None:
        seeds = [args.seed]
    else:
        lo, hi = (int(v) for v in args.seeds.split("-"))
        seeds = list(range(lo, hi + 1))
    if args.show:
        for sd in seeds:
            print(f"# seed {sd}\n{generate(sd)}")
        if args.seed is not None:
            global MEANS_ONLY
            MEANS_ONLY = args.means_only
            r = _run_seed(args.seed)
            print(r)
            return 0 if r.ok and r.minimal else 1
        return 0
    t0 = time.perf_counter()

    count = [0]

    def report(r):
        count[0] += 1
        if not r.ok:
            print(f"FAIL seed {r.seed}: {r.failure}", flush=True)
        elif not r.minimal:
            print(f"{'ABOVE MINIMUM' if r.minimal is False else 'NOT TOLD'} seed {r.seed}: {r.means}", flush=True)
        elif args.progress:
            print(
                f"[{count[0]}/{len(seeds)} {time.perf_counter() - t0:.0f}s] seed {r.seed}: ok, "
                f"{r.proof + ', ' if r.proof else ''}means {r.means}, {r.seconds:.1f}s",
                flush=True,
            )

    results = run_corpus(seeds, args.jobs, args.proof_work, report, means_only=args.means_only)
    print(summary(results, time.perf_counter() - t0))
    return 0 if all(r.ok and r.minimal for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
