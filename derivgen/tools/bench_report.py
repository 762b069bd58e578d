"""``derivgen bench``'s report as text that fits 100 columns, and as a chart."""

from __future__ import annotations

import io
import math
import textwrap

from derivgen.runtime.fsutil import atomic_write
from derivgen.tools.bench_targets import target_lines


def header_lines(report: dict) -> list[str]:
    """The report's preamble: the machine, each C build, the bandwidth probe, what 'bound' means."""
    m = report["machine"]
    caches = (
        ", ".join(f"{k} {v >> 20} MiB" if v >= 1 << 20 else f"{k} {v >> 10} KiB" for k, v in m["caches"].items())
        or "caches unknown"
    )
    lines = [f"machine: {m['cpu']}; {m['cores']} core(s); {caches}; CPU flags: {' '.join(m['flags']) or '-'}"]
    for b in report["builds"]:
        what = f"skipped ({b['skipped']})" if b["skipped"] else f"targets {b['isa'] or '?'}"
        lines.append(f"{b['label']}: CFLAGS {' '.join(b['cflags'])}; {what}")
    bw = report["bandwidth"]
    if bw.get("cases"):
        lo, hi = bw["copy_GBps_range"]
        lines.append(
            f"bandwidth probe ({bw['MiB']} MiB arrays, {report['threads']} thread(s), beside each case): "
            f"copy {bw['copy_GBps']:.1f} GB/s median ({lo:.1f}-{hi:.1f}), streaming-store copy "
            f"{bw['stream_copy_GBps']:.1f} GB/s; dtype {report['dtype']}; "
            f"malloc {'tuned' if report['tuned_malloc'] else 'default'}"
        )
    lines.append(
        "bound = bytes moved (fwd: x, y; bwd: x, dy, dx) / copy bandwidth probed beside each case; "
        "'nt' = the same with the streaming-store copy; every array 64-byte aligned (as torch allocates "
        "and derivgen allocates outputs), shared by all implementations"
    )
    return lines


def format_report(report: dict) -> str:
    """The report as text that fits 100 columns: the preamble, the timings, the ratios to the
    bandwidth bounds, and the targets."""
    lines = [_wrap(line) for line in header_lines(report)] + [""]

    def f(v: float | None, fmt: str = "{:.2f}") -> str:
        """A cell: the value formatted, or '-'."""
        return "-" if v is None else fmt.format(v)

    def key(r: dict) -> tuple:
        return (r["layer"], "x".join(map(str, r["shape"])), r["impl"])

    res = report["results"]
    times = [
        ("layer", "shape", "impl", "fwd ms", "bwd ms", "fwd+bwd ms", "alloc ms", "x torch"),
        *(
            (
                *key(r),
                f(r["fwd_ms"]),
                f(r["bwd_ms"]),
                f(r["step_ms"]),
                f(r["step_alloc_ms"]),
                f(r["ratios"].get("step_vs_torch")),
            )
            for r in res
        ),
    ]
    bounds = [
        ("layer", "shape", "impl", "x bound", "fwd x bnd", "bwd x bnd", "fwd x nt", "bwd x nt"),
        *(
            (
                *key(r),
                *(
                    f(r["ratios"].get(k))
                    for k in (
                        "step_vs_bound",
                        "fwd_vs_bound",
                        "bwd_vs_bound",
                        "fwd_vs_stream_bound",
                        "bwd_vs_stream_bound",
                    )
                ),
            )
            for r in res
        ),
    ]
    fused = [r for r in res if "fwd_vs_eager" in r["ratios"]]
    tables = [times, bounds]
    if fused:  # the fused layers: each phase timed in the same rounds as PyTorch's
        tables.append(
            [
                ("layer", "shape", "impl", "fwd ms", "bwd ms", "fwd x eager", "bwd x eager", "fwd x compile")
                + ("bwd x compile", "fwd x floor", "bwd x floor"),
                *(
                    (
                        *key(r),
                        *(
                            f(r["ratios"].get(k))
                            for k in (
                                "same_round_fwd_ms",
                                "same_round_bwd_ms",
                                "fwd_vs_eager",
                                "bwd_vs_eager",
                                "fwd_vs_compile",
                                "bwd_vs_compile",
                                "fwd_vs_floor",
                                "bwd_vs_floor",
                            )
                        ),
                    )
                    for r in fused
                ),
            ]
        )
    for table in tables:
        widths = [max(len(str(x[i])) for x in table) for i in range(len(table[0]))]
        lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        lines.append("")
    lines += [_wrap(line) for line in target_lines(report)]
    return "\n".join(lines)


def _wrap(line: str) -> str:
    """A line of prose folded to 100 columns (continuations indented)."""
    return textwrap.fill(line, 100, subsequent_indent="    ", break_on_hyphens=False) if len(line) > 100 else line


def plot(report: dict, path: str) -> None:
    """A bar chart (PNG, log scale) of every implementation's forward + backward per case;
    RuntimeError without matplotlib."""
    try:  # imported here: matplotlib is an optional dependency (derivgen[plot])
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    res = report["results"]
    cases = []
    for r in res:
        k = f"{r['layer']}\n{'x'.join(map(str, r['shape']))}"
        if k not in cases:
            cases.append(k)
    impls = list(dict.fromkeys(r["impl"] for r in res))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 4.5))
    w = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        vals = []
        for k in cases:
            r = next(
                (q for q in res if f"{q['layer']}\n{'x'.join(map(str, q['shape']))}" == k and q["impl"] == impl), None
            )
            vals.append((r["step_ms"] or r["step_alloc_ms"]) if r else math.nan)
        ax.bar([j + (i - (len(impls) - 1) / 2) * w for j in range(len(cases))], vals, w, label=impl)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, fontsize=8)
    ax.set_ylabel("forward + backward, ms (median)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"derivgen bench ({report['dtype']}, {report['threads']} threads)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    atomic_write(path, buf.getvalue())
