"""The answer writers (bankml/formats/answer.py) fed plain chunks and summaries, with a fake
``AnswerSource`` in place of the engine (no server, no engine)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from bankml.engine_cupy.sampler import SamplerParams
from bankml.formats.answer import ChatAnswer, CompletionAnswer, LlamaCompletionAnswer
from bankml.formats.answers import answers_for, merged
from bankml.receipts.kinds import CHAT, LLAMA_COMPLETION, OAI_COMPLETION
from bankml.receipts.tally import Tally


class FakeSource:
    """What an Answer asks of the engine: a name, a build, a tokenizer's count, a receipt."""

    model_id = "tiny.gguf"
    build_info = "bankml 0 native"

    def __init__(self) -> None:
        self.receipts: list[dict[str, Any]] = []

    def token_count(self, text: str) -> int:
        return len(text.split())

    def receipt(
        self, tally: Tally, parsed: Any, summary: Any, *, api: str, stream: bool
    ) -> dict[str, Any]:
        out = {"text": tally.text, "api": api, "stream": stream}
        self.receipts.append(out)
        return out


TIMINGS = {"cache_n": 0, "prompt_n": 4, "prompt_ms": 2.0, "predicted_n": 2, "predicted_ms": 1.0}


def chunk(text: str, entry: Any = None) -> SimpleNamespace:
    return SimpleNamespace(text=text, token=1, entry=entry, timings=None)


def summary(text: str, finish: str = "stop", stopping_word: str = "") -> SimpleNamespace:
    return SimpleNamespace(
        text=text,
        finish_reason=finish,
        prompt_tokens=4,
        completion_tokens=2,
        timings=dict(TIMINGS),
        stopping_word=stopping_word,
        cancelled=False,
        tokens=[7, 8],
        slot=0,
    )


def parsed(**options: Any) -> SimpleNamespace:
    return SimpleNamespace(
        sampler=SamplerParams(),
        options=options,
        n_probs=options.pop("n_probs", 0),
        n_predict=-1,
        stop=(),
        prompt_text="Hello",
        prompt_tokens=[1, 2, 3, 4],
        constraint=None,
    )


def test_a_whole_chat_carries_the_text_usage_timings_and_the_receipt() -> None:
    source = FakeSource()
    answer = ChatAnswer(source, CHAT, b"{}", {"messages": []}, parsed())
    assert answer.on_chunk(chunk("Hi")) == []  # not streamed: nothing per chunk
    out = answer.whole(summary("Hi there"))
    assert out["id"].startswith("chatcmpl-")
    assert (out["object"], out["model"], out["system_fingerprint"]) == (
        "chat.completion",
        "tiny.gguf",
        "bankml 0 native",
    )
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
    assert out["usage"]["total_tokens"] == 6
    assert out["timings"]["prompt_per_token_ms"] == 0.5
    assert out["bankml_receipt"] == {"text": "Hi there", "api": CHAT, "stream": False}
    assert answer.tally.prompt_tokens == 4 and answer.tally.completion_tokens == 2


def test_a_streamed_chat_opens_with_the_role_and_ends_with_usage_and_the_receipt() -> None:
    answer = ChatAnswer(FakeSource(), CHAT, b"{}", {"stream": True}, parsed())
    first = answer.on_chunk(chunk("Hi"))
    assert [e["choices"][0]["delta"] for e in first] == [
        {"role": "assistant", "content": None},
        {"content": "Hi"},
    ]
    assert answer.on_chunk(chunk(" you")) == [
        {**first[1], "choices": [{"finish_reason": None, "index": 0, "delta": {"content": " you"}}]}
    ]
    (last,) = answer.final_events(summary("Hi you"))
    assert last["choices"][0]["finish_reason"] == "stop"
    assert last["usage"]["completion_tokens"] == 2
    assert "timings" in last
    assert last["bankml_receipt"] == {"text": "Hi you", "api": CHAT, "stream": True}


def test_include_usage_ends_a_chat_with_a_chunk_without_choices() -> None:
    request = {"stream": True, "stream_options": {"include_usage": True}}
    answer = ChatAnswer(FakeSource(), CHAT, b"{}", request, parsed())
    answer.on_chunk(chunk("x"))
    finish, usage = answer.final_events(summary("x", finish="length"))
    assert finish["choices"][0]["finish_reason"] == "length" and "usage" not in finish
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 4


def test_a_stop_words_own_logprob_entries_are_dropped_from_a_whole_answer() -> None:
    answer = CompletionAnswer(FakeSource(), OAI_COMPLETION, b"{}", {}, parsed(n_probs=1))
    for i, text in enumerate(["a", "b", "c"]):
        answer.on_chunk(chunk(text, entry={"id": i}))
    out = answer.whole(summary("ab", stopping_word="c d"))  # the fake counts 2 tokens
    assert out["object"] == "text_completion"
    assert out["choices"][0]["logprobs"] == {"content": [{"id": 0}]}


def test_llama_completion_keeps_only_the_response_fields_and_the_receipt() -> None:
    options = {"response_fields": ["content", "generation_settings/n_predict"]}
    answer = LlamaCompletionAnswer(
        FakeSource(), LLAMA_COMPLETION, b"{}", {"prompt": "Hello"}, parsed(**options)
    )
    out = answer.whole(summary("done"))
    assert out == {
        "content": "done",
        "generation_settings/n_predict": -1,
        "bankml_receipt": {"text": "done", "api": LLAMA_COMPLETION, "stream": False},
    }


def test_a_requests_answers_share_one_id_and_merge_in_index_order() -> None:
    source = FakeSource()
    answers = answers_for(source, OAI_COMPLETION, b"{}", {}, [parsed(), parsed()])
    assert [a.index for a in answers] == [0, 1]
    assert answers[0].id == answers[1].id and answers[0].created == answers[1].created
    results = [a.whole(summary(t)) for a, t in zip(answers, ["one", "two"])]
    out = merged(OAI_COMPLETION, results)
    assert [c["text"] for c in out["choices"]] == ["one", "two"]
    assert [r["text"] for r in out["bankml_receipt"]] == ["one", "two"]
    assert merged(LLAMA_COMPLETION, results) == results  # /completion: llama-server's array
