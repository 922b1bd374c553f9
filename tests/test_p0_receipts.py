"""Signed receipts of P0's Responses (``/v1/responses``, ``/responses``) and Anthropic Messages
(``/v1/messages``) answers: a real ``bankml serve --spawn`` in front of the real llama-server on
the default model, asked over loopback, each receipt checked as a third party checks it.

For each endpoint, streamed and not, greedy and (Responses: the seed is forwarded) seeded or with
a seed bankml drew: the untouched receipt is ``valid`` and replays identically, on the exact
engine and through an unmodified llama-server; the mutation suite's changes (tests/
test_check_receipt.py: one byte of the answer or the request, another model, seed or
temperature, an edited field, another key's signature, a receipt moved onto another answer,
and the same lies signed again by the key's holder) are refused. A sampled Messages answer is
``valid`` but cannot be replayed (llama-server drops the seed). The official ``openai``
client's ``responses.create`` parses the signed answers. Counts are printed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bankml.receipts.answer import find_receipt
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.keys import SigningKey, keygen
from bankml.receipts.replay import (
    IDENTICAL,
    LlamaServerProcess,
    open_replay_engine,
    replay_in_process,
    replay_with_llama_server,
)
from tests import support
from tests.bankml_process import BankmlProcess, check_receipt_cli, post, spawned_p0
from tests.receipt_answers import Exchange, lies_signed, load, tampered_cases

pytestmark = [pytest.mark.llama_server, pytest.mark.slow]

COLOUR = "Name a colour."
PRIMARY = "Name three colors."
# (name, path, body, seeded); "unknown seed": sampled, llama-server draws a seed it does not show
EXCHANGES: list[tuple[str, str, dict[str, Any], bool]] = [
    (
        "responses greedy",
        "/v1/responses",
        {"input": COLOUR, "max_output_tokens": 8, "temperature": 0},
        False,
    ),
    (
        "responses greedy stream",
        "/v1/responses",
        {"input": PRIMARY, "max_output_tokens": 8, "temperature": 0, "stream": True},
        False,
    ),
    (
        "responses seeded, input items",
        "/v1/responses",
        {
            "input": [{"role": "user", "content": [{"type": "input_text", "text": PRIMARY}]}],
            "max_output_tokens": 8,
            "temperature": 0.9,
            "seed": 7,
        },
        True,
    ),
    (
        "responses alias, seed drawn stream, instructions",
        "/responses",
        {
            "input": COLOUR,
            "instructions": "Answer in one word.",
            "max_output_tokens": 8,
            "temperature": 1.0,
            "stream": True,
        },
        True,
    ),
    (
        "messages greedy, a stop sequence",
        "/v1/messages",
        {
            "messages": [{"role": "user", "content": PRIMARY}],
            "max_tokens": 32,
            "temperature": 0,
            "stop_sequences": ["2."],
        },
        False,
    ),
    (
        "messages greedy stream, system and blocks",
        "/v1/messages",
        {
            "system": "Answer briefly.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": PRIMARY}]}],
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
        },
        False,
    ),
    (
        "messages sampled, unknown seed",
        "/v1/messages",
        {"messages": [{"role": "user", "content": PRIMARY}], "max_tokens": 8, "temperature": 0.9},
        False,
    ),
]
# P0's other completion endpoints: their receipts replay too (a P0 receipt names no device)
OTHER_EXCHANGES: list[tuple[str, str, dict[str, Any], bool]] = [
    (
        "chat greedy, logprobs",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": COLOUR}],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
        False,
    ),
    (
        "chat seed drawn stream",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": PRIMARY}],
            "max_tokens": 8,
            "temperature": 1.0,
            "stream": True,
        },
        True,
    ),
    (
        "completion seeded, n_probs",
        "/completion",
        {
            "prompt": "The capital of France is",
            "n_predict": 8,
            "temperature": 0.9,
            "seed": 5,
            "n_probs": 2,
        },
        True,
    ),
    (
        "oai completion greedy stream",
        "/v1/completions",
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True},
        False,
    ),
]
API_OF = {
    "/v1/responses": "responses",
    "/responses": "responses",
    "/v1/messages": "messages",
    "/v1/chat/completions": "chat",
    "/completion": "llama_completion",
    "/v1/completions": "oai_completion",
}


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return keygen(tmp_path_factory.mktemp("p0-key") / "receipt-key.pem")


@pytest.fixture(scope="module")
def p0(
    key: SigningKey,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    log = tmp_path_factory.mktemp("log") / "p0.log"
    with spawned_p0(key, default_model, default_fork, llama_server_bin, log) as bankml:
        yield bankml


def asked(p0: BankmlProcess, table: list[tuple[str, str, dict[str, Any], bool]]) -> list[Exchange]:
    out = []
    for name, path, body, seeded in table:
        raw = json.dumps(body).encode()
        out.append(
            Exchange(name, API_OF[path], "stream" in body, seeded, raw, post(p0, path, raw), 0, 0)
        )
    return out


@pytest.fixture(scope="module")
def exchanges(p0: BankmlProcess) -> list[Exchange]:
    return asked(p0, EXCHANGES)


@pytest.fixture(scope="module")
def replay_engine(exchanges: list[Exchange], default_model: Path, default_fork: Path) -> Any:
    receipt = find_receipt(exchanges[0].response)[1]
    return open_replay_engine(str(default_model), str(default_fork), receipt)


# llama-server's Messages stop reasons (a stop sequence ends the turn too) and the receipt's
FINISH_OF_STOP_REASON = {"end_turn": "stop", "max_tokens": "length"}


def messages_stop_reason(response: bytes) -> str:
    """A Messages answer's ``stop_reason``: the whole message's, or its stream's message_delta."""
    _, objects, _ = load(response)
    for obj in objects:
        if obj.get("type") == "message_delta":
            return obj["delta"]["stop_reason"]
    return objects[0]["stop_reason"]


