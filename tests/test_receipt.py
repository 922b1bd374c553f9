"""receipt.py: the receipt's fields, order and hashes, from a Tally filled by hand."""

from __future__ import annotations

import json

from bankml.receipts.digest import canonical_logprobs
from bankml.receipts.tally import Tally, receipt
from bankml.version import __version__
from tests.bankml_process import sha


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_receipt_fields_in_the_reference_order_and_hashes() -> None:
    clock = Clock()
    body = b'{"messages":[{"role":"user","content":"hi"}]}'
    t = Tally(request_body=body, clock=clock)
    clock.now = 100.0123
    t.add_text("")  # a role delta: not the first token
    clock.now = 100.25
    t.add_text("Héllo")
    t.add_text(", wörld ✓")
    t.set_counts(9, 3)
    clock.now = 101.0
    r = receipt(t, engine="llama-server b1", model_sha256="ab" * 32)
    assert list(r) == [
        "bankml",
        "engine",
        "model_sha256",
        "guard",
        "prompt_tokens",
        "completion_tokens",
        "ttft_ms",
        "wall_ms",
        "response_sha256",
        "request_sha256",
        "signed",
    ]
    assert r["bankml"] == __version__ and r["engine"] == "llama-server b1" and r["guard"] == "play"
    assert (r["prompt_tokens"], r["completion_tokens"], r["ttft_ms"], r["wall_ms"]) == (
        9,
        3,
        250,
        1000,
    )
    assert r["response_sha256"] == sha("Héllo, wörld ✓".encode())
    assert r["request_sha256"] == sha(body)
    assert r["signed"] is False
    json.dumps(r)  # plain JSON


def test_empty_answer_and_unknown_counts() -> None:
    t = Tally(request_body=b"{}")
    t.set_counts(None, True)  # not counts: left unknown
    r = receipt(t, engine="llama-server", model_sha256="0" * 64, ttft_measured=False)
    assert r["response_sha256"] == sha(b"")
    assert (r["prompt_tokens"], r["completion_tokens"], r["ttft_ms"]) == (None, None, None)


def test_logprobs_hash_is_of_the_compact_json_of_the_entries() -> None:
    t = Tally(request_body=b"{}")
    t.add_logprobs([{"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": []}])
    t.add_logprobs([{"token": "!", "logprob": -1.25, "bytes": [33], "top_logprobs": []}])
    r = receipt(t, engine="llama-server", model_sha256="0" * 64)
    text = (
        '[{"token":"é","logprob":-0.5,"bytes":[195,169],"top_logprobs":[]},'
        '{"token":"!","logprob":-1.25,"bytes":[33],"top_logprobs":[]}]'
    )
    assert canonical_logprobs(t.logprobs) == text.encode()
    assert r["logprobs_sha256"] == sha(text.encode())
    assert list(r)[-2:] == ["logprobs_sha256", "signed"]
