// bankml's web page: a chat with the served model that checks every answer's signed receipt in
// the browser (docs/modules/web.md). Nothing is fetched but this address; model text is only
// ever put into the page as text (textContent), never parsed as HTML nor run.

// --- canonical JSON: the bytes a receipt's signature covers (bankml/receipts/canonical.py) ---

export const CONTEXT = "bankml-receipt-v2\n";
const EXACT_INT_LIMIT = 2 ** 53;

// A JSON number kept as the text it was written as, so that an integer beyond 2**53 stays exact.
export class RawNumber {
  constructor(text) {
    this.text = text;
  }
}

const WS = /[ \t\n\r]*/y;
const NUMBER = /-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/y;
const STRING = /"(?:[^"\\\u0000-\u001f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"/y;

// JSON.parse, but numbers are RawNumber and objects have no prototype (a "__proto__" key is
// an ordinary key); a repeated key keeps its last value, as Python's json.loads does.
export function parseLossless(text) {
  let i = 0;
  const fail = (what) => {
    throw new SyntaxError(`JSON: ${what} at offset ${i}`);
  };
  const skip = () => {
    WS.lastIndex = i;
    WS.exec(text);
    i = WS.lastIndex;
  };
  const token = (re) => {
    re.lastIndex = i;
    const m = re.exec(text);
    if (!m) return null;
    i = re.lastIndex;
    return m[0];
  };
  const value = (depth) => {
    if (depth > 512) fail("nested too deep");
    skip();
    const c = text[i];
    if (c === "{") {
      i++;
      const obj = Object.create(null);
      skip();
      if (text[i] === "}") {
        i++;
        return obj;
      }
      for (;;) {
        skip();
        const key = token(STRING);
        if (key === null) fail("a key expected");
        skip();
        if (text[i] !== ":") fail("':' expected");
        i++;
        obj[JSON.parse(key)] = value(depth + 1);
        skip();
        if (text[i] === ",") {
          i++;
        } else if (text[i] === "}") {
          i++;
          return obj;
        } else {
          fail("',' or '}' expected");
        }
      }
    }
    if (c === "[") {
      i++;
      const list = [];
      skip();
      if (text[i] === "]") {
        i++;
        return list;
      }
      for (;;) {
        list.push(value(depth + 1));
        skip();
        if (text[i] === ",") {
          i++;
        } else if (text[i] === "]") {
          i++;
          return list;
        } else {
          fail("',' or ']' expected");
        }
      }
    }
    if (c === '"') return JSON.parse(token(STRING) ?? fail("a bad string"));
    for (const [word, literal] of [["true", true], ["false", false], ["null", null]]) {
      if (text.startsWith(word, i)) {
        i += word.length;
        return literal;
      }
    }
    const number = token(NUMBER);
    if (number === null) fail("a value expected");
    return new RawNumber(number);
  };
  const out = value(0);
  skip();
  if (i !== text.length) fail("text after the value");
  return out;
}

// The shortest decimal that reads back as x, written as Python's repr(float) writes it.
export function pyFloatRepr(x) {
  if (!Number.isFinite(x)) throw new RangeError("NaN and the infinities are not JSON");
  const sign = x < 0 || Object.is(x, -0) ? "-" : "";
  // Number's own shortest round-trip digits (ECMA-262 Number::toString), in any of its forms
  const m = /^(\d+)(?:\.(\d+))?(?:e([+-]\d+))?$/.exec(String(Math.abs(x)));
  const all = m[1] + (m[2] ?? "");
  const point = m[1].length + Number(m[3] ?? 0); // where the decimal point falls in `all`
  const lead = all.length - all.replace(/^0+/, "").length;
  const digits = all.slice(lead).replace(/0+$/, "") || "0";
  const exp = digits === "0" ? 0 : point - lead - 1; // the first digit's power of ten
  let out;
  if (exp < -4 || exp >= 16) {
    const mantissa = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    out = `${mantissa}e${exp < 0 ? "-" : "+"}${String(Math.abs(exp)).padStart(2, "0")}`;
  } else if (exp >= 0) {
    out = `${digits.slice(0, exp + 1).padEnd(exp + 1, "0")}.${digits.slice(exp + 1) || "0"}`;
  } else {
    out = `0.${"0".repeat(-exp - 1)}${digits}`;
  }
  return sign + out;
}

function canonicalDouble(x) {
  if (!Number.isFinite(x)) throw new RangeError("NaN and the infinities are not JSON");
  if (Number.isInteger(x) && Math.abs(x) < EXACT_INT_LIMIT) return String(x); // -0 too: "0"
  return pyFloatRepr(x);
}

function canonicalNumber(text) {
  if (/^-?[0-9]+$/.test(text)) return BigInt(text).toString(); // an integer, any size
  return canonicalDouble(Number(text));
}

// Python sorts str keys by code point; JavaScript's default sort compares UTF-16 units.
function compareCodePoints(a, b) {
  const A = Array.from(a, (c) => c.codePointAt(0));
  const B = Array.from(b, (c) => c.codePointAt(0));
  for (let k = 0; k < Math.min(A.length, B.length); k++) {
    if (A[k] !== B[k]) return A[k] - B[k];
  }
  return A.length - B.length;
}

const jsonString = (s) => JSON.stringify(s).replace(/\u007f/g, "\\u007f");

