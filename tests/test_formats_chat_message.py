"""The chat message, its stream deltas and ids, as llama-server writes them.

``compute_diffs`` against the cases of llama.cpp's tests/test-chat.cpp (test_msg_diffs_compute);
``message_object`` and ``delta_object`` against the shapes llama-server (build 11434) sends
(tests/test_p0_acts_receipts.py sees them from the real server); ``MessageStream`` driven by a
parse over a growing text: the deltas, assembled as a client assembles them (and as a receipt
hashes them: bankml.receipts.acts), give the whole message's reasoning, content and calls, each
call keeping the id it was first given.
"""

from __future__ import annotations

import json
import re

import pytest

from bankml.formats.chat_message import (
    ChatMessage,
    DiffError,
    MessageDiff,
    MessageStream,
    ToolCallMsg,
    compute_diffs,
    delta_object,
    finish_reason,
    message_object,
    tool_call_id,
)
from bankml.receipts.acts import Acts


def test_diffs_as_llama_cpp_computes_them() -> None:
    assert compute_diffs(ChatMessage(), ChatMessage(content="Hello, world!")) == [
        MessageDiff(content_delta="Hello, world!")
    ]
    assert compute_diffs(ChatMessage(content="Hello,"), ChatMessage(content="Hello, world!")) == [
        MessageDiff(content_delta=" world!")
    ]
    msg1 = ChatMessage(tool_calls=(ToolCallMsg("special_function", '{"ar', "123"),))
    msg2 = ChatMessage(tool_calls=(ToolCallMsg("special_function", '{"arg1": 1}', "123"),))
    assert compute_diffs(ChatMessage(), msg1) == [
        MessageDiff(
            tool_call_index=0, tool_call_delta=ToolCallMsg("special_function", '{"ar', "123")
        )
    ]
    # neither id nor name change: the arguments' new part alone
    assert compute_diffs(msg1, msg2) == [
        MessageDiff(tool_call_index=0, tool_call_delta=ToolCallMsg("", 'g1": 1}', ""))
    ]
    both = ChatMessage(
        tool_calls=(
            ToolCallMsg("f1", '{"arg1": 1}', "123"),
            ToolCallMsg("f2", '{"arg2": 2}', "222"),
        )
    )
    assert compute_diffs(ChatMessage(), both) == [
        MessageDiff(tool_call_index=0, tool_call_delta=both.tool_calls[0]),
        MessageDiff(tool_call_index=1, tool_call_delta=both.tool_calls[1]),
    ]


def test_reasoning_comes_first_and_a_lost_call_is_an_error() -> None:
    old = ChatMessage(content="a", reasoning_content="r")
    new = ChatMessage(content="ab", reasoning_content="rs")
    assert compute_diffs(old, new) == [
        MessageDiff(reasoning_content_delta="s"),
        MessageDiff(content_delta="b"),
    ]
    with pytest.raises(DiffError):
        compute_diffs(ChatMessage(tool_calls=(ToolCallMsg("f"),)), ChatMessage())
    with pytest.raises(DiffError):
        compute_diffs(ChatMessage(content="ab"), ChatMessage(content="ax"))
    # a partial stop word taken away: nothing new
    assert compute_diffs(ChatMessage(content="ab</"), ChatMessage(content="ab")) == [
        MessageDiff(content_delta="")
    ]
    with pytest.raises(DiffError):
        compute_diffs(
            ChatMessage(tool_calls=(ToolCallMsg("get"),)),
            ChatMessage(tool_calls=(ToolCallMsg("put"),)),
        )


