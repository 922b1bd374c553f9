"""``bankml`` and its subcommands: one argparse parser, a subparser for each command.

Each command's arguments are declared by the module that owns it (``bankml.cli.gate``,
``bankml.cli.text``, ``bankml.cli.generate``); the bodies import Twisted, NumPy or the engine
only when they run, so ``bankml sha256`` or ``bankml --help`` start in well under a second.
``serve`` takes no arguments here: they go verbatim to the twistd plugin's options
(``bankml.tap.Options``), so ``bankml serve`` and ``twistd bankml`` read the same command line.
"""

from __future__ import annotations

import argparse
import sys

from bankml.cli import convert, gate, generate, rpc_worker, text, usage
from bankml.cli.parsing import CommandParser, add_command
from bankml.version import __version__

USAGE_EXIT = 1  # no command, an unknown one, or a bad option before it
# commands whose arguments go as given to the module that parses them
PASSTHROUGH = ("create", "check-receipt", "keygen", "llama-server")


def version_line() -> str:
    return f"bankml {__version__}"


def build_parser() -> CommandParser:
    parser = CommandParser(
        prog="bankml",
        description="A verifying loopback gateway for local GGUF language models.",
        epilog="`bankml COMMAND --help` describes a command's options.",
        usage_exit=USAGE_EXIT,
    )
    parser.add_argument(
        "--version", action="version", version=version_line(), help="print bankml's version"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    gate.add_commands(commands)
    add_command(
        commands,
        "serve",
        serve_command,
        "serve a verified model on loopback, with receipts",
        usage_exit=USAGE_EXIT,
        add_help=False,  # --help goes to the twistd options, which list serve's options
    )
    add_command(
        commands,
        "llama-server",
        llama_server_command,
        "llama-server's command line, served natively: bankml llama-server --fork F -m FILE ...",
        usage_exit=USAGE_EXIT,
        add_help=False,  # its arguments are llama-server's, read by serving.llama_flags
    )
    text.add_commands(commands)
    convert.add_commands(commands)
    generate.add_commands(commands)
    usage.add_commands(commands)
    rpc_worker.add_commands(commands)
    add_command(
        commands,
        "create",
        create_command,
        "derive a model from a pinned one: bankml create NAME -f Modelfile [--registry DIR]",
        usage_exit=USAGE_EXIT,
        add_help=False,  # its arguments go to the registry's create command as given
    )
    add_command(
        commands,
        "check-receipt",
        check_receipt_command,
        "check a signed receipt: --request REQUEST --response RESPONSE --key PUBKEY [--replay ...]",
        usage_exit=USAGE_EXIT,
        add_help=False,  # its arguments go to the receipts' checker as given
    )
    add_command(
        commands,
        "keygen",
        keygen_command,
        "create an Ed25519 receipt-signing key: bankml keygen [--key FILE]",
        usage_exit=USAGE_EXIT,
        add_help=False,
    )
    add_command(
        commands, "version", version_command, "print bankml's version", usage_exit=USAGE_EXIT
    )
    help_parser = add_command(
        commands, "help", help_command, "print this help", usage_exit=USAGE_EXIT
    )
    help_parser.set_defaults(top_parser=parser)
    return parser


def serve_command(args: argparse.Namespace) -> int:
    # Twisted is imported only to serve
    from bankml.tap import serve_command as serve

    return serve(args.serve_argv)


DROPIN_USAGE = (
    "usage: bankml llama-server --fork FORK.json -m FILE [llama-server's flags] [--listen ADDR]\n"
    "llama-server's command line, answered by bankml's native engine on --host/--port\n"
    "(default 127.0.0.1:8080); docs/llama-server.md lists what each flag does here."
)


def llama_server_command(args: argparse.Namespace) -> int:
    """`bankml llama-server ...`: llama-server's arguments rewritten into `bankml serve --native`
    (serving.llama_flags.dropin_argv), then served as `bankml serve` serves them."""
    from bankml.serving.llama_flags import DEFAULT_PORT, FlagError, dropin_argv

    argv = list(args.passthrough_argv)
    if any(a in ("-h", "--help", "--usage") for a in argv):
        print(DROPIN_USAGE)
        return 0
    if "--version" in argv:
        print(version_line())
        return 0
    try:
        serve_argv, notes = dropin_argv(argv)
    except FlagError as err:
        print(f"bankml llama-server: {err}\n{DROPIN_USAGE}", file=sys.stderr)
        return USAGE_EXIT
    for note in notes:
        print(f"bankml llama-server: {note}", file=sys.stderr)
    if "--host" not in serve_argv and "--port" not in serve_argv:
        serve_argv += ["--port", str(DEFAULT_PORT)]  # llama-server's address, not bankml's
    from bankml.tap import serve_command as serve

    return serve(serve_argv)


def create_command(args: argparse.Namespace) -> int:
    from bankml.cli.registry import create_main

    return create_main(args.passthrough_argv)


def check_receipt_command(args: argparse.Namespace) -> int:
    from bankml.cli.receipts import check_receipt_main

    return check_receipt_main(args.passthrough_argv)


def keygen_command(args: argparse.Namespace) -> int:
    from bankml.cli.receipts import keygen_main

    return keygen_main(args.passthrough_argv)


def version_command(args: argparse.Namespace) -> int:
    print(version_line())
    return 0


def help_command(args: argparse.Namespace) -> int:
    args.top_parser.print_help()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return USAGE_EXIT
    if args.command == "serve":
        args.serve_argv = rest  # FILE and every option, in the order given
    elif args.command in PASSTHROUGH:
        args.passthrough_argv = rest
    elif rest:
        args.command_parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
