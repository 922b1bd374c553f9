"""The engine's model on a GPU through the decode step (device_step.py): what ``Model.load``
returns for ``device="cuda"`` when ``device_step.unsupported`` finds nothing against the model.

``DeviceModel`` is a ``Model`` whose weights are ``DeviceWeights`` (the GGUF blocks on the
device) and whose caches are ``DeviceCache``s, each a ``DeviceSequence`` (a slot's K/V,
position, next token and logits on the device). ``forward(tokens, cache)`` runs a pass's tokens
before its last through the prefill without its head (device_prefill.py: the cache only, all
rows at once, in chunks of ``PREFILL_ROWS`` as llama-server's micro-batches, so the attention
scratch stays bounded; a chunk whose scratch does not fit the free memory is halved until one
does) and its last token through one decode step, so the logits a draw reads
are always a step's, whether the prompt was evaluated afresh or its last token re-evaluated
over held cells (docs/modules/device_model.md has the rule). It returns a ``DeviceLogits``: a
handle on the sequence's last logits, still on the device, that the
engine's draw reads only as far as the request needs (device_sampling.py): the greedy token the
step chose (4 bytes), the top-k pairs (2k + 1 ints), or the whole row (V floats). A token the
device already holds (the greedy choice read back) is not written again, so a greedy decode
step writes nothing and reads 4 bytes.

A slot's prompt reuses its common prefix with what the sequence holds, as on the CPU: the
engine truncates the cache to the prefix (``DeviceCache.truncate`` moves the position on the
device) and steps the rest; the prompt cache (--cache-ram) keeps its entries as device copies,
as the array path's do. Embeddings (``hidden_states``) come from the prefill's rows. Not on
this path: a q8_0 K/V cache; ``Model.load`` keeps the array path for a model the step does
not play, and on ROCm for one whose kernels hiprtc does not compile (``not_compiled_here``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy

from bankml.engine_cupy.cuda_loader import on_hip
from bankml.engine_cupy.device_prefill import DevicePrefill
from bankml.engine_cupy.device_step import (
    MAX_ROWS,
    DeviceMemory,
    DeviceSequence,
    DeviceStep,
    DeviceWeights,
)
from bankml.engine_cupy.kernels.progress import CompileStats
from bankml.engine_cupy.kv_cache import sequence_state_nbytes
from bankml.engine_cupy.model import Model
from bankml.engine_cupy.passes import PassLogits, pass_groups
from bankml.engine_cupy.weights import HParams, UnsupportedModel

F32 = numpy.float32
PREFILL_ROWS = 512  # a prompt's rows per prefill: llama-server's default micro-batch


class DeviceCache:
    """A slot's cache on the device: its ``DeviceSequence`` and what the host knows of it."""

    cache_type = "f16"
    fused_decode = False
    pos_min = 0

    def __init__(self, step: DeviceStep, n_ctx: int, seq: DeviceSequence | None = None) -> None:
        self.step = step
        self.seq: DeviceSequence = step.new_sequence(n_ctx) if seq is None else seq
        self.n_ctx = n_ctx
        self.known_token: int | None = 0  # the id seq.token holds, where the host knows it
        self.steps = 0  # steps run: a DeviceLogits is of one step

    @property
    def n_tokens(self) -> int:
        return self.seq.n_tokens

    @n_tokens.setter
    def n_tokens(self, n: int) -> None:
        """The sequence's length after its cells were written from outside (a slot restored):
        the position set on the device; the next token is written by the next step."""
        if not 0 <= n <= self.n_ctx:
            raise ValueError(f"{n} positions in a sequence of {self.n_ctx}")
        self.seq.pos.set(numpy.asarray([n], dtype=numpy.int32))
        self.seq.n_tokens = n
        self.known_token = None
        self.steps += 1

    # what slots.py's save and restore read: the layers' K and V (f16 bits [kv, n_ctx, hd])
    @property
    def n_head_kv(self) -> int:
        return self.step.hp.n_head_kv

    @property
    def head_dim(self) -> int:
        return self.step.hp.head_dim

    @property
    def xp(self) -> ModuleType:
        return self.step.cp

    @property
    def _k(self) -> list[Any]:
        return [self.seq.k[il] for il in range(self.step.hp.n_layer)]

    @property
    def _v(self) -> list[Any]:
        return [self.seq.v[il] for il in range(self.step.hp.n_layer)]

    def truncate(self, n: int) -> None:
        self.step.truncate(self.seq, n)

    def snapshot(self) -> list[Any]:
        """Copies of positions 0..n_tokens-1 of K and V, on the device (the prompt cache's
        entries, as the array path's KVCache.snapshot keeps them in its array module)."""
        n = self.n_tokens
        return [self.seq.k[:, :, :n].copy(), self.seq.v[:, :, :n].copy()]

    def state_nbytes(self, n_streams: int) -> int:
        """llama_state_seq_get_size of the sequence (KVCache.state_nbytes): f16 cells in every
        layer."""
        row = 2 * self.n_head_kv * self.head_dim
        return sequence_state_nbytes(self.n_tokens, [2 * row] * self.step.hp.n_layer, n_streams)

    def restore(self, snapshot: list[Any], n_tokens: int) -> None:
        """Put back what ``snapshot`` copied: positions 0..n_tokens-1."""
        k, v = snapshot
        self.seq.k[:, :, :n_tokens] = k
        self.seq.v[:, :, :n_tokens] = v
        self.n_tokens = int(n_tokens)

    def copy_from(self, source: DeviceCache) -> None:
        """This slot's sequence becomes a copy of ``source``'s (a shared prompt's child)."""
        self.step.copy_sequence(source.seq, self.seq)
        self.known_token = source.known_token
        self.steps += 1


