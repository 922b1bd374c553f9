"""Ollama's API over the native engine: ``OllamaHost``, what the Ollama resources ask.

The resources (bankml/resources/ollama.py) read bodies and write bytes; everything else is here
(``OllamaHost`` is the ``OllamaRoutes`` they ask, bankml/resources/interfaces.py):

- **Listings** (``/api/version``, ``/api/tags``, ``/api/ps``, ``/api/show``) come from the
  catalog (``registry.catalog``: every pin of the registry directory plus the startup model, and
  the derived models) and the residency, shaped by ``formats.ollama``.
- **Answers** (``/api/chat``, ``/api/generate``): ``prepare`` (the prepare thread) validates the
  whole request with ``formats.ollama_request`` before any compute; ``run`` (the engine thread,
  in turn with every /v1 request) makes the model resident (``registry.residency``: reused when
  its file is unchanged, else the guard and the sha256 again before a weight is read), fits
  ``num_ctx``, lets the engine parse the body as /v1/chat/completions does (so ``format`` is
  constrained exactly as ``response_format`` is), runs it, and applies ``keep_alive``.
  ``OllamaRun`` turns its items into NDJSON lines and the final object with the receipt.
- **Residency**: one model resident (``--max-loaded`` 1). The resident model's engine is the one
  ``NativeEngine`` (and so /v1) answers with; ``wake`` loads the startup model again for a /v1
  request after an unload. ``reap`` is the reaper's step (a ``LoopingCall`` every second in
  native/service.py, queued behind any running request, so it never interrupts one).

No Twisted here: the bridge's Deferreds stay in the resources and the service.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from bankml.formats import ollama as wire
from bankml.formats import ollama_request as req
from bankml.formats.chat_content import chat_schema_content
from bankml.formats.errors import ApiError
from bankml.formats.ollama import OllamaError
from bankml.gate import verify
from bankml.native.resident import apply_server_defaults, open_engine
from bankml.native.run import Step, relay_forwards
from bankml.receipts.kinds import CHAT, LLAMA_COMPLETION, OLLAMA_KIND
from bankml.receipts.vouch import identity_problem
from bankml.registry import create as registry_create
from bankml.registry.catalog import (
    MANIFEST_CHANGED,
    Catalog,
    Target,
    layer_of,
    manifest_problem,
    pin_of,
    stale_layer,
)
from bankml.registry.keepalive import DEFAULT, BadKeepAlive, KeepAlive, parse_keep_alive
from bankml.registry.names import tag
from bankml.registry.pins import Pin, discover
from bankml.registry.residency import LoadError, Residency, Resident

if TYPE_CHECKING:
    from bankml.native.resident import NativeEngine


# a layer's parameters under their /v1 names ("": not a /v1 field; num_ctx is the server's)
V1_PARAMETERS = {"num_predict": "max_tokens", "num_ctx": ""}


@dataclass
class Job:
    """One /api/chat or /api/generate request after validation."""

    prepared: req.Prepared
    raw: bytes
    started_ns: int


@dataclass(frozen=True)
class Ready:
    """The first item of a run: the model is resident and the engine parsed the body."""

    stage: ClassVar[str] = "ready"  # how the resource tells the items apart (a Step has none)
    load_ns: int
    schema_answer: bool  # a chat schema: the content is the JSON value without its fence
    parser: Any = None  # the chat format's parse of the answer (content, thinking, tool calls)


@dataclass(frozen=True)
class Finished:
    """The last item of a run: the engine's summary and what the final object needs."""

    stage: ClassVar[str] = "finished"
    summary: Any
    parsed: Any = None  # the engine's Request (its seed pinned): the receipt's replay facts
    drop_last_entries: int = 0
    context: list[int] | None = None
    problem: str | None = None  # the file changed during the run: no receipt


