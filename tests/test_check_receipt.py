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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bankml.receipts.answer import JSON, find_receipt, response_form, sse_payloads
from bankml.receipts.check import VALID, check_receipt
from bankml.receipts.keys import SigningKey, keygen
from bankml.receipts.replay import IDENTICAL, replay_in_process
from bankml.receipts.sign import sha256_hex, sign_receipt
from tests import support
from tests.receipt_answers import (  # noqa: F401  (fixtures, found by their names)
    Exchange,
    exchanges_fixture,
    native_engine_fixture,
    receipt_key_fixture,
    replay_engine_fixture,
)

pytestmark = pytest.mark.slow

# --- taking an answer apart and putting it back as the server writes it ---------------------------


def load(ex_response: bytes) -> tuple[str, list[dict[str, Any]], bool]:
    """(form, the objects, whether the stream ended with [DONE])."""
    form = response_form(ex_response)
    if form == JSON:
        return form, [json.loads(ex_response)], False
    payloads = sse_payloads(ex_response)
    done = bool(payloads) and payloads[-1] == b"[DONE]"
    return form, [json.loads(p) for p in payloads if p != b"[DONE]"], done


def dump(form: str, objects: list[dict[str, Any]], done: bool) -> bytes:
    from bankml.formats.nlohmann import dumps
    from bankml.serving.writers import sse_event

    if form == JSON:
        return dumps(objects[0])
    return b"".join(sse_event(o) for o in objects) + (b"data: [DONE]\n\n" if done else b"")


def receipt_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return objects[-1]["bankml_receipt"]


def edited(response: bytes, edit: Callable[[list[dict[str, Any]]], None]) -> bytes:
    form, objects, done = load(response)
    objects = copy.deepcopy(objects)
    edit(objects)
    return dump(form, objects, done)


def text_slots(api: str, objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str]]:
    """(the dict holding a piece of the answer text, its key), in order."""
    out = []
    for obj in objects:
        if api == "llama_completion":
            out.append((obj, "content"))
            continue
        if api in ("responses", "messages"):
            out += typed_text_slots(api, obj)
            continue
        for choice in obj.get("choices") or []:
            if api == "oai_completion":
                out.append((choice, "text"))
            else:
                out.append((choice.get("delta") or choice.get("message") or {}, "content"))
    return [(d, k) for d, k in out if isinstance(d.get(k), str) and d[k]]


