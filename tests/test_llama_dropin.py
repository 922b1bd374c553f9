"""llama-server's command line on bankml: `bankml llama-server ...` and `bankml serve --native`
with llama-server's flags, side by side with the real llama-server started with the same flags,
over real HTTP on loopback.

One drop-in bankml (``bankml llama-server --fork F -m FILE -c 2048 --temp 0 --alias ...
--api-key K``) and one llama-server with the same flags answer the same requests: greedy answers
from the server-wide ``--temp 0``, the alias in /v1/models and in answers, the API key's 401,
CORS headers and preflight, /metrics' 501 without ``--metrics``. The ``--cors-origins localhost``
policy is checked on bankml's AccessControl in front of a small tree, against a llama-server
started with that flag. Refused flags exit 1 before anything listens.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_twisted
from twisted.internet.threads import deferToThread

from bankml.llama_server import FLAGS, REFUSE, SERVE
from bankml.resources import llama
from bankml.serving.access import AccessControl, CorsPolicy
from bankml.serving.llama_flags import dropin_argv
from bankml.serving.routes import Branch, LlamaRoute
from bankml.serving.site import LoopbackSite, listen_loopback
from bankml.tap import Options
from tests import support
from tests.dropin import bankml, call, listening, running_dropin, start_dropin
from tests.support import ROOT, free_port

KEY = "k-3f9a1c"
ALIAS = "tinyllama-2,b-second"
SHARED_FLAGS = ["--temp", "0", "--alias", ALIAS, "--api-key", KEY]
SHARED_FLAGS += ["-n", "8", "--seed", "42", "--chat-template", "chatml"]
AUTH = {"Authorization": f"Bearer {KEY}"}
LOCALHOST_ONLY = ["--cors-origins", "localhost"]
CHAT = {
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 24,
}


@pytest.fixture(scope="module")
def reference(default_model: Path, llama_server_bin: Path) -> Iterator[support.LlamaServer]:
    with support.LlamaServer(default_model, args=SHARED_FLAGS, binary=llama_server_bin) as ref:
        yield ref


class DropIn:
    def __init__(
        self, port: int, listen_port: int, ollama_port: int, proc: subprocess.Popen
    ) -> None:
        self.port, self.listen_port, self.proc = port, listen_port, proc
        self.ollama_port = ollama_port  # --ollama-listen: Ollama's API alone


@pytest.fixture(scope="module")
def dropin(
    default_model: Path, default_fork: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DropIn]:
    """`bankml llama-server` with llama-server's flags here (support.LlamaServer's and ours)."""
    port, listen_port, ollama_port = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("dropin") / "bankml.log"
    args = [
        *("--fork", str(default_fork), "-m", str(default_model)),
        *("--host", "127.0.0.1", "-t", "2", "-c", "2048", "-np", "1"),
        *("--jinja", "--no-webui", "-fa", "on", "-ngl", "99"),
        *("--listen", f"127.0.0.1:{listen_port}"),
        *("--ollama-listen", f"127.0.0.1:{ollama_port}"),
        *SHARED_FLAGS,
    ]
    with running_dropin(args, port, log) as proc:
        yield DropIn(port, listen_port, ollama_port, proc)
    # the key never reaches the log
    assert KEY not in log.read_text()


# --- the argument list ----------------------------------------------------------------------


def test_the_dropin_rewrites_llama_servers_spellings_into_bankml_serve_options() -> None:
    argv, notes = dropin_argv(
        ["-m", "m.gguf", "--fork", "f.json", "-c", "1024", "-np", "1", "-ctk", "q8_0"]
        + ["--cache-type-v=q8_0", "-a", "x", "-n", "8", "-fa", "on", "--metrics"]
    )
    assert argv == [
        "m.gguf",
        *("--native", "--fork", "f.json", "--ctx", "1024", "--parallel", "1"),
        *("--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--alias", "x"),
        *("--n-predict", "8", "--metrics"),
    ]
    assert notes == [
        "ignoring -fa: bankml computes the same answer with -fa on or auto (auto is on for the "
        "CPU); -fa off is refused"
    ]


def test_bankmls_own_options_pass_through_the_dropin_as_given() -> None:
    argv, _ = dropin_argv(
        ["-m", "m.gguf", "--fork", "f.json", "--ollama-listen", "127.0.0.1:11434"]
        + ["--listen=127.0.0.1:9", "--max-queue", "4", "--models-memory", "2G"]
    )
    assert argv[argv.index("--ollama-listen") + 1] == "127.0.0.1:11434"
    assert argv[argv.index("--models-memory") + 1] == "2G"
    assert argv[argv.index("--listen") + 1] == "127.0.0.1:9"
    assert argv[argv.index("--max-queue") + 1] == "4"


def test_the_dropin_context_defaults_to_llama_servers_0_the_models_own() -> None:
    argv, _ = dropin_argv(["-m", "m.gguf", "--fork", "f.json"])
    assert argv == ["m.gguf", "--native", "--fork", "f.json", "--ctx", "0"]
    argv, _ = dropin_argv(["-m", "m.gguf", "--fork", "f.json", "--ctx-size", "512"])
    assert argv.count("--ctx") == 1 and argv[argv.index("--ctx") + 1] == "512"


def test_every_flag_has_one_meaning_and_every_refusal_a_reason() -> None:
    spellings = [s for flag in FLAGS for s in flag.spellings]
    assert len(spellings) == len(set(spellings))
    assert all(flag.reason for flag in FLAGS if flag.action == REFUSE)
    assert {"--temp", "--alias", "--api-key", "--metrics", "-np"} <= {
        s for flag in FLAGS if flag.action == SERVE for s in flag.spellings
    }


@pytest.mark.parametrize(
    "args, reason",
    [
        (["llama-server", "-np", "0"], "invalid value for n_parallel"),
        (["llama-server", "--lora", "a.gguf"], "changes the model's computation"),
        (["llama-server", "-hf", "user/model"], "pinned in FORK.json"),
        (["llama-server", "--no-such-flag"], "not a llama-server (build 11434) flag"),
        (["llama-server", "-ctk", "q4_0", "-ctv", "q4_0"], "bankml keeps f16 or q8_0"),
        (["llama-server", "-ctk", "q8_0"], "keeps K and V in one type"),
        (["llama-server", "--chat-template", "{% for %}"], "chat template refused"),
        (["llama-server", "--api-key-file", "/nonexistent/keys"], "--api-key-file"),
        (["serve", "--temp", "0"], "bankml takes it with --native"),
        (["llama-server", "--host", "0.0.0.0"], "bankml listens on loopback only"),
    ],
)
def test_a_refused_flag_exits_1_with_its_reason_before_anything_listens(
    default_model: Path, default_fork: Path, args: list[str], reason: str
) -> None:
    port = free_port()
    command, *rest = args
    model = ["-m", str(default_model)] if command == "llama-server" else [str(default_model)]
    run = subprocess.run(
        bankml(command, *model, "--fork", str(default_fork), "--port", str(port), *rest),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert reason in run.stderr
    assert not listening(port)


# --- side by side with llama-server -------------------------------------------------------


def test_a_server_wide_temp_0_gives_llama_servers_greedy_answers(
    dropin: DropIn, reference: support.LlamaServer
) -> None:
    answers = []
    for port in (dropin.port, reference.port):
        status, _, body = call(port, "POST", "/v1/chat/completions", CHAT, AUTH)
        assert status == 200, body
        chat = json.loads(body)["choices"][0]["message"]["content"]
        status, _, body = call(
            port, "POST", "/completion", {"prompt": "The sky is", "n_predict": 16}, AUTH
        )
        answers.append((chat, json.loads(body)["content"]))
    assert answers[0] == answers[1]
    assert answers[0][0]  # a real answer, not two empty ones


def test_server_wide_n_predict_and_seed_apply_where_a_request_does_not_override(
    dropin: DropIn, reference: support.LlamaServer
) -> None:
    """-n 8 limits a request without n_predict; --seed 42 seeds a request that sets its own
    temperature (so it samples) and no seed: the same tokens as llama-server's."""
    answers = []
    for port in (dropin.port, reference.port):
        limited = json.loads(
            call(port, "POST", "/completion", {"prompt": "Once upon a time"}, AUTH)[2]
        )
        sampled = json.loads(
            call(
                port,
                "POST",
                "/completion",
                {"prompt": "My favourite food is", "temperature": 1.5, "n_predict": 24},
                AUTH,
            )[2]
        )
        answers.append(
            (limited["content"], limited["tokens_predicted"], sampled["content"], sampled["tokens"])
        )
    assert answers[0] == answers[1]
    assert answers[0][1] == 8


