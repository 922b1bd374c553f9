"""The official ``ollama`` Python client, unchanged, against a live ``bankml serve --native
--registry DIR``: one server for the module (the default model, plus a small pinned GGUF that is
listed but never loaded), short answers."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import ollama
import pytest

from bankml.receipts.check import check_receipt
from tests.native_server import NativeProcess
from tests.registry_support import pin_into, write_gguf
from tests.support import free_port

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name a colour."}]
OLLAMA_PORT = free_port()
GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, default_model: Path, default_fork: Path
) -> Iterator[NativeProcess]:
    home = tmp_path_factory.mktemp("ollama")
    registry = home / "forks"
    registry.mkdir()
    pin_into(registry, write_gguf(registry / "Tiny-Extra-F16.gguf", name="Tiny Extra"))
    # the default model's pin in the registry too: a derived model's base is pinned there
    (registry / default_fork.name).write_bytes(default_fork.read_bytes())
    # a second pin: a copy of the default model under another name (switched to by name)
    shutil.copyfile(default_model, registry / "Smol-Copy.gguf")
    pin_into(registry, registry / "Smol-Copy.gguf")
    engine_port = free_port()
    proc = NativeProcess(
        default_model,
        default_fork,
        [
            "--native",
            "--upstream",
            f"127.0.0.1:{engine_port}",
            "--registry",
            str(registry),
            "--ollama-listen",
            f"127.0.0.1:{OLLAMA_PORT}",
        ],
        home / "bankml.log",
        engine_port=engine_port,
    )
    with proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: NativeProcess) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


@pytest.fixture(scope="module")
def startup(default_model: Path) -> str:
    return default_model.name[: -len(".gguf")].lower()


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def raw_request(
    server: NativeProcess, method: str, path: str, body: Any = None, port: int | None = None
) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port or server.port, timeout=120)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type") or "", resp.read()
    finally:
        conn.close()


def test_root_and_version(server: NativeProcess, client: ollama.Client) -> None:
    status, ctype, body = raw_request(server, "GET", "/")
    assert status == 200 and ctype.startswith("text/plain") and b"bankml is running" in body
    assert raw_request(server, "HEAD", "/")[0] == 200
    status, _, body = raw_request(server, "GET", "/api/version")
    assert status == 200 and json.loads(body)["version"]


def test_list_and_show(
    server: NativeProcess, client: ollama.Client, startup: str, default_fork: Path
) -> None:
    names = [m.model for m in client.list().models]
    assert names == [f"{startup}:latest", "smol-copy:latest", "tiny-extra-f16:latest"]
    shown = client.show(startup)
    assert shown.details.format == "gguf" and shown.details.family == "llama"
    assert "temperature" in (shown.parameters or "") and shown.template
    pinned = json.loads(default_fork.read_text())["files"][0]["sha256"]
    status, _, raw = raw_request(server, "POST", "/api/show", {"model": startup})
    assert status == 200 and json.loads(raw)["bankml"]["sha256"] == pinned
    with pytest.raises(ollama.ResponseError) as err:
        client.show("no-such-model")
    assert err.value.status_code == 404 and "not found" in err.value.error


def test_chat_whole_and_streamed_agree(
    server: NativeProcess, client: ollama.Client, startup: str, default_fork: Path
) -> None:
    # the same prompt three times: the second and third find the same prompt cache
    client.chat(startup, MESSAGES, options=GREEDY)
    streamed = list(client.chat(startup, MESSAGES, options=GREEDY, stream=True))
    whole = client.chat(startup, MESSAGES, options=GREEDY)
    content = whole.message.content
    assert content and "".join(c.message.content for c in streamed) == content
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 6
    assert whole.model == f"{startup}:latest" and whole.message.role == "assistant"
    assert whole.prompt_eval_count and whole.total_duration >= whole.eval_duration > 0
    assert streamed[-1].done and not any(c.done for c in streamed[:-1])
    # the receipt and bankml_cache_n, which the client does not keep: the same request raw
    body = {"model": startup, "messages": MESSAGES, "options": GREEDY, "stream": False}
    status, _, raw = raw_request(server, "POST", "/api/chat", body)
    answer = json.loads(raw)
    receipt = answer["bankml_receipt"]
    assert status == 200 and answer["message"]["content"] == content
    assert receipt["response_sha256"] == sha(content)
    assert receipt["request_sha256"] == hashlib.sha256(json.dumps(body).encode()).hexdigest()
    pinned = json.loads(default_fork.read_text())["files"][0]["sha256"]
    assert receipt["model_sha256"] == pinned and receipt["guard"] == "play"
    assert receipt["completion_tokens"] == 6 and receipt["prompt_tokens"] == whole.prompt_eval_count
    assert isinstance(answer["bankml_cache_n"], int) and answer["bankml_cache_n"] > 0
    assert list(answer)[-2:] == ["bankml_cache_n", "bankml_receipt"]
    body["stream"] = True
    status, ctype, raw = raw_request(server, "POST", "/api/chat", body)
    lines = [json.loads(line) for line in raw.splitlines()]
    assert status == 200 and ctype.startswith("application/x-ndjson")
    assert [i for i, obj in enumerate(lines) if "bankml_receipt" in obj] == [len(lines) - 1]
    text = "".join(obj["message"]["content"] for obj in lines)
    assert text == content and lines[-1]["bankml_receipt"]["response_sha256"] == sha(text)


def test_generate_whole_streamed_and_context(client: ollama.Client, startup: str) -> None:
    whole = client.generate(startup, "Say hi.", options=GREEDY)
    assert whole.response and whole.done_reason == "length" and whole.eval_count == 6
    assert whole.context and len(whole.context) == whole.prompt_eval_count + whole.eval_count
    streamed = list(client.generate(startup, "Say hi.", options=GREEDY, stream=True))
    assert "".join(c.response for c in streamed[:-1]) and streamed[-1].done
    follow = client.generate(startup, "And again.", context=whole.context, options=GREEDY)
    assert follow.prompt_eval_count > len(whole.context) and follow.response


def test_generate_raw(client: ollama.Client, startup: str) -> None:
    answer = client.generate(startup, "The capital of France is", raw=True, options=GREEDY)
    assert answer.response and answer.context is None


def test_format_json_schema(client: ollama.Client, startup: str) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    answer = client.chat(
        startup,
        [{"role": "user", "content": "Give a colour as JSON."}],
        format=schema,
        options={"temperature": 0, "num_predict": 40},
    )
    jsonschema.validate(json.loads(answer.message.content), schema)
    answer = client.generate(startup, "A JSON object, please.", format="json", options=GREEDY)
    assert answer.response.lstrip().startswith("{")


def test_logprobs(client: ollama.Client, startup: str) -> None:
    answer = client.chat(startup, MESSAGES, options=GREEDY, logprobs=True, top_logprobs=2)
    entries = answer.logprobs
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 for e in entries)
    assert "".join(e.token for e in entries) == answer.message.content


def test_greedy_chat_equals_v1(server: NativeProcess, client: ollama.Client, startup: str) -> None:
    messages = [{"role": "user", "content": "What is two plus two?"}]
    client.chat(startup, messages, options=GREEDY)  # both below find the same prompt cache
    status, _, body = raw_request(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": messages, "temperature": 0, "max_tokens": 6},
    )
    assert status == 200
    v1 = json.loads(body)["choices"][0]["message"]["content"]
    assert client.chat(startup, messages, options=GREEDY).message.content == v1


def test_seeded_chat_equals_v1(server: NativeProcess, client: ollama.Client, startup: str) -> None:
    messages = [{"role": "user", "content": "Tell me a word."}]
    seeded = {"temperature": 0.9, "seed": 42, "num_predict": 6}
    client.chat(startup, messages, options=seeded)  # both below find the same prompt cache
    status, _, body = raw_request(
        server,
        "POST",
        "/v1/chat/completions",
        {"messages": messages, "temperature": 0.9, "seed": 42, "max_tokens": 6},
    )
    assert status == 200
    v1 = json.loads(body)["choices"][0]["message"]["content"]
    assert client.chat(startup, messages, options=seeded).message.content == v1


def test_ps_and_keep_alive_zero_unloads(
    server: NativeProcess, client: ollama.Client, startup: str
) -> None:
    assert [m.model for m in client.ps().models] == [f"{startup}:latest"]
    client.chat(startup, MESSAGES, options=GREEDY, keep_alive=0)
    assert client.ps().models == []
    # /v1 and llama-server's endpoints load the startup model again (verified first)
    status, _, body = raw_request(server, "POST", "/tokenize", {"content": "hi"})
    assert status == 200 and json.loads(body)["tokens"]
    assert [m.model for m in client.ps().models] == [f"{startup}:latest"]
    unloaded = client.generate(startup, keep_alive=0)  # an empty request only unloads
    assert unloaded.done_reason == "unload" and client.ps().models == []
    status, _, _ = raw_request(
        server, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}
    )
    assert status == 200
    client.generate(startup, keep_alive=0)
    loaded = client.generate(startup, keep_alive="10m")  # an empty request only loads
    assert loaded.done_reason == "load" and loaded.load_duration > 0
    (resident,) = client.ps().models
    assert resident.model == f"{startup}:latest" and resident.size_vram == 0


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "words"),
    [
        ("POST", "/api/pull", {"model": "x"}, 400, "does not pull"),
        ("POST", "/api/push", {"model": "x"}, 400, "publishes nothing"),
        ("POST", "/api/embed", {"model": "x", "input": "a"}, 404, "not found"),
        ("POST", "/api/embeddings", {"model": "x", "prompt": "a"}, 404, "not found"),
        ("POST", "/api/nothing", {}, 404, "POST /api/chat"),
        ("GET", "/api/chat", None, 404, "POST /api/chat"),
        ("GET", "/api/pull", None, 404, "POST /api/chat"),
        ("POST", "/api/chat", {"model": "nope", "messages": MESSAGES}, 404, "not found"),
        ("POST", "/api/chat", {"messages": MESSAGES, "tools": [{"x": 1}]}, 400, "tools"),
        ("POST", "/api/chat", {"messages": MESSAGES, "options": {"bogus": 1}}, 400, "bogus"),
        ("POST", "/api/chat", {"messages": MESSAGES, "keep_alive": "soon"}, 400, "keep_alive"),
        ("POST", "/api/generate", {"prompt": "a", "format": "xml"}, 400, "format"),
    ],
)
def test_refusals(
    server: NativeProcess, method: str, path: str, body: Any, status: int, words: str
) -> None:
    got, ctype, raw = raw_request(server, method, path, body)
    assert got == status and ctype.startswith("application/json")
    answer = json.loads(raw)
    assert list(answer) == ["error"] and words in answer["error"]


def test_client_sees_refusal_status(client: ollama.Client, startup: str) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(startup, MESSAGES, options={"mirostat": 2})
    assert err.value.status_code == 400 and "mirostat" in err.value.error


SYSTEM = "You answer in French."


def test_create_from_modelfile_copy_and_delete(
    server: NativeProcess, client: ollama.Client, startup: str, default_model: Path
) -> None:
    # FROM the file: its basename is pinned by the registry directory's copy of its fork
    modelfile = f'FROM {default_model}\nSYSTEM "{SYSTEM}"\nPARAMETER num_predict 3\n'
    status, ctype, raw = raw_request(
        server, "POST", "/api/create", {"model": "french", "modelfile": modelfile}
    )
    assert status == 200 and ctype.startswith("application/x-ndjson"), raw
    lines = [json.loads(line)["status"] for line in raw.splitlines()]
    assert lines[0] == "parsing modelfile" and lines[-1] == "success"
    assert any(line.startswith("verifying ") for line in lines)
    names = [m.model for m in client.list().models]
    assert "french:latest" in names
    shown = client.show("french")
    assert f"SYSTEM {SYSTEM}" in shown.modelfile and "num_predict" in (shown.parameters or "")
    assert shown.details.parent_model == f"{startup}:latest"
    assert client.copy("french", "french-two").status == "success"
    assert "french-two:latest" in [m.model for m in client.list().models]
    assert client.delete("french-two").status == "success"
    assert "french-two:latest" not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as err:
        client.delete(startup)
    assert err.value.status_code == 400 and "pinned model" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.copy("no-such-model", "x")
    assert err.value.status_code == 404


def test_derived_model_layer_in_effect(
    server: NativeProcess, client: ollama.Client, startup: str, default_model: Path
) -> None:
    client.create("terse", from_=str(default_model), system=SYSTEM, parameters={"num_predict": 3})
    client.chat("terse", MESSAGES, options={"temperature": 0})
    base = client.chat(
        startup,
        [{"role": "system", "content": SYSTEM}, *MESSAGES],
        options={"temperature": 0, "num_predict": 3},
    )
    derived = client.chat("terse", MESSAGES, options={"temperature": 0})
    assert derived.eval_count == 3 and derived.done_reason == "length"
    assert derived.message.content == base.message.content
    assert derived.prompt_eval_count == base.prompt_eval_count
    status, _, body = raw_request(
        server,
        "POST",
        "/v1/chat/completions",
        {"model": "terse", "messages": MESSAGES, "temperature": 0},
    )
    answer = json.loads(body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    assert answer["choices"][0]["message"]["content"] == derived.message.content
    assert client.delete("terse").status == "success"


def test_create_refusals(server: NativeProcess) -> None:
    for body, words in (
        ({"model": "x", "modelfile": "FROM nothing-here\n"}, "nothing-here"),
        ({"model": "x", "modelfile": "FROM a\nADAPTER b\n"}, "ADAPTER"),
        ({"model": "x", "from": "a", "quantize": "q4_0"}, "quantize"),
        ({"modelfile": "FROM a\n"}, "model is required"),
    ):
        status, _, raw = raw_request(server, "POST", "/api/create", body)
        assert status == 400, raw
        assert words in json.loads(raw)["error"]


def test_ollama_listen_answers_ollama_routes_only(server: NativeProcess, startup: str) -> None:
    status, _, body = raw_request(server, "GET", "/api/tags", port=OLLAMA_PORT)
    assert status == 200 and f"{startup}:latest" in [m["model"] for m in json.loads(body)["models"]]
    answer = ollama.Client(host=f"http://127.0.0.1:{OLLAMA_PORT}").generate(
        startup, "Hi", options=GREEDY
    )
    assert answer.response and answer.eval_count == 6
    assert raw_request(server, "GET", "/v1/models", port=OLLAMA_PORT)[0] == 404


def wait_for(check: Any, seconds: float = 120) -> bool:
    """Whether ``check()`` comes true; ``seconds`` only bounds a hang (the reaper runs every
    second, later on a loaded machine)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def test_keep_alive_expiry_seen_in_ps(client: ollama.Client, startup: str) -> None:
    client.generate(startup, "Hi", options=GREEDY, keep_alive="1s")
    assert wait_for(lambda: client.ps().models == [])
    client.generate(startup, keep_alive="10m")
    assert [m.model for m in client.ps().models] == [f"{startup}:latest"]


