"""``bankml generate``: answer a prompt or a conversation with the native engine.

The text is streamed to stdout as it forms; with ``--json`` one object is printed at the end
instead: text, tokens, prompt_tokens, finish_reason and timings.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from bankml.cli.parsing import Commands, add_command


def add_commands(commands: Commands) -> None:
    p = add_command(commands, "generate", generate_command, "answer with the native engine")
    p.add_argument("model", metavar="FILE", help="GGUF model file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw text, tokenized as llama-server's /completion does")
    src.add_argument(
        "--messages", help="a JSON array of chat messages, rendered with the chat template"
    )
    p.add_argument(
        "--max", type=int, default=-1, dest="max_tokens", help="token limit (-1: until EOG)"
    )
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--top-k", type=int, dest="top_k")
    p.add_argument("--top-p", type=float, dest="top_p")
    con = p.add_mutually_exclusive_group()
    con.add_argument("--grammar", help="a GBNF grammar")
    con.add_argument("--json-schema", dest="json_schema", help="a JSON schema (JSON text)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--ctx", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")


def request_body(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The llama-server request these options stand for, and its kind."""
    body: dict[str, Any] = {"n_predict": args.max_tokens}
    for name in ("temperature", "seed", "top_k", "top_p", "grammar"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.json_schema is not None:
        try:
            body["json_schema"] = json.loads(args.json_schema)
        except ValueError as err:
            raise SystemExit(f"bankml generate: --json-schema is not JSON: {err}") from None
    if args.messages is not None:
        try:
            body["messages"] = json.loads(args.messages)
        except ValueError as err:
            raise SystemExit(f"bankml generate: --messages is not JSON: {err}") from None
        if "json_schema" in body:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"schema": body.pop("json_schema")},
            }
        return body, "chat"
    body["prompt"] = args.prompt
    return body, "completion"


def generate_command(args: argparse.Namespace) -> int:
    body, kind = request_body(args)
    # the engine (NumPy, Numba) only once the command runs: `bankml --help` stays quick
    from bankml.engine_cupy.engine import Engine
    from bankml.engine_cupy.model import UnsupportedModel
    from bankml.engine_cupy.request import RequestError
    from bankml.engine_cupy.schedule import Chunk

    try:
        engine = Engine.open(
            args.model,
            n_ctx=args.ctx,
            device=args.device,
            cache_type=os.environ.get("BANKML_CACHE_TYPE"),
            cache_ram=os.environ.get("BANKML_CACHE_RAM"),
        )
    except (UnsupportedModel, OSError, ValueError) as err:
        print(f"bankml generate: {err}", file=sys.stderr)
        return 2
    try:
        request = engine.parse_request(body, kind)
    except RequestError as err:
        message = err.body if isinstance(err.body, str) else json.dumps(err.body)
        reason = f" ({err.reason})" if err.reason else ""
        print(f"bankml generate: {message}{reason}", file=sys.stderr)
        return 2
    steps = engine.run_steps(request)
    for chunk in steps:  # Chunks only: no prompt progress was asked for
        if not args.json and isinstance(chunk, Chunk) and chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    s = steps.summary
    if args.json:
        print(
            json.dumps(
                {
                    "text": s.text,
                    "tokens": s.tokens,
                    "prompt_tokens": s.prompt_tokens,
                    "finish_reason": s.finish_reason,
                    "timings": s.timings,
                },
                ensure_ascii=False,
            )
        )
    else:
        sys.stdout.write("\n")
    return 0
