"""A first-use compile says so on a terminal, and stays quiet in a pipe (derivgen.runtime.build)."""

import io

from derivgen.runtime import build


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_only(monkeypatch):
    tty = _Terminal()
    monkeypatch.setattr(build.sys, "stderr", tty)
    build._progress("derivgen: compiling layernorm.c")
    assert tty.getvalue() == "derivgen: compiling layernorm.c\n"
    pipe = io.StringIO()
    monkeypatch.setattr(build.sys, "stderr", pipe)
    build._progress("derivgen: compiling layernorm.c")
    assert pipe.getvalue() == ""
