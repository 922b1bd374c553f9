"""Ollama's API bodies and the request pipeline, checked against the official client's types."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from ollama._types import (
    ChatResponse,
    GenerateResponse,
    ListResponse,
    ProcessResponse,
    ShowResponse,
    StatusResponse,
)

from bankml.formats import ollama as fmt
from bankml.formats.ollama_request import (
    CHAT,
    GENERATE,
    Prepared,
    fit_chat,
    parse_body,
    prepare,
    prompt_too_long,
)
from bankml.registry.catalog import Catalog
from bankml.registry.create import create, spec_from_modelfile
from bankml.registry.keepalive import FOR, FOREVER, KeepAlive
from bankml.registry.modelfile import parse_modelfile
from bankml.registry.pins import discover
from bankml.registry.residency import Residency
from bankml.version import __version__
from tests.registry_support import pin_into, write_gguf

N_CTX = 4096
SYSTEM_MF = (
    "FROM tiny-f16\nSYSTEM You are mindX.\nPARAMETER temperature 0.3\nPARAMETER num_ctx 2048\n"
    'PARAMETER stop "<|im_end|>"\nMESSAGE user earlier\nMESSAGE assistant reply\nLICENSE MIT\n'
)


@pytest.fixture
def catalog(tmp_path: Path) -> Catalog:
    forks = tmp_path / "forks"
    forks.mkdir()
    write_gguf(forks / "Tiny-F16.gguf", name="Tiny", size_label="1M", temperature=0.6)
    pin_into(forks, forks / "Tiny-F16.gguf")
    startup = (str(forks / "Tiny-F16.gguf"), str(forks / "Tiny-F16.gguf.FORK.json"))
    first = Catalog.load(discover(str(forks), startup=startup), str(forks))
    create("mindx", spec_from_modelfile(SYSTEM_MF), first, now_ns=lambda: 0)
    return Catalog.load(discover(str(forks), startup=startup), str(forks))


# -- encoding, errors, fixed bodies ---------------------------------------------------------------


def test_encoding_and_errors() -> None:
    assert fmt.dumps({"a": "é", "b": [1, 2]}) == '{"a": "é", "b": [1, 2]}'.encode()
    assert fmt.dumps({"x": float("nan")}) == b'{"x": null}'
    assert fmt.ndjson_line({"done": True}) == b'{"done": true}\n'
    assert fmt.error_body("no") == {"error": "no"}
    assert fmt.OllamaError(404, "gone").body() == {"error": "gone"}
    assert fmt.rfc3339(0) == "1970-01-01T00:00:00.000000000Z"
    assert fmt.version_body() == {"version": __version__, "bankml": True}
    assert fmt.ROOT_TEXT == "bankml is running (Ollama's API at /api, native only)"
    err = fmt.unknown_route("GET", "/api/nothing")
    assert err.status == 404 and err.message.startswith(
        "bankml serve --native (Ollama API): GET /, HEAD /, GET /api/version"
    )
    assert err.message.endswith("DELETE /api/delete, POST /api/embed, POST /api/embeddings")
    assert fmt.not_offered("/api/tags") is None
    assert fmt.not_offered("/api/pull").message.startswith(
        "bankml does not pull: models are imported sha256-pinned with open licences only"
    )
    assert fmt.not_offered("/api/push").message.startswith(
        "not offered: bankml publishes nothing; "
    )
    assert fmt.not_offered("/api/embed") is None  # served (with --embeddings)
    assert fmt.not_offered("/api/embeddings") is None


# -- listings -------------------------------------------------------------------------------------


def test_tags(catalog: Catalog) -> None:
    body = fmt.tags_body(catalog)
    ListResponse.model_validate(body)
    pin, derived = body["models"]
    assert list(pin) == ["name", "model", "modified_at", "size", "digest", "details", "bankml"]
    the_pin = catalog.registry.pins[0]
    assert pin["name"] == pin["model"] == "tiny-f16:latest"
    assert pin["digest"] == the_pin.sha256 and pin["size"] == the_pin.bytes
    assert pin["details"] == {
        "parent_model": "",
        "format": "gguf",
        "family": "llama",
        "families": ["llama"],
        "parameter_size": "1M",
        "quantization_level": "F16",
    }
    assert pin["bankml"] == {"native": True, "reason": None, "file": "Tiny-F16.gguf", "found": True}
    assert derived["name"] == "mindx:latest"
    assert derived["digest"] == "sha256:" + catalog.derived["mindx"].manifest.digest
    assert derived["details"]["parent_model"] == "tiny-f16:latest"
    assert derived["modified_at"] == "1970-01-01T00:00:00.000000000Z"


def test_tags_of_the_default_model(default_model: Path, tmp_path: Path) -> None:
    forks = tmp_path / "forks"
    forks.mkdir()
    os.symlink(default_model, forks / default_model.name)
    pin_into(forks, forks / default_model.name)
    body = fmt.tags_body(Catalog.load(discover(str(forks)), str(forks)))
    entry = ListResponse.model_validate(body).models[0]
    assert entry.model == "smollm2-135m-instruct.q4_1:latest"
    assert entry.digest == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert entry.details.family == "llama" and entry.details.quantization_level == "Q4_1"
    assert entry.details.parameter_size == "135M"


def test_ps(catalog: Catalog) -> None:
    assert fmt.ps_body(None, catalog, None) == {"models": []}
    res = Residency(lambda verified: object())
    pin = catalog.registry.pins[0]
    res.acquire(pin, now=0.0, shown_as="mindx", context_length=2048)
    body = fmt.ps_body(res.resident, catalog, res.ps_expires_at(0.0))
    ProcessResponse.model_validate(body)
    (entry,) = body["models"]
    assert list(entry) == [
        "name",
        "model",
        "size",
        "digest",
        "details",
        "expires_at",
        "size_vram",
        "context_length",
    ]
    assert entry["name"] == "mindx:latest"  # named after the model whose request loaded it
    assert entry["digest"].startswith("sha256:") and entry["details"]["parent_model"]
    assert entry["expires_at"].startswith("2262-01-")  # kept for good: the epoch + 292 years
    assert (entry["size_vram"], entry["context_length"]) == (0, 2048)
    res.touch(pin.name, KeepAlive(FOR, 300), now=10.0)
    body = fmt.ps_body(res.resident, catalog, res.ps_expires_at(10.0))
    assert body["models"][0]["expires_at"] == "1970-01-01T00:05:10.000000000Z"


def test_show_a_pin(catalog: Catalog) -> None:
    pin = catalog.registry.pins[0]
    body = fmt.show_body(pin, N_CTX)
    ShowResponse.model_validate(body)
    assert list(body) == [
        "modelfile",
        "parameters",
        "template",
        "details",
        "model_info",
        "capabilities",
        "modified_at",
        "bankml",
    ]
    assert body["modelfile"].splitlines()[:2] == [
        f"# bankml {__version__}: a pinned model (sha256 {pin.sha256}), verified before every "
        "load; not editable",
        f"FROM {pin.path}",
    ]
    assert body["parameters"].splitlines()[0] == "temperature" + " " * 20 + "0.6"
    assert body["template"] == pin.header.chat_template
    assert body["model_info"]["general.architecture"] == "llama"
    assert list(body["model_info"]) == sorted(body["model_info"])
    assert body["capabilities"] == ["completion"]
    assert body["bankml"]["sha256"] == pin.sha256 and body["bankml"]["n_ctx"] == N_CTX


def test_show_a_derived_model(catalog: Catalog) -> None:
    derived = catalog.derived["mindx"]
    body = fmt.show_body(derived, N_CTX)
    ShowResponse.model_validate(body)
    assert list(body) == [
        "license",
        "modelfile",
        "parameters",
        "template",
        "system",
        "details",
        "messages",
        "model_info",
        "capabilities",
        "modified_at",
        "bankml",
    ]
    assert body["modelfile"] == (
        "FROM tiny-f16\nSYSTEM You are mindX.\nPARAMETER temperature 0.3\nPARAMETER num_ctx 2048\n"
        "PARAMETER stop <|im_end|>\nMESSAGE user earlier\nMESSAGE assistant reply\nLICENSE MIT\n"
    )
    # the Modelfile shown builds the same layer again
    again = spec_from_modelfile(body["modelfile"])
    assert again.system == "You are mindX." and again.stop == ["<|im_end|>"]
    assert len(parse_modelfile(body["modelfile"])) == 8
    assert body["parameters"].splitlines() == [
        "temperature                    0.3",
        "top_k                          40",
        "top_p                          0.95",
        "min_p                          0.05",
        "num_ctx                        2048",
        'stop                           "<|im_end|>"',
    ]
    assert body["system"] == "You are mindX." and body["license"] == "MIT"
    assert body["messages"] == [
        {"role": "user", "content": "earlier"},
        {"role": "assistant", "content": "reply"},
    ]
    assert body["details"]["parent_model"] == "tiny-f16:latest"
    assert body["bankml"]["layer"] == {
        "derived": True,
        "digest": f"sha256:{derived.manifest.digest}",
        "base_sha256": derived.pin.sha256,
        "base_fork": "Tiny-F16.gguf.FORK.json",
    }


def test_create_status_lines_parse() -> None:
    for line in ("parsing modelfile", "success"):
        assert StatusResponse.model_validate_json(fmt.dumps({"status": line})).status == line


# -- answers --------------------------------------------------------------------------------------

RECEIPT = {"bankml": __version__, "engine": "native", "signed": False}
NOW = "2026-12-01T10:00:00.000000000Z"


def _final(kind: str, **extra) -> dict:
    return fmt.final_object(
        kind,
        "mindx:latest",
        NOW,
        "",
        done_reason="stop",
        total_ns=9,
        load_ns=1,
        prompt_eval_count=7,
        prompt_eval_ns=2,
        eval_count=3,
        eval_ns=4,
        cache_n=5,
        receipt=RECEIPT,
        **extra,
    )


def test_chat_lines() -> None:
    piece = fmt.piece_line(CHAT, "mindx:latest", NOW, "Hi")
    assert fmt.dumps(piece) == (
        b'{"model": "mindx:latest", "created_at": "2026-12-01T10:00:00.000000000Z", '
        b'"message": {"role": "assistant", "content": "Hi"}, "done": false}'
    )
    ChatResponse.model_validate(piece)
    final = _final(CHAT, logprobs=[{"token": "Hi", "logprob": -0.1}])
    assert list(final) == [
        "model",
        "created_at",
        "message",
        "done",
        "done_reason",
        "total_duration",
        "load_duration",
        "prompt_eval_count",
        "prompt_eval_duration",
        "eval_count",
        "eval_duration",
        "bankml_cache_n",
        "logprobs",
        "bankml_receipt",
    ]
    parsed = ChatResponse.model_validate(final)
    assert parsed.done and parsed.eval_count == 3 and parsed.logprobs[0].token == "Hi"


def test_generate_lines() -> None:
    piece = fmt.piece_line(GENERATE, "tiny-f16:latest", NOW, "Hi")
    assert list(piece) == ["model", "created_at", "response", "done"]
    GenerateResponse.model_validate(piece)
    final = _final(GENERATE, context=[1, 2, 3])
    assert list(final)[:7] == [
        "model",
        "created_at",
        "response",
        "done",
        "done_reason",
        "context",
        "total_duration",
    ]
    assert "logprobs" not in final and list(final)[-1] == "bankml_receipt"
    assert GenerateResponse.model_validate(final).context == [1, 2, 3]


@pytest.mark.parametrize("kind", [CHAT, GENERATE])
def test_load_and_unload_answers(kind: str) -> None:
    load = fmt.load_object(kind, "m:latest", NOW, unloaded=False, load_ns=123)
    unload = fmt.load_object(kind, "m:latest", NOW, unloaded=True, load_ns=123)
    key = "message" if kind == CHAT else "response"
    assert list(load) == ["model", "created_at", key, "done", "done_reason", "load_duration"]
    assert (load["done_reason"], load["load_duration"]) == ("load", 123)
    assert (unload["done_reason"], unload["load_duration"]) == ("unload", 0)
    model = ChatResponse if kind == CHAT else GenerateResponse
    assert model.model_validate(unload).done


def test_logprobs_as_ollama_answers_them() -> None:
    entries = [
        {
            "id": 5,
            "token": "Hi",
            "logprob": -0.5,
            "bytes": [72, 105],
            "top_logprobs": [
                {"id": 5, "token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                {"id": 6, "token": "Yo", "logprob": -1.5, "bytes": [89, 111]},
            ],
        },
        {"id": 2, "token": "", "logprob": -0.01, "bytes": [], "top_logprobs": []},
    ]
    assert fmt.ollama_logprobs(entries, 1) == [
        {
            "token": "Hi",
            "logprob": -0.5,
            "bytes": [72, 105],
            "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}],
        },
        {"token": "", "logprob": -0.01, "top_logprobs": []},
    ]
    assert fmt.ollama_logprobs(entries, 0)[0] == {
        "token": "Hi",
        "logprob": -0.5,
        "bytes": [72, 105],
    }


# -- the request pipeline -------------------------------------------------------------------------


def _prep(kind: str, body: dict, catalog: Catalog):
    return prepare(kind, body, catalog, n_ctx=N_CTX)


def _refused(kind: str, body: dict, catalog: Catalog) -> tuple[int, str]:
    with pytest.raises(fmt.OllamaError) as err:
        _prep(kind, body, catalog)
    return err.value.status, err.value.message


def test_body_must_be_json() -> None:
    for raw in (b"{", b"NaN", b'{"a": Infinity}', b"[" * 100_000):
        with pytest.raises(fmt.OllamaError) as err:
            parse_body(raw)
        assert (err.value.status, err.value.message) == (400, "body is not JSON")
    with pytest.raises(fmt.OllamaError) as err:
        parse_body(b"[1]")
    assert err.value.message == "body is not a JSON object"
    assert parse_body(b'{"a": 1, "a": 2}') == {"a": 2}  # the last duplicate wins


HELLO = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("kind", "body", "status", "message"),
    [
        (CHAT, {"model": "nope", "messages": HELLO}, 404, None),
        (CHAT, {"model": 5}, 400, "model must be a string"),
        (
            CHAT,
            {"messages": HELLO, "keep_alive": "soon"},
            400,
            'keep_alive "soon": not a duration ("5m", "1h", seconds, 0 or -1)',
        ),
        (
            CHAT,
            {"messages": HELLO, "keep_alive": True},
            400,
            "keep_alive must be a duration string or a number of seconds",
        ),
        (CHAT, {"messages": HELLO, "stream": "no"}, 400, "stream: true or false"),
        (
            GENERATE,
            {"prompt": "x", "raw": True, "format": "json"},
            400,
            "format: a JSON answer is constrained through the chat template; raw mode takes no "
            "format",
        ),
        (
            CHAT,
            {"messages": HELLO, "tools": [{"type": "function"}]},
            400,
            "tools: tools[0].function must be an object",
        ),
        (CHAT, {"messages": HELLO, "tools": {"a": 1}}, 400, "tools: an array of tools"),
        (
            CHAT,
            {"messages": HELLO, "tools": [{"type": "function", "function": {"name": 5}}]},
            400,
            "tools: tools[0].function.name must be a non-empty string",
        ),
        (
            CHAT,
            {"model": "tiny-f16", "messages": HELLO, "tools": [{"function": {"name": "f"}}]},
            400,
            "tiny-f16 does not support tools",  # the pin's template (ChatML) has no tool calls
        ),
        (
            GENERATE,
            {"prompt": "x", "tools": [{"function": {"name": "f"}}]},
            400,
            "tools: /api/generate takes no tools; send them to /api/chat",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]},
            400,
            "messages[0]: only an assistant message calls tools",
        ),
        (
            CHAT,
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            400,
            "messages[0].tool_calls[0].function.arguments must be an object",
        ),
        (
            GENERATE,
            {"prompt": "x", "images": ["aGk="]},
            400,
            "images: bankML's models are text-only; vision is out of scope",
        ),
        (
            GENERATE,
            {"prompt": "x", "suffix": "end"},
            400,
            "suffix: fill-in-the-middle is not reproduced; send the whole prompt",
        ),
        (
            GENERATE,
            {"prompt": "x", "template": "{{ .Prompt }}"},
            400,
            "template: the model's own chat template is used; a replacement template is not taken",
        ),
        (
            CHAT,
            {"model": "tiny-f16", "messages": HELLO, "think": "high"},
            400,
            '"tiny-f16" does not support thinking',  # Ollama's message: the name as asked
        ),
        (CHAT, {"messages": HELLO, "think": True}, 400, None),
        (
            CHAT,
            {"messages": HELLO, "think": "extreme"},
            400,
            'invalid think value: "extreme" (must be "high", "medium", "low", "max", true, or '
            "false)",
        ),
        (
            GENERATE,
            {"prompt": "x", "think": 3},
            400,
            'think must be a boolean or string ("high", "medium", "low", "max", true, or false)',
        ),
        (
            GENERATE,
            {"prompt": "x", "raw": True, "think": False},
            400,
            "think: raw mode and a context take the prompt as given; thinking is set through the "
            "chat template (send think without raw or context, or leave it out)",
        ),
        (
            GENERATE,
            {"prompt": "x", "context": [1, "two"]},
            400,
            "context must be an array of token ids (from an earlier answer)",
        ),
        (
            GENERATE,
            {"prompt": "x", "raw": True, "context": [1, 2]},
            400,
            "raw mode does not support template, system, or context",
        ),
        (
            CHAT,
            {"messages": HELLO, "top_logprobs": 21},
            400,
            "top_logprobs must be between 0 and 20",
        ),
        (
            CHAT,
            {"messages": HELLO, "top_logprobs": -1},
            400,
            "top_logprobs must be between 0 and 20",
        ),
        (
            CHAT,
            {"messages": HELLO, "top_logprobs": 2.5},
            400,
            "top_logprobs: a whole number from 0 to 20",
        ),
        (CHAT, {"messages": HELLO, "logprobs": "yes"}, 400, "logprobs: true or false"),
        (
            CHAT,
            {"messages": HELLO, "format": "yaml"},
            400,
            'format: "json" or a JSON schema (an object)',
        ),
        (CHAT, {"messages": HELLO, "options": []}, 400, "options must be an object"),
        (
            CHAT,
            {"messages": HELLO, "options": {"temperature": "hot"}},
            400,
            "options.temperature must be a number",
        ),
        (
            CHAT,
            {"messages": HELLO, "options": {"dry_multiplier": 0.5}},
            400,
            "options.dry_multiplier: not an option bankML knows; it refuses rather than ignore "
            "what might change the answer",
        ),
        (
            CHAT,
            {"messages": HELLO, "options": {"mirostat": 2}},
            400,
            "mirostat: not reproduced; bankml samples with llama-server's default chain (send "
            "mirostat 0 or leave it out)",
        ),
        (
            CHAT,
            {"messages": HELLO, "options": {"tfs_z": 0.5}},
            400,
            "tfs_z: tail-free sampling is not reproduced (llama.cpp removed it)",
        ),
        (
            CHAT,
            {"messages": HELLO, "options": {"num_ctx": 8192}},
            400,
            "num_ctx 8192 is larger than the context this server holds (4096); restart bankml "
            "serve with --ctx 8192 if it fits in memory",
        ),
        (
            CHAT,
            {"messages": HELLO, "options": {"stop": [1]}},
            400,
            "stop must be a string or an array of strings",
        ),
        (
            CHAT,
            {"messages": HELLO, "options": {"repeat_penalty": 0}},
            400,
            "Failed to initialize samplers: penalty_repeat must be finite and greater than 0",
        ),
        (CHAT, {"messages": "hello"}, 400, "messages must be an array"),
        (CHAT, {"messages": [{"content": "x"}]}, 400, "a message without a role"),
        (
            CHAT,
            {"messages": [{"role": "function", "content": "x"}]},
            400,
            'a message with role "function": roles are system, user, assistant and tool',
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            "only text content is in scope",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            400,
            "images: bankML's models are text-only; vision is out of scope",
        ),
        (GENERATE, {"prompt": 5}, 400, "prompt must be a string"),
        (GENERATE, {"prompt": "x", "system": 5}, 400, "system must be a string"),
    ],
)
def test_refusals(
    kind: str, body: dict, status: int, message: str | None, catalog: Catalog
) -> None:
    got_status, got = _refused(kind, body, catalog)
    assert got_status == status
    if message is not None:
        assert got == message
    if status == 404:
        assert got == (
            "model 'nope' not found: bankml serves pinned models only (tiny-f16); derived: mindx"
        )


def test_pipeline_order(catalog: Catalog) -> None:
    """The first refusal in the pipeline's order is the one answered."""
    bad_everything = {
        "model": "nope",
        "keep_alive": "soon",
        "tools": [1],
        "top_logprobs": 99,
        "options": {"x": 1},
        "messages": "x",
    }
    assert _refused(CHAT, bad_everything, catalog)[0] == 404
    bad_everything["model"] = "mindx"
    assert _refused(CHAT, bad_everything, catalog)[1].startswith('keep_alive "soon"')
    del bad_everything["keep_alive"]
    assert _refused(CHAT, bad_everything, catalog)[1].startswith("tools:")
    del bad_everything["tools"]
    assert _refused(CHAT, bad_everything, catalog)[1] == "top_logprobs must be between 0 and 20"
    del bad_everything["top_logprobs"]
    assert _refused(CHAT, bad_everything, catalog)[1].startswith("options.x:")
    del bad_everything["options"]
    assert _refused(CHAT, bad_everything, catalog)[1] == "messages must be an array"


