"""The resident engine as the serving layer sees it: ``NativeEngine``.

Built once after verify passed and the engine opened (bankml/native/service.py), or by
``bankml.api.open_native``; every native resource and ``bankml.chat`` read it. It holds the
engine (``bankml.engine_cupy.engine.Engine``, or a test double with the same methods), its
bridge (None outside a server), what was verified, and the per-completion records; and it is
the one door from the serving layer into the engine: the jobs the resources hand to the bridge
(``parse``, ``steps``, the text and slot jobs) turn the engine's refusals into ``ApiError``.

No Twisted. It imports the engine, so in a server it is first imported on the engine thread
(native/service.py says why).
"""

from __future__ import annotations

import copy
import os
import sys
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from bankml.engine_cupy import backend, slots
from bankml.engine_cupy.checkpoints import N_BATCH
from bankml.engine_cupy.encoder_engine import EncoderEngine, is_encoder
from bankml.engine_cupy.engine import DEFAULT_SLOT_PROMPT_SIMILARITY, Engine, compile_kernels
from bankml.engine_cupy.file_type import file_ftype_name
from bankml.engine_cupy.gguf_file import read_metadata
from bankml.engine_cupy.rank_head import rank_head
from bankml.engine_cupy.request import RequestError
from bankml.engine_cupy.sampler import DEFAULT_SEED, SamplerParams
from bankml.engine_cupy.speculative import drafters
from bankml.engine_cupy.weights import UnsupportedModel
from bankml.formats.errors import RETRY_AFTER_S, ApiError, error_object, refusal_of
from bankml.formats.llama import DefaultTask, MetricsScrape, Props, slot_object
from bankml.formats.openai import ModelFacts
from bankml.formats.slot_view import SlotView
from bankml.native import text
from bankml.native.run import prompt_steps
from bankml.receipts.convert import ConversionError, to_chat
from bankml.receipts.keys import SigningKey
from bankml.receipts.kinds import CHAT, CONVERTED, ENGINE_KIND, MESSAGES
from bankml.receipts.log import ReceiptLog
from bankml.receipts.sign import native_facts, pin_seed
from bankml.receipts.tally import Tally
from bankml.receipts.vouch import identity_problem, issue_receipt
from bankml.version import __version__

if TYPE_CHECKING:
    from bankml.native.bridge import EngineBridge

T = TypeVar("T")

DEFAULT_CTX = 4096
# a router started with no pinned model: its name and path where one model's are shown
# (llama-server's router's /props says model_path "none" too)
NO_MODEL = "none"
WINDOW_KEYS = ("prompt_tokens", "prompt_seconds", "steps", "predicted_seconds")


def _refusing(fn: Callable[..., T], *args: Any) -> T:
    """A text or slot job, its refusal as llama-server answers it: its own message, its status
    (400 unless the error names another)."""
    try:
        return fn(*args)
    except (ValueError, TypeError, KeyError) as err:
        status = int(getattr(err, "status", 400))
        raise ApiError.of(status, str(err.args[0] if err.args else err)) from None


def _cache_type_of(engine: Any) -> str:
    """The KV cache type an engine computes with (f16 for a test double without a cache)."""
    return str(getattr(getattr(engine, "cache", None), "cache_type", None) or "f16")