// bankml's canonical JSON: keys sorted, no whitespace, an integral number as an integer, any
// other as the shortest repr, strings as JSON writes them plus DEL as \u007f.
export function canonicalJson(v) {
  if (v === null) return "null";
  if (v === true) return "true";
  if (v === false) return "false";
  if (v instanceof RawNumber) return canonicalNumber(v.text);
  if (typeof v === "number") return canonicalDouble(v);
  if (typeof v === "string") return jsonString(v);
  if (Array.isArray(v)) return `[${v.map(canonicalJson).join(",")}]`;
  if (typeof v === "object") {
    const keys = Object.keys(v).sort(compareCodePoints);
    return `{${keys.map((k) => `${jsonString(k)}:${canonicalJson(v[k])}`).join(",")}}`;
  }
  throw new TypeError(`not JSON: ${typeof v}`);
}

export const canonicalFromText = (text) => canonicalJson(parseLossless(text));

// The bytes the signature covers: the context line, then the receipt without its signature
// and envelope.
export function signedText(receipt) {
  const rest = Object.create(null);
  for (const k of Object.keys(receipt)) {
    if (k !== "signature" && k !== "envelope") rest[k] = receipt[k];
  }
  return CONTEXT + canonicalJson(rest);
}

// --- hashes, the key, and checking one answer ---

const utf8 = new TextEncoder();

function hex(buffer) {
  return Array.from(new Uint8Array(buffer), (b) => b.toString(16).padStart(2, "0")).join("");
}

export async function sha256Hex(text) {
  const bytes = typeof text === "string" ? utf8.encode(text) : text;
  return hex(await crypto.subtle.digest("SHA-256", bytes));
}

function base64Bytes(text) {
  const binary = atob(text);
  return Uint8Array.from(binary, (c) => c.charCodeAt(0));
}

function pemBytes(pem) {
  const m = /-----BEGIN PUBLIC KEY-----([A-Za-z0-9+/=\s]+)-----END PUBLIC KEY-----/.exec(pem);
  if (!m) throw new Error("not a PEM public key");
  return base64Bytes(m[1].replace(/\s+/g, ""));
}

// The receipt key from its PEM: the WebCrypto key, and its id (the sha256 of the raw 32-byte
// public key, the last 32 bytes of the SubjectPublicKeyInfo).
export async function importReceiptKey(pem) {
  const der = pemBytes(pem);
  const key = await crypto.subtle.importKey("spki", der, { name: "Ed25519" }, false, ["verify"]);
  return { key, keyid: await sha256Hex(der.slice(-32)), pem };
}

// Each tool call as the receipt hashes it: {"id", "type", "name", "arguments"} in call order.
export const toolCallsJson = (calls) =>
  JSON.stringify(
    calls.map((c) => ({ id: c.id, type: c.type, name: c.name, arguments: c.arguments })),
  );

// The receipt of a stream as it came: the bankml_receipt of its last event that carries one
// (numbers as written), or null.
export function receiptOf(raw) {
  let found = null;
  for (const line of (raw || "").split("\n")) {
    if (line.startsWith("data: {") && line.includes('"bankml_receipt"')) {
      const event = parseLossless(line.slice(6));
      if (event.bankml_receipt && typeof event.bankml_receipt === "object") {
        found = event.bankml_receipt;
      }
    }
  }
  return found;
}

// One answer against its receipt: "verified", "failed" (with every reason) or "unsigned".
// `answer` holds what the page shows and sent: content, reasoning, toolCalls, request (the
// exact body) and raw (the stream as received).
export async function checkAnswer(answer, receiptKey) {
  let receipt;
  try {
    receipt = receiptOf(answer.raw);
  } catch (err) {
    return { status: "failed", reasons: [`the receipt is not JSON: ${err.message}`], receipt: null };
  }
  if (receipt === null) {
    const why = answer.stopped ? "stopped before the end" : "the answer carries no receipt";
    return { status: "unsigned", reasons: [why], receipt: null };
  }
  if (typeof receipt.signature !== "string" || receipt.signed !== true) {
    return { status: "unsigned", reasons: ["the receipt is not signed"], receipt };
  }
  const reasons = [];
  const expect = async (field, text, what) => {
    if (receipt[field] === undefined && !text) return;
    if (receipt[field] !== (await sha256Hex(text || ""))) {
      reasons.push(`${field} is not the sha256 of ${what}`);
    }
  };
  if (!receiptKey) {
    reasons.push("no public key to check the signature with (GET /bankml/key)");
  } else {
    if (receipt.alg !== "ed25519") reasons.push(`alg is ${JSON.stringify(receipt.alg)}`);
    if (receipt.keyid !== receiptKey.keyid) reasons.push("keyid is not the served key's id");
    let good = false;
    try {
      const signed = utf8.encode(signedText(receipt));
      const sig = base64Bytes(receipt.signature);
      good = await crypto.subtle.verify({ name: "Ed25519" }, receiptKey.key, sig, signed);
    } catch (err) {
      reasons.push(`the signature cannot be checked: ${err.message}`);
    }
    if (!good) reasons.push("the signature does not verify");
  }
  if (receipt.request_sha256 !== (await sha256Hex(answer.request || ""))) {
    reasons.push("request_sha256 is not the sha256 of the request sent");
  }
  if (receipt.response_sha256 !== (await sha256Hex(answer.content || ""))) {
    reasons.push("response_sha256 is not the sha256 of the answer's text");
  }
  await expect("reasoning_sha256", answer.reasoning, "the reasoning shown");
  const calls = answer.toolCalls || [];
  await expect("tool_calls_sha256", calls.length ? toolCallsJson(calls) : "", "the tool calls");
  return { status: reasons.length ? "failed" : "verified", reasons, receipt };
}

