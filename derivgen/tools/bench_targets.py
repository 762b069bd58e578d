"""The project's speed targets: the catalogue layers' bench shapes (the first of each is the one
the targets judge), the limits against PyTorch, the streaming-store bound and plain NumPy, and
each report's targets judged, met or missed (below this machine's memory floor or not)."""

from __future__ import annotations

# the catalogue layers' bench shapes; the first one of each is the one the targets judge
DEFAULT_SHAPES = {
    "layernorm": [(8192, 1024), (512, 8192), (65536, 128), (16384, 256)],
    "rmsnorm": [(8192, 1024), (512, 8192), (65536, 128)],
    "online_layernorm": [(8192, 1024)],
    "batchnorm": [(32, 64, 56, 56)],
    "instancenorm": [(32, 64, 56, 56)],
    "groupnorm": [(32, 64, 56, 56)],
}
# targets (2 threads, preallocated outputs): C fwd+bwd / torch, per (layer, shape, dtype);
# shape None is the layer's first bench shape
TORCH_TARGETS = [
    ("layernorm", (8192, 1024), "float32", 0.75),
    ("layernorm", (65536, 128), "float32", 0.9),
    ("layernorm", (16384, 256), "float32", 0.9),
    ("layernorm", (512, 8192), "float32", 0.8),
    ("groupnorm", None, "float32", 0.7),
    ("rmsnorm", None, "float32", 0.2),
    ("batchnorm", None, "float32", 0.5),
    ("instancenorm", None, "float32", 0.5),
    ("layernorm", (8192, 1024), "float64", 0.8),
]
# targets for the forward and the backward each / the streaming-store bound, per (layer, shape):
# long rows 1.2, short rows (several in flight per sweep) 1.5, channel layouts 1.3
NT_TARGETS = [
    ("layernorm", (8192, 1024), 1.2),
    ("layernorm", (512, 8192), 1.2),
    ("layernorm", (65536, 128), 1.5),
    ("layernorm", (16384, 256), 1.5),
    ("rmsnorm", None, 1.2),
    ("online_layernorm", None, 1.2),
    ("groupnorm", None, 1.3),
    ("instancenorm", None, 1.3),
    ("batchnorm", None, 1.3),
]
NUMPY_TARGET = 0.6  # generated NumPy layer norm fwd+bwd / plain NumPy (float32, first shape)


def evaluate_targets(report: dict) -> list[dict]:
    """Every target that this report's rows can judge, per C build."""
    res, dtype = report["results"], report["dtype"]
    # the project's targets: catalogue layers at their default shapes (a first shape is the
    # layer's first default one), whatever else the run timed
    first = {layer: shapes[0] for layer, shapes in DEFAULT_SHAPES.items()}
    out = []

    def row(layer: str, shape: tuple, impl: str) -> dict | None:
        """The report's row of one layer, shape and implementation, if it has one."""
        return next((q for q in res if q["layer"] == layer and tuple(q["shape"]) == shape and q["impl"] == impl), None)

    c_labels = [b["label"] for b in report["builds"] if not b["skipped"]]
    for label in c_labels:
        for layer, shape, dt, limit in TORCH_TARGETS:
            shape = first.get(layer) if shape is None else shape
            r = row(layer, shape, label) if dt == dtype else None
            if r is None or "step_vs_torch" not in r["ratios"]:
                continue
            v = r["ratios"]["step_vs_torch"]
            t = row(layer, shape, "torch")
            out.append(
                {
                    "build": label,
                    "what": f"{layer} {'x'.join(map(str, shape))} fwd+bwd / torch",
                    "value": v,
                    "limit": limit,
                    "met": v <= limit,
                    "floor": t["ratios"].get("floor_vs_torch") if t else None,
                }
            )
        for layer, shape, limit in NT_TARGETS:
            shape = first.get(layer) if shape is None else shape
            r = row(layer, shape, label) if dtype == "float32" else None
            if r is None:
                continue
            for ph, word in (("fwd", "forward"), ("bwd", "backward")):
                v = r["ratios"][f"{ph}_vs_stream_bound"]
                out.append(
                    {
                        "build": label,
                        "what": f"{layer} {'x'.join(map(str, shape))} {word} / streaming-store bound",
                        "value": v,
                        "limit": limit,
                        "met": v <= limit,
                    }
                )
    shape = first.get("layernorm")
    r = row("layernorm", shape, "generated numpy") if shape and dtype == "float32" else None
    if r is not None:
        v = r["ratios"]["step_vs_plain_numpy"]
        out.append(
            {
                "build": "generated numpy",
                "what": f"layernorm {'x'.join(map(str, shape))} fwd+bwd / plain numpy",
                "value": v,
                "limit": NUMPY_TARGET,
                "met": v <= NUMPY_TARGET,
            }
        )
    return out


def missed_below_floor(met: bool, limit: float | None, floor: float | None) -> bool:
    """Whether a target (``limit``) was missed asking for less time than this machine's
    memory floor (both as fractions of torch's time)."""
    return not met and limit is not None and floor is not None and limit < floor


def _below_floor(target: dict) -> bool:
    """:func:`missed_below_floor` of one of :func:`evaluate_targets`' targets."""
    return missed_below_floor(target["met"], target["limit"], target.get("floor"))


def target_lines(report: dict) -> list[str]:
    """The project's targets this report can judge, each met or MISSED, and how many were met."""
    targets = report.get("targets") or evaluate_targets(report)
    if not targets:
        return ["targets: none of this run's cases has one"]
    out = [
        f"targets ({report['dtype']}, {report['threads']} thread(s), preallocated outputs; the targets are set for float32, 2 threads):"
    ]
    # a table under each build's name, so that a line fits 100 columns unfolded
    width = max(len(t["what"]) for t in targets)
    build = None
    for t in targets:
        if t["build"] != build:
            build = t["build"]
            out.append(f"  {build}:")
        out.append(f"    {t['what']:<{width}}  {t['value']:.2f} (<= {t['limit']})  {'met' if t['met'] else 'MISSED'}")
        if _below_floor(t):
            out.append(f"      below this machine's memory floor, {t['floor']:.2f} of torch")
    met = sum(t["met"] for t in targets)
    unreachable = sum(map(_below_floor, targets))
    out.append(
        f"  {met} of {len(targets)} met"
        + (
            f"; {unreachable} missed below the memory floor (bytes moved / the faster copy probe)"
            if unreachable
            else ""
        )
    )
    return out
