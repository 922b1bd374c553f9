"""Every endpoint llama-server has and bankml serves, side by side: bankml ``--native`` and the
real llama-server on the same model, the same requests, over real HTTP on loopback.

For each endpoint: the same status, the same keys (recursively: every key path of the JSON, list
items merged), and the same values where a client may rely on them (tokenize, detokenize,
apply-template, /props' template and generation defaults, the models' ids and sizes, and every
refusal message: context limit, sampler values, logprobs, ``n``, ``stream_options``, slots, wrong
methods). The only keys bankml adds are its receipt (``bankml_receipt``, at the top level of a
whole answer and of a stream's last regular event) and ``usage`` on a streamed chat's finish
chunk when ``stream_options.include_usage`` is not set (so the last chunk always carries usage
and timings); both are listed in ``BANKML_ADDITIONS``.

Where bankml answers differently on purpose, the test asserts bankml's answer and llama-server's,
and docs/modules/native_service.md says why. Differences that remain in files this suite does not
own are strict xfails naming the file: they fail loudly once fixed, so the marker comes off.

The native side is the native tests' shared engine (``shared_served``, n_ctx 2048 like the
reference). ``reference_server`` is the test run's llama-server (no ``--metrics``, no slot path);
``full_reference`` is a second llama-server of this module with ``--metrics`` and
``--slot-save-path``, for /metrics and the slot actions. Generated text is not compared here (the
engine's numerics are test_forward's and test_engine's, served answers
test_served_greedy_chat's), only its shape and the prompt's token count.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_twisted
from twisted.internet import reactor
from twisted.internet.threads import deferToThread

from bankml.native.resident import NativeEngine
from bankml.native.service import build_native_roots
from bankml.serving.site import LoopbackSite, listen_loopback
from tests import support
from tests.events import HANG_GUARD_S
from tests.native_support import (
    N_CTX,
    RECEIPT,
    Served,
    assert_same_keys,
    both,
    call,
    chat,
    completion,
    key_paths,
    receipt_free,
)


@pytest.fixture(scope="module")
def full_reference(default_model: Path, llama_server_bin: Path) -> Iterator[support.LlamaServer]:
    """llama-server with the endpoints bankml always has: --metrics and a slot directory."""
    with tempfile.TemporaryDirectory(prefix="ref-slots-") as slot_dir:
        with support.LlamaServer(
            default_model, args=["--metrics", "--slot-save-path", slot_dir], binary=llama_server_bin
        ) as server:
            yield server


# --- GET /health, /props, /v1/models, /metrics -----------------------------------------------------


@pytest.mark.parametrize("path", ["/health", "/v1/health", "/v1/models", "/models"])
@pytest_twisted.ensureDeferred
async def test_state_endpoints_answer_llama_servers_keys(
    served: Served, reference_server: Any, path: str
) -> None:
    (status, ctype, ours), (ref_status, ref_ctype, ref) = await both(
        served.engine_url, reference_server, "GET", path
    )
    assert status == ref_status == 200 and ctype == ref_ctype
    assert_same_keys(ours, ref)


@pytest_twisted.ensureDeferred
async def test_models_name_and_measure_the_same_model(
    served: Served, reference_server: Any
) -> None:
    (_, _, ours), (_, _, ref) = await both(served.engine_url, reference_server, "GET", "/v1/models")
    mine, theirs = ours["data"][0], ref["data"][0]
    # llama-server names the model by its -m argument; bankml by the file's name (its id everywhere)
    assert mine["id"] == Path(theirs["id"]).name == support.DEFAULT_MODEL.name
    assert mine["aliases"] == [mine["id"]] and ours["models"][0]["name"] == mine["id"]
    assert (
        mine["meta"] == theirs["meta"]
    )  # vocab, n_ctx, n_ctx_train, n_embd, n_params, size, ftype
    assert mine["architecture"] == theirs["architecture"] and mine["object"] == theirs["object"]


@pytest_twisted.ensureDeferred
async def test_props_give_llama_servers_template_and_defaults(
    served: Served, reference_server: Any
) -> None:
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, reference_server, "GET", "/props"
    )
    assert status == ref_status == 200
    for key in (
        "chat_template",
        "bos_token",
        "eos_token",
        "model_ftype",
        "total_slots",
        "modalities",
        "endpoint_props",
        "ui",
        "is_sleeping",
    ):
        assert ours[key] == ref[key], key
    assert (
        ours["default_generation_settings"]["n_ctx"]
        == ref["default_generation_settings"]["n_ctx"]
        == N_CTX
    )
    params, ref_params = (
        ours["default_generation_settings"]["params"],
        ref["default_generation_settings"]["params"],
    )
    for key in set(ref_params) - {
        "reasoning_format"
    }:  # every default llama-server shows, to the bit
        assert json.dumps(params.get(key)) == json.dumps(ref_params[key]), key  # (C floats widened)


@pytest.mark.parametrize(
    "obj, text",
    [
        (
            {"logprob": float("-inf"), "top": [float("inf"), float("nan"), 1.5, -0.0]},
            '{"logprob":null,"top":[null,null,1.5,-0.0]}',
        ),
        ({"a": "é", "b": (1, 2.5)}, '{"a":"é","b":[1,2.5]}'),
    ],
)
def test_dumps_writes_valid_json_with_non_finite_numbers_as_null(obj: Any, text: str) -> None:
    """nlohmann writes NaN and infinities as null; Python's NaN/Infinity would not be JSON."""
    from bankml.formats.nlohmann import dumps

    assert dumps(obj) == text.encode()
    json.loads(dumps(obj), parse_constant=lambda name: pytest.fail(f"{name} in JSON"))