def test_empty_requests_only_load_or_unload(catalog: Catalog) -> None:
    for kind, body in ((CHAT, {"messages": []}), (GENERATE, {"prompt": ""}), (CHAT, {})):
        got = _prep(kind, {**body, "model": "mindx", "tools": ["ignored"]}, catalog)
        assert got.empty and not got.unload and got.model == "mindx:latest"
        gone = _prep(kind, {**body, "model": "tiny-f16", "keep_alive": 0}, catalog)
        assert gone.empty and gone.unload
    kept = _prep(GENERATE, {"keep_alive": -1}, catalog)
    assert kept.keep_alive.kind == FOREVER and kept.stream


def test_a_chat_through_a_derived_model(catalog: Catalog) -> None:
    got = _prep(
        CHAT,
        {
            "model": "mindx",
            "messages": [{"role": "user", "content": "hi", "thinking": None}],
            "options": {"top_k": 5, "top_p": 7, "temperature": -1, "num_predict": 0, "num_gpu": 1},
            "stream": False,
            "logprobs": True,
            "top_logprobs": 0,
            "format": {"type": "object"},
        },
        catalog,
    )
    assert (got.stream, got.engine_kind, got.num_ctx, got.logprobs, got.top_logprobs) == (
        False,
        "chat",
        2048,  # the layer's num_ctx
        True,
        0,
    )
    assert got.body == {
        "temperature": 0.0,  # clamped to >= 0 (the request's value wins over the layer's)
        "stop": ["<|im_end|>"],
        "top_k": 5,
        "top_p": 1.0,  # clamped to [0, 1]
        "response_format": {"type": "json_object"},
        "logprobs": True,
        "top_logprobs": 1,  # top 0 is computed as one alternative
        "messages": [
            {"role": "system", "content": "You are mindX."},
            {"role": "user", "content": "earlier"},
            {"role": "assistant", "content": "reply"},
            {"role": "user", "content": "hi"},
        ],
    }
    own = _prep(
        CHAT,
        {"model": "mindx", "messages": [{"role": "system", "content": "Mine."}, *HELLO]},
        catalog,
    )
    # the request starts with its own system message: the layer's SYSTEM is not added
    assert [m["content"] for m in own.body["messages"]] == ["earlier", "reply", "Mine.", "hello"]
    assert own.body["temperature"] == 0.3 and own.body["stop"] == ["<|im_end|>"]
    assert own.keep_alive == KeepAlive(FOR, 300.0)


