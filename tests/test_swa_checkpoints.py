"""llama-server's context checkpoints for a sliding-window model, side by side.

llama-server ends a gemma3 prompt's batches at user-message starts and 516 and 4 tokens before
the end, saves the SWA cache's window there ("context checkpoints"), and when a later prompt
shares a prefix whose window its SWA cache no longer holds, restores the newest usable
checkpoint or evaluates the prompt from 0 (bankml/engine_cupy/checkpoints.py). The tiny gemma3
(F32 weights, window 8, a 768-cell SWA cache at -c 2048) runs multi-turn chats past the window
through /v1/chat/completions and Engine.run_steps: on every turn the tokens reused
(``timings.cache_n``) and evaluated (``prompt_n``) must equal llama-server's, the greedy answer
must be the same and the top-10 log-probabilities must agree (where batches are cut decides the
attention kernel each token meets, so a wrong cut shows in the last bits).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy
import pytest
from gguf import GGMLQuantizationType as T

from bankml.engine_cupy import checkpoints as ck
from bankml.engine_cupy.chat_template import CHATML_TEMPLATE, ChatTemplate
from bankml.engine_cupy.engine import Engine
from bankml.engine_cupy.model import Model
from bankml.engine_cupy.tokenizer import Tokenizer
from tests import support
from tests.tiny_models import TinySpec, write_tiny_model

N_CTX = 2048  # support.LlamaServer's -c
N_PREDICT = 12
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "quick",
    "brown",
    "lazy",
    "garden",
    "window",
    "paper",
    "music",
    "silver",
    "forest",
    "ocean",
    "bright",
    "candle",
    "story",
    "winter",
    "summer",
    "yellow",
]


def words(n: int, seed: int) -> str:
    return " ".join(numpy.random.default_rng(seed).choice(WORDS, n))


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    spec = TinySpec("gemma3", T.F32, n_layer=4)  # window 8, no chat template: ChatML
    return write_tiny_model(
        tmp_path_factory.mktemp("ckpt") / "gemma3-swa.gguf", spec, default_model
    )


# --- the rules, without llama-server ---------------------------------------------------------


def test_role_markers_as_the_template_analysis_finds_them(default_model: Path) -> None:
    chatml = ChatTemplate(CHATML_TEMPLATE)  # what the tiny models (no template) get
    assert ck.user_start_marker(chatml.render) == "<|im_start|>user"
    assert ck.assistant_start_marker(chatml.render) == "<|im_start|>assistant"
    # SmolLM2's template puts its system message before a first user message: the diff of no
    # message against one user message keeps it in the marker, as llama-server's does
    smollm = ChatTemplate.from_gguf(default_model)
    assert ck.user_start_marker(smollm.render).endswith("<|im_end|>\n<|im_start|>user")
    assert ck._segments("a<b>c[d]e<f") == [
        (False, "a"),
        (True, "<b>"),
        (False, "c"),
        (True, "[d]"),
        (False, "e"),
        (False, "<f"),
    ]


def test_spans_take_the_first_matching_delimiter() -> None:
    delims = [("assistant", [1, 7]), ("user", [1, 5])]
    spans = ck.find_spans([9, 1, 5, 3, 1, 7, 4, 1, 5, 6], delims)
    assert spans.user_starts == frozenset({1, 7}) and spans.last_user == 7
    assert ck.find_spans([1, 5], []).user_starts == frozenset()
    assert ck.find_spans([1, 5], [("user", [])]).user_starts == frozenset(
        {0, 1}
    )  # std::equal of nothing


def first_prompt_plan(n: int, spans: ck.MessageSpans) -> tuple[list[int], list[int]]:
    """Batch ends and checkpoints of a prompt evaluated into an empty slot (pos_min -1 before
    the first batch, 0 after it, as long as the prompt fits the 768-cell SWA cache)."""
    ckpts = ck.Checkpoints(window=8)
    ends, start = [], 0
    while start < n:
        end = ck.batch_end(start, n, spans, ckpts.items)
        if ck.takes_checkpoint(start, end, n, -1 if start == 0 else 0, spans, ckpts.items):
            ckpts.create(start, 0, start - 1, 1, None)
        ends.append(end)
        start = end
    return ends, [c.n_tokens for c in ckpts.items]


def test_batches_end_at_user_starts_and_before_the_end() -> None:
    # what llama-server did with an 871-token chat prompt whose only user message starts at
    # token 12 (its log: checkpoints at n_tokens 12, 355 and 867)
    ends, taken = first_prompt_plan(871, ck.MessageSpans(frozenset({12})))
    assert ends == [12, 355, 867, 871] and taken == [12, 355, 867]
    # a plain prompt: only the two cuts before the end
    assert first_prompt_plan(900, ck.MessageSpans()) == ([384, 896, 900], [384, 896])
    # an earlier user start cuts only while no checkpoint exists; the last one always
    ends, taken = first_prompt_plan(1000, ck.MessageSpans(frozenset({5, 40, 300})))
    assert ends == [5, 40, 300, 484, 996, 1000] and taken == [5, 300, 484, 996]


def test_eviction_and_reuse_as_create_checkpoint() -> None:
    c = ck.Checkpoints(window=8, n_max=3, min_step=100)
    for n, task in ((10, 1), (50, 1), (400, 2)):
        c.create(n, 0, n - 1, task, None)
    c.create(420, 0, 419, 3, None)  # full: 50 is within min_step of 10 (another task), dropped
    assert [x.n_tokens for x in c.items] == [10, 400, 420]
    c.create(420, 5, 419, 3, None)  # the same n_tokens supersedes (after the oldest goes)
    assert [(x.n_tokens, x.pos_min) for x in c.items] == [(400, 0), (420, 5)]
    restored: list[Any] = []

    def restore(ring: Any, values: Any) -> None:
        restored.append((ring, values))

    # the cache still holds the window of the prefix: kept whole, later checkpoints erased
    assert c.reuse(410, 500, 600, 0, restore) == 410 and not restored
    assert [x.n_tokens for x in c.items] == [400]
    # it does not: the newest checkpoint early enough is restored, cut to its pos_max
    c.create(420, 0, 419, 4, "ring")
    assert c.reuse(430, 500, 600, 425, restore) == 419 and restored == [("ring", None)]
    # none usable: evaluated from 0, every checkpoint past position 0 erased
    assert c.reuse(300, 500, 600, 295, restore) == 0 and c.items == []


# --- side by side with llama-server ----------------------------------------------------------


def array_path_engine(path: Path) -> Engine:
    """The engine on the array-module path (what CuPy runs), on the CPU: no stored ring, only
    llama.cpp's SWA bookkeeping, which must take the same prefix decisions."""
    model = Model.load(path, device="cpu", progress=False, exact=False)
    tokenizer = Tokenizer.from_gguf(model.reader)
    return Engine(model, tokenizer, ChatTemplate.from_gguf(model.reader, tokenizer), N_CTX)