@pytest.mark.parametrize("path", ["/completion", "/v1/chat/completions", "/tokenize"])
@pytest_twisted.ensureDeferred
async def test_a_number_beyond_a_double_is_refused_as_llama_server(
    served: Served, reference_server: Any, path: str
) -> None:
    """1e400 is nlohmann's parse error (out_of_range.406), never an infinity read and echoed."""
    body = json.dumps(
        {
            "prompt": "x",
            "content": "x",
            "messages": [{"role": "user", "content": "x"}],
            "lora": [{"id": 0, "scale": 1}],
            "n_predict": 1,
        }
    ).replace('"scale": 1', '"scale": 1e400')
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, reference_server, "POST", path, raw=body.encode()
    )
    assert status == ref_status == 400
    assert (
        ref["error"]["message"]
        == "[json.exception.out_of_range.406] number overflow parsing '1e400'"
    )
    assert (
        ours["error"]["message"] == "the request body is not JSON: number overflow parsing '1e400'"
    )


@pytest.mark.parametrize(
    "value", [0.8, 0.1, 0.95, -1.0, 1e-45, 3.4e38, 1e39, -1e39, float("inf"), float("nan"), 7]
)
def test_c_float_is_a_float32_widened_and_json_null_when_not_finite(value: float) -> None:
    import math

    import numpy as np

    from bankml.formats.nlohmann import c_float

    with np.errstate(over="ignore"):
        as_c = float(np.float32(value))  # a double assigned to a C float, read back as a double
    assert c_float(value) == (as_c if math.isfinite(as_c) else None)


@pytest_twisted.ensureDeferred
async def test_props_have_llama_servers_keys(served: Served, reference_server: Any) -> None:
    (_, _, ours), (_, _, ref) = await both(served.engine_url, reference_server, "GET", "/props")
    assert_same_keys(ours, ref)
    assert (
        ours["chat_template_caps"] == ref["chat_template_caps"]
    )  # the same caps, in std::map's order
    assert list(ours["chat_template_caps"]) == list(ref["chat_template_caps"])
    reasoning = ours["default_generation_settings"]["params"]["reasoning_format"]
    assert reasoning == ref["default_generation_settings"]["params"]["reasoning_format"] == "none"


def metric_lines(text: str) -> list[str]:
    """The HELP and TYPE lines of a Prometheus exposition (the values change with every request)."""
    return [line for line in text.splitlines() if line.startswith("#")]