def replayable(ex: Exchange) -> bool:
    return not ex.name.endswith("unknown seed")


def test_the_receipts_are_signed_and_name_what_llama_server_used(
    p0: BankmlProcess, exchanges: list[Exchange], key: SigningKey
) -> None:
    assert p0.get("/bankml/key")[1]["keyid"] == key.keyid
    for ex in exchanges:
        receipt = find_receipt(ex.response)[1]
        assert receipt["receipt_version"] == 2 and receipt["signed"] is True, ex.name
        assert (receipt["api"], receipt["stream"]) == (ex.api, ex.stream), ex.name
        assert receipt["device"] is None and receipt["engine"].startswith("llama-server b")
        seed = receipt["sampler"]["seed"]
        body = json.loads(ex.request)
        if ex.api == "messages":
            assert seed is None, ex.name  # llama-server drops it: not known
        elif "seed" in body:
            assert seed == body["seed"], ex.name
        else:
            assert isinstance(seed, int) and seed != 4294967295, ex.name
        assert receipt["n_predict"] == body.get("max_output_tokens", body.get("max_tokens"))
        if ex.api == "messages":  # from the answer's stop_reason
            stop_reason = messages_stop_reason(ex.response)
            assert receipt["finish_reason"] == FINISH_OF_STOP_REASON[stop_reason], ex.name
            if body["temperature"] == 0:  # greedy: the same answer each time
                expected = "end_turn" if "stop_sequences" in body else "max_tokens"
                assert stop_reason == expected, ex.name
        else:
            assert receipt["finish_reason"] is None, ex.name  # a Responses answer says none


def test_untouched_receipts_are_valid_and_replay_identically(
    exchanges: list[Exchange], key: SigningKey, replay_engine: Any, tmp_path: Path
) -> None:
    valid = identical = cannot = 0
    for ex in exchanges:
        verdict = check_receipt(
            ex.request, ex.response, key.public_key_pem, model_sha256=support.DEFAULT_SHA256
        )
        assert verdict == VALID, (ex.name, verdict)
        valid += 1
        outcome = replay_in_process(ex.request, ex.response, replay_engine)
        if replayable(ex):
            assert outcome.startswith(IDENTICAL), (ex.name, outcome)
            identical += 1
        else:
            assert outcome.startswith("cannot replay: the seed is not known"), outcome
            cannot += 1
    print(
        f"\nP0 Responses/Messages: {valid}/{len(exchanges)} valid, {identical} replay "
        f"identically, {cannot} cannot be replayed (seed unknown), false rejects: 0"
    )
    ex = next(e for e in exchanges if e.api == "messages" and e.stream)
    code, out = check_receipt_cli(tmp_path, ex.request, ex.response, key.public_key_pem)
    assert (code, out) == (0, VALID)


