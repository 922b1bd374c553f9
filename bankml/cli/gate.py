"""``bankml guard``, ``sha256``, ``pin`` and ``verify``: the gate on the command line.

Exit codes: guard 0 play / 2 refuse / 3 need_more / 1 unreadable; verify 0 play, 1 for "cannot ..."
and --fork problems, 3 for a truncated header, 2 for every other refusal; pin 0 or 2; sha256 0 or
1. A bad command line exits 1 for all four (2 and 3 are verdicts).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bankml.cli.parsing import CommandParser, Commands, add_command
from bankml.gate.guard import guard_file
from bankml.gate.verify import Refused, pin, read_fork, sha256_file, verify
from bankml.version import __version__

GUARD_EXIT = {"play": 0, "refuse": 2, "need_more": 3}
USAGE_EXIT = 1


def add_commands(commands: Commands) -> None:
    guard = add_command(
        commands,
        "guard",
        guard_command,
        "check a GGUF header: play, refuse or need_more",
        "Check a GGUF header: play, refuse or need_more.",
        USAGE_EXIT,
    )
    guard.add_argument("file")
    guard.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    _engine_option(guard)

    sha256 = add_command(
        commands,
        "sha256",
        sha256_command,
        "sha256 of a file, read in large blocks",
        "sha256 of a file, as sha256sum prints it.",
        USAGE_EXIT,
    )
    sha256.add_argument("file")

    pin_parser = add_command(
        commands,
        "pin",
        pin_command,
        "write or update a file's pin in FORK.json",
        "Write or update a file's sha256 pin in FORK.json.",
        USAGE_EXIT,
    )
    pin_parser.add_argument("file")
    pin_parser.add_argument(
        "--fork", required=True, help="the FORK.json to write (created when absent)"
    )

    verify_parser = add_command(
        commands,
        "verify",
        verify_command,
        "the guard, then the sha256 pin",
        "The guard, then the whole-file sha256 against the pin.",
        USAGE_EXIT,
    )
    verify_parser.add_argument("file")
    verify_parser.add_argument(
        "--fork", required=True, help="FORK.json pinning the file's basename"
    )
    verify_parser.add_argument(
        "--json", action="store_true", help="print the result as one JSON object"
    )
    _engine_option(verify_parser)


def _engine_option(parser: CommandParser) -> None:
    parser.add_argument(
        "--engine",
        choices=("mainline", "prism"),
        default="mainline",
        help="prism allows the PrismML fork's types and Bonsai 2 (default mainline)",
    )


def _json_line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False)


def guard_command(args: argparse.Namespace) -> int:
    try:
        result = guard_file(args.file, args.engine)
    except OSError as err:
        print(f"bankml guard: cannot read {args.file}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(result.to_json() if args.json else result.to_text())
    return GUARD_EXIT[result.verdict]


def sha256_command(args: argparse.Namespace) -> int:
    try:
        digest = sha256_file(args.file)
    except OSError as err:
        print(f"bankml sha256: cannot read {args.file}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(f"{digest}  {args.file}")
    return 0


def pin_command(args: argparse.Namespace) -> int:
    try:
        sha = pin(args.file, args.fork)
    except Refused as refused:
        print(f"refuse: {refused.reason}")
        return 2
    print(f"pinned {sha}")
    return 0


def verify_command(args: argparse.Namespace) -> int:
    try:
        read_fork(args.fork)  # a --fork problem is an I/O error (exit 1), reported before the guard
    except Refused as refused:
        print(f"bankml: {refused.reason}", file=sys.stderr)
        return 1
    try:
        verified = verify(args.file, args.fork, args.engine)
    except Refused as refused:
        if args.json:
            print(
                _json_line({"verdict": "refuse", "reason": refused.reason, "bankml": __version__})
            )
        else:
            print(f"refuse: {refused.reason}")
        return refused.exit_code
    if args.json:
        guard = verified.guard
        print(
            _json_line(
                {
                    "verdict": "play",
                    "guard": guard.verdict,
                    "engine": guard.engine,
                    "model_sha256": verified.sha256,
                    "bankml": __version__,
                    "arch": guard.arch,
                    "name": guard.name,
                    "types": dict(guard.types),
                }
            )
        )
    else:
        print(f"play pinned {verified.sha256}")
    return 0
