"""llama.cpp's RPC workers as bankml sees them: their addresses, and the hello that says a worker
answers and speaks the RPC protocol of bankml's llama.cpp build (11434).

A worker is an ``rpc-server`` (llama.cpp's ``tools/rpc``, built beside llama-server by
scripts/build-llama-server.sh); llama-server ``--rpc HOST:PORT,...`` spreads the model's layers
over them. Before P0 starts llama-server on workers (and before every restart),
``workers_problem`` connects to each and sends RPC's HELLO, as llama-server's own client does
first (ggml-rpc.cpp ``negotiate_hello``):

- request: the command byte ``RPC_CMD_HELLO`` (14), the request's size as a little-endian
  uint64 (24), then 24 bytes of transport capabilities (all zero: plain TCP, no RDMA);
- answer: its size as a little-endian uint64 (28), then ``major, minor, patch, padding`` bytes
  and the server's 24 bytes of capabilities (an older protocol's answer also starts with the
  three version bytes, so its version is read and named).

A worker that does not answer, answers something else, or speaks another protocol version than
``PROTOCOL`` (RPC_PROTO_*_VERSION of build 11434, ggml/include/ggml-rpc.h; the patch number
follows ggml's operation count, so a worker of another build differs there) is refused with the
reason. bankml asks for the exact version where llama-server accepts any older minor version: a
worker of another build may compute differently, and the receipt names the workers as the place
the answer was computed.

An rpc-server serves one client at a time (the others wait in its accept queue), so a worker
already serving a llama-server does not answer the hello within ``HELLO_TIMEOUT_S``: that is
refused too ("busy or not an RPC worker"). No Twisted here: the check is a blocking socket
exchange, run in a thread by the caller.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

RPC_CMD_HELLO = 14
CONN_CAPS_SIZE = 24
PROTOCOL = (7, 0, 0)  # RPC_PROTO_MAJOR/MINOR/PATCH_VERSION of llama.cpp build 11434
DEFAULT_PORT = 50052  # rpc-server's default
HELLO_TIMEOUT_S = 5.0


class WorkerRefused(Exception):
    """A worker that cannot be used; the message says which and why."""


def parse_worker(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), as llama-server's ``--rpc`` reads each address; ValueError
    with the reason."""
    host, sep, port_text = address.strip().rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"RPC worker {address!r}: expected HOST:PORT, e.g. 127.0.0.1:50052")
    if host.startswith("[") or ":" in host:
        raise ValueError(f"RPC worker {address!r}: llama-server's --rpc takes IPv4 or a name")
    return host, int(port_text)


def parse_workers(text: str) -> tuple[str, ...]:
    """``A,B,...`` (llama-server's ``--rpc`` value) -> the addresses, each checked; ValueError."""
    workers = tuple(part.strip() for part in text.split(","))
    if not workers or any(not w for w in workers):
        raise ValueError(f"--rpc {text!r}: a comma-separated list of HOST:PORT")
    for w in workers:
        parse_worker(w)
    if len(set(workers)) != len(workers):
        raise ValueError(f"--rpc {text!r}: a worker is named twice")
    return workers


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def hello(address: str, timeout: float = HELLO_TIMEOUT_S) -> tuple[int, int, int]:
    """The RPC protocol version (major, minor, patch) the worker at ``address`` answers HELLO
    with. WorkerRefused when it cannot be reached or does not answer as an rpc-server."""
    host, port = parse_worker(address)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            request = bytes([RPC_CMD_HELLO]) + struct.pack("<Q", CONN_CAPS_SIZE)
            sock.sendall(request + bytes(CONN_CAPS_SIZE))
            (size,) = struct.unpack("<Q", _recv_exactly(sock, 8))
            # every protocol version's answer starts with major, minor, patch (v3's was only
            # those three bytes), so another version is read and named rather than misread
            if not 3 <= size <= 1024:
                raise WorkerRefused(
                    f"RPC worker {address} answered HELLO with {size} bytes: not an rpc-server"
                )
            major, minor, patch = _recv_exactly(sock, size)[:3]
    except TimeoutError:
        raise WorkerRefused(
            f"RPC worker {address} did not answer HELLO within {timeout:g} s "
            "(busy with another llama-server, or not an rpc-server)"
        ) from None
    except OSError as err:
        raise WorkerRefused(f"RPC worker {address} cannot be reached: {err}") from None
    return major, minor, patch


def reachable(address: str, timeout: float = 1.0) -> bool:
    """Whether anything accepts a TCP connection at ``address`` (nothing is sent)."""
    try:
        with socket.create_connection(parse_worker(address), timeout=timeout):
            return True
    except OSError:
        return False


def version_text(version: Sequence[int]) -> str:
    return ".".join(str(v) for v in version)


def worker_problem(address: str, timeout: float = HELLO_TIMEOUT_S) -> str | None:
    """Why the worker at ``address`` cannot be used, or None when it answers HELLO with
    ``PROTOCOL``."""
    try:
        version = hello(address, timeout)
    except WorkerRefused as err:
        return str(err)
    if version != PROTOCOL:
        return (
            f"RPC worker {address} speaks RPC protocol {version_text(version)}, not "
            f"{version_text(PROTOCOL)} (llama.cpp build 11434's): a worker of another build "
            "is refused"
        )
    return None


def workers_problem(workers: Sequence[str], timeout: float = HELLO_TIMEOUT_S) -> str | None:
    """The first worker's problem (``worker_problem``), or None when every one answers."""
    for address in workers:
        problem = worker_problem(address, timeout)
        if problem is not None:
            return problem
    return None