def test_malformed_answers_are_refused_not_raised(
    exchanges: list[Exchange], key: SigningKey
) -> None:
    """Cut anywhere, a typed stream or a whole answer is refused with a reason, never raised;
    a stream whose receipt is on an earlier event than the last is refused."""
    cases = 0
    for ex in exchanges:
        # a cut inside the last event's JSON at the latest (its closing newlines add nothing)
        for cut in range(0, len(ex.response.rstrip()), 53):
            verdict = check_receipt(ex.request, ex.response[:cut], key.public_key_pem)
            assert verdict.startswith("refuse: "), (ex.name, cut, verdict)
            cases += 1
    ex = next(e for e in exchanges if e.api == "messages" and e.stream)
    extra = ex.response + b'event: ping\ndata: {"type": "ping"}\n\n'
    assert check_receipt(ex.request, extra, key.public_key_pem).startswith(
        "refuse: a receipt in event"
    )
    print(f"\nP0 cut answers: {cases} refused")


def test_a_seed_is_claimed_only_where_llama_server_reads_one(
    exchanges: list[Exchange], key: SigningKey
) -> None:
    """Signed by the key's holder: a Messages receipt naming a seed, or a Responses receipt
    naming none, is refused by the check."""
    from bankml.receipts.sign import sign_receipt
    from tests.receipt_answers import edited

    def with_seed(response: bytes, seed: Any) -> bytes:
        def edit(objects: list[dict[str, Any]]) -> None:
            r = objects[-1]["bankml_receipt"]
            r = {**r, "sampler": {**r["sampler"], "seed": seed}}
            objects[-1]["bankml_receipt"] = sign_receipt(r, key)

        return edited(response, edit)

    messages = next(e for e in exchanges if e.api == "messages")
    verdict = check_receipt(messages.request, with_seed(messages.response, 5), key.public_key_pem)
    assert verdict == "refuse: a Messages receipt names a seed, which llama-server never reads"
    responses = next(e for e in exchanges if e.api == "responses")
    verdict = check_receipt(
        responses.request, with_seed(responses.response, None), key.public_key_pem
    )
    assert verdict == "refuse: the receipt names no seed actually used", verdict


def test_mutations_are_refused(
    exchanges: list[Exchange], key: SigningKey, replay_engine: Any, tmp_path: Path
) -> None:
    other = keygen(tmp_path / "other.pem")
    pem = key.public_key_pem
    tampered = tampered_cases(exchanges, key, other)
    accepted = [name for name, req, resp in tampered if check_receipt(req, resp, pem) == VALID]
    print(
        f"\nP0 changed after signing: {len(tampered)} cases, "
        f"{len(tampered) - len(accepted)} refused by the check, false accepts: {len(accepted)}"
    )
    assert accepted == []
    # a Messages request's seed never reaches llama-server's sampler: another seed in it,
    # re-signed, is the same request for the model (and is not a lie)
    lies = [
        (name, req, resp)
        for name, req, resp in lies_signed(exchanges, key)
        if not (name.startswith("messages") and "another seed" in name)
    ]
    by_check = by_replay = 0
    passed = []
    for name, req, resp in lies:
        if check_receipt(req, resp, pem, model_sha256=support.DEFAULT_SHA256) != VALID:
            by_check += 1
        elif replay_in_process(req, resp, replay_engine).startswith(IDENTICAL):
            passed.append(name)
        else:
            by_replay += 1
    print(
        f"P0 signed lies: {len(lies)} cases, {by_check} refused by the check, {by_replay} by "
        f"the replay, false accepts: {len(passed)}"
    )
    assert passed == []


