"""Slot files: one of the engine's slots (its tokens and KV cache) saved to and restored from disk.

The format, little-endian::

    b"bankML slot v1\\n"
    model sha256, 64 ASCII characters (right-padded with "0")
    u64 n_ctx, u64 n_tokens, u64 n_layers
    per layer: u64 width (n_head_kv * head_dim; bit 63 set for a q8_0 cache), then
        K then V for positions 0..n_tokens-1, each position's heads in order:
        f16: n_tokens * width u16 values;  q8_0: n_tokens * width / 32 blocks of 34 bytes
        (f16 scale, then 32 int8 values), as ggml's block_q8_0
    tokens, u32 each
    sha256 (32 bytes) of everything before it

A save writes ``<name>.tmp`` and renames it, so a crash never leaves half a file under the name.
A restore checks, in this order, and names the first failure: not a slot file, damaged (sha256),
another model, another context size, too many tokens, another layer count, another cache type,
another cache shape, truncated, trailing data, a token outside the vocabulary. Any failure
leaves the slot empty (as llama-server's ``prompt_clear``). Each of those takes the slot's id
(``engine.slots[id_slot]``; an engine without ``slots`` is its own one slot). No Twisted here:
the bridge runs them on the engine thread, between scheduler steps (never on a slot that is
processing: the resource refuses that first).

``copy_slot`` makes one slot a copy of another, in memory: the engine's runs of a prompt's
further completions start from their parent's computed prompt (schedule.SharedPrompt).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from bankml.engine_cupy.backend import to_host
from bankml.engine_cupy.device_model import DeviceCache

MAGIC = b"bankML slot v1\n"
Q8_FLAG = 1 << 63
U64 = struct.Struct("<Q")
BLOCK = 32
Q8_BLOCK_BYTES = 34


class SlotError(Exception):
    """A slot file that cannot be restored; the message is the reason llama-server would add
    after ``Unable to restore slot: ``."""


@dataclass
class SlotResult:
    n_tokens: int
    n_bytes: int
    ms: float


class _OneSlot:
    """The slot of an engine object without ``slots`` (a one-slot engine's attributes)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @property
    def cache(self) -> Any:
        return self.engine.cache

    @property
    def tokens(self) -> list[int]:
        return list(self.engine.slot_tokens)

    @tokens.setter
    def tokens(self, tokens: list[int]) -> None:
        self.engine.slot_tokens = tokens

    @property
    def checkpoints(self) -> Any:
        return getattr(self.engine, "checkpoints", None)


def slot_of(engine: Any, id_slot: int = 0) -> Any:
    """The slot ``id_slot`` of ``engine`` (its cache, tokens and checkpoints)."""
    slots = getattr(engine, "slots", None)
    return slots[id_slot] if slots is not None else _OneSlot(engine)


def _sha_field(sha256: str) -> bytes:
    return sha256.encode("ascii", "replace")[:64].ljust(64, b"0")


def _geometry(cache: Any) -> tuple[int, int, str]:
    """(n_layers, width, cache_type) of a KVCache."""
    return len(cache._k), cache.n_head_kv * cache.head_dim, cache.cache_type


def _layer_bytes(cache: Any, store: Any, n: int) -> bytes:
    """One layer's K or V for positions 0..n-1, position-major, in the file's encoding."""
    if isinstance(cache, DeviceCache):  # f16 bits on the device: the file's bytes already
        bits = to_host(store[:, :n]).transpose(1, 0, 2)
        return np.ascontiguousarray(bits).astype("<u2").tobytes()
    if cache.cache_type == "f16":
        values = store[:, :n].transpose(1, 0, 2)  # [n, kv, hd]
        return np.ascontiguousarray(to_host(values).astype("<f2")).tobytes()
    q, d = store
    qs = to_host(q[:, :n]).transpose(1, 0, 2)  # [n, kv, hd] int8
    ds = to_host(d[:, :n]).transpose(1, 0, 2)  # [n, kv, hd/32] f16
    blocks = np.empty(qs.shape[:2] + (qs.shape[2] // BLOCK, Q8_BLOCK_BYTES), np.uint8)
    blocks[..., :2] = np.ascontiguousarray(ds.astype("<f2")).view(np.uint8).reshape(ds.shape + (2,))
    blocks[..., 2:] = qs.reshape(qs.shape[:2] + (-1, BLOCK)).view(np.uint8)
    return blocks.tobytes()


def save_slot(engine: Any, path: str, model_sha256: str, id_slot: int = 0) -> SlotResult:
    """Write the engine's slot ``id_slot`` to ``path`` (through ``path.tmp``); the bytes
    written. A save that fails (a full disk, say) removes its ``path.tmp`` and leaves ``path``
    as it was."""
    tmp = path + ".tmp"
    try:
        return _write_slot(slot_of(engine, id_slot), path, tmp, model_sha256)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_slot(slot: Any, path: str, tmp: str, model_sha256: str) -> SlotResult:
    t0 = time.perf_counter()
    cache = slot.cache
    tokens = list(slot.tokens)
    n = len(tokens)
    n_layers, width, cache_type = _geometry(cache)
    h = hashlib.sha256()
    written = 0
    with open(tmp, "wb") as f:

        def put(data: bytes) -> None:
            nonlocal written
            h.update(data)
            f.write(data)
            written += len(data)

        put(
            MAGIC
            + _sha_field(model_sha256)
            + U64.pack(cache.n_ctx)
            + U64.pack(n)
            + U64.pack(n_layers)
        )
        for layer in range(n_layers):
            put(U64.pack(width | (Q8_FLAG if cache_type == "q8_0" else 0)))
            put(_layer_bytes(cache, cache._k[layer], n))
            put(_layer_bytes(cache, cache._v[layer], n))
        put(np.asarray(tokens, dtype="<u4").tobytes())
        digest = h.digest()
        f.write(digest)
        written += len(digest)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return SlotResult(n, written, (time.perf_counter() - t0) * 1e3)


def erase_slot(engine: Any, id_slot: int = 0) -> int:
    """Empty the slot ``id_slot``; the number of tokens it held."""
    _cells_unknown(engine)
    return _erase(slot_of(engine, id_slot))


def _cells_unknown(engine: Any) -> None:
    """The engine's record of the shared cache's cells (Engine.cells) no longer holds."""
    forget = getattr(engine, "forget_cells", None)
    if forget is not None:
        forget()


def _erase(slot: Any) -> int:
    # an embedding's input counts as held, as llama-server's slot keeps it (Slot.embedded)
    n = len(slot.tokens) + len(getattr(slot, "embedded", ()))
    slot.tokens, slot.embedded, slot.holds_embedding = [], [], False
    slot.cache.truncate(0)
    _forget_checkpoints(slot)
    return n


def copy_slot(src: Any, dst: Any) -> int:
    """Slot ``dst`` becomes a copy of slot ``src``, as llama-server's ``copy_state_to`` makes a
    child task's slot of its parent's (seq_rm then seq_cp of the whole sequence, the prompt
    cloned with its checkpoints): the K and V of every position, the sliding-window cache's
    cells as they are laid out (bookkeeping and ring), the tokens and the context checkpoints
    (the saved checkpoints are shared, never written after they are taken). Plain array copies;
    both slots belong to one engine (the same cache geometry). The number of positions."""
    source, target = src.cache, dst.cache
    n = source.n_tokens
    if isinstance(target, DeviceCache):  # on the GPU: the sequence copied on the device
        target.copy_from(source)
        dst.tokens = list(src.tokens)
        return n
    everything = slice(None)
    target.copy_layout(source)  # a context shift's cell layout, when the source has one
    for mine, theirs in zip(target._k + target._v, source._k + source._v):
        target._copy_cells(theirs, mine, slice(0, n), slice(0, n))
    for rings, src_rings in ((target._ring_k, source._ring_k), (target._ring_v, source._ring_v)):
        for layer, ring in src_rings.items():
            target._copy_cells(ring, rings[layer], everything, everything)
    if source.swa is not None:
        target.swa.pos[:] = source.swa.pos
        target.swa.head = source.swa.head
    target.advance(n)  # the ring's layout was copied: it is not laid out afresh
    dst.tokens = list(src.tokens)
    if getattr(src, "checkpoints", None) is not None:
        dst.checkpoints.items = list(src.checkpoints.items)
    return n


def _forget_checkpoints(slot: Any) -> None:
    """llama-server's erase and restore clear the slot's prompt, its context checkpoints too."""
    if getattr(slot, "checkpoints", None) is not None:
        slot.checkpoints.clear()


def restore_slot(engine: Any, path: str, model_sha256: str, id_slot: int = 0) -> SlotResult:
    """Load ``path`` into the engine's slot ``id_slot``, or raise SlotError (the slot is then
    empty)."""
    t0 = time.perf_counter()
    slot = slot_of(engine, id_slot)
    _cells_unknown(engine)
    try:
        n, size = _restore(slot, int(engine.n_vocab), path, model_sha256)
    except SlotError:
        _erase(slot)
        raise
    return SlotResult(n, size, (time.perf_counter() - t0) * 1e3)


def _max_file_bytes(cache: Any) -> int:
    n_layers, width, cache_type = _geometry(cache)
    per_pos = width * 2 if cache_type == "f16" else width // BLOCK * Q8_BLOCK_BYTES
    header = len(MAGIC) + 64 + 3 * 8
    return header + n_layers * (8 + 2 * cache.n_ctx * per_pos) + 4 * cache.n_ctx + 32


def _read_bounded(path: str, limit: int) -> bytes:
    """The file, refused as 'trailing data' past what any slot of this engine can hold (so a
    huge file is never read whole); a missing file is llama-server's load failure."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise SlotError(f"cannot read {os.path.basename(path)}: {err.strerror or err}") from None
    if len(data) > limit:
        if not data.startswith(MAGIC):
            raise SlotError("not a bankML slot file")
        raise SlotError("the slot file has trailing data")
    return data


def _restore(slot: Any, n_vocab: int, path: str, model_sha256: str) -> tuple[int, int]:
    cache = slot.cache
    data = _read_bounded(path, _max_file_bytes(cache))
    if not data.startswith(MAGIC):
        raise SlotError("not a bankML slot file")
    if len(data) < len(MAGIC) + 64 + 24 + 32 or hashlib.sha256(data[:-32]).digest() != data[-32:]:
        raise SlotError("the slot file is damaged (its sha256 does not match)")
    body = memoryview(data)[:-32]
    pos = len(MAGIC)
    if bytes(body[pos : pos + 64]) != _sha_field(model_sha256):
        raise SlotError("the slot was saved for another model")
    pos += 64
    n_ctx, n, n_layers = (U64.unpack_from(body, pos + 8 * i)[0] for i in range(3))
    pos += 24
    if n_ctx != cache.n_ctx:
        raise SlotError(
            f"the slot was saved with a {n_ctx}-token context, this engine has {cache.n_ctx}"
        )
    if n > cache.n_ctx:
        raise SlotError("Restored prompt does not fit in the slot context")
    my_layers, width, cache_type = _geometry(cache)
    if n_layers != my_layers:
        raise SlotError("the slot's layers do not match this model")
    layers = []
    for _ in range(n_layers):
        if pos + 8 > len(body):
            raise SlotError("truncated")
        word = U64.unpack_from(body, pos)[0]
        pos += 8
        saved_type = "q8_0" if word & Q8_FLAG else "f16"
        if saved_type != cache_type:
            raise SlotError(
                f"the slot was saved with a {saved_type} cache, this engine keeps {cache_type}"
            )
        if word & ~Q8_FLAG != width:
            raise SlotError("the slot's cache shape does not match this model")
        per = n * (width * 2 if cache_type == "f16" else width // BLOCK * Q8_BLOCK_BYTES)
        if pos + 2 * per > len(body):
            raise SlotError("truncated")
        layers.append((body[pos : pos + per], body[pos + per : pos + 2 * per]))
        pos += 2 * per
    if pos + 4 * n > len(body):
        raise SlotError("truncated")
    tokens = np.frombuffer(body[pos : pos + 4 * n], dtype="<u4").astype(np.int64)
    pos += 4 * n
    if pos != len(body):
        raise SlotError("the slot file has trailing data")
    if n and int(tokens.max()) >= n_vocab:
        raise SlotError("Invalid tokens in slot save file")
    for layer, (k, v) in enumerate(layers):
        _load_layer(cache, cache._k, layer, k, n)
        _load_layer(cache, cache._v, layer, v, n)
    cache.n_tokens = n
    _forget_checkpoints(slot)
    slot.tokens, slot.embedded, slot.holds_embedding = [int(t) for t in tokens], [], False
    return n, len(data)


def _load_layer(cache: Any, stores: list[Any], layer: int, raw: memoryview, n: int) -> None:
    xp = cache.xp
    kv, hd = cache.n_head_kv, cache.head_dim
    if isinstance(cache, DeviceCache):  # f16 bits on the device
        bits = np.frombuffer(raw, dtype="<u2").reshape(n, kv, hd).transpose(1, 0, 2)
        stores[layer][:, :n] = xp.asarray(np.ascontiguousarray(bits, dtype=np.uint16))
        return
    if cache.cache_type == "f16":
        values = np.frombuffer(raw, dtype="<f2").reshape(n, kv, hd).transpose(1, 0, 2)
        stores[layer][:, :n] = xp.asarray(values.astype(np.float32))
        return
    blocks = np.frombuffer(raw, dtype=np.uint8).reshape(n, kv, hd // BLOCK, Q8_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[..., :2]).view("<f2").reshape(n, kv, hd // BLOCK)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, kv, hd)
    stores[layer][0][:, :n] = xp.asarray(q.transpose(1, 0, 2))
    stores[layer][1][:, :n] = xp.asarray(d.transpose(1, 0, 2).astype(np.float16))
