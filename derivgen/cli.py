"""The ``derivgen`` command line."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import click

from derivgen import api
from derivgen.explain.document import mode_names, text_expr
from derivgen.prove.proof import prove_derivation
from derivgen.runtime.build import BuildError, BuildWarning, build_shared, library_path
from derivgen.runtime.fsutil import atomic_write
from derivgen.spec.lint import LintWarning, lint
from derivgen.spec.model import Spec, SpecError, catalogue_names
from derivgen.tools import generate as gen
from derivgen.tools.bench import DEFAULT_SHAPES, default_shapes, format_report, plot, run_bench, tune_malloc
from derivgen.tools.check import check_layer, format_table, rows_json, stderr_progress

PDFLATEX_MISSING = (
    "--pdf needs pdflatex: install the Debian package texlive-latex-base (apt-get install -y texlive-latex-base)"
)


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


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="derivgen")
def cli() -> None:
    """Derive, prove and generate backward passes of normalization layers.

    Each command's --help shows its defaults; docs/cli.md describes them all."""


@cli.command("list", short_help="The catalogue and the zoo, one line each.")
def list_cmd() -> None:
    """The built-in catalogue, then the zoo of published layers, one line each."""
    for heading, names in (("", api.names()), ("the zoo (published layers, generated on demand):", api.zoo())):
        if heading:
            click.echo(f"\n{heading}")
        for name in names:
            spec = api.load_spec(name)
            modes = "/".join(m.name for m in spec.modes)
            line = f"{name:<22} {spec.title} [{modes}]"
            click.echo(line if len(line) <= 100 else line[:99] + "…")


@cli.command("derive", short_help="Print a layer's backward pass derived step by step.")
@click.argument("name", required=False)
@click.option("--spec", "spec_file", type=click.Path(dir_okay=False), help="A spec file instead of a catalogue NAME.")
@click.option(
    "--format", "fmt", type=click.Choice(["latex", "markdown", "text"]), default="latex", help="Output format."
)
@click.option("--standalone", is_flag=True, help="A complete LaTeX document that compiles with pdflatex.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to FILE instead of stdout.")
@click.option(
    "--pdf",
    type=click.Path(dir_okay=False),
    help="Compile the standalone LaTeX to this PDF (nothing on stdout unless -o says where the text goes).",
)
@click.option("--prove-sizes", default="2-6", show_default=True, help="Brute-force proof sizes (e.g. 2-6 or 2,3).")
@click.option("--no-prove", is_flag=True, help="Skip the brute-force proof.")
@click.option(
    "--order",
    type=click.IntRange(1, 2),
    default=1,
    show_default=True,
    help="2 adds the second order: the double backward and the JVP, derived and proven (N up to 5).",
)
@click.option("--strict", is_flag=True, help=STRICT_HELP)
def derive_cmd(
    name: str | None,
    spec_file: str | None,
    fmt: str,
    standalone: bool,
    output: str | None,
    pdf: str | None,
    prove_sizes: str,
    no_prove: bool,
    order: int,
    strict: bool,
) -> None:
    """Print the step-by-step derivation of a layer's backward pass: LaTeX by default
    (--format text reads best in a terminal), proven at N = 2..6 unless --no-prove.

    The spec lint's warnings go to stderr first (--strict: errors, exit 2)."""
    spec = _spec_or_name(name, spec_file)
    sizes = () if no_prove else _sizes(prove_sizes)
    _out_file(output, "-o/--output")
    _out_file(pdf, "--pdf")
    if pdf and shutil.which("pdflatex") is None:  # before the work, like every other check
        raise UserError(PDFLATEX_MISSING)
    _lint([spec], strict)
    with _status(f"deriving and proving {spec.name} (N = {', '.join(map(str, sizes))})" if sizes else ""):
        derivation = api.derive(spec, prove=sizes)
    failed = [mode for mode, proof in derivation.proofs.items() if not proof.ok]
    second_sizes = tuple(n for n in sizes if n <= 5)
    with _status(f"deriving and proving the second order of {spec.name}" if order == 2 else ""):
        text = derivation.render(fmt, standalone=standalone, order=order, second_sizes=second_sizes)
    if output:
        _write(output, text, "-o/--output")
    elif not pdf:  # --pdf alone writes the PDF, not the LaTeX too
        click.echo(text, nl=False)
    if pdf:
        _pdflatex(derivation.render("latex", standalone=True, order=order, second_sizes=second_sizes), Path(pdf))
    if failed:
        raise click.ClickException(
            f"{spec.name}: the closed form FAILED its brute-force proof in mode(s) {', '.join(failed)}"
        )


