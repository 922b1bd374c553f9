"""``bankml usage [PID...]``: one sample of what bankml (this process) and the given processes
cost, the same document as ``GET /bankml/usage`` (``bankml.usage.UsageSampler``).

The window is 500 ms (the server's is 250 ms: a command line has time to spare, and a longer
window reads CPU % more steadily). Processes are named ``bankml`` (this command) and ``pid N``;
a pid that is gone is left out, as the server leaves out a dead engine. An argument that is not a
pid is a usage error (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from bankml.cli.parsing import Commands, add_command

WINDOW_S = 0.5


def add_commands(commands: Commands) -> None:
    parser = add_command(
        commands,
        "usage",
        usage_command,
        "memory and CPU of bankml and the given processes (one 500 ms sample, JSON)",
        usage_exit=1,
    )
    parser.add_argument("pids", nargs="*", type=_pid, metavar="PID", help="a process id")


def _pid(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a process id")
    return int(text)


def usage_command(args: argparse.Namespace) -> int:
    # Twisted and psutil are imported only for this command
    from twisted.internet import task

    from bankml.usage import UsageSampler

    named = [("bankml", os.getpid())] + [(f"pid {pid}", pid) for pid in args.pids]
    sample: dict[str, Any] = {}

    def take(reactor: Any) -> Any:
        sampler = UsageSampler(reactor, lambda: named, interval=WINDOW_S, keep=0.0)
        return sampler.sample().addCallback(sample.update)

    try:
        task.react(take)
    except SystemExit as done:  # react exits; 0 once the sample is taken
        if done.code:
            return int(done.code)
    print(json.dumps(sample, indent=1), file=sys.stdout)
    return 0
