"""The command line: happy paths, and bad input as one line with exit code 2."""

import subprocess
import sys

import pytest

import derivgen


def run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "derivgen", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_list():
    r = run("list")
    assert r.returncode == 0
    assert [l.split()[0] for l in r.stdout.splitlines()] == derivgen.names()


def test_derive_text_to_file(tmp_path):
    out = tmp_path / "ln.txt"
    r = run("derive", "layernorm", "--format", "text", "--prove-sizes", "2-3", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "N = 3: proven" in out.read_text(encoding="utf-8")
    assert [p.name for p in tmp_path.iterdir()] == ["ln.txt"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["derive", "nosuchlayer"], "unknown layer 'nosuchlayer'"),
        (["derive", "layernorm", "--format", "docx"], "--format"),
        (["derive", "layernorm", "--prove-sizes", "1-99"], "--prove-sizes"),
        (["derive"], "NAME or --spec"),
        (["derive", "--spec", "/nonexistent/spec.toml"], "cannot read spec"),
        (["frobnicate"], "No such command"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle, tmp_path):
    r = run(*args, cwd=tmp_path)
    assert r.returncode == 2
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_pdf_missing_tool_message(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "derivgen",
            "derive",
            "rmsnorm",
            "--no-prove",
            "--pdf",
            str(tmp_path / "x.pdf"),
            "-o",
            str(tmp_path / "x.tex"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0
    assert "texlive-latex-base" in r.stderr
    assert not (tmp_path / "x.pdf").exists()
