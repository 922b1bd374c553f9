"""The native Resources served from a fake engine (``ResidentEngine``, resources/interfaces.py)
whose bridge runs every job at once: the routes' checks and the bytes they write, without a
server, a reactor or a model."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from twisted.internet.defer import Deferred, maybeDeferred, succeed
from twisted.web.test.requesthelper import DummyRequest

from bankml.engine_cupy.sampler import SamplerParams
from bankml.formats.errors import ApiError
from bankml.formats.llama import MetricsScrape, Props, prometheus_text, props_object
from bankml.formats.openai import ModelFacts
from bankml.formats.slot_actions import NOT_SUPPORTED_SLOTS
from bankml.formats.slot_view import SlotView
from bankml.native.run import Step
from bankml.resources import llama
from bankml.resources.openai import ChatCompletions, Models
from bankml.serving.run_control import RunControl


class InstantBridge:
    """Every job at once, on the calling thread; a run's items delivered in order."""

    scheduler = None

    def new_control(self) -> RunControl:
        return RunControl()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Deferred[Any]:
        return maybeDeferred(fn, *args, **kwargs)

    prepare = call

    def stream(
        self, steps: Callable[..., Iterator[Any]], deliver: Callable[[Any], None], control: Any
    ) -> Deferred[Any]:
        for item in steps(control.cancelled):
            deliver(item)
        return succeed(None)


class FakeEngine:
    """The resident engine as the native Resources see it, answering "Hi there" to any chat."""

    model_id = "tiny.gguf"
    build_info = "bankml 0 native"
    started = 1700000000.5

    def __init__(self, slot_dir: str | None = None) -> None:
        self.bridge = InstantBridge()
        self.slot_dir = slot_dir
        self.slot_views = [SlotView()]
        self.recorded: list[str] = []
        self.slot_actions: list[tuple[str, str, int]] = []

    # AnswerSource
    def token_count(self, text: str) -> int:
        return 1

    def receipt(self, tally: Any, parsed: Any, summary: Any, *, api: str, stream: bool) -> Any:
        return {"text": tally.text, "api": api}

    # the runs
    def identity_problem(self) -> str | None:
        return None

    def parse(self, body: dict[str, Any], kind: str) -> list[Any]:
        if "messages" not in body:
            raise ApiError.of(400, "'messages' is required")
        options: dict[str, Any] = {}
        return [SimpleNamespace(sampler=SamplerParams(), options=options, n_probs=0, n_predict=-1)]

    def steps(
        self, prompts: list[Any], keep_alive: bool = True, first_index: int = 0
    ) -> Callable[..., Iterator[Any]]:
        def run(cancelled: Callable[[], bool], forwards: bool = False) -> Iterator[Any]:
            for text in ("Hi", " there"):
                yield Step(0, chunk=SimpleNamespace(text=text, token=1, entry=None, timings=None))
            yield Step(
                0,
                summary=SimpleNamespace(
                    text="Hi there",
                    finish_reason="stop",
                    prompt_tokens=3,
                    completion_tokens=2,
                    timings=None,
                    cancelled=False,
                ),
            )

        return run

    def shared(self, prompts: list[Any], n_cmpl: int) -> list[Any]:
        return prompts

    def view_for(self, item: Any) -> SlotView | None:
        return self.slot_views[0]

    def record(
        self, summary: Any, ttft_ms: int | None, wall_ms: int, kind: str, model: str = ""
    ) -> None:
        self.recorded.append(kind)

    # the text and slot jobs
    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(body.get("content"), str):
            raise ApiError.of(400, "'content' must be a string")
        return {"tokens": [ord(c) for c in body["content"]]}

    detokenize = apply_template = input_tokens = tokenize

    def slots(self, views: list[SlotView]) -> list[dict[str, Any]]:
        return [{"id": i, "is_processing": v.processing} for i, v in enumerate(views)]

    def slot_action(self, action: str, filename: str, id_slot: int) -> tuple[int, dict[str, Any]]:
        self.slot_actions.append((action, filename, id_slot))
        return 200, {"id_slot": id_slot}

    # the plain data of /props, /metrics, /v1/models
    def props(self) -> Props:
        return Props(
            defaults=SamplerParams(),
            n_ctx=4096,
            total_slots=1,
            model_alias=self.model_id,
            model_ftype="Q4_1",
            model_path="/models/tiny.gguf",
            build_info=self.build_info,
        )

    def scrape(self) -> MetricsScrape:
        totals = dict.fromkeys(
            (
                "prompt_tokens",
                "prompt_tokens_cached",
                "prompt_seconds",
                "tokens_predicted",
                "predicted_seconds",
                "decode_calls",
                "n_tokens_max",
            ),
            0,
        )
        window = {"prompt_tokens": 0, "prompt_seconds": 0, "steps": 0, "predicted_seconds": 0}
        return MetricsScrape(totals, window, 0, 0, 0.0)

    def model_facts(self) -> ModelFacts:
        return ModelFacts(id=self.model_id, aliases=[], n_ctx=4096, ftype="Q4_1")


