"""The shared KV cache's cells as llama.cpp's llama_kv_cache keeps them for several slots
(kv_cache.SharedCells: find_slot, apply_ubatch, seq_rm; a sliding-window model's two caches,
kv_cache.IswaCells), a cache following its sequence's cells in them (KVCache.follow), and the
receipt's ``evaluated_cells`` read back with its refusals. The cells' effect on the vectors and
logprobs is tested side by side with llama-server in tests/test_embeddings.py."""

from __future__ import annotations

import numpy
import pytest

from bankml.engine_cupy.kv_cache import (
    IswaCells,
    KVCache,
    SequenceCells,
    SequenceIswa,
    SharedCells,
    find_cells,
)
from bankml.engine_cupy.model import BatchCells
from bankml.receipts.embedding import GroupCells, InputCells, cells_field, read_cells_field


def place(cells: SharedCells | IswaCells, seq: int, n: int) -> list[int]:
    return cells.place(numpy.full(n, seq), numpy.arange(n)).tolist()


def test_a_batch_takes_the_freed_cells_from_the_first_freed_then_past_the_kept_ones() -> None:
    cells = SharedCells(512)
    assert place(cells, 3, 4) == [0, 1, 2, 3]
    assert place(cells, 2, 3) == [4, 5, 6]
    assert cells.head == 7 and cells.used_max_p1 == 7 and cells.n_kv() == 256
    cells.seq_rm(3)  # the head goes back to the first cell freed
    assert cells.head == 0
    assert place(cells, 1, 6) == [0, 1, 2, 3, 7, 8]  # around slot 2's cells
    cells.seq_rm(9)  # a sequence with no cells frees nothing
    assert cells.head == 9


def test_seq_rm_from_a_position_frees_the_cells_of_the_later_positions() -> None:
    cells = SharedCells(512)
    place(cells, 0, 6)
    place(cells, 1, 3)
    cells.seq_rm(0, 4)  # a prompt that reuses the first four positions of slot 0's
    assert cells.head == 4 and cells.seq[:9].tolist() == [0, 0, 0, 0, -1, -1, 1, 1, 1]
    taken = cells.place(numpy.zeros(3, numpy.int64), numpy.arange(4, 7))
    assert taken.tolist() == [4, 5, 9]  # round slot 1's cells
    assert cells.pos[[4, 5, 9]].tolist() == [4, 5, 6]


def test_the_search_starts_from_cell_0_when_enough_cells_before_the_head_are_free() -> None:
    cells = SharedCells(512)
    place(cells, 0, 10)
    place(cells, 1, 2)
    cells.seq_rm(1)  # each seq_rm moves the head back to the first cell it freed
    assert cells.head == 10
    cells.seq_rm(0)
    assert cells.head == 0
    reusable = numpy.ones(16, bool)
    assert find_cells(reusable, used=0, head=9, n=4).tolist() == [0, 1, 2, 3]  # 9 > 0 + 8
    assert find_cells(reusable, used=0, head=8, n=4).tolist() == [8, 9, 10, 11]
    assert find_cells(reusable, used=0, head=14, n=4).tolist() == [0, 1, 2, 3]
    reusable[:13] = False
    assert find_cells(reusable, used=13, head=14, n=3).tolist() == [14, 15, 13]  # round
    with pytest.raises(ValueError, match="no free cell"):
        find_cells(reusable, used=13, head=14, n=4)


