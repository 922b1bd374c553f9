"""OpenAI's chat and completion bodies and stream chunks, as llama-server writes them.

Every function builds one JSON object from values the caller already has (the engine's text,
counts and logprob entries), in llama-server's key order, so a client written for llama-server
or OpenAI reads bankml's answers unchanged. ``bankml_receipt`` and llama-server's ``timings`` are
added by the caller. Pure Python: no Twisted.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

VOCAB_TYPES = {"llama": 1, "gpt2": 2, "bert": 3, "t5": 4, "rwkv": 5}  # llama_vocab_type


def envelope(
    created: int, answer_id: str, model: str, fingerprint: str, obj: str
) -> dict[str, Any]:
    """The keys every chat or completion object and chunk carries after its choices."""
    return {
        "created": created,
        "id": answer_id,
        "model": model,
        "system_fingerprint": fingerprint,
        "object": obj,
    }


def role_delta() -> dict[str, Any]:
    """OpenAI's (and llama-server's) opening delta of a streamed chat."""
    return {"role": "assistant", "content": None}


def chat_chunk(
    env: dict[str, Any], delta: dict[str, Any], finish: str | None = None, index: int = 0
) -> dict[str, Any]:
    """A chat chunk of choice ``index`` (a request's completions and prompts in order)."""
    return {"choices": [{"finish_reason": finish, "index": index, "delta": delta}], **env}


def chat_usage_chunk(env: dict[str, Any]) -> dict[str, Any]:
    """The chunk with no choices that ends a chat streamed with ``include_usage``."""
    return {"choices": [], **env}


def chat_completion(
    env: dict[str, Any],
    text: str,
    finish: str,
    entries: list[Any],
    usage: dict[str, Any],
    index: int = 0,
    message: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole chat answer: its ``message`` as the chat parser left it
    (``chat_message.message_object``), or the text as the content."""
    choice: dict[str, Any] = {
        "finish_reason": finish,
        "index": index,
        "message": message if message is not None else {"role": "assistant", "content": text},
    }
    if entries:
        choice["logprobs"] = {"content": entries}
    return {"choices": [choice], **env, "usage": usage}


def completion_choice(
    text: str, index: int, entries: list[Any] | None, finish: str | None
) -> dict[str, Any]:
    return {
        "text": text,
        "index": index,
        "logprobs": {"content": entries} if entries else None,
        "finish_reason": finish,
    }


def text_completion(
    env: dict[str, Any], choice: dict[str, Any], usage: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A /v1/completions object or chunk with one choice."""
    out = {"choices": [choice], **env}
    if usage is not None:
        out["usage"] = usage
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "completion_tokens": completion_tokens,
        "prompt_tokens": prompt_tokens,
        "total_tokens": completion_tokens + prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def include_usage(request: dict[str, Any]) -> bool:
    """``stream_options.include_usage`` (checked by the engine's parse, in llama-server's schema order)."""
    options = request.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def merged_completions(results: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat or /v1/completions answer of several choices (``n``, several prompts), not
    streamed: the first object with every choice in index order (its usage and timings are the
    first choice's, as llama-server's) and ``bankml_receipt`` the list of each choice's
    receipt."""
    out = dict(results[0])
    out["choices"] = [r["choices"][0] for r in results]
    out["bankml_receipt"] = [r["bankml_receipt"] for r in results]
    return out


@dataclass(frozen=True)
class ModelFacts:
    """What ``GET /v1/models`` lists of the resident model (built by the native engine's
    ``model_facts``)."""

    id: str  # llama-server's model name: its first --alias, else the file's name
    aliases: Sequence[str]  # the --alias names (none: the id alone)
    n_ctx: int
    ftype: str  # llama-server's name for the file's type
    tokenizer: str = ""  # the tokenizer's model ("llama", "gpt2", ...)
    n_vocab: int | None = None
    n_ctx_train: int | None = None
    n_embd: int | None = None
    n_params: int | None = None  # the tensors' parameters (llama_model_n_params)
    size: int | None = None  # the tensors' bytes (llama_model_size)
    tags: Sequence[str] = ()  # --tags (informational), in sorted order


def model_info(model: ModelFacts) -> dict[str, Any]:
    """One model as llama-server's get_res_model_info lists it. The id is the file's name
    (llama-server uses its -m argument as given); the sizes are the tensors' (llama_model_size,
    llama_model_n_params), not the file's."""
    return {
        "id": model.id,
        "aliases": list(model.aliases) or [model.id],
        "tags": list(model.tags),
        "object": "model",
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "created": int(time.time()),
        "owned_by": "bankML",
        "meta": {
            "vocab_type": VOCAB_TYPES.get(model.tokenizer, 0),
            "n_vocab": model.n_vocab,
            "n_ctx": model.n_ctx,
            "n_ctx_train": model.n_ctx_train,
            "n_embd": model.n_embd,
            "n_params": model.n_params,
            "size": model.size,
            "ftype": model.ftype,
        },
    }


def models_object(model: ModelFacts) -> dict[str, Any]:
    """``GET /v1/models`` (and ``/models``): llama-server's get_res_models, the Ollama-style
    ``models`` list and OpenAI's ``data``."""
    return {
        "models": [
            {
                "name": model.id,
                "model": model.id,
                "modified_at": "",
                "size": "",
                "digest": "",
                "type": "model",
                "description": "",
                "tags": [""],
                "capabilities": ["completion"],
                "parameters": "",
                "details": {
                    "parent_model": "",
                    "format": "gguf",
                    "family": "",
                    "families": [""],
                    "parameter_size": "",
                    "quantization_level": "",
                },
            }
        ],
        "object": "list",
        "data": [model_info(model)],
    }
