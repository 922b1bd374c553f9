"""Greedy chat answers served through bankml's own address (``--listen``, the native engine) and
through the real llama-server, same model, same requests: 20 prompts of 32 tokens, streamed and
not, must give the same text, finish reason and usage.

Both sides start every answer from an empty slot (``cache_prompt: false``), so the answers do not
depend on what earlier tests left in either slot. The stream's text is the concatenation of its
deltas and its usage the last usage an event carries (``stream_options.include_usage``), read
the same way on both sides.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from tests.native_support import Served, post, sse_events

N_TOKENS = 32
PROMPTS = [
    "Name a colour.",
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain recursion in one sentence.",
    "Give me a recipe for pancakes.",
    "What is the largest planet?",
    "Write a haiku about rain.",
    "List three fruits.",
    "How do I reverse a list in Python?",
    "What does a compiler do?",
    "Tell me a joke about cats.",
    "Translate 'good morning' to French.",
    "Why is the sky blue?",
    "Count from one to ten.",
    "What is 17 plus 25?",
    "Describe a sunset in two sentences.",
    "Who wrote Romeo and Juliet?",
    "Suggest a name for a pet turtle.",
    "What is photosynthesis?",
    "Summarise the rules of chess briefly.",
]


def body(prompt: str, stream: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": N_TOKENS,
        "cache_prompt": False,
    }
    if stream:
        out.update(stream=True, stream_options={"include_usage": True})
    return out


def usage_of(usage: dict[str, Any]) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def answer(url: str, prompt: str, stream: bool) -> tuple[str, str | None, tuple[int, int, int]]:
    """(text, finish reason, usage) of one chat answer; blocking (run it in a thread)."""
    status, ctype, data = post(url + "/v1/chat/completions", body(prompt, stream))
    assert status == 200, data[:300]
    if not stream:
        whole = json.loads(data)
        choice = whole["choices"][0]
        return choice["message"]["content"], choice["finish_reason"], usage_of(whole["usage"])
    assert ctype.startswith("text/event-stream")
    events = [e for e in sse_events(data) if isinstance(e, dict)]
    choices = [c for e in events for c in e.get("choices") or []]
    text = "".join(c.get("delta", {}).get("content") or "" for c in choices)
    finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), None)
    usages = [e["usage"] for e in events if e.get("usage")]
    assert usages, events[-3:]
    return text, finish, usage_of(usages[-1])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest_twisted.ensureDeferred
async def test_greedy_chat_is_llama_servers(
    served: Served, reference_server: Any, stream: bool
) -> None:
    same, different = 0, []
    for prompt in PROMPTS:
        ours = await deferToThread(answer, served.url, prompt, stream)
        theirs = await deferToThread(answer, reference_server.url, prompt, stream)
        if ours == theirs:
            same += 1
        else:
            different.append((prompt, ours, theirs))
    print(
        f"\ngreedy chat {N_TOKENS} tokens, {'streamed' if stream else 'whole'}: "
        f"{same}/{len(PROMPTS)} identical (text, finish reason, usage)"
    )
    assert not different, different[:3]
