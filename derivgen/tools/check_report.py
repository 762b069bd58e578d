"""``derivgen check``'s rows as a text table that fits 100 columns, and as JSON."""

from __future__ import annotations

from dataclasses import asdict

from derivgen.tools.check import NO_FD, Row

# the table's short names of the checks and of the longer statuses (JSON keeps the full ones)
_SHORT_CHECK = {
    "spec + finite differences": "spec + FD",
    "second order: finite differences": "2nd order FD",
    "torch": "torch",
    "torch second order": "2nd order torch",
    "other backend": "other backend",
}
_SHORT_STATUS = {
    "ok (checked numerically)": "ok (numerically)",
    "skipped: torch not installed": "skipped: no torch",
    NO_FD: "n/a: stop_gradient",
    "ok (y only: stop_gradient)": "ok (y only)",
    "FAIL: torch not installed (CI=true)": "FAIL: no torch (CI)",
}
WIDTH = 100


def format_table(rows: list[Row]) -> str:
    """The rows as an aligned text table that fits 100 columns: per row its largest relative
    error and the output it is in (``--json`` gives every output's), the tolerance and the status."""
    head = ("layer", "mode", "backend", "dtype", "check", "worst rel. error", "tol", "status")
    body = []
    for r in rows:
        worst = max(r.errors.items(), key=lambda kv: kv[1]) if r.errors else None
        err = f"{worst[1]:.1e} {worst[0]}" if worst else "-"
        body.append(
            (
                r.layer,
                r.mode,
                r.backend,
                {"float32": "f32", "float64": "f64"}.get(r.dtype, r.dtype),
                _SHORT_CHECK.get(r.check, r.check),
                err,
                f"{r.tol:.0e}" if r.tol is not None else "-",
                _SHORT_STATUS.get(r.status, r.status),
            )
        )
    table = [list(t) for t in (head, *body)]
    lines = []

    def width() -> int:
        return sum(max(len(str(t[i])) for t in table) for i in range(len(table[0]))) + 2 * (len(table[0]) - 1)

    if width() > WIDTH and len({r.layer for r in rows}) == 1:
        # one layer with a long name: name it once above, not on every line
        lines.append(f"layer {rows[0].layer}")
        table = [t[1:] for t in table]
    if width() > WIDTH:  # the tolerances are per check and dtype (docs/cli.md): drop their column
        at = table[0].index("tol")
        table = [t[:at] + t[at + 1 :] for t in table]
    err = table[0].index("worst rel. error")
    while width() > WIDTH and max(len(t[err]) for t in table[1:]) > 8:  # shorten the outputs' names
        cut = max(len(t[err]) for t in table[1:]) - 1
        for t in table[1:]:
            t[err] = t[err] if len(t[err]) <= cut else t[err][: cut - 1] + "…"
    widths = [max(len(str(t[i])) for t in table) for i in range(len(table[0]))]
    for row in table:
        line = "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
        lines.append(line if len(line) <= WIDTH else line[: WIDTH - 1] + "…")
    return "\n".join(lines)


def rows_json(rows: list[Row]) -> list[dict]:
    """The rows as JSON-ready dicts, each with its ``failed``."""
    return [dict(asdict(r), failed=r.failed) for r in rows]
