"""``derivgen bench``: the generated code timed against NumPy, PyTorch, Flax and the bandwidth bound."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import click

from derivgen.cli.common import UserError, _make_dir, _out_file, _shape, _specs, _write, cli
from derivgen.tools.bench import default_shapes, run_bench
from derivgen.tools.bench_report import format_report, plot
from derivgen.tools.bench_targets import DEFAULT_SHAPES
from derivgen.tools.progress import stderr_progress
from derivgen.tools.timing import tune_malloc


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
    "--zoo",
    "with_zoo",
    is_flag=True,
    help="Every catalogue and zoo layer (or NAMES): derivgen.torch against an independent PyTorch forward, eager "
    "and torch.compile, fwd and fwd+bwd, with the memory floor; with --jax, derivgen.jax against jnp + autodiff.",
)
@click.option("--small", is_flag=True, help="With --zoo: tiny shapes (64x128, 4x8x6x6), a run of seconds per layer.")
@click.option("--no-compile", "no_compile", is_flag=True, help="With --zoo: leave torch.compile out.")
@click.option(
    "--block",
    is_flag=True,
    help="With --zoo: each layer inside a block's neighbours, gelu(y) + x, in every variant; derivgen's module "
    "runs under torch.compile with them (against the whole block compiled by Inductor).",
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
    with_zoo: bool,
    small: bool,
    no_compile: bool,
    block: bool,
    sync_world: int | None,
) -> None:
    """Time generated C and NumPy against plain NumPy, PyTorch and the memory-bandwidth bound."""
    if with_zoo:
        if with_torch or sync_world or spec_files or plot_file or isas != "native" or dtype != "float32":
            raise UserError(
                "--zoo takes NAMES, --shape, --small, --no-compile, --block, --jax, --threads, --repeat, --json and "
                "--default-malloc only (float32)"
            )
        if block and (no_compile or with_jax):
            raise UserError(
                "--block compares derivgen under torch.compile with Inductor: not with --no-compile or --jax"
            )
        _bench_zoo(names, shapes, small, no_compile, with_jax, threads, repeat, json_file, default_malloc, block)
        return
    if small or no_compile or block:
        raise UserError("--small, --no-compile and --block go with --zoo")
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
        from derivgen.tools.bench_torch import CASES, format_torch_report, run_torch_bench
    except ImportError as e:
        raise UserError(str(e)) from None
    if sync_world:
        from derivgen.tools.bench_sync import format_sync_report, run_sync_bench  # optional PyTorch, as above

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
        from derivgen.tools.bench_bf16 import LAYERS, format_bf16_report, run_bf16_bench
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
    from derivgen.tools.bench_jax import format_jax_report, run_jax_bench

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


def _bench_zoo(
    names: tuple[str, ...],
    shapes: tuple[str, ...],
    small: bool,
    no_compile: bool,
    with_jax: bool,
    threads: int | None,
    repeat: int,
    json_file: str | None,
    default_malloc: bool,
    block: bool = False,
) -> None:
    """``bench --zoo``: every layer against an independent PyTorch forward (``--jax``: jnp + autodiff;
    ``--block``: inside gelu(y) + x)."""
    try:  # PyTorch is an optional dependency; the zoo bench's references and oracle are PyTorch's
        from derivgen.tools import bench_zoo as Z
    except ImportError as e:
        raise UserError(f"{e} (bench --zoo needs PyTorch)") from None
    known = Z.layers()
    bad = [n for n in names if n not in known]
    if bad:
        raise UserError(f"--zoo: unknown layer(s) {', '.join(bad)} (`derivgen list` names them)")
    trailing, channels = (Z.SMALL_TRAILING, Z.SMALL_CHANNELS) if small else (Z.TRAILING, Z.CHANNELS)
    for text in shapes:  # a 2-D shape is the trailing layers', a 4-D one the channel layers'
        s = _shape(text)
        if len(s) == 2:
            trailing = s
        elif len(s) == 4:
            channels = s
        else:
            raise UserError(f"--shape with --zoo: 2-D (rows x features) or 4-D (NxCxHxW), got {text!r}")
    _out_file(json_file, "--json")
    if not default_malloc:
        tune_malloc()
    layers = list(names) or known
    progress = stderr_progress(len(layers))
    if with_jax:
        if no_compile:
            raise UserError("--no-compile is the PyTorch zoo bench's; --jax compiles nothing with Inductor")
        try:
            from derivgen.tools.bench_zoo_jax import format_zoo_jax_report, run_zoo_jax_bench
        except ImportError as e:
            raise UserError(f"{e} (bench --zoo --jax needs JAX: pip install jax)") from None
        report = run_zoo_jax_bench(layers, trailing, channels, repeat, progress)
        text = format_zoo_jax_report(report)
    else:
        report = Z.run_zoo_bench(layers, trailing, channels, threads, repeat, not no_compile, True, progress, block)
        text = Z.format_zoo_report(report)
    progress.done()
    click.echo(text)
    if json_file:
        _write(json_file, json.dumps(report, indent=1), "--json")