def typed_text_slots(api: str, obj: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """The Responses and Messages answers' text: a whole answer's output_text parts or text
    blocks, a stream's text deltas."""
    kind = obj.get("type")
    if kind == "response.output_text.delta":
        return [(obj, "delta")]
    if kind == "content_block_delta" and (obj.get("delta") or {}).get("type") == "text_delta":
        return [(obj["delta"], "text")]
    if api == "responses" and isinstance(obj.get("output"), list) and kind is None:
        items = [i for i in obj["output"] if i.get("type") == "message"]
        return [(p, "text") for i in items for p in i["content"] if p["type"] == "output_text"]
    if api == "messages" and kind == "message":
        return [(b, "text") for b in obj["content"] if b.get("type") == "text"]
    return []


def one_answer_byte(api: str) -> Callable[[list[dict[str, Any]]], None]:
    """Change the answer's first ASCII letter to another letter."""

    def edit(objects: list[dict[str, Any]]) -> None:
        for holder, key in text_slots(api, objects):
            text = holder[key]
            for i, c in enumerate(text):
                if c.isascii() and c.isalpha():
                    holder[key] = text[:i] + ("x" if c != "x" else "y") + text[i + 1 :]
                    return
        raise AssertionError("an answer without a letter")

    return edit


def one_request_byte(request: bytes) -> bytes:
    """A letter of the prompt (a message's content, the prompt, or a Responses input) changed."""
    field = (
        b"content" if b"messages" in request else b"input" if b'"input"' in request else b"prompt"
    )
    i = request.index(b'"', request.index(field) + len(field) + 1)
    i = next(j for j in range(i, len(request)) if chr(request[j]).isalpha())
    return request[:i] + (b"x" if request[i : i + 1] != b"x" else b"y") + request[i + 1 :]


def with_fields(request: bytes, **fields: Any) -> bytes:
    return json.dumps({**json.loads(request), **fields}).encode()


def changed(value: Any) -> Any:
    """Another value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value[:-1] + ("0" if value[-1:] != "0" else "1") if value else "x"
    if isinstance(value, dict):
        first = sorted(value)[0]
        return {**value, first: changed(value[first])}
    if isinstance(value, list):
        return [*value, 0]
    return 0  # null


# --- the suite ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_key(tmp_path_factory: pytest.TempPathFactory) -> SigningKey:
    return keygen(tmp_path_factory.mktemp("other-key") / "other.pem")


def tampered_cases(
    exchanges: list[Exchange], key: SigningKey, other: SigningKey
) -> list[tuple[str, bytes, bytes]]:
    """Changes made after signing: the check alone must refuse each."""
    cases = []
    for n, ex in enumerate(exchanges):
        tag = ex.name
        cases.append(
            (
                f"{tag}: a byte of the answer",
                ex.request,
                edited(ex.response, one_answer_byte(ex.api)),
            )
        )
        cases.append((f"{tag}: a byte of the request", one_request_byte(ex.request), ex.response))
        cases.append(
            (
                f"{tag}: another seed in the request",
                with_fields(ex.request, seed=1234567),
                ex.response,
            )
        )
        cases.append(
            (
                f"{tag}: another temperature in the request",
                with_fields(ex.request, temperature=0.55),
                ex.response,
            )
        )

        def set_model(objects: list[dict[str, Any]]) -> None:
            receipt_of(objects)["model_sha256"] = support.DEFAULT_SHA256[::-1]

        cases.append((f"{tag}: another model sha256", ex.request, edited(ex.response, set_model)))
        for field in sorted(find_receipt(ex.response)[1]):

            def edit_field(objects: list[dict[str, Any]], field: str = field) -> None:
                r = receipt_of(objects)
                r[field] = changed(r[field])

            cases.append(
                (
                    f"{tag}: receipt field {field} edited",
                    ex.request,
                    edited(ex.response, edit_field),
                )
            )

        def drop_signature(objects: list[dict[str, Any]]) -> None:
            del receipt_of(objects)["signature"]

        cases.append((f"{tag}: signature removed", ex.request, edited(ex.response, drop_signature)))

        def other_signs(objects: list[dict[str, Any]]) -> None:
            objects[-1]["bankml_receipt"] = sign_receipt(receipt_of(objects), other)

        cases.append(
            (f"{tag}: signed by another key", ex.request, edited(ex.response, other_signs))
        )

        def other_signs_keyid_kept(objects: list[dict[str, Any]]) -> None:
            r = sign_receipt(receipt_of(objects), other)
            objects[-1]["bankml_receipt"] = {**r, "keyid": key.keyid}

        cases.append(
            (
                f"{tag}: another key's signature, this key's id",
                ex.request,
                edited(ex.response, other_signs_keyid_kept),
            )
        )
        for m, other_ex in enumerate(exchanges):
            if m == n or other_ex.stream != ex.stream or other_ex.api != ex.api:
                continue
            moved_receipt = find_receipt(ex.response)[1]

            def move(objects: list[dict[str, Any]], r: dict = moved_receipt) -> None:
                objects[-1]["bankml_receipt"] = r

            moved = edited(other_ex.response, move)
            cases.append((f"{tag}: receipt moved onto {other_ex.name}", other_ex.request, moved))
            cases.append(
                (f"{tag}: receipt moved onto {other_ex.name}, own request", ex.request, moved)
            )
    return cases


def lies_signed(exchanges: list[Exchange], key: SigningKey) -> list[tuple[str, bytes, bytes]]:
    """Changes signed again by the key's holder: the check or the replay must refuse each."""

    def resigned(
        response: bytes, edit: Callable[[dict[str, Any], list[dict[str, Any]]], None]
    ) -> bytes:
        def apply(objects: list[dict[str, Any]]) -> None:
            r = dict(receipt_of(objects))
            edit(r, objects)
            objects[-1]["bankml_receipt"] = sign_receipt(r, key)

        return edited(response, apply)

    cases = []
    for ex in exchanges:
        tag = ex.name

        def answer_byte(
            r: dict[str, Any], objects: list[dict[str, Any]], api: str = ex.api
        ) -> None:
            one_answer_byte(api)(objects)
            from bankml.receipts.answer import answer_of

            form = "sse" if r["stream"] else JSON
            r["response_sha256"] = sha256_hex(answer_of(objects, form, api, None).text.encode())

        cases.append(
            (
                f"{tag}: a byte of the answer, hash re-signed",
                ex.request,
                resigned(ex.response, answer_byte),
            )
        )

        def model(r: dict[str, Any], objects: list) -> None:
            r["model_sha256"] = support.DEFAULT_SHA256[::-1]

        cases.append(
            (f"{tag}: another model sha256, re-signed", ex.request, resigned(ex.response, model))
        )
        for name, value in (("seed", 1234567), ("temperature", 0.55)):
            request = with_fields(ex.request, **{name: value})

            def rehash(r: dict[str, Any], objects: list, request: bytes = request) -> None:
                r["request_sha256"] = sha256_hex(request)

            cases.append(
                (
                    f"{tag}: another {name} in the request, re-signed",
                    request,
                    resigned(ex.response, rehash),
                )
            )

        def count(r: dict[str, Any], objects: list) -> None:
            r["completion_tokens"] += 1

        cases.append(
            (
                f"{tag}: completion_tokens edited, re-signed",
                ex.request,
                resigned(ex.response, count),
            )
        )

        def prompt(r: dict[str, Any], objects: list) -> None:
            r["prompt_tokens_sha256"] = changed(r["prompt_tokens_sha256"])

        cases.append(
            (
                f"{tag}: prompt_tokens_sha256 edited, re-signed",
                ex.request,
                resigned(ex.response, prompt),
            )
        )

        def n_ctx(r: dict[str, Any], objects: list) -> None:
            r["n_ctx"] = r["n_ctx"] // 2

        cases.append((f"{tag}: n_ctx edited, re-signed", ex.request, resigned(ex.response, n_ctx)))
    return cases


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
    assert all(v.startswith("refuse: ") for _, v in accepted)
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