def test_a_sliding_window_cache_takes_cells_out_of_their_sequences_window_again() -> None:
    """find_slot on the SWA cache: a cell whose position is at least the window behind its own
    sequence's next position is taken as if empty; apply_ubatch then empties that sequence's
    positions up to the last one overwritten, so each keeps its positions whole."""
    cells = SharedCells(16, window=4)
    assert place(cells, 0, 10) == list(range(10))
    assert place(cells, 1, 4) == [10, 11, 12, 13]
    # sequence 0 goes on from position 10: cells 14 and 15 are empty, then round the cache
    # cell 0 (position 0, 10 behind) and cell 1 are taken
    taken = cells.place(numpy.zeros(4, numpy.int64), numpy.arange(10, 14))
    assert taken.tolist() == [14, 15, 0, 1]
    assert cells.pos[[14, 15, 0, 1]].tolist() == [10, 11, 12, 13] and cells.head == 2
    # sequence 1 goes on from position 4: from the head, sequence 0's positions 2 and 3
    taken = cells.place(numpy.full(2, 1), numpy.arange(4, 6))
    assert taken.tolist() == [2, 3]
    assert cells.seq[:4].tolist() == [0, 0, 1, 1] and cells.pos[:4].tolist() == [12, 13, 4, 5]
    # sequence 0's positions 0..3 went: those before the last overwritten (3) with them
    assert sorted(cells.pos[cells.seq == 0].tolist()) == list(range(4, 14))
    windowless = SharedCells(16)
    place(windowless, 0, 14)
    assert windowless.place(numpy.zeros(2, numpy.int64), numpy.arange(14, 16)).tolist() == [14, 15]
    with pytest.raises(ValueError, match="no free cell"):
        windowless.place(numpy.zeros(1, numpy.int64), numpy.arange(16, 17))


def test_a_sliding_window_models_books_take_a_micro_batch_together() -> None:
    """IswaCells: each micro-batch placed in both caches (the full layers' cells returned, the
    sliding layers' kept), each removal in both; a micro-batch the sliding layers' cache
    cannot hold changes neither."""
    books = IswaCells(SharedCells(32), SharedCells(8, window=2))
    assert place(books, 0, 6) == list(range(6))
    assert books.swa_placed.tolist() == list(range(6))
    assert place(books, 1, 4) == [6, 7, 8, 9]
    assert books.swa_placed.tolist() == [6, 7, 0, 1]  # sequence 0's positions 0, 1: out
    books.seq_rm(1)
    assert (books.base.seq == 1).sum() == 0 and (books.swa.seq == 1).sum() == 0
    before = (books.base.seq.copy(), books.swa.seq.copy(), books.swa.head)
    with pytest.raises(ValueError, match="no free cell"):
        place(books, 2, 9)
    assert numpy.array_equal(books.base.seq, before[0]) and books.swa.head == before[2]
    assert numpy.array_equal(books.swa.seq, before[1])


def test_batch_cells_refuse_what_no_micro_batch_holds() -> None:
    tokens = [[1, 2], [3]]
    BatchCells([numpy.array([0, 5]), numpy.array([3])], 256).check(tokens, 4096)
    for cells, n_kv, why in (
        ([numpy.array([0, 5])], 256, "do not match"),
        ([numpy.array([0, 5]), numpy.array([3, 4])], 256, "do not match"),
        ([numpy.array([0, 300]), numpy.array([3])], 256, "outside"),
        ([numpy.array([0, 5]), numpy.array([3])], 8192, "outside"),
        ([numpy.array([0, 3]), numpy.array([3])], 256, "one cell"),
    ):
        with pytest.raises(ValueError, match=why):
            BatchCells(cells, n_kv).check(tokens, 4096)