def test_two_pins_switched_by_name_and_a_replaced_file(
    server: NativeProcess, client: ollama.Client, default_model: Path
) -> None:
    copy = server.log.parent / "forks" / "Smol-Copy.gguf"
    log = server.output()
    answer = client.chat("smol-copy", MESSAGES, options=GREEDY)
    assert answer.model == "smol-copy:latest" and answer.load_duration > 0
    assert [m.model for m in client.ps().models] == ["smol-copy:latest"]
    assert server.output().count("smol-copy verified") == log.count("smol-copy verified") + 1
    # the resident file changes (its mtime): refused with 503, unloaded, then verified again
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ollama.ResponseError) as err:
        client.chat("smol-copy", MESSAGES, options=GREEDY)
    assert err.value.status_code == 503 and "changed since bankml verified it" in err.value.error
    assert client.ps().models == []
    again = client.chat("smol-copy", MESSAGES, options=GREEDY)
    assert again.load_duration > 0 and again.message.content
    assert server.output().count("smol-copy verified") == log.count("smol-copy verified") + 2
    back = client.chat(default_model.name[: -len(".gguf")].lower(), MESSAGES, options=GREEDY)
    assert back.load_duration > 0


def test_a_schema_answer_streamed_is_the_whole_answer(client: ollama.Client, startup: str) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    asked = [{"role": "user", "content": "A number as JSON."}]
    options = {"temperature": 0, "num_predict": 12}
    client.chat(startup, asked, format=schema, options=options)  # the same cache state below
    whole = client.chat(startup, asked, format=schema, options=options).message.content
    streamed = client.chat(startup, asked, format=schema, options=options, stream=True)
    assert "".join(part.message.content for part in streamed) == whole
    assert not whole.startswith("```")


