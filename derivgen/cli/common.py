"""What the commands share: the ``derivgen`` group, the one-line ``UserError``, the checks of
output paths before any work, atomic writes, the status line, spec loading and the lint."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import click

from derivgen import api
from derivgen.runtime.fsutil import atomic_write
from derivgen.spec.lint import LintWarning, lint
from derivgen.spec.model import Spec, SpecError


class UserError(click.ClickException):
    """Bad input: one line on stderr, exit code 2."""

    exit_code = 2


def _out_file(path: str | None, option: str) -> None:
    """Check before any work that ``path`` (an --output / --json / --plot / --pdf FILE) can be
    written: a UserError naming the option otherwise."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{option} {path}: is a directory")
    _writable_dir(p.parent, f"{option} {path}")


def _out_dir(path: Path, option: str) -> None:
    """Check before any work that directory ``path`` exists or can be made, and can be written."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{option} {path}: not a directory")
    _writable_dir(path, f"{option} {path}")


def _writable_dir(folder: Path, what: str) -> None:
    """UserError unless a file can be created in ``folder``, or ``folder`` can be made in its
    parent (derivgen makes at most the last directory of a path, as ``mkdir`` without ``-p``):
    probed with a temporary file, removed at once."""
    probe = folder if str(folder) else Path(".")
    if not probe.exists():
        parent = probe.parent
        if not parent.exists():
            up = parent
            while not up.exists() and up.parent != up:
                up = up.parent
            if up.exists() and not up.is_dir():
                raise UserError(f"{what}: {up} is not a directory")
            raise UserError(
                f"{what}: {parent}/ does not exist (derivgen makes at most the last directory of a path, "
                f"like mkdir without -p: make {parent}/ first)"
            )
        probe = parent
    if not probe.is_dir():
        raise UserError(f"{what}: {probe} is not a directory")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".derivgen-probe-", dir=probe)
    except OSError as exc:
        raise UserError(f"{what}: cannot write in {probe} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(tmp)


def _make_dir(folder: Path, option: str) -> None:
    """Make ``folder`` if it is missing (its parent exists: the checks before the work said so),
    and say so on stderr."""
    if str(folder) in ("", ".") or folder.is_dir():
        return
    try:
        folder.mkdir()
    except FileExistsError:
        return
    except OSError as exc:
        raise UserError(f"{option} {folder}: cannot make the directory ({exc.strerror or exc})") from None
    click.echo(f"derivgen: created directory {folder}/", err=True)


def _write(path: str | Path, data: str | bytes, option: str) -> None:
    """atomic_write, with a failure as a one-line UserError naming the option; a missing last
    directory of the path is made first (and said)."""
    _make_dir(Path(path).parent, option)
    try:
        atomic_write(path, data)
    except OSError as exc:
        raise UserError(f"{option} {path}: cannot write ({exc.strerror or exc})") from None


@contextlib.contextmanager
def _status(message: str) -> Iterator[None]:
    """``message`` on stderr while the block runs, cleared after: on a terminal only (and not
    for an empty message), so that pipes and logs see nothing."""
    show = bool(message) and sys.stderr.isatty()
    if show:
        sys.stderr.write(f"\r\033[K{message} ...")
        sys.stderr.flush()
    try:
        yield
    finally:
        if show:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _spec_or_name(name: str | None, spec: str | None) -> Spec:
    """The spec of a catalogue NAME or a --spec FILE (exactly one given); a bad one is a UserError."""
    if (name is None) == (spec is None):
        raise UserError("give a layer NAME or --spec FILE (exactly one)")
    try:
        return api.load_spec(Path(spec)) if spec is not None else api.load_spec(name)
    except SpecError as exc:
        raise UserError(str(exc)) from None


def _specs(names: tuple[str, ...] | list[str], spec_files: tuple[str, ...]) -> list[Spec]:
    """Catalogue NAMES and --spec FILEs, validated, in the order given; two layers of one
    name (they would write the same files) are an error naming both sources."""
    specs = [_spec_or_name(n, None) for n in names] + [_spec_or_name(None, f) for f in spec_files]
    seen: dict[str, Spec] = {}
    for spec in specs:
        if spec.name in seen and seen[spec.name].source != spec.source:
            raise UserError(f"{spec.source}: layer name {spec.name!r} is also the name of {seen[spec.name].source}")
        seen.setdefault(spec.name, spec)
    return specs


class LintErrors(UserError):
    """The spec lint's warnings under ``--strict``: one error line each, exit code 2."""

    def __init__(self, found: list[LintWarning]) -> None:
        super().__init__("\nderivgen: error: ".join(str(w) for w in found))


STRICT_HELP = "Make the spec lint's warnings errors (exit 2 before any work)."


def _lint(specs: list[Spec], strict: bool) -> None:
    """The lint's warnings of ``specs`` on stderr, one line each; with ``strict``, as errors."""
    found = [w for spec in specs for w in lint(spec)]
    if found and strict:
        raise LintErrors(found)
    for w in found:
        click.echo(f"derivgen: warning: {w}", err=True)


def _sizes(text: str) -> tuple[int, ...]:
    """The proof sizes of ``--prove-sizes``: a range ``2-6`` or a list ``2,3,4``, each in 2..12."""
    try:
        if "-" in text:
            lo, hi = (int(t) for t in text.split("-", 1))
            sizes = tuple(range(lo, hi + 1))
        else:
            sizes = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise UserError(f"--prove-sizes: expected a range like 2-6 or a list like 2,3,4, got {text!r}") from None
    if not sizes:
        raise UserError(f"--prove-sizes: no size in {text!r} (a range runs low to high, like 2-6)")
    if min(sizes) < 2 or max(sizes) > 12:
        raise UserError(f"--prove-sizes: sizes must lie in 2..12, got {text!r}")
    return sizes


def _shape(text: str) -> tuple[int, ...]:
    """A ``--shape`` like ``8192x1024`` (or ``8192,1024``) as a tuple of positive sizes."""
    t = text.strip().lower()
    if not re.fullmatch(r"[0-9]+(?:[x,][0-9]+)*", t):
        raise UserError(f"--shape: expected positive sizes like 8192x1024, got {text!r}")
    dims = tuple(int(d) for d in re.split(r"[x,]", t))
    if min(dims) < 1:
        raise UserError(f"--shape: expected positive sizes like 8192x1024, got {text!r}")
    return dims


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="derivgen")
def cli() -> None:
    """Derive, prove and generate backward passes of normalization layers.

    Each command's --help shows its defaults; docs/cli.md describes them all."""
