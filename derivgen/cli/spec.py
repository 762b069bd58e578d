"""``derivgen lint`` and ``import``: the spec lint over files or built-in layers, and a PyTorch
forward read as a spec."""

from __future__ import annotations

import os
from pathlib import Path

import click

from derivgen import api
from derivgen.cli.common import LintErrors, UserError, _shape, _spec_or_name, _status, _write, cli
from derivgen.spec.lint import lint
from derivgen.spec.model import SpecError


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


@cli.command("import", short_help="Read a PyTorch module's or function's forward as a spec.")
@click.argument("target", metavar="PATH:NAME")
@click.option(
    "--shape",
    "shape_texts",
    required=True,
    multiple=True,
    help="An example input's shape, like 4x64 or 2,8,16,16; repeated for a forward of several tensors (x first).",
)
@click.option(
    "--arg", "args", multiple=True, metavar="VALUE", help="A constructor argument (a Python literal), in order."
)
@click.option("--kwarg", "kwargs", multiple=True, metavar="NAME=VALUE", help="A constructor keyword argument.")
@click.option("--name", default=None, help="The layer's name in the spec (default: from the class or function).")
@click.option(
    "-o", "--out", default=None, type=click.Path(dir_okay=False), help="Write the spec here (default: stdout)."
)
def import_cmd(
    target: str,
    shape_texts: tuple[str, ...],
    args: tuple[str, ...],
    kwargs: tuple[str, ...],
    name: str | None,
    out: str | None,
) -> None:
    """Trace a torch.nn.Module class (built with --arg/--kwarg) or a function, named as
    file.py:NAME or package.module:NAME, with torch.export on a float64 input of --shape (one
    --shape per tensor argument: x, then a residual, a gate ...), and write its forward as a
    spec (TOML): statistics, the normalized coordinate, parameters by the module's names, eps
    and other numbers as options, the tensors after x and the tensors returned after y. What no spec construct computes is
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
    shapes = tuple(_shape(t) for t in shape_texts)
    shape = shapes[0] if len(shapes) == 1 else shapes
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
