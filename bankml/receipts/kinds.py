"""The API kinds: which API an answer was written for, the ``api`` field of every receipt.

One vocabulary for the native answers, P0's reading of llama-server's answers, the signed
receipt and its replay. A kind names a wire shape, not a route: ``/v1/chat/completions`` and
``/chat/completions`` are both ``CHAT``.
"""

from __future__ import annotations

CHAT = "chat"  # OpenAI chat completions
OAI_COMPLETION = "oai_completion"  # OpenAI /v1/completions
LLAMA_COMPLETION = "llama_completion"  # llama-server's /completion, /completions, /infill
RESPONSES = "responses"  # OpenAI Responses, converted to a chat completion as llama-server does
MESSAGES = "messages"  # Anthropic Messages, converted the same way
OLLAMA_CHAT = "ollama_chat"
OLLAMA_GENERATE = "ollama_generate"
# embeddings (bankml/receipts/embedding.py): vectors, not text
OAI_EMBEDDINGS = "embeddings"  # OpenAI /v1/embeddings
LLAMA_EMBEDDING = "llama_embedding"  # llama-server's /embedding, /embeddings
OLLAMA_EMBED = "ollama_embed"  # Ollama's /api/embed
OLLAMA_EMBEDDINGS = "ollama_embeddings"  # Ollama's legacy /api/embeddings
EMBEDDING_APIS = (OAI_EMBEDDINGS, LLAMA_EMBEDDING, OLLAMA_EMBED, OLLAMA_EMBEDDINGS)
# rerank (bankml/receipts/rerank.py): llama-server's /rerank, /v1/rerank: scores, not text
RERANK = "rerank"

# an Ollama request's kind (``formats.ollama_request``'s chat / generate) -> its API kind
OLLAMA_KIND = {"chat": OLLAMA_CHAT, "generate": OLLAMA_GENERATE}

APIS = (
    CHAT,
    OAI_COMPLETION,
    LLAMA_COMPLETION,
    RESPONSES,
    MESSAGES,
    OLLAMA_CHAT,
    OLLAMA_GENERATE,
    *EMBEDDING_APIS,
    RERANK,
)

# /infill's body: parsed as llama-server's fill-in-the-middle fields, answered (and receipted)
# as LLAMA_COMPLETION; not an API kind of its own
INFILL = "infill"

# the kinds the engine runs itself, and the request shape it parses for each
ENGINE_KIND = {
    CHAT: "chat",
    OAI_COMPLETION: "completion",
    LLAMA_COMPLETION: "completion",
    INFILL: "infill",
}

# the kinds llama-server answers by converting the request to a chat completion first
CONVERTED = (RESPONSES, MESSAGES)