@pytest_twisted.ensureDeferred
async def test_metrics_are_llama_servers_names_and_types(
    served: Served, full_reference: Any
) -> None:
    (status, ctype, ours), (ref_status, ref_ctype, ref) = await both(
        served.engine_url, full_reference, "GET", "/metrics"
    )
    assert status == ref_status == 200 and ctype == ref_ctype == "text/plain; version=0.0.4"
    mine, theirs = metric_lines(ours), metric_lines(ref)
    assert set(mine) <= set(theirs), set(mine) - set(theirs)  # same names, HELP texts and types
    assert [line for line in theirs if line in mine] == mine  # in llama-server's order


@pytest_twisted.ensureDeferred
async def test_metrics_list_every_llama_server_metric(served: Served, full_reference: Any) -> None:
    (_, _, ours), (_, _, ref) = await both(served.engine_url, full_reference, "GET", "/metrics")
    assert metric_lines(ours) == metric_lines(ref)


# --- POST /tokenize, /detokenize, /apply-template --------------------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/tokenize", {"content": "Hello <|im_start|> wörld", "with_pieces": True}),
        ("/tokenize", {"content": "Hello", "add_special": True, "parse_special": False}),
        ("/tokenize", {}),
        (
            "/tokenize",
            {"content": [1, "Hello", 2.9, True, 4294967301, 1e30], "add_special": True},
        ),  # C++'s int casts
        (
            "/tokenize",
            {"content": "Hello", "add_special": 1, "with_pieces": "x"},
        ),  # not booleans: the defaults
        ("/detokenize", {"tokens": [19556, 905, 1, 2]}),
        ("/detokenize", {"tokens": [True, 2.5, 4294967301]}),
        ("/detokenize", {}),
        (
            "/apply-template",
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                ]
            },
        ),
        (
            "/apply-template",
            {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False},
        ),
        ("/apply-template", {}),  # 'messages' is required
        ("/apply-template", {"messages": "x"}),
        ("/apply-template", {"messages": [{"role": "user"}]}),
    ],
)
@pytest_twisted.ensureDeferred
async def test_text_endpoints_answer_exactly_as_llama_server(
    served: Served, reference_server: Any, path: str, body: dict
) -> None:
    ours, ref = await both(served.engine_url, reference_server, "POST", path, body)
    assert ours == ref


@pytest.mark.parametrize("token", [49152, 10**8, -1])
@pytest_twisted.ensureDeferred
async def test_detokenize_out_of_range_is_a_clear_400(
    served: Served, reference_server: Any, token: int
) -> None:
    """llama-server reads out of bounds and answers 500 with a C++ range_check text; bankml
    refuses the request (the project's rule: bad input is a clear 4xx, never a 500)."""
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, reference_server, "POST", "/detokenize", {"tokens": [19556, token]}
    )
    assert ref_status == 500 and "range_check" in ref["error"]["message"]
    assert status == 400 and ours == {
        "error": {"code": 400, "message": "Invalid token id", "type": "invalid_request_error"}
    }
    assert_same_keys(ours, ref)


@pytest_twisted.ensureDeferred
async def test_a_message_without_a_role_is_400_with_llama_servers_message(
    served: Served, reference_server: Any
) -> None:
    """llama-server answers its own parse failure with 500; the message is the same, bankml's
    status is 400 (it is the client's input)."""
    body = {"messages": [{"content": "x"}]}
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, reference_server, "POST", "/apply-template", body
    )
    assert (status, ref_status) == (400, 500)
    assert ours["error"]["message"] == ref["error"]["message"]
    assert (ours["error"]["type"], ref["error"]["type"]) == (
        "invalid_request_error",
        "server_error",
    )


@pytest.mark.parametrize(
    "path, body",
    [
        ("/tokenize", {"content": 5}),
        ("/tokenize", {"content": None}),
        ("/tokenize", {"content": [1, None]}),
        ("/tokenize", {"content": ["a", {}]}),
        ("/detokenize", {"tokens": "abc"}),
        ("/detokenize", {"tokens": None}),
        ("/detokenize", {"tokens": [1, "a"]}),
        ("/detokenize", {"tokens": [[1]]}),
    ],
)
@pytest_twisted.ensureDeferred
async def test_text_endpoint_type_refusals_are_llama_servers(
    served: Served, reference_server: Any, path: str, body: dict
) -> None:
    ours, ref = await both(served.engine_url, reference_server, "POST", path, body)
    assert ours == ref


