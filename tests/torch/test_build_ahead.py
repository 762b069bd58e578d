"""derivgen.torch's first-use builds announce themselves in one line on stderr whatever
stderr is, and ``derivgen.torch.build`` does them ahead."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch.utils.cpp_extension

import derivgen.torch as dt
from derivgen.runtime.build import library_path
from derivgen.torch import ext


def test_the_extension_build_says_what_how_long_and_where(monkeypatch, capsys, tmp_path):
    """One line on stderr (pytest's capture is not a terminal), before the compiler runs."""
    monkeypatch.setenv("DERIVGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(ext, "_STATE", {})
    seen = []

    def fake_load(name, sources, **kw):
        seen.append(capsys.readouterr().err)  # what was printed before the build started
        return types.SimpleNamespace(__file__=str(Path(kw["build_directory"]) / f"{name}.so"))

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    mod = ext.module()
    assert mod is not None and len(seen) == 1
    lines = seen[0].splitlines()
    assert len(lines) == 1, lines
    assert "C++ extension" in lines[0] and f"about {ext.TOOK}" in lines[0]
    assert f"cached in {tmp_path / 'torch_ext'}" in lines[0]
    assert ext.module() is mod and capsys.readouterr().err == ""  # once per process


def test_build_ahead_returns_the_libraries(monkeypatch, capsys):
    fake = types.SimpleNamespace(__file__="/cache/torch_ext/x/x.so")
    monkeypatch.setattr(ext, "module", lambda: fake)
    paths = dt.build("layernorm", "rmsnorm")
    assert paths[0] == Path(fake.__file__)
    lay = dt.layer("layernorm").libraries.main
    assert paths[1] == library_path(lay.source, extra=lay.extra, cflags=lay.cflags)
    assert all(p.is_file() for p in paths[1:]) and len(paths) == 3
    assert dt.build(extension=False) == []


def test_build_ahead_names_an_extension_it_cannot_build(monkeypatch):
    monkeypatch.setattr(ext, "module", lambda: None)
    monkeypatch.setenv("DERIVGEN_TORCH_EXT", "1")
    with pytest.raises(RuntimeError, match="could not be built"):
        dt.build()
    monkeypatch.setenv("DERIVGEN_TORCH_EXT", "0")  # turned off: nothing to build
    assert dt.build() == []