# every field of a chat and a generate body given a wrong type: a 4xx with Ollama's error, or
# (where the field is one Ollama takes loosely) an answer; never a 5xx
WRONG = [1, "x", [1, "a"], {"a": 1}]
FIELDS = ["model", "messages", "prompt", "system", "stream", "format", "options", "keep_alive",
          "raw", "context", "logprobs", "top_logprobs", "think", "tools", "images"]  # fmt: skip


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_wrong_types_in_every_field_are_4xx(server: NativeProcess, startup: str, path: str) -> None:
    base: dict[str, Any] = {"model": startup, "stream": False, "options": {"num_predict": 1}}
    base.update({"messages": MESSAGES} if path == "/api/chat" else {"prompt": "Hi"})
    seen = set()
    for name in FIELDS:
        for value in WRONG:
            status, ctype, raw = raw_request(server, "POST", path, {**base, name: value})
            seen.add(status)
            assert status < 500, (name, value, raw)
            answer = json.loads(raw.splitlines()[-1])
            assert "error" in answer if status >= 400 else answer["done"], (name, value, raw)
    assert 400 in seen and 200 in seen
    assert "Traceback" not in server.output()


def test_ollama_options_on_the_command_line(tmp_path: Path) -> None:
    from twisted.python import usage

    from bankml.tap import Options, default_registry

    def parsed(*args: str) -> Options:
        options = Options()
        options.parseOptions(["m.gguf", "--fork", "f.json", *args])
        return options

    assert parsed("--native", "--registry", str(tmp_path))["registry"] == str(tmp_path)
    assert parsed("--native", "--registry")["registry"] == default_registry()
    assert parsed("--native")["keep-alive"] == "5m"
    assert parsed("--native", "--max-loaded", "3")["max-loaded"] == 3
    assert parsed("--native", "--models-memory", "1.5G")["models-memory"] == 3 * 2**29
    for args, words in (
        (["--registry", str(tmp_path)], "needs --native"),
        (["--native", "--keep-alive", "soon"], "--keep-alive"),
        (["--max-loaded", "2"], "--max-loaded"),
        (["--native", "--max-loaded", "0"], "--max-loaded"),
        (["--native", "--models-memory", "lots"], "--models-memory"),
        (["--native", "--ollama-listen", "0.0.0.0:11434"], "--ollama-listen"),
    ):
        with pytest.raises(usage.UsageError) as err:
            parsed(*args)
        assert words in str(err.value)


