"""``derivgen list``, ``derive`` and ``prove``: the catalogue, the derivation as a document, the proofs."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import click

from derivgen import api
from derivgen.cli.common import (
    STRICT_HELP,
    UserError,
    _lint,
    _out_file,
    _sizes,
    _spec_or_name,
    _specs,
    _status,
    _write,
    cli,
)
from derivgen.explain.document import mode_names, text_expr
from derivgen.prove.proof import prove_derivation
from derivgen.tools.progress import stderr_progress

PDFLATEX_MISSING = (
    "--pdf needs pdflatex: install the Debian package texlive-latex-base (apt-get install -y texlive-latex-base)"
)


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
