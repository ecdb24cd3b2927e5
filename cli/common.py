"""Helpers shared by every `kvtier` command: error reporting, tables, JSON.

Errors: the root command group (`KvtierGroup`) catches any exception a command raises and
prints one line, `error: <message>`, on stderr and exits with status 1. A global `--debug`
(or KVTIER_DEBUG=1) lets the exception through with its traceback instead. Commands therefore
just raise ValueError / OSError with a message that says what was wrong and what to do.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import typer
import typer.core
from rich.console import Console
from rich.table import Table

#: Exit status of a command that failed with an error (click uses 2 for usage errors).
EXIT_FAILURE = 1

#: The root group's parameter that turns tracebacks on.
DEBUG_PARAM = "debug"

# The command-line framework's own control flow: usage errors, `typer.Exit`, aborts. They are
# found through typer's public names because typer either depends on click or vendors it.
_CLICK_EXCEPTION = next(cls for cls in typer.BadParameter.__mro__
                        if cls.__name__ == "ClickException")
_FRAMEWORK_EXCEPTIONS = (_CLICK_EXCEPTION, typer.Exit, typer.Abort)


def debug_from_env() -> bool:
    """True when KVTIER_DEBUG is set to something other than "", "0" or "false"."""
    return os.environ.get("KVTIER_DEBUG", "").lower() not in ("", "0", "false", "no")


def format_error(exc: BaseException) -> str:
    """One line naming the problem: the message of expected errors, the type of others."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, (ValueError, OSError)):
        return f"error: {message}"
    return f"error: {type(exc).__name__}: {message} (run with --debug for the traceback)"


class KvtierGroup(typer.core.TyperGroup):
    """The root command group: turns an exception from any subcommand into one stderr line.

    Click's own exceptions (usage errors, `typer.Exit`, Ctrl-C aborts) keep their behaviour.
    """

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except _FRAMEWORK_EXCEPTIONS:
            raise
        except Exception as exc:  # the one place where every command's errors are reported
            if ctx.params.get(DEBUG_PARAM) or debug_from_env():
                raise
            typer.echo(format_error(exc), err=True)
            ctx.exit(EXIT_FAILURE)


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """Print a rich table to stdout; cells are shown with str()."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column == columns[0] else "right")
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    Console().print(table)


def _json_safe(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN / inf; a missing figure is null
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def print_json(data: object) -> None:
    """Print `data` as indented JSON on stdout (Paths as strings, NaN / inf as null)."""
    sys.stdout.write(json.dumps(_json_safe(data), indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()