def test_the_chat_template_flag_is_the_template_used(
    dropin: DropIn, reference: support.LlamaServer
) -> None:
    body = {"messages": CHAT["messages"]}
    ours = json.loads(call(dropin.port, "POST", "/apply-template", body, AUTH)[2])
    theirs = json.loads(call(reference.port, "POST", "/apply-template", body, AUTH)[2])
    assert ours == theirs
    # ChatML, not the file's own template (which adds a system prompt naming the model)
    assert ours["prompt"].startswith("<|im_start|>user")


def test_the_alias_names_the_model_in_models_props_and_answers(
    dropin: DropIn, reference: support.LlamaServer
) -> None:
    seen = []
    for port in (dropin.port, reference.port):
        models = json.loads(call(port, "GET", "/v1/models", None, AUTH)[2])
        props = json.loads(call(port, "GET", "/props", None, AUTH)[2])
        named = {**CHAT, "model": "gpt-4o-mini"}  # llama-server answers with its own name
        chat = json.loads(call(port, "POST", "/v1/chat/completions", named, AUTH)[2])
        short = {"prompt": "Hi", "max_tokens": 2, "model": "gpt-4o-mini"}
        completion = json.loads(call(port, "POST", "/v1/completions", short, AUTH)[2])
        seen.append(
            (
                models["data"][0]["id"],
                models["data"][0]["aliases"],
                models["models"][0]["name"],
                props["model_alias"],
                chat["model"],
                completion["model"],
            )
        )
    assert seen[0] == seen[1]
    assert seen[0][0] == "b-second"  # llama-server's first alias in sorted order


