"""check_receipt and the replays on real answers of the default model (tests/receipt_answers.py).

The mutation suite: every untouched receipt is ``valid`` and replays identically on the exact
engine; every single change is refused: by the check alone when it was made after signing (a byte
of the answer or the request, another model, seed or temperature, any receipt field, another
key's signature, a receipt moved onto another answer), by the check or the replay when the key's
holder signed the lie. The counts are printed; zero false accepts and zero false rejects.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from bankml.receipts.answer import find_receipt
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.keys import SigningKey, keygen
from bankml.receipts.replay import IDENTICAL, replay_in_process
from bankml.receipts.sign import sign_receipt
from tests import support
from tests.receipt_answers import (  # noqa: F401  (fixtures, found by their names)
    Exchange,
    dump,
    edited,
    exchanges_fixture,
    lies_signed,
    load,
    native_engine_fixture,
    one_answer_byte,
    one_request_byte,
    receipt_key_fixture,
    receipt_of,
    replay_engine_fixture,
    tampered_cases,
)

pytestmark = pytest.mark.slow

# --- the suite ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_key(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return keygen(tmp_path_factory.mktemp("other-key") / "other.pem")


def test_untouched_receipts_are_valid_and_replay(
    exchanges: list[Exchange], receipt_key: SigningKey, replay_engine: Any
) -> None:
    valid = identical = 0
    for ex in exchanges:
        verdict = check_receipt(
            ex.request, ex.response, receipt_key.public_key_pem, model_sha256=support.DEFAULT_SHA256
        )
        assert verdict == VALID, (ex.name, verdict)
        valid += 1
        outcome = replay_in_process(ex.request, ex.response, replay_engine)
        assert outcome.startswith(IDENTICAL), (ex.name, outcome)
        identical += 1
    print(
        f"\nuntouched: {valid}/{len(exchanges)} valid, {identical}/{len(exchanges)} replay identically (false rejects: 0)"
    )


def test_mutations_are_refused(
    exchanges: list[Exchange], receipt_key: SigningKey, other_key: SigningKey, replay_engine: Any
) -> None:
    pem = receipt_key.public_key_pem
    tampered = tampered_cases(exchanges, receipt_key, other_key)
    accepted = [(name, check_receipt(req, resp, pem)) for name, req, resp in tampered]
    false_accepts = [name for name, verdict in accepted if verdict == VALID]
    assert [(name, v) for name, v in accepted if not v.startswith("refuse: ")] == []
    print(
        f"\nchanged after signing: {len(tampered)} cases, {len(tampered) - len(false_accepts)} refused by the check, false accepts: {len(false_accepts)}"
    )
    assert false_accepts == []

    lies = lies_signed(exchanges, receipt_key)
    by_check = by_replay = 0
    passed = []
    for name, req, resp in lies:
        if check_receipt(req, resp, pem, model_sha256=support.DEFAULT_SHA256) != VALID:
            by_check += 1
            continue
        if replay_in_process(req, resp, replay_engine).startswith(IDENTICAL):
            passed.append(name)
        else:
            by_replay += 1
    print(
        f"signed lies: {len(lies)} cases, {by_check} refused by the check, {by_replay} by the replay, false accepts: {len(passed)}"
    )
    assert passed == []


def test_first_reasons(
    exchanges: list[Exchange], receipt_key: SigningKey, other_key: SigningKey
) -> None:
    """A refusal names what is wrong."""
    ex = exchanges[0]
    pem = receipt_key.public_key_pem
    assert check_receipt(one_request_byte(ex.request), ex.response, pem).startswith(
        "refuse: request_sha256"
    )
    assert "response_sha256" in check_receipt(
        ex.request, edited(ex.response, one_answer_byte(ex.api)), pem
    )
    assert "not by the key given" in check_receipt(
        ex.request, ex.response, other_key.public_key_pem
    )
    assert "pinned model" in check_receipt(ex.request, ex.response, pem, model_sha256="0" * 64)
    assert check_receipt(ex.request, b"{}", pem) == "refuse: the response carries no bankml_receipt"
    assert check_receipt(ex.request, ex.response, "not a key").startswith("refuse: the public key")


def test_malformed_input_is_refused_not_raised(
    exchanges: list[Exchange], receipt_key: SigningKey
) -> None:
    pem = receipt_key.public_key_pem
    ex = next(e for e in exchanges if e.stream)
    wrong = {"receipt_version": 2, "alg": "ed25519", "keyid": receipt_key.keyid, "signature": "x"}
    bodies = [b"", b"data: [DONE]\n\n", b"[1,2]", b'{"bankml_receipt": 5}', b"\xff\xfe", b"null"]
    bodies.append(json.dumps({"bankml_receipt": wrong}).encode())
    bodies += [ex.response[:cut] for cut in range(0, len(ex.response), 97)]
    for body in bodies:
        assert check_receipt(ex.request, body, pem).startswith("refuse: "), body[:80]
    assert check_receipt(b"\x00", ex.response, pem).startswith("refuse: request_sha256")


def test_stream_layouts(exchanges: list[Exchange], receipt_key: SigningKey) -> None:
    """The receipt as a field of the last regular event, or as that event alone; never earlier."""
    pem = receipt_key.public_key_pem
    ex = next(e for e in exchanges if e.stream and e.api == "chat")
    form, objects, done = load(ex.response)
    receipt = objects[-1].pop("bankml_receipt")
    alone = dump(form, [*objects, {"bankml_receipt": receipt}], done)
    assert check_receipt(ex.request, alone, pem) == VALID
    early = copy.deepcopy(objects)
    early[0]["bankml_receipt"] = receipt
    assert "not in the stream's last event" in check_receipt(
        ex.request, dump(form, early, done), pem
    )
    after_done = ex.response + b'data: {"choices":[]}\n\n'
    assert check_receipt(ex.request, after_done, pem).startswith("refuse: ")
    crlf = ex.response.replace(b"\n", b"\r\n")
    assert check_receipt(ex.request, crlf, pem) == VALID


def test_ndjson_answer(exchanges: list[Exchange], receipt_key: SigningKey) -> None:
    """An NDJSON stream (Ollama's form): the lines' text joined, the logprobs as the final object
    lists them all again, the receipt on the last line."""
    from bankml.receipts.answer import answer_of

    ex = next(
        e for e in exchanges if e.stream and e.api == "chat" and "logprobs" in e.request.decode()
    )
    form, objects, _ = load(ex.response)
    receipt = dict(receipt_of(objects))
    view = answer_of(objects, form, "chat", None)
    text, entries = view.text, view.logprobs
    assert entries and "logprobs_sha256" in receipt
    lines = [
        {
            "message": {"role": "assistant", "content": text[:5]},
            "done": False,
            "logprobs": entries[:1],
        },
        {
            "message": {"role": "assistant", "content": text[5:]},
            "done": False,
            "logprobs": entries[1:],
        },
        {
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": receipt["finish_reason"],
            "prompt_eval_count": receipt["prompt_tokens"],
            "eval_count": receipt["completion_tokens"],
            "logprobs": entries,
        },
    ]
    receipt.update(api="ollama_chat")
    lines[-1]["bankml_receipt"] = sign_receipt(receipt, receipt_key)

    def body() -> bytes:
        return b"".join(json.dumps(line).encode() + b"\n" for line in lines)

    assert check_receipt(ex.request, body(), receipt_key.public_key_pem) == VALID
    lines[-1]["logprobs"] = entries[1:]
    assert "logprobs_sha256" in check_receipt(ex.request, body(), receipt_key.public_key_pem)
    lines[-1]["logprobs"] = entries
    lines[0]["message"]["content"] = "X" + text[1:5]
    assert "response_sha256" in check_receipt(ex.request, body(), receipt_key.public_key_pem)


def test_cannot_replay_is_not_a_pass(
    exchanges: list[Exchange], receipt_key: SigningKey, replay_engine: Any
) -> None:
    ex = exchanges[0]
    gpu = edited(
        ex.response,
        lambda objs: objs[-1].update(
            bankml_receipt=sign_receipt({**receipt_of(objs), "device": "cuda"}, receipt_key)
        ),
    )
    assert check_receipt(ex.request, gpu, receipt_key.public_key_pem) == VALID
    assert replay_in_process(ex.request, gpu, replay_engine).startswith(
        "cannot replay: answered on 'cuda'"
    )


def test_cli(
    exchanges: list[Exchange],
    receipt_key: SigningKey,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    default_model: Path,
    default_fork: Path,
) -> None:
    from bankml.cli.receipts import check_receipt_main, keygen_main

    ex = next(e for e in exchanges if e.seeded and e.stream)
    (tmp_path / "req.json").write_bytes(ex.request)
    (tmp_path / "resp").write_bytes(ex.response)
    (tmp_path / "key.pem").write_text(receipt_key.public_key_pem)
    (tmp_path / "bad").write_bytes(edited(ex.response, one_answer_byte(ex.api)))
    args = ["--request", str(tmp_path / "req.json"), "--key", str(tmp_path / "key.pem")]
    assert check_receipt_main([*args, "--response", str(tmp_path / "resp")]) == 0
    assert capsys.readouterr().out == "valid\n"
    assert check_receipt_main([*args, "--response", str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().out.startswith("refuse: response_sha256")
    replay = ["--replay", str(default_model), "--fork", str(default_fork)]
    assert check_receipt_main([*args, "--response", str(tmp_path / "resp"), *replay]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("replay: identical")
    with pytest.raises(SystemExit) as usage:
        check_receipt_main([*args, "--response", str(tmp_path / "resp"), "--replay", "m"])
    assert usage.value.code == 1
    assert keygen_main(["--key", str(tmp_path / "k.pem")]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(tmp_path / "k.pem")
    assert keygen_main(["--key", str(tmp_path / "k.pem")]) == 2
    assert keygen_main([], home=str(tmp_path / "home")) == 0
    assert (tmp_path / "home/.local/share/bankml/receipt-key.pem").stat().st_mode & 0o777 == 0o600


@pytest.mark.llama_server
def test_replay_through_llama_server(
    exchanges: list[Exchange], receipt_key: SigningKey, llama_server_bin: Path, default_model: Path
) -> None:
    """The unmodified llama-server computes the same answers, greedy and seeded."""
    from bankml.receipts.replay import LlamaServerProcess, replay_with_llama_server

    receipt = find_receipt(exchanges[0].response)[1]
    with LlamaServerProcess(
        str(llama_server_bin), str(default_model), receipt["n_ctx"], receipt["cache_type"]
    ) as server:
        outcomes = [
            (ex.name, replay_with_llama_server(ex.request, ex.response, server)) for ex in exchanges
        ]
    agreed = [name for name, outcome in outcomes if outcome.startswith(IDENTICAL)]
    print(f"\nllama-server replays: {len(agreed)}/{len(outcomes)} identical")
    assert agreed == [name for name, _ in outcomes], outcomes
    assert any(ex.seeded for ex in exchanges) and any(not ex.seeded for ex in exchanges)
    for name, outcome in outcomes:
        print(f"  {name}: {outcome}")
    # a signed lie about the answer is caught by llama-server too
    ex = next(e for e in exchanges if e.seeded and e.api == "llama_completion")
    lie = lies_signed([ex], receipt_key)[0]
    assert lie[0].endswith("a byte of the answer, hash re-signed")
    with LlamaServerProcess(
        str(llama_server_bin), str(default_model), receipt["n_ctx"], receipt["cache_type"]
    ) as server:
        assert replay_with_llama_server(lie[1], lie[2], server).startswith("refuse: ")


@pytest.mark.llama_server
def test_cli_replay_with_llama_server(
    exchanges: list[Exchange],
    receipt_key: SigningKey,
    llama_server_bin: Path,
    default_model: Path,
    default_fork: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bankml.cli.receipts import check_receipt_main

    ex = next(e for e in exchanges if e.seeded and e.api == "chat" and e.stream)
    (tmp_path / "req.json").write_bytes(ex.request)
    (tmp_path / "resp").write_bytes(ex.response)
    (tmp_path / "key.pem").write_text(receipt_key.public_key_pem)
    argv = ["--request", str(tmp_path / "req.json"), "--response", str(tmp_path / "resp")]
    argv += ["--key", str(tmp_path / "key.pem"), "--replay", str(default_model)]
    argv += ["--fork", str(default_fork), "--replay-with-llama-server", str(llama_server_bin)]
    assert check_receipt_main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "valid" and out[1].startswith("replay: identical"), out
