"""The endpoints that run the engine: one request, its prompts, their answers.

``AnswerResource(native, kind)`` answers a chat (``chat``), an OpenAI completion
(``oai_completion``) or llama-server's /completion (``llama_completion``) the same way:

1. the body is read as JSON (not an object: 400), the model file's identity is checked (changed
   since verify: 503, no receipt);
2. ``native.parse`` runs on the bridge's prepare thread and validates everything before a token
   is computed; a refusal is llama-server's status and error object;
3. the run (``native.steps``: every prompt in turn) is queued on the engine thread; each
   ``Step`` comes back on the reactor thread to ``RunWriter``, which asks each prompt's
   ``Answer`` (bankml/formats/answer.py) what to send (with ``return_progress``, a stream's
   prompt-progress events first);
4. not streamed: one object (several prompts: llama-server's array on /completion, one object
   with every choice on /v1/completions); streamed: the events as they come, each prompt's
   last one carrying its receipt, ``data: null`` before each prompt after the first (as
   llama-server writes a later task's begin), then ``data: [DONE]`` except on /completion. An
   error after the stream began is ``data: {"error": ...}``. The file's identity is checked
   again before each prompt's last event or object: changed, the answer ends with a 503
   instead, and no receipt.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, DeferredList, FirstError
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import NOT_DONE_YET, Request

from bankml.formats.answer import Answer
from bankml.formats.answers import ANSWERS, answers_for, merged
from bankml.formats.errors import RETRY_AFTER_S, ApiError, error_body
from bankml.formats.nlohmann import dumps, loads_json
from bankml.formats.slot_view import SlotView
from bankml.receipts.kinds import LLAMA_COMPLETION, MESSAGES, RESPONSES
from bankml.resources.interfaces import Bridge, ResidentEngine
from bankml.serving.run_control import ClientGone, Overloaded, RunControl
from bankml.serving.writers import (
    EventStream,
    JsonResource,
    anthropic_sse_event,
    gone,
    sse_event,
    typed_sse_event,
    write_error,
    write_json,
)

_log = Logger(namespace="bankml.native")

# the streams that are not OpenAI's data-only events, and those that end without [DONE]
FRAMES = {RESPONSES: typed_sse_event, MESSAGES: anthropic_sse_event}
NO_DONE = (LLAMA_COMPLETION, RESPONSES, MESSAGES)


def read_json_object(request: Request) -> tuple[bytes, dict[str, Any]]:
    """(raw body, the object); ApiError 400 when it is not a JSON object."""
    raw = request.content.read() if request.content is not None else b""
    try:
        obj = loads_json(raw)
    except ValueError as err:
        raise ApiError.of(400, f"the request body is not JSON: {err}") from None
    if not isinstance(obj, dict):
        raise ApiError.of(400, "the request body must be a JSON object")
    return raw, obj


class AnswerResource(JsonResource):
    """One endpoint kind on the native engine (see the module doc)."""

    isLeaf = True

    def __init__(self, native: ResidentEngine, kind: str) -> None:
        super().__init__()
        if kind not in ANSWERS:
            raise ValueError(f"unknown kind {kind!r}")
        if native.bridge is None:
            raise ValueError("a served NativeEngine has its bridge")
        self.native = native
        self.bridge: Bridge = native.bridge
        self.kind = kind
        self.parse_kind = kind  # the body's shape for native.parse (/infill's: INFILL)

    def render_POST(self, request: Request) -> Any:
        try:
            raw, obj = read_json_object(request)
        except ApiError as err:
            write_json(request, err.status, err.as_bytes())
            return NOT_DONE_YET
        problem = self.native.identity_problem()
        if problem is not None:
            write_json(request, 503, error_body(503, problem))
            return NOT_DONE_YET
        control = self.bridge.new_control()
        request.notifyFinish().addErrback(lambda _: control.cancel())
        asked = (request.args or {}).get(b"autoload")  # llama-server's router: ?autoload=
        extra = {} if not asked else {"autoload": asked[-1] in (b"true", b"1")}
        d = self.bridge.prepare(self.native.parse, obj, self.parse_kind, **extra)
        d.addCallback(self._run, request, raw, obj, control)
        d.addErrback(self._failed, request, None)
        return NOT_DONE_YET

    def _run(
        self,
        prompts: list[Any],
        request: Request,
        raw: bytes,
        obj: dict[str, Any],
        control: RunControl,
    ) -> Any:
        if gone(request):
            return None
        answers = answers_for(self.native, self.kind, raw, obj, prompts)
        writer = RunWriter(request, self.native, answers, control)
        if self.bridge.scheduler is None or len(prompts) == 1:
            d = self.bridge.stream(self.native.steps(prompts), writer.step, control)
        else:
            d = self._fan_out(prompts, writer, control)
        d.addCallback(writer.end)
        d.addErrback(self._failed, request, writer)
        return d

    def _fan_out(self, prompts: list[Any], writer: RunWriter, control: RunControl) -> Deferred:
        """Each answer (a prompt, or one of its ``n_cmpl`` completions) a run of its own, on a
        slot of its own, all queued at once, a prompt's completions as one group that computes
        the prompt once (``Engine.share_prompt``): the Deferred fires when every one has ended,
        or fails with the first failure (the others cancelled)."""
        n_cmpl = int(writer.answers[0].options.get("n_cmpl", 1))
        if n_cmpl > 1:
            prompts = self.native.shared(prompts, n_cmpl)
        runs = []
        for index, parsed in enumerate(prompts):
            own = self.bridge.new_control()
            control.follow(own)
            runs.append((self.native.steps([parsed], first_index=index), own))
        every = DeferredList(
            self.bridge.stream_each(runs, writer.step, group=n_cmpl),
            fireOnOneErrback=True,
            consumeErrors=True,
        )

        def first_failure(failure: Failure) -> Failure:
            control.cancel()  # the other answers stop within a token
            error = failure.value
            return error.subFailure if isinstance(error, FirstError) else failure

        every.addErrback(first_failure)
        return every

    def _failed(self, failure: Failure, request: Request, writer: RunWriter | None) -> None:
        if writer is not None:
            writer.end_view()
        if failure.check(ClientGone) or gone(request):
            return
        if failure.check(Overloaded):  # never queued: nothing computed, nothing lost
            write_error(request, 503, str(failure.value), retry_after=RETRY_AFTER_S)
            return
        err = failure.value
        if isinstance(err, ApiError):
            if writer is not None and writer.events.started:
                writer.events.fail(err.status, err.body)
            else:
                if err.retry_after is not None:
                    request.setHeader(b"retry-after", str(err.retry_after).encode())
                write_json(request, err.status, err.as_bytes())
            return
        _log.failure("native run failed", failure)
        message = f"the engine failed: {failure.getErrorMessage()}"
        if writer is not None:
            writer.events.error(500, message)
        else:
            write_json(request, 500, error_body(500, message))


class RunWriter:
    """Writes one request's answers: stream events as Steps arrive (the answers' runs side by
    side on several slots, or one after the other), or the objects, in index order, at the end."""

    def __init__(
        self,
        request: Request,
        native: ResidentEngine,
        answers: list[Answer],
        control: RunControl,
    ) -> None:
        self.request = request
        self.answers = answers
        self.control = control
        self.native = native
        self.kind = answers[0].kind
        self.stream = answers[0].stream
        self.events = EventStream(
            request,
            frame=FRAMES.get(self.kind, sse_event),
            producer=control if self.stream else None,
        )
        self.results: dict[int, dict[str, Any]] = {}
        self.cancelled = False
        self.problem: str | None = None  # the file changed during the run
        # the slot view of each answer whose task a slot runs (GET /slots; with several slots
        # known at the answer's first step)
        self.views: dict[int, SlotView] = {}
        # llama-server's n_cmpl children share their parent's task start: no begin event
        n_cmpl = int(answers[0].options.get("n_cmpl", 1))
        self.first_of_task = [a.index % n_cmpl == 0 for a in answers]
        self._begin(0, None)

    def _begin(self, index: int, item: Any) -> None:
        """Answer ``index``'s task starts on its slot (each answer is a task, as llama-server's)."""
        view = self.native.view_for(item)
        if view is None or self.views.get(index) is view:
            return
        if index in self.views:
            self.views.pop(index).end()
        self.views[index] = view
        answer = self.answers[index]
        view.begin(answer.kind, answer.request, answer.parsed)

    def end_view(self, index: int | None = None) -> None:
        """The views of the answers still running (of answer ``index`` only) end."""
        for key in list(self.views) if index is None else [index]:
            view = self.views.pop(key, None)
            if view is not None:
                view.end()

    def step(self, step: Any) -> None:
        """One ``Step`` of the run (bankml/native/run.py): a token's chunk, a prompt's
        progress, or a prompt's summary."""
        answer = self.answers[step.index]
        self._begin(step.index, step.chunk or step.progress or step.summary)
        # llama-server's begin event of a later task (none where progress events went instead)
        begins = (
            step.index > 0
            and self.first_of_task[step.index]
            and self.stream
            and not answer.progress_sent
        )
        if step.progress is not None:
            self.events.write(answer.on_progress(step.progress))
            return
        if step.summary is None:
            view = self.views.get(step.index)
            if view is not None:
                view.on_chunk(step.chunk)
            events: list[Any] = answer.on_chunk(step.chunk)
            if begins and answer.n_tokens == 1:
                events = [None, *events]
            self.events.write(events)
            return
        summary = step.summary
        self.end_view(step.index)
        if summary.cancelled or gone(self.request):
            self.cancelled = True
            return
        if begins and answer.n_tokens == 0:
            self.events.write([None])
        self.problem = self.problem or self.native.identity_problem()
        if self.problem is not None:  # no receipt: the run stops here
            self.control.cancel()
            return
        if self.stream:
            self.events.write(answer.final_events(summary))
        else:
            self.results[step.index] = answer.whole(summary)
        model = getattr(getattr(answer.parsed, "served_by", None), "name", "")
        self.native.record(
            summary, answer.tally.ttft_ms(), answer.tally.wall_ms(), answer.kind, model
        )

    def end(self, _: Any = None) -> None:
        """The run is over (its Deferred fired): end the stream, or write the object(s)."""
        self.end_view()
        self.events.release()
        if self.problem is not None:
            self.events.error(503, self.problem)
            return
        if self.cancelled or gone(self.request):
            return
        if self.stream:
            # llama-server ends its /completion, Responses and Messages streams without [DONE]
            self.events.finish(b"" if self.kind in NO_DONE else b"data: [DONE]\n\n")
        else:
            results = [self.results[i] for i in sorted(self.results)]
            write_json(self.request, 200, dumps(merged(self.kind, results)))