def test_replay_through_an_unmodified_llama_server(
    exchanges: list[Exchange],
    key: SigningKey,
    llama_server_bin: Path,
    default_model: Path,
    default_fork: Path,
    tmp_path: Path,
) -> None:
    receipt = find_receipt(exchanges[0].response)[1]
    with LlamaServerProcess(
        str(llama_server_bin), str(default_model), receipt["n_ctx"], receipt["cache_type"]
    ) as server:
        outcomes = [
            (ex, replay_with_llama_server(ex.request, ex.response, server)) for ex in exchanges
        ]
        lie = next(c for c in lies_signed([exchanges[2]], key) if "a byte of the answer" in c[0])
        assert replay_with_llama_server(lie[1], lie[2], server).startswith("refuse: ")
    agreed = 0
    for ex, outcome in outcomes:
        print(f"  {ex.name}: {outcome}")
        if replayable(ex):
            assert outcome.startswith(IDENTICAL), (ex.name, outcome)
            agreed += 1
        else:
            assert outcome.startswith("cannot replay: the seed is not known"), outcome
    print(f"P0 llama-server replays: {agreed}/{len(outcomes)} identical")
    ex = next(e for e in exchanges if e.name == "responses alias, seed drawn stream, instructions")
    code, out = check_receipt_cli(
        tmp_path,
        ex.request,
        ex.response,
        key.public_key_pem,
        *("--replay", str(default_model), "--fork", str(default_fork)),
        *("--replay-with-llama-server", str(llama_server_bin)),
    )
    assert code == 0 and out.splitlines()[0] == VALID, out
    assert out.splitlines()[1].startswith("replay: identical"), out


def test_the_other_p0_receipts_replay_too(
    p0: BankmlProcess,
    key: SigningKey,
    replay_engine: Any,
    llama_server_bin: Path,
    default_model: Path,
) -> None:
    """Chat, /completion and /v1/completions through P0: valid, and identical on the exact
    engine (llama-server's logprobs within the replay's tolerance) and through llama-server."""
    others = asked(p0, OTHER_EXCHANGES)
    for ex in others:
        assert check_receipt(ex.request, ex.response, key.public_key_pem) == VALID, ex.name
        outcome = replay_in_process(ex.request, ex.response, replay_engine)
        assert outcome.startswith(IDENTICAL), (ex.name, outcome)
        print(f"\n  {ex.name}: engine: {outcome}", end="")
    receipt = find_receipt(others[0].response)[1]
    with LlamaServerProcess(
        str(llama_server_bin), str(default_model), receipt["n_ctx"], receipt["cache_type"]
    ) as server:
        for ex in others:
            outcome = replay_with_llama_server(ex.request, ex.response, server)
            assert outcome.startswith(IDENTICAL), (ex.name, outcome)
            print(f"\n  {ex.name}: llama-server: {outcome}", end="")
    print(f"\nP0 chat and completions: {len(others)}/{len(others)} valid, replayed identically")


def test_the_openai_client_parses_signed_responses(p0: BankmlProcess, key: SigningKey) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{p0.url}/v1", api_key="none", max_retries=0)
    raw = client.responses.with_raw_response.create(
        model="default", input=COLOUR, max_output_tokens=8, temperature=0
    )
    answer = raw.parse()
    assert answer.output_text and answer.status == "completed"
    assert answer.model_extra["bankml_receipt"]["receipt_version"] == 2
    assert check_receipt(raw.http_request.content, raw.content, key.public_key_pem) == VALID
    events = list(
        client.responses.create(
            model="default", input=COLOUR, max_output_tokens=8, temperature=0, stream=True
        )
    )
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == answer.output_text
    assert events[-1].model_extra["bankml_receipt"]["api"] == "responses"


def test_the_anthropic_client_parses_signed_messages(p0: BankmlProcess, key: SigningKey) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=p0.url, api_key="none", max_retries=0)
    asked = {
        "model": "default",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": COLOUR}],
        "extra_body": {"temperature": 0},
    }
    raw = client.messages.with_raw_response.create(**asked)  # type: ignore[call-overload]
    answer = raw.parse()
    assert answer.content[0].type == "text" and answer.content[0].text
    sent, received = raw.http_request.content, raw.http_response.content
    assert check_receipt(sent, received, key.public_key_pem) == VALID
    with client.messages.stream(**asked) as events:  # type: ignore[arg-type]
        streamed = events.get_final_message()
    assert streamed.content[0].text == answer.content[0].text  # type: ignore[union-attr]