def test_schemas_and_reasoning(catalog: Catalog) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    got = _prep(
        CHAT,
        {
            "messages": [{"role": "assistant", "content": None, "thinking": "hmm"}, *HELLO],
            "format": schema,
            "options": {"num_predict": 16, "stop": ["", "END"], "seed": 3},
        },
        catalog,
    )
    assert got.body["response_format"] == {"type": "json_schema", "json_schema": {"schema": schema}}
    assert got.body["n_predict"] == 16 and got.body["stop"] == ["END"] and got.body["seed"] == 3
    assert got.body["messages"][0] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "hmm",
    }
    assert got.num_ctx is None and got.model == "tiny-f16:latest"
    assert "response_format" not in _prep(CHAT, {"messages": HELLO, "format": ""}, catalog).body


def test_generate_prompts(catalog: Catalog) -> None:
    got = _prep(GENERATE, {"model": "mindx", "prompt": "go", "system": "Be brief."}, catalog)
    assert got.returns_context and not got.raw
    assert got.body["messages"] == [
        {"role": "system", "content": "Be brief."},  # the request's system over the layer's
        {"role": "user", "content": "earlier"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "go"},
    ]
    ctx = _prep(GENERATE, {"prompt": "more", "context": [1, 2, 3]}, catalog)
    assert ctx.context == [1, 2, 3]
    assert ctx.body["messages"] == [{"role": "user", "content": "more"}]
    raw = _prep(
        GENERATE,
        {
            "prompt": "<|im_start|>x",
            "raw": True,
            "system": "ignored",
            "logprobs": True,
            "top_logprobs": 3,
        },
        catalog,
    )
    assert (raw.raw, raw.engine_kind, raw.returns_context) == (True, "completion", False)
    assert raw.body == {"n_probs": 3, "prompt": "<|im_start|>x"}


