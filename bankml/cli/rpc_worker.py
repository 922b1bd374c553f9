"""``bankml rpc-worker [--host H --allow-network] [--port P] [--threads N] [--rpc-server BIN]``:
one llama.cpp RPC worker (``rpc-server``), launched and supervised by bankml
(bankml/rpc_worker.py), until SIGTERM or SIGINT.

The worker binds 127.0.0.1 unless ``--host`` names another address and ``--allow-network`` is
given too: llama.cpp's RPC protocol has no authentication, so binding a network address is an
explicit choice, and bankml warns when it is made (docs/rpc.md says how to reach a worker on
another machine safely). ``--rpc-server`` defaults to $BANKML_RPC_SERVER, else the rpc-server
scripts/build-llama-server.sh built beside llama-server. Exit status: 128 + the signal after a
stop by SIGTERM or SIGINT (as ``bankml serve``), 1 for a usage error, 3 when the worker cannot
be brought up.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from bankml.cli.parsing import Commands, add_command

USAGE_EXIT = 1
EXIT_FAILED = 3


def default_rpc_server() -> str:
    env = os.environ.get("BANKML_RPC_SERVER")
    if env:
        return env
    cache = os.environ.get("BANKML_CACHE") or os.path.expanduser("~/.cache/bankml")
    return os.path.join(cache, "llama-server", "11434", "bin", "rpc-server")


def add_commands(commands: Commands) -> None:
    parser = add_command(
        commands,
        "rpc-worker",
        rpc_worker_command,
        "run and supervise a llama.cpp RPC worker (rpc-server) for --spawn ... --rpc",
        usage_exit=USAGE_EXIT,
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to bind (default 127.0.0.1); another needs --allow-network",
    )
    parser.add_argument("--port", type=int, default=50052, help="the port (default 50052)")
    parser.add_argument(
        "--allow-network",
        action="store_true",
        help="bind --host though it is not loopback: RPC has no authentication, keep the port "
        "on a private network, an SSH tunnel or WireGuard",
    )
    parser.add_argument("--threads", type=int, default=None, help="rpc-server's CPU threads (-t)")
    parser.add_argument(
        "--rpc-server",
        default=None,
        metavar="BIN",
        help="the rpc-server binary (default $BANKML_RPC_SERVER, else the one "
        "scripts/build-llama-server.sh built)",
    )
    parser.add_argument(
        "--restart-delay",
        default="1:60",
        metavar="MIN[:MAX]",
        help="seconds before a restart, doubling from MIN to MAX (1:60)",
    )


def rpc_worker_command(args: argparse.Namespace) -> int:
    # Twisted is imported only to run the worker
    from twisted.internet import reactor as _reactor
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    from bankml.process_protocol import parse_restart_delay
    from bankml.rpc_worker import LOOPBACK, WorkerProcess

    parser = args.command_parser
    if args.host not in LOOPBACK and not args.allow_network:
        parser.error(
            f"--host {args.host} is not loopback: llama.cpp's RPC protocol has no "
            "authentication; give --allow-network too to bind it (see docs/rpc.md)"
        )
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port}: not a port")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be positive")
    binary = args.rpc_server or default_rpc_server()
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        parser.error(
            f"--rpc-server {binary}: not an executable file "
            "(scripts/build-llama-server.sh builds it)"
        )
    try:
        delay = parse_restart_delay(args.restart_delay)
    except ValueError as err:
        parser.error(str(err))
    reactor: Any = _reactor
    observer = FilteringLogObserver(
        textFileLogObserver(sys.stderr), [LogLevelFilterPredicate(defaultLogLevel=LogLevel.info)]
    )
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
    worker = WorkerProcess(
        reactor, binary, args.host, args.port, threads=args.threads, restart_delay=delay
    )
    status = {"code": 0}

    def bring_up() -> None:
        def failed(failure: Any) -> None:
            print(f"bankml rpc-worker: {failure.getErrorMessage()}", file=sys.stderr, flush=True)
            status["code"] = EXIT_FAILED
            if reactor.running:
                reactor.stop()

        worker.start().addErrback(failed)

    worker.startService()
    reactor.addSystemEventTrigger("before", "shutdown", worker.stopService)
    reactor.callWhenRunning(bring_up)
    reactor.run()
    exit_signal = getattr(reactor, "_exitSignal", None)
    if exit_signal:
        return 128 + int(exit_signal)
    return status["code"]
