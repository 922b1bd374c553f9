"""Embedding requests and answers as llama-server (build 11434) and Ollama write them.

llama-server (``handle_embeddings_impl``, tools/server/server-context.cpp):

- ``POST /v1/embeddings`` (OpenAI's shape) and ``POST /embedding``, ``/embeddings`` (its own:
  an array of ``{"index", "embedding": [vector, ...]}``, every token's vector with pooling
  ``none``, else the one pooled vector); a body with ``content`` instead of ``input`` is
  answered in its own shape on /v1/embeddings too;
- its checks, in its order: no ``--embeddings`` (501), pooling ``none`` on the OpenAI shape
  (400), neither ``input`` nor ``content``, ``encoding_format`` other than float or base64, an
  empty list of inputs, an empty input (each 400); ``embd_normalize`` in the body overrides
  ``--embd-normalize``;
- the OpenAI object's keys in llama-server's order (model, object, usage, data), each datum's
  (embedding, index, object[, encoding_format]); base64 is the float32 bytes, little-endian.

Ollama (server/routes.go ``EmbedHandler``, ``EmbeddingsHandler``): ``/api/embed`` reads
``input`` (a string or a list of strings; an empty string or list: no embedding), ``truncate``
(default true), ``dimensions`` (a prefix of each vector, normalised again) and answers
``{"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"}``; every
vector is normalised to unit length in float32 as Ollama's ``normalize`` does. The legacy
``/api/embeddings`` reads ``prompt`` and answers ``{"embedding"}`` with the vector as the
runner gives it (pooled, not normalised), in float64 JSON numbers.

Pure data: vectors come in as lists of floats (or anything with ``tolist``), no NumPy here.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bankml.formats.errors import ApiError
from bankml.formats.nlohmann import json_type

NOT_SUPPORTED = "This server does not support embeddings. Start it with `--embeddings`"
NOT_OAI = "Pooling type 'none' is not OAI compatible. Please use a different pooling type"
NO_INPUT = '"input" or "content" must be provided'
BAD_FORMAT = "The format to return the embeddings in. Can be either float or base64"
EMPTY_INPUT = "Input content cannot be empty"
# bankml's own refusal: a reranker's rank pooling is its classifier's scores, not a vector
# (llama-server answers garbage there: the scores read as a whole embedding row)
RANK_POOLING = "This server reranks (pooling rank): it answers /rerank, not embeddings"


@dataclass(frozen=True)
class EmbeddingRequest:
    """What llama-server reads of an embedding request: its ``input`` (or ``content``) as the
    body gave it (the engine splits and tokenizes it: Engine.embedding_inputs), whether the
    answer is OpenAI's object, base64, and the normalisation."""

    prompt: Any
    oai: bool
    base64: bool
    embd_normalize: int


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_request(
    body: dict[str, Any], *, oai: bool, pooling: str, enabled: bool, embd_normalize: int
) -> EmbeddingRequest:
    """llama-server's reading of an embedding body, its refusals in its order (ApiError). The
    inputs are not split nor tokenized here (an empty array, an empty input: refused after,
    ``check_tokens``)."""
    if not enabled:
        raise ApiError.of(501, NOT_SUPPORTED, "not_supported_error")
    if oai and pooling == "none":
        raise ApiError.of(400, NOT_OAI)
    if "input" in body:
        prompt = body["input"]
    elif "content" in body:
        oai = False  # "content" is not OpenAI's field: llama-server's own shape
        prompt = body["content"]
    else:
        raise ApiError.of(400, NO_INPUT)
    use_base64 = False
    if "encoding_format" in body:
        fmt = body["encoding_format"]
        if not isinstance(fmt, str):
            raise ApiError.of(
                400, f"[json.exception.type_error.302] type must be string, but is {json_type(fmt)}"
            )
        if fmt == "base64":
            use_base64 = True
        elif fmt != "float":
            raise ApiError.of(400, BAD_FORMAT)
    normalize = embd_normalize
    if "embd_normalize" in body:
        value = body["embd_normalize"]
        if not is_number(value) and not isinstance(value, bool):  # nlohmann reads true as 1
            raise ApiError.of(
                400,
                f"[json.exception.type_error.302] type must be number, but is {json_type(value)}",
            )
        normalize = int(value)
    return EmbeddingRequest(prompt, oai, use_base64, normalize)


def check_tokens(tokenized: Sequence[Sequence[int]]) -> None:
    """llama-server's refusal of an input that tokenized to nothing."""
    for tokens in tokenized:
        if not tokens:
            raise ApiError.of(400, EMPTY_INPUT)


def too_large(n_tokens: int, n_ubatch: int) -> ApiError:
    """An input that must fit one micro-batch and does not: llama-server's message (which it
    answers as a 500 server error; bankml answers the client's mistake as a 400)."""
    return ApiError.of(
        400,
        f"input ({n_tokens} tokens) is too large to process. increase the physical batch size "
        f"(current batch size: {n_ubatch})",
    )