def test_fit_chat_as_ollama_s_chat_prompt() -> None:
    def count(messages) -> int:
        return sum(len(m["content"]) for m in messages)

    s = {"role": "system", "content": "SS"}
    a = {"role": "user", "content": "aaaa"}
    b = {"role": "assistant", "content": "bbbb"}
    c = {"role": "user", "content": "cc"}
    assert fit_chat([s, a, b, c], count, 100) == [s, a, b, c]
    assert fit_chat([s, a, b, c], count, 8) == [s, b, c]  # the system message stays
    assert fit_chat([s, a, b, c], count, 3) == [s, c]  # the last one always stays
    # a system message before the first one cut stays ...
    assert fit_chat([a, s, b, c], count, 6) == [s, c]
    # ... and one that is itself the first one cut is dropped
    assert fit_chat([a, s, c], count, 3) == [c]
    assert fit_chat([c], count, 1) == [c]
    assert fit_chat([], count, 1) == []
    too_long = prompt_too_long(50, 8)
    assert too_long.status == 400 and too_long.message.startswith(
        "the prompt is 50 tokens, more than num_ctx 8"
    )


def test_request_bodies_from_the_official_client_pass(catalog: Catalog) -> None:
    """What the ollama client sends for chat and generate (its own request models) is taken."""
    from ollama._types import ChatRequest, GenerateRequest, Options

    chat = ChatRequest(
        model="mindx",
        messages=[{"role": "user", "content": "hi"}],
        options=Options(temperature=0.2, seed=1, num_predict=8, num_ctx=1024),
        keep_alive="10m",
        stream=True,
    ).model_dump(exclude_none=True)
    got = _prep(CHAT, json.loads(json.dumps(chat)), catalog)
    assert got.keep_alive == KeepAlive(FOR, 600.0) and got.num_ctx == 1024
    gen = GenerateRequest(model="tiny-f16", prompt="hi", options={"top_k": 3}).model_dump(
        exclude_none=True
    )
    assert _prep(GENERATE, gen, catalog).body["top_k"] == 3