# --- POST /completion, /v1/completions, /v1/chat/completions ---------------------------------------


@pytest.mark.parametrize(
    "path, body",
    [
        ("/completion", completion()),
        ("/completion", completion(n_probs=2)),
        ("/v1/completions", completion()),
        ("/v1/completions", completion(logprobs=2)),
        ("/v1/chat/completions", chat()),
        ("/v1/chat/completions", chat(logprobs=True, top_logprobs=2)),
    ],
)
@pytest_twisted.ensureDeferred
async def test_answers_have_llama_servers_keys(
    served: Served, reference_server: Any, path: str, body: dict
) -> None:
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, reference_server, "POST", path, body
    )
    assert status == ref_status == 200
    assert_same_keys(ours, ref)
    assert RECEIPT in ours
    prompt_tokens = (
        (ours["tokens_evaluated"], ref["tokens_evaluated"])
        if path == "/completion"
        else (ours["usage"]["prompt_tokens"], ref["usage"]["prompt_tokens"])
    )
    assert prompt_tokens[0] == prompt_tokens[1]  # the same template and tokens
    if path != "/completion":  # the same per-token timing keys, the rates null or positive
        assert all(v is None or v >= 0 for v in ours["timings"].values())


def stream_shape(events: list[Any]) -> list[Any]:
    """A stream as the sequence of its events' key sets, consecutive equal ones collapsed (the
    number of text pieces depends on the text)."""
    shape: list[Any] = []
    for event in events:
        keys = sorted(key_paths(event)) if isinstance(event, dict) else event
        if not shape or shape[-1] != keys:
            shape.append(keys)
    return shape


@pytest.mark.parametrize(
    "path, body, addition",
    [
        ("/completion", completion(stream=True), set()),
        ("/v1/completions", completion(stream=True), set()),
        ("/v1/completions", completion(stream=True, stream_options={"include_usage": True}), set()),
        (
            "/v1/chat/completions",
            chat(stream=True),
            {"usage"},
        ),  # bankml's addition on the finish chunk
        ("/v1/chat/completions", chat(stream=True, stream_options={"include_usage": True}), set()),
        (
            "/v1/chat/completions",
            chat(stream=True, stream_options={"include_usage": False}),
            {"usage"},
        ),
        ("/v1/chat/completions", chat(stream=True, logprobs=True, top_logprobs=1), {"usage"}),
    ],
)
@pytest_twisted.ensureDeferred
async def test_streams_have_llama_servers_events(
    served: Served, reference_server: Any, path: str, body: dict, addition: set[str]
) -> None:
    (status, ctype, ours), (ref_status, ref_ctype, ref) = await both(
        served.engine_url, reference_server, "POST", path, body
    )
    assert (
        status == ref_status == 200
        and ctype.startswith("text/event-stream")
        and ref_ctype.startswith(ctype)
    )
    ours = receipt_free(ours)
    finish = ours[-2] if ours[-1] == "[DONE]" else ours[-1]
    if addition:
        assert set(finish) - set(finish_of(ref)) == addition
        finish_without = {k: v for k, v in finish.items() if k not in addition}
        ours = [finish_without if e is finish else e for e in ours]
    assert stream_shape(ours) == stream_shape(ref)


def finish_of(events: list[Any]) -> dict[str, Any]:
    return events[-2] if events[-1] == "[DONE]" else events[-1]


@pytest_twisted.ensureDeferred
async def test_include_usage_ends_a_chat_with_a_usage_chunk(
    served: Served, reference_server: Any
) -> None:
    body = chat(stream=True, stream_options={"include_usage": True})
    (_, _, ours), (_, _, ref) = await both(
        served.engine_url, reference_server, "POST", "/v1/chat/completions", body
    )
    for events in (receipt_free(ours), ref):
        finish, usage, done = events[-3:]
        assert (
            done == "[DONE]"
            and usage["choices"] == []
            and finish["choices"][0]["finish_reason"] == "length"
        )
        assert "usage" not in finish and "timings" not in finish
        assert usage["usage"]["completion_tokens"] == 2 and set(usage["timings"]) >= {
            "cache_n",
            "prompt_n",
        }
    assert receipt_free(ours)[-2]["usage"]["prompt_tokens"] == ref[-2]["usage"]["prompt_tokens"]


