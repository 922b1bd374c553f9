"""The native forward pass against the real llama-server: next-token log-probabilities and greedy
answers on the default model, on the q8_0 KV cache, and on tiny models of every architecture.

Token ids come from llama-server's /tokenize, so these tests do not depend on bankml's tokenizer.
Each oracle test prints its figure (largest log-probability difference, identical answers) and
asserts it; the thresholds are the measured figures with a margin (docs/modules/model.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy
import pytest

from bankml.engine_cupy.model import Model
from tests import support
from tests.engine_checks import (
    GREEDY_TOKENS,
    PROMPTS,
    compare_greedy,
    compare_next_token,
    log_softmax,
    tokenize,
)
from tests.tiny_models import TINY_SPECS, TinySpec, write_tiny_model


@pytest.fixture(scope="module")
def prompt_ids(reference_server: support.LlamaServer) -> list[list[int]]:
    return [tokenize(reference_server, text) for text in PROMPTS]


@pytest.mark.llama_server
def test_default_next_token_logprobs(default_engine: Model, reference_server, prompt_ids) -> None:
    worst, same_top1 = compare_next_token(default_engine, reference_server, prompt_ids)
    print(
        f"\ndefault model, {len(prompt_ids)} prompts: largest top-10 logprob difference "
        f"{worst:.5f}, same top-1 {same_top1}/{len(prompt_ids)}"
    )
    assert same_top1 == len(prompt_ids)
    # measured 0.00001: the logits are ggml's; what is left is the order in which llama-server
    # sums the 49,152 exponentials after its partial sort (sampler.token_logprobs)
    assert worst < 1e-4


@pytest.mark.llama_server
@pytest.mark.slow
def test_default_greedy_answers(default_engine: Model, reference_server, prompt_ids) -> None:
    prompts = prompt_ids[:20]
    same, notes = compare_greedy(default_engine, reference_server, prompts, GREEDY_TOKENS)
    print(
        f"\ndefault model greedy {GREEDY_TOKENS} tokens: {same}/{len(prompts)} identical; {notes}"
    )
    # measured 20/20 since the kernels are ggml's (7/20 before them)
    assert same == len(prompts) == 20


@pytest.mark.llama_server
@pytest.mark.slow
def test_q8_0_cache_against_llama_server(
    default_engine: Model, default_model: Path, llama_server_bin: Path, prompt_ids
) -> None:
    prompts = prompt_ids[:8]
    with support.LlamaServer(
        default_model,
        binary=llama_server_bin,
        args=["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"],
    ) as server:
        worst, same_top1 = compare_next_token(default_engine, server, prompts, "q8_0")
        same, notes = compare_greedy(default_engine, server, prompts[:5], 32, "q8_0")
    print(
        f"\nq8_0 cache: largest top-10 logprob difference {worst:.5f}, same top-1 "
        f"{same_top1}/{len(prompts)}; greedy 32 tokens {same}/5 identical {notes}"
    )
    # measured 0.00001, 8/8, 5/5 (32 tokens) since the q8_0 path is ggml's (FWHT rotations, q8_0 store,
    # flash attention on the q8_0 blocks); 0.551, 7/8, 1/5 before
    assert same_top1 == len(prompts)
    assert worst < 1e-4
    assert same == 5


@pytest.mark.llama_server
@pytest.mark.slow
def test_q4_k_m_against_llama_server(
    default_model_q4_k_m: Path, llama_server_bin: Path, prompt_ids
) -> None:
    """A Q4_K_M file, as most downloads are (made from the default model by llama.cpp's own
    llama-quantize): repacked Q4_K and Q6_K down products beside Q5_0/Q8_0 stacks, one-row
    steps through the fused decode step."""
    model = Model.load(default_model_q4_k_m, device="cpu", progress=False)
    prompts = prompt_ids[:8]
    with support.LlamaServer(default_model_q4_k_m, binary=llama_server_bin) as server:
        worst, same_top1 = compare_next_token(model, server, prompts)
        same, notes = compare_greedy(model, server, prompts, 32)
    print(
        f"\nQ4_K_M: largest top-10 logprob difference {worst:.6f}, same top-1 {same_top1}/"
        f"{len(prompts)}; greedy 32 tokens {same}/{len(prompts)} identical {notes}"
    )
    # measured 1e-6 and 8/8
    assert same_top1 == len(prompts)
    assert worst < 1e-4
    assert same == len(prompts)


TINY_PROMPTS = PROMPTS[:6]


@pytest.mark.llama_server
@pytest.mark.slow
@pytest.mark.parametrize("spec", TINY_SPECS, ids=lambda s: s.name)
def test_tiny_architecture(
    spec: TinySpec, tiny_dir: Path, default_model: Path, llama_server_bin: Path
) -> None:
    path = write_tiny_model(tiny_dir / f"{spec.name}.gguf", spec, default_model)
    model = Model.load(path, device="cpu", progress=False)
    with support.LlamaServer(path, binary=llama_server_bin) as server:
        prompts = [tokenize(server, text) for text in TINY_PROMPTS]
        worst, same_top1 = compare_next_token(model, server, prompts)
        same, notes = compare_greedy(model, server, prompts, 32)
    print(
        f"\n{spec.name}: largest top-10 logprob difference {worst:.5f}, same top-1 "
        f"{same_top1}/{len(prompts)}, greedy 32 tokens {same}/{len(prompts)} identical {notes}"
    )
    assert same_top1 == len(prompts)
    # measured 0.00000-0.00001 and all answers identical over the 16 models since every weight
    # type in them has an exact kernel (0.00002-0.39 and some answers different on the f32
    # fallback: figures per type in exact_*.md)
    assert worst < 1e-4
    assert same == len(prompts)


@pytest.mark.llama_server
def test_last_layer_output_product_takes_every_row(
    tiny_dir: Path, default_model: Path, llama_server_bin: Path
) -> None:
    """llama.cpp's build_attn multiplies every row of the last layer's attention by wo before
    get_rows keeps the output row; F16 rounds that product differently for one row (vec_dot)
    and for several (tinyBLAS), so taking the last row before wo moved these logits."""
    spec = next(s for s in TINY_SPECS if s.name == "llama-F16")
    path = write_tiny_model(tiny_dir / f"{spec.name}.gguf", spec, default_model)
    model = Model.load(path, device="cpu", progress=False)
    with support.LlamaServer(path, binary=llama_server_bin) as server:
        ids = tokenize(server, PROMPTS[9])
        worst, same_top1 = compare_next_token(
            model, server, [ids[:k] for k in range(2, len(ids) + 1)]
        )
    print(
        f"\nllama-F16, prefixes of {len(ids)} tokens: largest top-10 logprob difference {worst:.7f}"
    )
    assert same_top1 == len(ids) - 1
    # measured 0.0000002 (what is left is llama-server's sum of the exponentials); 0.0018 at 11
    # tokens and 0.00024 at 2 when wo took only the last row
    assert worst < 1e-5


# --- properties of the forward pass that need no llama-server --------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tiny_dir: Path, default_model: Path) -> Model:
    spec = TinySpec("qwen3", TINY_SPECS[5].wtype)  # F32: no q8 rounding to magnify last bits
    return Model.load(
        write_tiny_model(tiny_dir / "local-qwen3.gguf", spec, default_model),
        device="cpu",
        progress=False,
    )


def test_micro_batches_equal_one_batch(tiny_llama: Model) -> None:
    """Prefill split into micro-batches gives the logits of one batch (same cache contents)."""
    ids = list(range(300, 340))
    whole = tiny_llama.forward(ids, tiny_llama.new_cache(64), all_logits=True)
    cache = tiny_llama.new_cache(64)
    parts = [tiny_llama.forward(ids[i : i + 7], cache, all_logits=True) for i in range(0, 40, 7)]
    split = numpy.concatenate(parts)
    assert cache.n_tokens == 40
    diff = float(numpy.abs(whole - split).max())
    print(f"\nlargest logit difference, 40 tokens in one batch vs batches of 7: {diff:.2e}")
    assert diff < 0.02  # measured 0.004 on logits with a std of 8
    last_only = tiny_llama.forward(ids, tiny_llama.new_cache(64))
    assert numpy.abs(whole[-1] - last_only).max() < 1e-3


def test_truncate_then_recompute(tiny_llama: Model) -> None:
    cache = tiny_llama.new_cache(32)
    first = tiny_llama.forward([5, 6, 7, 8], cache)
    tiny_llama.forward([9, 10], cache)
    cache.truncate(3)
    assert cache.n_tokens == 3
    again = tiny_llama.forward([8], cache)
    assert numpy.abs(first - again).max() < 0.02
    with pytest.raises(ValueError):
        cache.truncate(5)


def test_context_and_token_limits(tiny_llama: Model) -> None:
    cache = tiny_llama.new_cache(4)
    with pytest.raises(ValueError, match="do not fit"):
        tiny_llama.forward([1, 2, 3, 4, 5], cache)
    assert cache.n_tokens == 0
    with pytest.raises(ValueError, match="out of range"):
        tiny_llama.forward([tiny_llama.n_vocab], cache)
    with pytest.raises(ValueError):
        tiny_llama.forward([], cache)


def test_cache_types(tiny_llama: Model) -> None:
    f16 = tiny_llama.new_cache(16)
    assert f16.cache_type == "f16"
    q8 = tiny_llama.new_cache(16, "q8_0")
    assert q8.cache_type == "q8_0"
    assert q8.nbytes < f16.nbytes / 2  # 34 bytes per 32 values against f32-held f16 values
    with pytest.raises(ValueError, match='cache type "q4_0": bankML keeps f16 or q8_0'):
        tiny_llama.new_cache(16, "q4_0")
    a = tiny_llama.forward([11, 12, 13], f16)
    b = tiny_llama.forward([11, 12, 13], q8)
    assert int(numpy.argmax(a)) == int(numpy.argmax(b))


def test_array_module_path_on_the_cpu(default_engine: Model, default_model: Path) -> None:
    """The vectorised xp path (the one CuPy runs; CI has no GPU) computes the same model: f32
    products and softmax instead of ggml's kernels, so close to the exact path, not equal."""
    plain = Model.load(default_model, device="cpu", progress=False, exact=False)
    assert plain.exact is False and default_engine.exact is True
    assert (
        plain.weights.output.weight is not None and default_engine.weights.output.exact is not None
    )
    worst, same_top1 = 0.0, 0
    for text_ids in ([1, 504, 3458, 282, 4649, 314], [28, 11, 2029, 9, 1213, 30, 87, 59, 1030]):
        exact = log_softmax(default_engine.forward(text_ids, default_engine.new_cache(16)))
        approx = log_softmax(plain.forward(text_ids, plain.new_cache(16)))
        top = numpy.argsort(-exact)[:10]
        worst = max(worst, float(numpy.abs(exact[top] - approx[top]).max()))
        same_top1 += int(numpy.argmax(exact) == numpy.argmax(approx))
    print(
        f"\narray path vs exact path: largest top-10 logprob difference {worst:.4f}, top-1 {same_top1}/2"
    )
    assert same_top1 == 2
    assert 0 < worst < 0.5  # not the same bits (f32 products), the same model
