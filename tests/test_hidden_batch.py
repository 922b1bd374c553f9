"""Several embedding inputs computed together (``Engine.hidden_states_batch``,
``Encoder.hidden_states_each``): each input's hidden states must be the bits of that input
computed alone (``hidden_states``), which tests/test_embeddings.py, test_encoder.py and
test_rerank.py compare with llama-server's; here the passes themselves: which inputs share a
pass, and the inputs that must stay alone (over a micro-batch, a product whose arithmetic
changes with the rows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bankml.engine_cupy.engine import Engine
from bankml.engine_cupy.passes import SHARED_INPUT_ROWS, hidden_passes


@pytest.fixture(scope="module")
def engine(default_model: Path) -> Engine:
    return Engine.open(default_model, n_ctx=1024, device="cpu")


def test_hidden_passes_group_short_inputs_in_order_within_the_rows() -> None:
    assert hidden_passes([2, 1, 41, 3], 512, True) == [[0, 1], [2], [3]]
    assert hidden_passes([30] * 5, 512, True) == [[0, 1, 2, 3], [4]]  # 120 rows, then 30
    assert hidden_passes([100, 20, 10, 600, 5], 512, True) == [[0], [1, 2], [3], [4]]
    assert hidden_passes([SHARED_INPUT_ROWS + 1, 3, 4], 512, True) == [[0], [1, 2]]
    assert hidden_passes([20, 20, 20], 16, True) == [[0], [1], [2]]  # over one micro-batch
    assert hidden_passes([2, 3], 512, False) == [[0], [1]]


def test_inputs_sharing_passes_are_each_alone_bits(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = engine.model
    assert model.shares_passes  # Q4_1 and Q8_0 products: a row's bits do not depend on others
    texts = ["Hello world", "x", "The quick brown fox jumps over the lazy dog. " * 2, "a b c"]
    inputs = [engine.prompt_tokens(t) for t in texts]
    inputs.append(list(range(100, 700)))  # over -ub 512: two micro-batches of its own
    assert min(map(len, inputs)) == 1
    alone = [engine.hidden_states(tokens) for tokens in inputs]
    singles: list[int] = []
    own = model.hidden_states

    def counted(tokens: Any, *args: Any) -> Any:
        singles.append(len(tokens))
        return own(tokens, *args)

    monkeypatch.setattr(model, "hidden_states", counted)
    both = engine.hidden_states_batch(inputs)
    assert singles == [
        600
    ]  # the four short inputs (1 to 21 tokens) in one pass, the long one alone
    for a, b in zip(alone, both, strict=True):
        assert a.dtype == b.dtype == np.float32
        assert np.array_equal(a, b)
    # the one slot keeps the last input, its tokens and cells, as llama-server's slot does
    (slot,) = engine.slots
    assert slot.tokens == inputs[-1] and slot.cache.n_tokens == len(inputs[-1])
    assert slot.embedded == []


def test_a_model_that_does_not_share_passes_embeds_each_input_in_its_slot(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a product's rows would change bits beside others (here said so by
    ``shares_passes``), each input is the model's own ``hidden_states``, one call each."""
    inputs = [[1, 2, 3], [4, 5], [6]]
    alone = [engine.hidden_states(tokens) for tokens in inputs]
    monkeypatch.setattr(type(engine.model), "shares_passes", property(lambda self: False))
    calls: list[int] = []
    own = engine.model.hidden_states

    def counted(tokens: Any, *args: Any) -> Any:
        calls.append(len(tokens))
        return own(tokens, *args)

    monkeypatch.setattr(engine.model, "hidden_states", counted)
    for a, b in zip(alone, engine.hidden_states_batch(inputs), strict=True):
        assert np.array_equal(a, b)
    assert calls == [3, 2, 1]


def test_inputs_in_one_micro_batch_move_from_64_tokens_only(engine: Engine) -> None:
    """``Model.hidden_states_together`` (llama-server's slots with -kvu, checked side by side
    in tests/test_embeddings.py): below 64 tokens in the micro-batch every input is its own
    one-row attention, as alone; from 64 the tiled kernel runs for every input, at its cells:
    the first, at cell 0 and 64 tokens or more itself, is as alone, one after it is not."""
    model = engine.model
    assert model.follows_micro_batches
    short = [engine.prompt_tokens(t) for t in ("Hello world", "a b c", "x")]
    assert sum(map(len, short)) < 64
    together = model.hidden_states_together(short, engine.cache.kv_size)
    for tokens, rows in zip(short, together, strict=True):
        assert np.array_equal(rows, model.hidden_states(tokens))
    long, after = engine.prompt_tokens("zz " * 40), short[0]
    assert len(long) >= 64
    first, second = model.hidden_states_together([long, after], engine.cache.kv_size)
    assert np.array_equal(first, model.hidden_states(long))
    assert not np.array_equal(second, model.hidden_states(after))
    with pytest.raises(ValueError, match="cells"):
        model.hidden_states_together([long, long], 128)