// --- safe rendering: model text goes in as text nodes only ---

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) {
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
  }
  return node;
}

// A small Markdown subset: ``` fenced code blocks and `inline code` (shown as text), paragraphs
// split on blank lines; everything else is the text as written.
export function renderText(container, text) {
  const blocks = [];
  let paragraph = [];
  let code = null;
  const flush = () => {
    if (paragraph.length) blocks.push(el("p", {}, ...inlineCode(paragraph.join("\n"))));
    paragraph = [];
  };
  for (const line of text.split("\n")) {
    if (line.startsWith("```")) {
      if (code === null) {
        flush();
        code = [];
      } else {
        blocks.push(el("pre", {}, el("code", {}, code.join("\n"))));
        code = null;
      }
    } else if (code !== null) {
      code.push(line);
    } else if (line.trim() === "") {
      flush();
    } else {
      paragraph.push(line);
    }
  }
  if (code !== null) blocks.push(el("pre", {}, el("code", {}, code.join("\n"))));
  flush();
  container.replaceChildren(...blocks);
}

function inlineCode(text) {
  return text.split("`").map((part, k) => (k % 2 ? el("code", {}, part) : part));
}

// --- the server ---

const settings = { apiKey: sessionStorage.getItem("bankml.apiKey") || "" };

function headers(extra = {}) {
  return settings.apiKey ? { ...extra, Authorization: `Bearer ${settings.apiKey}` } : extra;
}

async function getJson(path) {
  const res = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!res.ok) throw new Error(`${path}: HTTP ${res.status}`);
  return res.json();
}

function errorText(status, body) {
  try {
    const message = JSON.parse(body)?.error?.message;
    if (message) return `HTTP ${status}: ${message}`;
  } catch {
    // not JSON: the status says it
  }
  return `HTTP ${status}`;
}

// One streamed chat completion: calls onUpdate(answer) as it grows; resolves with the answer.
async function streamChat(answer, signal, onUpdate) {
  const res = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: utf8.encode(answer.request),
    signal,
    cache: "no-store",
  });
  if (!res.ok) throw new Error(errorText(res.status, await res.text()));
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  const calls = new Map();
  let pending = "";
  const take = (line) => {
    if (!line.startsWith("data: ") || line === "data: [DONE]") return;
    const event = JSON.parse(line.slice(6));
    if (event.error) throw new Error(event.error.message || "the server stopped the answer");
    const delta = event.choices?.[0]?.delta;
    if (!delta) return;
    if (typeof delta.content === "string") answer.content += delta.content;
    if (typeof delta.reasoning_content === "string") answer.reasoning += delta.reasoning_content;
    for (const [position, entry] of (delta.tool_calls || []).entries()) {
      const index = Number.isInteger(entry.index) ? entry.index : position;
      if (!calls.has(index)) calls.set(index, { id: "", type: "", name: "", arguments: "" });
      const call = calls.get(index);
      call.id ||= typeof entry.id === "string" ? entry.id : "";
      call.type ||= typeof entry.type === "string" ? entry.type : "";
      if (typeof entry.function?.name === "string") call.name += entry.function.name;
      if (typeof entry.function?.arguments === "string") call.arguments += entry.function.arguments;
    }
    answer.toolCalls = [...calls.keys()].sort((a, b) => a - b).map((k) => calls.get(k));
  };
  for (;;) {
    const { value, done } = await reader.read();
    const text = done ? decoder.decode() : decoder.decode(value, { stream: true });
    answer.raw += text;
    pending += text;
    const lines = pending.split("\n");
    pending = done ? "" : lines.pop();
    for (const line of lines) take(line.replace(/\r$/, ""));
    onUpdate(answer);
    if (done) return answer;
  }
}

// --- conversations, kept in this browser (IndexedDB) ---

const STORE = "bankml.conversations.v1";
const SETTINGS = "bankml.settings.v1";
const MARKS = { verified: "✓", failed: "✗", unsigned: "–", checking: "…" };
const SAYS = {
  verified: "Receipt verified",
  failed: "Receipt check failed",
  unsigned: "No signed receipt",
  checking: "Checking the receipt…",
};

