"""A small Twisted mock of llama-server for the gateway's fast tests.

It answers `/health`, `/props` (with a `model_path` the test chooses), `/v1/models` and
`/v1/chat/completions` (one JSON object, or SSE events laid out as llama-server writes them: a
role delta with `content: null`, one ``data: {...}`` per piece, a chunk with `finish_reason`
(and `timings`, unless the request set `stream_options.include_usage`: then a last chunk with
no choices carries `usage` and `timings`), then ``data: [DONE]``). Knobs on `MockLlama` make it misbehave: an error status, slow pieces, a
connection dropped mid-stream, a huge declared body, a very long SSE line.

The real llama-server is used for everything the mock stands in for (tests/test_serve_p0.py);
the mock is for the cases a real engine cannot be made to produce on demand, and for speed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from twisted.internet import reactor as default_reactor
from twisted.web import resource, server

PIECES = ["Savante ", "knows."]


@dataclass
class MockLlama:
    model_path: str
    pieces: list[str] = field(default_factory=lambda: list(PIECES))
    prompt_tokens: int = 7
    health_status: int = 200
    error_status: int | None = None  # answer chat with this status and llama-server's error body
    piece_delay: float = 0.0  # seconds between streamed pieces
    die_after: int | None = None  # drop the connection after this many streamed pieces
    declared_length: int | None = None  # a Content-Length to declare on the non-streamed answer
    long_line_bytes: int = 0  # one streamed data line this long before the pieces
    before_finish: Any = None  # called just before a stream's finish chunk is written
    requests: list[bytes] = field(default_factory=list)
    props_requests: int = 0
    cancelled: int = 0  # streams whose client went away before the end
    streamed: list[bytes] = field(default_factory=list)  # each stream's bytes, as written
    reactor: Any = default_reactor

    def root(self) -> resource.Resource:
        root = resource.Resource()
        root.putChild(b"health", _Json(lambda: (self.health_status, {"status": "ok"})))
        root.putChild(b"props", _Json(self._props))
        v1 = resource.Resource()
        root.putChild(b"v1", v1)
        v1.putChild(
            b"models",
            _Json(
                lambda: (
                    200,
                    {
                        "object": "list",
                        "data": [{"id": self.model_path.rsplit("/", 1)[-1], "object": "model"}],
                    },
                )
            ),
        )
        chat = resource.Resource()
        v1.putChild(b"chat", chat)
        chat.putChild(b"completions", _Chat(self))
        return root

    def _props(self) -> tuple[int, dict[str, Any]]:
        self.props_requests += 1
        return 200, {"model_path": self.model_path, "build_info": "b0-mock"}

    def completion(self) -> dict[str, Any]:
        text = "".join(self.pieces)
        return {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": text},
                }
            ],
            "created": 1,
            "model": "mock",
            "object": "chat.completion",
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": len(self.pieces),
                "total_tokens": self.prompt_tokens + len(self.pieces),
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            "timings": {"prompt_n": self.prompt_tokens, "predicted_n": len(self.pieces)},
        }


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(choice: dict[str, Any] | None) -> dict[str, Any]:
    """A chat chunk with llama-server's keys, in its order (no choice: the usage chunk's [])."""
    return {
        "choices": [choice] if choice is not None else [],
        "created": 1,
        "id": "chatcmpl-mock",
        "model": "mock",
        "system_fingerprint": "b0-mock",
        "object": "chat.completion.chunk",
    }


class _Json(resource.Resource):
    isLeaf = True

    def __init__(self, answer: Any) -> None:
        super().__init__()
        self.answer = answer

    def render_GET(self, request: server.Request) -> bytes:
        status, obj = self.answer()
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json; charset=utf-8")
        return json.dumps(obj).encode()


class _Chat(resource.Resource):
    isLeaf = True

    def __init__(self, mock: MockLlama) -> None:
        super().__init__()
        self.mock = mock

    def render_POST(self, request: server.Request) -> Any:
        mock = self.mock
        body = request.content.read()
        mock.requests.append(body)
        request.setHeader(b"content-type", b"application/json; charset=utf-8")
        try:
            req = json.loads(body)
        except ValueError:
            request.setResponseCode(400)
            return json.dumps(
                {
                    "error": {
                        "code": 400,
                        "message": "Failed to parse JSON",
                        "type": "invalid_request_error",
                    }
                }
            ).encode()
        if mock.error_status is not None:
            request.setResponseCode(mock.error_status)
            return json.dumps(
                {
                    "error": {
                        "code": mock.error_status,
                        "message": "mock error",
                        "type": "server_error",
                    }
                }
            ).encode()
        if not req.get("stream"):
            answer = mock.completion()
            if req.get("logprobs"):
                answer["choices"][0]["logprobs"] = {
                    "content": [
                        {"token": p, "logprob": -0.5, "bytes": list(p.encode()), "top_logprobs": []}
                        for p in mock.pieces
                    ]
                }
            data = json.dumps(answer).encode()
            if mock.declared_length is None:
                return data
            # written by hand: twisted.web would not send a Content-Length it cannot honour
            request.channel.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(mock.declared_length).encode()
                + b"\r\n\r\n"
                + data[:16]
            )  # the rest never comes
            return server.NOT_DONE_YET
        request.setHeader(b"content-type", b"text/event-stream")
        options = req.get("stream_options")
        usage = isinstance(options, dict) and options.get("include_usage") is True
        _Stream(mock, request, bool(req.get("logprobs")), usage).start()
        return server.NOT_DONE_YET


class _Stream:
    def __init__(
        self, mock: MockLlama, request: server.Request, logprobs: bool, usage: bool
    ) -> None:
        self.mock, self.request, self.logprobs, self.usage = mock, request, logprobs, usage
        self.sent = 0
        self.index = len(mock.streamed)
        mock.streamed.append(b"")
        self.gone = False
        self.call: Any = None
        request.notifyFinish().addErrback(self._gone)

    def _gone(self, _: Any) -> None:
        self.gone = True
        self.mock.cancelled += 1
        if self.call is not None and self.call.active():
            self.call.cancel()

    def _write(self, data: bytes) -> None:
        self.mock.streamed[self.index] += data
        self.request.write(data)

    def start(self) -> None:
        if self.mock.long_line_bytes:
            self._write(b"data: " + b"x" * self.mock.long_line_bytes)
        role = {"role": "assistant", "content": None}
        self._write(sse(chunk({"index": 0, "finish_reason": None, "delta": role})))
        self._next()

    def _next(self) -> None:
        if self.gone:
            return
        mock, request = self.mock, self.request
        if mock.die_after is not None and self.sent >= mock.die_after:
            request.channel.transport.loseConnection()  # the sent events leave, the end never does
            return
        if self.sent < len(mock.pieces):
            piece = mock.pieces[self.sent]
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": None,
                "delta": {"content": piece},
            }
            if self.logprobs:
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": piece,
                            "logprob": -0.25,
                            "bytes": list(piece.encode()),
                            "top_logprobs": [],
                        }
                    ]
                }
            self._write(sse(chunk(choice)))
            self.sent += 1
            self.call = mock.reactor.callLater(mock.piece_delay, self._next)
            return
        if mock.before_finish is not None:
            mock.before_finish()
        timings = {"prompt_n": mock.prompt_tokens, "predicted_n": len(mock.pieces)}
        last = chunk({"index": 0, "finish_reason": "stop", "delta": {}})
        if not self.usage:
            last["timings"] = timings
        self._write(sse(last))
        if self.usage:  # llama-server's usage chunk: no choices, usage and timings
            usage = mock.completion()["usage"]
            self._write(sse({**chunk(None), "usage": usage, "timings": timings}))
        self._write(b"data: [DONE]\n\n")
        request.finish()


def listen(mock: MockLlama) -> Any:
    """The mock on a free loopback port; returns the listening port (getHost().port)."""
    return mock.reactor.listenTCP(0, server.Site(mock.root()), interface="127.0.0.1")


def main(argv: list[str]) -> None:
    """Run the mock as a process with llama-server's arguments (`-m PATH --host H --port P`,
    the rest ignored), for supervision tests: `python tests/mock_llama.py -m M --port P ...`.
    `--ignore-sigterm` makes it a process that only SIGKILL stops."""
    import signal

    from twisted.internet import reactor

    model, host, port = "", "127.0.0.1", 8080
    for flag, value in zip(argv, argv[1:] + [""]):
        if flag == "-m":
            model = value
        elif flag == "--host":
            host = value
        elif flag == "--port":
            port = int(value)
    if "--ignore-sigterm" in argv:
        reactor.callWhenRunning(signal.signal, signal.SIGTERM, signal.SIG_IGN)
    print(f"mock llama-server: {model} on {host}:{port}", flush=True)
    reactor.listenTCP(port, server.Site(MockLlama(model_path=model).root()), interface=host)
    reactor.run()


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
