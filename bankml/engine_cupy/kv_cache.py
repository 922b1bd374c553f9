"""The KV cache: per layer, the keys and values of every position computed so far.

Two types, as llama-server's ``--cache-type-k/v``:

- ``f16`` (default): K and V are rounded to f16 on store, as ggml's f16 cache does. On the CPU
  the rounded values are kept in float32 arrays, because NumPy converts f16 to f32 slowly and
  attention would pay that conversion for every cell at every step; the values are the same
  bits as an f16 cache (``nbytes`` reports what is really held: 4 bytes per value).
- ``q8_0``: 32 int8 values and one f16 scale per block (34 bytes per 32 values), as ggml's
  ``quantize_row_q8_0``. Like llama.cpp, when the head size is a multiple of 64, K (and Q) are
  first turned by an orthonormal Walsh-Hadamard rotation in blocks of ``rot_k`` (64, doubled
  while it divides the head) and V in blocks of 64; attention's output is turned back.

On the CPU (xp is NumPy) both steps round as llama-server's: the rotation is ggml's fast
Walsh-Hadamard transform (``exact_ops.fwht``, what ``llama_mul_mat_hadamard`` runs), the store
is the AVX2 ``quantize_row_q8_0`` (``exact_matmul``'s). ggml's exact q8_0 attention
(``exact_attention.flash_attn_q8_0``) then takes ``rotate_k(q)`` and the ``quantized`` blocks,
and its output goes through ``output``. On CuPy the same steps are vectorised (a product by the
Hadamard matrix, a NumPy-style rounding), close but not bit-identical.

The vectorised attention reads ``keys(layer, end)``/``values(layer, end)`` as float32
[n_head_kv, end, head_dim] and asks ``query(q)`` for Q as the kernel sees it (f16-rounded, or
rotated and q8_0-rounded).

gemma3's sliding-window layers: llama.cpp keeps them in a smaller cache (``ring_size``) whose
cells are reused once their positions fall out of the window, so past that many positions its
cells are not in position order, and ggml's flash attention sums over cells in cell order. On
the exact path (``ring=True``) the cache keeps, besides the position-ordered store every layer
has (read by slot files, snapshots and truncation), a copy of each sliding layer in llama.cpp's
cell layout: ``Cells`` places each micro-batch as ``llama_kv_cache::find_slot`` and
``apply_ubatch`` do, and attention reads those cells, with their mask and ``n_kv``.

Memory: every store is allocated for the whole context and filled as positions are written, so
a slot holds in memory only the pages its positions reached. On the CPU the stores are private
anonymous mappings in 4 KiB pages (``zeroed``): NumPy asks the kernel for 2 MiB pages on arrays
of 4 MiB and more, and a store is laid out per KV head, so a first prompt of a few tokens
touched every head's region and made the kernel zero the whole store (a 3B model at
``-c 2048``: 448 MiB and about 0.6 s per slot's first prompt, measured on a 2-core AMD EPYC,
2026-12-07).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy

from bankml.engine_cupy.kernels import exact_matmul, exact_ops
from bankml.engine_cupy.kernels.exact_attention import KV_PAD, kv_length
from bankml.engine_cupy.kernels.jit import f16_round, njit
from bankml.engine_cupy.weights import quantize_activation

CACHE_TYPES = ("f16", "q8_0")
FA_TILE_Q = 64  # GGML_FA_TILE_Q: from this many rows ggml's CPU flash attention is tiled
CELL_PAD = KV_PAD  # llama.cpp pads n_ctx, the SWA cache size and n_kv to multiples of 256
N_UBATCH = 512  # llama-server's default -ub: the SWA cache holds the window plus one ubatch


def zeroed(xp: ModuleType, shape: tuple[int, ...], dtype: Any) -> Any:
    """A zero-filled store (module doc, "Memory"): on the CPU an anonymous mapping whose pages
    the kernel provides, 4 KiB at a time, when a position is first written; on a GPU xp's."""
    if xp is not numpy:
        return xp.zeros(shape, dtype)
    dtype = numpy.dtype(dtype)
    nbytes = int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
    if nbytes == 0:
        return numpy.zeros(shape, dtype)
    # private and anonymous (Python's default for -1 is shared memory): zero pages, freed with
    # the last view of them, never shared with a forked child
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    no_huge = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if no_huge is not None:  # where the kernel backs every mapping by huge pages
        pages.madvise(no_huge)
    # the array of the store's own shape over the mapping, so that a view of its first cells
    # has it as its base (exact_attention reads the store in place through that)
    return numpy.ndarray(shape, dtype, buffer=pages)