const state = {
  conversations: [],
  current: null,
  receiptKey: null,
  model: "",
  busy: null,
  db: null,
  totalSlots: null,
  models: [],
  loading: false,
};
const $ = (id) => document.getElementById(id);
const newId = () => `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
const str = (v) => (typeof v === "string" ? v : "");

function say(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

// A stored or imported message, keeping only the fields the page knows, each of its type.
function cleanMessage(m) {
  if (!m || (m.role !== "user" && m.role !== "assistant")) return null;
  const out = { role: m.role, content: str(m.content) };
  if (m.role === "assistant") {
    Object.assign(out, {
      reasoning: str(m.reasoning),
      request: str(m.request),
      raw: str(m.raw),
      error: str(m.error),
      stopped: m.stopped === true,
      toolCalls: (Array.isArray(m.toolCalls) ? m.toolCalls : []).map((c) => ({
        id: str(c?.id),
        type: str(c?.type),
        name: str(c?.name),
        arguments: str(c?.arguments),
      })),
    });
  }
  return out;
}

function cleanConversation(c) {
  if (!c || !Array.isArray(c.messages)) return null;
  return {
    id: newId(),
    title: str(c.title).slice(0, 80) || "Conversation",
    created: str(c.created) || new Date().toISOString(),
    messages: c.messages.map(cleanMessage).filter(Boolean),
  };
}

// IndexedDB "bankml", store "conversations": one record per conversation (keyPath "id", its
// place in the list as "position"). What an older page kept in localStorage moves here once.
const DB_NAME = "bankml";
const DB_STORE = "conversations";

function openDb() {
  return new Promise((resolve, reject) => {
    const opening = indexedDB.open(DB_NAME, 1);
    opening.onupgradeneeded = () => opening.result.createObjectStore(DB_STORE, { keyPath: "id" });
    opening.onsuccess = () => resolve(opening.result);
    opening.onerror = () => reject(opening.error);
  });
}

const finished = (tx) =>
  new Promise((resolve, reject) => {
    tx.oncomplete = () => resolve();
    tx.onerror = () => reject(tx.error);
    tx.onabort = () => reject(tx.error || new Error("the write was aborted"));
  });

async function readConversations(db) {
  const tx = db.transaction(DB_STORE, "readonly");
  const all = tx.objectStore(DB_STORE).getAll();
  await finished(tx);
  return all.result.sort((a, b) => (a.position ?? 0) - (b.position ?? 0));
}

async function writeConversations(db, list) {
  const tx = db.transaction(DB_STORE, "readwrite");
  const store = tx.objectStore(DB_STORE);
  store.clear();
  list.forEach((c, position) => store.put({ ...c, position }));
  await finished(tx);
}

function parseStored(text) {
  try {
    const saved = JSON.parse(text || "[]");
    return (Array.isArray(saved) ? saved : []).map(cleanConversation).filter(Boolean);
  } catch {
    return [];
  }
}

async function load() {
  try {
    state.db = await openDb();
    state.conversations = (await readConversations(state.db))
      .map(cleanConversation)
      .filter(Boolean);
    const old = localStorage.getItem(STORE);
    if (old !== null) {
      const moved = parseStored(old);
      state.conversations.push(...moved);
      await writeConversations(state.db, state.conversations);
      localStorage.removeItem(STORE);
      if (moved.length) say(`${moved.length} conversation(s) moved from localStorage to IndexedDB.`);
    }
  } catch (err) {
    state.db = null;
    state.conversations = parseStored(localStorage.getItem(STORE));
    say(`IndexedDB is not available (${err.message}); conversations kept in localStorage.`, true);
  }
  if (!state.conversations.length) state.conversations.push(cleanConversation({ messages: [] }));
  state.current = state.conversations[0].id;
}

// Writes go one after another, each the list as it stands when it is asked for.
let saving = Promise.resolve();

function save() {
  const list = structuredClone(state.conversations);
  saving = saving
    .then(() => {
      if (state.db) return writeConversations(state.db, list);
      localStorage.setItem(STORE, JSON.stringify(list));
    })
    .catch((err) => say(`The conversations could not be kept: ${err.message}`, true));
  return saving;
}

const current = () => state.conversations.find((c) => c.id === state.current);

function fillConversationList() {
  const list = $("conversation");
  list.replaceChildren(
    ...state.conversations.map((c) => {
      const option = el("option", { value: c.id }, c.title);
      option.selected = c.id === state.current;
      return option;
    }),
  );
}

function download(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const link = el("a", { href: url, download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

function renderUser(message) {
  const text = el("div", { class: "text" });
  renderText(text, message.content);
  return el("li", { class: "message user" }, el("p", { class: "who" }, "You"), text);
}

function modelOf(message) {
  try {
    return str(JSON.parse(message.request || "{}")?.model);
  } catch {
    return "";
  }
}

function renderAnswer(message) {
  const item = el("li", { class: "message assistant", "data-receipt": "checking" });
  const model = modelOf(message) || state.model;
  item.append(el("p", { class: "who" }, model ? `Answer · ${model}` : "Answer"));
  fillAnswer(item, message);
  return item;
}

// The answer's parts as they stand (called again while it streams).
function fillAnswer(item, message) {
  const who = item.firstChild;
  const keep = item.querySelector(":scope > details.reasoning");
  const open = keep ? keep.open : false;
  const parts = [who];
  if (message.reasoning) {
    const reasoning = el("details", { class: "reasoning" }, el("summary", {}, "Reasoning"));
    reasoning.open = open;
    reasoning.append(el("div", {}, message.reasoning));
    parts.push(reasoning);
  }
  const text = el("div", { class: "text" });
  renderText(text, message.content);
  parts.push(text);
  if (message.toolCalls?.length) {
    const calls = el("ol", { class: "calls", "aria-label": "Tool calls" });
    for (const call of message.toolCalls) {
      calls.append(el("li", {}, el("code", {}, `${call.name}(${call.arguments})`)));
    }
    parts.push(el("p", { class: "who" }, "Tool calls"), calls);
  }
  if (message.error) parts.push(el("p", { class: "error" }, `Error: ${message.error}`));
  const receipt = item.querySelector(":scope > details.receipt");
  if (receipt) parts.push(receipt);
  item.replaceChildren(...parts);
}

function showCheck(item, message, check) {
  item.dataset.receipt = check.status;
  const summary = el(
    "summary",
    {},
    el("span", { class: "mark", "aria-hidden": "true" }, MARKS[check.status]),
    ` ${SAYS[check.status]}`,
  );
  const details = el("details", { class: "receipt" }, summary);
  if (check.status !== "verified" && check.reasons?.length) {
    details.append(el("ul", {}, ...check.reasons.map((r) => el("li", {}, r))));
  }
  if (check.receipt) {
    const fields = el("dl");
    for (const key of Object.keys(check.receipt).sort()) {
      if (key === "envelope") continue;
      const value = check.receipt[key];
      const shown = value instanceof RawNumber ? value.text : JSON.stringify(value, plainNumbers);
      fields.append(el("dt", {}, key), el("dd", {}, shown));
    }
    details.append(fields);
  }
  if (message.request || message.raw) {
    const buttons = el("div", { class: "buttons" });
    const add = (label, name, text, type) => {
      const button = el("button", { type: "button" }, label);
      button.addEventListener("click", () => download(name, text, type));
      buttons.append(button);
    };
    add("Download request", "request.json", message.request, "application/json");
    add("Download answer", "answer.sse", message.raw, "text/event-stream");
    if (state.receiptKey) add("Download key", "key.pem", state.receiptKey.pem, "application/x-pem-file");
    details.append(
      el("p", {}, "bankml check-receipt --request request.json --response answer.sse --key key.pem"),
      buttons,
    );
  }
  item.querySelector(":scope > details.receipt")?.remove();
  item.append(details);
}

function plainNumbers(_key, value) {
  return value instanceof RawNumber ? Number(value.text) : value;
}

async function check(item, message) {
  showCheck(item, message, await checkAnswer(message, state.receiptKey));
}

function renderConversation() {
  fillConversationList();
  const list = $("messages");
  list.replaceChildren();
  for (const message of current().messages) {
    if (message.role === "user") {
      list.append(renderUser(message));
    } else {
      const item = renderAnswer(message);
      list.append(item);
      check(item, message);
    }
  }
  setBusy(Boolean(state.busy));
}

// --- sending ---

function numberSetting(id) {
  const value = Number($(id).value);
  return $(id).value.trim() !== "" && Number.isFinite(value) ? value : null;
}

function requestBody(conversation) {
  const messages = [];
  const system = $("system-prompt").value;
  if (system.trim()) messages.push({ role: "system", content: system });
  for (const m of conversation.messages) {
    if (m.role === "user") messages.push({ role: "user", content: m.content });
    else if (!m.error && (m.content || m.toolCalls?.length)) {
      const said = { role: "assistant", content: m.content };
      if (m.toolCalls?.length) {
        said.tool_calls = m.toolCalls.map((c) => ({
          id: c.id,
          type: c.type || "function",
          function: { name: c.name, arguments: c.arguments },
        }));
      }
      messages.push(said);
    }
  }
  const body = { messages, stream: true };
  if (state.model) body.model = state.model;
  const temperature = numberSetting("temperature");
  if (temperature !== null) body.temperature = temperature;
  const maxTokens = numberSetting("max-tokens");
  if (maxTokens !== null && maxTokens >= 0) body.max_tokens = Math.floor(maxTokens);
  const tools = $("tools").value.trim();
  if (tools) {
    const parsed = JSON.parse(tools);
    if (!Array.isArray(parsed)) throw new Error("Tools must be a JSON list");
    body.tools = parsed;
  }
  return JSON.stringify(body);
}

async function send(event) {
  event?.preventDefault();
  if (state.busy || state.loading) return;
  const prompt = $("prompt").value;
  if (!prompt.trim()) return;
  const conversation = current();
  conversation.messages.push({ role: "user", content: prompt });
  let request;
  try {
    request = requestBody(conversation);
  } catch (err) {
    conversation.messages.pop();
    say(`Not sent: ${err.message}`, true);
    return;
  }
  if (conversation.messages.length === 1) conversation.title = prompt.slice(0, 60);
  $("prompt").value = "";
  $("messages").append(renderUser(conversation.messages.at(-1)));
  fillConversationList();
  await answerTurn(conversation, request);
}

// Regenerate: the last user turn asked again; its answer replaces the last one, with a receipt
// of its own (checked as any other).
async function regenerate() {
  if (state.busy || state.loading) return;
  const conversation = current();
  if (conversation.messages.at(-1)?.role === "assistant") {
    conversation.messages.pop();
    const items = $("messages").querySelectorAll(":scope > li.assistant");
    items[items.length - 1]?.remove();
  }
  if (conversation.messages.at(-1)?.role !== "user") return;
  let request;
  try {
    request = requestBody(conversation);
  } catch (err) {
    say(`Not sent: ${err.message}`, true);
    return;
  }
  await answerTurn(conversation, request);
}

// One answer to the conversation's last user turn, streamed into the page, kept and checked.
async function answerTurn(conversation, request) {
  const answer = cleanMessage({ role: "assistant", request });
  conversation.messages.push(answer);
  const item = renderAnswer(answer);
  $("messages").append(item);
  item.scrollIntoView({ block: "end" });
  const control = new AbortController();
  state.busy = control;
  setBusy(true);
  say("Answering…");
  let drawn = 0;
  try {
    await streamChat(answer, control.signal, () => {
      if (!drawn) {
        drawn = requestAnimationFrame(() => {
          drawn = 0;
          fillAnswer(item, answer);
        });
      }
    });
    say("");
  } catch (err) {
    if (control.signal.aborted) {
      answer.stopped = true;
      say("Stopped.");
    } else {
      answer.error = err.message;
      say(err.message, true);
    }
  } finally {
    cancelAnimationFrame(drawn);
    state.busy = null;
    setBusy(false);
    fillAnswer(item, answer);
    save();
    await check(item, answer);
    refreshUsage();
  }
}

function setBusy(busy) {
  $("send").disabled = busy || state.loading;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || state.loading || !current()?.messages.some((m) => m.role === "user");
}

function stop() {
  state.busy?.abort();
}

// --- the model picker: what /v1/models serves, and the Ollama registry where there is one ---

const MODEL = "bankml.model.v1";

// The registry's models (GET /api/tags) and which of them is resident (GET /api/ps), or null
// where this address has no Ollama API (the engine address, P0).
async function registry() {
  try {
    const [tags, ps] = await Promise.all([getJson("/api/tags"), getJson("/api/ps")]);
    const resident = new Set((ps?.models || []).map((m) => str(m?.name)));
    return (tags?.models || [])
      .filter((m) => str(m?.name))
      .map((m) => ({ name: m.name, resident: resident.has(m.name), file: str(m.bankml?.file) }));
  } catch {
    return null;
  }
}

function fillModels(v1, tags) {
  const entries = [];
  const capabilities = new Map(
    (v1?.models || []).map((m) => [str(m?.model), (m?.capabilities || []).join(", ")]),
  );
  for (const m of v1?.data || []) {
    const id = str(m?.id);
    if (!id) continue;
    const can = capabilities.get(id);
    entries.push({ name: id, label: `${id} (serving${can ? `: ${can}` : ""})`, load: false });
  }
  for (const m of tags || []) {
    const where = m.resident ? "registry, loaded" : "registry, not loaded";
    const label = `${m.name} (${where}${m.file ? `: ${m.file}` : ""})`;
    entries.push({ name: m.name, label, load: !m.resident });
  }
  state.models = entries;
  // the last choice again on a new visit, unless it must be loaded first (choose it again)
  const kept = entries.find((e) => e.name === localStorage.getItem(MODEL) && !e.load);
  const names = entries.map((e) => e.name);
  state.model = names.includes(state.model) ? state.model : kept?.name || names[0] || "";
  $("model").replaceChildren(
    ...entries.map((e) => {
      const option = el("option", { value: e.name }, e.label);
      option.selected = e.name === state.model;
      return option;
    }),
  );
  if (!entries.length) $("model").append(el("option", { value: "" }, "unknown"));
}

// A model chosen: its name goes in every request from now on; a registry model that is not
// resident is loaded first with Ollama's load request (POST /api/generate with only the model),
// as an Ollama client does, so that /v1 answers with it.
async function chooseModel() {
  const name = $("model").value;
  const entry = state.models.find((e) => e.name === name);
  state.model = name;
  localStorage.setItem(MODEL, name);
  if (!entry?.load) return;
  state.loading = true;
  setBusy(false);
  say(`Loading ${name}…`);
  let outcome; // [status line, is an error], said once the picker is refilled
  try {
    const res = await fetch("/api/generate", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ model: name }),
      cache: "no-store",
    });
    const text = await res.text();
    if (!res.ok) throw new Error(errorText(res.status, text));
    outcome = [`${name} loaded.`, false];
  } catch (err) {
    outcome = [`${name} not loaded: ${err.message}`, true];
  } finally {
    state.loading = false;
    // the picker shows what is resident before the status line says so
    fillModels(await getJson("/v1/models").catch(() => null), await registry());
    say(...outcome);
    setBusy(false);
  }
}

// --- settings: the server's defaults (GET /props) unless changed here ---

const SETTING_FIELDS = ["system-prompt", "temperature", "max-tokens", "tools"];

function keepSettings() {
  const kept = Object.fromEntries(SETTING_FIELDS.map((id) => [id, $(id).value]));
  localStorage.setItem(SETTINGS, JSON.stringify(kept));
}

async function applyDefaults(forget) {
  if (forget) localStorage.removeItem(SETTINGS);
  let kept = {};
  try {
    kept = JSON.parse(localStorage.getItem(SETTINGS) || "{}") || {};
  } catch {
    kept = {};
  }
  let params = {};
  try {
    const props = await getJson("/props");
    params = props?.default_generation_settings?.params || {};
    if (Number.isInteger(props?.total_slots)) state.totalSlots = props.total_slots;
  } catch (err) {
    say(`Server defaults not read: ${err.message}`, true);
  }
  const defaults = {
    "system-prompt": "",
    temperature: typeof params.temperature === "number" ? String(params.temperature) : "",
    "max-tokens": typeof params.n_predict === "number" ? String(params.n_predict) : "",
    tools: "",
  };
  for (const id of SETTING_FIELDS) {
    $(id).value = typeof kept[id] === "string" ? kept[id] : defaults[id];
  }
}

// --- usage: tokens per second and time to first token (GET /bankml/metrics) ---

const usage = { records: [], note: "No completions yet." };

async function refreshUsage() {
  if (document.visibilityState === "hidden") return;
  try {
    const metrics = await getJson("/bankml/metrics");
    usage.records = (metrics.records || []).slice(-60);
    const last = usage.records.at(-1);
    usage.note = metrics.measured === false
      ? "Tokens per second and time to first token are not available in P0 mode: bankml " +
        "forwards to llama-server and does not measure its completions."
      : last
      ? `Last: ${fmt(last.predicted_per_second)} tokens/s, first token after ` +
        `${fmt(last.ttft_ms)} ms (${metrics.kept} completions kept).`
      : "No completions measured yet.";
  } catch (err) {
    usage.records = [];
    usage.note = `No metrics here (${err.message}).`;
  }
  $("usage-text").textContent = usage.note;
  drawUsage();
  await refreshLoad();
}

const fmt = (v) => (typeof v === "number" ? (v >= 100 ? v.toFixed(0) : v.toFixed(1)) : "–");

function drawUsage() {
  const canvas = $("usage-plot");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 320;
  const height = Math.round(width / 2);
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const style = getComputedStyle(document.documentElement);
  const colour = (name) => style.getPropertyValue(name).trim();
  const panels = [
    ["tokens/s", "predicted_per_second", colour("--plot-a")],
    ["first token, ms", "ttft_ms", colour("--plot-b")],
  ];
  const half = height / 2;
  g.font = "11px system-ui, sans-serif";
  g.lineWidth = 2;
  panels.forEach(([label, field, stroke], k) => {
    const top = k * half + 14;
    const bottom = (k + 1) * half - 4;
    const values = usage.records.map((r) => (typeof r[field] === "number" ? r[field] : null));
    const max = Math.max(1e-9, ...values.filter((v) => v !== null));
    g.fillStyle = colour("--muted");
    g.fillText(`${label} (max ${fmt(values.some((v) => v !== null) ? max : null)})`, 6, top - 3);
    g.strokeStyle = colour("--border");
    g.beginPath();
    g.moveTo(4, bottom + 0.5);
    g.lineTo(width - 4, bottom + 0.5);
    g.stroke();
    g.strokeStyle = stroke;
    g.fillStyle = stroke;
    g.beginPath();
    const step = (width - 16) / Math.max(1, values.length - 1);
    let started = false;
    values.forEach((v, n) => {
      if (v === null) return;
      const x = 8 + n * step;
      const y = bottom - (v / max) * (bottom - top - 4);
      if (started) g.lineTo(x, y);
      else g.moveTo(x, y);
      started = true;
      g.fillRect(x - 2, y - 2, 4, 4);
    });
    g.stroke();
  });
}

// --- load: slots busy, queue, memory and CPU over time (GET /slots, /metrics, /bankml/usage) ---

const LOAD_KEEP = 100; // samples, one per poll (3 s): the last five minutes
const loadPlot = { samples: [], notes: {} };

async function getText(path) {
  const res = await fetch(path, { headers: headers(), cache: "no-store" });
  if (!res.ok) throw new Error(`${path}: HTTP ${res.status}`);
  return res.text();
}

// One sample of Prometheus text: the value of `name` (no labels), or null.
export function promValue(text, name) {
  for (const line of text.split("\n")) {
    if (line.startsWith(`${name} `)) {
      const value = Number(line.slice(name.length + 1));
      return Number.isFinite(value) ? value : null;
    }
  }
  return null;
}

async function refreshLoad() {
  const [slots, metrics, sampled] = await Promise.allSettled([
    getJson("/slots"),
    getText("/metrics"),
    getJson("/bankml/usage"),
  ]);
  const sample = { busy: null, slots: null, queue: null, memory: null, cpu: null };
  const notes = {};
  const prom = metrics.status === "fulfilled" ? metrics.value : "";
  if (slots.status === "fulfilled" && Array.isArray(slots.value)) {
    sample.busy = slots.value.filter((s) => s?.is_processing === true).length;
    sample.slots = slots.value.length;
  } else {
    sample.busy = promValue(prom, "llamacpp:requests_processing");
    sample.slots = state.totalSlots ?? null;
  }
  sample.queue = promValue(prom, "llamacpp:requests_deferred");
  if (sample.busy === null) notes.slots = "not published here (/slots and /metrics answer no)";
  if (sample.queue === null) notes.queue = "not published here (/metrics: start with --metrics)";
  if (sampled.status === "fulfilled") {
    const u = sampled.value;
    if (typeof u?.rss_bytes === "number") sample.memory = u.rss_bytes / 2 ** 20;
    if (typeof u?.cpu_percent === "number") sample.cpu = u.cpu_percent;
  } else {
    notes.memory = notes.cpu = `not published here (${sampled.reason.message})`;
  }
  loadPlot.samples.push(sample);
  if (loadPlot.samples.length > LOAD_KEEP) loadPlot.samples.shift();
  loadPlot.notes = notes;
  drawLoad();
}

// The SVG namespace, as the HTML parser gave it to the page's own <svg>.
function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS($("load-plot").namespaceURI, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
  if (text !== null) node.textContent = text;
  return node;
}

const LOAD_PANELS = [
  ["slots", "busy", "Slots busy", (v, s) => `${v} of ${s.slots ?? "?"}`],
  ["queue", "queue", "Queue", (v) => `${v} waiting`],
  ["memory", "memory", "Memory (RSS)", (v) => `${fmt(v)} MiB`],
  ["cpu", "cpu", "CPU", (v) => `${fmt(v)} % of a core`],
];

// Four small line plots in one inline SVG, drawn from the samples kept; a series this address
// does not publish says so in its panel.
function drawLoad() {
  const width = 320;
  const high = 56;
  const plot = $("load-plot");
  const parts = [];
  LOAD_PANELS.forEach(([series, field, title, says], k) => {
    const top = k * high;
    const values = loadPlot.samples.map((s) => s[field]);
    const known = values.filter((v) => v !== null);
    const last = loadPlot.samples.at(-1);
    const group = svg("g", { class: "panel", "data-series": series });
    if (known.length) group.setAttribute("data-last", String(values.at(-1) ?? ""));
    const max = Math.max(
      series === "slots" ? (last?.slots ?? 1) : 0,
      series === "cpu" ? 100 : 0,
      ...known,
      1e-9,
    );
    const shown = values.at(-1) === null || values.at(-1) === undefined
      ? loadPlot.notes[series] || "no sample yet"
      : says(values.at(-1), last);
    group.append(svg("text", { x: 4, y: top + 12, class: "plot-label" }, `${title}: ${shown}`));
    const bottom = top + high - 6;
    const y0 = top + 18;
    group.append(svg("line", { x1: 4, x2: width - 4, y1: bottom, y2: bottom, class: "plot-axis" }));
    const step = (width - 16) / Math.max(1, LOAD_KEEP - 1);
    const offset = LOAD_KEEP - values.length;
    const points = [];
    values.forEach((v, n) => {
      if (v === null) return;
      const x = 8 + (offset + n) * step;
      const y = bottom - (v / max) * (bottom - y0);
      points.push(`${x.toFixed(1)},${y.toFixed(1)}`);
    });
    if (points.length) {
      group.append(svg("polyline", { points: points.join(" "), class: `plot-line p${k}` }));
    }
    parts.push(group);
  });
  plot.replaceChildren(...parts);
}

// --- export and import (JSON) ---

function exportAll() {
  const doc = { format: "bankml-conversations", version: 1, conversations: state.conversations };
  download("bankml-conversations.json", JSON.stringify(doc, null, 1), "application/json");
}

async function importFile(file) {
  try {
    const doc = JSON.parse(await file.text());
    const list = Array.isArray(doc) ? doc : doc?.conversations;
    if (!Array.isArray(list)) throw new Error("no conversations in it");
    const added = list.map(cleanConversation).filter(Boolean);
    if (!added.length) throw new Error("no conversations in it");
    state.conversations.push(...added);
    state.current = added[0].id;
    save();
    renderConversation();
    say(`Imported ${added.length} conversation(s); their receipts are checked again here.`);
  } catch (err) {
    say(`Not imported: ${err.message}`, true);
  }
}

// --- start ---

// What the page reads of the server: the model's name, the receipt key, the defaults (again
// when an API key is given).
async function connect() {
  const [models, key] = await Promise.allSettled([
    getJson("/v1/models"),
    getJson("/bankml/key").then((k) => importReceiptKey(k.public_key)),
    applyDefaults(false),
  ]);
  fillModels(models.status === "fulfilled" ? models.value : null, await registry());
  state.receiptKey = key.status === "fulfilled" ? key.value : null;
  $("key-id").textContent = state.receiptKey
    ? state.receiptKey.keyid
    : `none (${key.reason.message})`;
  refreshUsage();
}

async function start() {
  await load();
  $("api-key").value = settings.apiKey;
  $("composer").addEventListener("submit", send);
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("model").addEventListener("change", chooseModel);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.busy) stop();
  });
  for (const id of SETTING_FIELDS) $(id).addEventListener("change", keepSettings);
  $("api-key").addEventListener("change", () => {
    settings.apiKey = $("api-key").value;
    sessionStorage.setItem("bankml.apiKey", settings.apiKey);
    connect().then(renderConversation);
  });
  $("reset-settings").addEventListener("click", () => applyDefaults(true));
  $("conversation").addEventListener("change", () => {
    state.current = $("conversation").value;
    renderConversation();
  });
  $("new-conversation").addEventListener("click", () => {
    const fresh = cleanConversation({ messages: [] });
    state.conversations.unshift(fresh);
    state.current = fresh.id;
    save();
    renderConversation();
    $("prompt").focus();
  });
  $("delete-conversation").addEventListener("click", () => {
    if (!window.confirm("Delete this conversation from this browser?")) return;
    state.conversations = state.conversations.filter((c) => c.id !== state.current);
    if (!state.conversations.length) state.conversations.push(cleanConversation({ messages: [] }));
    state.current = state.conversations[0].id;
    save();
    renderConversation();
  });
  $("export").addEventListener("click", exportAll);
  $("import").addEventListener("change", () => {
    const file = $("import").files[0];
    if (file) importFile(file);
    $("import").value = "";
  });
  window.addEventListener("resize", drawUsage);
  document.addEventListener("visibilitychange", refreshUsage);
  setInterval(refreshUsage, 3000);

  await connect();
  renderConversation();
  document.body.dataset.ready = "true";
}

globalThis.bankmlPage = {
  parseLossless,
  canonicalJson,
  canonicalFromText,
  pyFloatRepr,
  signedText,
  promValue,
  saved: () => saving, // settles once every write asked for so far is done
};
start();