def test_the_receipts_cells_read_back_as_runs_and_refuse_what_is_not_cells() -> None:
    field = cells_field([GroupCells(1, [[0, 1, 2, 7, 8], [3]], 256)])
    assert field == [{"group": 1, "n_kv": 256, "cells": [[[0, 3], [7, 9]], [[3, 4]]]}]
    together = [[0], [2, 1]]
    assert read_cells_field(field, together, [4, 1, 5]) == {
        2: InputCells([0, 1, 2, 7, 8], 256),
        1: InputCells([3], 256),
    }
    # a sliding-window model's: its sliding layers' cells in their own cache as well
    field = cells_field([GroupCells(1, [[0, 1, 2, 7, 8], [3]], 256, [[4, 5, 6, 0, 1], [2]], 256)])
    assert field[0]["swa_cells"] == [[[4, 7], [0, 2]], [[2, 3]]] and field[0]["swa_n_kv"] == 256
    assert read_cells_field(field, together, [4, 1, 5]) == {
        2: InputCells([0, 1, 2, 7, 8], 256, [4, 5, 6, 0, 1], 256),
        1: InputCells([3], 256, [2], 256),
    }
    cells = {"group": 1, "n_kv": 256, "cells": [[[0, 5]], [[5, 6]]]}
    for bad in (
        [{**cells, "swa_cells": [[[0, 5]], [[5, 6]]]}],
        [{**cells, "swa_n_kv": "256", "swa_cells": [[[0, 5]], [[5, 6]]]}],
        [{**cells, "swa_n_kv": 256, "swa_cells": [[[0, 5]]]}],
        [{**cells, "swa_n_kv": 256, "swa_cells": [[[0, 4]], [[5, 6]]]}],
    ):
        assert isinstance(read_cells_field(bad, together, [4, 1, 5]), str), bad
    for bad in (
        {"group": 1},
        [{"group": 2, "n_kv": 256, "cells": [[[0, 5]], [[5, 6]]]}],
        [{"group": 1, "n_kv": "256", "cells": [[[0, 5]], [[5, 6]]]}],
        [{"group": 1, "n_kv": 256, "cells": [[[0, 5]]]}],
        [{"group": 1, "n_kv": 256, "cells": [[[0, 4]], [[5, 6]]]}],
        [{"group": 1, "n_kv": 256, "cells": [[[5, 0]], [[5, 6]]]}],
        [{"group": 1, "n_kv": 256, "cells": [[[0, 5]], [[5, 6]]], "more": 1}],
        [
            {"group": 1, "n_kv": 256, "cells": [[[0, 5]], [[5, 6]]]},
            {"group": 1, "n_kv": 256, "cells": [[[0, 5]], [[5, 6]]]},
        ],
    ):
        assert isinstance(read_cells_field(bad, together, [4, 1, 5]), str), bad


def test_a_cache_follows_its_sequences_cells_in_the_shared_cache() -> None:
    """KVCache.follow: the positions held copied into the cells the book gives them, the next
    micro-batch stored in the cells it chooses round the other sequence's, the mask hiding
    every cell but its own, n_kv the whole cache's; emptied, it keeps following; unfollow goes
    back to position order."""
    book = SharedCells(512)
    place(book, 0, 3)  # sequence 0 (the cache's) in cells 0-2
    place(book, 1, 4)  # another in cells 3-6
    cache = KVCache(numpy, 1, 1, 4, 512, "f16", ring=True, exact=True)
    rows = numpy.arange(12, dtype=numpy.float32).reshape(3, 1, 4)
    cache.place(0, 3)
    cache.store(0, 0, rows, rows)
    cache.advance(3)
    book.seq_rm(0, 1)  # positions 1.. freed: a prompt that reuses one
    cache.truncate(1)
    assert not cache.follow(SequenceCells(book, 1))  # the book holds other positions
    assert cache.follow(SequenceCells(book, 0)) and cache.follows
    cache.place(1, 3)  # cells 1, 2, then past the other sequence's
    assert cache.cells is not None and cache._batch_cells.tolist() == [1, 2, 7]
    more = rows + 100
    cache.store(0, 1, more, more)
    cache.advance(4)
    assert cache.keys(0, 8)[0, 7].tolist() == more[2, 0].tolist()
    assert cache.keys(0, 8)[0, 0].tolist() == rows[0, 0].tolist()
    mask = cache.cells.mask(numpy.array([3]))
    assert mask.shape == (1, 8) and (mask[0] == 0).tolist() == [1, 1, 1, 0, 0, 0, 0, 1]
    assert cache.cells.n_kv() == 256
    cache.truncate(0)  # the book frees every cell of the sequence; the layout stays
    assert cache.follows and book.seq[[0, 1, 2, 7]].tolist() == [-1] * 4
    cache.unfollow()
    assert not cache.follows and cache.cells is None