def array_cache_n(engine: Engine, kind: str, body: dict[str, Any]) -> tuple[int, int]:
    steps = engine.run_steps(engine.parse_request(dict(body), kind))
    for _ in steps:
        pass
    return _counts(steps.summary.timings)


def chat_turn(server: support.LlamaServer, engine: Engine, messages: list[dict]) -> dict[str, Any]:
    body = {
        "messages": messages,
        "max_tokens": N_PREDICT,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 10,
    }
    status, theirs = support.http_json(server.url + "/v1/chat/completions", dict(body))
    assert status == 200, theirs
    steps = engine.run_steps(engine.parse_request(dict(body), "chat"))
    chunks = list(steps)
    their_entries = theirs["choices"][0]["logprobs"]["content"]
    worst = max(
        (
            _gap(
                {e["token"]: e["logprob"] for e in mine.entry["top_logprobs"]},
                {e["token"]: e["logprob"] for e in their["top_logprobs"]},
            )
            for mine, their in zip(chunks, their_entries)
        ),
        default=0.0,
    )
    answer = theirs["choices"][0]["message"]["content"]
    return {
        "ours": _counts(steps.summary.timings),
        "theirs": _counts(theirs["timings"]),
        "same": "".join(c.text for c in chunks) == answer,
        "worst": worst,
        "answer": answer,
        "request": ("chat", copy.deepcopy(body)),
    }  # the caller extends its message list