def test_ollama_receipts_are_signed_and_check_valid(server: NativeProcess, startup: str) -> None:
    """The final object's receipt, whole and streamed, on /api/chat and /api/generate: `valid`
    with the server's public key, and refused once the answer is changed."""
    status, key, _ = server.get("/bankml/key")
    assert status == 200
    cases = [
        ("/api/chat", {"model": startup, "messages": MESSAGES, "options": GREEDY}),
        ("/api/generate", {"model": startup, "prompt": "Say hi.", "options": GREEDY}),
    ]
    for path, body in cases:
        for stream in (False, True):
            sent = {**body, "stream": stream}
            status, _, raw = raw_request(server, "POST", path, sent)
            assert status == 200, raw
            request = json.dumps(sent).encode()
            assert check_receipt(request, raw, key["public_key"]) == "valid", (path, stream)
            final = json.loads(raw.splitlines()[-1])
            assert final["bankml_receipt"]["api"] == f"ollama_{path.rsplit('/', 1)[1]}"
            changed = raw.replace(b'"done":true', b'"done":true,"x":1')  # the same text
            assert check_receipt(request, changed, key["public_key"]) == "valid"
            lines = [json.loads(line) for line in raw.splitlines()]
            first = next(
                o for o in lines if (o.get("message") or {}).get("content") or o.get("response")
            )
            if "message" in first:
                first["message"]["content"] += "!"
            else:
                first["response"] += "!"
            forged = b"".join(json.dumps(o).encode() + b"\n" for o in lines)
            assert check_receipt(request, forged, key["public_key"]).startswith("refuse: ")