def request(method: bytes, body: Any = None, **args: bytes) -> DummyRequest:
    req = DummyRequest([b""])
    req.method = method
    req.content = io.BytesIO(body if isinstance(body, bytes) else json.dumps(body).encode())
    for name, value in args.items():
        req.addArg(name.encode(), value)
    return req


def served(resource: Any, req: DummyRequest) -> tuple[int, bytes]:
    resource.render(req)
    assert req.finished, "the answer was not finished"
    return req.responseCode, b"".join(req.written)


def header(req: DummyRequest, name: bytes) -> bytes:
    return req.responseHeaders.getRawHeaders(name)[0]


def test_props_writes_the_format_of_the_engines_props() -> None:
    engine = FakeEngine()
    req = request(b"GET")
    status, body = served(llama.Props(engine), req)
    assert status == 200
    assert header(req, b"content-type") == b"application/json; charset=utf-8"
    assert json.loads(body) == props_object(engine.props())


def test_metrics_is_prometheus_text_with_the_start_time() -> None:
    engine = FakeEngine()
    req = request(b"GET")
    status, body = served(llama.Metrics(engine), req)
    assert status == 200
    assert body.decode() == prometheus_text(engine.scrape())
    assert header(req, b"content-type") == b"text/plain; version=0.0.4"
    assert header(req, b"process-start-time-unix") == b"1700000000"


def test_models_lists_the_engines_model() -> None:
    status, body = served(Models(FakeEngine()), request(b"GET"))
    assert status == 200
    assert [m["id"] for m in json.loads(body)["data"]] == ["tiny.gguf"]


def test_a_text_job_answers_or_writes_its_refusal() -> None:
    engine = FakeEngine()
    status, body = served(llama.Tokenize(engine), request(b"POST", {"content": "ab"}))
    assert (status, json.loads(body)) == (200, {"tokens": [97, 98]})
    status, body = served(llama.Tokenize(engine), request(b"POST", {"content": 1}))
    assert status == 400
    assert json.loads(body)["error"]["message"] == "'content' must be a string"
    status, body = served(llama.Tokenize(engine), request(b"POST", b"[1]"))
    assert status == 400
    assert json.loads(body)["error"]["message"] == "the request body must be a JSON object"


def test_slot_actions_are_checked_in_llama_servers_order_before_the_engine_sees_them() -> None:
    def action(engine: FakeEngine, id_text: str, body: Any, **args: bytes) -> tuple[int, str]:
        status, out = served(llama.SlotAction(engine, id_text), request(b"POST", body, **args))
        return status, json.loads(out).get("error", {}).get("message", "")

    no_dir = FakeEngine()
    assert action(no_dir, "x", {}, action=b"nope") == (501, NOT_SUPPORTED_SLOTS)
    engine = FakeEngine(slot_dir="/tmp/slots")
    assert action(engine, "x", {}, action=b"save") == (400, "Invalid slot ID")
    assert action(engine, "0", {}, action=b"nope") == (400, "Invalid action")
    assert action(engine, "0", {"filename": "../a"}, action=b"save") == (400, "Invalid filename")
    assert action(engine, "0", {}, action=b"restore")[0] == 400  # no filename
    assert engine.slot_actions == []
    assert action(engine, " 7", {"filename": "a.bin"}, action=b"save") == (200, "")
    assert action(engine, "3", None, action=b"erase") == (200, "")
    assert engine.slot_actions == [("save", "a.bin", 7), ("erase", "", 3)]


def test_the_slot_monitor_is_503_when_every_slot_is_busy_and_asked_to_fail() -> None:
    engine = FakeEngine()
    status, body = served(llama.Slots(engine), request(b"GET"))
    assert (status, json.loads(body)) == (200, [{"id": 0, "is_processing": False}])
    engine.slot_views[0].processing = True
    status, body = served(llama.Slots(engine), request(b"GET", fail_on_no_slot=b"1"))
    assert (status, json.loads(body)["error"]["message"]) == (503, "no slot available")


def test_a_chat_runs_through_the_bridge_and_writes_one_object_with_its_receipt() -> None:
    engine = FakeEngine()
    status, body = served(ChatCompletions(engine), request(b"POST", {"messages": []}))
    assert status == 200
    out = json.loads(body)
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
    assert out["bankml_receipt"] == {"text": "Hi there", "api": "chat"}
    assert engine.recorded == ["chat"]
    view = engine.slot_views[0]  # the slot's task began, counted its tokens and ended
    assert (view.id_task, view.processing, view.kind) == (0, False, "chat")


def test_a_refused_chat_is_the_engines_status_and_error_object() -> None:
    engine = FakeEngine()
    status, body = served(ChatCompletions(engine), request(b"POST", {"prompt": "x"}))
    assert (status, json.loads(body)["error"]["message"]) == (400, "'messages' is required")
    assert engine.recorded == []