def over_context(n_tokens: int, n_ctx: int) -> ApiError:
    """An input over the slot's context (llama-server's exceed_context_size_error)."""
    message = (
        f"input ({n_tokens} tokens) is larger than the max context size ({n_ctx} tokens). skipping"
    )
    return ApiError(
        400,
        {
            "error": {
                "code": 400,
                "message": message,
                "type": "exceed_context_size_error",
                "n_prompt_tokens": n_tokens,
                "n_ctx": n_ctx,
            }
        },
    )


def floats(vector: Any) -> list[float]:
    """A vector as JSON numbers (a float32 array's values, each exactly as a double)."""
    values = vector.tolist() if hasattr(vector, "tolist") else list(vector)
    return [float(v) for v in values]


def float32_base64(vector: Any) -> str:
    """The vector's float32 bytes, little-endian, in base64 (llama-server's ``base64``)."""
    values = floats(vector)
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def oai_object(
    model: str, vectors: Sequence[Any], n_tokens: Sequence[int], use_base64: bool
) -> dict[str, Any]:
    """format_embeddings_response_oaicompat: one pooled vector per input, in input order."""
    data = []
    for i, vector in enumerate(vectors):
        if use_base64:
            data.append(
                {
                    "embedding": float32_base64(vector),
                    "index": i,
                    "object": "embedding",
                    "encoding_format": "base64",
                }
            )
        else:
            data.append({"embedding": floats(vector), "index": i, "object": "embedding"})
    total = int(sum(n_tokens))
    return {
        "model": model,
        "object": "list",
        "usage": {"prompt_tokens": total, "total_tokens": total},
        "data": data,
    }


def llama_results(rows: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """llama-server's own answer: for each input its vectors (every token's with pooling
    none, else the one pooled)."""
    return [{"index": i, "embedding": [floats(v) for v in vs]} for i, vs in enumerate(rows)]


# --- Ollama ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OllamaEmbedRequest:
    """/api/embed's fields: the inputs (strings), ``truncate``, ``dimensions``."""

    model: str
    inputs: list[str]
    truncate: bool
    dimensions: int
    keep_alive: Any


def read_ollama_embed(body: dict[str, Any]) -> OllamaEmbedRequest:
    """EmbedHandler's reading of /api/embed, its refusals as 400 ``{"error": ...}`` (ApiError
    with Ollama's body)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ollama_error(400, "model is required")
    raw = body.get("input")
    if raw is None:
        inputs: list[str] = []
    elif isinstance(raw, str):
        inputs = [raw] if raw else []
    elif isinstance(raw, list):
        if not all(isinstance(s, str) for s in raw):
            raise ollama_error(400, "invalid input type")
        inputs = list(raw)
    else:
        raise ollama_error(400, "invalid input type")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ollama_error(400, "truncate must be a boolean")
    dimensions = body.get("dimensions", 0)
    if dimensions is None:
        dimensions = 0
    if not isinstance(dimensions, int) or isinstance(dimensions, bool):
        raise ollama_error(400, "dimensions must be an integer")
    return OllamaEmbedRequest(model, inputs, truncate, dimensions, body.get("keep_alive"))


def ollama_error(status: int, message: str) -> ApiError:
    """A refusal on Ollama's routes (their resource writes it as ``{"error": message}``)."""
    return ApiError(status, {"error": {"message": message}})


def ollama_normalize(vector: Sequence[float]) -> list[float]:
    """Ollama's ``normalize``: float32 sum of squares in order, ``norm = float32(1 /
    max(sqrt(sum), 1e-12))``, each element times it in float32; a NaN or infinity is its 400."""
    total = 0.0
    f32 = _float32
    for v in vector:
        if not math.isfinite(v):
            raise ollama_error(400, "embedding contains NaN or Inf values")
        total = f32(total + f32(v * v))
    norm = f32(1.0 / max(math.sqrt(total), 1e-12))
    return [f32(v * norm) for v in vector]


def _float32(x: float) -> float:
    """``x`` rounded to float32 (beyond its range: an infinity, as the hardware rounds)."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)


def ollama_embed_object(
    model: str,
    vectors: Sequence[Sequence[float]],
    prompt_eval_count: int,
    total_duration_ns: int,
    load_duration_ns: int,
) -> dict[str, Any]:
    """EmbedHandler's answer (api.EmbedResponse's fields in its order; a zero duration or
    count is left out, as its ``omitempty``)."""
    out: dict[str, Any] = {"model": model, "embeddings": [list(v) for v in vectors]}
    for name, value in (
        ("total_duration", total_duration_ns),
        ("load_duration", load_duration_ns),
        ("prompt_eval_count", prompt_eval_count),
    ):
        if int(value):
            out[name] = int(value)
    return out
