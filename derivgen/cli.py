"""The ``derivgen`` command line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import click

from derivgen import api
from derivgen.explain.document import text_expr
from derivgen.prove.proof import prove_derivation
from derivgen.runtime.build import BuildError, BuildWarning, build_shared, library_path
from derivgen.runtime.fsutil import atomic_write
from derivgen.spec.model import Spec, SpecError
from derivgen.tools import generate as gen
from derivgen.tools.bench import DEFAULT_SHAPES, default_shapes, format_report, plot, run_bench, tune_malloc
from derivgen.tools.check import check_layer, format_table, rows_json, stderr_progress


class UserError(click.ClickException):
    """Bad input: one line on stderr, exit code 2."""

    exit_code = 2


def _spec_or_name(name: str | None, spec: str | None) -> Spec:
    """The spec of a catalogue NAME or a --spec FILE (exactly one given); a bad one is a UserError."""
    if (name is None) == (spec is None):
        raise UserError("give a layer NAME or --spec FILE (exactly one)")
    try:
        return api.load_spec(Path(spec)) if spec is not None else api.load_spec(name)
    except SpecError as exc:
        raise UserError(str(exc)) from None


def _specs(names: tuple[str, ...] | list[str], spec_files: tuple[str, ...]) -> list[Spec]:
    """Catalogue NAMES and --spec FILEs, validated, in the order given."""
    return [_spec_or_name(n, None) for n in names] + [_spec_or_name(None, f) for f in spec_files]


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
    if not sizes or min(sizes) < 2 or max(sizes) > 12:
        raise UserError(f"--prove-sizes: sizes must lie in 2..12, got {text!r}")
    return sizes


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="derivgen")
def cli() -> None:
    """Derive, prove and generate backward passes of normalization layers."""


@cli.command("list")
def list_cmd() -> None:
    """The built-in catalogue, then the zoo of published layers, one line each."""
    for heading, names in (("", api.names()), ("the zoo (published layers, generated on demand):", api.zoo())):
        if heading:
            click.echo(f"\n{heading}")
        for name in names:
            spec = api.load_spec(name)
            modes = "/".join(m.name for m in spec.modes)
            click.echo(f"{name:<22} {spec.title} [{modes}]")


@cli.command("derive")
@click.argument("name", required=False)
@click.option("--spec", "spec_file", type=click.Path(dir_okay=False), help="A spec file instead of a catalogue NAME.")
@click.option("--format", "fmt", type=click.Choice(["latex", "markdown", "text"]), default="latex", show_default=True)
@click.option("--standalone", is_flag=True, help="A complete LaTeX document that compiles with pdflatex.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write to FILE instead of stdout.")
@click.option("--pdf", type=click.Path(dir_okay=False), help="Also compile the standalone LaTeX to this PDF.")
@click.option("--prove-sizes", default="2-6", show_default=True, help="Brute-force proof sizes (e.g. 2-6 or 2,3).")
@click.option("--no-prove", is_flag=True, help="Skip the brute-force proof.")
@click.option(
    "--order",
    type=click.IntRange(1, 2),
    default=1,
    show_default=True,
    help="2 adds the second order: the double backward and the JVP, derived and proven (N up to 5).",
)
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
) -> None:
    """Print the step-by-step derivation of a layer's backward pass."""
    spec = _spec_or_name(name, spec_file)
    sizes = () if no_prove else _sizes(prove_sizes)
    derivation = api.derive(spec, prove=sizes)
    failed = [mode for mode, proof in derivation.proofs.items() if not proof.ok]
    second_sizes = tuple(n for n in sizes if n <= 5)
    text = derivation.render(fmt, standalone=standalone, order=order, second_sizes=second_sizes)
    if output:
        atomic_write(output, text)
    else:
        click.echo(text, nl=False)
    if pdf:
        _pdflatex(derivation.render("latex", standalone=True, order=order, second_sizes=second_sizes), Path(pdf))
    if failed:
        raise click.ClickException(
            f"{spec.name}: the closed form FAILED its brute-force proof in mode(s) {', '.join(failed)}"
        )


