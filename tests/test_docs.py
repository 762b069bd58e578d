"""The documentation runs: every ```bash, ```console and ```python block of README.md and
docs/*.md is executed, and its printed output compared where the document shows it.

One test per document; its blocks run in order in the directory the README puts its reader
in, the clone's root (its Install section: ``git clone ... && cd derivgen``), so that a
command such as ``derivgen generate --spec my.toml`` meets what it meets there (the
catalogue's ``generated/``). That directory is a fresh copy for each document (so a tutorial
may write a file in one block and use it in the next, and nothing lands in the clone):
``generated/`` copied, every other entry of the clone's root linked, and the virtual
environment's ``derivgen`` first on PATH.

* ```console: lines ``$ command`` (a trailing ``\\`` continues one) and the output the
  document shows after each, compared line by line: ``...`` alone matches any lines (or
  none), ``...`` inside a line any text; trailing blanks are ignored. A command must exit 0
  unless the output it shows contains ``error:``. The one line a first-use build prints
  on stderr (``derivgen: compiling ... (first use, about ...; cached in ...)``) is left out
  of the comparison: it appears only while the build cache is cold.
* ```bash: run with ``bash -euo pipefail``; it must exit 0.
* ```python: run as a script in the directory (exit 0); a block of ``>>>`` lines runs as a
  doctest (ELLIPSIS and NORMALIZE_WHITESPACE on).
* An HTML comment on the line before a block steers it: ``<!-- doc-test: skip (why) -->``
  leaves it out (only for what takes minutes or needs the network: the reason is
  required, and ``test_skips_say_why`` lists them); ``<!-- doc-test: write NAME -->``
  writes the block (any language) to the file NAME instead of running it.

Blocks that use PyTorch are skipped when it is not installed, and fail under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import FIRST_USE, ROOT

from derivgen.runtime.build import announce

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = ("bash", "console", "python")
ANNOTATION = re.compile(r"<!--\s*doc-test:\s*(skip|write)\b\s*(.*?)\s*-->")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
BIN = Path(sys.executable).parent


@dataclass
class Block:
    """One fenced block: its language, text, first line number and annotation."""

    lang: str
    text: str
    line: int
    action: str = "run"  # run, skip or write
    arg: str = ""


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the annotation on the line before each."""
    out: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        block = Block(lang, "\n".join(body) + "\n", start + 1)
        prev = lines[start - 1] if start else ""
        a = ANNOTATION.search(prev)
        if a:
            block.action, block.arg = a.group(1), a.group(2)
        out.append(block)
        i += 1
    return out


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONHASHSEED"] = "0"
    env.pop("COLUMNS", None)
    return env


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401 -- only whether it imports
    except ImportError:
        return False
    return True


def _match(expected: list[str], got: list[str]) -> bool:
    """Whether ``got`` matches ``expected`` (``...`` lines and in-line ``...`` as wildcards)."""
    if not expected:
        return not got
    head, rest = expected[0], expected[1:]
    if head.strip() == "...":
        return any(_match(rest, got[k:]) for k in range(len(got) + 1))
    if not got:
        return False
    pattern = ".*".join(re.escape(part) for part in head.rstrip().split("..."))
    return re.fullmatch(pattern, got[0].rstrip()) is not None and _match(rest, got[1:])


def _commands(text: str) -> list[tuple[str, list[str]]]:
    """A console block's (command, expected output lines)."""
    out: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            raise AssertionError(f"console block: expected a '$ ' command line, got {lines[i]!r}")
        cmd = lines[i][2:]
        while cmd.endswith("\\") and i + 1 < len(lines):
            i += 1
            cmd = cmd[:-1] + " " + lines[i].strip()
        i += 1
        expected = []
        while i < len(lines) and not lines[i].startswith("$ "):
            expected.append(lines[i])
            i += 1
        while expected and not expected[-1].strip():
            expected.pop()
        out.append((cmd, expected))
    return out


# entries of the clone's root that a document's commands may write into: copied, not linked
WRITTEN = ("generated",)
NOT_COPIED = {".git", ".venv", ".pytest_cache", ".ruff_cache", "build", "__pycache__"}