def test_a_manifest_edited_by_hand_while_serving_is_refused(
    server: NativeProcess, client: ollama.Client, default_model: Path
) -> None:
    registry = Path(server.engine_args[server.engine_args.index("--registry") + 1])
    client.create("handmade", from_=str(default_model), system=SYSTEM)
    assert client.chat("handmade", MESSAGES, options=GREEDY).done
    manifest = registry / "handmade.MODEL.json"
    text = manifest.read_text(encoding="utf-8")
    manifest.write_text(text.replace(SYSTEM, SYSTEM + " Always."), encoding="utf-8")
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat("handmade", MESSAGES, options=GREEDY)
    assert refused.value.status_code == 400
    assert "cannot be served" in refused.value.error and "edited by hand" in refused.value.error
    # made again outside the server (`bankml create`: a valid manifest, another digest): the
    # server reads it anew and serves it
    modelfile = registry.parent / "Modelfile.handmade"
    modelfile.write_text(f'FROM {default_model}\nSYSTEM "{SYSTEM} Again."\n', encoding="utf-8")
    made = subprocess.run(
        [sys.executable, "-m", "bankml", "create", "handmade", "-f", str(modelfile),
         "--registry", str(registry)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert client.chat("handmade", MESSAGES, options=GREEDY).done
    assert f"SYSTEM {SYSTEM} Again." in client.show("handmade").modelfile
    assert client.delete("handmade").status == "success"


def test_a_v1_answer_restarts_the_models_keep_alive(
    server: NativeProcess, client: ollama.Client, startup: str
) -> None:
    """Every answer that uses the resident model, /v1 too, starts its keep-alive again with the
    server's default (5 minutes): a server answering only /v1 never unloads its model."""
    client.generate(startup, "Hi", options=GREEDY, keep_alive="30s")
    before = client.ps().models[0].expires_at
    status, _, _ = raw_request(
        server, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}
    )
    assert status == 200
    after = client.ps().models[0].expires_at
    assert (after - before).total_seconds() > 120  # 30 s from then, against 5 min from now