# --- refusals: the same status and message -----------------------------------------------------------


LONG = "word " * (N_CTX + 50)
REFUSALS = [
    (
        "/v1/chat/completions",
        chat(LONG),
    ),  # the context limit (exceed_context_size_error with its counts)
    ("/v1/completions", completion(LONG)),
    ("/completion", completion(LONG)),
    ("/v1/chat/completions", chat(repeat_penalty=-1)),  # sampler values
    ("/v1/chat/completions", chat(min_p="x")),
    ("/completion", completion(repeat_last_n=-2)),
    ("/v1/chat/completions", chat(max_tokens=-2)),
    ("/v1/chat/completions", chat(stop=[5])),
    ("/v1/chat/completions", chat(top_logprobs=2)),  # logprobs
    (
        "/v1/chat/completions",
        chat(n=2),
    ),  # n > 1: llama-server has one completion per prompt per slot
    ("/v1/completions", completion(n=2)),
    ("/completion", completion(n=0)),
    ("/v1/chat/completions", chat(n="2")),
    (
        "/v1/chat/completions",
        chat(stream=True, stream_options={"include_usage": "yes"}),
    ),  # stream_options
    ("/apply-template", {"messages": "x"}),
]


@pytest.mark.parametrize(
    "path, body", REFUSALS, ids=lambda v: v if isinstance(v, str) else json.dumps(v)[:60]
)
@pytest_twisted.ensureDeferred
async def test_refusals_are_llama_servers_word_for_word(
    served: Served, reference_server: Any, path: str, body: dict
) -> None:
    ours, ref = await both(served.engine_url, reference_server, "POST", path, body)
    assert ours[0] == 400 and ours == ref


@pytest.mark.parametrize(
    "body",
    [
        completion(stream_options={"include_usage": 1}),
        completion(stream=True, stream_options={"include_usage": "yes"}),
    ],
)
@pytest_twisted.ensureDeferred
async def test_completions_check_include_usage_as_llama_server(
    served: Served, reference_server: Any, body: dict
) -> None:
    ours, ref = await both(served.engine_url, reference_server, "POST", "/v1/completions", body)
    assert ours[0] == 400 and ours == ref


def top_logprobs_seen(answer: tuple[int, str, Any]) -> Any:
    """A chat answer's status and its first token's number of top_logprobs (None without logprobs),
    or the refusal."""
    status, _, body = answer
    if status != 200:
        return status, body
    logprobs = body["choices"][0].get("logprobs")
    return status, len(logprobs["content"][0]["top_logprobs"]) if logprobs else None


@pytest.mark.parametrize(
    "extra",
    [
        {"logprobs": "x"},
        {"logprobs": True, "top_logprobs": "2"},
        {"logprobs": 1},
        {"logprobs": 0},
        {"logprobs": False},
        {"logprobs": 3, "n_probs": 1},
        {"logprobs": False, "top_logprobs": 2},
        {"logprobs": True, "top_logprobs": 2.5},
        {"logprobs": True, "top_logprobs": None},
        {"logprobs": True, "top_logprobs": 2, "n_probs": 5},
    ],
    ids=json.dumps,
)
@pytest_twisted.ensureDeferred
async def test_chat_logprobs_types_as_llama_server(
    served: Served, reference_server: Any, extra: dict
) -> None:
    """logprobs true: n_probs = top_logprobs (20 when not a number); any other logprobs is n_probs'
    alias (a string its type error)."""
    ours, ref = await both(
        served.engine_url, reference_server, "POST", "/v1/chat/completions", chat(**extra)
    )
    assert top_logprobs_seen(ours) == top_logprobs_seen(ref)


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/tokenize", None),
        ("GET", "/completion", None),
        ("GET", "/v1/chat/completions", None),
        ("GET", "/v1/completions", None),
        ("PUT", "/v1/chat/completions", {}),
        ("POST", "/health", {}),
        ("POST", "/v1/models", {}),
        ("POST", "/metrics", {}),
        ("DELETE", "/health", None),
        ("POST", "/props", {}),  # routed, refused: 501 "Start it with `--props`"
        ("GET", "/health/extra", None),
        ("POST", "/v1/chat/completions/", chat()),
        ("GET", "/nowhere", None),
        ("GET", "/v1", None),
    ],
)
@pytest_twisted.ensureDeferred
async def test_wrong_methods_and_paths_are_llama_servers_answers(
    served: Served, reference_server: Any, method: str, path: str, body: Any
) -> None:
    ours, ref = await both(served.engine_url, reference_server, method, path, body)
    assert ours[0] in (404, 501) and ours == ref


