"""``bankml convert DIR -o OUT.gguf --fork F [--source S] [--outtype f16|bf16|q8_0|f32]``.

A Hugging Face safetensors directory to a GGUF, byte-identical to llama.cpp build 11434's
``convert_hf_to_gguf.py`` with the same ``--outtype``, pinned in F with its provenance. Prints
``pinned <sha256>`` (exit 0); a refusal prints ``refuse: <why>`` and exits 2, leaving no output
file; a bad command line exits 1.
"""

from __future__ import annotations

import argparse
import sys

from bankml.cli.parsing import Commands, add_command

USAGE_EXIT = 1


def add_commands(commands: Commands) -> None:
    parser = add_command(
        commands,
        "convert",
        convert_command,
        "convert a safetensors directory to a pinned GGUF (as llama.cpp's converter writes it)",
        "Convert a Hugging Face safetensors directory to a GGUF, byte-identical to llama.cpp "
        "build 11434's convert_hf_to_gguf.py, and pin it in FORK.json with its inputs' hashes.",
        USAGE_EXIT,
    )
    parser.add_argument(
        "directory",
        metavar="DIR",
        help="the model directory (config.json, tokenizer.json, *.safetensors)",
    )
    parser.add_argument(
        "-o",
        "--outfile",
        required=True,
        metavar="OUT.gguf",
        help="the GGUF to write (must not exist)",
    )
    parser.add_argument(
        "--fork", required=True, help="the FORK.json to pin it in (created when absent)"
    )
    parser.add_argument(
        "--source", help="where the directory came from (default: its canonical path)"
    )
    parser.add_argument(
        "--outtype",
        default="f16",
        choices=["f16", "bf16", "q8_0", "f32"],
        help="the weights' type (default f16)",
    )


def convert_command(args: argparse.Namespace) -> int:
    from bankml.convert import ConvertError, convert

    try:
        done = convert(
            args.directory, args.outfile, args.fork, source=args.source, outtype=args.outtype
        )
    except ConvertError as refused:
        print(f"refuse: {refused.reason}")
        return 2
    print(f"pinned {done.sha256}")
    print(
        f"bankml convert: {done.architecture}, {done.tensors} tensors, {done.bytes} bytes, "
        f"{len(done.inputs)} inputs hashed into {args.fork}",
        file=sys.stderr,
    )
    return 0