def clone_root(where: Path) -> Path:
    """A stand-in for the clone's root in ``where``: ``generated/`` copied, every other
    entry of the clone (``derivgen/``, ``examples/``, ``pyproject.toml`` ...) linked."""
    where.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name in NOT_COPIED or entry.name.endswith(".egg-info"):
            continue
        if entry.name in WRITTEN:
            shutil.copytree(entry, where / entry.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (where / entry.name).symlink_to(entry)
    return where


def _where(path: Path, block: Block) -> str:
    return f"{path.relative_to(ROOT)}:{block.line}"


def run_block(path: Path, block: Block, cwd: Path) -> None:
    """Run one block in ``cwd``; an AssertionError says where and what differed."""
    env = _env()
    where = _where(path, block)
    if block.lang == "console":
        for cmd, expected in _commands(block.text):
            r = subprocess.run(
                ["bash", "-o", "pipefail", "-c", cmd + " 2>&1"],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            out = r.stdout.rstrip("\n").splitlines() if r.stdout.strip() else []
            got = [line for line in out if not FIRST_USE.match(line)]
            if r.returncode != 0 and not any("error:" in e for e in expected):
                raise AssertionError(f"{where}: `{cmd}` exited {r.returncode}:\n{r.stdout}")
            if expected and not _match(expected, got):
                raise AssertionError(
                    f"{where}: `{cmd}` printed\n"
                    + "\n".join(got)
                    + "\n--- but the document shows\n"
                    + "\n".join(expected)
                )
        return
    if block.lang == "bash":
        r = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.text],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, f"{where}: exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        return
    script = cwd / f"_doc_block_{block.line}.py"
    script.write_text(block.text, encoding="utf-8")
    if re.search(r"^>>> ", block.text, re.MULTILINE):
        args = [sys.executable, "-m", "doctest", "-o", "ELLIPSIS", "-o", "NORMALIZE_WHITESPACE", script.name]
        script.rename(script.with_suffix(".txt"))
        args[-1] = script.with_suffix(".txt").name
    else:
        args = [sys.executable, script.name]
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{where}: exited {r.returncode}:\n{r.stdout}\n{r.stderr}"


def _needs_torch(block: Block) -> bool:
    """Whether a block uses PyTorch, or shows output that needs it (check's torch rows)."""
    return bool(re.search(r"\btorch\b", block.text))


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_document_runs(path, tmp_path):
    tmp_path = clone_root(tmp_path / "derivgen")
    have_torch = _torch_available()
    ran = 0
    without_torch = []
    for block in blocks(path):
        if block.action == "write":
            target = tmp_path / block.arg
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text, encoding="utf-8")
            continue
        if block.lang not in RUN or block.action == "skip":
            continue
        if _needs_torch(block) and not have_torch:
            if IN_CI:
                pytest.fail(f"{_where(path, block)} needs PyTorch, which is not installed (CI=true)")
            without_torch.append(_where(path, block))
            continue
        run_block(path, block, tmp_path)
        ran += 1
    assert ran or path.name != "README.md", "the README has no block that runs"
    if without_torch:  # the others ran; these say so rather than pass
        pytest.skip(f"PyTorch is not installed: {', '.join(without_torch)} did not run")


def test_skips_say_why():
    """Every skipped block gives its reason, and only blocks of the languages that run are skipped."""
    for path in DOCS:
        for block in blocks(path):
            if block.action == "skip":
                where = _where(path, block)
                assert re.fullmatch(r"\(.{8,}\)", block.arg), f"{where}: a skip needs its reason in parentheses"
                assert block.lang in RUN, f"{where}: only {RUN} blocks run; a {block.lang!r} block needs no skip"
            if block.action == "write":
                assert block.arg and "/" not in block.arg.strip("./"), f"{_where(path, block)}: write NAME"


def test_docs_link_to_files_that_exist():
    """Relative links between the documents point at files that exist."""
    for path in DOCS:
        for target in re.findall(r"\]\((?!https?:|#)([^)#\s]+)", path.read_text(encoding="utf-8")):
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to missing {target}"


def test_no_history_in_the_documents():
    """The documents describe the tool as it is, not the story of its making."""
    words = re.compile(
        r"\bissue \d+|\bthis session\b|\ba later session\b|\bthis round\b|\bwas \d+(\.\d+)?x\b", re.IGNORECASE
    )
    for path in DOCS:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not words.search(line), f"{path.relative_to(ROOT)}:{n}: {line.strip()}"


def test_the_runner_leaves_out_first_use_lines_only():
    line = "derivgen: compiling layernorm.c (first use, about 10 s; cached in /home/me/.cache/derivgen)"
    assert FIRST_USE.match(line)
    assert not FIRST_USE.match("derivgen: error: compiling layernorm.c failed")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        announce("derivgen.torch's C++ extension", "1-2 min", Path("/c/torch_ext/x"))
    assert FIRST_USE.match(err.getvalue().strip())  # what the builds print


def test_the_documents_run_in_a_stand_in_for_the_clone(tmp_path):
    root = clone_root(tmp_path / "derivgen")
    assert (root / "examples" / "scalenorm.toml").is_file() and (root / "README.md").is_file()
    assert not (root / "generated").is_symlink() and (root / "generated" / "numpy" / "layernorm.py").is_file()
    assert not (root / ".git").exists() and not (root / ".venv").exists()


def test_the_runner_matches_wildcards():
    assert _match(["a ... c", "...", "z"], ["a b c", "x", "y", "z"])
    assert _match(["...", "z"], ["z"])
    assert not _match(["a"], ["a", "b"])
    assert _commands("$ echo a \\\n  b\na b\n") == [("echo a  b", ["a b"])]
    assert shutil.which("bash")