@pytest.mark.parametrize(
    "path",
    [
        "/tokenize",
        "/detokenize",
        "/apply-template",
        "/completion",
        "/v1/completions",
        "/v1/chat/completions",
        "/slots/0?action=save",
    ],
)
@pytest.mark.parametrize(
    "raw", [b"{not json", b'{"prompt": "x", "n_predict": NaN, "content": [Infinity]}']
)
@pytest_twisted.ensureDeferred
async def test_bad_json_is_400_everywhere(
    served: Served, full_reference: Any, path: str, raw: bytes
) -> None:
    """Not JSON (also Python's NaN and Infinity, which JSON lacks): the same 400 and error type;
    the message is Python's parser's, not nlohmann's (a client cannot act on either beyond "fix the JSON")."""
    (status, _, ours), (ref_status, _, ref) = await both(
        served.engine_url, full_reference, "POST", path, raw=raw
    )
    assert status == ref_status == 400
    assert_same_keys(ours, ref)
    assert ours["error"]["type"] == ref["error"]["type"] == "invalid_request_error"
    assert ours["error"]["message"].startswith("the request body is not JSON: ")
    assert ref["error"]["message"].startswith("[json.exception.parse_error.101] parse error")


@pytest.mark.parametrize(
    "path", ["/tokenize", "/detokenize", "/completion", "/v1/chat/completions"]
)
@pytest_twisted.ensureDeferred
async def test_a_body_that_is_not_an_object_is_400(
    served: Served, reference_server: Any, path: str
) -> None:
    """llama-server answers a JSON array on some endpoints as an empty request (200) and on others
    with nlohmann's text; bankml refuses it alike everywhere."""
    (status, _, ours), (ref_status, _, _) = await both(
        served.engine_url, reference_server, "POST", path, raw=b"[1,2]"
    )
    assert status == 400 and ref_status in (200, 400)
    assert ours == {
        "error": {
            "code": 400,
            "message": "the request body must be a JSON object",
            "type": "invalid_request_error",
        }
    }


# --- /slots/0?action=save|restore|erase -------------------------------------------------------------------


async def slot_action(url: str, sid: str, action: str, body: Any = None) -> tuple[int, str, Any]:
    return await deferToThread(
        call, url, "POST", f"/slots/{sid}?action={action}", body if body is not None else {}
    )


@pytest_twisted.ensureDeferred
async def test_slot_save_erase_restore_answer_as_llama_server(
    served: Served, full_reference: Any
) -> None:
    name = "side-by-side.bin"
    answers: dict[str, list[Any]] = {}
    kept: dict[str, int] = {}
    for url in (served.engine_url, full_reference.url):
        _, _, done = await deferToThread(
            call, url, "POST", "/completion", completion("Hello there")
        )
        kept[url] = (
            done["tokens_evaluated"] + done["tokens_predicted"] - 1
        )  # the last token is never decoded
        steps = [
            await slot_action(url, "0", "save", {"filename": name}),
            await slot_action(url, "0", "erase"),
            await slot_action(url, "0", "restore", {"filename": name}),
            await slot_action(url, "0", "restore", {"filename": "missing.bin"}),
        ]
        answers[url] = steps
    ours, ref = answers[served.engine_url], answers[full_reference.url]
    for (status, _, mine), (ref_status, _, theirs) in zip(ours, ref):
        assert status == ref_status
        assert_same_keys(mine, theirs)
    (_, _, saved), (_, _, erased), (_, _, restored), (_, _, missing) = ours
    (_, _, ref_saved), (_, _, ref_erased), (_, _, ref_restored), (_, _, ref_missing) = ref
    n_kept = kept[served.engine_url]
    assert n_kept == kept[full_reference.url] > 0
    assert saved["n_saved"] == ref_saved["n_saved"] == n_kept
    assert erased == ref_erased == {"id_slot": 0, "n_erased": n_kept}
    assert restored["n_restored"] == ref_restored["n_restored"] == n_kept
    assert (
        (saved["filename"], restored["filename"])
        == (ref_saved["filename"], ref_restored["filename"])
        == (name, name)
    )
    # bankml writes its own file format (with the model's sha256 and a trailer): other sizes
    assert (
        restored["n_read"] == saved["n_written"]
        and ref_restored["n_read"] == ref_saved["n_written"]
    )
    # a failed restore: the same prefix; bankml names the reason (llama-server's is generic)
    assert missing["error"]["message"].startswith("Unable to restore slot: ")
    assert ref_missing["error"]["message"].startswith("Unable to restore slot: ")
    assert "missing.bin" in missing["error"]["message"]


