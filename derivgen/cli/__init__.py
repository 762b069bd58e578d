"""The ``derivgen`` command line: one module per group of commands (``derive``: list, derive,
prove; ``generate``: generate, check, build; ``spec``: lint, import; ``bench``), each adding its
commands to the one click group of ``common``; ``main`` turns every error into one line and an
exit code."""

from __future__ import annotations

import click

from derivgen.cli import bench, derive, generate, spec  # noqa: F401  (each adds its commands to the group)
from derivgen.cli.common import UserError, cli
from derivgen.spec.model import SpecError

__all__ = ["UserError", "cli", "main"]


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