@cli.command("prove")
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
    for spec in specs:
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
                    str(len(mode.reductions)),
                    proof.status,
                    f"{sum(r.seconds for r in proof.results):.1f}s",
                    "∂L/∂x = " + text_expr(mode.dx, spec),
                )
            )
    widths = [max(len(r[i]) for r in rows + [("layer", "mode", "red.", "proof", "time", "")]) for i in range(5)]
    head = ("layer", "mode", "red.", f"proof N={sizes[0]}..{sizes[-1]}", "time")
    widths[3] = max(widths[3], len(head[3]))
    click.echo("  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  closed form")
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
    click.echo(
        f"\n{len(specs)} layer(s): derived in {t_derive:.2f} s, proven in {t_prove:.1f} s "
        f"(total {time.perf_counter() - t_all:.1f} s)"
    )
    if failed:
        raise click.ClickException(f"proof FAILED for {', '.join(failed)}")


@cli.command("generate")
@click.argument("names", nargs=-1)
@click.option("--spec", "spec_files", multiple=True, type=click.Path(dir_okay=False), help="Spec file(s) to generate.")
@click.option(
    "--target", type=click.Choice(["numpy", "c", "torch", "jax"]), multiple=True, help="Targets (default: all four)."
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Output directory (default: generated/ in the current directory).",
)
@click.option("--check", is_flag=True, help="Write nothing; exit 1 listing files that are stale.")
def generate_cmd(
    names: tuple[str, ...], spec_files: tuple[str, ...], target: tuple[str, ...], out_dir: str | None, check: bool
) -> None:
    """Regenerate NumPy, C and PyTorch code (default: the whole catalogue into ./generated)."""
    targets = tuple(target) or gen.TARGETS
    specs = _specs(names, spec_files)
    whole = not specs
    files = gen.render_all(specs or None, targets)
    out = Path(out_dir) if out_dir else Path("generated")
    if check:
        bad = gen.stale(files, out) + (gen.orphans(files, out, targets) if whole else [])
        if bad:
            raise click.ClickException(
                f"{len(bad)} stale generated file(s) in {out}/ (run `derivgen generate`): {', '.join(bad)}"
            )
        click.echo(f"{len(files)} generated file(s) in {out}/ are up to date")
        return
    written = gen.write(files, out)
    for path in written:
        click.echo(f"wrote {path}")
    click.echo(f"{len(files)} file(s) in {out}/, {len(written)} changed")


@cli.command("check")
@click.argument("names", nargs=-1)
@click.option("--spec", "spec_files", multiple=True, type=click.Path(dir_okay=False), help="Spec file(s) to check.")
@click.option("--backend", "backends", default="numpy,c", show_default=True, help="Comma-separated: numpy,c.")
@click.option(
    "--dtype", "dtypes", default="float32,float64", show_default=True, help="Comma-separated: float32,float64."
)
@click.option("--prove-sizes", default="2-6", show_default=True, help="Brute-force proof sizes.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def check_cmd(
    names: tuple[str, ...], spec_files: tuple[str, ...], backends: str, dtypes: str, prove_sizes: str, as_json: bool
) -> None:
    """Cross-check every layer x backend x dtype: spec + finite differences, the other backend, PyTorch, proof."""
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
    total = sum(len(s.modes) for s in specs) * len(backend_list) * len(dtype_list)
    progress = stderr_progress(total)
    rows = []
    for spec in specs:
        rows += check_layer(spec, backend_list, dtype_list, prove_sizes=sizes, progress=progress)
    progress.done()
    failed = [r for r in rows if r.failed]
    if as_json:
        click.echo(json.dumps({"rows": rows_json(rows), "failed": len(failed)}, indent=1))
    else:
        click.echo(format_table(rows))
        skipped = sum(1 for r in rows if r.status.startswith("skipped"))
        click.echo(
            f"\n{len(rows) - len(failed) - skipped} passed, {len(failed)} failed"
            + (f", {skipped} skipped" if skipped else "")
        )
    if failed:
        raise click.ClickException(f"{len(failed)} check(s) failed")


