"""`bankml guard`, `sha256`, `pin` and `verify`: the gate on the command line.

Outputs and exit codes follow shared/reference/verify-registry-create.md sections 2, 3 and 7:
guard 0 play / 2 refuse / 3 need_more / 1 unreadable; verify 0 play, 1 for "cannot ..." and
--fork problems, 3 for a truncated header, 2 for every other refusal; pin 0 or 2.
"""

from __future__ import annotations

import argparse
import json
import sys

import bankml
from bankml.gate.guard import guard_file
from bankml.gate.verify import Refused, pin, read_fork, sha256_file, verify

GUARD_EXIT = {"play": 0, "refuse": 2, "need_more": 3}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as exit 1 (the reference's usage exit), not 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(f"{self.format_usage()}{self.prog}: error: {message}")


def _parse(parser: _Parser, argv: list[str]) -> argparse.Namespace | None:
    try:
        return parser.parse_args(argv)
    except _UsageError as err:
        print(err, file=sys.stderr)
        return None


def _engine_option(parser: _Parser) -> None:
    parser.add_argument(
        "--engine",
        choices=("mainline", "prism"),
        default="mainline",
        help="prism allows the PrismML fork's types and Bonsai 2 (default mainline)",
    )


def _json_line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False)


def guard_command(argv: list[str]) -> int:
    parser = _Parser(
        prog="bankml guard", description="Check a GGUF header: play, refuse or need_more."
    )
    parser.add_argument("file")
    parser.add_argument("--json", action="store_true", help="print the verdict as one JSON object")
    _engine_option(parser)
    args = _parse(parser, argv)
    if args is None:
        return 1
    try:
        result = guard_file(args.file, args.engine)
    except OSError as err:
        print(f"bankml guard: cannot read {args.file}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(result.to_json() if args.json else result.to_text())
    return GUARD_EXIT[result.verdict]


def sha256_command(argv: list[str]) -> int:
    parser = _Parser(prog="bankml sha256", description="sha256 of a file, as sha256sum prints it.")
    parser.add_argument("file")
    args = _parse(parser, argv)
    if args is None:
        return 1
    try:
        digest = sha256_file(args.file)
    except OSError as err:
        print(f"bankml sha256: cannot read {args.file}: {err.strerror or err}", file=sys.stderr)
        return 1
    print(f"{digest}  {args.file}")
    return 0


def pin_command(argv: list[str]) -> int:
    parser = _Parser(
        prog="bankml pin", description="Write or update a file's sha256 pin in FORK.json."
    )
    parser.add_argument("file")
    parser.add_argument(
        "--fork", required=True, help="the FORK.json to write (created when absent)"
    )
    args = _parse(parser, argv)
    if args is None:
        return 1
    try:
        sha = pin(args.file, args.fork)
    except Refused as refused:
        print(f"refuse: {refused.reason}")
        return 2
    print(f"pinned {sha}")
    return 0


def verify_command(argv: list[str]) -> int:
    parser = _Parser(
        prog="bankml verify", description="The guard, then the whole-file sha256 against the pin."
    )
    parser.add_argument("file")
    parser.add_argument("--fork", required=True, help="FORK.json pinning the file's basename")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    _engine_option(parser)
    args = _parse(parser, argv)
    if args is None:
        return 1
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
                _json_line(
                    {"verdict": "refuse", "reason": refused.reason, "bankml": bankml.__version__}
                )
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
                    "bankml": bankml.__version__,
                    "arch": guard.arch,
                    "name": guard.name,
                    "types": dict(guard.types),
                }
            )
        )
    else:
        print(f"play pinned {verified.sha256}")
    return 0
