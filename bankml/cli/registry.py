"""``bankml create NAME -f|--file Modelfile [--registry [DIR]] [--models DIR]``.

``create_main(argv)`` takes the arguments after ``create``. The registry directory is ``DIR``,
or, when ``--registry`` is absent or has no value, ``$BANKML_FORKS``, else
``~/.local/share/bankml/forks``; it is created when missing. Pinned files are looked for in the
registry directory, then in ``--models``. A relative ``FROM ./x`` is relative to the Modelfile.

Status lines go to stdout; then stderr says ``bankml create: <name> (digest sha256:<d>) over
<file> (sha256 <s>)`` and the exit status is 0. A refusal prints ``bankml create: refuse: <why>``
and exits 2; a usage error or an unreadable Modelfile exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from bankml.cli.parsing import CommandParser
from bankml.registry.catalog import Catalog
from bankml.registry.create import CreateError, create, spec_from_modelfile
from bankml.registry.pins import discover

USAGE = "usage: bankml create NAME -f Modelfile [--registry [DIR]] [--models DIR]"
MAX_MODELFILE_BYTES = 16 * 1024 * 1024


def default_registry_dir(environ: Mapping[str, str]) -> str:
    """``$BANKML_FORKS``, else ``$HOME/.local/share/bankml/forks``."""
    forks = environ.get("BANKML_FORKS")
    if forks:
        return forks
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".local", "share", "bankml", "forks")


def _parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="bankml create", usage=USAGE.removeprefix("usage: "), usage_exit=1)
    parser.add_argument("name", metavar="NAME", help="the derived model's name")
    parser.add_argument("-f", "--file", dest="modelfile", help="the Modelfile")
    parser.add_argument(
        "--registry",
        nargs="?",
        const="",
        metavar="DIR",
        help="the registry directory (no value: $BANKML_FORKS, else ~/.local/share/bankml/forks)",
    )
    parser.add_argument("--models", metavar="DIR", help="also look for pinned files here")
    return parser


def create_main(
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    env = os.environ if environ is None else environ
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as done:  # --help (0), or a usage error printed on stderr (1)
        return int(done.code or 0)
    name, modelfile, directory, models = args.name, args.modelfile, args.registry, args.models
    if modelfile is None:
        print("bankml create: -f Modelfile is required", file=err)
        return 1
    directory = directory or default_registry_dir(env)
    try:
        with open(modelfile, "rb") as f:
            raw = f.read(MAX_MODELFILE_BYTES + 1)
    except OSError as e:
        print(f"bankml create: cannot read {modelfile}: {e.strerror or e}", file=err)
        return 1
    if len(raw) > MAX_MODELFILE_BYTES:
        print(
            f"bankml create: refuse: {modelfile} is larger than {MAX_MODELFILE_BYTES} bytes",
            file=err,
        )
        return 2
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        print(f"bankml create: cannot create {directory}: {e.strerror or e}", file=err)
        return 1
    registry = discover(directory, search=[directory] + ([models] if models else []))
    catalog = Catalog.load(
        registry, directory, log=lambda line: print(f"bankml create: {line}", file=err)
    )

    def status(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        status("parsing modelfile")
        spec = spec_from_modelfile(raw.decode("utf-8", "replace"))
        created = create(
            name,
            spec,
            catalog,
            relative_to=os.path.dirname(os.path.abspath(modelfile)),
            status=status,
        )
    except CreateError as why:
        print(f"bankml create: refuse: {why.message}", file=err)
        return 2
    m = created.manifest
    print(
        f"bankml create: {m.name} (digest sha256:{m.digest}) over {created.base_file} "
        f"(sha256 {m.base.sha256})",
        file=err,
    )
    return 0
