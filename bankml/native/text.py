"""llama-server's text endpoints on the resident engine: /tokenize, /detokenize,
/apply-template, /chat/completions/input_tokens (run on the bridge's prepare thread).

Each takes the engine and the request body and returns the answer object; a request llama-server
refuses raises ``ValueError`` (or ``TypeError``/``KeyError``) with its message.
"""

from __future__ import annotations

from typing import Any

from bankml.engine_cupy.request import chat_render_options, check_chat_messages
from bankml.formats.nlohmann import c_int, json_flag, json_string, type_error


def tokenize_mixed(engine: Any, content: Any, add_special: bool, parse_special: bool) -> list[int]:
    """llama-server's tokenize_mixed: a string, or an array of strings and token ids (the first
    item, string or id, is the only one that may take the special tokens)."""
    if not isinstance(content, list):
        return engine.tokenize(
            json_string(content), add_special=add_special, parse_special=parse_special
        )
    out: list[int] = []
    for index, part in enumerate(content):
        if isinstance(part, str):
            out += engine.tokenize(
                part, add_special=add_special and index == 0, parse_special=parse_special
            )
        else:
            out.append(c_int(part))
    return out


def tokenize_answer(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    if "content" not in body:
        return {"tokens": []}
    tokens = tokenize_mixed(
        engine,
        body["content"],
        json_flag(body, "add_special", False),
        json_flag(body, "parse_special", True),
    )
    if not json_flag(body, "with_pieces", False):
        return {"tokens": tokens}
    pieces = []
    for token in tokens:
        raw = engine.tokenizer.token_to_piece(token, True)
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)  # not valid UTF-8: llama-server lists the bytes
        pieces.append({"id": token, "piece": piece})
    return {"tokens": pieces}


def detokenize_answer(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    """tokens_to_str: every token's piece with special tokens as text."""
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list):
        raise type_error("array", tokens)
    ids = [c_int(t) for t in tokens]
    if any(t < 0 or t >= engine.n_vocab for t in ids):
        raise ValueError("Invalid token id")  # llama-server would read out of bounds
    raw = b"".join(engine.tokenizer.token_to_piece(t, True) for t in ids)
    return {"content": raw.decode("utf-8", "replace")}


def apply_template_answer(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    """oaicompat_chat_params_parse's prompt, as /apply-template returns it (without Jinja, the
    chat's own preparation: its refusals, then the built-in template's prompt)."""
    if not getattr(engine, "jinja", True):
        return {"prompt": engine.chat_prompt_text(body)}
    messages = check_chat_messages(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    prompt = engine.apply_template(
        messages, tools=body.get("tools"), **chat_render_options(body), **kwargs
    )
    return {"prompt": prompt}


def input_tokens_answer(engine: Any, body: dict[str, Any]) -> dict[str, Any]:
    """handle_count_tokens for a chat: the prompt's token count (tokenize_mixed with special
    tokens), and OpenAI's object name."""
    return {"input_tokens": len(engine.chat_prompt_tokens(body)), "object": "response.input_tokens"}