def pad_cells(n: int, pad: int = CELL_PAD) -> int:
    return -(-int(n) // pad) * pad


def ring_size(n_ctx: int, window: int, n_ubatch: int = N_UBATCH) -> int:
    """Cells of llama.cpp's SWA cache for one sequence (llama_kv_cache_iswa, no --swa-full):
    GGML_PAD(min(kv_size, n_swa + n_ubatch), 256), kv_size being n_ctx padded to 256 and the
    ubatch no larger than n_ctx (llama_context caps n_batch, then n_ubatch, by n_ctx)."""
    ubatch = min(int(n_ctx), n_ubatch)
    return pad_cells(min(pad_cells(n_ctx), int(window) + ubatch))


def find_cells(reusable: numpy.ndarray, used: int, head: int, n: int) -> numpy.ndarray:
    """llama_kv_cache::find_slot, not contiguous: the first ``n`` cells a micro-batch may take
    (``reusable``), tested one by one from ``head`` round the cache, from cell 0 instead when
    more than twice ``n`` cells before the head are free (``used``: the cells occupied)."""
    size = len(reusable)
    start = head if head <= used + 2 * n else 0
    order = numpy.concatenate([numpy.arange(start, size), numpy.arange(0, start)])
    found = order[reusable[order]][:n]
    if len(found) < n:
        raise ValueError("no free cell in the KV cache")
    return found.astype(numpy.int64)


def sequence_state_nbytes(n_cells: int, layer_rows: Sequence[int], n_streams: int) -> int:
    """The bytes llama_kv_cache::state_write gives one sequence of ``n_cells`` cells (what
    llama_state_seq_get_size counts): the stream count and each stream's cell count; then,
    where it holds cells, each cell's position, sequence count and sequence id, the V layout,
    layer count and rotation sizes, and per layer K's and V's type and row size with their
    rows (``layer_rows``: a layer's K plus V row bytes). V is never transposed here: bankml
    attends as flash attention does."""
    size = 4 + 4 * n_streams
    if n_cells:
        size += 12 * n_cells + 16 + sum(24 + n_cells * row for row in layer_rows)
    return size


class CellBook:
    """What llama_kv_cells keeps of a cache: the position each cell holds (-1: empty), and the
    head find_slot searches from."""

    size: int
    pos: numpy.ndarray
    head: int

    @property
    def used_max_p1(self) -> int:
        """llama_kv_cells::used_max_p1: one past the last occupied cell."""
        used = numpy.flatnonzero(self.pos >= 0)
        return int(used[-1]) + 1 if used.size else 0

    def n_kv(self) -> int:
        """llama_kv_cache::get_n_kv: the cells ggml attends over (occupied ones, padded)."""
        return kv_length(self.used_max_p1, self.size)


class SharedCells(CellBook):
    """Which sequence and position each cell of one KV cache holds when several sequences
    share it (llama-server's slots with ``-kvu``): the cells a micro-batch takes (``place``:
    find_slot, then apply_ubatch) and frees (``seq_rm``), so that a batch's cells are known
    where the other slots' sequences stay in theirs. ``window``: the SWA cache of a
    sliding-window model's sliding layers, whose cells are taken again once out of the window
    of their own sequence's next position."""

    def __init__(self, size: int, window: int | None = None):
        self.size = int(size)
        self.window = window
        self.seq = numpy.full(self.size, -1, numpy.int64)  # -1: empty
        self.pos = numpy.full(self.size, -1, numpy.int64)
        self.head = 0

    def seq_rm(self, seq: int, p0: int = 0) -> None:
        """seq_rm(seq, p0, -1): empty its cells from position ``p0`` (0: all of them); the head
        moves back to the first one freed if that is before it."""
        freed = numpy.flatnonzero((self.seq == seq) & (self.pos >= p0))
        self.seq[freed] = -1
        self.pos[freed] = -1
        if freed.size and freed[0] < self.head:
            self.head = int(freed[0])

    def in_order_alone(self, seq: int) -> bool:
        """Whether the cache holds ``seq`` alone, its positions 0..k-1 in cells 0..k-1, the head
        at k: its next micro-batches then take the next cells, as in a cache of its own."""
        held = numpy.flatnonzero(self.seq >= 0)
        k = held.size
        return (
            self.head == k
            and bool((self.seq[held] == seq).all())
            and numpy.array_equal(held, numpy.arange(k))
            and numpy.array_equal(self.pos[held], numpy.arange(k))
        )

    def place(self, seqs: numpy.ndarray, positions: numpy.ndarray) -> numpy.ndarray:
        """The cells of one micro-batch, its tokens in batch order (each its sequence and
        position); the head moves past the last. With a window, a cell whose position is out
        of the window of its sequence's next one is taken too, and the positions up to the
        last one taken from a sequence are emptied (apply_ubatch keeps each sequence's
        positions whole from its smallest)."""
        empty = self.seq < 0
        reusable = empty
        if self.window is not None:
            reusable = empty | (self._next_positions() - self.pos >= self.window)
        idx = find_cells(reusable, self.size - int(empty.sum()), self.head, len(seqs))
        overwritten = numpy.stack([self.seq[idx], self.pos[idx]])
        self.seq[idx] = seqs
        self.pos[idx] = positions
        for seq in numpy.unique(overwritten[0][overwritten[0] >= 0]):
            last = int(overwritten[1][overwritten[0] == seq].max())
            stale = (self.seq == seq) & (self.pos <= last)
            self.seq[stale] = -1
            self.pos[stale] = -1
        self.head = int(idx[-1]) + 1
        return idx

    def _next_positions(self) -> numpy.ndarray:
        """Per cell, its sequence's largest position + 1 (0 for an empty cell)."""
        out = numpy.zeros(self.size, numpy.int64)
        for seq in numpy.unique(self.seq[self.seq >= 0]):
            mine = self.seq == seq
            out[mine] = int(self.pos[mine].max()) + 1
        return out


class IswaCells:
    """The books of a sliding-window model's two caches (llama_kv_cache_iswa) when several
    sequences share them: the full layers' (``base``) and the sliding layers' smaller one
    (``swa``), which every micro-batch and removal reach alike. ``place`` returns the full
    layers' cells; the sliding layers' of the same micro-batch are ``swa_placed``."""

    def __init__(self, base: SharedCells, swa: SharedCells):
        self.base, self.swa = base, swa
        self.swa_placed = numpy.zeros(0, numpy.int64)

    def n_kv(self) -> int:
        return self.base.n_kv()

    def seq_rm(self, seq: int, p0: int = 0) -> None:
        self.base.seq_rm(seq, p0)
        self.swa.seq_rm(seq, p0)

    def place(self, seqs: numpy.ndarray, positions: numpy.ndarray) -> numpy.ndarray:
        # both take the micro-batch, or neither does (llama_kv_cache_iswa's prepare); the
        # sliding layers' book changes in place, as sequences' views of it (SequenceCells) hold it
        before = (self.swa.seq.copy(), self.swa.pos.copy(), self.swa.head)
        placed = self.swa.place(seqs, positions)
        try:
            idx = self.base.place(seqs, positions)
        except ValueError:
            self.swa.seq, self.swa.pos, self.swa.head = before
            raise
        self.swa_placed = placed
        return idx


class Cells(CellBook):
    """Which position each cell of one of llama.cpp's KV caches holds, for one sequence: the
    SWA cache of gemma3's sliding layers (``window``: cells whose position left the window of
    the next one are reused), or the whole cache once a context shift has made cell order
    differ from position order (``window`` None: a cell is reused only once emptied).

    ``place`` is llama_kv_cache::find_slot (not contiguous: cells tested one by one from the
    head) then apply_ubatch; ``remove`` is seq_rm(p0, p1), ``add`` seq_add.
    """

    def __init__(self, size: int, window: int | None):
        self.size, self.window = int(size), window
        self.pos = numpy.full(self.size, -1, numpy.int64)  # -1: empty
        self.head = 0

    @classmethod
    def in_order(cls, size: int, n: int) -> Cells:
        """A windowless cache whose first n cells hold positions 0..n-1, as a sequence placed
        from an empty cache leaves it."""
        cells = cls(size, None)
        cells.pos[:n] = numpy.arange(n)
        cells.head = n
        return cells

    def place(self, positions: numpy.ndarray) -> numpy.ndarray:
        """Cells for one micro-batch of consecutive positions; updates the bookkeeping."""
        n = len(positions)
        if n > self.size:
            raise ValueError(f"a micro-batch of {n} tokens does not fit {self.size} cells")
        pos = self.pos
        next_pos = int(pos.max()) + 1  # the sequence's largest position + 1
        reusable = pos < 0
        if self.window is not None:  # or out of the window of the next position
            reusable |= next_pos - pos >= self.window
        idx = find_cells(reusable, int((pos >= 0).sum()), self.head, n)
        overwritten = pos[idx]
        pos[idx] = positions
        if (overwritten >= 0).any():  # keep [pos_min, pos_max] whole, as apply_ubatch purges
            last = int(overwritten.max())
            stale = (pos >= 0) & (pos <= last)
            pos[stale] = -1
        self.head = int(idx[-1]) + 1
        return idx

    def remove(self, p0: int, p1: int | None = None) -> None:
        """seq_rm(seq, p0, p1): empty the cells of positions p0..p1-1 (p1 None: all from p0);
        the head moves back to the first freed cell if that is before it."""
        held = self.pos >= p0
        if p1 is not None:
            held &= self.pos < p1
        freed = numpy.flatnonzero(held)
        self.pos[freed] = -1
        if freed.size and freed[0] < self.head:
            self.head = int(freed[0])

    def remove_from(self, p0: int) -> None:
        """seq_rm(seq, p0, -1)."""
        self.remove(p0)

    def add(self, p0: int, p1: int, delta: int) -> numpy.ndarray:
        """seq_add(seq, p0, p1, delta): the cells of positions p0..p1-1 now hold position +
        delta (a cell pushed below 0 is emptied); returns the cells still held, in cell order."""
        moved = numpy.flatnonzero((self.pos >= p0) & (self.pos < p1))
        self.pos[moved] += delta
        gone = moved[self.pos[moved] < 0]
        self.pos[gone] = -1
        if gone.size and gone[0] < self.head:
            self.head = int(gone[0])
        return moved[self.pos[moved] >= 0]

    def held(self) -> numpy.ndarray:
        """What llama_state_seq_get_data writes of this cache (a context checkpoint, a prompt
        cache entry, a slot file): the occupied cells not masked for the largest position
        (is_masked_swa against seq_pos_max, so the last ``window`` positions), in cell order."""
        return held_positions(self.pos, self.window)

    def load(self, positions: numpy.ndarray) -> numpy.ndarray:
        """llama_state_seq_set_data of a checkpoint (state_read_meta): seq_rm the whole
        sequence, then find_slot and apply_ubatch for the saved cells in their saved order.
        Returns the cells they now occupy."""
        self.remove_from(0)
        return self.place(numpy.asarray(positions, numpy.int64)) if len(positions) else positions

    def holds(self, start: int, end: int) -> bool:
        """Whether every position start..end-1 is in a cell."""
        return bool(numpy.isin(numpy.arange(start, end), self.pos).all())

    def mask(self, q_pos: Any) -> numpy.ndarray:
        """f32 [n, used_max_p1]: 0 where query position q sees the cell, -inf where it is empty,
        later than q, or ``window`` or more before it (llama_kv_cache::set_input_kq_mask)."""
        return cells_mask(self.pos[: self.used_max_p1], q_pos, self.window)


def held_positions(pos: numpy.ndarray, window: int | None) -> numpy.ndarray:
    """Cells.held over the cells' positions ``pos`` (-1: a cell the sequence does not hold)."""
    occupied = pos >= 0
    if window is not None and occupied.any():
        occupied &= int(pos.max()) - pos < window
    return pos[occupied].copy()


def cells_mask(pos: numpy.ndarray, q_pos: Any, window: int | None) -> numpy.ndarray:
    """Cells.mask over the cells' positions ``pos`` (-1: a cell the sequence does not hold)."""
    p = pos[None, :]
    q = numpy.asarray(q_pos, numpy.int64)[:, None]
    hidden = (p < 0) | (p > q)
    if window is not None:
        hidden |= q - p >= window
    return numpy.where(hidden, numpy.float32(-numpy.inf), numpy.float32(0))


class SequenceCells:
    """One sequence's cells in a cache several sequences share (``SharedCells``), as a KVCache
    keeps a cell layout (``KVCache.follow``): ``place`` and ``remove_from`` go to the shared
    book, so a micro-batch takes the cells find_slot gives it round the other sequences';
    ``used_max_p1`` and ``n_kv`` are the whole cache's (what ggml attends over), and ``mask``
    hides every cell but this sequence's own (and, in a sliding layers' book, those out of the
    window)."""

    def __init__(self, book: SharedCells, seq: int):
        self.book, self.seq = book, int(seq)
        self.window = book.window

    @property
    def size(self) -> int:
        return self.book.size

    @property
    def pos(self) -> numpy.ndarray:
        """Each cell's position in this sequence (-1: empty or another sequence's)."""
        return numpy.where(self.book.seq == self.seq, self.book.pos, -1)

    @property
    def used_max_p1(self) -> int:
        return self.book.used_max_p1

    def n_kv(self) -> int:
        return self.book.n_kv()

    def place(self, positions: numpy.ndarray) -> numpy.ndarray:
        return self.book.place(numpy.full(len(positions), self.seq), positions)

    def remove_from(self, p0: int) -> None:
        self.book.seq_rm(self.seq, p0)

    def held(self) -> numpy.ndarray:
        return held_positions(self.pos, self.window)

    def holds(self, start: int, end: int) -> bool:
        return bool(numpy.isin(numpy.arange(start, end), self.pos).all())

    def load(self, positions: numpy.ndarray) -> numpy.ndarray:
        """Cells.load in the shared book: the sequence's cells emptied, then the saved ones
        placed round the other sequences' in their saved order."""
        self.remove_from(0)
        if not len(positions):
            return numpy.zeros(0, numpy.int64)
        return self.place(numpy.asarray(positions, numpy.int64))

    def mask(self, q_pos: Any) -> numpy.ndarray:
        return cells_mask(self.pos[: self.used_max_p1], q_pos, self.window)


class SequenceIswa:
    """One sequence's cells in both books of a sliding-window model's shared caches
    (``IswaCells``): ``base`` the full layers', ``swa`` the sliding layers'; ``place`` puts a
    micro-batch in both at once and returns both cell lists."""

    def __init__(self, book: IswaCells, seq: int):
        self.book, self.seq = book, int(seq)
        self.base, self.swa = SequenceCells(book.base, seq), SequenceCells(book.swa, seq)

    def place(self, positions: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
        idx = self.book.place(numpy.full(len(positions), self.seq), positions)
        return idx, self.book.swa_placed


def resolve_cache_type(cache_type: str | None, head_dim: int) -> str:
    """The cache type asked for (None or empty: f16), checked as llama-server checks it."""
    cache_type = cache_type or "f16"
    if cache_type not in CACHE_TYPES:
        raise ValueError(f'cache type "{cache_type}": bankML keeps f16 or q8_0')
    if cache_type == "q8_0" and head_dim % 32:
        raise ValueError(
            f"a q8_0 cache needs a head size that is a multiple of 32; this model's is {head_dim}"
        )
    return cache_type


@njit
def _store_f16(cells: numpy.ndarray, start: int, x: numpy.ndarray) -> None:  # pragma: no cover
    """cells[h, start + i, :] = x[i, h, :] rounded to f16 values: one pass, where NumPy's
    transpose, f16 cast and f32 write-back took three (~20 ms of a 256-token prefill)."""
    n, heads, dim = x.shape
    for i in range(n):
        for h in range(heads):
            for d in range(dim):
                cells[h, start + i, d] = f16_round(x[i, h, d])


def hadamard(n: int) -> numpy.ndarray:
    """The orthonormal Sylvester Walsh-Hadamard matrix of size n (a power of two); H @ H = I."""
    h = numpy.ones((1, 1), numpy.float32)
    while h.shape[0] < n:
        h = numpy.block([[h, h], [h, -h]])
    return (h / numpy.sqrt(numpy.float32(n))).astype(numpy.float32)


def rotation_sizes(head_dim: int) -> tuple[int, int]:
    """(rot_k, rot_v) as llama_kv_cache: none (0) unless the head is a multiple of 64."""
    if head_dim % 64:
        return 0, 0
    rot_k = 64
    while head_dim % (2 * rot_k) == 0:
        rot_k *= 2
    return rot_k, 64


class KVCache:
    """Keys and values of positions 0..n_tokens-1 for every layer of one sequence."""

    def __init__(
        self,
        xp: ModuleType,
        n_layer: int,
        n_head_kv: int,
        head_dim: int,
        n_ctx: int,
        cache_type: str | None = None,
        window: int = 0,
        sliding: tuple[bool, ...] = (),
        ring: bool = False,
        n_ubatch: int = N_UBATCH,
        exact: bool | None = None,
    ):
        """``window``/``sliding``: gemma3's sliding window and which layers use it; ``ring``:
        keep those layers in llama.cpp's SWA cell layout as well (the exact path), when its
        cache is smaller than n_ctx; ``n_ubatch``: llama-server's -ub, which sizes that cache;
        ``exact``: round as llama-server's CPU backend (default: when xp is NumPy; the model's
        array path passes False, so that on the CPU it runs the very code CuPy runs)."""
        self.xp = xp
        self.exact = xp is numpy if exact is None else bool(exact and xp is numpy)
        self.n_ctx = int(n_ctx)
        if self.n_ctx < 1:
            raise ValueError(f"n_ctx must be positive, not {n_ctx}")
        self.kv_size = pad_cells(self.n_ctx)  # llama_context pads n_ctx to 256 cells
        self.cache_type = resolve_cache_type(cache_type, head_dim)
        self._n_tokens = 0
        self.n_ubatch = int(n_ubatch)
        self.n_head_kv, self.head_dim = n_head_kv, head_dim
        shape = (n_head_kv, self.n_ctx, head_dim)
        if self.cache_type == "f16":
            self._k = [zeroed(xp, shape, xp.float32) for _ in range(n_layer)]
            self._v = [zeroed(xp, shape, xp.float32) for _ in range(n_layer)]
            self._rot = (None, None)
        else:
            blocks = (n_head_kv, self.n_ctx, head_dim // 32)
            self._k = [
                (zeroed(xp, shape, xp.int8), zeroed(xp, blocks, xp.float16)) for _ in range(n_layer)
            ]
            self._v = [
                (zeroed(xp, shape, xp.int8), zeroed(xp, blocks, xp.float16)) for _ in range(n_layer)
            ]
            rot_k, rot_v = rotation_sizes(head_dim)
            self._rot = (
                xp.asarray(hadamard(rot_k)) if rot_k else None,
                xp.asarray(hadamard(rot_v)) if rot_v else None,
            )
        self._ring_k: dict[int, Any] = {}
        self._ring_v: dict[int, Any] = {}
        size = ring_size(self.n_ctx, window, self.n_ubatch) if window else 0
        # llama.cpp's SWA cache bookkeeping, kept for every sliding-window model (its pos_min and
        # saved cells decide llama-server's prefix reuse); ``cells`` is the same object when the
        # ring's cells are also stored and attended over (the exact path, size < n_ctx)
        # while following a sliding-window model's shared caches (``follow``), the sliding
        # layers' book of this sequence (a SequenceCells) stands in for its own ring
        self.swa: Cells | SequenceCells | None = (
            Cells(size, window) if window and any(sliding) else None
        )
        self._sliding = tuple(il for il, is_sliding in enumerate(sliding) if is_sliding)
        self._ring_size = size
        # the sliding layers' cells stored and attended over in llama.cpp's SWA layout
        self._own_ring = bool(ring) and self.swa is not None and size < self.n_ctx
        self._make_own_ring()
        self._batch_cells: numpy.ndarray | None = None  # cells of the micro-batch being run
        # after a context shift (``shift``) on the exact path: the whole cache's cell layout,
        # every layer's cells stored and attended over in cell order (None: position order);
        # or the cells of a cache other sequences share (``follow``)
        self._cells_kept = bool(ring) and self.exact
        self.shifted: Cells | SequenceCells | None = None
        # following both books of a sliding-window model's shared caches: the full layers'
        # cells are ``shifted``'s, the sliding layers' ``swa``'s (their micro-batch's below)
        self._iswa: SequenceIswa | None = None
        self._swa_batch_cells: numpy.ndarray | None = None

    @property
    def cells(self) -> Cells | SequenceCells | None:
        """The layout whose cells are also stored and attended over: the whole cache's after a
        context shift (``shifted``; the full layers' where both shared books are followed),
        else the SWA cache's when it is a ring (``swa``), else None."""
        if self.shifted is not None:
            return self.shifted
        return self.swa if self._ring_k else None

    def layout(self, layer: int) -> Cells | SequenceCells | None:
        """The cell layout ``layer``'s attention walks (None: position order)."""
        if layer not in self._ring_k:
            return None
        if self._iswa is not None and layer in self._sliding:
            return self.swa
        return self.cells

    def _layer_batch_cells(self, layer: int) -> numpy.ndarray | None:
        """The cells ``place`` chose for ``layer``'s layout."""
        if self._iswa is not None and layer in self._sliding:
            return self._swa_batch_cells
        return self._batch_cells

    def _make_own_ring(self) -> None:
        """Storage for the sliding layers' own ring, where the cache keeps one."""
        if self._own_ring:
            for il in self._sliding:
                self._ring_k[il] = self._empty_like(self._k[il], self._ring_size)
                self._ring_v[il] = self._empty_like(self._v[il], self._ring_size)

    def _empty_like(self, entry: Any, cells: int) -> Any:
        """Zeroed storage of ``entry``'s kind with ``cells`` cells."""

        def one(a: Any) -> Any:
            return zeroed(self.xp, (a.shape[0], cells) + a.shape[2:], a.dtype)

        return tuple(one(a) for a in entry) if isinstance(entry, tuple) else one(entry)

    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    @n_tokens.setter
    def n_tokens(self, n: int) -> None:
        """Positions 0..n-1 now hold what the store was given from outside (a slot restore
        writes the position store, then sets this): the ring is laid out afresh from them."""
        self._n_tokens = int(n)
        self._unshift()
        self._relay_ring()

    def advance(self, n_tokens: int) -> None:
        """The forward pass stored positions up to n_tokens-1 (the ring placed them itself)."""
        self._n_tokens = int(n_tokens)

    @property
    def pos_min(self) -> int:
        """llama_memory_seq_pos_min: the smallest position the cache still holds (the ring's,
        which forgets the oldest; 0 without a ring, -1 when empty). llama-server reuses a
        cached prefix of n_past tokens only if this is at most max(0, n_past - window)."""
        if self._n_tokens == 0:
            return -1
        if self.swa is None:
            return 0
        held = self.swa.pos[self.swa.pos >= 0]
        return int(held.min()) if held.size else -1

    @property
    def pos_max(self) -> int:
        """llama_memory_seq_pos_max: the largest position held (-1 when empty)."""
        return self._n_tokens - 1

    def ring_positions(self) -> numpy.ndarray | None:
        """What a saved state of the cell layout holds (``Cells.held``, in cell order: the
        SWA cache's window, or every position after a context shift; their values are the
        position store's, which keeps them); None when cells are in position order."""
        if self.follows:  # the shared cache's cells: the sliding layers' book's window
            return None if self._iswa is None or self.swa is None else self.swa.held()
        if isinstance(self.shifted, Cells):
            return self.shifted.held()
        return None if self.swa is None else self.swa.held()

    def window_values(self, positions: numpy.ndarray | None) -> list[Any] | None:
        """Copies of the sliding layers' K and V at ``positions`` (a checkpoint's ring): what
        llama-server's context checkpoint holds. Needed only where the position store is
        about to be overwritten while the checkpoint stays (an embedding evaluated in the
        slot); None without a sliding window."""
        if positions is None or self.swa is None or not self._sliding:
            return None
        return [self._copy_of(self._k[il], positions) for il in self._sliding] + [
            self._copy_of(self._v[il], positions) for il in self._sliding
        ]

    def load_ring(self, positions: numpy.ndarray | None, values: list[Any] | None = None) -> None:
        """Restore a context checkpoint taken by ``ring_positions``: the ring holds those
        positions again, laid out as llama.cpp reads a saved sequence back, with their values
        from the position store (positions before the checkpoint are never recomputed while it
        is kept: llama-server erases a checkpoint once the slot is cut before its pos_max), or
        from ``values`` (``window_values``), written into the sliding layers' store first."""
        if positions is None:
            return
        if values is not None:
            n = len(self._sliding)
            for il, k, v in zip(self._sliding, values[:n], values[n:], strict=True):
                self._copy_cells(k, self._k[il], slice(None), positions)
                self._copy_cells(v, self._v[il], slice(None), positions)
        if self.swa is None:  # a shifted cache's cells, put back in their saved order
            if not self._cells_kept or numpy.array_equal(positions, numpy.arange(len(positions))):
                return
            self.unfollow()
            if self.shifted is None:
                self._lay_out_cells()
            assert isinstance(self.shifted, Cells)
            cells = self.shifted.load(positions)
            for il in self._ring_k:
                self._copy_cells(self._k[il], self._ring_k[il], positions, cells)
                self._copy_cells(self._v[il], self._ring_v[il], positions, cells)
            return
        cells = self.swa.load(positions)
        for il in self._sliding:  # none unless the ring's cells are stored
            if il not in self._ring_k:
                continue
            self._copy_cells(self._k[il], self._ring_k[il], positions, cells)
            self._copy_cells(self._v[il], self._ring_v[il], positions, cells)

    def in_ring(self, layer: int) -> bool:
        """Whether ``layer``'s attention reads the SWA ring's cells (keys/values/quantized then
        take a number of cells, not of positions)."""
        return layer in self._ring_k

    def place(self, start: int, n: int) -> None:
        """Before a micro-batch of positions start..start+n-1: choose its ring cells."""
        if self._iswa is not None:  # both shared books take it, or neither
            positions = numpy.arange(start, start + n)
            self._batch_cells, self._swa_batch_cells = self._iswa.place(positions)
        elif self.cells is not None:
            self._batch_cells = self.cells.place(numpy.arange(start, start + n))
        elif self.swa is not None:  # bookkeeping only: any batch, in llama_decode's ubatches
            for a in range(start, start + n, self.n_ubatch):
                self.swa.place(numpy.arange(a, min(a + self.n_ubatch, start + n)))

    def _relay_ring(self) -> None:
        """Lay the ring out as llama.cpp reads a saved sequence back (a slot file, or after a
        truncation that dropped positions the window still needs): its last ``window``
        positions, from the first free cell, values from the position store."""
        if self.swa is None or self.swa.window is None:
            return
        n = self._n_tokens
        self.load_ring(numpy.arange(max(0, n - self.swa.window), n))

    @staticmethod
    def _copy_of(entry: Any, index: Any) -> Any:
        """A copy of entry[:, index], for an f32 array or a q8_0 (values, scales) pair."""
        if isinstance(entry, tuple):
            return tuple(a[:, index].copy() for a in entry)
        return entry[:, index].copy()

    def _copy_cells(self, src: Any, dst: Any, positions: Any, cells: Any) -> None:
        """dst[:, cells] = src[:, positions], for an f32 array or a q8_0 (values, scales) pair."""
        if isinstance(src, tuple):
            for a, b in zip(src, dst):
                b[:, cells] = a[:, positions]
        else:
            dst[:, cells] = src[:, positions]

    @property
    def nbytes(self) -> int:
        def size(entry: Any) -> int:
            return sum(a.nbytes for a in entry) if isinstance(entry, tuple) else entry.nbytes

        stores = self._k + self._v + list(self._ring_k.values()) + list(self._ring_v.values())
        return sum(size(e) for e in stores)

    def state_nbytes(self, n_streams: int, window_only: bool = False) -> int:
        """llama_state_seq_get_size of this sequence as llama-server's cache holds it, with
        ``n_streams`` streams (1 with ``-kvu``, else one per slot): its cells in every layer; a
        sliding-window model's full layers, then its sliding layers' cache, whose cells within
        the window of the last position count (``Cells.held``). ``window_only``: the sliding layers'
        part alone (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: a context checkpoint)."""
        values = self.n_head_kv * self.head_dim
        row = 2 * values if self.cache_type == "f16" else values // 32 * 34  # ggml_row_size
        swa = self.swa
        sliding = set(self._sliding) if swa is not None else set()
        full = sequence_state_nbytes(
            self._n_tokens, [2 * row for il in range(len(self._k)) if il not in sliding], n_streams
        )
        if swa is None:
            return full
        part = sequence_state_nbytes(len(swa.held()), [2 * row] * len(sliding), n_streams)
        return part if window_only else full + part

    def truncate(self, n: int) -> None:
        """Forget positions n.. (kept cells are overwritten by the next forward).

        The ring empties the cells of positions n.. as seq_rm does. Should it have reused the
        cells of positions the window of position n still needs (llama-server evaluates the
        prompt again from 0 then), it is laid out afresh from the position store instead."""
        if not 0 <= n <= self.n_tokens:
            raise ValueError(f"cannot truncate a cache of {self.n_tokens} tokens to {n}")
        self._n_tokens = int(n)
        if self.shifted is not None:
            self.shifted.remove_from(n)
            if n == 0 and not self.follows:  # an empty cache fills in position order again
                self._unshift()
        if self.swa is not None and self.swa.window is not None:  # the ring always has one
            self.swa.remove_from(n)
            if not self.swa.holds(max(0, n - self.swa.window + 1), n):  # the window of position n
                self.unfollow()  # the shared books are not followed past a ring laid afresh
                self._relay_ring()

    # --- context shift ------------------------------------------------------------------------

    def shift(self, n_keep: int, n_discard: int, turn: Callable[[Any], Any]) -> None:
        """llama-server's context shift on this sequence: seq_rm(n_keep, n_keep + n_discard),
        seq_add(n_keep + n_discard, n_tokens, -n_discard), then llama.cpp's K-shift
        (build_rope_shift): the keys of the moved positions go through ``turn`` (RoPE by
        -n_discard, f32 [n, n_head_kv, head_dim] in and out) and back to the cache's type; a
        q8_0 key is dequantized and turned back from its Hadamard rotation first, and rotated
        again after. Values only move.

        On the exact path the cells then stay where llama.cpp leaves them: the freed ones are
        filled by the next tokens, so cell order is no longer position order, and attention
        reads every layer's cells in cell order from here on (``cells``)."""
        if self.swa is not None:
            raise ValueError("a context shift needs a cache without a sliding window")
        n = self._n_tokens
        if n_keep < 0 or n_discard < 1 or n_keep + n_discard > n:
            raise ValueError(
                f"cannot shift {n} positions by keeping {n_keep}, dropping {n_discard}"
            )
        self.unfollow()  # a shift is this sequence's own: its cells from position order
        if self._cells_kept and self.shifted is None:
            self._lay_out_cells()
        moved, kept_to = slice(n_keep + n_discard, n), slice(n_keep, n - n_discard)
        for il in range(len(self._k)):
            self._shift_keys(self._k[il], moved, kept_to, turn)
            self._copy_cells(self._v[il], self._v[il], moved, kept_to)
        self._n_tokens = n - n_discard
        if isinstance(self.shifted, Cells):
            self.shifted.remove(n_keep, n_keep + n_discard)
            cells = self.shifted.add(n_keep + n_discard, n, -n_discard)
            positions = self.shifted.pos[cells]
            for il in self._ring_k:  # the moved cells' keys turned; their values stay
                self._copy_cells(self._k[il], self._ring_k[il], positions, cells)

    def _shift_keys(self, entry: Any, src: slice, dst: slice, turn: Callable[[Any], Any]) -> None:
        """entry[:, dst] = the keys of entry[:, src] turned, in the cache's rounding."""
        xp = self.xp
        if isinstance(entry, tuple):  # q8_0: dequantize, unrotate, turn, rotate, quantize
            keys = self._dq8(entry[0][:, src], entry[1][:, src]).transpose(1, 0, 2)
            q, d = self._q8(self.rotate_k(turn(self.rotate_k(xp.ascontiguousarray(keys)))))
            entry[0][:, dst] = q.transpose(1, 0, 2)
            entry[1][:, dst] = d.transpose(1, 0, 2)
            return
        keys = xp.ascontiguousarray(entry[:, src].transpose(1, 0, 2))
        turned = turn(keys).astype(xp.float16).astype(xp.float32)  # ggml's f16 cells
        entry[:, dst] = turned.transpose(1, 0, 2)

    def _lay_out_cells(self) -> None:
        """Keep the whole cache's cells from here on: as a sequence placed from an empty cache
        leaves them (positions 0..n_tokens-1 in cells 0..), every layer copied into them."""
        n = self._n_tokens
        self._keep_cells(Cells.in_order(self.kv_size, n), slice(0, n), slice(0, n))

    def _keep_cells(self, layout: Cells | SequenceCells, positions: Any, cells: Any) -> None:
        """Attend over every layer's cells in ``layout``'s order from here on, the positions
        held copied into their cells."""
        self.shifted = layout
        for il in range(len(self._k)):
            self._fill_cells(il, self.kv_size, positions, cells)

    def _fill_cells(self, il: int, size: int, positions: Any, cells: Any) -> None:
        """Layer ``il`` attended over ``size`` cells, the ``positions`` held copied into
        ``cells`` from the position store."""
        self._ring_k[il] = self._empty_like(self._k[il], size)
        self._ring_v[il] = self._empty_like(self._v[il], size)
        self._copy_cells(self._k[il], self._ring_k[il], positions, cells)
        self._copy_cells(self._v[il], self._ring_v[il], positions, cells)

    @property
    def follows(self) -> bool:
        """Whether the cells are those of a cache other sequences share (``follow``)."""
        return isinstance(self.shifted, SequenceCells)

    def follow(self, layout: SequenceCells | SequenceIswa) -> bool:
        """Keep this sequence's cells where the shared cache's book places them (llama-server's
        slots with ``-kvu``): positions 0..n_tokens-1 copied into the cells the book holds them
        in, each later micro-batch into the cells it chooses, attention in cell order over the
        whole cache's ``n_kv``, until ``unfollow``. False where the cache keeps no cell layout
        (not the exact path, a context shift's) or the book does not hold exactly its
        positions.

        A sliding-window model follows both books (``SequenceIswa``): the full layers the full
        layers' cache's cells, the sliding layers the smaller cache's, whose cells for this
        sequence are any of its positions (those still in the window of the next one among
        them)."""
        if not self._cells_kept or self.shifted is not None:
            return False
        base = layout.base if isinstance(layout, SequenceIswa) else layout
        if (self.swa is not None) != isinstance(layout, SequenceIswa):
            return False
        if base.size > self.kv_size:
            return False
        pos = base.pos
        cells = numpy.flatnonzero(pos >= 0)
        positions = pos[cells]
        if not numpy.array_equal(numpy.sort(positions), numpy.arange(self._n_tokens)):
            return False
        if not isinstance(layout, SequenceIswa):
            self._keep_cells(layout, positions, cells)
            return True
        swa_pos = layout.swa.pos
        swa_cells = numpy.flatnonzero(swa_pos >= 0)
        if (swa_pos[swa_cells] >= self._n_tokens).any():
            return False
        self._ring_k.clear()
        self._ring_v.clear()
        self.shifted, self.swa, self._iswa = layout.base, layout.swa, layout
        for il in range(len(self._k)):
            if il in self._sliding:
                self._fill_cells(il, layout.swa.size, swa_pos[swa_cells], swa_cells)
            else:
                self._fill_cells(il, self.kv_size, positions, cells)
        return True

    def unfollow(self) -> None:
        """Back to position order after ``follow`` (the position store holds every position)."""
        if self.follows:
            self._unshift()

    def copy_layout(self, source: KVCache) -> None:
        """Take ``source``'s context-shift cell layout (or none); the caller copies the values
        (slots.copy_slot)."""
        self._unshift()
        if isinstance(source.shifted, Cells):
            self._lay_out_cells()
            assert isinstance(self.shifted, Cells)
            self.shifted.pos[:] = source.shifted.pos
            self.shifted.head = source.shifted.head

    def _unshift(self) -> None:
        """Back to position order (an empty cache, or one laid anew from the position store);
        after following both shared books, the sliding layers' own ring again, holding what
        their book held of this sequence, in its cell order."""
        if self.shifted is not None:
            self.shifted = None
            self._ring_k.clear()
            self._ring_v.clear()
        if self._iswa is not None and self.swa is not None:
            pos = self.swa.pos
            held = pos[pos >= 0]
            if len(held) > self._ring_size:
                held = self.swa.held()
            self._iswa, self._swa_batch_cells = None, None
            self.swa = Cells(self._ring_size, self.swa.window)
            self._make_own_ring()
            self.load_ring(held)

    def snapshot(self) -> list[Any]:
        """Copies of positions 0..n_tokens-1 of every layer's K and V (the host prompt cache)."""
        held = slice(None, self.n_tokens)
        return [self._copy_of(e, held) for e in self._k] + [self._copy_of(e, held) for e in self._v]

    def restore(self, snapshot: list[Any], n_tokens: int) -> None:
        """Put back what ``snapshot`` copied: positions 0..n_tokens-1."""
        layers, held = len(self._k), slice(None, n_tokens)
        for i in range(layers):
            self._copy_cells(snapshot[i], self._k[i], slice(None), held)
            self._copy_cells(snapshot[layers + i], self._v[i], slice(None), held)
        self.n_tokens = int(n_tokens)  # lays the ring out again

    # --- used by the forward pass -------------------------------------------------------------

    def _rotate(self, x: Any, rot: Any | None) -> Any:
        """x [..., head_dim] turned by the Hadamard matrix in blocks of its size: ggml's fast
        transform on the CPU, a matrix product on CuPy."""
        if rot is None:
            return x
        n = rot.shape[0]
        if self.exact:
            return exact_ops.fwht(x, n)
        shape = x.shape
        return (x.reshape(-1, n) @ rot).reshape(shape)

    def rotate_k(self, x: Any) -> Any:
        """Q or K [..., head_dim] as llama.cpp turns them before the cache and attention (x
        itself when the cache is not rotated: f16, or a head size not a multiple of 64)."""
        return self._rotate(x, self._rot[0])

    def rotate_v(self, x: Any) -> Any:
        """V [..., head_dim] as llama.cpp turns it before the cache; the same turn brings the
        attention output back (``output``)."""
        return self._rotate(x, self._rot[1])

    def _q8(self, x: Any) -> tuple[Any, Any]:
        """x [..., head_dim] as q8_0 blocks: int8 values and f16 scales (quantize_row_q8_0)."""
        xp = self.xp
        if self.exact:  # the AVX2 rounding, shared with the matrix products' activations
            rows = exact_matmul.Activation(x.reshape(-1, x.shape[-1]))
            return (
                rows.q.reshape(x.shape),
                rows.d16.view(numpy.float16).reshape(*x.shape[:-1], -1),
            )
        blocks = x.reshape(*x.shape[:-1], -1, 32)
        amax = xp.abs(blocks).max(axis=-1)
        d = (amax / numpy.float32(127)).astype(xp.float16)
        inv = numpy.float32(127) / xp.where(amax > 0, amax, numpy.float32(1))
        q = xp.rint(blocks * inv[..., None]).astype(xp.int8)
        return q.reshape(x.shape), d

    def _dq8(self, q: Any, d: Any) -> Any:
        xp = self.xp
        blocks = q.reshape(*q.shape[:-1], -1, 32).astype(xp.float32)
        return (blocks * d.astype(xp.float32)[..., None]).reshape(q.shape)

    def store(self, layer: int, start: int, k: Any, v: Any) -> None:
        """k, v [n, n_head_kv, head_dim] f32 for positions start..start+n-1 (a layer in the
        ring also gets them in the cells ``place`` chose)."""
        end = start + k.shape[0]
        if end > self.n_ctx:
            raise ValueError(f"the cache holds {self.n_ctx} positions; {end} asked")
        self._store_positions(layer, start, end, k, v)
        if layer in self._ring_k:  # the same rounded rows, into the micro-batch's ring cells
            cells = self._layer_batch_cells(layer)
            if cells is None or len(cells) != end - start:
                raise ValueError("place() chooses the ring cells before a micro-batch is stored")
            positions = slice(start, end)
            self._copy_cells(self._k[layer], self._ring_k[layer], positions, cells)
            self._copy_cells(self._v[layer], self._ring_v[layer], positions, cells)

    def _store_positions(self, layer: int, start: int, end: int, k: Any, v: Any) -> None:
        xp = self.xp
        if self.cache_type == "f16" and self.exact:
            _store_f16(self._k[layer], start, numpy.ascontiguousarray(k, numpy.float32))
            _store_f16(self._v[layer], start, numpy.ascontiguousarray(v, numpy.float32))
            return
        if self.cache_type == "f16":
            self._k[layer][:, start:end] = k.transpose(1, 0, 2).astype(xp.float16)
            self._v[layer][:, start:end] = v.transpose(1, 0, 2).astype(xp.float16)
            return
        for entry, x in ((self._k[layer], self.rotate_k(k)), (self._v[layer], self.rotate_v(v))):
            q, d = self._q8(x)  # rounded per row of head_dim, in the batch's own layout
            entry[0][:, start:end] = q.transpose(1, 0, 2)
            entry[1][:, start:end] = d.transpose(1, 0, 2)

    @property
    def fused_decode(self) -> bool:
        """Whether exact_decode's fused step can store and read this cache: f16 values on the
        CPU (in position order, and in the sliding-window ring where there is one)."""
        return self.cache_type == "f16" and self.exact

    def f16_cells(self, layer: int) -> tuple[numpy.ndarray, numpy.ndarray]:
        """The layer's whole K and V stores, f32 [n_head_kv, n_ctx, head_dim] holding f16
        values, in position order (what the fused decode step writes, and attends over unless
        the layer is in the ring)."""
        return self._k[layer], self._v[layer]

    def ring_f16_cells(self, layer: int) -> tuple[numpy.ndarray, numpy.ndarray, int] | None:
        """For a layer in the sliding-window ring (``in_ring``), its f16 ring K and V
        [n_head_kv, ring cells, head_dim] and the cell ``place`` chose for a one-token
        micro-batch (the fused decode step stores there too); None for another layer."""
        if layer not in self._ring_k:
            return None
        cells = self._layer_batch_cells(layer)
        if cells is None or len(cells) != 1:
            raise ValueError("place() chooses the ring cell of a one-token micro-batch first")
        return self._ring_k[layer], self._ring_v[layer], int(cells[0])

    def quantized(self, layer: int, end: int) -> tuple[Any, Any, Any, Any]:
        """(k_q, k_d, v_q, v_d) of positions 0..end-1: views of the q8_0 cache, int8
        [n_head_kv, end, head_dim] and f16 scales [n_head_kv, end, head_dim/32], K and V rotated
        (what exact_attention.flash_attn_q8_0 takes, read in place)."""
        if self.cache_type != "q8_0":
            raise ValueError(f"a {self.cache_type} cache holds no q8_0 blocks")
        (kq, kd), (vq, vd) = self._read_k(layer), self._read_v(layer)
        return kq[:, :end], kd[:, :end], vq[:, :end], vd[:, :end]

    def _read_k(self, layer: int) -> Any:
        return self._ring_k.get(layer, self._k[layer])

    def _read_v(self, layer: int) -> Any:
        return self._ring_v.get(layer, self._v[layer])

    def keys(self, layer: int, end: int) -> Any:
        """K of positions 0..end-1 (of ring cells 0..end-1 for a layer ``in_ring``)."""
        if self.cache_type == "f16":
            return self._read_k(layer)[:, :end]
        q, d = self._read_k(layer)
        return self._dq8(q[:, :end], d[:, :end])

    def values(self, layer: int, end: int) -> Any:
        """V of positions 0..end-1 (of ring cells 0..end-1 for a layer ``in_ring``)."""
        if self.cache_type == "f16":
            return self._read_v(layer)[:, :end]
        q, d = self._read_v(layer)
        return self._dq8(q[:, :end], d[:, :end])

    def query(self, q: Any) -> Any:
        """q [n, heads, head_dim] as ggml's flash attention takes it.

        f16 cache: batches of 64 rows or more go to the tiled kernel, which keeps Q in f32;
        smaller ones to the one-row kernel, which rounds Q to f16 (K's vec_dot type).
        q8_0 cache: rotated like K, then rounded to q8_0.
        """
        xp = self.xp
        if self.cache_type == "f16":
            if q.shape[0] >= FA_TILE_Q:
                return q
            return q.astype(xp.float16).astype(xp.float32)
        rotated = self.rotate_k(q)
        flat = rotated.reshape(-1, self.head_dim)
        return quantize_activation(xp, flat, "q8_0").reshape(q.shape)

    def output(self, o: Any) -> Any:
        """Attention output [..., head_dim] back from V's rotation (llama.cpp turns ``cur`` by
        the same Hadamard matrix right after flash attention, H @ H = I)."""
        return self.rotate_v(o)