@cli.command("prove", short_help="Derive and prove layers; print a summary table.")
@click.argument("names", nargs=-1)
@click.option("--spec", "spec_files", multiple=True, type=click.Path(dir_okay=False), help="Spec file(s) to prove too.")
@click.option("--prove-sizes", default="2-6", show_default=True, help="Brute-force sizes (e.g. 2-6).")
def prove_cmd(names: tuple[str, ...], spec_files: tuple[str, ...], prove_sizes: str) -> None:
    """Derive and prove layers (default: the whole catalogue); print a summary table."""
    sizes = _sizes(prove_sizes)
    specs = _specs(names, spec_files)
    if not specs:
        specs = [api.load_spec(n) for n in api.names()]
    t_all = time.perf_counter()
    t_derive = t_prove = 0.0
    failed = []
    rows = []
    progress = stderr_progress(len(specs))
    for spec in specs:
        progress(f"deriving and proving {spec.name}")
        t0 = time.perf_counter()
        derivation = api.derive(spec)
        t1 = time.perf_counter()
        proofs = prove_derivation(derivation, sizes)
        t2 = time.perf_counter()
        t_derive += t1 - t0
        t_prove += t2 - t1
        for mode_name, mode in derivation.modes.items():
            proof = proofs[mode_name]
            if not proof.ok:
                failed.append(f"{spec.name}/{mode_name}")
            rows.append(
                (
                    spec.name,
                    mode_name,
                    mode.reduction_summary,
                    proof.status,
                    f"{sum(r.seconds for r in proof.results):.1f}s",
                    "∂L/∂x = " + text_expr(mode.dx, spec, extra=mode_names(mode)),
                )
            )
    progress.done()
    widths = [max(len(r[i]) for r in rows + [("layer", "mode", "red.", "proof", "time", "")]) for i in range(5)]
    head = ("layer", "mode", "red.", f"proof N={sizes[0]}..{sizes[-1]}", "time")
    widths[3] = max(widths[3], len(head[3]))
    click.echo("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    for r in rows:  # the closed form on lines of its own, wrapped to fit 100 columns
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)).rstrip())
        click.echo(textwrap.fill(r[5], 100, initial_indent="    ", subsequent_indent="        "))
    click.echo(
        f"\n{len(specs)} layer(s): derived in {t_derive:.2f} s, proven in {t_prove:.1f} s "
        f"(total {time.perf_counter() - t_all:.1f} s)"
    )
    if failed:
        raise click.ClickException(f"proof FAILED for {', '.join(failed)}")


@cli.command("generate", short_help="Write the NumPy, C, PyTorch, JAX and Triton code of layers.")
@click.argument("names", nargs=-1)
@click.option("--spec", "spec_files", multiple=True, type=click.Path(dir_okay=False), help="Spec file(s) to generate.")
@click.option(
    "--target",
    type=click.Choice(["numpy", "c", "torch", "jax", "triton"]),
    multiple=True,
    help="Targets (default: all five).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Output directory, made if missing (only its last part, as mkdir) [default: ./generated for "
    "catalogue layers; for --spec files, generated/ in the first spec's folder].",
)
@click.option("--check", is_flag=True, help="Write nothing; exit 1 listing files that are stale.")
def generate_cmd(
    names: tuple[str, ...], spec_files: tuple[str, ...], target: tuple[str, ...], out_dir: str | None, check: bool
) -> None:
    """Write each layer's code for five targets (default: the whole catalogue into ./generated):
    numpy/NAME.py; c/NAME.c, c/NAME.h and their binding c/NAME.py; torch/NAME.py; jax/NAME.py;
    triton/NAME.py; and the package files.

    A --spec layer is written beside its spec (SPEC_FOLDER/generated/) or into --out, never over
    the catalogue's own generated files."""
    targets = tuple(target) or gen.TARGETS
    specs = _specs(names, spec_files)
    whole = not specs
    if out_dir:
        out = Path(out_dir)
    elif spec_files:
        out = Path(spec_files[0]).parent / "generated"
    else:
        out = Path("generated")
    if not check:
        _out_dir(out, "--out")
    own = [s for s in specs if not s.source.startswith("catalogue/")]
    if own and not out_dir and _holds_catalogue(out):
        raise UserError(
            f"{out}/ holds the catalogue's generated code; write a spec file's code elsewhere with --out DIR"
        )
    if own:
        _not_over_catalogue(own, out, targets)
    with _status(f"deriving and rendering {len(specs) or len(catalogue_names())} layer(s)"):
        files = gen.render_all(specs or None, targets)
    if check:
        bad = gen.stale(files, out) + (gen.orphans(files, out, targets) if whole else [])
        if bad:
            raise click.ClickException(
                f"{len(bad)} stale generated file(s) in {out}/ (run `derivgen generate`): {', '.join(bad)}"
            )
        click.echo(f"{len(files)} generated file(s) in {out}/ are up to date")
        return
    _make_dir(out, "--out")
    try:
        written = gen.write(files, out)
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write ({exc.strerror or exc})") from None
    for path in written:
        click.echo(f"wrote {path}")
    click.echo(f"{len(files)} file(s) in {out}/, {len(written)} changed")


