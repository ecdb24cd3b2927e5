"""Helpers shared by every `kvtier` command: error reporting, tables, JSON.

Errors: the root command group (`KvtierGroup`) catches any exception a command raises and
prints one line, `error: <message>`, on stderr and exits with status 1. A global `--debug`
(or KVTIER_DEBUG=1) lets the exception through with its traceback instead. Commands therefore
just raise ValueError / OSError with a message that says what was wrong and what to do.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import ClassVar

import typer
import typer.core
import typer.main
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

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


class LazyCommand(typer.core.TyperCommand):
    """A command listed by name and one-line help, whose module is imported only when the
    command runs (or its own --help is asked for): `kvtier --help` and `kvtier --version`
    then never import torch.

    target: "module:attribute", a typer command function or a `typer.Typer` group.
    """

    def __init__(self, name: str, target: str, short_help: str) -> None:
        super().__init__(name=name, help=short_help, short_help=short_help)
        self.target = target

    def load(self) -> typer.core.TyperCommand | typer.core.TyperGroup:
        """Import the target and build its command (a group for a `typer.Typer`)."""
        module_name, attribute = self.target.split(":")
        obj = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(obj, typer.Typer):
            single = typer.Typer(add_completion=False)
            single.command(self.name)(obj)
            obj = single
        command = typer.main.get_command(obj)
        command.name = self.name
        unwrap_help(command)
        return command


def unwrap_help(command) -> None:
    """Join the lines of each paragraph of a command's help (and its subcommands'), so
    docstring line breaks never show in `--help` listings; blank lines stay paragraph
    breaks."""
    if command.help:
        paragraphs = inspect.cleandoc(command.help).split("\n\n")
        command.help = "\n\n".join(" ".join(p.split()) for p in paragraphs)
    for sub in getattr(command, "commands", {}).values():
        if not isinstance(sub, LazyCommand):
            unwrap_help(sub)


class KvtierGroup(typer.core.TyperGroup):
    """The root command group: turns an exception from any subcommand into one stderr line,
    and loads `LazyCommand`s when they are invoked.

    Click's own exceptions (usage errors, `typer.Exit`, Ctrl-C aborts) keep their behaviour.
    Subclasses list their lazily loaded commands in `lazy_commands` as
    (name, "module:attribute", one-line help).
    """

    lazy_commands: ClassVar[tuple[tuple[str, str, str], ...]] = ()

    def __init__(self, **attrs) -> None:
        super().__init__(**attrs)
        unwrap_help(self)
        for name, target, short_help in self.lazy_commands:
            self.commands.setdefault(name, LazyCommand(name, target, short_help))

    def resolve_command(self, ctx: typer.Context, args: list[str]):
        name, command, rest = super().resolve_command(ctx, args)
        if isinstance(command, LazyCommand):
            command = command.load()
            self.commands[name] = command
        return name, command, rest

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except _FRAMEWORK_EXCEPTIONS:
            raise
        except BrokenPipeError:
            # The reader went away (`kvtier ... | head`): nothing more can be shown.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(EXIT_FAILURE)
        except Exception as exc:  # the one place where every command's errors are reported
            if ctx.params.get(DEBUG_PARAM) or debug_from_env():
                raise
            typer.echo(format_error(exc), err=True)
            ctx.exit(EXIT_FAILURE)


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[object]],
                err: bool = False) -> None:
    """Print a titled table (cells shown with str()) on stdout, or stderr with `err`.

    It stays readable when piped or 80 columns wide: the title wraps between words, a column
    is never narrower than its header's longest word or its widest short cell (headers wrap
    between words, numbers are never cut), long cells fold onto more lines, and a table too
    wide for the console is printed as one `column: value` block per row instead.
    """
    console = Console(stderr=err)
    cells = [[str(cell) for cell in row] for row in rows]
    min_widths = []
    for index, column in enumerate(columns):
        short = [len(row[index]) for row in cells
                 if index < len(row) and len(row[index]) <= _SHORT_CELL]
        min_widths.append(max([len(word) for word in column.split()] + short))
    console.print(Text(title, style="italic"))
    if sum(min_widths) + _COLUMN_GAP * (len(columns) - 1) > console.width:
        for row in cells:
            block = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False)
            block.add_column(no_wrap=True, style="bold")
            block.add_column(overflow="fold")
            for column, cell in zip(columns, row):
                block.add_row(column, cell)
            console.print(block)
            console.print()
        return
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for index, column in enumerate(columns):
        numeric = all(_looks_numeric(row[index]) for row in cells if index < len(row))
        table.add_column(column, justify="right" if numeric and index else "left",
                         min_width=min_widths[index], overflow="fold")
    for row in cells:
        table.add_row(*row)
    console.print(table)


#: Cells up to this many characters are never wrapped (numbers, short names).
_SHORT_CELL = 24
#: Characters between two columns (the padding on both sides and the rule).
_COLUMN_GAP = 3


def _looks_numeric(cell: str) -> bool:
    text = cell.replace(",", "").replace("%", "").replace(" MiB", "").strip()
    try:
        float(text)
    except ValueError:
        return text in ("-", "")
    return True


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

