"""bankml's web page (bankml/web, resources/web.py) in a real browser: Debian's chromium driven
by Playwright against a real `bankml serve --native` signing with a key of the test's own.

The page chats (streamed, greedy, a few tokens), checks the answer's receipt in the browser
(``data-receipt="verified"``), and the files it offers pass ``bankml check-receipt``; an answer
changed on the way (one byte of its text, or one field of its receipt) is ``failed``, an answer
without a receipt or stopped (Escape) ``unsigned``; model text is shown as text, never run; the page asks nothing
of any other address. Regenerate replaces the last answer with one of its own receipt; the
conversations are kept in IndexedDB (what localStorage held moves there once); the model picker
lists /v1/models and the registry and loads the model chosen (the server has a second one to
pick: a copy of the default model pinned under another name); the load plot draws slots, queue,
memory and CPU; in front of a real P0 the page chats, verifies its receipts and says its
completion figure is not available there. Its canonical JSON is compared with bankml's own on awkward values.
Screenshots at desktop and phone width go to the test's tmp_path (their paths are printed).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import random
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from bankml.receipts.canonical import canonical_json, signed_bytes
from bankml.receipts.keys import keygen
from tests.bankml_process import check_receipt_cli, spawned_p0
from tests.native_server import NativeProcess, native_process
from tests.registry_support import pin_into

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
ANSWERED = 'li.assistant:not([data-receipt="checking"])'
READ_CONVERSATIONS = """async () => {
  await bankmlPage.saved();
  const db = await new Promise((ok, no) => {
    const r = indexedDB.open("bankml");
    r.onsuccess = () => ok(r.result);
    r.onerror = () => no(r.error);
  });
  const all = await new Promise((ok, no) => {
    const r = db.transaction("conversations").objectStore("conversations").getAll();
    r.onsuccess = () => ok(r.result);
    r.onerror = () => no(r.error);
  });
  db.close();
  return all.sort((a, b) => a.position - b.position);
}"""

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium (make test-deps installs it)"
)


@pytest.fixture(scope="module")
def server(
    default_model: Path, default_fork: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NativeProcess]:
    directory = tmp_path_factory.mktemp("web")
    key = keygen(directory / "key" / "receipt-key.pem")
    # a registry with the default model's pin and a second model to pick: a copy of it under
    # another name (one model is resident at a time; the picker loads the one chosen)
    registry = directory / "forks"
    registry.mkdir()
    (registry / default_fork.name).write_bytes(default_fork.read_bytes())
    shutil.copyfile(default_model, registry / "Smol-Copy.gguf")
    pin_into(registry, registry / "Smol-Copy.gguf")
    proc = native_process(default_model, default_fork, directory)
    proc.engine_args += ["--receipt-key", str(key.path), "--registry", str(registry)]
    with proc:
        yield proc


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


class Visit:
    """One page in its own browser context, with every request it made."""

    def __init__(self, browser: Any, url: str) -> None:
        self.context = browser.new_context(
            accept_downloads=True, viewport={"width": 1280, "height": 900}
        )
        self.page = self.context.new_page()
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)
        self.page.wait_for_selector("body[data-ready=true]", timeout=60_000)

    def settings(self, temperature: str, max_tokens: str) -> None:
        if not self.page.locator("#settings").evaluate("d => d.open"):
            self.page.click("#settings summary")
        self.page.fill("#temperature", temperature)
        self.page.fill("#max-tokens", max_tokens)

    def ask(self, prompt: str) -> Any:
        """Send ``prompt`` from the keyboard; the new answer once its receipt is checked."""
        before = self.page.locator(ANSWERED).count()
        self.page.fill("#prompt", prompt)
        self.page.press("#prompt", "Enter")
        self.page.wait_for_function(
            f"n => document.querySelectorAll('{ANSWERED}').length > n", arg=before, timeout=120_000
        )
        return self.page.locator(ANSWERED).last

    def stored(self) -> list[dict[str, Any]]:
        """The conversations as the page keeps them in IndexedDB, in their order."""
        kept: list[dict[str, Any]] = self.page.evaluate(READ_CONVERSATIONS)
        return kept

    def stored_answers(self) -> list[dict[str, Any]]:
        return [m for c in self.stored() for m in c["messages"] if m["role"] == "assistant"]

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="module")
def visit(browser: Any, server: NativeProcess) -> Iterator[Visit]:
    """The page at / of the engine address, greedy and short."""
    v = Visit(browser, server.engine_url + "/")
    v.settings("0", "8")
    yield v
    v.close()


def get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Content-Type": "application/json"} if method == "POST" else {}
        conn.request(method, path, b"{}" if method == "POST" else None, headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def sse_text(raw: str) -> str:
    """The answer's text as the stream carries it: every delta's content, joined."""
    text = ""
    for line in raw.split("\n"):
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
    return text


def test_the_page_and_its_files_are_served_with_a_strict_policy(server: NativeProcess) -> None:
    for port, path in (
        (server.engine_port, "/"),
        (server.engine_port, "/ui"),
        (server.port, "/ui"),
    ):
        status, headers, body = get(port, path)
        assert (status, headers["Content-Type"]) == (200, "text/html; charset=utf-8"), path
        policy = headers["Content-Security-Policy"]
        assert "default-src 'self'" in policy and "script-src 'self'" in policy
        assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert b'<script type="module" src="/ui/app.js"></script>' in body
        assert body.count(b"<script") == 1 and b"style=" not in body  # nothing inline
        assert b"http://" not in body and b"https://" not in body
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        status, headers, body = get(server.port, f"/ui/{name}")
        assert (status, headers["Content-Type"]) == (200, f"{kind}; charset=utf-8")
        assert b"http://" not in body and b"https://" not in body and b"innerHTML" not in body
    assert get(server.engine_port, "/", "POST")[0] == 404
    assert get(server.port, "/ui/other.js")[0] == 404
    # the page on the engine address reads the key there
    status, _, body = get(server.engine_port, "/bankml/key")
    assert status == 200 and json.loads(body) == server.get("/bankml/key")[1]


@pytest.fixture(scope="module")
def answered(visit: Visit) -> tuple[Any, str, str]:
    """The page's answer to one question (its element), and the stream as the server sent it
    (its Content-Type and body)."""
    with visit.page.expect_response("**/v1/chat/completions") as streamed:
        answer = visit.ask("Name a colour.")
    response = streamed.value
    return answer, response.headers["content-type"], response.body().decode()


def test_an_answer_streams_and_its_receipt_verifies(
    visit: Visit, answered: tuple[Any, str, str], tmp_path: Path
) -> None:
    page = visit.page
    answer, content_type, raw = answered
    assert content_type.startswith("text/event-stream")
    assert answer.get_attribute("data-receipt") == "verified", answer.inner_text()
    shown = visit.stored_answers()[0]
    assert shown["content"] == sse_text(raw) != ""
    assert shown["raw"] == raw
    assert answer.locator(".text").inner_text().strip() == shown["content"].strip()
    sent = json.loads(shown["request"])
    assert (sent["stream"], sent["temperature"], sent["max_tokens"]) == (True, 0, 8)
    assert sent["messages"][-1] == {"role": "user", "content": "Name a colour."}
    # the receipt's fields, and the three files bankml check-receipt takes
    answer.locator("details.receipt summary").click()
    assert "response_sha256" in answer.locator("details.receipt dl").inner_text()
    files = {}
    for label in ("request", "answer", "key"):
        with page.expect_download() as download:
            answer.get_by_role("button", name=f"Download {label}").click()
        path = tmp_path / download.value.suggested_filename
        download.value.save_as(path)
        files[label] = path.read_bytes()
    assert hashlib.sha256(files["request"]).hexdigest() in raw  # request_sha256
    status, out = check_receipt_cli(
        tmp_path, files["request"], files["answer"], files["key"].decode()
    )
    assert status == 0, out


def test_regenerate_replaces_the_last_answer_with_one_of_its_own_receipt(
    visit: Visit, answered: tuple[Any, str, str]
) -> None:
    page = visit.page
    before = visit.stored_answers()
    count = page.locator("li.assistant").count()
    page.locator("li.assistant").last.evaluate("e => { e.dataset.old = 'yes'; }")
    page.focus("#regenerate")
    page.keyboard.press("Enter")
    page.wait_for_function(
        "() => { const a = [...document.querySelectorAll('li.assistant')].at(-1);"
        " return !a.dataset.old && a.dataset.receipt !== 'checking'; }",
        timeout=120_000,
    )
    after = visit.stored_answers()
    assert page.locator("li.assistant").count() == count and len(after) == len(before)
    assert page.locator("li.assistant").last.get_attribute("data-receipt") == "verified"
    old, new = before[-1], after[-1]
    assert json.loads(new["request"])["messages"] == json.loads(old["request"])["messages"]
    receipts = [
        json.loads([x for x in a["raw"].split("\n") if '"bankml_receipt"' in x][-1][6:])[
            "bankml_receipt"
        ]
        for a in (old, new)
    ]
    assert receipts[0]["signature"] != receipts[1]["signature"]
    assert receipts[1]["response_sha256"] == hashlib.sha256(new["content"].encode()).hexdigest()


def alter(route: Any, change: Any) -> None:
    """Fetch the real answer, change it with ``change(events)``, and hand that to the page."""
    response = route.fetch()
    events = response.text().split("\n\n")
    route.fulfill(response=response, body="\n\n".join(change(events)))


def one_byte_of_the_text(events: list[str]) -> list[str]:
    out, done = [], False
    for event in events:
        if not done and event.startswith("data: {"):
            obj = json.loads(event[6:])
            delta = (obj.get("choices") or [{}])[0].get("delta") or {}
            text = delta.get("content") or ""
            if text and text[0] != "Q":
                delta["content"] = "Q" + text[1:]
                event, done = "data: " + json.dumps(obj, ensure_ascii=False), True
        out.append(event)
    assert done
    return out


def one_field_of_the_receipt(events: list[str]) -> list[str]:
    out = []
    for event in events:
        if event.startswith("data: {") and '"bankml_receipt"' in event:
            obj = json.loads(event[6:])
            obj["bankml_receipt"]["completion_tokens"] += 1
            event = "data: " + json.dumps(obj, ensure_ascii=False)
        out.append(event)
    return out


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (one_byte_of_the_text, "response_sha256"),
        (one_field_of_the_receipt, "signature does not verify"),
    ],
)
def test_an_answer_changed_on_the_way_fails(
    visit: Visit, answered: tuple[Any, str, str], change: Any, reason: str
) -> None:
    page = visit.page
    page.route("**/v1/chat/completions", lambda route: alter(route, change))
    try:
        answer = visit.ask("Name a fruit.")
    finally:
        page.unroute("**/v1/chat/completions")
    assert answer.get_attribute("data-receipt") == "failed"
    assert "✗" in answer.locator("details.receipt summary").inner_text()
    assert reason in answer.locator("details.receipt ul").text_content()


def test_model_text_is_shown_never_run_and_an_answer_without_receipt_is_unsigned(
    visit: Visit,
) -> None:
    page = visit.page
    hostile = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'
    chunks = [
        {"choices": [{"index": 0, "delta": {"reasoning_content": "thinking <b>hard</b>"}}]},
        {"choices": [{"index": 0, "delta": {"content": hostile + "\n```\n<i>code</i>\n```"}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "c1",
                                "type": "function",
                                "function": {"name": "lookup", "arguments": '{"q":"<x>"}'},
                            }
                        ]
                    },
                }
            ]
        },
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=body),
    )
    try:
        answer = visit.ask("Anything.")
    finally:
        page.unroute("**/v1/chat/completions")
    assert answer.get_attribute("data-receipt") == "unsigned"
    assert hostile in answer.locator(".text").inner_text()
    assert answer.locator(".text img, .text script, .text i, .reasoning b").count() == 0
    assert answer.locator(".text pre code").inner_text() == "<i>code</i>"
    assert page.evaluate("window.pwned") is None
    reasoning = answer.locator("details.reasoning")
    assert reasoning.evaluate("d => d.open") is False
    assert reasoning.locator("div").text_content() == "thinking <b>hard</b>"
    assert answer.locator("ol.calls").inner_text().strip() == 'lookup({"q":"<x>"})'


def test_escape_stops_an_answer_which_is_then_unsigned(visit: Visit) -> None:
    """A long answer (the request made to ignore end of text on the way) stopped from the
    keyboard once it has begun: what came is kept, with no receipt."""
    page = visit.page

    def longer(route: Any) -> None:
        body = json.loads(route.request.post_data)
        route.continue_(post_data=json.dumps({**body, "max_tokens": 512, "ignore_eos": True}))

    page.route("**/v1/chat/completions", longer)
    try:
        before = page.locator("li.assistant").count()
        page.fill("#prompt", "Count to ten.")
        page.press("#prompt", "Enter")
        page.wait_for_function(
            "n => (document.querySelectorAll('li.assistant')[n]?.querySelector('.text')"
            "?.textContent || '').length > 0",
            arg=before,
        )
        assert page.is_enabled("#stop")
        page.keyboard.press("Escape")
        answer = page.locator("li.assistant").nth(before)
        page.wait_for_function("e => e.dataset.receipt !== 'checking'", arg=answer.element_handle())
    finally:
        page.unroute("**/v1/chat/completions")
    assert answer.get_attribute("data-receipt") == "unsigned"
    assert "stopped before the end" in answer.locator("details.receipt").text_content()
    assert page.text_content("#status") == "Stopped." and not page.is_enabled("#stop")
    assert visit.stored_answers()[-1]["stopped"] is True


def test_export_and_import_check_the_receipts_again(
    visit: Visit, answered: tuple[Any, str, str], tmp_path: Path
) -> None:
    page = visit.page
    with page.expect_download() as download:
        page.click("#export")
    exported = tmp_path / "conversations.json"
    download.value.save_as(exported)
    doc = json.loads(exported.read_text())
    assert doc["format"] == "bankml-conversations"
    marks = [a.get_attribute("data-receipt") for a in page.locator(ANSWERED).all()]
    assert "verified" in marks
    page.set_input_files("#import", str(exported))
    page.wait_for_function(
        "n => document.querySelectorAll('li.assistant:not([data-receipt=checking])').length"
        " === n && document.getElementById('conversation').options.length > 1",
        arg=len(marks),
    )
    assert [a.get_attribute("data-receipt") for a in page.locator(ANSWERED).all()] == marks


def test_conversations_in_localstorage_move_to_indexeddb_once(
    browser: Any, visit: Visit, answered: tuple[Any, str, str], server: NativeProcess
) -> None:
    """What a page kept in localStorage (its format: a JSON list of conversations) is moved to
    IndexedDB on the next load, and its answers are checked again there."""
    kept = [c for c in visit.stored() if any(m["role"] == "assistant" for m in c["messages"])][:1]
    kept = [{k: v for k, v in c.items() if k != "position"} for c in kept]
    v = Visit(browser, server.engine_url + "/")  # a browser context of its own
    try:
        page = v.page
        page.evaluate("t => localStorage.setItem('bankml.conversations.v1', t)", json.dumps(kept))
        page.reload()
        page.wait_for_selector("body[data-ready=true]", timeout=60_000)
        assert page.evaluate("localStorage.getItem('bankml.conversations.v1')") is None
        assert "moved from localStorage to IndexedDB" in page.text_content("#status")
        moved = v.stored()[-1]
        assert [m.get("raw") for m in moved["messages"]] == [
            m.get("raw") for m in kept[0]["messages"]
        ]
        page.select_option("#conversation", moved["id"])
        n = sum(m["role"] == "assistant" for m in moved["messages"])
        page.wait_for_function(f"n => document.querySelectorAll('{ANSWERED}').length === n", arg=n)
        marks = {a.get_attribute("data-receipt") for a in page.locator(ANSWERED).all()}
        assert "verified" in marks
        page.reload()  # once: nothing moves again, nothing doubles
        page.wait_for_selector("body[data-ready=true]", timeout=60_000)
        assert len(v.stored()) == 1 and "moved" not in page.text_content("#status")
        assert v.errors == []
    finally:
        v.close()


def test_the_model_picker_lists_v1_and_the_registry_and_switches(
    browser: Any, server: NativeProcess
) -> None:
    """At /ui of the listen address the picker lists /v1/models and the registry (/api/tags);
    a registry model that is not resident is loaded when chosen, and its name goes in the
    request; the answer is verified as any other. The engine address has no registry: it
    lists /v1/models only."""
    v1 = [m["id"] for m in server.get("/v1/models")[1]["data"]]
    tags = [m["name"] for m in server.get("/api/tags")[1]["models"]]
    assert "smol-copy:latest" in tags and len(tags) == 2
    v = Visit(browser, server.url + "/ui")
    try:
        page = v.page
        v.settings("0", "4")
        listed = page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
        assert listed == v1 + tags and page.input_value("#model") == v1[0]
        # the picker's label as it stands when the status line first says "loaded": the
        # picker is refreshed before the status line speaks, so the two never disagree
        page.evaluate(
            """() => new MutationObserver((changes, observer) => {
                if (!document.getElementById('status').textContent.includes('loaded')) return;
                const picker = document.getElementById('model');
                window.labelWhenLoaded = picker.selectedOptions[0].textContent;
                observer.disconnect();
            }).observe(document.getElementById('status'), {childList: true, subtree: true,
                                                          characterData: true})"""
        )
        page.select_option("#model", "smol-copy:latest")
        page.wait_for_function(
            "() => document.getElementById('status').textContent.includes('loaded')",
            timeout=120_000,
        )
        assert page.text_content("#status") == "smol-copy:latest loaded."
        resident = [m["name"] for m in server.get("/api/ps")[1]["models"]]
        assert resident == ["smol-copy:latest"]
        label = page.evaluate("() => window.labelWhenLoaded")
        assert label.startswith("smol-copy:latest (registry, loaded"), label
        answer = v.ask("Name a colour.")
        assert answer.get_attribute("data-receipt") == "verified", answer.inner_text()
        sent = json.loads(v.stored_answers()[-1]["request"])
        assert sent["model"] == "smol-copy:latest"
        assert "Answer · smol-copy:latest" in answer.inner_text()
        # back to the startup model, by its registry name, for the tests after this one
        startup = next(t for t in tags if t != "smol-copy:latest")
        page.select_option("#model", startup)
        page.wait_for_function(
            "() => document.getElementById('status').textContent.endsWith('loaded.')",
            timeout=120_000,
        )
        assert [m["name"] for m in server.get("/api/ps")[1]["models"]] == [startup]
        assert v.errors == []
    finally:
        v.close()
    engine = Visit(browser, server.engine_url + "/")
    try:
        listed = engine.page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
        assert listed == v1
    finally:
        engine.close()


def test_the_usage_plot_shows_the_engines_records(
    visit: Visit, answered: tuple[Any, str, str], server: NativeProcess
) -> None:
    page = visit.page
    page.wait_for_function(
        "() => document.getElementById('usage-text').textContent.includes('completions kept')",
        timeout=20_000,
    )
    text = page.text_content("#usage-text")
    shown = int(re.search(r"\((\d+) completions kept\)", text).group(1))
    assert "tokens/s" in text and 1 <= shown <= server.get("/bankml/metrics")[1]["kept"]
    drawn = page.evaluate(
        "() => { const c = document.getElementById('usage-plot');"
        " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        " let n = 0; for (let k = 3; k < d.length; k += 4) n += d[k] > 0; return n; }"
    )
    assert drawn > 0


LOAD_SERIES = ["slots", "queue", "memory", "cpu"]


def test_the_load_plot_draws_slots_queue_memory_and_cpu(
    visit: Visit, answered: tuple[Any, str, str], server: NativeProcess
) -> None:
    """From /slots, /metrics and /bankml/usage of the engine address, one sample a poll."""
    page = visit.page
    # the panels once each series has two points and a last value (read in the same turn)
    panels = page.wait_for_function(
        "() => { const gs = [...document.querySelectorAll('#load-plot g.panel')];"
        " const ok = gs.length === 4 && gs.every(g => g.dataset.last"
        " && g.querySelector('polyline')?.points.numberOfItems >= 2);"
        " return ok && gs.map(g => [g.dataset.series, g.dataset.last, g.textContent]); }",
        timeout=30_000,
    ).json_value()
    assert [p[0] for p in panels] == LOAD_SERIES, panels
    last = {series: float(value) for series, value, _ in panels}
    text = {series: said for series, _, said in panels}
    status, _, body = get(server.engine_port, "/slots")
    slots = json.loads(body)
    assert status == 200 and 0 <= last["slots"] <= len(slots)
    assert f"of {len(slots)}" in text["slots"] and last["queue"] >= 0
    total = server.get("/bankml/usage")[1]["mem_total_bytes"] / 2**20
    assert 0 < last["memory"] < total and "MiB" in text["memory"]
    assert last["cpu"] >= 0 and "% of a core" in text["cpu"]
    assert server.get("/bankml/metrics")[1]["measured"] is True


def test_in_front_of_p0_the_page_chats_and_verifies_its_receipts(
    browser: Any,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path: Path,
) -> None:
    """The page at /ui of a real P0 (bankml in front of the llama-server it spawned, signing):
    an answer streams through P0 and its receipt verifies in the browser; the page says its
    completion figure is not available in P0 mode (P0 keeps no records for it) and asks
    nothing of another address."""
    key = keygen(tmp_path / "key" / "receipt-key.pem")
    log = tmp_path / "p0.log"
    with spawned_p0(key, default_model, default_fork, llama_server_bin, log, ["--metrics"]) as p0:
        v = Visit(browser, p0.url + "/ui")
        try:
            v.settings("0", "8")
            answer = v.ask("Name a colour.")
            assert answer.get_attribute("data-receipt") == "verified", answer.inner_text()
            v.page.wait_for_function(
                "() => document.getElementById('usage-text').textContent.includes('P0')",
                timeout=20_000,
            )
            assert "not available in P0 mode" in v.page.text_content("#usage-text")
            origin = urlsplit(p0.url).netloc
            assert v.requests and all(urlsplit(u).netloc == origin for u in v.requests)
            assert not v.errors
        finally:
            v.close()


def test_the_page_asks_nothing_of_another_address(visit: Visit, server: NativeProcess) -> None:
    assert visit.requests
    origin = urlsplit(server.engine_url).netloc
    elsewhere = [
        url
        for url in visit.requests
        if not (
            (urlsplit(url).scheme == "http" and urlsplit(url).netloc == origin)
            or url.startswith(f"blob:{server.engine_url}/")
        )
    ]
    assert elsewhere == []
    assert visit.errors == []


def test_the_listen_address_serves_it_at_ui_accessible_at_phone_width_and_in_the_dark(
    browser: Any, server: NativeProcess, tmp_path: Path
) -> None:
    v = Visit(browser, server.url + "/ui")
    try:
        page = v.page
        assert page.text_content("#key-id") == server.get("/bankml/key")[1]["keyid"]
        assert page.input_value("#model") not in ("", "unknown")
        unlabelled = page.evaluate(
            "() => [...document.querySelectorAll('input, select, textarea, canvas')]"
            ".filter(e => !(e.labels?.length || e.getAttribute('aria-label'))).map(e => e.id)"
        )
        assert unlabelled == []
        page.wait_for_selector("#load-plot g.panel")  # a first sample drawn, for the screenshots
        shots = []
        for name, size in (("desktop", (1280, 900)), ("phone", (390, 844))):
            page.set_viewport_size({"width": size[0], "height": size[1]})
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
            shots.append(tmp_path / f"web-page-{name}.png")
            page.screenshot(path=str(shots[-1]), full_page=True)
        backgrounds = []
        for scheme in ("light", "dark"):
            page.emulate_media(color_scheme=scheme)
            backgrounds.append(page.evaluate("getComputedStyle(document.body).backgroundColor"))
        assert backgrounds[0] != backgrounds[1]
        page.keyboard.press("Tab")  # the first stop is the skip link, then the controls
        assert page.evaluate("document.activeElement.className") == "skip"
        print("screenshots:", *shots)
        assert v.errors == []
    finally:
        v.close()


def awkward_values() -> list[Any]:
    rng = random.Random(7)
    doubles = [struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0] for _ in range(300)]
    doubles = [d for d in doubles if d == d and abs(d) != float("inf")]
    return [
        {"b": 1, "a": [1.0, 2.5, -0.0, 1e16, 1e-7, 0.1, 9007199254740993, 2**64 + 1]},
        {"\U0001f600": 1, "\ufb01": 2, "z": 3, "é": 4, "A": 5},
        {"s": 'tab\tnew\nline\x00\x1f\x7f \u2028 "q" \\ é 😀', "": None, "t": True},
        {"deep": [[{"x": [0.30000000000000004, 123456789.125, 5e-324]}]]},
        doubles,
    ]


def test_the_pages_canonical_json_is_bankmls(visit: Visit, answered: tuple[Any, str, str]) -> None:
    texts = [json.dumps(v, ensure_ascii=False) for v in awkward_values()]
    # and a real receipt, with the bytes its signature covers
    raw = answered[2]
    last = [line for line in raw.split("\n") if '"bankml_receipt"' in line][-1]
    receipt = json.loads(last[6:])["bankml_receipt"]
    texts.append(json.dumps(receipt))
    got = visit.page.evaluate("ts => ts.map(t => bankmlPage.canonicalFromText(t))", texts)
    assert [g.encode() for g in got] == [canonical_json(json.loads(t)) for t in texts]
    signed = visit.page.evaluate(
        "t => bankmlPage.signedText(bankmlPage.parseLossless(t))", json.dumps(receipt)
    )
    assert signed.encode() == signed_bytes(receipt)