def _holds_catalogue(out: Path) -> bool:
    """Whether directory ``out`` holds code generated from the catalogue (a header says so)."""
    for target in gen.TARGETS:
        folder = out / target
        if folder.is_dir():
            for path in sorted(folder.glob("*.py")):
                try:
                    if "from catalogue/" in path.read_text(encoding="utf-8", errors="replace")[:300]:
                        return True
                except OSError:
                    continue
    return False


def _not_over_catalogue(specs: list[Spec], out: Path, targets: tuple[str, ...]) -> None:
    """UserError if writing ``specs`` (spec files, not the catalogue) into ``out`` would replace a
    file generated from the catalogue (its header says ``from catalogue/``)."""
    clash = []
    for spec in specs:
        for target in targets:
            for suffix in (".py", ".c", ".h"):
                path = out / target / f"{spec.name}{suffix}"
                try:
                    head = path.read_text(encoding="utf-8", errors="replace")[:300] if path.is_file() else ""
                except OSError:
                    head = ""
                if "from catalogue/" in head:
                    clash.append(str(path))
    if clash:
        raise UserError(
            f"{clash[0]}{f' (and {len(clash) - 1} more)' if len(clash) > 1 else ''} is the catalogue's generated "
            f"code, which layer {specs[0].name!r} from a spec file would replace: write it elsewhere with --out DIR "
            "or rename the layer"
        )