def test_objects_in_llama_servers_shapes() -> None:
    msg = ChatMessage(tool_calls=(ToolCallMsg("get_weather", '{"city": "Rome"}', "X1"),))
    assert json.dumps(message_object(msg), separators=(",", ":")) == (
        '{"role":"assistant","content":"","tool_calls":[{"type":"function","function":'
        '{"name":"get_weather","arguments":"{\\"city\\": \\"Rome\\"}"},"id":"X1"}]}'
    )
    assert message_object(ChatMessage(content="hi", reasoning_content="r")) == {
        "role": "assistant",
        "content": "hi",
        "reasoning_content": "r",
    }
    first = MessageDiff(tool_call_index=0, tool_call_delta=ToolCallMsg("get_weather", "{", "X1"))
    assert delta_object(first) == {
        "tool_calls": [
            {
                "index": 0,
                "id": "X1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": "{"},
            }
        ]
    }
    later = MessageDiff(tool_call_index=0, tool_call_delta=ToolCallMsg("", '"', ""))
    assert delta_object(later) == {"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]}
    assert delta_object(MessageDiff(reasoning_content_delta="r")) == {"reasoning_content": "r"}
    assert finish_reason(True, ChatMessage(tool_calls=(ToolCallMsg("f"),))) == "tool_calls"
    assert finish_reason(True, ChatMessage(content="x")) == "stop"
    assert finish_reason(False, ChatMessage(tool_calls=(ToolCallMsg("f"),))) == "length"


def test_ids_are_drawn_as_llama_server_draws_them() -> None:
    ids = {tool_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[0-9A-Za-z]{32}", i) for i in ids)


def _held_back(text: str, tag: str) -> str:
    """``text`` less an ending that could be the start of ``tag``."""
    for cut in range(len(tag) - 1, 0, -1):
        if text.endswith(tag[:cut]):
            return text[:-cut]
    return text


def _object_prefix(text: str) -> str:
    """The JSON object that ``text`` starts with, as far as it goes (no string holds a brace)."""
    depth = 0
    for at, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return text[: at + 1]
    return text


def _parse(text: str, partial: bool) -> ChatMessage:
    """A small parse for the stream's test: ``<think>…</think>`` reasoning, then content up to
    ``<tool_call>``, then calls as ``{"name": …, "arguments": {…}}`` between tags; a partial
    parse holds back a tag's beginning and shows a call's arguments as they grow."""
    reasoning = ""
    if partial and "<think>".startswith(text):
        return ChatMessage()
    if text.startswith("<think>"):
        end = text.find("</think>")
        if end < 0:
            return ChatMessage(reasoning_content=_held_back(text[7:], "</think>"))
        reasoning, text = text[7:end], text[end + 8 :]
    content, _, rest = text.partition("<tool_call>")
    if partial:
        content = _held_back(content, "<tool_call>")
    calls = []
    for block in rest.split("<tool_call>") if rest else []:
        name = re.search(r'"name": "([^"]*)"', block)
        at = block.find('"arguments": ')
        if name and at >= 0:
            calls.append(ToolCallMsg(name.group(1), _object_prefix(block[at + 13 :])))
    return ChatMessage(content, reasoning, tuple(calls))


def test_the_stream_assembles_to_the_whole_message() -> None:
    text = (
        '<think>wants weather</think>Let me look.<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Rome"}}</tool_call><tool_call>{"name": "get_time", '
        '"arguments": {"zone": "CET"}}</tool_call>'
    )
    drawn = iter(["ID0", "ID1"])
    stream = MessageStream(_parse, new_id=lambda: next(drawn))
    acts, content = Acts(), ""
    for at in range(0, len(text), 3):
        for diff in stream.update(text[at : at + 3], partial=True):
            delta = delta_object(diff)
            content += delta.get("content", "")
            acts.take_chat(delta)
    for diff in stream.update("", partial=False):
        delta = delta_object(diff)
        content += delta.get("content", "")
        acts.take_chat(delta)
    whole = Acts()
    whole.take_chat(message_object(stream.message))
    assert content == stream.message.content == "Let me look."
    assert acts.reasoning_text == "wants weather"
    assert [c.as_json() for c in acts.tool_calls()] == [c.as_json() for c in whole.tool_calls()]
    assert [(c.id, c.name, c.arguments) for c in acts.tool_calls()] == [
        ("ID0", "get_weather", '{"city": "Rome"}'),
        ("ID1", "get_time", '{"zone": "CET"}'),
    ]
    assert acts.receipt_fields()["tool_calls_sha256"] == whole.receipt_fields()["tool_calls_sha256"]
