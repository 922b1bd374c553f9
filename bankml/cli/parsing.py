"""The parser class every ``bankml`` command is built with, and the helper that adds one."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn

# A command's body: the parsed arguments in, the exit status out.
Run = Callable[[argparse.Namespace], int]
Commands = argparse._SubParsersAction  # what add_subparsers returns (argparse names it privately)


class CommandParser(argparse.ArgumentParser):
    """argparse with the exit status for a bad command line chosen per command.

    The gate's commands keep 2 and 3 for verdicts (refuse, need_more), so their usage errors exit
    1; the engine's commands keep argparse's 2.
    """

    def __init__(self, *args: Any, usage_exit: int = 2, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.usage_exit = usage_exit

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(self.usage_exit, f"{self.prog}: error: {message}\n")


def add_command(
    commands: Commands,
    name: str,
    run: Run,
    summary: str,
    description: str | None = None,
    usage_exit: int = 2,
    **kwargs: Any,
) -> CommandParser:
    """A subparser for ``bankml NAME``: ``summary`` is its line in ``bankml --help``."""
    parser: CommandParser = commands.add_parser(
        name, help=summary, description=description or summary, usage_exit=usage_exit, **kwargs
    )
    parser.set_defaults(run=run, command_parser=parser)
    return parser
