"""The official `openai` Python client through bankml (P0, in front of the real llama-server)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests import support
from tests.bankml_process import (
    MESSAGES,
    BankmlProcess,
    canonical_stream,
    check_receipt_on_last_chunk,
    sha,
)

pytestmark = pytest.mark.llama_server


@pytest.fixture(scope="module")
def client(
    reference_server: support.LlamaServer,
    default_model: Path,
    default_fork: Path,
    tmp_path_factory: pytest.TempPathFactory,
):
    log = tmp_path_factory.mktemp("openai") / "bankml.log"
    with BankmlProcess(
        default_model, default_fork, ["--upstream", f"127.0.0.1:{reference_server.port}"], log
    ) as bankml:
        yield openai.OpenAI(base_url=bankml.url + "/v1", api_key="x", max_retries=0)


def test_openai_client_not_streamed(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=12, temperature=0
    )
    text = completion.choices[0].message.content
    assert text
    receipt = completion.model_extra["bankml_receipt"]
    assert receipt["response_sha256"] == sha(text)
    assert receipt["model_sha256"] == support.DEFAULT_SHA256
    assert receipt["completion_tokens"] == completion.usage.completion_tokens


@pytest.mark.parametrize("include_usage", [False, True])
def test_openai_client_canonical_stream_loop(client: openai.OpenAI, include_usage: bool) -> None:
    text, chunks = canonical_stream(client, include_usage)
    check_receipt_on_last_chunk(text, chunks, include_usage)


def test_openai_client_sees_an_engine_error_as_an_api_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=4, n=2)
    assert refused.value.status_code == 400
    assert (
        refused.value.body["message"]
        == "Field 'n': Value must be between 1 <= value <= 1, but got 2"
    )
