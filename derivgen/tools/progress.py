"""A progress bar on stderr for the commands that run many steps."""

from __future__ import annotations

import sys
from collections.abc import Callable


def stderr_progress(total: int) -> Callable[[str], None]:
    """A progress callback for ``total`` steps on stderr: a bar redrawn in place on a terminal,
    nothing otherwise (pipes and logs stay clean); its ``done()`` clears the bar."""
    state = {"n": 0}
    tty = sys.stderr.isatty()

    def step(label: str) -> None:
        """One step done, ``label`` saying which."""
        state["n"] += 1
        n = state["n"]
        bar = "#" * int(24 * n / max(total, 1))
        msg = f"[{bar:<24}] {n}/{total} {label}"
        if tty:
            sys.stderr.write("\r\033[K" + msg[:100])
            sys.stderr.flush()

    def done() -> None:
        """Clear the bar (on a terminal)."""
        if tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

    step.done = done
    return step