class DeviceLogits:
    """The last logits of one sequence, on the device until asked for (module doc). Valid
    until that sequence's next step."""

    def __init__(self, cache: DeviceCache) -> None:
        self.cache = cache
        self.stamp = cache.steps
        self._host: numpy.ndarray | None = None

    def _check(self) -> None:
        if self.cache.steps != self.stamp:
            raise RuntimeError("these logits were overwritten by a later step of the sequence")

    def greedy(self) -> int:
        """The first largest logit's id, chosen on the device by the step: 4 bytes back."""
        self._check()
        token = self.cache.step.chosen(self.cache.seq)
        self.cache.known_token = token
        return token

    def top_k(
        self, k: int, bias: tuple[numpy.ndarray, numpy.ndarray] | None = None
    ) -> tuple[numpy.ndarray, numpy.ndarray] | None:
        """The k largest (ids, logits), largest first, ``bias`` added first (DeviceStep.top_k);
        None on a NaN."""
        self._check()
        return self.cache.step.top_k(self.cache.seq, k, bias)

    def host(self) -> numpy.ndarray:
        """The whole row on the host (V floats, read once)."""
        if self._host is None:
            self._check()
            self._host = self.cache.step.host_logits(self.cache.seq)
        return self._host

    def copy(self) -> numpy.ndarray:
        return self.host().copy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> numpy.ndarray:
        host = self.host()
        return host if dtype is None else host.astype(dtype)


def host_logits(logits: Any) -> Any:
    """A host row for whatever a forward pass returned (a DeviceLogits or host logits)."""
    return logits.host() if isinstance(logits, DeviceLogits) else logits


