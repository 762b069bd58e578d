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
uses for its locals.

``run(text)`` parses, derives, proves at N = 2, 3, generates NumPy and C,
compiles the C (a compiler warning fails the spec, as ``-Werror`` would), and checks both
backends in float32 and float64 against float64 finite differences and each
other (:func:`derivgen.tools.check.check_layer`); a channel layout's channels-last
kernels must give its NCHW kernels' bits (:func:`channels_last_mismatches`).

    python tests/specfuzz.py --seeds 0-1999 --jobs 2      # the larger corpus (make fuzz)
    python tests/specfuzz.py --seed 17 --show             # one spec, printed
"""

from __future__ import annotations

import argparse
import copy
import functools
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

    def toml(self, name: str) -> str:
        def tbl(items):
            return "\n".join(f"{k} = {v}" for k, v in items)

        out = [f'name = "{name}"', 'title = "Fuzzed layer"', "[layout]", tbl(self.layout.items())]
        for head, items in (
            ("params", self.params),
            ("options", self.options),
            ("inputs", self.inputs),
            ("buffers", self.buffers),
        ):
            if items:
                out += [f"[{head}]", tbl(items)]
        if self.stats:
            out += ["[statistics]", tbl((k, f'"{v}"') for k, v in self.stats)]
        if self.min_group > 1:
            out += ["[modes.train]", f"min_group_size = {self.min_group}"]
        if self.eval_stats:
            out += ["[modes.eval.statistics]", tbl((k, f'"{v}"') for k, v in self.eval_stats)]
        if self.normalized:
            out += ["[normalized]", f'name = "{self.normalized[0]}"', f'expr = "{self.normalized[1]}"']
        out += ["[output]", f'y = "{self.output}"']
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
    if seed >= BLOCK_SEEDS:  # the block family: a layout whose groups hold blocks (seed alone again)
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
    _selections_and_friends(random.Random(seed * 7919 + 17), s, names, kind, z, terms)
    _leading_masks(random.Random(seed * 104729 + 31), s, names, kind, z, xh, terms, eps)
    _windows(random.Random(seed * 15485863 + 47), s, names, kind, z, terms)
    if seed >= BLOCK_SEEDS:
        _blocks(random.Random(seed * 32452843 + 59), s, names, kind, terms, eps, c)
    s.output = " + ".join(terms)
    return s.toml(f"fuzz{seed}")


def _selections_and_friends(rng: random.Random, s: _Spec, names: Names, kind: str, z: str, terms: list[str]) -> None:
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
    if rng.random() < 0.12:  # a group maximum or minimum (any layout)
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


# ------------------------------------------------------------------ the pipeline


@dataclass
class Result:
    seed: int
    ok: bool
    proof: str = ""  # "proven" / "checked numerically" / "FAILED"
    reductions: int = 0
    seconds: float = 0.0
    failure: str = ""


@functools.cache  # the suite's corpora share seeds
def features(seed: int) -> frozenset[str]:
    """What seed's spec exercises (:func:`text_features`)."""
    return text_features(generate(seed), f"fuzz{seed}.toml")


def text_features(text: str, source: str = "spec.toml") -> frozenset[str]:
    """What a spec exercises: its layout and reduction, each function its formulas call
    (mean and sum included), each table its text has ([inputs], [buffers],
    [modes.eval.statistics], [normalized], ...), its kinds of parameter (role, scalar shape)
    and of block statistic. :func:`covering` picks a corpus's sample by them."""
    from derivgen.spec.model import parse_spec

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
    return frozenset(out)


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
    """Parse, derive, prove, generate, compile, check. Never raises: failures are results."""
    from derivgen.spec.model import parse_spec
    from derivgen.tools.check import check_layer

    t0 = time.perf_counter()
    try:
        spec = parse_spec(text, source=f"fuzz{seed}.toml")
        rows = check_layer(spec, prove_sizes=prove_sizes)
        import derivgen

        d = derivgen.derive(spec, prove=tuple(prove_sizes))
        from derivgen.prove.proof import prove_second_mode

        every, sizes2 = SECOND_ORDER
        if any(m.blocks for m in spec.modes):  # a grid of 2*2*N elements at most: N = 2 is enough
            sizes2 = sizes2[:1]
        second = (
            {m: prove_second_mode(d.second(m), sizes2, symbolic_seconds=5.0) for m in d.modes}
            if seed < 0 or seed % every == 0
            else {}
        )
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
        return Result(
            seed,
            not bad and not bad2 and not bad3,
            proof,
            max(len(m.reductions) for m in d.modes.values()),
            time.perf_counter() - t0,
            fail,
        )
    except BaseException as exc:  # every failure is a finding
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return Result(seed, False, "", 0, time.perf_counter() - t0, tb[:2000])