def test_the_sliding_layers_book_changes_in_place_even_when_the_full_layers_refuse() -> None:
    """A micro-batch the full layers' cache cannot hold after the sliding layers' took it: the
    sliding layers' book is put back as it was, the same object a sequence's view reads."""
    books = IswaCells(SharedCells(4), SharedCells(8, window=2))
    place(books, 0, 3)
    swa, view = books.swa, SequenceIswa(books, 0)
    before = (swa.seq.copy(), swa.pos.copy(), swa.head)
    with pytest.raises(ValueError, match="no free cell"):
        view.place(numpy.arange(3, 5))
    assert books.swa is swa and view.swa.book is swa and swa.head == before[2]
    assert numpy.array_equal(swa.seq, before[0]) and numpy.array_equal(swa.pos, before[1])


def test_a_sliding_window_cache_follows_both_shared_books() -> None:
    """KVCache.follow(SequenceIswa): the full layer attends over the full layers' book's cells,
    the sliding layer over the sliding layers' book's, each micro-batch stored into the cells
    each book gives it (the sliding one reusing another sequence's cell out of its window),
    each layer's mask and n_kv its own book's; a checkpoint's positions are the sliding
    book's window in its cell order; unfollow gives the sliding layer its own ring back,
    holding what the book held of the sequence, in the book's order."""
    books = IswaCells(SharedCells(1024), SharedCells(8, window=2))
    place(books, 1, 4)  # another sequence in cells 0-3 of both
    cache = KVCache(
        numpy, 2, 1, 4, 1024, "f16", window=2, sliding=(True, False), ring=True, exact=True
    )
    rows = numpy.arange(12, dtype=numpy.float32).reshape(3, 1, 4)
    cache.place(0, 3)
    for layer in (0, 1):
        cache.store(layer, 0, rows, rows)
    cache.advance(3)
    own_ring = cache.swa
    place(books, 0, 3)  # this sequence's three positions: cells 4-6 of both
    assert not cache.follow(SequenceCells(books.base, 0))  # a sliding window needs both
    assert cache.follow(SequenceIswa(books, 0)) and cache.follows
    assert cache.layout(0) is cache.swa and cache.swa.book is books.swa
    assert cache.layout(1) is cache.cells and cache.cells.book is books.base
    assert cache.keys(0, 8)[0, 4:7].tolist() == rows[:, 0].tolist()
    for pos, full_cell, swa_cell in ((3, 7, 7), (4, 8, 0)):  # cell 0: position 0 of the other
        cache.place(pos, 1)
        assert (cache._batch_cells.tolist(), cache._swa_batch_cells.tolist()) == (
            [full_cell],
            [swa_cell],
        )
        row = rows[:1] + 100 * pos
        for layer in (0, 1):
            cache.store(layer, pos, row, row)
        cache.advance(pos + 1)
        assert cache.keys(0, 8)[0, swa_cell].tolist() == row[0, 0].tolist()
        assert cache.keys(1, 9)[0, full_cell].tolist() == row[0, 0].tolist()
    assert books.swa.seq[0] == 0 and books.swa.pos[0] == 4
    sliding = cache.layout(0).mask(numpy.array([4]))[0] == 0
    assert numpy.flatnonzero(sliding).tolist() == [0, 7]  # positions 4 and 3: the window
    full = cache.layout(1).mask(numpy.array([4]))[0] == 0
    assert numpy.flatnonzero(full).tolist() == [4, 5, 6, 7, 8]
    assert cache.ring_positions().tolist() == [4, 3]
    cache.unfollow()
    assert not cache.follows and cache.swa is not own_ring and cache.layout(1) is None
    assert cache.swa.pos[:5].tolist() == [4, 0, 1, 2, 3] and cache.pos_min == 0
    assert cache.layout(0) is cache.swa  # its own ring again
    assert cache.keys(0, 5)[0, 0].tolist() == (rows[:1] + 400)[0, 0].tolist()
