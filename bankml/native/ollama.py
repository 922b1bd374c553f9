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
- **Residency**: up to ``--max-loaded`` models resident (1 by default), each with its own
  engine (slots, KV cache, prompt cache), within ``--models-memory``. The engine of the model
  used last is the one ``NativeEngine`` reads outside a run; a run holds its own model's
  (``hold``), which is never unloaded under it. With more than one, a /v1 request's ``model``
  chooses its model too (``select``, on the prepare thread); with one, /v1 answers with the
  resident model whatever it names (llama-server's rule), and ``wake`` loads the startup model
  again for a /v1 request after an unload. ``reap`` is the reaper's step (a ``LoopingCall`` every second in
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
from bankml.formats.errors import RETRY_AFTER_S, ApiError
from bankml.formats.ollama import OllamaError
from bankml.gate import verify
from bankml.llama_server import DEFAULT_STOP_TIMEOUT
from bankml.native.embed import EmbedModel
from bankml.native.resident import apply_server_defaults, open_engine, training_context
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
from bankml.registry.pins import Pin, Registry, discover
from bankml.registry.residency import LoadError, Residency, Resident, kv_shape, models_memory
from bankml.serving import llama_flags, presets

if TYPE_CHECKING:
    from bankml.native.resident import NativeEngine
    from bankml.native.router import RouterModels


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


@dataclass(frozen=True)
class Choice:
    """The model a request was parsed for (``NativeEngine.parse`` tags its prompts with it):
    its pin's name, and what was verified of it."""

    name: str
    verified: Any
    model_id: str


def kv_bytes(path: str, n_ctx: int, cache_type: str | None = None) -> int:
    """The KV cache a model of ``path`` needs for ``n_ctx`` cells (every slot's together), as
    the engine holds it: per layer and cell ``head_count_kv * (key_length + value_length)``
    values, 4 bytes each for f16 and f32 (the engine keeps f16 values, rounded, in float32),
    34 bytes per 32 for q8_0; 0 where the header does not say."""
    shape = kv_shape(path)
    if shape is None:
        return 0
    n_layer, n_head_kv, k_len, v_len = shape
    per_value = 34 / 32 if cache_type == "q8_0" else 4.0
    return int(n_layer * n_ctx * n_head_kv * (k_len + v_len) * per_value)


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
        # the server's context: every model is opened with it (an encoder caps its own at its
        # training context, and NativeEngine.n_ctx follows the model used last)
        self.n_ctx = int(native.n_ctx)
        self.options = dict(options or {})
        self.clock = clock
        self.log = log
        max_loaded = int(self.options.get("max-loaded") or 1)
        self.residency = Residency(
            self._open_model,
            self._unloaded,
            log,
            max_loaded=max_loaded,
            budget=models_memory(self.options.get("models-memory")),
            need=self.need,
        )
        pins = catalog.registry.pins
        # (no pin at all: a router started on a directory pinning none, nothing resident)
        startup = pins[0] if pins else None
        now = clock()
        # (llama-server's router mode starts with none open)
        if native.engine is not None and startup is not None:
            self.residency.resident = Resident(
                startup,
                native.verified,
                native.engine,
                loaded_at=now,
                expires_at=keep_alive.expires_at(now),
                shown_as=startup.name,
                context_length=native.n_ctx,
                need=self.need(startup),
            )
        native.waker = self.wake
        native.used = self.used
        native.rewrite = self.layered_v1
        # llama-server's router: each model by its id (and aliases), its pin, or why refused
        self.router: presets.RouterPresets | None = self.options.get("presets")
        # router mode: a model whose last load failed -> the exit status llama-server's router
        # lists for a child that died loading (1), until it loads
        self.router_failed: dict[str, int] = {}
        self._route_models()
        self.router_events: RouterModels | None = None  # GET /models/sse's source
        if max_loaded > 1 or self.options.get("router"):
            # the /v1 model field chooses among the catalog's models (in router mode even with
            # one resident at most: each request loads the model it names, as llama-server's)
            native.select = self.select
            native.hold = self.hold
            native.stopping = self.stopping
            native.residents = self.residents

    def _route_models(self) -> None:
        """The router's tables from its presets and the catalog's pins: each model by its id
        (and aliases) to its id, each id to its pin or to why it is refused, each pin's name to
        its id."""
        self.router_pins: dict[str, Pin] = {}
        self.router_refused: dict[str, str] = {}
        self.router_names: dict[str, str] = {}  # an id or alias -> the model's id
        if self.router is not None:
            self.router_pins, self.router_refused = self.router.assign(self.catalog.registry.pins)
            for name, model in self.router.models.items():
                self.router_names.update({alias: name for alias in model.aliases})
                self.router_names[name] = name
        self.router_ids = {pin.name: name for name, pin in self.router_pins.items()}

    def reload_router(self) -> list[str]:
        """On the engine thread (after every running answer): the models directory and the
        preset read again (native/router.py says what changes); the ids of the resident models
        unloaded for it. ``PresetError`` when the preset no longer reads or gives a model a
        setting bankml refuses: then nothing changes."""
        old = self.router
        assert old is not None
        directory = self.options.get("registry")
        found = presets.load_presets(
            self.options.get("models-preset"), self.options.get("models-dir"), old.cli
        )
        try:
            llama_flags.check_model_settings(found, self.options)
        except llama_flags.FlagError as err:
            raise presets.PresetError(str(err)) from None
        catalog = Catalog.load(host_registry(self.native.verified, directory, found), directory)
        pins, _refused = found.assign(catalog.registry.pins)
        unloaded: list[str] = []
        for pin_name, resident in list(self.residency.residents.items()):
            model_id = self.router_ids.get(pin_name)
            now = pins.get(model_id) if model_id is not None else None
            if (
                model_id is None
                or now is None
                or now.sha256 != resident.pin.sha256
                or found.options_for(model_id) != old.options_for(model_id)
            ):
                self.residency.unload(pin_name)
                unloaded.append(model_id or pin_name)
        self.catalog, self.router = catalog, found
        self._route_models()
        if self.router_events is not None:
            self.router_events.notify("*", "models_reload", None)
        return unloaded

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
            model = pin_of(run.job.prepared.target).name if self.native.select else ""
            self.native.record(summary, tally.ttft_ms(), tally.wall_ms(), OLLAMA_KIND[kind], model)

    def tags(self) -> dict[str, Any]:
        return wire.tags_body(self.catalog)

    def ps(self) -> dict[str, Any]:
        """Every resident model, the most recently used first among equal expiries."""
        now = self.clock()
        residents = list(reversed(self.residency.residents.values()))
        entries = []
        for resident in residents:
            expires_at = self.residency.ps_expires_at(now, resident)
            if expires_at is not None:
                entries.append((resident, expires_at))
        return wire.ps_models_body(entries, self.catalog)

    def residents(self) -> dict[str, Any]:
        """/bankml/metrics' and /bankml/usage's view of each resident model (reactor thread):
        the bytes it was reckoned to need, the requests running on it, when it expires."""
        return {
            name: {
                "need_bytes": r.need,
                "in_use": r.in_use,
                "loaded_at": r.loaded_at,
                "expires_at": r.expires_at,
            }
            for name, r in list(self.residency.residents.items())
        }

    def need(self, pin: Pin) -> int:
        """The bytes ``pin`` needs resident: its file (the weights are read from it) and the KV
        cache of this server's context (``kv_bytes``)."""
        if pin.path is None:
            return int(pin.bytes or 0)
        try:
            size = os.path.getsize(pin.path)
            kv = kv_bytes(pin.path, self.n_ctx, self.options.get("cache_type"))
        except (OSError, ValueError):
            return int(pin.bytes or 0)
        return size + kv

    def show(self, raw: bytes) -> dict[str, Any]:
        target = req.show_target(req.parse_body(raw), self.catalog)
        return wire.show_body(target, self.n_ctx, self.capabilities(target))

    def capabilities(self, target: Target) -> tuple[str, ...]:
        """What the target's chat template can do beyond completion (``tools``, ``thinking``):
        the resident engine's template where the target's pin is resident (the server's
        ``--chat-template-file`` among it), else the pin's own."""
        engine = self.native.engine
        template = getattr(engine, "template", None) if engine is not None else None
        pin = pin_of(target)
        resident = pin.sha256 == self.native.verified.sha256
        if template is not None and resident:
            found = wire.template_capabilities(template.source)
        else:
            found = tuple(c for c in wire.pin_capabilities(target) if c != "embedding")
        if self.embeds(pin):
            found = (*found, "embedding")
        return found

    def embeds(self, pin: Pin) -> bool:
        """Whether /api/embed answers with ``pin``: a model that does not complete (Ollama's
        reading, ``pin_completes``: an encoder) always, another with --embeddings; neither
        with --rerank's pooling."""
        llama = (getattr(self, "options", None) or {}).get("llama") or {}
        embedding = llama.get("embedding") or {}
        if embedding.get("pooling") == "rank":
            return False
        return bool(embedding.get("enabled")) or not wire.pin_completes(pin)

    def embedding_model(self, name: Any, keep_alive: Any = None) -> EmbedModel:
        """On the prepare thread, for /api/embed and /api/embeddings: ``name`` resolves as a
        chat's model does (Ollama's 404 otherwise), ``keep_alive`` is read as a chat's. Returns
        what the engine thread runs: the model made resident as for a chat (verified again
        when it is loaded), and after the embedding the request's keep-alive applied."""
        if not isinstance(name, str) or not name:
            raise OllamaError(400, "model is required")
        target = req._resolve({"model": name}, self.catalog)
        try:
            kept = parse_keep_alive(keep_alive, self.keep_alive)
        except BadKeepAlive as err:
            raise OllamaError(400, str(err)) from None
        pin = pin_of(target)
        return EmbedModel(
            embeds=self.embeds(pin),
            load=lambda: self._acquire(target),
            after=lambda: self.residency.touch(pin.name, kept, self.clock()),
        )

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
                n_ctx=self.n_ctx,
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
            registry_create.copy(source, destination, self.catalog, n_ctx=self.n_ctx)
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
        if self.native.select is None and pin_of(target).sha256 != self.native.verified.sha256:
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
            n_ctx=self.n_ctx,
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
            resident = self.residency.get(pin_of(p.target).name)
            kind, body = self._engine_body(engine, p)
            choice = Choice(pin_of(p.target).name, verified, self.answer_name(verified.path))
            try:
                prompts = self.native.parse(body, kind, choice=(choice, engine))
            except ApiError as err:
                raise _refusal(err) from None
            parsed = prompts[0]
            constraint = getattr(parsed, "constraint", None)
            parser = getattr(parsed, "chat_parser", None) if p.parse_message else None
            yield Ready(load_ns, getattr(constraint, "kind", "") == "chat_schema", parser)
            if resident is not None:
                resident.in_use += 1  # never unloaded under this run (steps hold it too)
                self._started(resident)
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
                if resident is not None:
                    resident.in_use -= 1
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
        # /api/ps's context: the one the model's engine holds (an encoder's is capped at its
        # training context); a model not resident yet gets its engine's once it is loaded
        was = self.residency.get(pin.name)
        context = int(getattr(was.handle, "n_ctx", 0) or 0) if was is not None else 0
        try:
            acquired = self.residency.acquire(pin, self.clock(), target.name, context)
        except LoadError as err:
            refused = OllamaError(err.status, err.message)
            if err.busy:
                refused.retry_after = RETRY_AFTER_S
            raise refused from None
        here = acquired.resident
        if here.context_length == 0:
            here.context_length = int(getattr(here.handle, "n_ctx", 0) or self.n_ctx)
        if self.native.engine is not here.handle:
            self.native.swap(here.handle, here.verified)
        stale = stale_layer(target, here.verified.sha256)
        if stale is not None:
            raise OllamaError(400, f"{tag(target.name)}: {stale}")
        return acquired.load_ns

    # -- the /v1 model field, with more than one model resident ----------------------------------

    def _autoload(self, asked: bool | None) -> bool:
        """Whether a request may load the model it names: its ``?autoload=`` (true or 1; any
        other value false), else the server's (``--no-models-autoload``: no)."""
        if asked is not None:
            return asked
        return bool(self.options.get("autoload", True))

    def select(self, body: Mapping[str, Any], autoload: bool | None = None) -> tuple[Choice, Any]:
        """On the prepare thread: the model a /v1 body names (blank: the startup model) and its
        engine, to parse with: a resident one at once, another made resident on the engine
        thread (in turn with the runs). Unknown: 404 (in router mode llama-server's router's
        400); refused: its status. An --alias name is the startup model's."""
        name = body.get("model")
        if isinstance(name, str) and name in self.native.model_aliases:
            name = None
        routed = self.router_names.get(name) if isinstance(name, str) else None
        try:
            if routed is not None and routed in self.router_refused:
                raise ApiError.of(400, self.router_refused[routed])
            if routed is not None:
                target: Target = self.router_pins[routed]
            else:
                target = self.catalog.resolve(name if isinstance(name, str) else None)
        except LookupError as err:
            if self.options.get("router"):
                raise ApiError.of(400, f"model '{name}' not found") from None
            raise ApiError.of(404, str(getattr(err, "message", None) or err)) from None
        pin = pin_of(target)
        here = self.residency.get(pin.name)
        if here is None and not self._autoload(autoload):
            # llama-server's router with --no-models-autoload (or ?autoload=false)
            raise ApiError.of(400, "model is not loaded")
        if here is not None and self.residency.unchanged(here):
            # resident: parsed at once, not behind the runs (the run holds it, hold)
            stale = stale_layer(target, here.verified.sha256)
            if stale is not None:
                raise ApiError.of(400, f"{tag(target.name)}: {stale}")
            v = here.verified
            return Choice(pin.name, v, self.answer_name(v.path)), here.handle

        def load() -> tuple[Choice, Any]:
            try:
                self._acquire(pin)
            except OllamaError as err:
                raise _api_error(err) from None
            here = self.residency.get(pin.name)
            assert here is not None
            self.residency.touch(pin.name, self.keep_alive, self.clock())
            v = here.verified
            return Choice(pin.name, v, self.answer_name(v.path)), here.handle

        bridge = self.bridge
        if bridge is not None and bridge.can_wait_on():
            # router mode: beside the other models' runs once its room can be made from idle
            # models; a generating model is never stopped for room (llama-server's router
            # waits for its request to end too)
            if self.options.get("router"):
                return bridge.call_and_wait(load, beside_runs=self.room_ready(pin))
            return bridge.call_and_wait(load)
        return load()

    def answer_name(self, path: str) -> str:
        """The model an answer names: its file's name (llama-server's router: without .gguf,
        the alias it starts each model's child with)."""
        file = os.path.basename(path)
        if not self.options.get("router"):
            return file
        real = os.path.realpath(path)
        for name, pin in self.router_pins.items():
            if pin.path is not None and os.path.realpath(pin.path) == real:
                return name
        return _router_id(file)

    def hold(self, choice: Choice) -> tuple[Any, Callable[[], None]]:
        """On the engine thread, as a run parsed for ``choice`` starts: its model's engine
        (loaded again, verified again, if it was unloaded while the run waited), held until the
        returned release is called (never unloaded under the run)."""
        pin = self.catalog.registry.by_name(choice.name)
        if pin is None:
            raise ApiError.of(404, f"{choice.name}: no longer in the registry")
        try:
            self._acquire(pin)
        except OllamaError as err:
            raise _api_error(err) from None
        here = self.residency.get(pin.name)
        assert here is not None
        if here.verified.sha256 != choice.verified.sha256:
            raise ApiError.of(  # sent again, it is checked against this one
                503,
                f"{pin.file} is not the file this request was checked against",
                retry_after=RETRY_AFTER_S,
            )
        here.in_use += 1
        self._started(here)

        def release() -> None:
            here.in_use -= 1
            if here.in_use == 0:  # its generations ended: an armed stop-timeout is moot
                here.stopping = None
                timer, here.stop_timer = here.stop_timer, None
                reactor = self.native.reactor
                if timer is not None and reactor is not None:
                    reactor.callFromThread(_disarm, timer)
            self.residency.touch(pin.name, self.keep_alive, self.clock())

        return here.handle, release

    def stopping(self, choice: Choice) -> str | None:
        """Polled by a run on ``choice``'s model, each step: why it is being stopped (its
        model's unload outlasted its stop-timeout: ``arm_stop``), None while it may go on."""
        here = self.residency.get(choice.name)
        return here.stopping if here is not None else None

    def stop_timeout_of(self, pin: Pin) -> float:
        """Router mode's stop-timeout of ``pin``'s model: its preset's ``stop-timeout`` (as
        llama-server's router reads it: an unreadable one is the default 10), else the
        server's ``--stop-timeout`` (10 when not given, llama-server's default)."""
        name = self.router_ids.get(pin.name)
        model = self.router.models.get(name) if self.router is not None and name else None
        given = model.given.get("stop-timeout") if model is not None else None
        if given is not None:
            try:
                return float(int(given))
            except ValueError:
                return float(DEFAULT_STOP_TIMEOUT)
        return float(self.options.get("stop_timeout", DEFAULT_STOP_TIMEOUT))

    def room_ready(self, pin: Pin) -> Callable[[], bool]:
        """When a load of ``pin`` may run beside other models' runs (asked on the engine
        thread, ``EngineBridge.call_beside_runs``): once its room can be made by unloading
        idle models only (``Residency.room_now``). Its bytes are reckoned there, once, the
        first time the model is not resident (reading its header off the reactor thread)."""
        need: list[int] = []

        def ready() -> bool:
            if self.residency.get(pin.name) is not None:
                return True
            if not need:
                need.append(self.need(pin))
            return self.residency.room_now(pin, need[0])

        return ready

    def idle_ready(self, pin: Pin) -> Callable[[], bool]:
        """When an unload of ``pin`` may run beside other models' runs: once no run holds it."""

        def idle() -> bool:
            here = self.residency.get(pin.name)
            return here is None or here.in_use == 0

        return idle

    def arm_stop(self, here: Resident, why: str, token: object) -> None:
        """On the reactor thread, when ``here`` is to be unloaded (``why``) by a job queued on
        the engine thread (``token``, until ``settle(token)``): its stop-timeout armed if it
        generates now, else as soon as a generation starts on it before that job runs (a
        request queued before the unload: ``_started``). When the timeout runs out with a
        generation still running on the model, that generation ends at its next step and is
        answered with a 503 (the job, queued behind it, then goes on)."""
        here.awaited[token] = why
        self._arm(here, why)

    def settle(self, token: object) -> None:
        """On the reactor thread, once the job ``token`` was queued for has run: no model
        awaits it any more, and a stop-timeout left armed for it alone is cancelled."""
        for here in self.residency.residents.values():
            if here.awaited.pop(token, None) is not None and not here.awaited:
                timer, here.stop_timer = here.stop_timer, None
                if timer is not None:
                    _disarm(timer)

    def _started(self, here: Resident) -> None:
        """On the engine thread, as a generation starts holding ``here``: when an unload of it
        is queued and has not run yet, its stop-timeout is armed (on the reactor thread)."""
        reactor = self.native.reactor
        if here.awaited and reactor is not None:
            reactor.callFromThread(self._arm_awaited, here)

    def _arm_awaited(self, here: Resident) -> None:
        if here.awaited:
            self._arm(here, next(iter(here.awaited.values())))

    def _arm(self, here: Resident, why: str) -> None:
        """``here``'s stop-timeout armed when it generates; nothing when no reactor runs or one
        is armed; disarmed when its last generation ends first (``hold``'s release)."""
        reactor = self.native.reactor
        if reactor is None or here.stop_timer is not None or here.in_use == 0:
            return
        timeout = self.stop_timeout_of(here.pin)
        name = self.answer_name(here.pin.path or here.verified.path)

        def fire() -> None:
            here.stop_timer = None
            if here.in_use > 0:
                self.log(f"{name}: stop-timeout of {timeout:g} s ran out ({why}): stopping it")
                here.stopping = (
                    f"model '{name}' was unloaded ({why}) and its stop-timeout of {timeout:g} s "
                    "ran out: this generation was stopped; send the request again"
                )

        here.stop_timer = reactor.callLater(timeout, fire)

    def _open_model(self, verified: Any) -> Any:
        """Residency's loader: the verified file's engine, swapped into the NativeEngine (as
        many slots as the server has, each of the context its slots have)."""
        own = self._router_options(verified)
        name = self.answer_name(verified.path)
        if self.router_events is None:
            return self._opened(verified, own)
        self.router_events.notify(name, "model_status", {"status": "loading"})
        self.router_failed.pop(name, None)
        try:
            engine = self._opened(verified, own)
        except Exception:
            # as llama-server's router sees a child die while it loads: unloaded, failed
            self.router_failed[name] = 1
            self.router_events.notify(name, "status_change", {"status": "unloaded", "exit_code": 1})
            raise
        info = self.router_events.info(name, engine, verified)
        self.router_events.notify(name, "status_change", {"status": "loaded", "info": info})
        return engine

    def _opened(self, verified: Any, own: dict[str, Any] | None) -> Any:
        """The verified file's engine, warmed up: the server's options, or in router mode
        the model's own (``own``)."""
        if own is None:
            n_ctx, kv_unified = self.n_ctx, True  # n_ctx is already each slot's
            # llama-server's server-wide flags hold for every load, as at start-up; its chat
            # template (--chat-template-file) is the startup model's
            llama = dict(self.options.get("llama") or {})
            pins = self.catalog.registry.pins
            if not pins or verified.sha256 != pins[0].sha256:
                llama.pop("chat_template", None)
        else:  # router mode: the model's own options (its preset's, the command line's over)
            llama = llama_flags.native_settings({**self.options, **own})
            n_ctx = int(own.get("ctx") or 0) or training_context(verified.path)
            kv_unified = bool(llama.get("kv_unified", False))
        engine, _device = open_engine(
            verified.path,
            n_ctx=n_ctx,
            device=self.options.get("device") or "auto",
            cache_type=self.options.get("cache_type"),
            cache_ram=self.options.get("cache_ram"),
            n_slots=self.native.n_slots,
            kv_unified=kv_unified,
        )
        apply_server_defaults(engine, llama)
        engine.warm_up(self.log)
        return engine

    def _router_options(self, verified: Any) -> dict[str, Any] | None:
        """In router mode, ``bankml serve``'s options of the model served from ``verified``
        (serving/presets.py ``options_for``); None otherwise."""
        if self.router is None:
            return None
        name = self.answer_name(verified.path)
        return self.router.options_for(name) if name in self.router_pins else None

    def _unloaded(self, resident: Resident, why: str) -> None:
        """The engine NativeEngine reads: the most recently used model left, else none."""
        if self.router_events is not None and resident.verified is not None:
            name = self.answer_name(resident.verified.path)
            self.router_events.notify(name, "status_change", {"status": "unloaded", "exit_code": 0})
        if self.native.engine is resident.handle:
            here = self.residency.resident
            if here is not None:
                self.native.swap(here.handle, here.verified)
            else:
                self.native.swap(None, self.native.verified)

    def wake(self) -> None:
        """On the engine thread, before a /v1 request: the startup model loaded again when
        nothing is resident (an unload or an expired keep-alive)."""
        pins = self.catalog.registry.pins
        if self.native.engine is None and pins:  # (none: a router with no pinned model)
            startup: Pin = pins[0]
            try:
                self._acquire(startup)
            except OllamaError as err:  # /v1 answers with llama-server's error object
                raise ApiError.of(err.status, err.message) from None
            self.residency.touch(startup.name, self.keep_alive, self.clock())

    def used(self) -> None:
        """On the engine thread, after a /v1 or llama-server run: the model used last gets its
        keep-alive started again with the server's default, as after any Ollama request (so a
        server answering /v1 without pause never unloads its model)."""
        resident = self.residency.resident
        if resident is not None:
            self.residency.touch(resident.pin.name, self.keep_alive, self.clock())

    def expired(self) -> bool:
        return self.residency.expired(self.clock())

    def reap(self) -> None:
        """The reaper's step, on the engine thread (so after any running request)."""
        self.residency.reap(self.clock())


def _disarm(timer: Any) -> None:
    """A stop-timeout that has not run yet, cancelled (on the reactor thread)."""
    if timer.active():
        timer.cancel()


def _router_id(file: str) -> str:
    """llama-server's router names a model of its directory by its file name without .gguf."""
    return file[: -len(".gguf")] if file.lower().endswith(".gguf") else file


def _api_error(err: OllamaError) -> ApiError:
    """An Ollama refusal as /v1 answers it (llama-server's error object, the same status)."""
    out = ApiError.of(err.status, err.message)
    out.retry_after = err.retry_after
    return out


def make_host(
    native: NativeEngine, options: Mapping[str, Any], log: Callable[[str], None]
) -> OllamaHost:
    """The host ``bankml serve --native`` runs: the startup model first, then every pin of
    ``options["registry"]`` (None: the startup model alone) and its derived models, kept
    ``options["keep-alive"]`` after each answer (Ollama's 5m when absent). No startup model
    (``native.verified`` None: a router on a directory pinning none): the directory's pins."""
    directory = options.get("registry")
    registry = host_registry(native.verified, directory, options.get("presets"))
    catalog = Catalog.load(registry, directory, log)
    keep_alive = parse_keep_alive(options.get("keep-alive"))
    return OllamaHost(native, catalog, keep_alive=keep_alive, options=options, log=log)


def host_registry(v: Any, directory: str | None, router: presets.RouterPresets | None) -> Registry:
    """The pins a host serves: the verified startup file ``v`` first (None: a router on a
    directory pinning none, the directory's pins alone), the registry directory's, and in
    router mode each preset model's pinned beside its file outside the directory."""
    registry = discover(directory) if v is None else _with_startup(v, directory)
    if router is not None:
        registry = Registry(registry.pins + router.outside_pins(registry.pins))
    return registry


def _with_startup(v: Any, directory: str | None) -> Registry:
    """The registry directory's pins with the verified startup file first."""
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
    return discover(directory, [os.path.dirname(v.path)], (v.path, fork_path))
