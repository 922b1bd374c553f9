"""``bankml check-receipt`` and ``bankml keygen``, as functions of their arguments.

    bankml check-receipt --request REQUEST --response RESPONSE --key PUBKEY
                         [--model-sha256 HEX] [--envelope FILE] [--replay MODEL --fork F
                          [--replay-with-llama-server BIN] [--chat-template-file F]]
    bankml check-receipt --log FILE --key PUBKEY
    bankml keygen [--key FILE] [--rotate | --revoke KEYID --reason TEXT]

check-receipt prints ``valid`` (exit 0) or ``refuse: <reason>`` (exit 2); with a replay, the
replay's verdict follows on a second line and a replay that does not pass (``refuse`` or
``cannot replay``) exits 2 too. ``--envelope FILE`` checks a DSSE envelope kept apart from the
answer (its ``bankml_receipt.envelope``, stored on its own) instead of the receipt in the
answer. ``--log FILE`` checks a ``--receipt-log`` (its rotated files too): ``valid: N receipts``,
or ``refuse:`` naming the first line that breaks it. A usage error (or an unreadable file) exits 1. keygen prints the key's path and id;
``--rotate`` retires the key in FILE into ``FILE.keyring.json`` and makes a new one in its
place, ``--revoke KEYID --reason TEXT`` marks a retired key revoked (receipts/keyring.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bankml.cli.parsing import CommandParser

EXIT_VALID, EXIT_REFUSED, EXIT_USAGE = 0, 2, 1


def _parser(prog: str, description: str) -> CommandParser:
    # like the gate's commands: 2 is a verdict (refuse), so a bad command line exits 1
    return CommandParser(prog=prog, description=description, usage_exit=EXIT_USAGE)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        print(f"{what} {path}: {err.strerror or err}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


def check_receipt_main(argv: Sequence[str] | None = None) -> int:
    parser = _parser("bankml check-receipt", "check a bankml answer's receipt")
    parser.add_argument("--request", help="the request body as sent")
    parser.add_argument("--response", help="the response body as received")
    parser.add_argument("--log", metavar="FILE", help="check this receipt log (--receipt-log)")
    parser.add_argument("--key", required=True, help="the PEM public key (GET /bankml/key)")
    parser.add_argument("--model-sha256", help="the model file's pinned sha256")
    parser.add_argument(
        "--envelope", metavar="FILE", help="check this DSSE envelope of the answer's receipt"
    )
    parser.add_argument("--replay", metavar="MODEL", help="replay the request on this file")
    parser.add_argument("--fork", help="MODEL's FORK.json (its pin)")
    parser.add_argument(
        "--chat-template-file",
        metavar="F",
        help="the chat template the answer's server ran with (its --chat-template-file)",
    )
    parser.add_argument(
        "--replay-with-llama-server", metavar="BIN", help="replay through this llama-server"
    )
    args = parser.parse_args(argv)
    if args.log:
        if args.request or args.response or args.replay or args.envelope:
            parser.error("--log FILE goes with --key alone")
        from bankml.receipts.check import check_receipt_log

        verdict = check_receipt_log(args.log, _read(args.key, "--key"))
        print(verdict, flush=True)
        return EXIT_VALID if verdict.startswith("valid") else EXIT_REFUSED
    if not args.request or not args.response:
        parser.error("--request and --response are required (or --log FILE)")
    if (args.replay is None) != (args.fork is None):
        parser.error("--replay MODEL and --fork F go together")
    if args.replay_with_llama_server and not args.replay:
        parser.error("--replay-with-llama-server needs --replay MODEL --fork F")
    if args.chat_template_file and not args.replay:
        parser.error("--chat-template-file goes with --replay")
    request = _read(args.request, "--request")
    response = _read(args.response, "--response")
    key = _read(args.key, "--key")

    from bankml.receipts.check import check_envelope, check_receipt

    if args.envelope:
        envelope = _read(args.envelope, "--envelope")
        verdict = check_envelope(request, response, envelope, key, model_sha256=args.model_sha256)
    else:
        verdict = check_receipt(request, response, key, model_sha256=args.model_sha256)
    print(verdict, flush=True)
    if verdict != "valid":
        return EXIT_REFUSED
    if not args.replay:
        return EXIT_VALID
    outcome = _replay(args, request, response)
    print(f"replay: {outcome}", flush=True)
    return EXIT_VALID if outcome.startswith("identical") else EXIT_REFUSED


def _replay(args: argparse.Namespace, request: bytes, response: bytes) -> str:
    from bankml.receipts import replay as rp
    from bankml.receipts.answer import Unreadable, answer_parts
    from bankml.receipts.kinds import EMBEDDING_APIS, RERANK

    try:
        receipt = rp.first_receipt(response)
    except Unreadable as err:
        return f"refuse: {err}"
    try:
        rp.replayable(receipt)
        if args.replay_with_llama_server and receipt.get("api") in EMBEDDING_APIS:
            return "cannot replay: an embedding answer is replayed on bankml's engine (--replay)"
        if args.replay_with_llama_server and receipt.get("api") == RERANK:
            return "cannot replay: a rerank answer is replayed on bankml's engine (--replay)"
        if args.replay_with_llama_server:
            if answer_parts(response) is not None:
                return (
                    "cannot replay: an answer with several receipts is replayed on bankml's "
                    "engine (--replay without --replay-with-llama-server)"
                )
            from bankml.gate.verify import Refused, verify

            try:
                verified = verify(args.replay, args.fork)
            except Refused as err:
                return f"cannot replay: the model file: {err.reason}"
            if verified.sha256 != receipt.get("model_sha256"):
                return f"refuse: the model file's sha256 is {verified.sha256}, the receipt names {receipt.get('model_sha256')}"
            server = rp.LlamaServerProcess(
                args.replay_with_llama_server,
                verified.path,
                receipt["n_ctx"],
                receipt["cache_type"],
                rp.llama_server_threads(),
                ["--chat-template-file", args.chat_template_file]
                if args.chat_template_file
                else [],
                reasoning_off=rp.is_p0(receipt),
            )
            with server:
                return rp.replay_with_llama_server(request, response, server)
        template = None
        if args.chat_template_file:
            with open(args.chat_template_file, encoding="utf-8") as handle:
                template = handle.read()
        engine = rp.open_replay_engine(args.replay, args.fork, receipt, template)
    except rp.CannotReplay as err:
        return f"cannot replay: {err}"
    except rp.ModelMismatch as err:
        return f"refuse: {err}"
    return rp.replay_in_process(request, response, engine)


def keygen_main(argv: Sequence[str] | None = None, home: str | None = None) -> int:
    parser = _parser("bankml keygen", "make a receipt signing key")
    parser.add_argument(
        "--key",
        help="where to write it (default $BANKML_RECEIPT_KEY, else under ~/.local/share/bankml/)",
    )
    parser.add_argument(
        "--rotate", action="store_true", help="retire the key into its keyring, make a new one"
    )
    parser.add_argument("--revoke", metavar="KEYID", help="mark this retired key revoked")
    parser.add_argument("--reason", help="why the key is revoked (with --revoke)")
    args = parser.parse_args(argv)
    if args.rotate and args.revoke:
        parser.error("--rotate and --revoke are separate steps")
    if bool(args.revoke) != bool(args.reason):
        parser.error("--revoke KEYID and --reason TEXT go together")

    from bankml.receipts.keyring import revoke, rotate
    from bankml.receipts.keys import KEY_ENV, KeyRefused, key_path, keygen

    environ = {k: v for k, v in os.environ.items() if not (home and k == KEY_ENV)}
    path = key_path(args.key, environ, home)
    try:
        if args.revoke:
            revoke(path, args.revoke, args.reason)
            print(json.dumps({"path": str(path), "revoked": args.revoke}))
            return EXIT_VALID
        key = rotate(path) if args.rotate else keygen(path)
    except KeyRefused as err:
        print(f"refuse: {err.reason}", file=sys.stderr)
        return EXIT_REFUSED
    print(json.dumps({"path": str(path), "keyid": key.keyid}))
    return EXIT_VALID