@cli.command("check", short_help="Cross-check the generated code of layers.")
@click.argument("names", nargs=-1)
@click.option("--spec", "spec_files", multiple=True, type=click.Path(dir_okay=False), help="Spec file(s) to check.")
@click.option("--backend", "backends", default="numpy,c", show_default=True, help="Comma-separated: numpy,c.")
@click.option(
    "--dtype", "dtypes", default="float32,float64", show_default=True, help="Comma-separated: float32,float64."
)
@click.option("--prove-sizes", default="2-6", show_default=True, help="Brute-force proof sizes.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.option("--strict", is_flag=True, help=STRICT_HELP)
def check_cmd(
    names: tuple[str, ...],
    spec_files: tuple[str, ...],
    backends: str,
    dtypes: str,
    prove_sizes: str,
    as_json: bool,
    strict: bool,
) -> None:
    """Cross-check every layer x backend x dtype (default: the whole catalogue).

    Against the spec and finite differences, the other backend, PyTorch autograd (torch's own
    layer for the catalogue, the spec's forward in torch operations for a spec file) and the
    brute-force proof; first and second order. Exit 1 if any check fails. The spec lint's
    warnings go to stderr first (--strict: errors, exit 2)."""
    backend_list = tuple(b.strip() for b in backends.split(",") if b.strip())
    dtype_list = tuple(d.strip() for d in dtypes.split(",") if d.strip())
    if (
        not backend_list
        or any(b not in ("numpy", "c") for b in backend_list)
        or len(set(backend_list)) != len(backend_list)
    ):
        raise UserError(f"--backend: expected a comma-separated subset of numpy,c, got {backends!r}")
    if (
        not dtype_list
        or any(d not in ("float32", "float64") for d in dtype_list)
        or len(set(dtype_list)) != len(dtype_list)
    ):
        raise UserError(f"--dtype: expected a comma-separated subset of float32,float64, got {dtypes!r}")
    sizes = _sizes(prove_sizes)
    specs = _specs(names, spec_files)
    if not specs:
        specs = [api.load_spec(n) for n in api.names()]
    _lint(specs, strict)
    total = sum(len(s.modes) for s in specs) * len(backend_list) * len(dtype_list)
    progress = stderr_progress(total)
    rows = []
    for spec in specs:
        with _status(f"{spec.name}: deriving, proving and compiling"):  # the bar takes over per case
            rows += check_layer(spec, backend_list, dtype_list, prove_sizes=sizes, progress=progress)
    progress.done()
    failed = [r for r in rows if r.failed]
    if as_json:
        click.echo(json.dumps({"rows": rows_json(rows), "failed": len(failed)}, indent=1))
    else:
        click.echo(format_table(rows))
        skipped = sum(1 for r in rows if r.status.startswith("skipped"))
        na = sum(1 for r in rows if r.status.startswith("n/a"))
        click.echo(
            f"\n{len(rows) - len(failed) - skipped - na} passed, {len(failed)} failed"
            + (f", {skipped} skipped" if skipped else "")
            + (f", {na} not applicable" if na else "")
        )
    if failed:
        raise click.ClickException(f"{len(failed)} check(s) failed")


@cli.command("lint", short_help="Warn of what in a spec is valid but likely a mistake.")
@click.argument("specs", nargs=-1, metavar="[SPEC]...")
@click.option("--strict", is_flag=True, help="Make the warnings errors: one line each on stderr, exit 2.")
@click.option(
    "--all-zero",
    is_flag=True,
    help="Also report a division or logarithm that only a group of zeros makes zero "
    "(as every layer that divides by a norm of x: weight normalization, absmax scaling).",
)
def lint_cmd(specs: tuple[str, ...], strict: bool, all_zero: bool) -> None:
    """Lint spec files (a path, or a catalogue or zoo layer's name; default: every built-in
    layer): a parameter, option, input, tensor, value, statistic or normalized coordinate that
    nothing uses; a division by, a logarithm of or a fractional power of a value that a simple
    group (every element equal, a group of one element) makes zero or negative; a statistic
    that is constant. One line per warning, naming the file and the field; exit 0 (--strict:
    errors, exit 2)."""
    loaded = []
    for item in specs or (*api.names(), *api.zoo()):
        as_file = item.endswith(".toml") or os.sep in item or "/" in item or Path(item).is_file()
        loaded.append(_spec_or_name(None, item) if as_file else _spec_or_name(item, None))
    found = [w for spec in loaded for w in lint(spec, all_zero=all_zero)]
    if found and strict:
        raise LintErrors(found)
    for w in found:
        click.echo(str(w))
    with_warnings = len({w.file for w in found})
    if found:
        click.echo(f"{len(found)} warning(s) in {with_warnings} of {len(loaded)} spec(s)")
    else:
        click.echo(f"no warnings in {len(loaded)} spec(s)")


@cli.command("build", short_help="Compile the C kernels into the build cache.")
@click.argument("names", nargs=-1)
@click.option("--spec", "spec_files", multiple=True, type=click.Path(dir_okay=False), help="Spec file(s) to build.")
@click.option(
    "--torch",
    "torch_ext",
    is_flag=True,
    help="Also build derivgen.torch's C++ extension (needs torch; 1-2 min the first time).",
)
def build_cmd(names: tuple[str, ...], spec_files: tuple[str, ...], torch_ext: bool) -> None:
    """Compile the C kernels into shared libraries in the build cache (CC and CFLAGS honored),
    ahead of their first use; --torch builds derivgen.torch's extension too."""
    specs = _specs(names, spec_files)
    if torch_ext:
        if importlib.util.find_spec("torch") is None:
            raise UserError("--torch: PyTorch is not installed (pip install torch==2.13.0)")
        from derivgen.torch.ahead import build as build_ahead

        t0 = time.perf_counter()
        try:
            build_ahead(extension=True)
        except RuntimeError as exc:
            raise UserError(f"--torch: {exc}") from None
        click.echo(f"{'torch extension':<18} {f'ready in {time.perf_counter() - t0:.1f} s':<18}")
    for spec in specs or [api.load_spec(n) for n in api.names()]:
        root, _ = api.materialize(spec, "c")
        source = root / f"{spec.name}.c"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", BuildWarning)
            try:
                cached = library_path(source).is_file()
                t0 = time.perf_counter()
                with _status("" if cached else f"compiling {spec.name}"):
                    lib = build_shared(source)
                took = time.perf_counter() - t0
            except BuildError as exc:
                raise click.ClickException(f"{spec.name}: {exc}") from None
        for w in caught:
            if issubclass(w.category, BuildWarning):
                click.echo(f"derivgen: warning: {w.message}", err=True)
        what = "cached" if cached else f"compiled in {took:.1f} s"
        click.echo(f"{spec.name:<18} {what:<18} {lib}")


@cli.command("import", short_help="Read a PyTorch module's or function's forward as a spec.")
@click.argument("target", metavar="PATH:NAME")
@click.option("--shape", "shape_text", required=True, help="An example input's shape, like 4x64 or 2,8,16,16.")
@click.option(
    "--arg", "args", multiple=True, metavar="VALUE", help="A constructor argument (a Python literal), in order."
)
@click.option("--kwarg", "kwargs", multiple=True, metavar="NAME=VALUE", help="A constructor keyword argument.")
@click.option("--name", default=None, help="The layer's name in the spec (default: from the class or function).")
@click.option(
    "-o", "--out", default=None, type=click.Path(dir_okay=False), help="Write the spec here (default: stdout)."
)
def import_cmd(
    target: str, shape_text: str, args: tuple[str, ...], kwargs: tuple[str, ...], name: str | None, out: str | None
) -> None:
    """Trace a torch.nn.Module class (built with --arg/--kwarg) or a function, named as
    file.py:NAME or package.module:NAME, with torch.export on a float64 input of --shape, and
    write its forward as a spec (TOML): statistics, the normalized coordinate, parameters by
    the module's names, eps and other numbers as options. What no spec construct computes is
    refused in one line naming the operation and its source line. Needs PyTorch."""
    import ast

    from derivgen.spec.from_torch import import_command_main

    def literal(what: str, text: str):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise UserError(f"{what}: expected a Python literal (a number, string, tuple ...), got {text!r}") from None

    positional = tuple(literal("--arg", a) for a in args)
    named = {}
    for kv in kwargs:
        key, sep, value = kv.partition("=")
        if not sep or not key.isidentifier():
            raise UserError(f"--kwarg: expected NAME=VALUE, got {kv!r}")
        named[key] = literal(f"--kwarg {key}", value)
    shape = _shape(shape_text)
    try:
        with _status(f"tracing {target}"):
            text, seconds = import_command_main(target, shape, positional, named, name=name)
    except SpecError as exc:
        raise UserError(str(exc)) from None
    if out is None:
        click.echo(text, nl=not text.endswith("\n"))
    else:
        _write(out, text, "--out")
        click.echo(f"derivgen: wrote {out} (imported in {seconds:.1f} s)", err=True)


def _shape(text: str) -> tuple[int, ...]:
    """A ``--shape`` like ``8192x1024`` (or ``8192,1024``) as a tuple of positive sizes."""
    t = text.strip().lower()
    if not re.fullmatch(r"[0-9]+(?:[x,][0-9]+)*", t):
        raise UserError(f"--shape: expected positive sizes like 8192x1024, got {text!r}")
    dims = tuple(int(d) for d in re.split(r"[x,]", t))
    if min(dims) < 1:
        raise UserError(f"--shape: expected positive sizes like 8192x1024, got {text!r}")
    return dims


@cli.command("bench", short_help="Time the generated code against NumPy, PyTorch and bandwidth.")
@click.argument("names", nargs=-1)
@click.option(
    "--spec",
    "spec_files",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Bench a spec file too (against plain NumPy written from its formulas).",
)
@click.option("--shape", "shapes", multiple=True, help="Shape(s) like 8192x1024 (default: per-layer defaults).")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="Threads (default: all cores).")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float64", "bfloat16"]),
    default="float32",
    show_default=True,
    help="bfloat16: the bfloat16 kernels against the float32 ones per byte, through derivgen.torch's operators.",
)
@click.option("--repeat", type=click.IntRange(3, 1000), default=15, show_default=True, help="Timed runs per case.")
@click.option(
    "--isa",
    "isas",
    default="native",
    show_default=True,
    help="C builds side by side: native (CFLAGS or the defaults) and/or -march names, comma-separated, "
    "e.g. x86-64-v4,x86-64-v3,x86-64 (one the CPU cannot run is skipped).",
)
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Also write the results as JSON.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), help="Save a chart (needs matplotlib).")
@click.option("--default-malloc", is_flag=True, help="Do not tune glibc malloc (shows page-fault costs).")
@click.option(
    "--torch",
    "with_torch",
    is_flag=True,
    help="Bench derivgen.torch's modules against torch.nn's instead, through autograd.",
)
@click.option(
    "--jax",
    "with_jax",
    is_flag=True,
    help="Bench derivgen.jax (jitted forward + backward) against Flax's layers on the CPU instead.",
)
@click.option(
    "--sync",
    "sync_world",
    type=click.IntRange(2, 64),
    default=None,
    help="With --torch: SyncBatchNorm split over this many gloo processes against one process (default: off).",
)
def bench_cmd(
    names: tuple[str, ...],
    spec_files: tuple[str, ...],
    shapes: tuple[str, ...],
    threads: int | None,
    dtype: str,
    repeat: int,
    isas: str,
    json_file: str | None,
    plot_file: str | None,
    default_malloc: bool,
    with_torch: bool,
    with_jax: bool,
    sync_world: int | None,
) -> None:
    """Time generated C and NumPy against plain NumPy, PyTorch and the memory-bandwidth bound."""
    if with_jax:
        if with_torch or sync_world or names or spec_files or shapes or plot_file or isas != "native":
            raise UserError("--jax benches its own fixed cases; it takes --dtype, --repeat and --json only")
        _bench_jax(dtype, repeat, json_file)
        return
    if with_torch:
        if names or spec_files or shapes or plot_file or isas != "native":
            raise UserError(
                "--torch benches its own fixed cases; it takes --threads, --dtype, --repeat and --json only"
            )
        _out_file(json_file, "--json")
        _bench_torch(threads, dtype, repeat, json_file, default_malloc, sync_world)
        return
    if sync_world:
        raise UserError("--sync benches derivgen.torch's SyncBatchNorm: use it with --torch")
    if dtype == "bfloat16":
        if spec_files or plot_file or isas != "native":
            raise UserError("--dtype bfloat16 takes catalogue NAMES, --shape, --threads, --repeat and --json only")
        _bench_bf16(names, shapes, threads, repeat, json_file)
        return
    if plot_file and importlib.util.find_spec("matplotlib") is None:
        raise UserError("--plot needs matplotlib: pip install matplotlib")
    _out_file(json_file, "--json")
    _out_file(plot_file, "--plot")
    names = list(names) or ([] if spec_files else list(DEFAULT_SHAPES))
    specs = _specs(names, spec_files)
    marches = [m.strip() for m in isas.split(",") if m.strip()]
    bad = [m for m in marches if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", m)]
    if not marches or bad or len(set(marches)) != len(marches):
        raise UserError(f"--isa: expected native and/or -march names, comma-separated, each once; got {isas!r}")
    shape_list = [_shape(s) for s in shapes] or None
    total = sum(len(shape_list or default_shapes(s)) for s in specs) * 2
    progress = stderr_progress(total)
    layers = [s.name if s.source.startswith("catalogue/") else s for s in specs]
    report = run_bench(
        layers, shape_list, threads, dtype, repeat, progress, tuned_malloc=not default_malloc, isas=marches
    )
    progress.done()
    click.echo(format_report(report))
    if json_file:
        _write(json_file, json.dumps(report, indent=1), "--json")
    if plot_file:
        _make_dir(Path(plot_file).parent, "--plot")
        try:
            plot(report, plot_file)
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"chart: {plot_file}")


