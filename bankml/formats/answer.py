"""One answer of the native engine: its objects and stream events, and its receipt.

An ``Answer`` is fed one prompt's run (``on_chunk`` per generated token, ``on_progress`` per
prompt-progress report, then ``whole`` or ``final_events`` with the run's summary: the items of
bankml/native/run.py's ``Step``s) and returns what to send, built by the wire formats in
llama-server's shapes. It holds the answer's ``Tally``; the receipt rides in the whole object, or
inside the last event of a stream. One subclass per endpoint family: ``ChatAnswer``
(/v1/chat/completions), ``CompletionAnswer`` (/v1/completions), ``LlamaCompletionAnswer``
(llama-server's /completion); the Responses and Messages answers build on ``ChatAnswer``
(bankml/formats/converted.py), and bankml/formats/answers.py names the class of each API kind.

What it asks of the engine that answers is ``AnswerSource``: the served model's name and build,
the number of tokens of a stop word, and the receipt of a finished answer (bankml/native's
``NativeEngine`` has them).

Pure Python: no Twisted, no NumPy, so ``bankml.chat`` builds the same objects the HTTP
endpoints send. The engine's chunks, summaries and parsed requests are read through their
attributes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from bankml.formats import llama as llama_format
from bankml.formats import openai as openai_format
from bankml.formats.chat_content import chat_schema_content
from bankml.formats.chat_message import (
    MessageDiff,
    MessageStream,
    delta_object,
    finish_reason,
    message_object,
)
from bankml.formats.llama import llama_timings
from bankml.receipts.kinds import CHAT, LLAMA_COMPLETION, OAI_COMPLETION
from bankml.receipts.tally import Tally


class AnswerSource(Protocol):
    """What an ``Answer`` reads of the engine that answers (``NativeEngine`` has it)."""

    @property
    def model_id(self) -> str:
        """The served model's name (llama-server's first ``--alias``, else the file's name)."""
        ...

    @property
    def build_info(self) -> str:
        """The ``system_fingerprint`` every OpenAI object carries."""
        ...

    def token_count(self, text: str) -> int:
        """How many tokens the model's tokenizer makes of ``text`` (a stop word)."""
        ...

    def receipt(
        self, tally: Tally, parsed: Any, summary: Any, *, api: str, stream: bool
    ) -> dict[str, Any]:
        """The receipt of one finished answer."""
        ...


