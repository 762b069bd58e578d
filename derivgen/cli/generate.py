"""``derivgen generate``, ``check`` and ``build``: write the generated code, cross-check it, compile it."""

from __future__ import annotations

import importlib.util
import json
import time
import warnings
from pathlib import Path

import click

from derivgen import api
from derivgen.cli.common import STRICT_HELP, UserError, _lint, _make_dir, _out_dir, _sizes, _specs, _status, cli
from derivgen.codegen import targets
from derivgen.runtime.build import BuildError, BuildWarning, build_shared, library_path
from derivgen.spec import Spec, catalogue_names
from derivgen.tools import generate as gen
from derivgen.tools.check import check_layer
from derivgen.tools.check_report import format_table, rows_json
from derivgen.tools.progress import stderr_progress


def _labels(names: tuple[str, ...]) -> str:
    """The targets' labels as a list in words: ``NumPy, C, PyTorch, JAX and Triton``."""
    labels = [targets.get(t).label for t in names]
    return ", ".join(labels[:-1]) + " and " + labels[-1] if len(labels) > 1 else "".join(labels)


@cli.command("generate", short_help=f"Write the {_labels(gen.TARGETS)} code of layers.")
@click.argument("names", nargs=-1)
@click.option("--spec", "spec_files", multiple=True, type=click.Path(dir_okay=False), help="Spec file(s) to generate.")
@click.option(
    "--target",
    type=click.Choice(list(targets.names())),
    multiple=True,
    help=f"Targets (default: {', '.join(gen.TARGETS)}).",
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
        folder = out / targets.get(target).folder
        if folder.is_dir():
            for path in sorted(folder.glob("*.py")):
                try:
                    if "from catalogue/" in path.read_text(encoding="utf-8", errors="replace")[:300]:
                        return True
                except OSError:
                    continue
    return False


def _not_over_catalogue(specs: list[Spec], out: Path, chosen: tuple[str, ...]) -> None:
    """UserError if writing ``specs`` (spec files, not the catalogue) into ``out`` would replace a
    file generated from the catalogue (its header says ``from catalogue/``)."""
    clash = []
    for spec in specs:
        for target in chosen:
            for relative in targets.get(target).paths(spec.name).values():
                path = out / relative
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


@cli.command("build", short_help="Compile the C kernels into the build cache.")
@click.argument("names", nargs=-1)
@click.option("--spec", "spec_files", multiple=True, type=click.Path(dir_okay=False), help="Spec file(s) to build.")
@click.option(
    "--torch",
    "torch_ext",
    is_flag=True,
    help="Also build derivgen.torch's C++ extension (needs torch; 1-2 min the first time).",
)
@click.option(
    "--second",
    is_flag=True,
    help="Also build each layer's second-order kernels (double backward, JVP), a library of their own.",
)
def build_cmd(names: tuple[str, ...], spec_files: tuple[str, ...], torch_ext: bool, second: bool) -> None:
    """Compile the C kernels into shared libraries in the build cache (CC and CFLAGS honored),
    ahead of their first use; --torch builds derivgen.torch's extension too, --second the
    second-order kernels (built on their first call otherwise)."""
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
        for extra in [None, *([["-DDG_SECOND_ONLY"]] if second else [])]:
            label = spec.name + (" 2nd" if extra else "")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", BuildWarning)
                try:
                    cached = library_path(source, extra=extra).is_file()
                    t0 = time.perf_counter()
                    with _status("" if cached else f"compiling {label}"):
                        lib = build_shared(source, extra=extra)
                    took = time.perf_counter() - t0
                except BuildError as exc:
                    raise click.ClickException(f"{spec.name}: {exc}") from None
            for w in caught:
                if issubclass(w.category, BuildWarning):
                    click.echo(f"derivgen: warning: {w.message}", err=True)
            what = "cached" if cached else f"compiled in {took:.1f} s"
            click.echo(f"{label:<18} {what:<18} {lib}")