@pytest.mark.parametrize(
    "sid, action, body",
    [
        ("0", "bogus", {}),
        ("0", "", {}),
        ("x", "save", {"filename": "a.bin"}),
        ("0", "save", {}),
        ("0", "save", {"filename": "../a.bin"}),
        ("0", "restore", {"filename": "/tmp/a.bin"}),
        ("0", "save", {"filename": "a:b"}),
        ("0", "save", {"filename": " a"}),
        ("0", "save", {"filename": "a."}),
        ("0", "save", {"filename": "a\u2215b"}),
        ("0", "save", {"filename": "x" * 256}),
        ("0", "save", {"filename": 5}),
        ("0", "restore", {"filename": None}),
        ("2147483648", "erase", {}),
        ("2147483648", "save", {"filename": "a.bin"}),  # beyond std::stoi's int
    ],
)
@pytest_twisted.ensureDeferred
async def test_slot_refusals_are_llama_servers_word_for_word(
    served: Served, full_reference: Any, sid: str, action: str, body: dict
) -> None:
    ours = await slot_action(served.engine_url, sid, action, body)
    ref = await slot_action(full_reference.url, sid, action, body)
    assert ours[0] == 400 and ours == ref


@pytest.mark.parametrize(
    "method, path", [("GET", "/slots"), ("POST", "/slots"), ("GET", "/slots/0")]
)
@pytest_twisted.ensureDeferred
async def test_slot_paths_route_as_llama_servers(
    served: Served, full_reference: Any, method: str, path: str
) -> None:
    """GET /slots is llama-server's slot monitor (test_native_llama_endpoints compares its
    values); the other two are its 404."""
    ours = await deferToThread(
        call, served.engine_url, method, path, {} if method == "POST" else None
    )
    ref = await deferToThread(
        call, full_reference.url, method, path, {} if method == "POST" else None
    )
    if (method, path) == ("GET", "/slots"):
        assert ours[0] == ref[0] == 200 and isinstance(ours[2], list) and len(ours[2]) == 1
        assert set(ours[2][0]) == set(ref[2][0])  # both have run a task by now
    else:
        assert ours == ref and ours[0] == 404


@pytest.mark.parametrize("sid, echoed", [("1", 1), ("-7", -7), ("%205x", 5)])
@pytest_twisted.ensureDeferred
async def test_slot_ids_wrap_as_llama_servers(
    served: Served, full_reference: Any, sid: str, echoed: int
) -> None:
    """Any id std::stoi reads is slot id % n_slots (one slot: slot 0), echoed back as asked."""
    ours = await slot_action(served.engine_url, sid, "erase")
    ref = await slot_action(full_reference.url, sid, "erase")
    assert ours[0] == ref[0] == 200 and ours[2]["id_slot"] == ref[2]["id_slot"] == echoed