def _bench_torch(
    threads: int | None, dtype: str, repeat: int, json_file: str | None, default_malloc: bool, sync_world: int | None
) -> None:
    """``bench --torch``: derivgen.torch's modules against torch.nn's (or, with ``--sync``, SyncBatchNorm
    split over processes against one process)."""
    try:  # imported here: PyTorch is an optional dependency, and these modules import it
        from derivgen.torch.bench import CASES, format_torch_report, run_torch_bench
    except ImportError as e:
        raise UserError(str(e)) from None
    if sync_world:
        from derivgen.torch.bench_sync import format_sync_report, run_sync_bench  # optional PyTorch, as above

        report = run_sync_bench(sync_world, repeat)
        click.echo(format_sync_report(report))
        if json_file:
            _write(json_file, json.dumps(report, indent=1), "--json")
        return
    if not default_malloc:
        tune_malloc()
    progress = stderr_progress(len(CASES) + 1)
    report = run_torch_bench(threads, repeat, dtype, progress)
    progress.done()
    click.echo(format_torch_report(report))
    if json_file:
        _write(json_file, json.dumps(report, indent=1), "--json")


def _bench_bf16(
    names: tuple[str, ...], shapes: tuple[str, ...], threads: int | None, repeat: int, json_file: str | None
) -> None:
    """``bench --dtype bfloat16``: the bfloat16 kernels against the float32 ones, per byte."""
    try:  # PyTorch is an optional dependency; the bench calls derivgen.torch's operators
        from derivgen.torch.bench_bf16 import LAYERS, format_bf16_report, run_bf16_bench
    except ImportError as e:
        raise UserError(str(e)) from None
    bad = [n for n in names if n not in LAYERS]
    if bad:
        raise UserError(f"--dtype bfloat16: no bfloat16 bench for {', '.join(bad)} (one of {', '.join(LAYERS)})")
    _out_file(json_file, "--json")
    layers = list(names) or list(LAYERS)
    shape_list = [_shape(s) for s in shapes] or None
    progress = stderr_progress(len(layers) * (len(shape_list) if shape_list else 1))
    report = run_bf16_bench(layers, shape_list, threads, repeat, progress)
    progress.done()
    click.echo(format_bf16_report(report))
    if json_file:
        _write(json_file, json.dumps(report, indent=1), "--json")


