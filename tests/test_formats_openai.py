"""OpenAI's /v1/models and its chat and completion objects from plain data (no server, no engine)."""

from __future__ import annotations

import time

from bankml.formats import openai as fmt
from bankml.formats.openai import ModelFacts, models_object


def test_models_lists_the_resident_model_in_both_shapes() -> None:
    before = int(time.time())
    out = models_object(
        ModelFacts(
            id="tiny.gguf",
            aliases=[],
            n_ctx=4096,
            ftype="Q4_1",
            tokenizer="gpt2",
            n_vocab=49152,
            n_ctx_train=8192,
            n_embd=576,
            n_params=134515008,
            size=85748544,
        )
    )
    assert list(out) == ["models", "object", "data"]
    assert out["object"] == "list"
    (listed,) = out["models"]
    assert (listed["name"], listed["model"], listed["details"]["format"]) == (
        "tiny.gguf",
        "tiny.gguf",
        "gguf",
    )
    (info,) = out["data"]
    assert info["id"] == "tiny.gguf"
    assert info["aliases"] == ["tiny.gguf"]  # no --alias: the id alone
    assert info["owned_by"] == "bankML"
    assert before <= info["created"] <= int(time.time())
    assert info["meta"] == {
        "vocab_type": 2,  # llama_vocab_type's BPE
        "n_vocab": 49152,
        "n_ctx": 4096,
        "n_ctx_train": 8192,
        "n_embd": 576,
        "n_params": 134515008,
        "size": 85748544,
        "ftype": "Q4_1",
    }


def test_aliases_are_listed_and_an_unknown_tokenizer_is_vocab_type_0() -> None:
    facts = ModelFacts(id="chat", aliases=["chat", "assistant"], n_ctx=512, ftype="F16")
    info = models_object(facts)["data"][0]
    assert info["aliases"] == ["chat", "assistant"]
    assert info["meta"]["vocab_type"] == 0
    assert info["meta"]["n_params"] is None and info["meta"]["size"] is None


def test_a_chat_completion_object_in_llama_servers_key_order() -> None:
    env = fmt.envelope(1700000000, "chatcmpl-1", "tiny.gguf", "bankml 0 native", "chat.completion")
    usage = fmt.usage(5, 2, 1)
    out = fmt.chat_completion(env, "hi", "stop", [], usage)
    assert list(out) == [
        "choices",
        "created",
        "id",
        "model",
        "system_fingerprint",
        "object",
        "usage",
    ]
    assert out["choices"] == [
        {"finish_reason": "stop", "index": 0, "message": {"role": "assistant", "content": "hi"}}
    ]
    assert usage == {
        "completion_tokens": 2,
        "prompt_tokens": 5,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


def test_several_choices_merge_into_one_object_with_each_receipt() -> None:
    env = fmt.envelope(1, "cmpl-1", "m", "fp", "text_completion")
    results = [
        {**fmt.text_completion(env, fmt.completion_choice(t, i, None, "stop")), "bankml_receipt": r}
        for i, (t, r) in enumerate([("a", "r0"), ("b", "r1")])
    ]
    out = fmt.merged_completions(results)
    assert [c["text"] for c in out["choices"]] == ["a", "b"]
    assert out["bankml_receipt"] == ["r0", "r1"]