class DeviceModel(Model):
    """A Model run by the GPU decode step (module doc)."""

    def __init__(self, hp: HParams, xp: ModuleType, path: str, reader: Any, step: DeviceStep):
        super().__init__(hp, None, xp, path, reader, exact=False)  # type: ignore[arg-type]
        self.step = step
        self.prefill = DevicePrefill(xp, step.w, step.kernels)
        self._shares_passes = False

    @classmethod
    def upload(cls, xp: ModuleType, path: str, reader: Any, hp: HParams) -> DeviceModel:
        step = DeviceStep(xp, DeviceWeights.upload(xp, reader, hp))
        return cls(hp, xp, path, reader, step)

    @staticmethod
    def _check_cache_type(cache_type: str | None) -> None:
        if cache_type not in (None, "f16"):
            raise UnsupportedModel(
                f"the GPU decode step keeps an f16 K/V cache, not {cache_type}"
                " (BANKML_DEVICE_STEP=0 runs the array path, which has it)"
            )

    def new_cache(self, n_ctx: int, cache_type: str | None = None) -> Any:
        self._check_cache_type(cache_type)
        return DeviceCache(self.step, n_ctx)

    def new_caches(self, n: int, n_ctx: int, cache_type: str | None = None) -> list[Any]:
        """``n`` slots' caches in one ``SequencePool``: the engine's slots, whose decode steps
        ``forward_batch`` runs up to ``MAX_ROWS`` at a time in one batched step."""
        self._check_cache_type(cache_type)
        return [DeviceCache(self.step, n_ctx, seq) for seq in self.step.new_sequences(n, n_ctx)]

    def forward(self, tokens: Sequence[int], cache: DeviceCache, all_logits: bool = False) -> Any:
        """The tokens before the last through the prefill (the cache only), the last through
        one decode step: the logits sampling reads are always a step's (module doc). The last
        row's logits as a ``DeviceLogits`` (with ``all_logits``, every token's on the host: one
        step each)."""
        self._check_rows(tokens, cache)
        if len(tokens) > 1 and not all_logits:
            before = [int(t) for t in tokens[:-1]]
            self._in_chunks(
                before, PREFILL_ROWS, lambda ids: self.prefill.prefill(cache.seq, ids, logits=False)
            )
            tokens = tokens[-1:]
        rows = []
        for token in tokens:
            if cache.known_token != int(token):
                self.step.set_token(cache.seq, int(token))
            self.step.step(cache.seq)
            cache.known_token = None  # the step's argmax wrote it; not read yet
            cache.steps += 1
            if all_logits:
                rows.append(self.step.host_logits(cache.seq))
        if all_logits:
            return numpy.stack(rows)
        return DeviceLogits(cache)

    def forward_batch(self, tokens: Sequence[Sequence[int]], caches: Sequence[Any]) -> PassLogits:
        """One micro-batch for each of several sequences. The decode steps (one token each) of
        caches of one pool (``new_caches``: the engine's slots) go ``MAX_ROWS`` at a time
        through one batched step (``DeviceStep.step_rows``: each row's bits its own step's);
        the others (prompt chunks, a lone step) through ``forward`` in turn. Every sequence is
        checked before any cache changes."""
        if len(tokens) != len(caches):
            raise ValueError(f"{len(tokens)} micro-batches for {len(caches)} caches")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("each sequence needs a cache of its own")
        for toks, cache in zip(tokens, caches):
            self._check_rows(toks, cache)
        out: list[Any] = [None] * len(tokens)
        pools: dict[int, list[int]] = {}
        for i, (toks, cache) in enumerate(zip(tokens, caches)):
            if len(toks) == 1:
                pools.setdefault(id(cache.seq.pool), []).append(i)
        for group in pools.values():
            for start in range(0, len(group), MAX_ROWS):
                rows = group[start : start + MAX_ROWS]
                if len(rows) > 1:
                    self._step_rows([int(tokens[i][0]) for i in rows], [caches[i] for i in rows])
                    for i in rows:
                        out[i] = DeviceLogits(caches[i])
        for i, (toks, cache) in enumerate(zip(tokens, caches)):
            if out[i] is None:
                out[i] = self.forward(toks, cache)
        return PassLogits(out, pass_groups([len(t) for t in tokens], shares=False))

    def _step_rows(self, tokens: list[int], caches: list[DeviceCache]) -> None:
        """One decode step of each cache, all in one batched step (a token the device already
        holds is not written again)."""
        for token, cache in zip(tokens, caches):
            if cache.known_token != token:
                self.step.set_token(cache.seq, token)
        self.step.step_rows([cache.seq for cache in caches])
        for cache in caches:
            cache.known_token = None  # the step's argmax wrote it; not read yet
            cache.steps += 1

    def decode_batch(self, tokens: Sequence[int], caches: Sequence[Any]) -> numpy.ndarray:
        out = self.forward_batch([[int(t)] for t in tokens], caches)
        return numpy.stack([logits.host() for logits in out])

    def hidden_states(
        self, tokens: Sequence[int], cache: DeviceCache | None = None, n_ubatch: int = 512
    ) -> numpy.ndarray:
        """llama.cpp's ``t_embd`` of every token (``Model.hidden_states``' contract): the
        tokens through the prefill from position 0 of ``cache`` (cleared first; a new one of
        their length when None) in chunks of ``n_ubatch`` (at most ``PREFILL_ROWS``), each
        chunk's rows after the output norm read back (``DevicePrefill.hidden``), f32
        [n_tokens, n_embd] on the host. The GPU's arithmetic: near the exact path's rows, not
        its bits (f16 activations into cuBLAS, as for a prompt)."""
        if cache is None:
            cache = self.new_cache(max(len(tokens), 1))
        else:
            cache.truncate(0)
        self._check_rows(tokens, cache)
        ids = [int(t) for t in tokens]
        step = max(1, min(n_ubatch, PREFILL_ROWS))
        rows = self._in_chunks(ids, step, lambda chunk: self.prefill.hidden(cache.seq, chunk))
        cache.known_token = None  # the prefill leaves seq.token as it was: not read
        cache.steps += 1  # a DeviceLogits of this cache from before is stale now
        return numpy.ascontiguousarray(numpy.concatenate(rows) if len(rows) > 1 else rows[0])

    @staticmethod
    def _in_chunks(ids: list[int], rows: int, run: Callable[[list[int]], Any]) -> list[Any]:
        """``run`` over ``ids`` in chunks of ``rows``, in order: a chunk whose prefill scratch
        does not fit the device's free memory (``DeviceMemory``, raised before any launch, so
        nothing is half done) is tried again at half its rows, and later chunks keep the size
        that fitted; at one row the refusal stands. A long context's attention scores are the
        largest part of that scratch (rows x heads x context, f32)."""
        out, start = [], 0
        while start < len(ids):
            size = min(rows, len(ids) - start)
            try:
                out.append(run(ids[start : start + size]))
            except DeviceMemory:
                if size == 1:
                    raise
                rows = (size + 1) // 2
                continue
            start += size
        return out

    def shift_context(self, cache: DeviceCache, n_keep: int, n_discard: int) -> None:
        """llama-server's context shift (DeviceStep.shift)."""
        self.step.shift(cache.seq, n_keep, n_discard)

    def warm_up(
        self,
        cache_type: str | None = None,
        report: Callable[[str], None] | None = None,
        jobs: int = 1,
        alongside: Callable[[], None] | None = None,
    ) -> CompileStats:
        """Build each kernel the step launches (CuPy compiles it, or loads its cache)."""
        for name in self.kernel_names():
            self.step.kernels.function(name)
        if alongside is not None:
            alongside()
        return CompileStats()

    def kernel_names(self) -> list[str]:
        """The kernels the step and the prefill launch for this model, sorted."""
        names = {"rms_norm_q8_1", "rope_kv_f16", "attn_decode_f16", "swiglu_q8_1"}
        embd = f"get_rows_{self.step.w.embd_qtype.lower()}"
        names |= {"argmax_f32", "top_k_f32", embd, f"{embd}_n", "rope_kv_f16_n"}
        names |= {"add_rms_norm_f16", "attn_prefill_f16", "swiglu_f16", "advance_pos"}
        names |= {f"{n}_rows" for n in ("rms_norm_q8_1", "rope_kv_f16", "attn_decode_f16")}
        names |= {"swiglu_q8_1_rows", "argmax_f32_rows", f"{embd}_rows"}
        w = self.step.w
        for m in [w.output] + [getattr(layer, a) for layer in w.layers for a in _MATS]:
            names.add(f"mmvq_{m.qtype.lower()}")
            names.add(f"mmvq_{m.qtype.lower()}_rows")
            names.add(f"dequantize_f16_{m.qtype.lower()}")
        return sorted(names)

    def not_compiled_here(self) -> str | None:
        """On CuPy's HIP build (ROCm), why the step cannot run: every kernel it launches is
        compiled now (hiprtc), and the first that does not compile is the reason, so that the
        model keeps the array path rather than failing at its first request. On CUDA, None
        at once: the kernels compile in the warm-up or at first use, as they always have."""
        if not on_hip(self.xp):
            return None
        for name in self.kernel_names():
            try:
                self.step.kernels.function(name)
            except Exception as err:  # CuPy's CompileException, or no hiprtc at all
                why = str(err).strip().splitlines()
                return f"ROCm: kernel {name} does not compile here ({type(err).__name__}: " + (
                    f"{why[0]})" if why else "no message)"
                )
        return None


_MATS = ("q", "k", "v", "o", "gate", "up", "down")