@dataclass
class OllamaRun:
    """One answer: the lines its items make, then its final object (see ``formats.ollama``)."""

    job: Job
    issue: Callable[..., Mapping[str, Any]]  # NativeEngine.receipt
    answer: wire.OllamaAnswer | None = None
    schema_answer: bool = False
    generated: str = ""
    content_sent: str = ""
    lines: list[dict[str, Any]] = field(default_factory=list)

    @property
    def stream(self) -> bool:
        return self.job.prepared.stream

    def ready(self, item: Ready) -> None:
        p = self.job.prepared
        self.schema_answer = item.schema_answer
        self.answer = wire.OllamaAnswer(
            p.kind,
            p.model,
            self.job.raw,
            stream=p.stream,
            top_logprobs=p.top_logprobs if p.logprobs else None,
            started_ns=self.job.started_ns,
            load_ns=item.load_ns,
            parser=item.parser,
        )

    def on_chunk(self, chunk: Any) -> list[dict[str, Any]]:
        assert self.answer is not None
        if self.schema_answer and chunk.text and self.answer.messages is None:
            # as /v1 sends it: the JSON value alone, as it grows
            self.generated += chunk.text
            content = chat_schema_content(self.generated)
            new = content[len(self.content_sent) :] if content.startswith(self.content_sent) else ""
            self.content_sent += new
            chunk = _Piece(new, chunk.entry)
        return self.answer.on_chunk(chunk)

    def last_lines(self) -> list[dict[str, Any]]:
        """Streamed, before the final object: the last parse's pieces on their own line."""
        assert self.answer is not None
        return self.answer.last_pieces()

    def final(self, item: Finished) -> dict[str, Any]:
        assert self.answer is not None
        api = OLLAMA_KIND[self.job.prepared.kind]

        def issue(tally: Any) -> Mapping[str, Any]:
            return self.issue(tally, item.parsed, item.summary, api=api, stream=self.stream)

        return self.answer.final(
            item.summary,
            context=item.context,
            drop_last_entries=item.drop_last_entries,
            issue=issue,
        )


@dataclass(frozen=True)
class _Piece:
    text: str
    entry: Any


def _refusal(err: ApiError) -> OllamaError:
    body = err.body.get("error") if isinstance(err.body, dict) else None
    message = body.get("message") if isinstance(body, dict) else None
    return OllamaError(err.status, str(message or err))


def _completion_body(body: dict[str, Any], prompt: str) -> dict[str, Any]:
    """A chat body as llama-server's /completion body for ``prompt`` (generate with context)."""
    out = {k: v for k, v in body.items() if k not in ("messages", "response_format")}
    out["prompt"] = prompt
    fmt = body.get("response_format")
    if fmt is not None:
        out["json_schema"] = (fmt.get("json_schema") or {}).get("schema") or {}
    if out.pop("logprobs", None):
        out["n_probs"] = out.pop("top_logprobs", 1)
    return out