def channels_last_mismatches(spec) -> list[str]:
    """Where a channel layout's channels-last kernels (derivgen.torch on a channels_last tensor)
    and its NCHW kernels (on the contiguous tensor) differ in any bit: y, the gradients of x and
    the parameters, the running buffers; float32, float64 and bfloat16, every mode, at 70
    channels (a block of 64 channels and 6) and 272 positions (a whole chunk of 256 that the
    batch layouts' sums take lane by lane, and a rest). Needs torch: without it the check is
    left out, except under CI=true, where that is a failure."""
    import importlib.util

    if spec.layout != "channels" or spec.inputs or (spec.buffers and spec.reduce != "batch"):
        return []  # no channels-last kernels, or no derivgen.torch module (inputs, such buffers)
    if importlib.util.find_spec("torch") is None:
        if os.environ.get("CI") == "true":
            raise RuntimeError("the channels-last check needs torch (the test extra) under CI=true")
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


SECONDS = 120  # one spec's whole pipeline; longer is a finding too
# the second order's brute-force proof: every k-th seed, at these sizes (its checks against
# finite differences and the other backend run for every seed, in check_layer)
SECOND_ORDER = (1, (2, 3))
# the channels-last kernels against the NCHW ones (channels_last_mismatches): every k-th seed
CHANNELS_LAST_EVERY = 1


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout(f"took longer than {SECONDS} s")


def _run_seed(seed: int) -> Result:
    """One seed, bounded twice: SIGALRM interrupts Python code after SECONDS; a watchdog
    thread (faulthandler) ends the whole worker process 30 s later if the time is spent
    where no signal handler can run (inside a C kernel), so a hang is a finding, not a
    stuck corpus."""
    import faulthandler
    import signal

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS)
    faulthandler.dump_traceback_later(SECONDS + 30, exit=True)
    try:
        return run(generate(seed), seed)
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _init_worker(proof_seconds: float, second_order=None, channels_last_every=None):
    import warnings

    import derivgen.prove.proof
    from derivgen.runtime.build import BuildWarning

    warnings.simplefilter("error", BuildWarning)  # a compiler warning is a finding (as -Werror)
    derivgen.prove.proof.SYMBOLIC_SECONDS = proof_seconds
    global SECOND_ORDER, CHANNELS_LAST_EVERY
    if second_order is not None:
        SECOND_ORDER = second_order
    if channels_last_every is not None:
        CHANNELS_LAST_EVERY = channels_last_every
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
    proof_seconds: float = 10.0,
    on_result=None,
    deadline: float | None = None,
    second_order=None,
    channels_last_every: int | None = None,
) -> list[Result]:
    """Every seed through the pipeline on ``jobs`` worker processes (each spec bounded by
    SECONDS, each proof size by ``proof_seconds`` of symbolic reduction); results in seed
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
        _init_worker(proof_seconds, second_order, channels_last_every)
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
            jobs, mp_context=ctx, initializer=_init_worker, initargs=(proof_seconds, second_order, channels_last_every)
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
    ok = sum(1 for r in results if r.ok)
    sym = sum(1 for r in results if r.proof == "proven")
    num = sum(1 for r in results if r.proof == "checked numerically")
    return (
        f"{len(results)} specs in {seconds:.0f} s: {ok} passed, {len(results) - ok} failed; "
        f"proofs: {sym} symbolic, {num} numeric fallback ({100.0 * sym / max(1, sym + num):.1f}% symbolic)"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0-99", help="a range like 0-1999")
    ap.add_argument("--seed", type=int, help="one seed")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--show", action="store_true", help="print the spec(s)")
    ap.add_argument("--progress", action="store_true", help="a line per spec (seed, result, proof, seconds)")
    ap.add_argument(
        "--proof-seconds",
        type=float,
        default=10.0,
        help="symbolic reduction per proof size before exact numbers take over",
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
            r = _run_seed(args.seed)
            print(r)
            return 0 if r.ok else 1
        return 0
    t0 = time.perf_counter()

    count = [0]

    def report(r):
        count[0] += 1
        if not r.ok:
            print(f"FAIL seed {r.seed}: {r.failure}", flush=True)
        elif args.progress:
            print(
                f"[{count[0]}/{len(seeds)} {time.perf_counter() - t0:.0f}s] seed {r.seed}: ok, {r.proof}, "
                f"{r.reductions} reduction(s), {r.seconds:.1f}s",
                flush=True,
            )

    results = run_corpus(seeds, args.jobs, args.proof_seconds, report)
    print(summary(results, time.perf_counter() - t0))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