class Answer:
    """One prompt's answer: the events its Chunks make, its last events or whole object."""

    id_prefix = "cmpl-"
    object_name = "text_completion"

    def __init__(
        self,
        source: AnswerSource,
        kind: str,
        body: bytes,
        request: dict[str, Any],
        parsed: Any,
        *,
        index: int = 0,
        clock: Callable[[], float] = time.monotonic,
        stream: bool | None = None,
    ) -> None:
        self.source = source
        self.kind = kind
        self.request = request
        self.parsed = parsed
        self.index = index
        self.stream = request.get("stream") is True if stream is None else stream
        self.tally = Tally(request_body=body, clock=clock)
        # the server's model name whatever the request names (llama-server's oaicompat_model);
        # with several models resident, the one the request was parsed for
        self.model = str(getattr(getattr(parsed, "served_by", None), "model_id", source.model_id))
        self.id = self.id_prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.options: dict[str, Any] = getattr(parsed, "options", {}) or {}
        self.entries: list[dict[str, Any]] = []  # every logprob entry the engine gave, in order
        self.n_tokens = 0  # tokens generated so far
        self.wants_logprobs = int(getattr(parsed, "n_probs", 0) or 0) > 0
        self.timings_per_token = bool(self.options.get("timings_per_token"))
        # ``verbose``: llama-server adds its /completion-shaped object (``__verbose``) to the
        # OpenAI answers; /completion is that object already
        self.verbose = bool(self.options.get("verbose")) and kind != LLAMA_COMPLETION
        self.progress_sent = False  # a prompt-progress event went out (it replaces the begin event)

    def envelope(self, obj: str | None = None) -> dict[str, Any]:
        return openai_format.envelope(
            self.created, self.id, self.model, self.source.build_info, obj or self.object_name
        )

    # -- per chunk

    def on_chunk(self, chunk: Any) -> list[dict[str, Any]]:
        """Note one Chunk; return the streamed events it makes (none when not streaming)."""
        self.n_tokens += 1
        if chunk.text and self.tally.first_piece_at is None:
            self.tally.first_piece_at = self.tally.clock()  # TTFT, streamed or not
        if chunk.entry is not None:
            self.entries.append(chunk.entry)
        if not self.stream:
            return []
        return self.pieces(chunk)

    def pieces(self, chunk: Any) -> list[dict[str, Any]]:
        """The events of one Chunk in a stream (a piece of text, a logprob entry)."""
        raise NotImplementedError

    def with_timings(self, events: list[dict[str, Any]], timings: Any) -> list[dict[str, Any]]:
        """``timings_per_token``: the run's timings so far on the last event of a token."""
        if self.timings_per_token and events and timings:
            events[-1]["timings"] = llama_timings(timings)
        return events

    def on_progress(self, progress: Any) -> list[dict[str, Any]]:
        """A prompt-progress event (a stream with ``return_progress``): the kind's empty piece,
        its timings with ``timings_per_token``, then ``prompt_progress``."""
        self.progress_sent = True
        if not self.stream:
            return []
        event = self.progress_piece(progress)
        if self.verbose and self.kind == OAI_COMPLETION:  # a partial's __verbose, as its own
            own = llama_format.progress_piece(self.index, self.n_tokens, progress.total)
            own = self.with_timings([own], progress.timings)[0]
            event["__verbose"] = {**own, "prompt_progress": progress.as_json()}
        event = self.with_timings([event], progress.timings)[0]
        event["prompt_progress"] = progress.as_json()
        return [event]

    def verbose_final(self, summary: Any, text: str, entries: list[Any]) -> dict[str, Any]:
        """``__verbose`` of a whole answer or a stream's end: /completion's final object of this
        task (its raw generated text; a chat task's settings name the chat parser)."""
        settings = llama_format.generation_settings(self.parsed)
        if self.kind == CHAT:
            settings["chat_format"] = str(self.options.get("chat_format", "peg-native"))
            settings["generation_prompt"] = str(self.options.get("generation_prompt", ""))
        out = llama_format.completion_final(
            summary,
            text,
            index=self.index,
            model=self.model,
            settings=settings,
            prompt=self.parsed.prompt_text or "",
        )
        out["timings"] = llama_timings(summary.timings)
        if entries:
            out["completion_probabilities"] = entries
        return out

    def progress_piece(self, progress: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _piece_taken(self, chunk: Any) -> bool:
        """Tally a completion piece; False when the Chunk has nothing to send."""
        if not chunk.text and chunk.entry is None:
            return False
        self.tally.add_text(chunk.text)
        if chunk.entry is not None:
            self.tally.add_logprobs([chunk.entry])
        return True

    # -- the end

    def usage(self, summary: Any) -> dict[str, Any]:
        return openai_format.usage(
            summary.prompt_tokens,
            summary.completion_tokens,
            (summary.timings or {}).get("cache_n", 0),
        )

    def final_logprobs(self, summary: Any) -> list[dict[str, Any]]:
        """Non-streamed: every entry, less a stop word's own tokens after a stop hit (llama-server
        drops the last len(tokenize(stop)) entries)."""
        entries = list(self.entries)
        word = getattr(summary, "stopping_word", "")
        if word:
            drop = min(len(entries), self.source.token_count(word))
            entries = entries[: len(entries) - drop]
        return entries

    def whole(self, summary: Any) -> dict[str, Any]:
        """The non-streamed answer, receipt included."""
        self.tally.set_counts(summary.prompt_tokens, summary.completion_tokens)
        text = self.answer_text(summary)
        self.tally_whole(text)
        entries = self.final_logprobs(summary) if self.wants_logprobs else []
        if entries:
            self.tally.add_logprobs(entries)
        out = self.whole_body(summary, text, entries)
        if self.verbose:
            out["__verbose"] = self.verbose_final(summary, str(summary.text), entries)
        out["timings"] = llama_timings(summary.timings)
        out["bankml_receipt"] = self.receipt(summary)
        return self.shaped(out)

    def answer_text(self, summary: Any) -> str:
        """The whole answer's text as the client receives it."""
        return str(summary.text)

    def tally_whole(self, text: str) -> None:
        """The whole answer, for its receipt."""
        self.tally.add_text(text)

    def whole_body(self, summary: Any, text: str, entries: list[Any]) -> dict[str, Any]:
        raise NotImplementedError

    def final_events(self, summary: Any) -> list[dict[str, Any]]:
        """Streamed: the last events, the last one with usage, timings and the receipt."""
        self.tally.set_counts(summary.prompt_tokens, summary.completion_tokens)
        events = self.last_events(summary)
        if self.verbose:  # on the finish chunk (a chat's usage chunk comes after it)
            finish = next(e for e in events if e["choices"] and e["choices"][0]["finish_reason"])
            finish["__verbose"] = self.verbose_final(summary, "", [])
        events[-1]["timings"] = llama_timings(summary.timings)
        events[-1]["bankml_receipt"] = self.receipt(summary)
        return [self.shaped(e) for e in events]

    def last_events(self, summary: Any) -> list[dict[str, Any]]:
        """The events that end a stream, before timings and the receipt go on the last one."""
        raise NotImplementedError

    def shaped(self, obj: dict[str, Any]) -> dict[str, Any]:
        """An object as sent (``response_fields`` on /completion); as it is elsewhere."""
        return obj

    def receipt(self, summary: Any) -> dict[str, Any]:
        """The answer's receipt, signed (with the replay facts of ``parsed`` and ``summary``)
        when the engine holds a key."""
        return self.source.receipt(
            self.tally, self.parsed, summary, api=self.kind, stream=self.stream
        )


class ChatAnswer(Answer):
    """/v1/chat/completions: OpenAI's chat object, or its chunks (role delta, content deltas,
    a token's logprob entry on its last delta)."""

    id_prefix = "chatcmpl-"
    object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_seen = False
        # a chat schema's answer reaches the client as llama-server's chat parser leaves it: the
        # JSON value without the blanks and ```json fence around it (streamed: as it grows)
        constraint = getattr(self.parsed, "constraint", None)
        self.schema_answer = getattr(constraint, "kind", "") == "chat_schema"
        self.generated = ""  # the generated text so far, when it is a schema answer
        self.content_sent = ""
        # a continued last message's content starts the answer's, as llama-server's chat
        # parser reads it; a stream sends it with the first piece, unless it is not to be echoed
        self.prefill = str(self.options.get("prefill") or "")
        self.prefill_pending = self.prefill if self.options.get("prefill_streamed", True) else ""
        # the chat format's parse (generation prompt + output -> content, reasoning, tool
        # calls), as llama-server's chat parser runs after every token and at the end
        parser = getattr(self.parsed, "chat_parser", None)
        self.messages = None if parser is None else MessageStream(parser)
        if self.messages is not None and not self.options.get("prefill_streamed", True):
            self.messages.update("", partial=True)  # a continuation not echoed: not re-sent

    def answer_text(self, summary: Any) -> str:
        text = str(summary.text)
        if self.messages is not None:
            self.messages.update(text[len(self.messages.text) :], partial=False)
            return self.messages.message.content
        return chat_schema_content(text) if self.schema_answer else self.prefill + text

    def tally_whole(self, text: str) -> None:
        if self.messages is None:
            self.tally.add_text(text)
        else:
            self.tally.take_chat(message_object(self.messages.message))

    def _message_events(self, added: str, partial: bool) -> list[dict[str, Any]]:
        """The events of what the parse finds after ``added``."""
        assert self.messages is not None
        return self.diff_events(self.messages.update(added, partial))

    def diff_events(self, diffs: list[MessageDiff]) -> list[dict[str, Any]]:
        """One parse's changes as this API streams them: OpenAI's deltas (tallied as sent)."""
        events = []
        for diff in diffs:
            delta = delta_object(diff)
            self.tally.take_chat(delta)
            events.append(openai_format.chat_chunk(self.envelope(), delta, index=self.index))
        return events

    def _finish(self, summary: Any) -> str:
        """The answer's finish reason (noted for the receipt): ``tool_calls`` for one that
        stopped with calls."""
        if self.messages is None:
            return str(summary.finish_reason)
        reason = finish_reason(summary.finish_reason == "stop", self.messages.message)
        self.tally.set_end(reason, None)
        return reason

    def _content_delta(self, text: str) -> str:
        """The part of a schema answer's content not sent yet (``text`` is the new piece)."""
        self.generated += text
        content = chat_schema_content(self.generated)
        new = content[len(self.content_sent) :] if content.startswith(self.content_sent) else ""
        self.content_sent += new
        return new

    def pieces(self, chunk: Any) -> list[dict[str, Any]]:
        events = []
        if not self.first_seen:  # OpenAI's (and llama-server's) opening role delta
            self.first_seen = True
            events.append(
                openai_format.chat_chunk(
                    self.envelope(), openai_format.role_delta(), index=self.index
                )
            )
        if self.messages is not None:
            events += self._message_events(chunk.text, partial=True)
        else:
            text = (
                self._content_delta(chunk.text) if self.schema_answer and chunk.text else chunk.text
            )
            if text and self.prefill_pending:
                text, self.prefill_pending = self.prefill_pending + text, ""
            if text:
                self.tally.add_text(text)
                events.append(
                    openai_format.chat_chunk(self.envelope(), {"content": text}, index=self.index)
                )
        if chunk.entry is not None and events:  # an entry rides on its token's last delta
            events[-1]["choices"][0]["logprobs"] = {"content": [chunk.entry]}
            self.tally.add_logprobs([chunk.entry])
        return self.with_timings(events, chunk.timings)

    def progress_piece(self, progress: Any) -> dict[str, Any]:
        # llama-server's opening role delta rides on every progress event, and again on the
        # first token's
        return openai_format.chat_chunk(
            self.envelope(), openai_format.role_delta(), index=self.index
        )

    def whole_body(self, summary: Any, text: str, entries: list[Any]) -> dict[str, Any]:
        return openai_format.chat_completion(
            self.envelope("chat.completion"),
            text,
            self._finish(summary),
            entries,
            self.usage(summary),
            index=self.index,
            message=None if self.messages is None else message_object(self.messages.message),
        )

    def last_events(self, summary: Any) -> list[dict[str, Any]]:
        """The finish chunk. Asked with ``stream_options.include_usage`` a chat ends as
        llama-server (and OpenAI) end it: the finish chunk alone, then a chunk with no choices
        carrying usage. Without it llama-server's finish chunk carries timings only; bankml adds
        usage there, so the last chunk always carries usage and timings."""
        events: list[dict[str, Any]] = []
        if not self.first_seen:
            self.first_seen = True
            events.append(
                openai_format.chat_chunk(
                    self.envelope(), openai_format.role_delta(), index=self.index
                )
            )
        if self.messages is not None:  # the final parse's deltas, then the finish
            events += self._message_events("", partial=False)
        last = openai_format.chat_chunk(
            self.envelope(), {}, self._finish(summary), index=self.index
        )
        if openai_format.include_usage(self.request):
            events.append(last)
            last = openai_format.chat_usage_chunk(self.envelope())
        last["usage"] = self.usage(summary)
        events.append(last)
        return events


class CompletionAnswer(Answer):
    """/v1/completions: OpenAI's text completion, its choice at the prompt's index."""

    def pieces(self, chunk: Any) -> list[dict[str, Any]]:
        if not self._piece_taken(chunk):
            return []
        entries = [chunk.entry] if chunk.entry is not None else None
        choice = openai_format.completion_choice(chunk.text, self.index, entries, None)
        event = openai_format.text_completion(self.envelope(), choice)
        if self.verbose:  # the partial result's own object
            event["__verbose"] = llama_format.completion_piece(
                self.index,
                chunk,
                self.n_tokens,
                len(self.parsed.prompt_tokens),
                self.timings_per_token,
            )
        return self.with_timings([event], chunk.timings)

    def progress_piece(self, progress: Any) -> dict[str, Any]:
        choice = openai_format.completion_choice("", self.index, None, None)
        return openai_format.text_completion(self.envelope(), choice)

    def whole_body(self, summary: Any, text: str, entries: list[Any]) -> dict[str, Any]:
        choice = openai_format.completion_choice(text, self.index, entries, summary.finish_reason)
        return openai_format.text_completion(self.envelope(), choice, self.usage(summary))

    def last_events(self, summary: Any) -> list[dict[str, Any]]:
        choice = openai_format.completion_choice("", self.index, None, summary.finish_reason)
        return [openai_format.text_completion(self.envelope(), choice, self.usage(summary))]


class LlamaCompletionAnswer(Answer):
    """llama-server's /completion: its events and final object, ``tokens`` with
    ``return_tokens``, per-token ``timings`` with ``timings_per_token``, ``response_fields``."""

    def pieces(self, chunk: Any) -> list[dict[str, Any]]:
        if not self._piece_taken(chunk):
            return []
        return [
            llama_format.completion_piece(
                self.index,
                chunk,
                self.n_tokens,
                len(self.parsed.prompt_tokens),
                self.timings_per_token,
            )
        ]

    def progress_piece(self, progress: Any) -> dict[str, Any]:
        return llama_format.progress_piece(self.index, self.n_tokens, progress.total)

    def final(self, summary: Any, text: str) -> dict[str, Any]:
        return llama_format.completion_final(
            summary,
            text,
            index=self.index,
            model=self.model,
            settings=llama_format.generation_settings(self.parsed),
            prompt=self.parsed.prompt_text or "",
            tokens=summary.tokens
            if self.options.get("return_tokens") and not self.stream
            else None,
        )

    def whole_body(self, summary: Any, text: str, entries: list[Any]) -> dict[str, Any]:
        out = self.final(summary, text)
        if entries:
            out["completion_probabilities"] = entries
        return out

    def last_events(self, summary: Any) -> list[dict[str, Any]]:
        return [self.final(summary, "")]

    def shaped(self, obj: dict[str, Any]) -> dict[str, Any]:
        paths = self.options.get("response_fields") or []
        return llama_format.only_fields(obj, paths) if paths else obj