@pytest.mark.parametrize(
    "method, path, headers",
    [
        ("GET", "/props", {}),
        ("GET", "/props", {"Authorization": "Bearer wrong"}),
        ("GET", "/props", {"Authorization": f"bearer {KEY}"}),
        ("GET", "/v1/models", {"X-Api-Key": "wrong"}),
        ("POST", "/v1/chat/completions", {}),
        ("GET", "/no-such-path", {}),
        ("GET", "/props", {"Authorization": "Bearer wrong", "X-Api-Key": KEY}),
    ],
)
def test_a_missing_or_wrong_key_is_llama_servers_401(
    dropin: DropIn, reference: support.LlamaServer, method: str, path: str, headers: dict
) -> None:
    body = CHAT if method == "POST" else None
    ours = call(dropin.port, method, path, body, headers)
    theirs = call(reference.port, method, path, body, headers)
    assert ours[0] == theirs[0] == 401
    assert ours[2] == theirs[2]
    assert ours[1]["content-type"] == theirs[1]["content-type"]
    # bankml's own address asks for the key the same way
    assert call(dropin.listen_port, method, path, body, headers)[2] == theirs[2]


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {KEY}"},
        {"Authorization": KEY},
        {"X-Api-Key": KEY},
        {"X-Api-Key": f"Bearer {KEY}"},
    ],
)
def test_the_key_is_taken_where_llama_server_takes_it(
    dropin: DropIn, reference: support.LlamaServer, headers: dict
) -> None:
    assert call(reference.port, "GET", "/props", None, headers)[0] == 200
    assert call(dropin.port, "GET", "/props", None, headers)[0] == 200
    assert call(dropin.listen_port, "GET", "/bankml", None, headers)[0] == 200


def test_the_official_openai_client_passes_its_key_and_reads_the_401(dropin: DropIn) -> None:
    import openai

    base = f"http://127.0.0.1:{dropin.port}/v1"
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(model="any", **CHAT)
    assert answer.choices[0].message.content
    assert answer.model == "b-second"
    wrong = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.chat.completions.create(model="any", **CHAT)
    assert refused.value.status_code == 401
    assert "Invalid API Key" in str(refused.value)


def test_ollama_listen_serves_ollamas_api_behind_the_same_key(dropin: DropIn) -> None:
    import ollama

    host = f"http://127.0.0.1:{dropin.ollama_port}"
    client = ollama.Client(host=host, headers=AUTH)
    (model,) = client.list().models
    answer = client.chat(model=model.model, messages=CHAT["messages"], options={"num_predict": 8})
    assert answer.message.content and answer.done
    # Ollama's routes only on that address; the key as on the llama-server routes
    assert call(dropin.ollama_port, "GET", "/v1/models", headers=AUTH)[0] == 404
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=host).list()
    assert refused.value.status_code == 401


def test_health_needs_no_key(dropin: DropIn, reference: support.LlamaServer) -> None:
    for path in ("/health", "/v1/health"):
        ours, theirs = call(dropin.port, "GET", path), call(reference.port, "GET", path)
        assert ours[0] == theirs[0] == 200
        assert json.loads(ours[2]) == json.loads(theirs[2])
    assert call(dropin.listen_port, "GET", "/bankml")[0] == 401


def test_metrics_is_llama_servers_501_without_the_flag(
    dropin: DropIn, reference: support.LlamaServer
) -> None:
    ours = call(dropin.port, "GET", "/metrics", None, AUTH)
    theirs = call(reference.port, "GET", "/metrics", None, AUTH)
    assert ours[0] == theirs[0] == 501
    assert json.loads(ours[2]) == json.loads(theirs[2])


CORS_HEADERS = (
    "access-control-allow-origin",
    "access-control-allow-credentials",
    "access-control-allow-methods",
    "access-control-allow-headers",
)


