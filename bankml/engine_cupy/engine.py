"""The native engine: one model, one slot, requests parsed and run as llama-server runs them.

``Engine.open`` loads the model, its tokenizer and chat template. ``parse_request`` validates a
/completion or /v1/chat/completions body completely (prompt, stop strings, sampler parameters,
constraint, limits, context) before any compute, raising ``RequestError`` with llama-server's
status and message. ``run_steps`` prefills in micro-batches of 512 (reusing the longest common
prefix with the slot's tokens), then samples token by token, yielding ``Chunk``s; its
``summary`` holds finish reason, counts and timings once the iteration is over.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from bankml.engine_cupy.chat_template import ChatTemplate, TemplateError
from bankml.engine_cupy.grammar import (ConstraintError, ConstraintSpec, Constraint, build_llg_tokenizer,
                                        resolve_constraint)
from bankml.engine_cupy.model import Model
from bankml.engine_cupy.prompt_cache import HostPromptCache, limit_from_env, longest_common_prefix
from bankml.engine_cupy.sampler import (SamplerError, SamplerParams, Sampler, VocabInfo, logarithm,
                                        token_logprobs)
from bankml.engine_cupy.tokenizer import Tokenizer

MICRO_BATCH = 512
INT32_MAX = 2_147_483_647


class RequestError(ValueError):
    """A refused request: HTTP ``status`` with ``body`` (a message string or llama-server's JSON)."""

    def __init__(self, message: str, status: int = 400, body: dict | None = None, reason: str = ""):
        super().__init__(message)
        self.status = status
        self.body = body if body is not None else message
        self.reason = reason  # what bankml found wrong, where llama-server's message says less


@dataclass
class Request:
    """A validated request, ready to run."""

    kind: str                       # "chat" | "completion"
    prompt_tokens: list[int]
    sampler: SamplerParams
    constraint: ConstraintSpec | None = None
    n_predict: int = -1             # -1: until EOG or the context is full
    stop: tuple[str, ...] = ()
    n_probs: int = 0
    cache_prompt: bool = True
    prompt_text: str | None = None


@dataclass
class Chunk:
    """One generated token: the text released with it, its logprob entry, the first-token flag."""

    text: str
    entry: dict | None
    first: bool
    token: int | None


@dataclass
class Summary:
    finish_reason: str = "stop"
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cancelled: bool = False
    stopping_word: str = ""
    timings: dict[str, Any] = field(default_factory=dict)


# --- request parsing helpers ---------------------------------------------------------------------------


def _int_field(body: Mapping[str, Any], names: Sequence[str], default: int, lo: int, hi: int) -> int:
    """A hard-limited integer field_num (n_predict and its aliases)."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, (int, float)):  # a boolean converts, as nlohmann's get<int> does
            raise RequestError(f"Field '{name}': [json.exception.type_error.302] type must be number, "
                               f"but is {_json_type(value)}")
        v = int(value)
        if v < lo or v > hi:
            raise RequestError(f"Field '{name}': Value must be between {lo} <= value <= {hi}, but got {v}")
        return v
    return default


def _json_type(value: Any) -> str:
    return {bool: "boolean", str: "string", list: "array", dict: "object", type(None): "null"}.get(
        type(value), "number")


def parse_stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The ``stop`` handler: a string or an array of strings; any other type is ignored, and a
    non-string item is nlohmann's conversion error, as in llama-server."""
    stop = body.get("stop")
    if isinstance(stop, str):
        return (stop,)
    if not isinstance(stop, list):
        return ()
    words = []
    for word in stop:
        if word is None or word == [] or word == {}:
            continue  # json::empty(): null and empty arrays/objects; an empty string is kept (and stops at once)
        if not isinstance(word, str):
            raise RequestError(f"Field 'stop': [json.exception.type_error.302] type must be string, "
                               f"but is {_json_type(word)}")
        words.append(word)
    return tuple(words)


def chat_logprobs(body: dict[str, Any]) -> None:
    """oaicompat_chat_params_parse's logprobs mapping: logprobs -> n_probs (top_logprobs or 20)."""
    logprobs = body.get("logprobs")
    if logprobs is True:
        top = body.get("top_logprobs")
        body["n_probs"] = 20 if top is None else top
    elif body.get("top_logprobs") is not None:
        raise RequestError("top_logprobs requires logprobs to be set to true")
    body.pop("logprobs", None)  # not n_probs' alias on the chat endpoint


def check_chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The shape checks oaicompat_chat_params_parse makes before templating."""
    if "messages" not in body:
        raise RequestError("'messages' is required")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise RequestError("Expected 'messages' to be an array")
    for msg in messages:
        if not isinstance(msg, dict):
            raise RequestError("Expected 'messages' items to be objects")
        role = msg.get("role")
        if role != "assistant" and "content" not in msg:
            raise RequestError("All non-assistant messages must contain 'content'")
        if role == "assistant" and "content" not in msg and "tool_calls" not in msg:
            raise RequestError("Assistant message must contain either 'content' or 'tool_calls'!")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError("Expected 'content' to be a string or an array")
    return messages


# --- text release: UTF-8 and stop strings ------------------------------------------------------------


def incomplete_utf8_at(text: bytes) -> int:
    """validate_utf8: the length without a multi-byte character cut off at the end."""
    n = len(text)
    for i in range(1, min(4, n) + 1):
        c = text[n - i]
        if (c & 0xE0) == 0xC0 and i < 2 or (c & 0xF0) == 0xE0 and i < 3 or (c & 0xF8) == 0xF0 and i < 4:
            return n - i
    return n


def find_partial_stop(text: bytes, stop: bytes) -> int:
    """string_find_partial_stop: where a suffix of ``text`` that begins ``stop`` starts, or -1."""
    for length in range(min(len(text), len(stop)), 0, -1):
        if text.endswith(stop[:length]):
            return len(text) - length
    return -1


class TextRelease:
    """process_token's text handling: hold incomplete UTF-8 and partial stop strings, cut at a stop."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s.encode("utf-8") for s in stops]
        self.text = b""
        self.sent = 0
        self.stopping_word = ""

    def push(self, piece: bytes, is_eog: bool) -> tuple[bytes | None, bool]:
        """Add a token's bytes; returns (released bytes or None while UTF-8 is incomplete, stopped)."""
        self.text += piece
        if incomplete_utf8_at(self.text) < len(self.text):
            return None, False
        pos = min(self.sent, len(self.text))
        tail = self.text[pos:]
        stop_pos, word = self._find_full(tail, len(piece))
        if stop_pos >= 0:
            self.text = self.text[:pos + stop_pos]
            self.stopping_word = word.decode("utf-8", "replace")
            pos = min(self.sent, len(self.text))
        elif not is_eog and any(find_partial_stop(tail, s) >= 0 for s in self.stops):
            return b"", False
        out = self.text[pos:]
        self.sent += len(out)
        return out, stop_pos >= 0

    def _find_full(self, tail: bytes, piece_len: int) -> tuple[int, bytes]:
        best, word = -1, b""
        for s in self.stops:
            start = max(len(tail) - (len(s) + piece_len), 0)
            p = tail.find(s, start)
            if p >= 0 and (best < 0 or p < best):
                best, word = p, s
        return best, word


def utf8_prefix_text(raw: bytes) -> str:
    """A logprob entry's ``token``: the incomplete trailing character cut, other bad bytes replaced."""
    return raw[:incomplete_utf8_at(raw)].decode("utf-8", "replace")


# --- timings ---------------------------------------------------------------------------------------------


@dataclass
class Clock:
    t_start: float = 0.0
    t_prompt: float = 0.0
    t_gen: float = 0.0

    def timings(self, cache_n: int, prompt_n: int, predicted_n: int) -> dict[str, Any]:
        prompt_ms = (self.t_prompt - self.t_start) * 1e3 if self.t_prompt else 0.0
        predicted_ms = (self.t_gen - self.t_prompt) * 1e3 if self.t_gen else 0.0

        def rate(n: int, ms: float) -> float | None:
            return 1e3 * n / ms if n and ms > 0 else None

        return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
                "prompt_per_second": rate(prompt_n, prompt_ms), "predicted_n": predicted_n,
                "predicted_ms": round(predicted_ms, 3), "predicted_per_second": rate(predicted_n, predicted_ms)}


