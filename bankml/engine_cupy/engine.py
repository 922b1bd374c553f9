"""The native engine: one model, ``n_slots`` slots, requests parsed and run as llama-server runs them.

``Engine.open`` loads the model, its tokenizer and chat template. ``parse_request`` validates a
/completion or /v1/chat/completions body completely (prompt, stop strings, sampler parameters,
constraint, limits, context; the fields as request.py reads them) before any compute, raising
``RequestError`` with llama-server's status and message. ``run_steps`` runs a request in a slot
(``choose_slot``): it prefills in micro-batches of 512 (reusing the longest common prefix with
the slot's tokens; with ``progress`` a ``Progress`` before and after each prompt batch), then
samples token by token, yielding ``Chunk``s (schedule.py: the run's protocol with whatever
drives it; stops.py: the text each releases); its ``summary`` holds finish reason, counts and
timings once the iteration is over.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from bankml.engine_cupy import checkpoints as _checkpoints
from bankml.engine_cupy import compile_jobs
from bankml.engine_cupy.chat_request import ChatDefaults
from bankml.engine_cupy.chat_task import (
    ChatTask,
    builtin_chat_task,
    chat_task,
    refuse_tools_without_jinja,
)
from bankml.engine_cupy.chat_template import ChatTemplate, TemplateError
from bankml.engine_cupy.checkpoints import Checkpoints, MessageSpans, find_spans
from bankml.engine_cupy.device_model import DeviceLogits
from bankml.engine_cupy.device_sampling import (
    FULL,
    GREEDY,
    TOP_K,
    bias,
    choice,
    draw_from_top_k,
)
from bankml.engine_cupy.grammar import (
    Constraint,
    ConstraintError,
    ConstraintSpec,
    GrammarStackError,
    build_llg_tokenizer,
    resolve_constraint,
    schema_to_constraint_text,
)
from bankml.engine_cupy.infill import infill_tokens
from bankml.engine_cupy.kernels.exact_attention import FA_TILE_Q, kv_length
from bankml.engine_cupy.kv_cache import (
    IswaCells,
    SequenceCells,
    SequenceIswa,
    SharedCells,
    pad_cells,
    ring_size,
)
from bankml.engine_cupy.model import BatchCells, Model, Placed
from bankml.engine_cupy.prompt_cache import (
    Entry,
    HostPromptCache,
    SavedCells,
    cache_ram_limit,
    longest_common_prefix,
)
from bankml.engine_cupy.reasoning_budget import ReasoningBudget, ReasoningBudgetSpec
from bankml.engine_cupy.request import (
    BUDGET_FIELDS,
    Request,
    RequestError,
    bool_field,
    chat_logprobs,
    chat_render_options,
    check_chat_messages,
    grammar_fields,
    is_integer,
    is_mixed,
    json_type,
    lora_field,
    parse_stop,
    parse_task_fields,
    reasoning_budget_fields,
)
from bankml.engine_cupy.sampler import (
    GuidedSampler,
    LogitBias,
    Sampler,
    SamplerError,
    SamplerParams,
    TokenProbs,
    VocabInfo,
    logarithm,
    parse_logit_bias,
    post_sampling_probs,
    prefill_tokens,
    token_logprobs,
)
from bankml.engine_cupy.sampler import (
    warm_up as warm_up_sampler,
)
from bankml.engine_cupy.schedule import (
    Chunk,
    Clock,
    Forward,
    Progress,
    SharedPrompt,
    Slot,
    Steps,
    Summary,
    Waiting,
    prompt_progress,
)
from bankml.engine_cupy.speculative import (
    DraftStats,
    Speculative,
    accept_draft,
    draft_limit,
)
from bankml.engine_cupy.stops import LineLimits, TextRelease, utf8_prefix_text
from bankml.engine_cupy.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_SLOT_PROMPT_SIMILARITY",
    "MICRO_BATCH",
    "Engine",
    "compile_kernels",
    "micro_batches",
    "prompt_batches",
    "slot_context",
]

MICRO_BATCH = _checkpoints.N_UBATCH


def prompt_batches(
    start: int,
    end: int,
    checkpoints: bool,
    n_batch: int = _checkpoints.N_BATCH,
    n_ubatch: int = MICRO_BATCH,
) -> list[tuple[int, int]]:
    """The micro-batches [a, b) llama-server evaluates prompt positions start..end-1 in when no
    message starts are known (plain prompts): batches of ``n_batch`` (-b) cut into micro-batches
    of ``n_ubatch`` (-ub: 512) from start, and, with
    ``checkpoints`` (sliding-window models), its batches also end 516 and 4 tokens before the
    end. The cuts decide which attention kernel (tiled or one-row) each token sees; the engine's
    own loop (``Engine._batch_end``) also follows user-message starts and the slot's checkpoints."""
    out: list[tuple[int, int]] = []
    a = start
    while a < end:
        b = (
            _checkpoints.batch_end(a, end, MessageSpans(), [])
            if checkpoints
            else min(a + n_batch, end)
        )
        out += micro_batches(a, b, n_ubatch)
        a = b
    return out


def micro_batches(a: int, b: int, n_ubatch: int = MICRO_BATCH) -> list[tuple[int, int]]:
    """llama_decode's split of one batch [a, b) into ubatches of ``n_ubatch`` (-ub: 512)."""
    return [(i, min(i + n_ubatch, b)) for i in range(a, b, n_ubatch)]


DEFAULT_SLOT_PROMPT_SIMILARITY = 0.1  # llama-server's --slot-prompt-similarity