def _bench_jax(dtype: str, repeat: int, json_file: str | None) -> None:
    """``bench --jax``: derivgen.jax against Flax's layers, jitted, on the CPU."""
    from derivgen.tools.bench import format_jax_report, run_jax_bench

    _out_file(json_file, "--json")
    progress = stderr_progress(6)
    try:
        report = run_jax_bench(repeat, dtype, progress)
    except ImportError as e:
        raise UserError(f"{e} (bench --jax needs JAX and Flax: pip install jax flax)") from None
    progress.done()
    click.echo(format_jax_report(report))
    if json_file:
        _write(json_file, json.dumps(report, indent=1), "--json")


def _pdflatex(tex: str, pdf: Path) -> None:
    """Compile standalone LaTeX to ``pdf`` with pdflatex (run twice, for references)."""
    exe = shutil.which("pdflatex")
    if exe is None:
        raise UserError(PDFLATEX_MISSING)
    with tempfile.TemporaryDirectory(prefix="derivgen-tex-") as tmp:
        (Path(tmp) / "doc.tex").write_text(tex, encoding="utf-8")
        for _ in range(2):
            run = subprocess.run(
                [exe, "-interaction=nonstopmode", "-halt-on-error", "doc.tex"],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            if run.returncode != 0:  # its log's "!" lines say why
                lines = [line for line in run.stdout.splitlines() if line.startswith("!")]
                raise click.ClickException(f"pdflatex failed: {lines[0] if lines else 'see log'}")
        _write(pdf, (Path(tmp) / "doc.pdf").read_bytes(), "--pdf")


def main(argv: list[str] | None = None) -> int:
    """Entry point: errors become one line and an exit code, never a traceback."""
    try:
        cli.main(args=argv, prog_name="derivgen", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.UsageError as exc:
        msg = exc.format_message().splitlines()[0] if exc.format_message() else "usage error"
        sub = exc.ctx.info_name if exc.ctx and exc.ctx.info_name != "derivgen" else None
        see = f" (see derivgen {sub} --help)" if sub else " (see derivgen --help)"
        click.echo(f"derivgen: error: {msg}{see}", err=True)  # the prefix of every error
        return 2
    except click.ClickException as exc:
        click.echo(f"derivgen: error: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("derivgen: aborted", err=True)
        return 1
    except (SpecError, ValueError, NotImplementedError) as exc:  # NotImplementedError: a target refuses a layer
        click.echo(f"derivgen: error: {exc}", err=True)
        return 2
    except OSError as exc:  # a file or directory that could not be read or written
        if isinstance(exc, BrokenPipeError):
            return 1
        where = f" {exc.filename}" if exc.filename else ""
        click.echo(f"derivgen: error:{where} {exc.strerror or exc}", err=True)
        return 2
    except BrokenPipeError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