# --- the engine --------------------------------------------------------------------------------------------


class Steps:
    """An iteration over a run's chunks; ``summary`` is filled when it ends."""

    def __init__(self, gen_factory: Callable[["Steps"], Iterator[Chunk]]):
        self.summary = Summary()
        self._gen = gen_factory(self)

    def __iter__(self) -> Iterator[Chunk]:
        return self._gen

    def __next__(self) -> Chunk:
        return next(self._gen)


class Engine:
    """One resident model with one slot (a KV cache and the tokens it holds)."""

    def __init__(self, model: Any, tokenizer: Tokenizer, template: ChatTemplate | None, n_ctx: int,
                 cache_type: str | None = None, sampling_defaults: SamplerParams | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self.n_ctx = n_ctx
        self.n_vocab = int(model.n_vocab)
        self.cache = model.new_cache(n_ctx, cache_type)
        self.slot_tokens: list[int] = []
        self.host_cache = HostPromptCache(limit_from_env())  # BANKML_CACHE_RAM, read at open
        self.defaults = sampling_defaults or SamplerParams()
        self._pieces = tokenizer.vocab_bytes()
        self._text_pieces = [tokenizer.token_to_piece(i, False) for i in range(tokenizer.n_vocab)]
        self._llg: Any = None
        self._vocab_info = VocabInfo(self._pieces, lambda s: self.tokenize(s))

    @classmethod
    def open(cls, path: str | os.PathLike, n_ctx: int = 4096, device: str = "auto",
             cache_type: str | None = None) -> "Engine":
        model = Model.load(path, device=device)
        tokenizer = Tokenizer.from_gguf(model.reader)
        template = ChatTemplate.from_gguf(model.reader, tokenizer)
        return cls(model, tokenizer, template, n_ctx, cache_type, _gguf_sampling_defaults(model.reader))

    # --- text ---------------------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.detokenize(ids)

    def apply_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        if self.template is None:
            raise RequestError("this model has no chat template")
        return self.template.render(messages, **kwargs)

    def llg_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on first use (about a second)."""
        if self._llg is None:
            special = [i for i in range(self.tokenizer.n_vocab) if self.tokenizer.is_control(i)]
            self._llg = build_llg_tokenizer(self._pieces, special, self.tokenizer.eog_ids,
                                            self.tokenizer.bos_id, lambda s: self.tokenize(s))
        return self._llg

    # --- requests -------------------------------------------------------------------------------------------

    def parse_request(self, request: Mapping[str, Any], kind: str) -> Request:
        """Validate a request body completely; raises RequestError (status 400) before any compute."""
        if not isinstance(request, Mapping):
            raise RequestError("request body must be a JSON object")
        body = dict(request)
        try:
            if kind == "chat":
                prompt_text, tokens = self._chat_prompt(body)
            elif kind == "completion":
                prompt_text, tokens = self._completion_prompt(body)
            else:
                raise ValueError(f"unknown request kind {kind!r}")
            stop = parse_stop(body)
            n_predict = _int_field(body, ("n_predict", "max_completion_tokens", "max_tokens"), -1, -1, INT32_MAX)
            params = SamplerParams.from_request(body, self.defaults)
            constraint = resolve_constraint(body, kind)
            if constraint is not None:
                Constraint(constraint, self.llg_tokenizer(), self.n_vocab, self.tokenizer.eog_ids)
            if params.dry_multiplier != 0.0:
                self._new_sampler(params)  # breaker tokenization can refuse
        except (SamplerError, TemplateError) as err:
            raise RequestError(str(err)) from None
        except ConstraintError as err:
            raise RequestError(str(err), reason=err.reason) from None
        cache_prompt = body.get("cache_prompt", True)
        if not isinstance(cache_prompt, bool):
            raise RequestError(f"Field 'cache_prompt': [json.exception.type_error.302] type must be boolean, "
                               f"but is {_json_type(cache_prompt)}")
        self._check_context(tokens)
        return Request(kind, tokens, params, constraint, n_predict, stop, max(params.n_probs, 0), cache_prompt,
                       prompt_text)

    def _chat_prompt(self, body: dict[str, Any]) -> tuple[str, list[int]]:
        messages = check_chat_messages(body)
        chat_logprobs(body)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object")
        add_gen = body.get("add_generation_prompt", True)
        text = self.apply_template(messages, add_generation_prompt=bool(add_gen), tools=body.get("tools"),
                                   **kwargs)
        return text, self.tokenize(text, add_special=True, parse_special=True)

    def _completion_prompt(self, body: Mapping[str, Any]) -> tuple[str | None, list[int]]:
        """tokenize_input_prompts: a string (BOS per the vocabulary, special tokens parsed) or ids."""
        if "prompt" not in body:
            raise RequestError("[json.exception.out_of_range.403] key 'prompt' not found")
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt, add_special=True, parse_special=True)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 or t >= self.n_vocab for t in prompt):
                raise RequestError("Prompt contains invalid tokens")
            return None, list(prompt)
        if isinstance(prompt, list) and all(isinstance(t, (int, str)) and not isinstance(t, bool) for t in prompt):
            if any(isinstance(t, str) for t in prompt) and any(isinstance(t, int) for t in prompt):
                tokens = self._mixed_prompt(prompt)
                return None, tokens
            raise RequestError("bankml serves one prompt per request (send several requests)")
        raise RequestError("\"prompt\" elements must be a string, a list of tokens, a JSON object containing a "
                           "prompt string, or a list of mixed strings & tokens.")

    def _mixed_prompt(self, parts: list[int | str]) -> list[int]:
        """tokenize_mixed: strings tokenized (BOS only before the first), ids kept."""
        out: list[int] = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                out += self.tokenize(part, add_special=i == 0, parse_special=True)
            else:
                if part < 0 or part >= self.n_vocab:
                    raise RequestError("Prompt contains invalid tokens")
                out.append(part)
        return out

    def _check_context(self, tokens: Sequence[int]) -> None:
        if len(tokens) >= self.n_ctx:
            message = (f"request ({len(tokens)} tokens) exceeds the available context size ({self.n_ctx} "
                       f"tokens), try increasing it")
            raise RequestError(message, 400, {"error": {
                "code": 400, "message": message, "type": "exceed_context_size_error",
                "n_prompt_tokens": len(tokens), "n_ctx": self.n_ctx}})

    # --- running --------------------------------------------------------------------------------------------

    def _new_sampler(self, params: SamplerParams) -> Sampler:
        return Sampler(params, self._vocab_info, self.n_vocab)

    def run_steps(self, request: Request, cancelled: Callable[[], bool] = lambda: False) -> Steps:
        """Prefill then generate; iterate for Chunks, then read ``.summary``."""
        return Steps(lambda steps: self._run(request, cancelled, steps.summary))

    def _prefill(self, tokens: list[int], cache_prompt: bool, cancelled: Callable[[], bool]
                 ) -> tuple[int, np.ndarray | None]:
        """Reuse the slot's common prefix (re-evaluating the last prompt token when all of it is
        cached), then evaluate the rest in micro-batches. Returns (cache_n, last logits or None if
        cancelled)."""
        if cache_prompt:
            self._use_host_cache(tokens)
        n_past = longest_common_prefix(self.slot_tokens, tokens) if cache_prompt else 0
        if n_past == len(tokens):
            n_past -= 1
        self.cache.truncate(n_past)
        self.slot_tokens = self.slot_tokens[:n_past]
        logits = None
        for start in range(n_past, len(tokens), MICRO_BATCH):
            if cancelled():
                return n_past, None
            batch = tokens[start:start + MICRO_BATCH]
            logits = self.model.forward(batch, self.cache)
            self.slot_tokens += batch
        return n_past, logits

    def _use_host_cache(self, prompt: list[int]) -> None:
        """llama-server's --cache-ram: keep the slot's context for later, bring back a better one."""
        if not self.host_cache.should_run(self.slot_tokens, prompt):
            return
        self.host_cache.save(self.slot_tokens, self.cache)
        entry = self.host_cache.take_better(self.slot_tokens, prompt)
        if entry is not None:
            self.cache.restore(entry.kv, len(entry.tokens))
            self.slot_tokens = list(entry.tokens)

    def _run(self, req: Request, cancelled: Callable[[], bool], summary: Summary) -> Iterator[Chunk]:
        clock = Clock(t_start=time.perf_counter())
        tokens = req.prompt_tokens
        summary.prompt_tokens = len(tokens)
        if not tokens:
            return
        sampler = self._new_sampler(req.sampler)
        constraint = (Constraint(req.constraint, self.llg_tokenizer(), self.n_vocab, self.tokenizer.eog_ids)
                      if req.constraint else None)
        cache_n, logits = self._prefill(tokens, req.cache_prompt, cancelled)
        prompt_n = len(tokens) - cache_n
        summary.timings = clock.timings(cache_n, prompt_n, 0)
        if logits is None:
            summary.cancelled = True
            return
        for t in tokens:
            sampler.accept(t)
        release = TextRelease(req.stop)
        eog = self.tokenizer.eog_ids
        n_gen = 0
        raw = b""
        while True:
            if cancelled():
                summary.cancelled = True
                break
            token = self._sample(sampler, constraint, logits)
            sampler.accept(token)
            if constraint is not None:
                constraint.accept(token)
            n_gen += 1
            now = time.perf_counter()
            if n_gen == 1:
                clock.t_prompt = now
            clock.t_gen = now
            summary.tokens.append(token)
            piece = self._text_pieces[token]
            raw += piece
            released, hit_stop = release.push(piece, token in eog)
            entry = None
            if released is not None and req.n_probs > 0:
                entry = self._entry(logits, token, released, req.n_probs)
            yield Chunk(released.decode("utf-8", "replace") if released else "", entry, n_gen == 1, token)
            finish = self._finish(req, token, n_gen, hit_stop, eog)
            if finish:
                summary.finish_reason = finish
                break
            logits = self.model.forward([token], self.cache)
            self.slot_tokens.append(token)
        summary.text = release.text.decode("utf-8", "replace")
        summary.stopping_word = release.stopping_word
        summary.completion_tokens = n_gen
        summary.timings = clock.timings(cache_n, prompt_n, n_gen)

    def _sample(self, sampler: Sampler, constraint: Constraint | None, logits: np.ndarray) -> int:
        if constraint is None:
            return sampler.sample(logits)
        return sampler.sample(logits, constraint.allows, constraint.mask)

    def _finish(self, req: Request, token: int, n_gen: int, hit_stop: bool, eog: frozenset[int]) -> str | None:
        """process_token's order: stop word, context full, n_predict, then EOG."""
        finish = "stop" if hit_stop else None
        if len(self.slot_tokens) + 1 >= self.n_ctx:
            finish = "length"
        elif finish is None and req.n_predict != -1 and n_gen >= req.n_predict:
            finish = "length"
        if token in eog:
            finish = "stop"
        return finish

    def _entry(self, logits: np.ndarray, token: int, released: bytes, n_probs: int) -> dict:
        """A logprob entry in llama-server's shape, from the raw logits."""
        probs = token_logprobs(logits, n_probs, token)
        top = []
        for tid, p in probs.top:
            piece = self._text_pieces[tid]
            top.append({"id": tid, "token": utf8_prefix_text(piece), "bytes": list(piece), "logprob": logarithm(p)})
        return {"id": token, "token": utf8_prefix_text(released), "bytes": list(released),
                "logprob": logarithm(probs.p_token), "top_logprobs": top}


def _gguf_sampling_defaults(reader: Any) -> SamplerParams:
    """general.sampling.* from the header, over llama.cpp's defaults."""
    values: dict[str, Any] = {}
    fields = getattr(reader, "fields", {}) or {}
    for name, fld in fields.items():
        if not name.startswith("general.sampling."):
            continue
        try:
            values[name] = fld.contents()
        except Exception:  # an odd type in an optional key: llama.cpp ignores what it cannot read
            continue
    return SamplerParams.from_gguf_metadata(values)
