"""The shared KV cache's cells as llama.cpp's llama_kv_cache keeps them for several slots
(kv_cache.SharedCells: find_slot, apply_ubatch, seq_rm), and the receipt's ``evaluated_cells``
read back with its refusals. The cells' effect on the vectors is tested side by side with
llama-server in tests/test_embeddings.py."""

from __future__ import annotations

import numpy
import pytest

from bankml.engine_cupy.kv_cache import KVCache, SequenceCells, SharedCells, find_cells
from bankml.engine_cupy.model import BatchCells
from bankml.receipts.embedding import GroupCells, cells_field, read_cells_field


def place(cells: SharedCells, seq: int, n: int) -> list[int]:
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
        2: ([0, 1, 2, 7, 8], 256),
        1: ([3], 256),
    }
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