@pytest_twisted.ensureDeferred
async def test_slots_without_a_slot_dir_are_llama_servers_501(
    served: Served, reference_server: Any
) -> None:
    bare = NativeEngine(
        served.native.engine,
        served.native.bridge,
        served.native.verified,
        slot_dir=None,
        n_ctx=N_CTX,
        reactor=reactor,
    )
    _, engine_root = build_native_roots(bare, sampler=object())
    port = listen_loopback(LoopbackSite(engine_root), "127.0.0.1:0")
    try:
        for action, body in (
            ("save", {"filename": "a.bin"}),
            ("restore", {"filename": "a.bin"}),
            ("erase", {}),
        ):
            ours = await slot_action(f"http://127.0.0.1:{port.getHost().port}", "0", action, body)
            ref = await slot_action(reference_server.url, "0", action, body)
            assert ours[0] == 501 and ours == ref
    finally:
        await port.stopListening()


# --- the official openai client: n > 1 and stream_options.include_usage -----------------------------------


def openai_client_view(base_url: str) -> dict[str, Any]:
    """What the openai client makes of n=2 (chat and completions) and of include_usage; blocking."""
    import openai

    client = openai.OpenAI(
        base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=HANG_GUARD_S
    )
    seen: dict[str, Any] = {}
    messages = [{"role": "user", "content": "Name a colour."}]
    for name, create in (
        (
            "chat_n",
            lambda: client.chat.completions.create(model="x", messages=messages, max_tokens=2, n=2),
        ),
        (
            "completions_n",
            lambda: client.completions.create(
                model="x", prompt="The capital of France is", max_tokens=2, n=2
            ),
        ),
    ):
        try:
            create()
            seen[name] = "answered"
        except openai.BadRequestError as err:
            seen[name] = (err.status_code, err.body)
    chunks = list(
        client.chat.completions.create(
            model="x",
            messages=messages,
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    seen["usage_chunks"] = [
        (ch.choices, ch.usage.completion_tokens, ch.usage.prompt_tokens)
        for ch in chunks
        if ch.usage is not None
    ]
    return seen


@pytest_twisted.ensureDeferred
async def test_openai_client_sees_n_and_include_usage_as_with_llama_server(
    served: Served, reference_server: Any
) -> None:
    ours = await deferToThread(openai_client_view, served.url)
    ref = await deferToThread(openai_client_view, reference_server.url)
    message = "Field 'n': Value must be between 1 <= value <= 1, but got 2"
    for name in ("chat_n", "completions_n"):
        assert ours[name] == ref[name]
        assert ours[name][0] == 400 and message in json.dumps(ours[name][1])
    assert ours["usage_chunks"] == ref["usage_chunks"]  # one chunk, no choices, the same counts
    assert len(ours["usage_chunks"]) == 1 and ours["usage_chunks"][0][:2] == ([], 2)


# --- bankml.chat: the same checks as HTTP -------------------------------------------------------------


def api_refusal(native: NativeEngine, request: Any, stream: bool) -> tuple[int, Any]:
    """(status, error object) of bankml.chat (or chat_stream) refusing ``request``; blocking."""
    from bankml import api

    try:
        if stream:
            list(api.chat_stream(request, native=native))
        else:
            api.chat(request, native=native)
    except api.ApiError as err:
        return err.status, err.body
    raise AssertionError("answered")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "request_",
    [
        chat(stream_options={"include_usage": "yes"}),
        chat(stream=True, stream_options={"include_usage": 1}),
        chat(logprobs="x"),
    ],
    ids=json.dumps,
)
@pytest_twisted.ensureDeferred
async def test_api_refuses_as_llama_server(
    served: Served, reference_server: Any, request_: dict, stream: bool
) -> None:
    """bankml.chat and chat_stream read a request by the engine's own checks, as HTTP does:
    llama-server's status and error object."""
    ours = await deferToThread(api_refusal, served.native, request_, stream)
    ref_status, _, ref = await deferToThread(
        call, reference_server.url, "POST", "/v1/chat/completions", request_
    )
    assert ours == (ref_status, ref) and ref_status == 400


@pytest.mark.parametrize(
    "request_", [chat(max_tokens=float("nan")), json.dumps(chat()).replace("0", "NaN").encode()]
)
def test_api_refuses_nan_as_not_json(served: Served, request_: Any) -> None:
    status, body = api_refusal(served.native, request_, stream=False)
    assert status == 400 and body["error"]["message"].startswith("the request body is not JSON: ")