def cors_of(headers: dict[str, str]) -> dict[str, str]:
    return {name: headers[name] for name in CORS_HEADERS if name in headers}


@pytest.mark.parametrize("origin", [None, "http://localhost:5173", "https://example.org"])
def test_cors_headers_and_preflight_are_llama_servers(
    dropin: DropIn, reference: support.LlamaServer, origin: str | None
) -> None:
    headers = {"Origin": origin} if origin else {}
    for method, path, extra in (
        ("GET", "/health", {}),
        ("GET", "/props", AUTH),
        ("GET", "/props", {}),  # the 401 carries them too
        ("OPTIONS", "/v1/chat/completions", {"Access-Control-Request-Method": "POST"}),
    ):
        ours = call(dropin.port, method, path, None, {**headers, **extra})
        theirs = call(reference.port, method, path, None, {**headers, **extra})
        assert ours[0] == theirs[0], (method, path)
        assert cors_of(ours[1]) == cors_of(theirs[1]), (method, path)
        if method == "OPTIONS":
            assert ours[2] == theirs[2] == b""
            assert ours[1]["content-type"] == theirs[1]["content-type"]


@pytest.fixture(scope="module")
def localhost_reference(
    default_model: Path, llama_server_bin: Path
) -> Iterator[support.LlamaServer]:
    with support.LlamaServer(default_model, args=LOCALHOST_ONLY, binary=llama_server_bin) as ref:
        yield ref


@pytest_twisted.ensureDeferred
async def test_cors_origins_localhost_reflects_only_local_origins(
    default_model: Path, localhost_reference: support.LlamaServer
) -> None:
    """`bankml serve --native --cors-origins localhost`'s policy, read by bankml serve's
    Options, on the AccessControl the native service puts in front of each address (here in
    front of /health alone), over loopback, against llama-server with the same flag."""
    options = Options()
    options.parseOptions([str(default_model), "--fork", "f", "--native"] + LOCALHOST_ONLY)
    root = Branch()
    root.putChild(b"health", LlamaRoute(llama.Health(None)))  # type: ignore[arg-type]
    cors = CorsPolicy(**options["llama"]["cors"])
    port = listen_loopback(LoopbackSite(AccessControl(root, (), cors)), "127.0.0.1:0")
    try:
        for origin in (
            "http://localhost:8000",
            "http://127.0.0.1",
            "http://[::1]:9",
            "http://x.org",
        ):
            head = {"Origin": origin}
            ours = await deferToThread(call, port.getHost().port, "GET", "/health", None, head)
            theirs = await deferToThread(
                call, localhost_reference.port, "GET", "/health", None, head
            )
            assert cors_of(ours[1]) == cors_of(theirs[1]), origin
    finally:
        await port.stopListening()


def test_ctx_size_0_is_the_models_training_context_as_in_llama_server(
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path: Path,
) -> None:
    port = free_port()
    args = ["--fork", str(default_fork), "-m", str(default_model), "-c", "0", "-np", "1"]
    proc = start_dropin(args, port, tmp_path / "bankml.log")
    try:
        with support.LlamaServer(default_model, args=["-c", "0"], binary=llama_server_bin) as ref:
            seen = []
            for where in (port, ref.port):
                props = json.loads(call(where, "GET", "/props")[2])
                models = json.loads(call(where, "GET", "/v1/models")[2])
                seen.append(
                    (
                        props["default_generation_settings"]["n_ctx"],
                        models["data"][0]["meta"]["n_ctx"],
                    )
                )
    finally:
        proc.terminate()
        proc.wait(30)
    assert seen[0] == seen[1]
    assert seen[0][0] > 2048  # the header's, not bankml's default or the test's -c 2048


def test_the_cache_type_flags_win_over_the_environment(
    default_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BANKML_CACHE_TYPE", "q8_0")
    base = [str(default_model), "--fork", "f", "--native"]
    options = Options()
    options.parseOptions(base)
    assert options["cache_type"] == "q8_0"  # the environment, when no flag says otherwise
    options = Options()
    options.parseOptions(base + ["--cache-type-k", "f16", "--cache-type-v", "f16"])
    assert options["cache_type"] == "f16"


def test_no_webui_leaves_the_web_page_out(dropin: DropIn) -> None:
    """The drop-in was started with --no-webui: / of the engine address is llama-server's JSON
    404 and /ui is not routed on either address (without it both serve bankml's page)."""
    for port, path in [(dropin.port, "/"), (dropin.port, "/ui"), (dropin.listen_port, "/ui")]:
        status, headers, body = call(port, "GET", path)
        assert status == 404 and headers["content-type"].startswith("application/json"), path
        assert json.loads(body)["error"]["message"] == "File Not Found", path