def slot_context(n_ctx: int, n_slots: int, kv_unified: bool) -> int:
    """llama_context's n_ctx_seq: each slot's positions. A unified cache gives each the whole
    context; otherwise the context is divided between the slots, each part padded to 256."""
    n_ctx = pad_cells(n_ctx)
    if kv_unified or n_slots <= 1:
        return n_ctx
    return pad_cells(n_ctx // n_slots)


def compile_kernels(
    path: str | os.PathLike,
    *,
    device: str = "auto",
    cache_type: str | None = None,
    report: Callable[[str], None] | None = None,
    jobs: int | None = None,
) -> Any:
    """Compile (or load from Numba's cache) the kernels the model at ``path`` reaches, on up
    to ``jobs`` processes (compile_jobs), then let the model go; returns
    kernels.progress.CompileStats.

    For a start-up that compiles while it hashes the file: once the file's header has passed
    the guard, call this on the thread that will run the engine (it starts the kernels' worker
    team, Model.load) while another thread checks the pin. Numba keeps the compiled kernels in
    the process, so the Engine.open and warm_up that follow the pin take seconds. Nothing is
    answered from the model loaded here."""
    model = Model.load(path, device=device, progress=False)
    return _warm_up(model, cache_type, report, jobs)


def _warm_up(
    model: Any, cache_type: str | None, report: Callable[[str], None] | None, jobs: int | None
) -> Any:
    """The model's kernels, on up to ``jobs`` processes (default: compile_jobs.default_jobs),
    then the sampler's top-k (else the first draw compiles it), while the jobs compile."""
    return model.warm_up(
        cache_type,
        report,
        jobs=compile_jobs.default_jobs() if jobs is None else jobs,
        alongside=warm_up_sampler,
    )


def _slot_caches(model: Any, n: int, n_ctx: int, cache_type: str | None) -> list[Any]:
    """The slots' caches: in one pool where the model keeps one (the device model, whose
    slots' decode steps then run as one batched step), else one ``new_cache`` each."""
    new_caches = getattr(model, "new_caches", None)
    if new_caches is not None:
        return list(new_caches(n, n_ctx, cache_type))
    return [model.new_cache(n_ctx, cache_type) for _ in range(n)]


class EmbeddingPlan(NamedTuple):
    """How llama-server's slots take one request's embedding inputs (Engine.embedding_batches):
    the batches, each in its order, the inputs whose slot keeps them after (input index: its
    slot), and those saved to the host prompt cache meanwhile."""

    batches: list[list[int]]
    keep: dict[int, Any]
    # with -kvu and --cache-idle-slots: the inputs a later batch's launch saves to the host
    # prompt cache (each in its slot's cells), in that order, each with the context
    # checkpoints its slot held then (a sliding-window model's; none otherwise)
    saved: Sequence[tuple[int, Sequence[Any]]] = ()
    # with -kvu, where the shared cache's cells are known (Engine.cells): input index: its
    # cells and its batch's n_kv (a sliding-window model's sliding layers' too)
    placement: Mapping[int, Placed] | None = None


class _RunCells(NamedTuple):
    """The shared cache's book set aside while a run goes (Engine._set_cells_aside), and the
    count of what it could not follow when it was."""

    cells: SharedCells | IswaCells
    changes: int
    # the slot's cache follows the book's cells (KVCache.follow): the book is kept as the run
    # goes; else the run's cells are placed in it when it ends (Engine._place_run)
    laid_out: bool


class Engine:
    """One resident model with ``n_slots`` slots (each a KV cache of ``n_ctx`` positions and the
    tokens it holds), one host prompt cache for all of them. ``cache``, ``slot_tokens`` and
    ``checkpoints`` are slot 0's (a one-slot engine's only slot)."""

    # a causal reranker's head (rank_head.py), set where the server ranks with this model
    rank_head: Any = None

    def __init__(
        self,
        model: Any,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        n_ctx: int,
        cache_type: str | None = None,
        sampling_defaults: SamplerParams | None = None,
        cache_ram: int | str | None = None,
        n_slots: int = 1,
        slot_prompt_similarity: float = DEFAULT_SLOT_PROMPT_SIMILARITY,
        kv_unified: bool = False,
    ):
        if n_slots < 1:
            raise ValueError("an engine has at least one slot")
        self.model = model
        # the server's -kvu: the slots' sequences in one cache, so one micro-batch can hold
        # several of them whole (``pooled_together``)
        self.kv_unified = kv_unified
        self.tokenizer = tokenizer
        self.template = template
        self.n_ctx = n_ctx
        self.n_vocab = int(model.n_vocab)
        # --cache-ram (MiB); its token limit is llama_n_ctx, every slot's positions, and its
        # state sizes count one stream per slot without -kvu
        self.host_cache = HostPromptCache(
            cache_ram_limit(cache_ram),
            n_ctx if kv_unified else n_ctx * n_slots,
            1 if kv_unified else n_slots,
        )
        self.defaults = sampling_defaults or SamplerParams()
        self.n_predict = -1  # the server's -n: where a request's n_predict is -1 or absent
        # the server's --reasoning-budget (a request's default reasoning_budget_tokens) and
        # --reasoning-budget-message (the message a chat template's reasoning budget forces)
        self.reasoning_budget = -1
        self.reasoning_budget_message = ""
        # the server's --reasoning-format, --reasoning and --chat-template-kwargs (JSON values)
        self.reasoning_format = "auto"
        self.reasoning = "auto"
        self.chat_template_kwargs: dict[str, Any] = {}
        # False with the server's --no-jinja: chats written by llama.cpp's built-in templates
        self.jinja = True
        # the server's -v (or -lv above 9): a request's default "verbose" (__verbose on answers)
        self.verbose = False
        # the server's --context-shift: a generation that fills its slot drops half of what
        # follows the kept tokens and goes on (``_shift_context``); off, it stops there
        self.context_shift = False
        self.n_keep = 0  # the server's --keep: a request's default n_keep
        # the server's --spec-type (speculative.py): drafts from the slot's history
        self.speculative: Speculative | None = None
        # the server's -b and -ub: a prompt is evaluated in batches of n_batch tokens, each cut
        # into micro-batches of n_ubatch (they decide which kernels a row meets, so the bits);
        # set_batch_sizes
        self.n_batch = _checkpoints.N_BATCH
        self.n_ubatch = MICRO_BATCH
        self.n_batch_flag = self.n_batch  # -b as given (an /infill prompt is cut by it)
        self.spm_infill = False  # the server's --spm-infill: an /infill suffix before its prefix
        self._pieces = tokenizer.vocab_bytes()
        self._text_pieces = [tokenizer.token_to_piece(i, False) for i in range(tokenizer.n_vocab)]
        # built on first use, by the prepare thread (parsing) or the engine thread alike
        self._lazy_lock = threading.Lock()
        self._llg: Any = None
        self._chat_delimiters: list[tuple[str, list[int]]] | None = None
        # llama-server's context checkpoints: only for sliding-window models (n_swa > 0)
        swa = getattr(model, "has_sliding_window", False)
        self.slots = [
            Slot(
                i,
                cache,
                n_ctx,
                checkpoints=Checkpoints(model.hp.swa_window) if swa else None,
            )
            for i, cache in enumerate(_slot_caches(model, n_slots, n_ctx, cache_type))
        ]
        self.slot_prompt_similarity = float(slot_prompt_similarity)
        # llama-server's --cache-idle-slots (its default): each task's launch saves the idle
        # slots to the host prompt cache, and with -kvu clears them (_acquire)
        self.clear_idle_slots = True
        # with -kvu, the shared cache's cells as far as embeddings' batches tell them (None:
        # not known, once a completion has taken cells, or not followed: an approximate
        # model, one slot); a sliding-window model's two caches' (IswaCells), whose book a
        # completion gives up
        self._tracks_cells = kv_unified and n_slots > 1 and bool(getattr(model, "exact", False))
        self.cells: SharedCells | IswaCells | None = (
            self._new_cells() if self._tracks_cells else None
        )
        # bumped by what a run's set-aside book cannot follow (another task's launch, a slot
        # erased or restored): _RunCells
        self._cell_changes = 0
        self._task_id = 0  # the last task's id, counted over all slots (as llama-server's)
        self._uses = 0  # a clock for the slots' t_last_used
        self._vocab_info = VocabInfo(self._pieces, lambda s: self.tokenize(s))

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        n_ctx: int = 4096,
        device: str = "auto",
        cache_type: str | None = None,
        cache_ram: int | str | None = None,
        n_slots: int = 1,
        kv_unified: bool = False,
        slot_prompt_similarity: float = DEFAULT_SLOT_PROMPT_SIMILARITY,
    ) -> Engine:
        """Load ``path`` for ``n_ctx`` positions on ``device``, with a KV cache of ``cache_type``
        (f16 or q8_0; None: f16) and a host prompt cache of ``cache_ram`` MiB (None: the default
        of prompt_cache.cache_ram_limit). ``n_slots`` slots share the context (each
        ``slot_context``: all of it with ``kv_unified``). Call it on the thread that will run
        the engine: on the CPU that thread starts and owns the kernels' worker team
        (kernels.jit)."""
        model = Model.load(path, device=device)
        tokenizer = Tokenizer.from_gguf(model.reader)
        template = ChatTemplate.from_gguf(model.reader, tokenizer)
        # as llama_context: -c 1000 holds 1024 positions (then each slot its share)
        n_ctx = slot_context(n_ctx, n_slots, kv_unified)
        return cls(
            model,
            tokenizer,
            template,
            n_ctx,
            cache_type,
            _gguf_sampling_defaults(model.reader),
            cache_ram,
            n_slots,
            slot_prompt_similarity,
            kv_unified=kv_unified,
        )

    # --- slots ----------------------------------------------------------------------------------------------

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def cache(self) -> Any:
        return self.slots[0].cache

    @property
    def slot_tokens(self) -> list[int]:
        return self.slots[0].tokens

    @slot_tokens.setter
    def slot_tokens(self, tokens: list[int]) -> None:
        self.slots[0].tokens = tokens

    @property
    def checkpoints(self) -> Checkpoints | None:
        return self.slots[0].checkpoints

    def free_slots(self) -> int:
        return sum(not slot.processing for slot in self.slots)

    def choose_slot(self, prompt: Sequence[int]) -> tuple[Slot, bool]:
        """llama-server's get_available_slot among the idle slots: the one whose tokens share
        the largest fraction of ``prompt`` (above ``slot_prompt_similarity``), else the least
        recently used (the last of equals, as its ``<=``). Returns the slot and whether the host
        prompt cache is to be updated for it (chosen by use, or keeping under half its tokens).
        Raises RuntimeError when every slot is busy (the scheduler never asks then)."""
        chosen: Slot | None = None
        update_cache = False
        threshold = np.float32(self.slot_prompt_similarity)
        if threshold != 0.0 and prompt:
            best = np.float32(0.0)
            best_lcp = 0
            for slot in self.slots:
                held = slot.tokens or slot.embedded
                if slot.processing or not held:
                    continue
                lcp = longest_common_prefix(held, prompt)
                sim = np.float32(lcp) / np.float32(len(prompt))
                if sim > best and sim > threshold:
                    best, best_lcp, chosen = sim, lcp, slot
            if chosen is not None:
                update_cache = best_lcp / len(chosen.tokens or chosen.embedded) < 0.5  # f_keep
        if chosen is None:
            t_last = -1
            for slot in self.slots:
                if slot.processing:
                    continue
                if chosen is None or slot.t_last_used <= t_last:
                    t_last, chosen = slot.t_last_used, slot
            update_cache = True
        if chosen is None:
            raise RuntimeError("every slot is busy")
        return chosen, update_cache

    def free_slot(self) -> Slot:
        """llama-server's get_free_slots for a child task: the first idle slot in id order (its
        contents are replaced by its parent's, so neither similarity nor the host prompt cache
        has a say). Raises RuntimeError when every slot is busy."""
        for slot in self.slots:
            if not slot.processing:
                return slot
        raise RuntimeError("every slot is busy")

    def share_prompt(self, completions: Sequence[Request]) -> list[Request]:
        """One prompt's completions (parent first, then its children) made to compute the
        prompt once (``SharedPrompt``): only for runs that a scheduler advances side by side,
        all admitted at once."""
        if len(completions) < 2:
            return list(completions)
        shared = SharedPrompt()
        return [
            replace(req, shared=shared, shared_child=j > 0) for j, req in enumerate(completions)
        ]

    @property
    def kv_size(self) -> int:
        """The cells of the cache the slots share with ``-kvu`` (0: a model that keeps none)."""
        return int(getattr(self.cache, "kv_size", 0))

    def _new_cells(self) -> SharedCells | IswaCells:
        """An empty book of the shared cache; a sliding-window model's sliding layers keep a
        cache of their own, of the window for each slot and a micro-batch (as
        llama_kv_cache_iswa sizes it with -kvu)."""
        base = SharedCells(self.kv_size)
        if not getattr(self.model, "has_sliding_window", False):
            return base
        window = int(self.model.hp.swa_window)
        size = ring_size(self.kv_size, window * self.n_slots, MICRO_BATCH)
        return IswaCells(base, SharedCells(size, window))

    def forget_cells(self) -> None:
        """The shared cache's cells are no longer known (a restored slot's, a batch beside a
        run)."""
        self.cells = None
        self._cell_changes += 1

    def _set_cells_aside(self, req: Request, slot: Slot) -> _RunCells | None:
        """The book while a run goes: unknown to others meanwhile (a task beside it joins its
        batches as they come), kept for the run's own cells where it runs alone (None: not
        followed: a prompt shared by several runs, another slot busy). Where other
        sequences hold cells, or the slot's own lie out of position order, the slot's cache
        follows the book's cells, so that its attention walks them as llama-server's does; a
        sequence alone in order from cell 0 keeps its own cache's order, the same cells. A
        sliding-window model's cache always follows both books (``SequenceIswa``), and a run
        that drafts (speculative decoding) always follows the book."""
        cells, self.cells = self.cells, None
        if cells is None or req.shared is not None or self.free_slots() != self.n_slots - 1:
            return None
        if isinstance(cells, IswaCells):  # a sliding-window model's two books, always laid out
            if not slot.cache.follow(SequenceIswa(cells, slot.id)):
                return None
            return _RunCells(cells, self._cell_changes, True)
        # a draft's rejected cells are emptied again (_place_run's replay takes one a token)
        laid_out = self.speculative is not None or not cells.in_order_alone(slot.id)
        if laid_out and not slot.cache.follow(SequenceCells(cells, slot.id)):
            return None
        return _RunCells(cells, self._cell_changes, laid_out)

    def _place_run(
        self, held: _RunCells | None, slot: Slot, summary: Summary, followed: bool
    ) -> None:
        """The cells a run took alone, as llama-server's decodes take them: its slot's cells from
        the first position not reused emptied, the prompt's micro-batches, then a cell for each
        token decoded after it (the last one sampled is never decoded). A run cancelled, whose
        context shifted, whose cache stopped following the book (``followed``), or beside which
        anything else happened leaves the book unknown."""
        if (
            held is None
            or held.changes != self._cell_changes
            or summary.cancelled
            or summary.n_discarded
        ):
            return
        cells = held.cells
        if held.laid_out:  # placed as the run went
            if followed:
                self.cells = cells
            return
        assert isinstance(cells, SharedCells)  # a sliding-window model's are laid out
        cache_n = int(summary.timings["cache_n"])
        n_prompt = summary.prompt_tokens
        cells.seq_rm(slot.id, cache_n)
        steps = [*self._prompt_micro_batches(slot, cache_n, n_prompt)]
        steps += [(p, p + 1) for p in range(n_prompt, len(slot.tokens))]
        try:
            for a, b in steps:
                cells.place(np.full(b - a, slot.id), np.arange(a, b))
        except ValueError:  # no room: llama-server's decode fails there
            return
        self.cells = cells

    def _save_to_host_cache(self, slot: Slot) -> bool:
        """The slot's tokens and cells (its checkpoints with them, and where it sits in the
        shared cache when the book knows) into the host cache; whether they were kept."""
        held = slot.checkpoints.items if slot.checkpoints is not None else []
        return self.host_cache.save(slot.tokens, slot.cache, held, self._saved_cells(slot))

    def _saved_cells(self, slot: Slot) -> SavedCells | None:
        """Where ``slot``'s sequence sits in the shared cache, as llama-server's state of it
        lists its cells (None: the book does not know, or holds other positions for it)."""
        cells = self.cells
        if cells is None:
            return None
        base = cells.base if isinstance(cells, IswaCells) else cells
        saved = SavedCells(SequenceCells(base, slot.id).held())
        if len(saved.base) != len(slot.tokens):
            return None
        if isinstance(cells, IswaCells):
            saved = saved._replace(swa=SequenceCells(cells.swa, slot.id).held())
        return saved

    @staticmethod
    def _placed_cells(placed: Placed | None, window: int) -> SavedCells | None:
        """``_saved_cells`` of an embedding's input from where its batch placed it."""
        if placed is None:
            return None
        base = np.argsort(placed.cells, kind="stable")  # its positions in cell order
        if placed.swa_cells is None:
            return SavedCells(base)
        order = np.argsort(placed.swa_cells, kind="stable")
        return SavedCells(base, order[order >= len(order) - window])

    def _place_loaded(self, slot: Slot, entry: Entry) -> None:
        """A prompt loaded into ``slot`` from the host cache, in the book as llama.cpp reads a
        saved sequence back (state_read, the full layers' cache, then a sliding-window model's
        sliding layers' one: seq_rm, then find_slot for its cells in their saved order). An
        entry saved where the book did not know its cells is placed in position order, unless
        it holds a cell layout of its own (a context shift's, a sliding window's): the book is
        then unknown."""
        cells = self.cells
        if cells is None:
            return
        saved = entry.cells
        if saved is None and entry.ring is None and not isinstance(cells, IswaCells):
            saved = SavedCells(np.arange(len(entry.tokens)))
        if saved is None or isinstance(cells, IswaCells) != (saved.swa is not None):
            self.forget_cells()
            return
        books = [(cells, saved.base)]
        if isinstance(cells, IswaCells) and saved.swa is not None:
            books = [(cells.base, saved.base), (cells.swa, saved.swa)]
        try:
            for book, positions in books:
                book.seq_rm(slot.id)
                if len(positions):
                    book.place(np.full(len(positions), slot.id), positions)
        except ValueError:  # no room: llama-server's restore fails there
            self.forget_cells()

    def _prompt_micro_batches(self, slot: Slot, start: int, end: int) -> Iterator[tuple[int, int]]:
        """The micro-batches ``_prefill`` evaluates a prompt's positions [start, end) in, for a
        slot without context checkpoints (whose batch cuts take none)."""
        while start < end:
            cut = self._batch_end(slot, start, end, MessageSpans())
            yield from micro_batches(start, cut, self.n_ubatch)
            start = cut

    def _acquire(self, slot: Slot) -> None:
        slot.processing = True
        slot.embedded = []  # the new task's prompt replaces an embedding's tokens
        slot.holds_embedding = False
        if self.clear_idle_slots:
            # llama-server's --cache-idle-slots: each launch saves every idle slot to the host
            # prompt cache, whence another slot may load it later; with -kvu it clears them
            for idle in self.slots:
                if idle.processing:
                    continue
                # a completion's or an embedding's, its cells with it
                if idle.tokens and self._save_to_host_cache(idle):
                    self.host_cache.update()
                if not self.kv_unified:
                    continue
                idle.embedded = []
                if self.cells is not None:
                    self.cells.seq_rm(idle.id)
                if idle.tokens:
                    idle.cache.truncate(0)
                    idle.tokens, idle.holds_embedding = [], False
                if idle.checkpoints is not None:  # prompt_clear: with its tokens
                    idle.checkpoints = Checkpoints(idle.checkpoints.window)
        self._task_id += 1
        self._cell_changes += 1
        slot.task_id = self._task_id

    def _release(self, slot: Slot) -> None:
        self._uses += 1
        slot.processing = False
        slot.t_last_used = self._uses

    def warm_up(self, report: Callable[[str], None] | None = None, jobs: int | None = None) -> Any:
        """Run each kernel a request can reach once (Model.warm_up), for this cache's type, on
        up to ``jobs`` processes (compile_jobs); ``report`` is told what compiles
        (kernels.progress). Returns its CompileStats."""
        return _warm_up(self.model, self.cache.cache_type, report, jobs)

    # --- text ---------------------------------------------------------------------------------------------

    def tokenize(
        self, text: str, add_special: bool = False, parse_special: bool = False
    ) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.detokenize(ids)

    def apply_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        if self.template is None:
            raise RequestError("this model has no chat template")
        return self.template.render(messages, **kwargs)

    def llg_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on first use (about a second)."""
        with self._lazy_lock:
            if self._llg is None:
                self._llg = build_llg_tokenizer(
                    self._pieces,
                    self.tokenizer.eog_ids,
                    self.tokenizer.bos_id,
                    lambda s: self.tokenize(s),
                )
            return self._llg

    # --- requests -------------------------------------------------------------------------------------------

    def parse_request(self, request: Mapping[str, Any], kind: str) -> Request:
        """Validate a one-prompt request body completely; raises RequestError (status 400) before any
        compute. A /completion body with several prompts is ``parse_batch``'s."""
        requests = self.parse_batch(request, kind)
        if len(requests) > 1:
            raise RequestError(
                "several prompts in one request are answered on /completion (llama-server's "
                "array of results); send them there or one per request"
            )
        return requests[0]

    def parse_batch(self, request: Mapping[str, Any], kind: str) -> list[Request]:
        """Validate a body into one Request per prompt (llama-server's tasks of one request: the same
        parameters, each prompt answered as if alone). Fields are read in llama-server's schema order,
        so the first refusal is the one it gives."""
        if not isinstance(request, Mapping):
            raise RequestError("request body must be a JSON object")
        body = dict(request)
        try:
            chat: ChatTask | None = None
            if kind == "chat":
                chat = self._chat_task(body)
                prompts = [(chat.prompt, self._chat_tokens(chat.prompt))]
            elif kind == "completion":
                prompts = self._completion_prompts(body)
            elif kind == "infill":
                prompts = [self._infill_prompt(body)]
                kind = "completion"  # the same run as /completion's from here
            else:
                raise ValueError(f"unknown request kind {kind!r}")
            task = parse_task_fields(body, self.n_slots)
            if body.get("verbose") is None:  # the server's -v where the request says nothing
                task["verbose"] = self.verbose
            if body.get("n_keep") is None:  # the server's --keep
                task["n_keep"] = self.n_keep
            if kind == "chat":
                task.update(self._continuation(body))
                # the chat parser's name, as llama-server shows it (none without Jinja)
                assert chat is not None
                task["chat_format"] = (
                    "Content-only"
                    if not self.jinja
                    else chat.params.format
                    if chat.params is not None
                    else "peg-native"
                )
                if task["verbose"]:  # __verbose shows the chat parser's generation prompt
                    assert chat is not None
                    task["generation_prompt"] = (
                        chat.generation_prompt
                        if chat.params is not None
                        else self._generation_prompt(body)
                    )
            params = SamplerParams.from_request(body, self.defaults)
            task["backend_sampling"] = bool_field(
                body, "backend_sampling", False
            )  # no backend here: no effect
            post_sampling = bool_field(body, "post_sampling_probs", False)
            task["lora"] = lora_field(body)
            constraint = resolve_constraint(body, kind)
            if constraint is not None and constraint.kind == "chat_schema" and not self.jinja:
                # without Jinja the schema is plain json_schema_to_grammar's GBNF
                constraint = ConstraintSpec(
                    "gbnf", schema_to_constraint_text(json.loads(constraint.source))
                )
            if constraint is not None and constraint.kind == "chat_schema":
                constraint = constraint.with_generation_prompt(self._generation_prompt(body))
            # a chat task's fields are what llama-server's chat parsing sets (the template's)
            fields = body if chat is None else self.chat_sampling_fields(body, chat)
            guidance = grammar_fields(fields, self._special_tokens)
            if chat is not None and chat.tool_grammar:  # the template's tool-call grammar
                constraint = ConstraintSpec("gbnf", chat.tool_grammar)
            if constraint is not None and (kind == "completion" or constraint.kind == "gbnf"):
                constraint = replace(
                    constraint,
                    lazy=guidance.lazy,
                    triggers=guidance.triggers,
                    grammar_type=guidance.grammar_type,
                    generation_prompt=guidance.generation_prompt,
                )
            budget_fields = reasoning_budget_fields(
                fields, self._special_tokens, self.reasoning_budget
            )
            # common_sampler_init makes a budget sampler only on these conditions
            budget = budget_fields if budget_fields.active(guidance.lazy) else None
            echoed = guidance.echoed()  # a chat's: what its template set
            if chat is not None and chat.params is None:
                echoed.pop("generation_prompt")  # a template not followed: shown as before
            task.update(echoed)
            params = self._with_biases(body, params)
            stop = parse_stop(body) + (chat.additional_stops if chat is not None else ())
            if constraint is not None or budget is not None or params.dry_multiplier:
                # common_sampler_init's refusals: the grammar (its triggers, its prefill), then
                # the chain (DRY's breakers)
                self._guided_sampler(params, constraint, budget, guidance.generation_prompt)
        except (SamplerError, TemplateError) as err:
            raise RequestError(str(err)) from None
        except ConstraintError as err:
            raise RequestError(str(err), reason=err.reason) from None
        extras: dict[str, Any] = {
            "chat_parser": None if chat is None else chat.parser(),
            "preserved_tokens": guidance.preserved,
            "generation_prompt": guidance.generation_prompt,
            "reasoning_budget": budget,
        }
        delimiters = self._message_delimiters(body, kind)
        out = []
        for prompt_text, tokens in prompts:
            self._check_context(tokens)
            out.append(
                Request(
                    kind,
                    tokens,
                    params,
                    constraint,
                    task["n_predict"] if task["n_predict"] != -1 else self.n_predict,
                    stop,
                    max(params.n_probs, 0),
                    task["cache_prompt"],
                    prompt_text,
                    post_sampling,
                    task["n_indent"],
                    task["t_max_predict_ms"],
                    task,
                    find_spans(tokens, delimiters),
                    **extras,
                )
            )
        return out

    def _special_tokens(self, text: str) -> list[int]:
        """common_tokenize(text, add_special=false, parse_special=true)."""
        return self.tokenize(text, parse_special=True)

    def chat_sampling_fields(self, body: Mapping[str, Any], chat: ChatTask) -> dict[str, Any]:
        """A chat task's grammar and budget fields as llama-server's oaicompat_chat_params_parse
        sets them before its schema reads them (``grammar_fields``, ``reasoning_budget_fields``):
        the template's ``grammar_lazy``, ``grammar_triggers``, ``preserved_tokens`` and
        ``generation_prompt`` whatever the body says, and the body's own budget fields unless the
        template has thinking tags (it sets them then: ``ChatTask.sampling_fields``)."""
        out: dict[str, Any] = {k: body[k] for k in BUDGET_FIELDS if k in body}
        out.update(chat.sampling_fields())
        if chat.params is None and body.get("reasoning_budget_start_tag") is not None:
            out["generation_prompt"] = self._generation_prompt(body)
        return out

    @property
    def chat_defaults(self) -> ChatDefaults:
        """The server's chat settings (its flags)."""
        return ChatDefaults(
            reasoning_format=self.reasoning_format,
            reasoning=self.reasoning,
            chat_template_kwargs=dict(self.chat_template_kwargs),
            reasoning_budget=self.reasoning_budget,
            reasoning_budget_message=self.reasoning_budget_message,
        )

    def _guided_sampler(
        self,
        params: SamplerParams,
        spec: ConstraintSpec | None,
        budget: ReasoningBudgetSpec | None,
        generation_prompt: str,
    ) -> GuidedSampler:
        """common_sampler_init: the grammar (a lazy one with its triggers), the reasoning budget
        (``budget``: None where llama-server makes none, ``ReasoningBudgetSpec.active``), both
        given the generation prompt's tokens where they take them, and the chain. Raises
        ConstraintError or SamplerError as llama-server refuses."""
        grammar = (
            Constraint(
                spec, self.llg_tokenizer(), self.n_vocab, self.tokenizer.eog_ids, self._pieces
            )
            if spec is not None
            else None
        )
        rbudget = (
            ReasoningBudget.of(budget, self._text_pieces.__getitem__)
            if budget is not None
            else None
        )
        prefill: list[int] = []
        wanted = rbudget is not None or (
            grammar is not None and spec is not None and spec.needs_prefill
        )
        if generation_prompt and wanted:
            tokens = self._special_tokens(generation_prompt)
            prefill = prefill_tokens(generation_prompt, tokens, self._pieces)
        return GuidedSampler(self._new_sampler(params), grammar, rbudget, prefill)

    def _message_delimiters(
        self, body: Mapping[str, Any], kind: str
    ) -> list[tuple[str, list[int]]]:
        """The role markers llama-server finds message starts by, for its context checkpoints
        (a sliding-window model only): a chat prompt's come from the template's analysis, a
        /completion body may give its own ``message_delimiters`` ([{role, delimiter}])."""
        if self.slots[0].checkpoints is None:  # not a sliding-window model
            return []
        if kind == "chat" and not self.jinja:  # the built-in templates give none
            return []
        if kind == "chat":
            with self._lazy_lock:
                if self._chat_delimiters is None:
                    markers = [
                        ("assistant", _checkpoints.assistant_start_marker(self.apply_template)),
                        ("user", _checkpoints.user_start_marker(self.apply_template)),
                    ]
                    self._chat_delimiters = [
                        (role, self.tokenize(text, parse_special=True))
                        for role, text in markers
                        if text
                    ]
                return self._chat_delimiters
        given = body.get("message_delimiters")
        if not isinstance(given, list):  # json_value: anything but an array reads as none
            return []
        return [
            (  # only "user" counts (find_spans)
                d["role"] if isinstance(d.get("role"), str) else "",
                self.tokenize(str(d.get("delimiter", "")), parse_special=True),
            )
            for d in given
            if isinstance(d, dict)
        ]

    def _with_biases(self, body: Mapping[str, Any], params: SamplerParams) -> SamplerParams:
        """logit_bias, then ignore_eos's -inf on every end-of-generation token (appended, as
        llama-server appends its logit_bias_eog)."""
        biases: tuple[LogitBias, ...] = params.logit_bias
        if body.get("logit_bias") is not None:
            biases = parse_logit_bias(
                body["logit_bias"], self.n_vocab, lambda text: self.tokenize(text)
            )
        ignore_eos = bool_field(body, "ignore_eos", params.ignore_eos)
        if ignore_eos and body.get("ignore_eos") is not None:
            biases += tuple(LogitBias(-float("inf"), t) for t in sorted(self.tokenizer.eog_ids))
        return replace(params, logit_bias=biases, ignore_eos=ignore_eos)

    def chat_prompt_tokens(self, body: Mapping[str, Any]) -> list[int]:
        """The tokens a chat body's prompt evaluates (its template, messages and logprobs checks
        as a chat's, nothing else; no context check): POST /chat/completions/input_tokens."""
        return self._chat_prompt(dict(body))[1]

    def chat_prompt_text(self, body: Mapping[str, Any]) -> str:
        """The prompt of a chat body, checked as a chat's (/apply-template without Jinja)."""
        return self._chat_task(dict(body)).prompt

    def _chat_prompt(self, body: dict[str, Any]) -> tuple[str, list[int]]:
        text = self._chat_task(body).prompt
        return text, self._chat_tokens(text)

    def _chat_tokens(self, text: str) -> list[int]:
        return self.tokenize(text, add_special=True, parse_special=True)

    def _chat_task(self, body: dict[str, Any]) -> ChatTask:
        """The body's chat task (chat_task.py): its messages and fields checked, the template
        applied as llama-server applies it."""
        if not self.jinja:
            return self._builtin_chat_task(body)
        messages = check_chat_messages(body)
        chat_logprobs(body)
        if self.template is None:
            raise RequestError("this model has no chat template")
        options = chat_render_options(body)
        kwargs = body.get("chat_template_kwargs")
        kwargs = kwargs if isinstance(kwargs, dict) else {}
        constraint = resolve_constraint(body, "chat")
        schema = (
            json.loads(constraint.source)
            if constraint is not None and constraint.kind == "chat_schema"
            else None
        )
        return chat_task(
            self.template,
            body,
            self.chat_defaults,
            add_generation_prompt=options["add_generation_prompt"],
            continue_final_message=options["continue_final_message"],
            json_schema=schema,
            render=lambda: self.apply_template(
                messages, tools=body.get("tools"), **options, **kwargs
            ),
        )

    def _builtin_chat_task(self, body: dict[str, Any]) -> ChatTask:
        """The chat task without Jinja (--no-jinja): tools refused, the template's text read as
        one of llama.cpp's built-in templates (chat_task.builtin_chat_task)."""
        refuse_tools_without_jinja(body)
        check_chat_messages(body)
        chat_logprobs(body)
        if self.template is None:
            raise RequestError("this model has no chat template")
        options = chat_render_options(body)
        resolve_constraint(body, "chat")  # its refusals, in llama-server's order
        return builtin_chat_task(
            self.template,
            body,
            self.chat_defaults,
            add_generation_prompt=options["add_generation_prompt"],
            continue_final_message=options["continue_final_message"],
        )

    def _continuation(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """What a continued last message does to a chat's answer: its content starts the
        answer's (``prefill``); a stream sends it with the first piece unless
        ``continue_final_message`` asked for the continuation without ``echo``
        (``prefill_streamed``)."""
        assert self.template is not None  # _chat_prompt rendered the messages
        continuation = chat_render_options(body)["continue_final_message"]
        return {
            "prefill": self.template.continued_content(body["messages"], continuation)
            if self.jinja
            else "",  # without Jinja the answer is the generated text alone
            "prefill_streamed": continuation is None or body.get("echo") is True,
        }

    def _generation_prompt(self, body: Mapping[str, Any]) -> str:
        """The assistant-turn text a chat schema's grammar starts with (checked by _chat_prompt)."""
        assert self.template is not None
        if not self.jinja:  # the built-in templates give the chat parser none
            return ""
        kwargs = body.get("chat_template_kwargs") or {}
        return self.template.generation_prompt(body["messages"], body.get("tools"), **kwargs)

    def _completion_prompts(self, body: Mapping[str, Any]) -> list[tuple[str, list[int]]]:
        """tokenize_input_prompts: an array without integers is several prompts, anything else one.
        Each prompt's text is its tokens detokenized with special tokens, as /completion reports it."""
        if "prompt" not in body:
            raise RequestError("[json.exception.out_of_range.403] key 'prompt' not found")
        prompt = body["prompt"]
        if isinstance(prompt, list) and not any(is_integer(p) for p in prompt):
            if not prompt:
                raise RequestError('"prompt" must not be empty')
            parts = [self._subprompt(p) for p in prompt]
        else:
            parts = [self._subprompt(prompt)]
        return [
            (self.tokenizer.detokenize(tokens, unparse_special=True), tokens) for tokens in parts
        ]

    def _infill_prompt(self, body: Mapping[str, Any]) -> tuple[str, list[int]]:
        """llama-server's /infill prompt (infill.py), with the server's -b, -n, a slot's
        context and --spm-infill."""
        tokens = infill_tokens(
            body,
            self.tokenizer.special,
            lambda text, add, parse: self.tokenize(text, add_special=add, parse_special=parse),
            self.tokenizer.add_bos,
            self.n_batch_flag,
            self.n_predict,
            self.n_ctx,
            self.spm_infill,
        )
        tokens = self._valid_ids(tokens)
        return self.tokenizer.detokenize(tokens, unparse_special=True), tokens

    def _subprompt(self, prompt: Any) -> list[int]:
        """tokenize_input_subprompt: a string, ids, ids mixed with strings, or {"prompt_string": ...}."""
        if isinstance(prompt, str) or is_mixed(prompt):
            return self._mixed_prompt(prompt)
        if isinstance(prompt, list) and all(is_integer(t) for t in prompt):
            return self._valid_ids(prompt)
        if isinstance(prompt, dict) and "prompt_string" in prompt:
            if "multimodal_data" in prompt:
                raise RequestError(
                    "Multimodal data provided, but model does not support multimodal requests."
                )
            return self._mixed_prompt(prompt["prompt_string"])
        raise RequestError(
            '"prompt" elements must be a string, a list of tokens, a JSON object containing a '
            "prompt string, or a list of mixed strings & tokens."
        )

    def _valid_ids(self, ids: Sequence[int]) -> list[int]:
        if any(t < 0 or t >= self.n_vocab for t in ids):
            raise RequestError("Prompt contains invalid tokens")
        return list(ids)

    def _mixed_prompt(self, prompt: Any) -> list[int]:
        """tokenize_mixed: a string, or strings and ids (special tokens parsed; BOS per the vocabulary
        only before a leading string)."""
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special=True, parse_special=True)
        if not isinstance(prompt, list):
            raise RequestError(
                f"[json.exception.type_error.302] type must be string, but is {json_type(prompt)}"
            )
        out: list[int] = []
        for i, part in enumerate(prompt):
            if isinstance(part, str):
                out += self.tokenize(part, add_special=i == 0, parse_special=True)
            elif isinstance(part, (int, float)) and not isinstance(part, bool):
                out += self._valid_ids([int(part)])  # get<llama_token>() truncates a float
            else:
                raise RequestError(
                    f"[json.exception.type_error.302] type must be number, but is {json_type(part)}"
                )
        return out

    def _check_context(self, tokens: Sequence[int]) -> None:
        if len(tokens) >= self.n_ctx:  # each slot's context
            message = (
                f"request ({len(tokens)} tokens) exceeds the available context size ({self.n_ctx} "
                f"tokens), try increasing it"
            )
            raise RequestError(
                message,
                400,
                {
                    "error": {
                        "code": 400,
                        "message": message,
                        "type": "exceed_context_size_error",
                        "n_prompt_tokens": len(tokens),
                        "n_ctx": self.n_ctx,
                    }
                },
            )

    # --- embeddings -----------------------------------------------------------------------------------------

    def prompt_tokens(self, prompt: Any) -> list[int]:
        """One input as llama-server's tokenize_input_subprompt reads it (a string, ids, ids
        mixed with strings, {"prompt_string": ...}); RequestError with its messages."""
        return self._subprompt(prompt)

    def embedding_inputs(self, prompt: Any) -> list[list[int]]:
        """An embedding body's ``input`` (or ``content``) tokenized as llama-server's
        handle_embeddings_impl reads it: an array holding no number is several inputs, anything
        else one; each as ``prompt_tokens``. An empty array is refused with its message."""
        if isinstance(prompt, list) and not any(
            isinstance(p, (int, float)) and not isinstance(p, bool) for p in prompt
        ):
            parts = [self._subprompt(p) for p in prompt]
        else:
            parts = [self._subprompt(prompt)]
        if not parts:
            raise RequestError('"input" must not be empty')
        return parts

    def hidden_states(self, tokens: Sequence[int]) -> np.ndarray:
        """llama.cpp's ``t_embd`` of every token of one input (Model.hidden_states), computed
        in the slot llama-server would choose for it, in micro-batches of -ub. An embedding is
        stateless there (its prompt is evaluated from position 0) and leaves its tokens and
        cells in the slot until the slot's next task (``_release_embedding``)."""
        slot, _ = self.choose_slot(tokens)
        self._acquire(slot)
        self.forget_cells()  # its cells are not placed (embedding_batches places a request's)
        kept = False
        self._keep_checkpoint_values(slot)
        try:
            slot.tokens = []
            rows = self.model.hidden_states(tokens, slot.cache, self.n_ubatch)
            kept = self.keeps_embeddings
            return rows
        finally:
            self._release_embedding(slot, tokens, kept)

    @property
    def keeps_embeddings(self) -> bool:
        """Whether a slot keeps an embedding's tokens and K/V after it, for a later prompt to
        reuse, as llama-server's slot does (``cache_n`` of the next completion that shares its
        prefix): a decoder on the exact path (a sliding-window model's ring with it, so the
        reuse is decided by its ``pos_min`` as a completion's). Elsewhere the slot keeps the
        input's tokens for the choice by similarity only (``Slot.embedded``), its cache
        emptied."""
        return bool(getattr(self.model, "exact", False))

    def _release_embedding(
        self, slot: Any, tokens: Sequence[int], kept: bool, splits: bool = False
    ) -> None:
        """An embedding's slot afterwards, free: holding the input's tokens with its cells
        (``kept``: the cache holds them), else an empty cache naming the input for the slot
        choice alone. Its context checkpoints stay, as llama-server's: an embedding that cannot
        be split (every pooling but ``last``) skips the prompt-reuse step that erases them, so
        the ones an earlier completion left still serve a later prompt; one that can be
        (``splits``) starts from position 0 there and erases those past it."""
        if splits and slot.checkpoints is not None:
            slot.checkpoints.items = [c for c in slot.checkpoints.items if c.pos_max <= 0]
        if kept:
            slot.tokens, slot.embedded = list(tokens), []
            slot.holds_embedding = True
        else:
            slot.cache.truncate(0)
            slot.tokens, slot.embedded = [], list(tokens)
        self._release(slot)

    @staticmethod
    def _keep_checkpoint_values(slot: Any) -> None:
        """Before an embedding is evaluated in ``slot``'s cache: its context checkpoints stay
        (``_release_embedding``), and each now keeps the sliding layers' K/V it covers, as
        llama-server's checkpoint holds them, since the embedding overwrites those positions
        in the position store a restore would otherwise read."""
        if slot.checkpoints is None:
            return
        slot.checkpoints.items = [
            c if c.values is not None else replace(c, values=slot.cache.window_values(c.ring))
            for c in slot.checkpoints.items
        ]

    def hidden_states_batch(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """``hidden_states`` of each input, as many calls one after the other would give them.
        The slots are taken and left as llama-server takes them for one request's tasks
        (``embedding_batches``); the inputs' computation does not depend on which. Where the
        model computes several inputs together (``Model.hidden_states_batch`` where it
        ``shares_passes``; an encoder's), they share its passes, each over a cache of its own
        of its slot's type and attended cells; otherwise each is its own ``hidden_states``."""
        plan = self.embedding_batches(inputs)
        return self.compute_hidden_states(inputs, (), plan)

    def compute_hidden_states(
        self,
        inputs: Sequence[Sequence[int]],
        together: Sequence[Sequence[int]] = (),
        plan: EmbeddingPlan | None = None,
    ) -> list[np.ndarray]:
        """The hidden states of ``hidden_states_batch``, except the groups of ``together``
        (``evaluated_together``), each evaluated as one micro-batch in its order. ``plan``
        (``embedding_batches``'; none: a replay's) says where the inputs' cells go after: the
        inputs whose slot keeps them are computed in their slot's cache and left there, as
        llama-server's slot holds its last embedding, and the saved ones are copied to the host
        prompt cache in their order."""
        keep = plan.keep if plan is not None else {}
        saved = plan.saved if plan is not None else []
        held = {i: slot.cache for i, slot in keep.items()}
        held.update({i: self._embedding_cache(self.cache, len(inputs[i])) for i, _ in saved})
        out: list[Any] = [None] * len(inputs)
        kv_size = self.kv_size
        lengths = [len(tokens) for tokens in inputs]
        for group in together:
            group_inputs = [inputs[i] for i in group]
            kept = [held.get(i) for i in group]
            states = self.model.hidden_states_together(
                group_inputs,
                kv_size,
                self.cache.cache_type,
                kept,
                self.batch_cells(group, plan, lengths),
            )
            for i, rows in zip(group, states, strict=True):
                out[i] = rows
        alone = [i for i in range(len(inputs)) if out[i] is None]
        caches = [
            held[i] if i in held else self._embedding_cache(self.cache, len(inputs[i]))
            for i in alone
        ]
        batch = getattr(self.model, "hidden_states_batch", None)
        shares = getattr(self.model, "shares_passes", True)  # an encoder decides per pass
        if batch is None or not shares or len(alone) < 2:
            for i, cache in zip(alone, caches):
                out[i] = self.model.hidden_states(inputs[i], cache, self.n_ubatch)
        else:
            for i, rows in zip(alone, batch([inputs[i] for i in alone], caches, self.n_ubatch)):
                out[i] = rows
        for i, slot in keep.items():  # the cache holds the input now
            slot.tokens, slot.embedded = list(inputs[i]), []
            slot.holds_embedding = True
        placement = plan.placement if plan is not None and plan.placement else {}
        window = int(getattr(getattr(self.model, "hp", None), "swa_window", 0) or 0)
        for i, checkpoints in saved:
            cells = self._placed_cells(placement.get(i), window)
            if self.host_cache.save(inputs[i], held[i], checkpoints, cells):
                self.host_cache.update()
        return out

    def embedding_batches(
        self, inputs: Sequence[Sequence[int]], splits: bool = False
    ) -> EmbeddingPlan:
        """The batches in which llama-server ``-np N`` evaluates one request's embedding
        inputs (in request order), each listed in the batch's order, with the slots taken and
        left as it takes and leaves them; and the inputs whose slot keeps them after it (the
        last each slot took, where the engine ``keeps_embeddings``), for
        ``compute_hidden_states`` to compute in that slot's cache. ``splits``: the inputs can
        be split (pooling ``last``), so their slots' checkpoints past position 0 go.

        Its tasks go to the idle slots in request order, each to the slot ``choose_slot``
        picks (the first time, the least recently used, the last of equals: slots N-1, N-2,
        ...), the tasks beyond the idle slots waiting for the next update; an update evaluates
        the busy slots' prompts in one batch in slot order, then releases them in slot order,
        which orders their ``t_last_used`` for the next request. That holds while every group
        fits ``-ub`` and no other request's task joins; ``evaluated_together`` and
        ``pooled_together`` follow the batches only that far."""
        # the first launch saves every slot to the host cache (where the book knows their
        # cells, with them), then empties the cache (cells_known)
        empties = self._tracks_cells and self.clear_idle_slots and self.free_slots() == self.n_slots
        batches = []
        placement: dict[int, Placed] = {}
        last: dict[int, tuple[int, Any]] = {}  # slot id: the last input it took, and the slot
        clears = self.keeps_embeddings and self.kv_unified and self.clear_idle_slots
        saved: list[tuple[int, list[Any]]] = []
        taken: list[tuple[Any, int]] = []
        i = 0
        while i < len(inputs):
            previous, taken = taken, []
            while i < len(inputs) and (not taken or self.free_slots() > 0):
                slot, _ = self.choose_slot(inputs[i])
                if clears and not taken:
                    # this launch saves the previous batch's other slots, in slot order
                    saved += [
                        (index, [] if held.checkpoints is None else list(held.checkpoints.items))
                        for held, index in previous
                        if held is not slot
                    ]
                self._acquire(slot)
                if empties:
                    self.cells, empties = self._new_cells(), False
                taken.append((slot, i))
                i += 1
            taken.sort(key=lambda pair: pair[0].id)
            self._place_batch(taken, inputs, placement)
            for slot, index in taken:
                # a kept input's cache is filled by compute_hidden_states; meanwhile its
                # tokens are named for the choice by similarity
                self._release_embedding(slot, inputs[index], False, splits)
                self._keep_checkpoint_values(slot)
                last[slot.id] = (index, slot)
            batches.append([index for _, index in taken])
        keep = dict(last.values()) if self.keeps_embeddings else {}
        if clears and batches:
            # each launch clears the idle slots: the last batch's alone keep their inputs
            keep = {index: slot for index, slot in keep.items() if index in batches[-1]}
        return EmbeddingPlan(batches, keep, saved, placement)

    def _place_batch(
        self,
        taken: Sequence[tuple[Any, int]],
        inputs: Sequence[Sequence[int]],
        placement: dict[int, Placed],
    ) -> None:
        """A batch's cells in the shared cache, where they are known: each slot clears its own
        sequence as its task starts, then the batch (in slot order) takes the cells
        find_slot gives it; the cells stay its slots' until their next task. A batch over
        ``-ub`` is evaluated otherwise: the cells are not known after it."""
        cells = self.cells
        if cells is None:
            return
        lengths = [len(inputs[index]) for _, index in taken]
        if sum(lengths) > self.n_ubatch:
            self.cells = None
            return
        for slot, _ in taken:
            cells.seq_rm(slot.id)
        try:
            idx = cells.place(
                np.concatenate([np.full(n, slot.id) for (slot, _), n in zip(taken, lengths)]),
                np.concatenate([np.arange(n) for n in lengths]),
            )
        except ValueError:  # no room: llama-server's decode fails there
            self.cells = None
            return
        cuts = np.cumsum(lengths)[:-1]
        n_kv = cells.n_kv()
        if isinstance(cells, IswaCells):
            swa_n_kv = cells.swa.n_kv()
            for (_, index), own, swa in zip(
                taken, np.split(idx, cuts), np.split(cells.swa_placed, cuts)
            ):
                placement[index] = Placed(own, n_kv, swa, swa_n_kv)
            return
        for (_, index), own in zip(taken, np.split(idx, cuts)):
            placement[index] = Placed(own, n_kv)

    def batch_cells(
        self, group: Sequence[int], plan: EmbeddingPlan | None, lengths: Sequence[int]
    ) -> BatchCells | None:
        """The cells ``group`` (a batch evaluated together) took, where they are not the
        batch's rows from cell 0 of an empty cache (None: those, or not known)."""
        placement = plan.placement if plan is not None else None
        if not placement or any(i not in placement for i in group):
            return None
        first = placement[group[0]]
        cells = [placement[i].cells for i in group]
        total = sum(lengths[i] for i in group)
        every = np.concatenate(cells)
        from_0 = np.array_equal(every, np.arange(total))
        from_0 = from_0 and first.n_kv == kv_length(total, self.kv_size)
        if first.swa_cells is None:
            return None if from_0 else BatchCells(cells, first.n_kv)
        swa = [np.asarray(placement[i].swa_cells, np.int64) for i in group]
        # the sliding layers' cells past the batch are hidden, so their n_kv changes no bit
        if from_0 and np.array_equal(np.concatenate(swa), np.arange(total)):
            return None
        return BatchCells(cells, first.n_kv, swa, first.swa_n_kv)

    def followed_batches(
        self, batches: Sequence[Sequence[int]], lengths: Sequence[int]
    ) -> list[list[int]]:
        """The batches of two inputs or more whose inputs share one micro-batch (with ``-kvu``;
        an encoder always), up to the first that does not fit ``-ub`` (which changes the
        batches after it: not followed)."""
        if not self.shares_micro_batch:
            return []
        followed = []
        for batch in batches:
            if sum(lengths[i] for i in batch) > self.n_ubatch:
                break
            if len(batch) >= 2:
                followed.append(list(batch))
        return followed

    def cells_known(self, n_tokens: int, all_idle: bool) -> bool:
        """Whether bankml knows the cells a micro-batch of ``n_tokens`` of several inputs takes
        as far as its bits go (``Model.hidden_states_together`` over an f16 cache). Below
        ``FA_TILE_Q`` tokens ggml attends one row at a time and skips the hidden cells, so
        where the batch sits does not count. From there on the tiles run over the cells from
        cell 0, and the batch must be placed from cell 0 of an empty cache: ``-kvu`` with
        ``--cache-idle-slots`` (each task's launch clears the idle slots, each slot its own
        sequence when its task starts, and llama_kv_cache's head goes back to the first cell
        freed) and every slot idle when the request came (``all_idle``); elsewhere the cells
        depend on what the other slots hold. Over a q8_0 cache ggml attends one row at a time
        at any size, so the cells never count."""
        if n_tokens < FA_TILE_Q or self.cache.cache_type == "q8_0":
            return True
        return self.kv_unified and self.clear_idle_slots and all_idle

    def evaluated_together(
        self,
        batches: Sequence[Sequence[int]],
        lengths: Sequence[int],
        all_idle: bool = True,
        plan: EmbeddingPlan | None = None,
    ) -> list[list[int]]:
        """The batches (``embedding_batches``, ``followed_batches``) that bankml evaluates as one
        micro-batch, in its order, as llama-server does (``compute_hidden_states``'s
        ``together``): where the model ``follows_micro_batches`` and the batch's cells are
        known (``cells_known``). From ``FA_TILE_Q`` tokens in the micro-batch every input's
        states depend on where it sits, and below it on the products' row count where they are
        not row-independent (docs/modules/embeddings.md); elsewhere each input stays alone.
        ``plan`` (``embedding_batches``') knows a batch's cells where the shared cache's are
        followed (``Engine.cells``): there an input alone in its batch is a group of its own
        too, where it sits elsewhere than from cell 0 of an empty cache."""
        if not getattr(self.model, "follows_micro_batches", False):
            return []
        placement = (plan.placement if plan is not None else None) or {}
        followed = self.followed_batches(batches, lengths)
        out = []
        for batch in batches:
            if batch in followed:
                if self.cells_known(sum(lengths[i] for i in batch), all_idle) or all(
                    i in placement for i in batch
                ):
                    out.append(list(batch))
            elif len(batch) == 1 and self._attends_apart(batch, plan, lengths):
                out.append(list(batch))
        return out

    def _attends_apart(
        self, batch: Sequence[int], plan: EmbeddingPlan | None, lengths: Sequence[int]
    ) -> bool:
        """Whether an input alone in its batch attends otherwise than alone in an empty cache:
        from ``FA_TILE_Q`` tokens over an f16 cache, at cells ``plan`` knows are others."""
        if sum(lengths[i] for i in batch) < FA_TILE_Q or self.cache.cache_type == "q8_0":
            return False
        return self.batch_cells(batch, plan, lengths) is not None

    def pooled_together(
        self,
        batches: Sequence[Sequence[int]],
        lengths: Sequence[int],
        all_idle: bool = True,
        plan: EmbeddingPlan | None = None,
    ) -> list[list[int]]:
        """The batches whose inputs' ``mean`` llama-server pools in one product over the
        micro-batch (pooling.mean_rows with ``beside_others``), in request order, where bankml
        has its states: the batches ``evaluated_together``, and, on a model whose products are
        row-independent (``Model.rows_independent``), the other batches whose states are each
        input's own: below ``FA_TILE_Q`` tokens, and at any size over a q8_0 cache (ggml attends
        over q8_0 cells one row at a time, skipping the hidden ones, whatever the micro-batch).
        Elsewhere not followed (each input's own vectors, docs/modules/embeddings.md)."""
        together = self.evaluated_together(batches, lengths, all_idle, plan)
        own = bool(getattr(self.model, "rows_independent", False))
        return [
            sorted(batch)
            for batch in self.followed_batches(batches, lengths)
            if batch in together
            or own
            and (sum(lengths[i] for i in batch) < FA_TILE_Q or self.cache.cache_type == "q8_0")
        ]

    @property
    def shares_micro_batch(self) -> bool:
        """Whether prompts of several slots go in one micro-batch whole: with ``-kvu``
        (without it llama.cpp cuts a batch into equal shares of every sequence)."""
        return self.kv_unified

    def _embedding_cache(self, cache: Any, n: int) -> Any:
        """A cache for one input of ``n`` tokens that attends as ``cache`` would: its type,
        and the cells ggml attends over (kernels.exact_attention.kv_length: the used cells
        padded to 256, at most the cache's), so as few cells as that allows; a model with a
        sliding window gets the slot's size whole (its ring's cells follow it)."""
        n_ctx = int(getattr(cache, "n_ctx", n))  # an encoder's NoCache: no size
        if not getattr(self.model, "has_sliding_window", False):
            n_ctx = min(n_ctx, pad_cells(max(n, 1)))
        return self.model.new_cache(n_ctx, cache.cache_type)

    # --- running --------------------------------------------------------------------------------------------

    def _new_sampler(self, params: SamplerParams) -> Sampler:
        return Sampler(params, self._vocab_info, self.n_vocab)

    def run_steps(
        self,
        request: Request,
        cancelled: Callable[[], bool] = lambda: False,
        progress: bool = False,
    ) -> Steps:
        """Prefill then generate in a slot chosen when the run starts (``choose_slot``);
        iterate for Chunks (and, with ``progress``, a ``Progress`` before the first batch and
        after each), then read ``.summary``. ``.coroutine`` yields each forward pass as a
        ``Forward`` too, for the caller to compute and send back."""
        return Steps(lambda steps: self._run(request, cancelled, steps.summary, progress))

    def _prefill(
        self,
        slot: Slot,
        tokens: list[int],
        cache_prompt: bool,
        cancelled: Callable[[], bool],
        spans: MessageSpans | None = None,
        clock: Clock | None = None,
    ) -> Generator[Progress | Forward, Any, tuple[int, Any]]:
        """Reuse the slot's common prefix (re-evaluating the last prompt token when all of it is
        cached; for a sliding-window model, as far as llama-server's checkpoints allow), then
        evaluate the rest in llama-server's batches. Yields a ``Progress`` when the prefix is
        known and after each batch, when given the run's ``clock``; returns (cache_n, last
        logits or None if cancelled)."""
        n_past = longest_common_prefix(slot.tokens, tokens) if cache_prompt else 0
        cache = slot.cache
        if slot.checkpoints is not None:
            n_past = slot.checkpoints.reuse(
                n_past, len(tokens), len(slot.tokens), cache.pos_min, cache.load_ring
            )
        if n_past == len(tokens):
            n_past -= 1
        cache.truncate(n_past)
        slot.tokens = slot.tokens[:n_past]
        if clock is not None:
            yield prompt_progress(clock, len(tokens), n_past, n_past, False, slot.id)
        logits = None
        start = n_past
        while start < len(tokens):
            end = self._batch_end(slot, start, len(tokens), spans or MessageSpans())
            for a, b in micro_batches(start, end, self.n_ubatch):
                if cancelled():
                    return n_past, None
                batch = tokens[a:b]
                logits = yield Forward(self.model, batch, cache, prompt=True)
                slot.tokens += batch
            start = end
            if clock is not None:
                yield prompt_progress(clock, len(tokens), n_past, end, True, slot.id)
        return n_past, logits

    def _batch_end(self, slot: Slot, start: int, n_prompt: int, spans: MessageSpans) -> int:
        """Where llama-server's prompt batch from ``start`` ends; for a sliding-window model the
        checkpoint it takes before decoding that batch is recorded here."""
        ckpts = slot.checkpoints
        if ckpts is None:
            return min(start + self.n_batch, n_prompt)
        end = _checkpoints.batch_end(start, n_prompt, spans, ckpts.items, ckpts.min_step)
        cache = slot.cache
        pos_min = cache.pos_min
        if _checkpoints.takes_checkpoint(
            start, end, n_prompt, pos_min, spans, ckpts.items, ckpts.min_step
        ):
            ckpts.create(
                start,
                pos_min,
                cache.pos_max,
                slot.task_id,
                cache.ring_positions(),
                cache.state_nbytes(self.host_cache.n_streams, window_only=True),
            )
        return end

    def _use_host_cache(self, slot: Slot, prompt: list[int]) -> None:
        """llama-server's --cache-ram (one cache for all slots): keep the slot's context (and
        its checkpoints) for later, bring back a better one."""
        if not self.host_cache.enabled:
            return
        self._save_to_host_cache(slot)
        entry = self.host_cache.take_better(slot.tokens, prompt)
        if entry is not None:
            slot.cache.restore(entry.kv, len(entry.tokens))
            self._place_loaded(slot, entry)
            if entry.ring is not None:
                slot.cache.load_ring(entry.ring)  # the ring as the entry held it
            slot.tokens = list(entry.tokens)
            if slot.checkpoints is not None:
                slot.checkpoints.items = list(entry.checkpoints)
        self.host_cache.update()

    def _run(
        self, req: Request, cancelled: Callable[[], bool], summary: Summary, progress: bool = False
    ) -> Generator[Chunk | Progress | Forward | Waiting, Any, None]:
        clock = Clock(t_start=time.perf_counter())
        tokens = req.prompt_tokens
        summary.prompt_tokens = len(tokens)
        shared = req.shared
        try:
            if not tokens:
                return
            if shared is not None and req.shared_child:
                slot, update_cache = self.free_slot(), False
            else:
                slot, update_cache = self.choose_slot(tokens)
            if req.cache_prompt and update_cache:
                # with the slot's choice, before the launch saves and clears the idle slots
                self._use_host_cache(slot, tokens)
            self._acquire(slot)
            held = self._set_cells_aside(req, slot)
            followed = False
            try:
                yield from self._generate(slot, req, cancelled, summary, clock, progress)
            finally:
                self._release(slot)
                if held is not None and held.laid_out:
                    followed = slot.cache.follows
                    slot.cache.unfollow()
            self._place_run(held, slot, summary, followed)
        finally:
            if shared is not None and not req.shared_child:
                shared.abandon()  # a parent that ended before its prompt did: children compute
        if req.chat_parser is not None and not summary.cancelled:
            # llama-server parses the finished answer as its chat format: an output the format
            # does not match ends the request with its 500 (the slot has finished as usual)
            req.chat_parser(summary.text, False)

    def _generate(
        self,
        slot: Slot,
        req: Request,
        cancelled: Callable[[], bool],
        summary: Summary,
        clock: Clock,
        progress: bool,
    ) -> Generator[Chunk | Progress | Forward | Waiting, Any, None]:
        tokens = req.prompt_tokens
        summary.slot = slot.id
        sampler = self._guided_sampler(
            req.sampler, req.constraint, req.reasoning_budget, req.generation_prompt
        )
        cache_n, logits = yield from self._prompt(slot, req, cancelled, clock, progress)
        prompt_n = len(tokens) - cache_n
        summary.timings = clock.timings(cache_n, prompt_n, 0)
        if logits is None:
            summary.cancelled = True
            return
        for t in tokens:
            sampler.accept(t, generated=False)
        if self.speculative is not None:  # the prompt is evaluated: the drafters see it
            self.speculative.begin(slot.id, slot.tokens)
        release = TextRelease(req.stop)
        lines = LineLimits(req.n_indent, req.t_max_predict_ms)
        eog = self.tokenizer.eog_ids
        n_gen = 0
        raw = b""
        drafts = DraftStats()
        # tokens drawn while checking a draft, not yet answered: all but the last are in the
        # cache already (speculative decoding)
        drawn: deque[int] = deque()

        def timings(n: int) -> dict[str, Any]:
            return drafts.added_to(clock.timings(cache_n, prompt_n, n))

        while True:
            if cancelled():
                summary.cancelled = True
                break
            spec_token = bool(drawn)
            if drawn:
                token = drawn.popleft()
            else:
                token, logits = self._draw(sampler, logits, req)
                self._accept(sampler, token)
            n_gen += 1
            now = time.perf_counter()
            if n_gen == 1:
                clock.t_prompt = now
            clock.t_gen = now
            summary.tokens.append(token)
            # a preserved token's text shows, control token or not (accept_special_token)
            piece = (
                self._pieces[token] if token in req.preserved_tokens else self._text_pieces[token]
            )
            raw += piece
            released, hit_stop = release.push(piece, token in eog)
            entry = None
            if released is not None and req.n_probs > 0 and spec_token:
                # llama-server gives a drafted answer's tokens probability 1 and no candidates
                entry = self._entry(TokenProbs([], 1.0), token, released, req.post_sampling_probs)
            elif released is not None and req.n_probs > 0:
                probs = (
                    post_sampling_probs(sampler.last, req.n_probs, token)
                    if req.post_sampling_probs and sampler.last is not None
                    else token_logprobs(logits, req.n_probs, token)
                )
                entry = self._entry(probs, token, released, req.post_sampling_probs)
            yield Chunk(
                released.decode("utf-8", "replace") if released else "",
                entry,
                n_gen == 1,
                token,
                timings(n_gen),
                slot.id,
            )
            finish = self._finish(slot, req, token, n_gen, hit_stop, eog)
            # n_indent / t_max_predict_ms come after the limits and before EOG in process_token
            if lines.stops(
                release, piece if released is None else released, (now - clock.t_prompt) * 1e3
            ):
                finish = "stop" if token in eog else "length"
            if finish:
                summary.finish_reason = finish
                if finish == "length" and not self.context_shift and self._context_full(slot):
                    summary.truncated = True  # stopped by the context, not by n_predict
                break
            if drawn:  # drafted tokens the pass took: the next is answered without a pass
                continue
            if self.context_shift and self._context_full(slot):
                summary.n_discarded += self._shift_context(slot, req)
                summary.truncated = True
            draft = self._draft(slot, req, token, n_gen)
            if not draft:
                logits = yield Forward(self.model, [token], slot.cache)
                slot.tokens.append(token)
                continue
            # the sampled token and the draft in one pass, every row's logits
            n_before = len(slot.tokens)
            rows = yield Forward(self.model, [token, *draft], slot.cache, all_logits=True)
            taken = accept_draft(
                sampler.sample, lambda t: self._accept(sampler, t), rows, draft, eog.__contains__
            )
            slot.cache.truncate(n_before + len(taken))  # the rejected draft's cells emptied
            slot.tokens += [token, *taken[:-1]]
            drafts.record(len(draft), len(taken) - 1)
            assert self.speculative is not None
            self.speculative.accept(slot.id, len(taken) - 1)
            drawn.extend(taken)
        summary.text = release.text.decode("utf-8", "replace")
        summary.stopping_word = release.stopping_word
        summary.completion_tokens = n_gen
        summary.timings = timings(n_gen)

    def _prompt(
        self,
        slot: Slot,
        req: Request,
        cancelled: Callable[[], bool],
        clock: Clock,
        progress: bool,
    ) -> Generator[Progress | Forward | Waiting, Any, tuple[int, Any]]:
        """The prompt in the slot: (cache_n, its last logits; None when cancelled). A shared
        prompt's child takes its parent's (``SharedPrompt``: no progress, the parent's prompt
        start for its timings); a parent publishes its own when its prefill ends."""
        shared = req.shared
        if shared is not None and req.shared_child:
            if (yield from shared.join(slot, cancelled)):
                clock.t_start = shared.t_start
                return shared.cache_n, shared.logits.copy()  # its own: sampling may write it
            if cancelled():
                return 0, None
        cache_n, logits = yield from self._prefill(
            slot,
            req.prompt_tokens,
            req.cache_prompt,
            cancelled,
            req.spans,
            clock if progress else None,
        )
        if shared is not None and not req.shared_child:
            shared.publish(slot, cache_n, logits, clock.t_start)
        return cache_n, logits

    def set_batch_sizes(self, n_batch: int, n_ubatch: int) -> bool:
        """llama-server's -b and -ub (llama_context caps the micro-batch by the batch). A
        sliding-window model keeps the defaults (its prompt cuts and its SWA cache are sized by
        them): False when it was asked for others."""
        n_ubatch = min(n_ubatch, n_batch)
        self.n_batch_flag = int(n_batch)
        if self.slots[0].checkpoints is not None:
            return (n_batch, n_ubatch) == (_checkpoints.N_BATCH, MICRO_BATCH)
        self.n_batch, self.n_ubatch = int(n_batch), int(n_ubatch)
        return True

    def _draw(self, sampler: GuidedSampler, logits: Any, req: Request) -> tuple[int, Any]:
        """The next token, and the logits as the rest of the step reads them. Logits left on
        the GPU by the decode step (``DeviceLogits``) are read only as far as the draw needs
        (device_sampling.choice): the device's greedy choice, the top-k pairs, or the row."""
        if not isinstance(logits, DeviceLogits):
            return sampler.sample(logits), logits
        mode, k = choice(sampler, req.n_probs, self.n_vocab)
        biases = bias(sampler.sampler.params) if mode != FULL else None
        assert biases is not False  # choice says FULL then
        if mode == GREEDY and biases is None:
            return logits.greedy(), logits
        if mode in (GREEDY, TOP_K):
            pairs = logits.top_k(1 if mode == GREEDY else k, biases)
            if pairs is not None:
                if mode == GREEDY:  # the biased row's first largest
                    return int(pairs[0][0]), logits
                return draw_from_top_k(sampler.sampler, *pairs), logits
        row = logits.host()
        return sampler.sample(row), row

    @staticmethod
    def _accept(sampler: GuidedSampler, token: int) -> None:
        try:
            sampler.accept(token)
        except GrammarStackError as err:  # a lazy grammar that cannot take its trigger
            raise RequestError(f"got exception: {err}", status=500) from None

    def _draft(self, slot: Slot, req: Request, sampled: int, n_gen: int) -> list[int]:
        """llama-server's draft for the next pass (--spec-type), within get_n_draft_max; none
        without speculative decoding."""
        if self.speculative is None:
            return []
        limit = draft_limit(slot.n_ctx, len(slot.tokens), req.n_predict, n_gen)
        if limit <= 0:
            return []
        return self.speculative.draft(slot.id, slot.tokens, sampled, limit)

    @staticmethod
    def _context_full(slot: Slot) -> bool:
        """No room for the next token (llama-server: prompt.n_tokens() + 1 >= n_ctx)."""
        return len(slot.tokens) + 1 >= slot.n_ctx

    def _shift_context(self, slot: Slot, req: Request) -> int:
        """llama-server's context shift (pre_decode, --context-shift): keep the request's
        ``n_keep`` first tokens (-1: the whole prompt; one more where the vocabulary adds BOS;
        at most n_ctx - 4), drop ``n_discard`` after them (0: half of the rest; at most all of
        it but one), move the rest down. Returns the number dropped."""
        if req.shared is not None:  # llama-server refuses it for a prompt computed once for all
            raise RequestError("context shift cannot be used for shared prompt", status=500)
        n_keep = int(req.options.get("n_keep", 0))
        n_keep = len(req.prompt_tokens) if n_keep < 0 else n_keep
        if self.tokenizer.add_bos:
            n_keep += 1
        n_keep = min(slot.n_ctx - 4, n_keep)
        n_left = len(slot.tokens) - n_keep
        n_discard = int(req.options.get("n_discard", 0)) or n_left // 2
        n_discard = min(max(n_discard, 0), max(0, n_left - 1))
        if n_discard:
            self.model.shift_context(slot.cache, n_keep, n_discard)
            slot.tokens = slot.tokens[:n_keep] + slot.tokens[n_keep + n_discard :]
        return n_discard

    def _finish(
        self, slot: Slot, req: Request, token: int, n_gen: int, hit_stop: bool, eog: frozenset[int]
    ) -> str | None:
        """process_token's order: stop word, context full (unless the context shifts), n_predict,
        then EOG."""
        finish = "stop" if hit_stop else None
        if (
            not self.context_shift
            and self._context_full(slot)
            or finish is None
            and req.n_predict != -1
            and n_gen >= req.n_predict
        ):
            finish = "length"
        if token in eog:
            finish = "stop"
        return finish

    def _entry(self, probs: TokenProbs, token: int, released: bytes, post_sampling: bool) -> dict:
        """A probabilities entry in llama-server's shape: ``logprob``/``top_logprobs`` from the raw
        logits, or with post_sampling_probs ``prob``/``top_probs`` from the chain's candidates."""
        key, top_key = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")
        value: Callable[[float], float] = (lambda p: p) if post_sampling else logarithm
        top = []
        for tid, p in probs.top:
            piece = self._text_pieces[tid]
            top.append(
                {"id": tid, "token": utf8_prefix_text(piece), "bytes": list(piece), key: value(p)}
            )
        return {
            "id": token,
            "token": utf8_prefix_text(released),
            "bytes": list(released),
            key: value(probs.p_token),
            top_key: top,
        }


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