@cli.command("build")
@click.argument("names", nargs=-1)
@click.option("--spec", "spec_files", multiple=True, type=click.Path(dir_okay=False), help="Spec file(s) to build.")
def build_cmd(names: tuple[str, ...], spec_files: tuple[str, ...]) -> None:
    """Compile the C kernels into shared libraries in the build cache (CC and CFLAGS honored)."""
    specs = _specs(names, spec_files)
    for spec in specs or [api.load_spec(n) for n in api.names()]:
        root, _ = api.materialize(spec, "c")
        source = root / f"{spec.name}.c"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", BuildWarning)
            try:
                cached = library_path(source).is_file()
                t0 = time.perf_counter()
                lib = build_shared(source)
                took = time.perf_counter() - t0
            except BuildError as exc:
                raise click.ClickException(f"{spec.name}: {exc}") from None
        for w in caught:
            if issubclass(w.category, BuildWarning):
                click.echo(f"derivgen: warning: {w.message}", err=True)
        what = "cached" if cached else f"compiled in {took:.1f} s"
        click.echo(f"{spec.name:<18} {what:<18} {lib}")


def _shape(text: str) -> tuple[int, ...]:
    """A ``--shape`` like ``8192x1024`` (or ``8192,1024``) as a tuple of positive sizes."""
    try:
        dims = tuple(int(t) for t in text.lower().replace(",", "x").split("x") if t.strip())
    except ValueError:
        dims = ()
    if not dims or min(dims) < 1:
        raise UserError(f"--shape: expected sizes like 8192x1024, got {text!r}")
    return dims


@cli.command("bench")
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
@click.option("--dtype", type=click.Choice(["float32", "float64"]), default="float32", show_default=True)
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
    help="With --torch: SyncBatchNorm split over this many gloo processes against one process.",
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
        _bench_torch(threads, dtype, repeat, json_file, default_malloc, sync_world)
        return
    if sync_world:
        raise UserError("--sync benches derivgen.torch's SyncBatchNorm: use it with --torch")
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
        atomic_write(json_file, json.dumps(report, indent=1))
    if plot_file:
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
            atomic_write(json_file, json.dumps(report, indent=1))
        return
    if not default_malloc:
        tune_malloc()
    progress = stderr_progress(len(CASES) + 1)
    report = run_torch_bench(threads, repeat, dtype, progress)
    progress.done()
    click.echo(format_torch_report(report))
    if json_file:
        atomic_write(json_file, json.dumps(report, indent=1))


def _bench_jax(dtype: str, repeat: int, json_file: str | None) -> None:
    """``bench --jax``: derivgen.jax against Flax's layers, jitted, on the CPU."""
    from derivgen.tools.bench import format_jax_report, run_jax_bench

    progress = stderr_progress(6)
    try:
        report = run_jax_bench(repeat, dtype, progress)
    except ImportError as e:
        raise UserError(f"{e} (bench --jax needs JAX and Flax: pip install 'derivgen[jax]')") from None
    progress.done()
    click.echo(format_jax_report(report))
    if json_file:
        atomic_write(json_file, json.dumps(report, indent=1))


def _pdflatex(tex: str, pdf: Path) -> None:
    """Compile standalone LaTeX to ``pdf`` with pdflatex (run twice, for references)."""
    exe = shutil.which("pdflatex")
    if exe is None:
        raise click.ClickException(
            "pdflatex not found: install the Debian package texlive-latex-base (apt-get install -y texlive-latex-base)"
        )
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
        atomic_write(pdf, (Path(tmp) / "doc.pdf").read_bytes())


def main(argv: list[str] | None = None) -> int:
    """Entry point: errors become one line and an exit code, never a traceback."""
    try:
        cli.main(args=argv, prog_name="derivgen", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.UsageError as exc:
        msg = exc.format_message().splitlines()[0] if exc.format_message() else "usage error"
        ctx = f"derivgen {exc.ctx.info_name}: " if exc.ctx and exc.ctx.info_name != "derivgen" else "derivgen: "
        click.echo(f"{ctx}error: {msg}", err=True)
        return 2
    except click.ClickException as exc:
        click.echo(f"derivgen: error: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("derivgen: aborted", err=True)
        return 1
    except (SpecError, ValueError) as exc:
        click.echo(f"derivgen: error: {exc}", err=True)
        return 2
    except BrokenPipeError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