def test_formats_and_registry_import_no_twisted() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import bankml.formats.ollama, bankml.formats.ollama_request, bankml.cli.registry\n"
        "import bankml.registry.residency\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'twisted'], 'twisted imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_show_requests(catalog: Catalog) -> None:
    from bankml.formats.ollama_request import show_target

    assert show_target({"name": "MindX"}, catalog).name == "mindx"
    assert show_target({"model": "tiny-f16:latest", "verbose": True}, catalog).name == "tiny-f16"
    for body in ({}, {"model": "nope"}, []):
        with pytest.raises(fmt.OllamaError) as err:
            show_target(body, catalog)
        assert err.value.status == 404


class _Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def __call__(self) -> int:
        self.ns += 1_000_000  # 1 ms a reading
        return self.ns


def _chunks():
    from bankml.engine_cupy.schedule import Chunk, Summary

    entry = {"id": 1, "token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}
    eog = {"id": 2, "token": "", "logprob": -0.1, "bytes": [], "top_logprobs": []}
    chunks = [Chunk("Hi", entry, True, 1), Chunk("", None, False, 3), Chunk("", eog, False, 2)]
    summary = Summary(
        finish_reason="stop",
        text="Hi",
        prompt_tokens=9,
        completion_tokens=2,
        timings={"cache_n": 4, "prompt_ms": 1.5, "predicted_ms": 2.25},
    )
    return chunks, summary


@pytest.mark.parametrize("stream", [True, False])
def test_an_answer_from_engine_chunks(stream: bool) -> None:
    import hashlib

    chunks, summary = _chunks()
    body = b'{"model": "mindx", "messages": []}'
    answer = fmt.OllamaAnswer(
        CHAT, "mindx:latest", body, stream=stream, top_logprobs=0, clock_ns=_Clock(), load_ns=7
    )
    lines = [line for c in chunks for line in answer.on_chunk(c)]
    final = answer.final(summary, engine="native", model_sha256="ab" * 32)
    if stream:
        assert [line["message"]["content"] for line in lines] == ["Hi", ""]
        assert lines[1]["logprobs"] == [{"token": "", "logprob": -0.1}]
        assert final["message"]["content"] == ""
    else:
        assert lines == [] and final["message"]["content"] == "Hi"
    ChatResponse.model_validate(final)
    assert (final["prompt_eval_count"], final["eval_count"], final["bankml_cache_n"]) == (9, 2, 4)
    assert (final["prompt_eval_duration"], final["eval_duration"]) == (1_500_000, 2_250_000)
    assert final["load_duration"] == 7 and final["total_duration"] > 0
    assert final["logprobs"] == [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
        {"token": "", "logprob": -0.1},
    ]
    r = final["bankml_receipt"]
    assert r["response_sha256"] == hashlib.sha256(b"Hi").hexdigest()
    assert r["request_sha256"] == hashlib.sha256(body).hexdigest()
    assert (r["prompt_tokens"], r["completion_tokens"], r["model_sha256"]) == (9, 2, "ab" * 32)
    assert "logprobs_sha256" in r and r["signed"] is False


def test_an_answer_without_logprobs() -> None:
    chunks, summary = _chunks()
    answer = fmt.OllamaAnswer(GENERATE, "tiny-f16:latest", b"{}", stream=True, clock_ns=_Clock())
    lines = [line for c in chunks for line in answer.on_chunk(c)]
    assert [line["response"] for line in lines] == ["Hi"]  # empty pieces are not sent
    final = answer.final(summary, engine="native", model_sha256="ab" * 32, context=[1, 2])
    assert "logprobs" not in final and "logprobs_sha256" not in final["bankml_receipt"]
    assert GenerateResponse.model_validate(final).context == [1, 2]


def _toy_parse(text: str, partial: bool) -> Any:
    """A chat format's parse in miniature: reasoning up to "|", then content up to the first
    "@", then one call per "@name" (arguments {"n": <its position>})."""
    from bankml.formats.chat_message import ChatMessage, ToolCallMsg

    if "|" not in text:
        return ChatMessage(reasoning_content=text)
    reasoning, _, rest = text.partition("|")
    content, *names = rest.split("@")
    calls = tuple(
        ToolCallMsg(name=name, arguments=json.dumps({"n": i, "é": [1.5, None]}))
        for i, name in enumerate(names)
    )
    return ChatMessage(content=content, reasoning_content=reasoning, tool_calls=calls)


@pytest.mark.parametrize("stream", [True, False])
def test_a_parsed_answer_carries_thinking_and_whole_tool_calls(stream: bool) -> None:
    import re

    from bankml.engine_cupy.schedule import Chunk, Summary
    from bankml.receipts.answer import read_answer

    pieces = ["Let ", "me|", "Hi", "!", "@f", "@g"]
    summary = Summary(finish_reason="stop", text="".join(pieces), prompt_tokens=5)
    summary.completion_tokens = len(pieces)
    answer = fmt.OllamaAnswer(
        CHAT, "m:latest", b"{}", stream=stream, clock_ns=_Clock(), parser=_toy_parse
    )
    lines = [line for p in pieces for line in answer.on_chunk(Chunk(p, None, False, 1))]
    lines += answer.last_pieces()
    final = answer.final(summary, engine="native", model_sha256="ab" * 32)
    messages = [line["message"] for line in [*lines, final]]
    calls = [call for m in messages for call in m.get("tool_calls", [])]
    assert "".join(m.get("thinking", "") for m in messages) == "Let me"
    assert "".join(m["content"] for m in messages) == "Hi!"
    assert [c["function"] for c in calls] == [
        {"index": 0, "name": "f", "arguments": {"n": 0, "é": [1.5, None]}},
        {"index": 1, "name": "g", "arguments": {"n": 1, "é": [1.5, None]}},
    ]
    assert all(re.fullmatch(r"call_[a-z0-9]{8}", c["id"]) for c in calls)
    if stream:  # thinking and content as they grow; f once g began, g on the last piece line
        assert [m.get("thinking", "") for m in messages[:2]] == ["Let ", "me"]
        assert [len(m.get("tool_calls", [])) for m in messages[-3:]] == [1, 1, 0]
    else:
        assert lines == []
    for obj in [*lines, final]:
        ChatResponse.model_validate(obj)
    body = b"".join(fmt.ndjson_line(obj) for obj in [*lines, final]) if stream else fmt.dumps(final)
    receipt = final["bankml_receipt"]
    view = read_answer(body, "ollama_chat")
    assert view.acts.receipt_fields() == {
        k: receipt[k] for k in ("reasoning_sha256", "tool_calls_sha256")
    }


# -- the engine takes what the pipeline prepares --------------------------------------------------


@pytest.fixture(scope="module")
def served(default_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """The default model pinned in a registry with a derived model, and the engine on it."""
    from bankml.engine_cupy.engine import Engine

    forks = tmp_path_factory.mktemp("forks")
    os.symlink(default_model, forks / default_model.name)
    pin_into(forks, forks / default_model.name)
    base = discover(str(forks)).pins[0].name
    mf = SYSTEM_MF.replace("FROM tiny-f16", f"FROM {base}")
    create("mindx", spec_from_modelfile(mf), Catalog.load(discover(str(forks)), str(forks)))
    model = forks / default_model.name
    startup = (str(model), str(forks / f"{model.name}.FORK.json"))
    catalog = Catalog.load(discover(str(forks), startup=startup), str(forks))
    return catalog, Engine.open(str(default_model), n_ctx=N_CTX)


def test_the_engine_takes_the_prepared_bodies(served) -> None:
    catalog, engine = served
    chat = prepare(
        CHAT,
        {
            "model": "mindx",
            "messages": HELLO,
            "format": {"type": "object", "properties": {"a": {"type": "integer"}}},
            "logprobs": True,
            "options": {"num_predict": 8, "seed": 42},
        },
        catalog,
        n_ctx=N_CTX,
    )
    req = engine.parse_request(chat.body, chat.engine_kind)
    assert req.constraint is not None and req.n_probs == 1 and req.n_predict == 8
    assert req.stop == ("<|im_end|>",) and req.sampler.seed == 42
    assert req.sampler.temperature == pytest.approx(0.3)  # the layer's
    assert "You are mindX." in req.prompt_text and req.prompt_text.index(
        "earlier"
    ) < req.prompt_text.index("hello")
    json_mode = prepare(CHAT, {"messages": HELLO, "format": "json"}, catalog, n_ctx=N_CTX)
    assert engine.parse_request(json_mode.body, "chat").constraint is not None
    raw = prepare(GENERATE, {"prompt": "<|im_start|>user\nhi", "raw": True}, catalog, n_ctx=N_CTX)
    got = engine.parse_request(raw.body, raw.engine_kind)
    assert got.prompt_tokens == engine.tokenize(raw.body["prompt"], parse_special=True)
    gen = prepare(GENERATE, {"model": "mindx", "prompt": "go"}, catalog, n_ctx=N_CTX)
    assert "You are mindX." in engine.parse_request(gen.body, "chat").prompt_text


def test_fit_chat_with_the_model_s_template(served) -> None:
    _, engine = served

    def count(messages) -> int:
        text = engine.apply_template(list(messages), add_generation_prompt=True)
        return len(engine.tokenize(text, parse_special=True))

    long = [{"role": "system", "content": "Be brief."}]
    long += [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}] * 3
    long.append({"role": "user", "content": "last"})
    whole = count(long)
    kept = fit_chat(long, count, whole - 1)
    assert kept[0]["role"] == "system" and kept[-1]["content"] == "last"
    assert count(kept) <= whole - 1 < count(long) and len(kept) < len(long)
    assert fit_chat(long, count, whole) == long


def test_tools_think_and_tool_messages_become_the_chat_body(catalog: Catalog) -> None:
    """Ollama's tool calls (object arguments), tool results and thinking as the chat body the
    engine reads as /v1/chat/completions; think's levels as reasoning_effort."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "thinking": "hmm",
            "tool_calls": [{"function": {"index": 0, "name": "f", "arguments": {"a": "é"}}}],
        },
        {"role": "TOOL", "content": "42", "tool_name": "f"},
    ]

    def chat(body: dict) -> Prepared:
        caps = lambda target: ("tools", "thinking")  # noqa: E731
        return prepare(
            CHAT, {"messages": messages, **body}, catalog, n_ctx=N_CTX, capabilities=caps
        )

    got = chat({"tools": [tool], "think": "low"})
    assert got.body["tools"] == [tool] and got.parse_message and got.think == "low"
    assert got.body["chat_template_kwargs"] == {"enable_thinking": True}
    assert got.body["reasoning_effort"] == "low"
    assert got.body["messages"][1:] == [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "hmm",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": '{"a":"é"}'}}
            ],
        },
        {"role": "tool", "content": "42", "name": "f"},
    ]
    off = chat({"think": False})
    assert off.body["chat_template_kwargs"] == {"enable_thinking": False}
    assert "reasoning_effort" not in off.body and "tools" not in off.body
    plain = _prep(CHAT, {"model": "tiny-f16", "messages": HELLO, "think": False}, catalog)
    assert plain.body["chat_template_kwargs"] == {"enable_thinking": False}
    assert not _prep(CHAT, {"model": "tiny-f16", "messages": HELLO}, catalog).parse_message