def completion_turn(
    server: support.LlamaServer, engine: Engine, prompt: list[int] | str, **extra: Any
) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0, "n_probs": 10, **extra}
    status, theirs = support.http_json(server.url + "/completion", dict(body, return_tokens=True))
    assert status == 200, theirs
    steps = engine.run_steps(engine.parse_request(dict(body), "completion"))
    chunks = list(steps)
    worst = max(
        (
            _gap(
                {e["id"]: e["logprob"] for e in mine.entry["top_logprobs"]},
                {e["id"]: e["logprob"] for e in their["top_logprobs"]},
            )
            for mine, their in zip(chunks, theirs["completion_probabilities"])
        ),
        default=0.0,
    )
    return {
        "ours": _counts(steps.summary.timings),
        "theirs": _counts(theirs["timings"]),
        "same": steps.summary.tokens == theirs["tokens"],  # the end-of-generation token too
        "worst": worst,
        "request": ("completion", body),
    }


def _counts(timings: dict[str, Any]) -> tuple[int, int]:
    return timings["cache_n"], timings["prompt_n"]


def _gap(ours: dict, theirs: dict) -> float:
    return max(abs(lp - theirs.get(key, -numpy.inf)) for key, lp in ours.items())


@pytest.mark.llama_server
@pytest.mark.slow
def test_chats_and_prompts_past_the_window_as_llama_server(
    tiny_gemma3: Path, llama_server_bin: Path
) -> None:
    engine = Engine.open(tiny_gemma3, n_ctx=N_CTX, device="cpu")
    system = {"role": "system", "content": "You are a tiny test model."}
    first = {"role": "user", "content": words(850, 1)}
    results: dict[str, dict[str, Any]] = {}
    with support.LlamaServer(tiny_gemma3, binary=llama_server_bin) as server:
        chat = [system, first]
        results["chat 1"] = r = chat_turn(server, engine, chat)
        chat += [
            {"role": "assistant", "content": r["answer"]},
            {"role": "user", "content": words(30, 2)},
        ]
        results["chat 2: next turn"] = r2 = chat_turn(server, engine, chat)
        # the first user message edited: its window is gone from the SWA cache, so the
        # checkpoint at its start is restored (cache_n 11 of 12 shared tokens)
        edited = [system, {"role": "user", "content": "edited " + first["content"]}] + chat[2:]
        results["chat 3: first message edited"] = chat_turn(server, engine, edited)
        # back to the first conversation: the host prompt cache brings it back with its
        # checkpoints, holding only the window; one of them is restored
        chat += [
            {"role": "assistant", "content": r2["answer"]},
            {"role": "user", "content": words(20, 3)},
        ]
        results["chat 4: back to the first chat"] = chat_turn(server, engine, chat)
        ids = [int(t) for t in numpy.random.default_rng(7).integers(300, 40000, size=900)]
        other = [int(t) for t in numpy.random.default_rng(8).integers(300, 40000, size=900)]
        results["completion 900 tokens"] = completion_turn(server, engine, ids)
        # diverging 40 tokens before the end: the SWA cache holds that prefix's window
        results["completion sharing 850 tokens"] = completion_turn(
            server, engine, ids[:850] + other[:40]
        )
        # diverging before the oldest position the SWA cache holds, with no checkpoint that
        # early: evaluated again from 0
        results["completion sharing 60 tokens"] = completion_turn(
            server, engine, ids[:60] + other[:800]
        )
        # a /completion body naming its message delimiters: the batches end at those user
        # starts, and an edit in the second user message restores the checkpoint there
        delims = [{"role": "user", "delimiter": "<|im_start|>user"}]
        second = words(600, 6)
        text = (
            f"<|im_start|>user\n{words(300, 5)}<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n"
            f"<|im_start|>user\n{second}<|im_end|>\n<|im_start|>assistant\n"
        )
        results["completion with message_delimiters"] = completion_turn(
            server, engine, text, message_delimiters=delims
        )
        results["the same, second user message edited"] = completion_turn(
            server, engine, text.replace(second, "edited " + second), message_delimiters=delims
        )
    assert_as_llama_server(results)
    # the array path (CuPy's; its answers are close, not the same bits) reuses as much
    array = array_path_engine(tiny_gemma3)
    reused = {name: array_cache_n(array, *r["request"]) for name, r in results.items()}
    print(f"array path: {reused}")
    assert reused == {name: r["theirs"] for name, r in results.items()}
    # the turns meant to reach a restore and a re-evaluation did
    assert 0 < results["chat 3: first message edited"]["theirs"][0] < 20
    assert results["completion sharing 850 tokens"]["theirs"][0] == 850
    assert results["completion sharing 60 tokens"]["theirs"][0] == 0
    assert 300 < results["the same, second user message edited"]["theirs"][0] < 330