BATCH_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "a b c",
    "zz " * 40,
]


def assert_llama_servers_batch(
    model: Path, binary: Path, cache_type: str | None = None, changed: int = 3
) -> None:
    """Four inputs of 126 tokens in one request to llama-server ``-np 4 -kvu --pooling none``
    on a fresh server (slots 3, 2, 1, 0: the batch reversed): every token's vector equal bit for
    bit to the four evaluated together in that order (Engine.compute_hidden_states), where
    ``changed`` of them differ alone."""
    from tests import support

    engine = Engine.open(model, n_ctx=4096, n_slots=4, kv_unified=True, cache_type=cache_type)
    assert engine.model.follows_micro_batches
    inputs = [engine.embedding_inputs(t)[0] for t in BATCH_TEXTS]
    args = ["--embeddings", "--pooling", "none", "-np", "4", "-kvu", "-c", "4096"]
    if cache_type is not None:
        args += ["-ctk", cache_type, "-ctv", cache_type]
    with support.LlamaServer(model, args=args, binary=binary) as ref:
        status, answer = support.http_json(ref.url + "/embedding", {"content": BATCH_TEXTS})
    assert status == 200
    theirs = [
        np.array(a["embedding"], np.float32) for a in sorted(answer, key=lambda a: a["index"])
    ]
    ours = engine.compute_hidden_states(inputs, [[3, 2, 1, 0]])
    for mine, ref_rows in zip(ours, theirs, strict=True):
        assert np.array_equal(mine, ref_rows)
    alone = engine.compute_hidden_states(inputs)
    assert sum(not np.array_equal(a, r) for a, r in zip(alone, theirs, strict=True)) == changed


def test_a_k_quant_micro_batch_is_llama_servers(
    default_model_q4_k_m: Path, llama_server_bin: Path
) -> None:
    """A K-quant file's products follow the micro-batch's row count (one group for the batch's
    sequences): llama-server's batch, three inputs differing alone (the first, 80 rows at the
    batch's head, multiplied as alone)."""
    assert_llama_servers_batch(default_model_q4_k_m, llama_server_bin)


def test_a_k_quant_micro_batch_over_a_q8_0_cache_is_llama_servers(
    default_model_q4_k_m: Path, llama_server_bin: Path
) -> None:
    """Over a q8_0 cache ggml attends one row at a time whatever the micro-batch, so only the
    products move: on a K-quant file (its arithmetic follows the batch's row count) the batch
    at ``-ctk q8_0 -ctv q8_0`` is llama-server's too."""
    assert_llama_servers_batch(default_model_q4_k_m, llama_server_bin, "q8_0")


def test_a_replay_refuses_a_batch_no_micro_batch_holds(engine: Engine) -> None:
    """A receipt's ``evaluated_together`` naming a batch larger than the cache is refused with
    the reason, not a traceback."""
    import json

    from bankml.receipts.embedding import replay_embeddings

    body = json.dumps({"input": ["zz " * 300] * 4}).encode()
    receipt = {
        "api": "embeddings",
        "pooling": "mean",
        "embd_normalize": 2,
        "evaluated_together": [[0, 1, 2, 3]],
        "embeddings_sha256": ["0" * 64] * 4,
    }
    verdict = replay_embeddings(body, [receipt], engine)
    assert verdict.startswith("refuse: the receipt's evaluated_together cannot be evaluated"), (
        verdict
    )


def test_a_sliding_window_micro_batch_is_llama_servers(
    default_model: Path, llama_server_bin: Path, tmp_path: Path
) -> None:
    """gemma3's sliding layers keep their own cache, emptied and filled from cell 0 alike: a
    tiny gemma3 (window 8, layers 0 and 2 sliding) gives llama-server's batch."""
    from gguf import GGMLQuantizationType as T

    from tests.tiny_models import TinySpec, write_tiny_model

    spec = TinySpec("gemma3", T.F32, n_layer=4)
    model = write_tiny_model(tmp_path / "gemma3-swa.gguf", spec, default_model)
    assert Engine.open(model, n_ctx=512).model.has_sliding_window
    assert_llama_servers_batch(model, llama_server_bin)
