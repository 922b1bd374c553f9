"""`bankml` command line: one dispatcher, each subcommand owned by its module.

Each entry names ``module:function``; the function takes the remaining argv and returns the
exit status. Modules are imported only when their command runs, so ``bankml sha256`` does not
pay for Twisted or NumPy.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "guard": ("bankml.verify_cli:guard_command", "check a GGUF header: play, refuse or need_more"),
    "sha256": ("bankml.verify_cli:sha256_command", "sha256 of a file, read in large blocks"),
    "pin": ("bankml.verify_cli:pin_command", "write or update a file's pin in FORK.json"),
    "verify": ("bankml.verify_cli:verify_command", "the guard, then the sha256 pin"),
    "serve": ("bankml.tap:serve_command", "serve a verified model on loopback, with receipts"),
    "tokenize": ("bankml.text_cli:tokenize_command", "tokenize stdin with a GGUF's vocabulary"),
    "chat-template": ("bankml.text_cli:chat_template_command", "render a GGUF's chat template"),
    "generate": ("bankml.generate_cli:generate_command", "answer with the native engine"),
}


def usage() -> str:
    lines = ["usage: bankml COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<14} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stderr if not args else sys.stdout)
        return 1 if not args else 0
    if args[0] == "--version":
        from bankml import __version__

        print(f"bankml {__version__}")
        return 0
    entry = COMMANDS.get(args[0])
    if entry is None:
        print(f"bankml: unknown command {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 1
    module_name, function_name = entry[0].split(":")
    command = getattr(importlib.import_module(module_name), function_name)
    return int(command(args[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