def assert_as_llama_server(results: dict[str, dict[str, Any]]) -> None:
    """Every turn: the same cache_n/prompt_n, the same answer, the same logprobs (printed)."""
    print()
    for name, r in results.items():
        print(
            f"{name}: cache_n/prompt_n ours {r['ours']}, llama-server {r['theirs']}; answer "
            f"{'same' if r['same'] else 'DIFFERENT'}; largest top-10 logprob difference {r['worst']:.3e}"
        )
    assert {name: r["ours"] for name, r in results.items()} == {
        name: r["theirs"] for name, r in results.items()
    }
    assert all(r["same"] for r in results.values())
    assert max(r["worst"] for r in results.values()) == 0.0


@pytest.mark.llama_server
@pytest.mark.slow
def test_a_gemma_template_as_llama_server(tiny_gemma3: Path, llama_server_bin: Path) -> None:
    """Gemma's own turn markers (<start_of_turn>user, plain text in this vocabulary), given to
    llama-server with --chat-template-file: its template analysis and ours must find the same
    user-message starts, which the cache_n of an edited first message shows (the checkpoint at
    the first user message's start is restored)."""
    # the build script keeps llama.cpp's source beside its bin/
    source = (
        llama_server_bin.parent.parent
        / "src"
        / "llama.cpp"
        / "models"
        / "templates"
        / "google-gemma-2-2b-it.jinja"
    )
    if not source.exists():
        pytest.skip(
            f"{source} is not there (llama-server not built by scripts/build-llama-server.sh)"
        )
    engine = Engine.open(tiny_gemma3, n_ctx=N_CTX, device="cpu")
    engine.template = dataclasses.replace(engine.template, source=source.read_text())
    first = {"role": "user", "content": words(850, 4)}
    results = {}
    with support.LlamaServer(
        tiny_gemma3, binary=llama_server_bin, args=["--chat-template-file", str(source)]
    ) as server:
        results["gemma chat 1"] = r = chat_turn(server, engine, [first])
        chat = [
            first,
            {"role": "assistant", "content": r["answer"]},
            {"role": "user", "content": words(30, 5)},
        ]
        results["gemma chat 2"] = chat_turn(server, engine, chat)
        edited = [{"role": "user", "content": "edited " + first["content"]}] + chat[1:]
        results["gemma chat 3: first message edited"] = chat_turn(server, engine, edited)
    assert_as_llama_server(results)
    assert 0 < results["gemma chat 3: first message edited"]["theirs"][0] < 10


def test_slot_erase_and_restore_forget_the_checkpoints(tiny_gemma3: Path, tmp_path: Path) -> None:
    """llama-server's slot erase and slot restore clear the slot's prompt (server_prompt::clear:
    its tokens and its checkpoints): a checkpoint of the conversation that was there before must
    not be restored into the next one."""
    from bankml.engine_cupy import slots

    engine = Engine.open(tiny_gemma3, n_ctx=N_CTX, device="cpu")
    chat = {"messages": [{"role": "user", "content": words(300, 1)}], "max_tokens": 2}
    array_cache_n(engine, "chat", chat)
    assert engine.checkpoints is not None and engine.checkpoints.items  # taken at the user start
    slots.save_slot(engine, str(tmp_path / "slot.bin"), "0" * 64)
    slots.erase_slot(engine)
    assert engine.checkpoints.items == [] and engine.slot_tokens == []
    array_cache_n(engine, "chat", chat)
    assert engine.checkpoints.items
    slots.restore_slot(engine, str(tmp_path / "slot.bin"), "0" * 64)
    assert engine.checkpoints.items == [] and engine.slot_tokens