class OllamaHost:
    """The catalog, the residency and the engine behind Ollama's routes (see the module doc)."""

    def __init__(
        self,
        native: NativeEngine,
        catalog: Catalog,
        *,
        keep_alive: KeepAlive = DEFAULT,
        options: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        log: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.native = native
        self.catalog = catalog
        self.keep_alive = keep_alive
        self.options = dict(options or {})
        self.clock = clock
        self.log = log
        self.residency = Residency(self._open_model, self._unloaded, log)
        startup = catalog.registry.pins[0]
        now = clock()
        self.residency.resident = Resident(
            startup,
            native.verified,
            native.engine,
            loaded_at=now,
            expires_at=keep_alive.expires_at(now),
            shown_as=startup.name,
            context_length=native.n_ctx,
        )
        native.waker = self.wake
        native.used = self.used
        native.rewrite = self.layered_v1

    @property
    def bridge(self) -> Any:
        return self.native.bridge

    # -- listings (reactor thread) ---------------------------------------------------------------

    def root_text(self) -> str:
        return wire.ROOT_TEXT

    def version(self) -> dict[str, Any]:
        return wire.version_body()

    def unknown(self, method: str, path: str) -> OllamaError:
        """A route bankml refuses (400 with why) or does not have (404 with the routes)."""
        refused = wire.not_offered(path) if method == "POST" else None
        return refused or wire.unknown_route(method, path)

    def record(self, run: OllamaRun, summary: Any) -> None:
        """One finished answer into the engine's records (/bankml/metrics, /metrics)."""
        if run.answer is not None:
            tally = run.answer.tally
            kind = run.job.prepared.kind
            self.native.record(summary, tally.ttft_ms(), tally.wall_ms(), OLLAMA_KIND[kind])

    def tags(self) -> dict[str, Any]:
        return wire.tags_body(self.catalog)

    def ps(self) -> dict[str, Any]:
        now = self.clock()
        return wire.ps_body(
            self.residency.resident, self.catalog, self.residency.ps_expires_at(now)
        )

    def show(self, raw: bytes) -> dict[str, Any]:
        target = req.show_target(req.parse_body(raw), self.catalog)
        return wire.show_body(target, self.native.n_ctx, self.capabilities(target))

    def capabilities(self, target: Target) -> tuple[str, ...]:
        """What the target's chat template can do beyond completion (``tools``, ``thinking``):
        the resident engine's template where the target's pin is resident (the server's
        ``--chat-template-file`` among it), else the pin's own."""
        engine = self.native.engine
        template = getattr(engine, "template", None) if engine is not None else None
        resident = pin_of(target).sha256 == self.native.verified.sha256
        if template is not None and resident:
            found = wire.template_capabilities(template.source)
        else:
            found = wire.pin_capabilities(target)
        llama = (getattr(self, "options", None) or {}).get("llama") or {}
        if resident and (llama.get("embedding") or {}).get("enabled"):  # --embeddings
            found = (*found, "embedding")
        return found

    def embedding_model(self, name: Any, keep_alive: Any = None) -> Callable[[], None]:
        """On the prepare thread, for /api/embed and /api/embeddings: ``name`` resolves as a
        chat's model does (Ollama's 404 otherwise) and to the resident file, which alone
        embeds (OllamaError 400 for another); ``keep_alive`` is read as a chat's. Returns what
        the engine thread runs after the embedding: the request's keep-alive applied."""
        if not isinstance(name, str) or not name:
            raise OllamaError(400, "model is required")
        target = req._resolve({"model": name}, self.catalog)
        if pin_of(target).sha256 != self.native.verified.sha256:
            raise OllamaError(
                400,
                f"model {name!r} is not the one bankml serves embeddings with "
                f"({os.path.basename(self.native.verified.path)}, started with --embeddings)",
            )
        try:
            kept = parse_keep_alive(keep_alive, self.keep_alive)
        except BadKeepAlive as err:
            raise OllamaError(400, str(err)) from None
        pin_name = pin_of(target).name
        return lambda: self.residency.touch(pin_name, kept, self.clock())

    # -- derived models (the prepare thread: create verifies its base in full) -----------------

    def create(self, raw: bytes) -> tuple[bool, list[str]]:
        """``/api/create``: (streamed, its status lines); OllamaError when refused."""
        try:
            asked = registry_create.create_request(req.parse_body(raw))
            created = registry_create.create(
                asked.name,
                asked.spec,
                self.catalog,
                parsed_modelfile=asked.parsed_modelfile,
                n_ctx=self.native.n_ctx,
            )
        except registry_create.CreateError as err:
            raise OllamaError(err.status, err.message) from None
        for warning in created.warnings:
            self.log(warning)
        self._reload()
        return asked.stream, created.status

    def copy(self, raw: bytes) -> None:
        """``/api/copy``: the destination as a layer over the source (nothing added)."""
        try:
            source, destination = registry_create.copy_request(req.parse_body(raw))
            registry_create.copy(source, destination, self.catalog, n_ctx=self.native.n_ctx)
        except registry_create.CreateError as err:
            raise OllamaError(err.status, err.message) from None
        self._reload()

    def delete(self, raw: bytes) -> None:
        """``DELETE /api/delete``: a derived model's manifest removed (a pin is refused)."""
        try:
            registry_create.delete(
                registry_create.delete_request(req.parse_body(raw)), self.catalog
            )
        except registry_create.CreateError as err:
            raise OllamaError(err.status, err.message) from None
        self._reload()

    def _reload(self) -> None:
        self.catalog = self.catalog.reload(self.log)

    def layered_v1(self, body: dict[str, Any], kind: str) -> dict[str, Any]:
        """A /v1/chat/completions body naming a derived model, with its layer applied as on
        /api/chat: its system prompt and messages first, its parameters under the request's.
        Other names are left to llama-server's rule (the model field does not choose)."""
        name = body.get("model")
        if kind != CHAT or not isinstance(name, str):
            return body
        try:
            target = self.catalog.resolve(name)
        except LookupError:
            return body
        layer = layer_of(target)
        if layer is None:
            return body
        if pin_of(target).sha256 != self.native.verified.sha256:
            raise ApiError.of(
                400,
                f"{tag(target.name)} is a layer over {pin_of(target).file}, which is not the "
                "model loaded now; ask /api/chat for it (it loads its base first)",
            )
        out = dict(body)
        if isinstance(body.get("messages"), list):
            out["messages"] = req.layered_messages(list(body["messages"]), layer)
        for key, value in layer.parameters.items():
            v1_key = V1_PARAMETERS.get(key, key)
            if (
                v1_key
                and out.get(v1_key) is None
                and not (v1_key == "max_tokens" and out.get("max_completion_tokens") is not None)
            ):
                out[v1_key] = value
        if layer.stop and out.get("stop") is None:
            out["stop"] = list(layer.stop)
        return out

    # -- answers ---------------------------------------------------------------------------------

    def prepare(self, kind: str, raw: bytes, started_ns: int) -> Job:
        """On the prepare thread: every check of ``formats.ollama_request`` (OllamaError), then
        a derived model's manifest read again: one edited by hand since the catalog was read is
        refused (400, its reason), one made again is read anew."""
        body = req.parse_body(raw)
        prepared = req.prepare(
            kind,
            body,
            self.catalog,
            n_ctx=self.native.n_ctx,
            default_keep_alive=self.keep_alive,
            capabilities=self.capabilities,
        )
        problem = manifest_problem(prepared.target)
        if problem == MANIFEST_CHANGED:
            self.catalog = self.catalog.reload(self.log)
            return self.prepare(kind, raw, started_ns)
        if problem is not None:
            raise OllamaError(400, f"model {prepared.model!r} cannot be served: {problem}")
        return Job(prepared, raw, started_ns)

    def new_run(self, job: Job) -> OllamaRun:
        return OllamaRun(job, self.native.receipt)

    def load_or_unload(self, job: Job) -> dict[str, Any]:
        """On the engine thread: an empty request's one object (the model loaded or unloaded)."""
        p = job.prepared
        pin = pin_of(p.target)
        if p.unload:
            self.residency.unload(pin.name)
            return wire.load_object(p.kind, p.model, wire.rfc3339(self.clock()), True, 0)
        acquired = self._acquire(p.target)
        self.residency.touch(pin.name, p.keep_alive, self.clock())
        return wire.load_object(p.kind, p.model, wire.rfc3339(self.clock()), False, acquired)

    def run(self, job: Job) -> Callable[[Callable[[], bool]], Iterator[Any]]:
        """The bridge's ``steps`` for one answer: ``Ready``, the engine's token Steps,
        ``Finished``; a refusal raises OllamaError (before the first item when it can)."""

        def steps(cancelled: Callable[[], bool], forwards: bool = False) -> Iterator[Any]:
            p = job.prepared
            load_ns = self._acquire(p.target)
            engine = self.native.engine
            verified = self.native.verified
            kind, body = self._engine_body(engine, p)
            try:
                prompts = self.native.parse(body, kind)
            except ApiError as err:
                raise _refusal(err) from None
            parsed = prompts[0]
            constraint = getattr(parsed, "constraint", None)
            parser = getattr(parsed, "chat_parser", None) if p.parse_message else None
            yield Ready(load_ns, getattr(constraint, "kind", "") == "chat_schema", parser)
            try:
                run = self.native.steps(prompts, keep_alive=False)(cancelled, forwards)
                # the scheduler's logits go on into the run (prompt_steps' forwards)
                yield from relay_forwards(
                    run,
                    lambda step: (
                        step
                        if step.summary is None
                        else self._finished(engine, verified, p, parsed, step)
                    ),
                )
            except ApiError as err:
                raise _refusal(err) from None
            finally:
                self.residency.touch(pin_of(p.target).name, p.keep_alive, self.clock())

        steps.yields_forwards = True  # type: ignore[attr-defined]
        return steps

    def _finished(
        self, engine: Any, verified: Any, p: req.Prepared, parsed: Any, step: Step
    ) -> Finished:
        summary = step.summary
        word = getattr(summary, "stopping_word", "")
        drop = len(engine.tokenize(word)) if word else 0
        context = None
        if p.returns_context:
            context = list(parsed.prompt_tokens) + list(getattr(summary, "tokens", []) or [])
        return Finished(summary, parsed, drop, context, identity_problem(verified))

    def _engine_body(self, engine: Any, p: req.Prepared) -> tuple[str, dict[str, Any]]:
        """The body the engine parses: a chat (templated), or a completion (raw, or generate
        with ``context``, whose text comes before the templated prompt)."""
        body = dict(p.body)
        if p.engine_kind != "chat":
            return LLAMA_COMPLETION, body
        if p.num_ctx is not None:
            body["messages"] = self._fitted(engine, body["messages"], p.num_ctx)
        if p.context:
            text = engine.detokenize(p.context) + engine.apply_template(
                body["messages"], add_generation_prompt=True
            )
            return LLAMA_COMPLETION, _completion_body(body, text)
        return CHAT, body

    @staticmethod
    def _fitted(engine: Any, messages: list[Any], num_ctx: int) -> list[Any]:
        def count(msgs: list[Any]) -> int:
            text = engine.apply_template(msgs, add_generation_prompt=True)
            return len(engine.tokenize(text, add_special=True, parse_special=True))

        kept = req.fit_chat(messages, count, num_ctx)
        n = count(list(kept))
        if n > num_ctx:
            raise req.prompt_too_long(n, num_ctx)
        return list(kept)

    # -- residency (engine thread) ---------------------------------------------------------------

    def _acquire(self, target: Target) -> int:
        """Make ``target``'s pin resident (verified again when it is loaded); its load_ns."""
        pin = pin_of(target)
        try:
            acquired = self.residency.acquire(pin, self.clock(), target.name, self.native.n_ctx)
        except LoadError as err:
            raise OllamaError(err.status, err.message) from None
        stale = stale_layer(target, acquired.resident.verified.sha256)
        if stale is not None:
            raise OllamaError(400, f"{tag(target.name)}: {stale}")
        return acquired.load_ns

    def _open_model(self, verified: Any) -> Any:
        """Residency's loader: the verified file's engine, swapped into the NativeEngine (as
        many slots as the server has, each of the context its slots have)."""
        engine, _device = open_engine(
            verified.path,
            n_ctx=int(self.native.n_ctx),
            device=self.options.get("device") or "auto",
            cache_type=self.options.get("cache_type"),
            cache_ram=self.options.get("cache_ram"),
            n_slots=self.native.n_slots,
            kv_unified=True,  # n_ctx is already each slot's
        )
        # llama-server's server-wide flags hold for every load, as at start-up; its chat
        # template (--chat-template-file) is the startup model's
        llama = dict(self.options.get("llama") or {})
        if verified.sha256 != self.catalog.registry.pins[0].sha256:
            llama.pop("chat_template", None)
        apply_server_defaults(engine, llama)
        engine.warm_up(self.log)
        self.native.swap(engine, verified)
        return engine

    def _unloaded(self, resident: Resident, why: str) -> None:
        if self.native.engine is resident.handle:
            self.native.swap(None, self.native.verified)

    def wake(self) -> None:
        """On the engine thread, before a /v1 request: the startup model loaded again when
        nothing is resident (an unload or an expired keep-alive)."""
        if self.native.engine is None:
            startup: Pin = self.catalog.registry.pins[0]
            try:
                self._acquire(startup)
            except OllamaError as err:  # /v1 answers with llama-server's error object
                raise ApiError.of(err.status, err.message) from None
            self.residency.touch(startup.name, self.keep_alive, self.clock())

    def used(self) -> None:
        """On the engine thread, after a /v1 or llama-server run: the resident model's
        keep-alive starts again with the server's default, as after any Ollama request (so a
        server answering /v1 without pause never unloads its model)."""
        resident = self.residency.resident
        if resident is not None:
            self.residency.touch(resident.pin.name, self.keep_alive, self.clock())

    def expired(self) -> bool:
        return self.residency.expired(self.clock())

    def reap(self) -> None:
        """The reaper's step, on the engine thread (so after any running request)."""
        self.residency.reap(self.clock())


def make_host(
    native: NativeEngine, options: Mapping[str, Any], log: Callable[[str], None]
) -> OllamaHost:
    """The host ``bankml serve --native`` runs: the startup model first, then every pin of
    ``options["registry"]`` (None: the startup model alone) and its derived models, kept
    ``options["keep-alive"]`` after each answer (Ollama's 5m when absent)."""
    directory = options.get("registry")
    v = native.verified
    fork_path = v.fork_path
    if directory is not None:
        # the startup file pinned in the registry directory too (the same sha256): that fork
        # is its pin, so a derived model can be made over it
        found = registry_create._fork_pinning(directory, os.path.basename(v.path))
        if (
            found is not None
            and verify.pinned_sha256(found[1], os.path.basename(v.path)) == v.sha256
        ):
            fork_path = found[0]
    registry = discover(directory, [os.path.dirname(v.path)], (v.path, fork_path))
    catalog = Catalog.load(registry, directory, log)
    keep_alive = parse_keep_alive(options.get("keep-alive"))
    return OllamaHost(native, catalog, keep_alive=keep_alive, options=options, log=log)