class NativeEngine:
    """The resident engine, its bridge, what was verified, and the per-completion records.

    Built once by native_service after verify passed and the engine opened; every native resource
    (openai.py, llama.py, bankml.py's /bankml) and api.py read it. ``engine`` is
    ``bankml.engine_cupy.engine.Engine`` (or a test double with the same methods).
    """

    METRICS_KEEP = 256

    def __init__(
        self,
        engine: Any,
        bridge: EngineBridge | None,
        verified: Any,
        *,
        slot_dir: str | None = None,
        n_ctx: int | None = None,
        device: str = "cpu",
        reactor: Any = None,
        receipt_key: SigningKey | None = None,
        aliases: Sequence[str] = (),
        tags: Sequence[str] = (),
        n_slots: int | None = None,
    ) -> None:
        self.engine = engine
        self.receipt_key = receipt_key  # signs every receipt; None: unsigned (the Python API)
        self.receipt_log: ReceiptLog | None = None  # --receipt-log: every receipt appended
        self.bridge = bridge
        self.verified = verified
        self.slot_dir = slot_dir
        self.n_ctx = int(n_ctx if n_ctx is not None else getattr(engine, "n_ctx", 0))
        self.cache_type = _cache_type_of(engine)  # kept: a receipt may outlive an unload
        self.device = device
        self.reactor = reactor
        # llama-server's model name: the first of its --alias names, else the file's name
        self.model_aliases = list(aliases)
        self.model_tags = list(tags)  # --tags, listed in /v1/models
        # (None verified: a router started with no pinned model, none of its own to name)
        self.model_id = (
            self.model_aliases[0]
            if aliases
            else os.path.basename(verified.path)
            if verified is not None
            else NO_MODEL
        )
        # llama-server's name for the file's type (general.file_type), read once from the header
        self.model_ftype = file_ftype_name(verified.path) if verified is not None else ""
        self.build_info = f"bankml {__version__} native"
        self.engine_name = f"bankml {__version__} native ({device})"
        self.started = time.time()
        self.records: list[dict[str, Any]] = []
        self.totals: dict[str, Any] = {
            "requests": 0,
            "prompt_tokens": 0,
            "prompt_seconds": 0.0,
            "tokens_predicted": 0,
            "predicted_seconds": 0.0,
            "decode_calls": 0,
            "n_tokens_max": 0,
            "prompt_tokens_cached": 0,
        }
        # llama-server's rate buckets: what /metrics' two throughput gauges average over, since
        # the last scrape (prompt tokens and seconds, generation decode steps and seconds)
        self.window = dict.fromkeys(WINDOW_KEYS, 0.0)
        # what GET /slots shows of each slot (updated on the reactor thread)
        slots_of = n_slots if n_slots is not None else getattr(engine, "n_slots", 1)
        self.slot_views = [SlotView() for _ in range(int(slots_of))]
        self._lock = threading.Lock()
        self._tensor_totals: tuple[int | None, int | None] | None = None
        # set by the Ollama host (native/ollama.py): on the engine thread, loads the startup
        # model again after an unload
        self.waker: Callable[[], None] | None = None
        # set by the Ollama host too: on the engine thread, after a /v1 or llama-server run,
        # the resident model's keep-alive starts again (as every request that uses it does)
        self.used: Callable[[], None] | None = None
        # set by the Ollama host too: a /v1 chat naming a derived model gets its layer
        self.rewrite: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
        # set by the Ollama host with --max-loaded above 1: on the prepare thread, the model a
        # /v1 body names made resident, (its Choice, its engine) to parse with ...
        # the model a body names, and its engine (``autoload``: a request's ?autoload=)
        self.select: Callable[[dict[str, Any], bool | None], tuple[Any, Any]] | None = None
        # ... and on the engine thread, as a run parsed for a Choice starts: (its model's
        # engine, the release to call when the run ends); never unloaded in between
        self.hold: Callable[[Any], tuple[Any, Callable[[], None]]] | None = None
        # ... and, polled during the run: why its model's generations are being stopped (router
        # mode's stop-timeout ran out on an unload), None while they may go on
        self.stopping: Callable[[Any], str | None] | None = None
        # ... and the resident models as /bankml/metrics lists them (their memory, their use)
        self.residents: Callable[[], dict[str, Any]] | None = None
        # with several models: each model's own requests and tokens (pin name -> counts)
        self.per_model: dict[str, dict[str, int]] = {}

    @property
    def slot(self) -> SlotView:
        """Slot 0's view (a one-slot server's only one)."""
        return self.slot_views[0]

    @property
    def n_slots(self) -> int:
        return len(self.slot_views)

    def view_for(self, item: Any) -> SlotView | None:
        """The view of the slot an engine item (a Chunk, Progress or Summary) came from; with
        one slot always slot 0's; None while the run has not reached its slot."""
        if len(self.slot_views) == 1:
            return self.slot_views[0]
        slot = int(getattr(item, "slot", -1)) if item is not None else -1
        return self.slot_views[slot] if 0 <= slot < len(self.slot_views) else None

    @property
    def asleep(self) -> bool:
        """No model is resident (Ollama's keep_alive unloaded it)."""
        return self.engine is None

    def wake(self) -> None:
        """On the engine thread: the startup model resident again (verified again first)."""
        if self.engine is None and self.waker is not None:
            self.waker()

    def _awake(self) -> None:
        """On the prepare thread, before a job that reads the engine: after an unload, the
        model is loaded again on the engine thread (in turn with the runs) and waited for."""
        bridge = self.bridge
        if self.engine is None and self.waker is not None and bridge and bridge.can_wait_on():
            if threading.current_thread() is bridge.engine.thread:
                self.wake()  # already in turn (waiting on itself would never end)
            else:
                bridge.call_and_wait(self.wake)

    def swap(self, engine: Any, verified: Any) -> None:
        """On the engine thread: ``engine`` (opened on ``verified``) answers from now on; None
        when the model was unloaded (``verified`` stays the last one, for /bankml)."""
        self.engine = engine
        self.verified = verified
        self._tensor_totals = None
        if engine is not None:
            self.n_ctx = int(getattr(engine, "n_ctx", self.n_ctx))
            self.cache_type = _cache_type_of(engine)
            self.model_id = os.path.basename(verified.path)
            self.model_ftype = file_ftype_name(verified.path)

    def pinned(self, engine: Any, verified: Any) -> NativeEngine:
        """A view of this NativeEngine that reads ``engine`` (opened on ``verified``) whatever
        model the server swaps in later: what a router-mode route reads once the gate resolved
        the model its request names (resources/router.py ``RouterGate``), so a request for
        another model made current meanwhile (``--models-max`` above 1) cannot change the
        engine it reads. The records, totals, slot views and bridge are this one's (shared);
        the metrics scrape is this one's too (its rate window restarts here); it never wakes
        another model."""
        view = copy.copy(self)
        NativeEngine.swap(view, engine, verified)
        view.waker = None
        view.scrape = self.scrape  # type: ignore[method-assign]
        return view

    def token_count(self, text: str) -> int:
        """How many tokens the resident model's tokenizer makes of ``text`` (a stop word)."""
        return len(self.engine.tokenize(text))

    def tensor_totals(self) -> tuple[int | None, int | None]:
        """(parameters, tensor bytes) of the resident model, from its GGUF header (what
        llama-server's /v1/models calls n_params and size); None without a header to read."""
        if self._tensor_totals is None:
            reader = getattr(getattr(self.engine, "model", None), "reader", None)
            tensors = list(getattr(reader, "tensors", None) or [])
            self._tensor_totals = (
                (sum(int(t.n_elements) for t in tensors), sum(int(t.n_bytes) for t in tensors))
                if tensors
                else (None, None)
            )
        return self._tensor_totals

    # --- checks ----------------------------------------------------------------------------

    def identity_problem(self) -> str | None:
        """None while the file is the one that was hashed (FileIdent: device, inode, size, mtime);
        None too with no file at all (a router started with no pinned model: each model's
        own view, ``pinned``, checks its own file)."""
        return identity_problem(self.verified) if self.verified is not None else None

    def receipt(
        self, tally: Tally, parsed: Any, summary: Any, *, api: str, stream: bool
    ) -> dict[str, Any]:
        """The receipt of one finished answer of this engine: ``parsed`` is the prompt's engine
        Request (seed pinned by ``parse``), ``summary`` its run's Summary."""
        chosen = served_by(parsed)
        verified = self.verified if chosen is None else chosen.verified
        facts = None
        if self.receipt_key is not None:
            facts = native_facts(
                parsed,
                summary,
                api=api,
                stream=stream,
                n_ctx=self.n_ctx,
                cache_type=self.cache_type,
                device=self.device,
                finish_reason=tally.finish_reason,
            )
        out = issue_receipt(tally, verified, self.engine_name, facts=facts, key=self.receipt_key)
        if self.receipt_log is not None:
            self.receipt_log.append(out)
        return out

    # --- the jobs the resources hand to the bridge (refusals raise ApiError) ------------------

    def parse(
        self,
        body: dict[str, Any],
        kind: str,
        choice: tuple[Any, Any] | None = None,
        autoload: bool | None = None,
    ) -> list[Any]:
        """The engine's validation of a body, before a token is computed: the request's answers
        in llama-server's task order (each prompt, a chat's one or a completion's several, then
        its ``n_cmpl - 1`` more completions: ``completions``), each with the seed it will run
        with (a request that named none gets one drawn now, so that its receipt can name it).

        With several models resident, each answer is tagged with the model it was parsed for
        (``served_by``: ``choice``, an Ollama run's, else the model the body names, made
        resident by ``select``); ``steps`` runs it on that model's engine, its receipt names
        that model's file."""
        if choice is None and self.select is not None and kind not in CONVERTED:
            choice = self.select(body, autoload)
        if choice is None:
            self._awake()
        engine = self.engine if choice is None else choice[1]
        asked, asked_kind = body, kind  # as the slot monitor shows a task
        if self.rewrite is not None:
            body = self.rewrite(body, kind)
        if kind in CONVERTED:  # llama-server runs a Responses or Messages request as a chat
            body, kind = chat_of(kind, body), CHAT
            if self.select is not None and choice is None:
                choice = self.select(body, autoload)
                engine = choice[1]
        try:
            if kind == CHAT:
                prompts = [engine.parse_request(body, ENGINE_KIND[kind])]
            else:
                prompts = engine.parse_batch(body, ENGINE_KIND[kind])
        except RequestError as err:
            if err.refused:  # tasks started, then refused on the slot: /slots shows them
                self._on_reactor(self.refused_tasks, asked_kind, asked, err.refused)
            raise refusal_of(err) from None
        out = [pin_seed(c) for p in prompts for c in completions(p)]
        if choice is not None and self.hold is not None:
            for parsed in out:
                parsed.served_by = choice[0]
        elif choice is None:
            for parsed in out:  # the model it was read for, should it be unloaded meanwhile
                parsed.read_for = (engine, self.verified)
        return out

    def _engine_for(self, engine: Any, read_for: tuple[Any, Any] | None) -> Any:
        """On the engine thread, as a run starts: the engine to run prompts read by ``engine``.
        The keep-alive may have unloaded that model after the request was read (the reaper's
        unload queued before the run): it is loaded again first, in turn, as a request that
        arrives after the unload loads it, and the run goes on on the same file's engine, as
        Ollama never unloads a model a request is waiting for. Another model made current
        meanwhile (an Ollama request) is a 503 to send again."""
        if self.engine is None and read_for is not None:
            self.wake()
        read_file = read_for[1] if read_for is not None else None
        same_file = (
            read_file is not None and getattr(self.verified, "sha256", None) == read_file.sha256
        )
        if self.engine is not None and (self.engine is engine or same_file):
            return self.engine
        raise ApiError.of(
            503,
            "the model was switched while this request waited; send it again",
            retry_after=RETRY_AFTER_S,
        )

    def steps(
        self, prompts: list[Any], keep_alive: bool = True, first_index: int = 0
    ) -> Callable[..., Generator[Any, Any, None]]:
        """The bridge's ``steps`` for parsed prompts (their Steps numbered from
        ``first_index``): ``prompt_steps`` (its ``forwards`` mode too), an engine refusal
        during the run raised as ApiError. After the run the model's keep-alive starts again
        (``used``), unless ``keep_alive`` is False (Ollama's routes apply the request's own)."""
        engine = self.engine
        chosen = served_by(prompts[0]) if prompts else None
        read_for = getattr(prompts[0], "read_for", None) if prompts else None
        if read_for is not None:
            engine = read_for[0]

        def steps(
            cancelled: Callable[[], bool], forwards: bool = False
        ) -> Generator[Any, Any, None]:
            release: Callable[[], None] | None = None
            if chosen is not None and self.hold is not None:
                # its own model's engine, loaded again if it was unloaded while this waited
                run_on, release = self.hold(chosen)
            else:
                run_on = self._engine_for(engine, read_for)
            stopping = self.stopping if chosen is not None and release is not None else None

            def until() -> bool:
                # router mode's stop-timeout: the run ends at its next step once its model's
                # unload ran out of patience, and is answered with a 503 (no receipt)
                return cancelled() or (stopping is not None and stopping(chosen) is not None)

            try:
                try:
                    yield from prompt_steps(run_on, prompts, first_index)(until, forwards)
                except RequestError as err:
                    raise refusal_of(err) from None
                stopped = stopping(chosen) if stopping is not None else None
                if stopped is not None and not cancelled():
                    raise ApiError.of(503, stopped)
            finally:
                if release is not None:
                    release()
                elif keep_alive and self.used is not None:
                    self.used()

        steps.yields_forwards = True  # type: ignore[attr-defined]
        return steps

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self._awake()
        return _refusing(text.tokenize_answer, self.engine, body)

    def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self._awake()
        return _refusing(text.detokenize_answer, self.engine, body)

    def apply_template(self, body: dict[str, Any]) -> dict[str, Any]:
        self._awake()
        return _refusing(text.apply_template_answer, self.engine, body)

    def input_tokens(self, body: dict[str, Any], kind: str = CHAT) -> dict[str, Any]:
        """llama-server's token count of a chat, Responses or Messages request's prompt."""
        chat = chat_of(kind, body) if kind in CONVERTED else body
        out = _refusing(text.input_tokens_answer, self.engine, chat)
        if kind == MESSAGES:  # Anthropic's count names no object
            del out["object"]
        return out

    def slots(self, views: Sequence[SlotView]) -> list[dict[str, Any]]:
        """On the prepare thread: GET /slots for copies of the slots' views, one entry per slot
        in id order (a chat's generation prompt is the template's, rendered here)."""
        out = []
        engine_slots = getattr(self.engine, "slots", None)
        for id_slot, view in enumerate(views):
            prompt, n_prompt_tokens = "", 0
            if view.parsed is not None:
                if view.kind == CHAT:
                    prompt = _refusing(self._generation_prompt, view.body)
                elif view.kind in CONVERTED:
                    prompt = _refusing(self._generation_prompt, chat_of(view.kind, view.body))
                n_prompt_tokens = (
                    len(engine_slots[id_slot].tokens)
                    if engine_slots is not None
                    else len(getattr(self.engine, "slot_tokens", None) or [])
                )
            out.append(
                slot_object(
                    view,
                    id_slot=id_slot,
                    n_ctx=self.n_ctx,
                    n_prompt_tokens=n_prompt_tokens,
                    generation_prompt=prompt,
                    speculative=self.engine.speculative is not None,
                )
            )
        return out

    def props(self) -> Props:
        """What /props shows of the server and the resident model."""
        engine = self.engine
        template = getattr(engine, "template", None)
        caps = getattr(template, "caps", None)
        return Props(
            defaults=getattr(engine, "defaults", None),
            n_ctx=self.n_ctx,
            total_slots=self.n_slots,
            model_alias=self.model_id,
            model_ftype=self.model_ftype,
            model_path=self.verified.path if self.verified is not None else NO_MODEL,
            build_info=self.build_info,
            chat_template=getattr(template, "source", ""),
            chat_template_caps=None if caps is None else dict(vars(caps)),
            bos_token=getattr(template, "bos_token", ""),
            eos_token=getattr(template, "eos_token", ""),
        )

    def model_facts(self) -> ModelFacts:
        """What ``GET /v1/models`` lists of the resident model."""
        return self.facts_of(self.engine, self.verified, self.tensor_totals())

    def facts_of(
        self,
        engine: Any,
        verified: Any,
        totals: tuple[int | None, int | None] | None = None,
    ) -> ModelFacts:
        """``model_facts`` of any resident model's engine (the router's ``GET /models``)."""
        hp = getattr(getattr(engine, "model", None), "hp", None)
        if totals is None:
            reader = getattr(getattr(engine, "model", None), "reader", None)
            tensors = list(getattr(reader, "tensors", None) or [])
            totals = (
                (sum(int(t.n_elements) for t in tensors), sum(int(t.n_bytes) for t in tensors))
                if tensors
                else (None, None)
            )
        n_params, size = totals
        current = engine is self.engine
        return ModelFacts(
            id=self.model_id if current else os.path.basename(verified.path),
            aliases=list(self.model_aliases) if current else [],
            tags=list(getattr(self, "model_tags", ())),
            n_ctx=int(getattr(engine, "n_ctx", self.n_ctx)),
            ftype=self.model_ftype if current else file_ftype_name(verified.path),
            tokenizer=getattr(getattr(engine, "tokenizer", None), "model", ""),
            n_vocab=getattr(engine, "n_vocab", None),
            n_ctx_train=getattr(hp, "n_ctx_train", None),
            n_embd=getattr(hp, "n_embd", None),
            n_params=n_params,
            size=size,
        )

    def shared(self, prompts: list[Any], n_cmpl: int) -> list[Any]:
        """A request's parsed answers with each prompt's ``n_cmpl`` completions made one group
        that computes the prompt once (``Engine.share_prompt``), in the same order."""
        share = self.engine.share_prompt
        return [c for p in range(0, len(prompts), n_cmpl) for c in share(prompts[p : p + n_cmpl])]

    def _generation_prompt(self, body: dict[str, Any]) -> str:
        template = getattr(self.engine, "template", None)
        if template is None or not isinstance(body.get("messages"), list):
            return ""
        kwargs = body.get("chat_template_kwargs")
        return str(
            template.generation_prompt(
                body["messages"], body.get("tools"), **(kwargs if isinstance(kwargs, dict) else {})
            )
        )

    def slot_action(self, action: str, filename: str, id_slot: int) -> tuple[int, dict[str, Any]]:
        """On the engine thread: (status, body) of one slot action (slot_actions.slot_job)."""
        self.wake()
        return _refusing(slot_job, self, action, filename, id_slot)

    # --- records --------------------------------------------------------------------------

    def record(
        self, summary: Any, ttft_ms: int | None, wall_ms: int, kind: str, model: str = ""
    ) -> None:
        """One finished completion into the ring and the totals (/bankml/metrics, /metrics);
        with several models resident, ``model`` (its pin's name) counts it for that model too."""
        t = dict(getattr(summary, "timings", {}) or {})
        rec: dict[str, Any] = {
            "at": time.time(),
            "kind": kind,
            "finish_reason": getattr(summary, "finish_reason", None),
            "prompt_tokens": getattr(summary, "prompt_tokens", 0),
            "completion_tokens": getattr(summary, "completion_tokens", 0),
            "cache_n": t.get("cache_n"),
            "ttft_ms": ttft_ms,
            "wall_ms": wall_ms,
            "prompt_per_second": t.get("prompt_per_second"),
            "predicted_per_second": t.get("predicted_per_second"),
            "grammar_ms": None,
            "energy_j": None,
        }
        prompt_n, predicted_n = int(t.get("prompt_n") or 0), int(t.get("predicted_n") or 0)
        prompt_s = float(t.get("prompt_ms") or 0.0) / 1e3
        predicted_s = float(t.get("predicted_ms") or 0.0) / 1e3
        steps = max(predicted_n - 1, 0)  # the first token comes from the prompt's last batch
        with self._lock:
            self.records.append(rec)
            del self.records[: -self.METRICS_KEEP]
            tot = self.totals
            tot["requests"] += 1
            tot["prompt_tokens"] += prompt_n
            tot["prompt_tokens_cached"] += int(t.get("cache_n") or 0)
            tot["prompt_seconds"] += prompt_s
            tot["tokens_predicted"] += predicted_n
            tot["predicted_seconds"] += predicted_s
            # one llama_decode per prompt batch, one per generated token but the last
            tot["decode_calls"] += -(-prompt_n // N_BATCH) + steps
            # the longest the slot grew: the last token sampled is never decoded
            tot["n_tokens_max"] = max(tot["n_tokens_max"], rec["prompt_tokens"] + steps)
            for key, value in zip(WINDOW_KEYS, (prompt_n, prompt_s, steps, predicted_s)):
                self.window[key] += value
            if model:
                rec["model"] = model
                own = self.per_model.setdefault(
                    model, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
                )
                own["requests"] += 1
                own["prompt_tokens"] += int(rec["prompt_tokens"] or 0)
                own["completion_tokens"] += int(rec["completion_tokens"] or 0)

    def _on_reactor(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` on the reactor thread (at once without a reactor: ``bankml.api``)."""
        if self.reactor is None:
            fn(*args)
        else:
            self.reactor.callFromThread(fn, *args)

    def refused_tasks(self, kind: str, body: dict[str, Any], parsed: list[Any]) -> None:
        """On the reactor thread: a request whose tasks llama-server starts and then refuses
        on the slot (a completion on an encoder, its 500): no counter of /metrics moves (none
        of llama-server's does: nothing was decoded), and an idle slot shows the last task
        (SlotView.refused_tasks), as llama-server's slot monitor does."""
        view = next((v for v in self.slot_views if not v.processing), None)
        if view is not None:
            view.refused_tasks(kind, body, parsed)

    def record_pooled(self, kind: str, inputs_tokens: Sequence[int], seconds: float) -> None:
        """On the reactor thread: an embedding or rerank request answered, counted as
        llama-server build 11434 counts its tasks (one per input, each alone on the slot, its
        cache never reused): every input's tokens processed as prompt in ``seconds`` together,
        one llama_decode per micro-batch of an input, the longest input as the slot's longest
        sequence; nothing predicted, no record in /bankml/metrics' ring. An idle slot's view
        shows the last task (SlotView.pooled_tasks)."""
        counts = [int(n) for n in inputs_tokens]
        if not counts:
            return
        n_ubatch = max(1, int(getattr(self.engine, "n_ubatch", N_BATCH) or N_BATCH))
        with self._lock:
            tot = self.totals
            tot["prompt_tokens"] += sum(counts)
            tot["prompt_seconds"] += seconds
            tot["decode_calls"] += sum(-(-n // n_ubatch) for n in counts)
            tot["n_tokens_max"] = max(tot["n_tokens_max"], *counts)
            self.window["prompt_tokens"] += sum(counts)
            self.window["prompt_seconds"] += seconds
        defaults = getattr(self.engine, "defaults", None)
        view = next((v for v in self.slot_views if not v.processing), None)
        if view is not None and defaults is not None:
            view.pooled_tasks(kind, DefaultTask(defaults), counts)

    def metrics(self) -> dict[str, Any]:
        """/bankml/metrics: the ring of the last 256 completions with totals."""
        with self._lock:
            records = list(self.records)
        out = {
            "source": self.engine_name,
            "measured": True,
            "kept": len(records),
            "keep": self.METRICS_KEEP,
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in records),
            "completion_tokens": sum(r["completion_tokens"] or 0 for r in records),
            "energy_j": None,
            "joules_per_token": None,
            "prompt_cache": self.prompt_cache_state(),
            "records": records,
        }
        models = self.models_state()
        if models is not None:  # several models: each one's memory and counts
            out["models"] = models
        return out

    def models_state(self) -> dict[str, Any] | None:
        """With several models resident (None otherwise): each model's requests and tokens
        answered, whether it is resident, and a resident one's memory reckoned and use."""
        if self.residents is None:
            return None
        with self._lock:
            per_model = {name: dict(counts) for name, counts in self.per_model.items()}
        models: dict[str, dict[str, Any]] = {
            name: {"resident": False, **c} for name, c in per_model.items()
        }
        for name, view in self.residents().items():
            models.setdefault(
                name, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
            ).update({"resident": True, **view})
        return models

    def prompt_cache_state(self) -> dict[str, Any]:
        """The host prompt cache (llama-server's --cache-ram): what it holds and its bound
        (``limit_bytes`` null: unbounded; 0: off). Read on the reactor thread: the engine
        thread replaces the entry list whole, so a copy of it is consistent. No model resident
        (a router with none loaded): nothing held, ``limit_bytes`` null (no cache to bound)."""
        cache = getattr(self.engine, "host_cache", None)
        if cache is None:
            return {"entries": 0, "bytes": 0, "held_bytes": 0, "limit_bytes": None}
        entries = list(cache.entries)
        return {
            "entries": len(entries),
            "bytes": sum(e.nbytes for e in entries),  # as llama-server counts them
            "held_bytes": sum(e.held_nbytes for e in entries),  # the memory they take here
            "limit_bytes": cache.limit,
        }

    # --- GET /bankml ------------------------------------------------------------------------

    def totals_now(self) -> dict[str, Any]:
        """A copy of the running totals (llama-server's /metrics counters)."""
        with self._lock:
            return dict(self.totals)

    def scrape(self) -> MetricsScrape:
        """/metrics: the totals and the rate window, which starts again (llama-server averages
        its throughput gauges over the time between two scrapes), with the bridge's gauges."""
        with self._lock:
            window, self.window = self.window, dict.fromkeys(WINDOW_KEYS, 0.0)
            totals = dict(self.totals)
        bridge = self.bridge
        return MetricsScrape(
            totals=totals,
            window=window,
            processing=bridge.processing if bridge else 0,  # runs holding a slot
            deferred=bridge.queued if bridge else 0,
            busy_slots_per_decode=self._busy_slots_per_decode(totals["decode_calls"]),
            models=self.models_state() or {},
        )

    def _busy_slots_per_decode(self, decode_calls: int) -> float:
        """Slots per pass: with several slots the scheduler's (each decode step and each prompt
        micro-batch in a pass counts its slot); one slot: 1.0 once anything was decoded."""
        scheduler = getattr(self.bridge, "scheduler", None)
        if scheduler is None:
            return 1.0 if decode_calls else 0.0
        stats = scheduler.stats
        return (stats.decode_rows + stats.prefill_batches) / stats.passes if stats.passes else 0.0

    def describe(self) -> dict[str, Any]:
        v = self.verified
        if v is None:  # a router started with no pinned model: nothing verified at start
            return self._describe_empty()
        resident = {
            "model": self.model_id,
            "path": v.path,
            "sha256": v.sha256,
            "n_ctx": self.n_ctx,
            "device": self.device,
            "since": self.started,
            "slot_tokens": len(getattr(self.engine, "slot_tokens", []) or []),
        }
        return {
            "bankml": __version__,
            "mode": "native",
            "verified": v.as_dict(),
            "guard_result": v.guard.as_dict(),
            "model": v.path,
            "model_sha256": v.sha256,
            "fork": v.fork_path,
            "hashed_at_unix": v.verified_at,
            "engine": {
                "name": self.engine_name,
                "state": "ready",
                "busy": bool(self.bridge and self.bridge.busy),
                "queued": self.bridge.queued if self.bridge else 0,
            },
            "resident": resident,
            "models": [self.model_id],
            "file_unchanged": self.identity_problem() is None,
        }

    def _describe_empty(self) -> dict[str, Any]:
        """``/bankml`` of a router started with no pinned model: no startup file (``model``
        and ``verified`` null), no model resident until one is loaded."""
        return {
            "bankml": __version__,
            "mode": "native",
            "verified": None,
            "guard_result": None,
            "model": None,
            "model_sha256": None,
            "fork": None,
            "hashed_at_unix": None,
            "engine": {
                "name": self.engine_name,
                "state": "ready",
                "busy": bool(self.bridge and self.bridge.busy),
                "queued": self.bridge.queued if self.bridge else 0,
            },
            "resident": None,
            "models": [],
            "file_unchanged": True,
        }


def served_by(parsed: Any) -> Any:
    """The model (an Ollama host's ``Choice``) a parsed answer was tagged with, None if none."""
    return getattr(parsed, "served_by", None)


def chat_of(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion llama-server runs for a Responses or Messages request; its refusal
    as a 400 (llama-server answers a Messages body without ``messages`` with a 500: bankml
    answers bad input with a 4xx)."""
    try:
        return to_chat(kind, body)
    except ConversionError as err:
        raise ApiError.of(400, str(err)) from None
    except RecursionError:
        raise ApiError.of(400, "the request is nested too deeply") from None


def completions(parsed: Any) -> list[Any]:
    """A prompt's ``n_cmpl`` completions as llama-server's parent task and its children: the
    same request, child ``j`` seeded ``seed + j`` (uint32) where a seed was given, each drawing
    its own otherwise."""
    n_cmpl = int((getattr(parsed, "options", None) or {}).get("n_cmpl", 1))
    seed = parsed.sampler.seed
    if n_cmpl <= 1:
        return [parsed]
    if seed == DEFAULT_SEED:
        return [parsed] * n_cmpl
    return [parsed] + [
        replace(parsed, sampler=replace(parsed.sampler, seed=(seed + j) % 2**32))
        for j in range(1, n_cmpl)
    ]


def open_engine(
    path: str,
    *,
    n_ctx: int,
    device: str = "auto",
    cache_type: str | None = None,
    cache_ram: str | None = None,
    n_slots: int = 1,
    kv_unified: bool = False,
    slot_prompt_similarity: float = DEFAULT_SLOT_PROMPT_SIMILARITY,
) -> tuple[Engine, str]:
    """The engine opened on a verified path, and the name of the device it computes on.
    ``cache_type`` (f16 when None) and ``cache_ram`` (the host prompt cache's bound in MiB; the
    default when None) come from the caller, which reads the environment; ``n_slots``,
    ``kv_unified`` and ``slot_prompt_similarity`` are llama-server's -np, -kvu and -sps. An
    encoder-only model (BERT) opens as an EncoderEngine: embeddings only, on the CPU."""
    opener = EncoderEngine.open if is_encoder(path) else Engine.open
    engine = opener(
        path,
        n_ctx=n_ctx,
        device=device,
        cache_type=cache_type,
        cache_ram=cache_ram,
        n_slots=n_slots,
        kv_unified=kv_unified,
        slot_prompt_similarity=slot_prompt_similarity,
    )
    device_name = backend.device_name(engine.model.xp) if hasattr(engine.model, "xp") else "cpu"
    return engine, device_name


def compile_served(
    path: str, options: Mapping[str, Any], report: Callable[[str], None] | None = None
) -> Any:
    """For the server, on the engine thread, while the main thread hashes the file: compile (or
    load from Numba's cache) the kernels ``open_served`` will run, with the same options, so the
    open after the pin takes seconds. Answers nothing; returns the CompileStats, or None on a
    GPU (the array backend compiles nothing, and the weights are not worth loading twice)."""
    device = options.get("device") or "auto"
    if backend.get_xp(device).__name__ != "numpy" or is_encoder(path):
        return None
    return compile_kernels(
        path,
        device=device,
        cache_type=options.get("cache_type"),
        report=report,
    )


def open_served(
    verified: Any,
    options: Mapping[str, Any],
    bridge: EngineBridge,
    reactor: Any,
    report: Callable[[str], None] | None = None,
    receipt_key: SigningKey | None = None,
) -> NativeEngine:
    """For the server, on the engine thread: the engine opened with ``bankml serve``'s options
    (``ctx``, ``device``, ``cache_type``, ``slot-dir``, ``llama``: llama-server's flags), each kernel run once (compiled or loaded
    now, not on the first request), wrapped for serving."""
    ctx = options.get("ctx")
    llama = options.get("llama") or {}
    engine, device_name = open_engine(
        verified.path,
        n_ctx=DEFAULT_CTX if ctx is None else int(ctx) or training_context(verified.path),
        device=options.get("device") or "auto",
        cache_type=options.get("cache_type"),
        cache_ram=options.get("cache_ram"),
        n_slots=int(llama.get("n_parallel", 1)),
        kv_unified=bool(llama.get("kv_unified", False)),
        slot_prompt_similarity=float(
            llama.get("slot_prompt_similarity", DEFAULT_SLOT_PROMPT_SIMILARITY)
        ),
    )
    apply_server_defaults(engine, llama)
    if (llama.get("embedding") or {}).get("pooling") == "rank" and not isinstance(
        engine, EncoderEngine
    ):
        engine.rank_head = rank_head(engine)  # a causal reranker's head (qwen3's cls.output)
        if engine.rank_head is None:
            raise UnsupportedModel(
                "--rerank (pooling rank): bankml's native engine reranks with a BERT reranker "
                "(a BERT GGUF with a classifier head) or a qwen3 reranker (cls.output)"
            )
    if isinstance(engine, EncoderEngine):
        engine.check_outputs(outputs_max(llama))
    engine.warm_up(report)  # ``report`` is told what compiles, and how long it took
    return NativeEngine(
        engine,
        bridge,
        verified,
        slot_dir=options.get("slot-dir") or options.get("slot_dir"),
        n_ctx=engine.n_ctx,
        device=device_name,
        reactor=reactor,
        receipt_key=receipt_key,
        aliases=llama.get("aliases") or (),
        tags=llama.get("tags") or (),
    )


def idle_served(
    verified: Any,
    options: Mapping[str, Any],
    bridge: EngineBridge,
    reactor: Any,
    receipt_key: SigningKey | None = None,
) -> NativeEngine:
    """For llama-server's router mode, on the engine thread: the NativeEngine with no engine
    open (``asleep``), as llama-server's router starts with no model loaded; no weight is read.
    Its slots are the server's (``-np``); each model is opened, verified again, when it is
    loaded (native/ollama.py ``OllamaHost._open_model``). ``verified`` None: the router has no
    startup model (no pinned file in its directory), its context DEFAULT_CTX unless given."""
    llama = options.get("llama") or {}
    ctx = options.get("ctx")
    trained = training_context(verified.path) if verified is not None else DEFAULT_CTX
    xp = backend.get_xp(options.get("device") or "auto")
    return NativeEngine(
        None,
        bridge,
        verified,
        slot_dir=options.get("slot-dir") or options.get("slot_dir"),
        n_ctx=DEFAULT_CTX if ctx is None else int(ctx) or trained,
        device=backend.device_name(xp),
        reactor=reactor,
        receipt_key=receipt_key,
        aliases=llama.get("aliases") or (),
        tags=llama.get("tags") or (),
        n_slots=int(llama.get("n_parallel", 1)),
    )


def outputs_max(llama: Mapping[str, Any]) -> int:
    """How many rows llama-server's context may output per batch (``server_output_limits``):
    -b with --embeddings or a pooling other than none, else -np times one plus the most drafts
    of --spec-type (``common_speculative_n_max``: the ngram kinds' size M, ngram-mod's n-max),
    at most -b, at least one."""
    n_batch = int(llama.get("n_batch", N_BATCH))
    embedding = llama.get("embedding") or {}
    if embedding.get("enabled") or embedding.get("pooling") not in (None, "none"):
        return n_batch
    kinds = (llama.get("speculative") or {}).values()
    drafts = max((int(k.get("size_m", k.get("n_max", 0))) for k in kinds), default=0)
    return max(1, min(n_batch, int(llama.get("n_parallel", 1)) * (1 + drafts)))


def training_context(path: str) -> int:
    """The context the model was trained for (``<arch>.context_length``): what llama-server's
    ``-c 0`` gives; bankml's default where the header does not say."""
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    key = f"{arch}.context_length"
    value = read_metadata(path, [key]).get(key) if arch else None
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_CTX


def apply_server_defaults(engine: Engine, llama: Mapping[str, Any]) -> None:
    """llama-server's server-wide settings (``serving.llama_flags.native_settings``) on an
    opened engine: the sampling defaults over the file's own ``general.sampling.*`` (as
    llama-server lets its flags win over the header's), ``-n``, ``--reasoning-budget`` and
    ``--reasoning-budget-message``, a chat template, and whether it runs as Jinja
    (``--no-jinja``: llama.cpp's built-in templates, builtin_templates.py)."""
    if llama.get("sampling"):
        engine.defaults = SamplerParams.from_request(llama["sampling"], engine.defaults)
    engine.n_predict = int(llama.get("n_predict", -1))
    engine.reasoning_budget = int(llama.get("reasoning_budget", -1))
    engine.reasoning_budget_message = str(llama.get("reasoning_budget_message", ""))
    engine.reasoning_format = str(llama.get("reasoning_format", "auto"))
    engine.reasoning = str(llama.get("reasoning", "auto"))
    engine.chat_template_kwargs = dict(llama.get("chat_template_kwargs") or {})
    engine.jinja = bool(llama.get("jinja", True))  # --no-jinja: llama.cpp's built-in templates
    engine.verbose = bool(llama.get("verbose", False))  # -v: a request's default "verbose"
    engine.context_shift = bool(llama.get("context_shift", False))  # --context-shift
    if engine.context_shift and getattr(engine.model, "has_sliding_window", False):
        # llama-server turns it off where its cache cannot shift (a sliding-window cache
        # smaller than the context); bankml turns it off for every sliding-window model
        print(
            "ctx_shift is not supported by this context, it will be disabled",
            file=sys.stderr,
            flush=True,
        )
        engine.context_shift = False
    engine.n_keep = int(llama.get("n_keep", 0))  # --keep: a request's default n_keep
    engine.clear_idle_slots = bool(llama.get("cache_idle_slots", True))  # cleared with -kvu
    engine.spm_infill = bool(llama.get("spm_infill"))  # --spm-infill (/infill's layout)
    sizes = (int(llama.get("n_batch", 2048)), int(llama.get("n_ubatch", 512)))  # -b, -ub
    if not engine.set_batch_sizes(*sizes):
        print(
            "ignoring -b/-ub: a sliding-window model keeps the batch sizes 2048 and 512",
            file=sys.stderr,
            flush=True,
        )
    engine.speculative = drafters(llama.get("speculative"))  # --spec-type
    if llama.get("chat_template") is not None and engine.template is not None:
        engine.template = replace(engine.template, source=llama["chat_template"])


def slot_index(id_slot: int, n_slots: int) -> int:
    """get_slot_by_id: any id wraps onto a slot (``id % n_slots``, the id read as size_t)."""
    return (id_slot % 2**64) % n_slots


def slot_job(
    native: NativeEngine, action: str, filename: str, id_slot: int = 0
) -> tuple[int, dict[str, Any]]:
    """On the engine thread: (status, body) of one slot action on slot ``id_slot`` (wrapped
    onto the slots as llama-server's get_slot_by_id); the answer echoes the id the request
    named, as llama-server's."""
    engine = native.engine
    index = slot_index(id_slot, int(getattr(engine, "n_slots", 1)))
    if action == "erase":
        return 200, {"id_slot": id_slot, "n_erased": slots.erase_slot(engine, index)}
    assert native.slot_dir is not None  # the resource refuses slot actions without a directory
    path = os.path.join(native.slot_dir, filename)
    if action == "save":
        try:
            done = slots.save_slot(engine, path, native.verified.sha256, index)
        except OSError as err:
            return 500, error_object(500, f"Unable to save slot: {err.strerror or err}")
        return 200, {
            "id_slot": id_slot,
            "filename": filename,
            "n_saved": done.n_tokens,
            "n_written": done.n_bytes,
            "timings": {"save_ms": round(done.ms, 3)},
        }
    try:
        done = slots.restore_slot(engine, path, native.verified.sha256, index)
    except slots.SlotError as err:
        return 400, error_object(400, f"Unable to restore slot: {err}")
    return 200, {
        "id_slot": id_slot,
        "filename": filename,
        "n_restored": done.n_tokens,
        "n_read": done.n_bytes,
        "timings": {"restore_ms": round(done.ms, 3)},
    }
