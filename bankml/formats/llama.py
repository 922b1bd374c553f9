"""llama-server's own bodies: /completion's stream events and final object, the task's
``generation_settings``, ``timings``, /props, the ``--metrics`` text, ``response_fields``.

Built from the engine's results and a parsed request, in llama-server's key order, with its
numbers as nlohmann prints them (C floats widened, non-finite values null). Pure Python: no
Twisted, no NumPy. /props, /slots and /metrics take plain data (``Props``, a ``SlotView`` copy,
``MetricsScrape``) that the native engine builds; the engine's chunks, summaries and parsed
requests are read through their attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bankml.formats.nlohmann import c_float
from bankml.formats.slot_view import SlotView
from bankml.receipts.kinds import CHAT

# --- /completion ---------------------------------------------------------------------------------


def completion_piece(
    index: int,
    chunk: Any,
    tokens_predicted: int,
    tokens_evaluated: int,
    with_timings: bool,
) -> dict[str, Any]:
    """One streamed /completion event: a token's text (llama-server's partial results carry
    id_slot -1, its final one the slot)."""
    event: dict[str, Any] = {
        "index": index,
        "content": chunk.text,
        "tokens": [chunk.token] if chunk.token is not None else [],
        "stop": False,
        "id_slot": -1,
        "tokens_predicted": tokens_predicted,
        "tokens_evaluated": tokens_evaluated,
    }
    if with_timings and getattr(chunk, "timings", None):
        event["timings"] = llama_timings(chunk.timings)
    if chunk.entry is not None:
        event["completion_probabilities"] = [chunk.entry]
    return event


def progress_piece(index: int, tokens_predicted: int, tokens_evaluated: int) -> dict[str, Any]:
    """A /completion prompt-progress event before its ``timings`` and ``prompt_progress``: an
    empty partial result (llama-server's token-less result, ``tokens`` [0])."""
    return {
        "index": index,
        "content": "",
        "tokens": [0],
        "stop": False,
        "id_slot": -1,
        "tokens_predicted": tokens_predicted,
        "tokens_evaluated": tokens_evaluated,
    }


def stop_type(summary: Any) -> str:
    """Why generation ended, as llama-server's stop_type names it."""
    if summary.completion_tokens == 0:
        return "none"  # nothing generated (an empty prompt): llama-server's STOP_TYPE_NONE
    if summary.finish_reason != "stop":
        return "limit"
    return "word" if getattr(summary, "stopping_word", "") else "eos"


def completion_final(
    summary: Any,
    text: str,
    *,
    index: int,
    model: str,
    settings: dict[str, Any],
    prompt: str,
    tokens: list[int] | None = None,
) -> dict[str, Any]:
    """/completion's final object (the whole answer, or the last streamed event with ``text``
    empty); ``tokens`` with ``return_tokens`` (not streamed)."""
    timings = summary.timings or {}
    return {
        "index": index,
        "content": text,
        "tokens": list(tokens) if tokens is not None else [],
        "id_slot": max(int(getattr(summary, "slot", 0)), 0),  # the slot that ran the task
        "stop": True,
        "model": model,
        "tokens_predicted": summary.completion_tokens,
        "tokens_evaluated": summary.prompt_tokens,
        "generation_settings": settings,
        "prompt": prompt,
        # a stream's last event carries no text: the run's whole text says it
        "has_new_line": "\n" in (text or getattr(summary, "text", "")),
        "truncated": bool(getattr(summary, "truncated", False)),
        "stop_type": stop_type(summary),
        "stopping_word": getattr(summary, "stopping_word", ""),
        # the slot's tokens: the prompt and all but the last token generated, less any shifted out
        "tokens_cached": summary.prompt_tokens
        + summary.completion_tokens
        - 1
        - getattr(summary, "n_discarded", 0)
        if summary.completion_tokens
        else timings.get("cache_n", 0),
    }


def nested_values(paths: list[str], obj: dict[str, Any]) -> dict[str, Any]:
    """json_get_nested_values: each ``a/b`` path looked up, kept under the path as its key;
    a path that is not there is left out."""
    out: dict[str, Any] = {}
    for path in paths:
        current: Any = obj
        for key in path.split("/"):
            if not isinstance(current, dict) or key not in current:
                break
            current = current[key]
        else:
            out[path] = current
    return out


def only_fields(obj: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    """``response_fields``: only those paths of ``obj`` (bankml's receipt stays, it is bankml's)."""
    out = nested_values(paths, obj)
    if "bankml_receipt" in obj:
        out["bankml_receipt"] = obj["bankml_receipt"]
    return out


# --- generation settings and timings -------------------------------------------------------------


# llama-server's task_params::to_json, in its key order: (key, whether llama.cpp holds it as a C
# float). The SamplerParams fields carry the same names. /props' default_generation_settings.params
# (to_json(only_metrics=true)) leaves out dry_sequence_breakers, stop, logit_bias and the grammar
# fields, which generation_settings adds between these runs for a task.
DRAW_ONE_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED
_SAMPLING_HEAD = (
    ("seed", False),
    ("temperature", True),
    ("dynatemp_range", True),
    ("dynatemp_exponent", True),
    ("top_k", False),
    ("top_p", True),
    ("min_p", True),
    ("top_n_sigma", True),
    ("xtc_probability", True),
    ("xtc_threshold", True),
    ("typical_p", True),
    ("repeat_last_n", False),
    ("repeat_penalty", True),
    ("presence_penalty", True),
    ("frequency_penalty", True),
    ("dry_multiplier", True),
    ("dry_base", True),
    ("dry_allowed_length", False),
    ("dry_penalty_last_n", False),
)
_MIROSTAT = (
    ("mirostat", False),
    ("mirostat_tau", True),
    ("mirostat_eta", True),
    ("adaptive_target", True),
    ("adaptive_decay", True),
)


def _sampling_values(params: Any, table: tuple[tuple[str, bool], ...]) -> dict[str, Any]:
    return {
        key: c_float(getattr(params, key)) if is_float else getattr(params, key)
        for key, is_float in table
    }


def logit_bias_entries(biases: Any) -> list[dict[str, Any]]:
    """format_logit_bias: ``{"bias", "token"}`` objects, -inf (a banned token) written as null."""
    return [{"bias": c_float(b.bias), "token": b.token} for b in biases]


TASK_ECHOED = ("n_keep", "n_discard", "stream", "timings_per_token", "backend_sampling", "lora")


def generation_settings(parsed: Any, only_metrics: bool = False) -> dict[str, Any]:
    """llama-server's ``task_params::to_json``: /completion's ``generation_settings`` (the
    parameters the run used), or with ``only_metrics`` /props' ``default_generation_settings.params``
    (the defaults, without stop, logit_bias and the grammar fields). Same keys, same order, floats
    as llama.cpp's C floats print."""
    params = parsed.sampler
    options = getattr(parsed, "options", None) or {}
    n_predict = getattr(parsed, "n_predict", -1)
    out = _sampling_values(params, _SAMPLING_HEAD)
    if getattr(parsed, "seed_drawn", False):
        # llama-server shows the seed a request named (0xFFFFFFFF: "draw one"); the seed bankml
        # drew for it is the receipt's to name
        out["seed"] = DRAW_ONE_SEED
    if not only_metrics:
        out["dry_sequence_breakers"] = list(params.dry_sequence_breakers)
    out.update(_sampling_values(params, _MIROSTAT))
    if not only_metrics:
        out["stop"] = list(getattr(parsed, "stop", ()))
    out.update(
        {
            "max_tokens": n_predict,
            "n_predict": n_predict,
            "n_keep": options.get("n_keep", 0),
            "n_discard": options.get("n_discard", 0),
            "ignore_eos": bool(getattr(params, "ignore_eos", False)),
            "stream": bool(options.get("stream", False)),
        }
    )
    if not only_metrics:
        out["logit_bias"] = logit_bias_entries(getattr(params, "logit_bias", ()))
    out.update({"n_probs": getattr(parsed, "n_probs", 0), "min_keep": params.min_keep})
    if not only_metrics:
        constraint = getattr(parsed, "constraint", None)
        # llama-server shows its GBNF; a JSON schema it converts to GBNF first, which bankml does
        # not (llguidance takes the schema itself), so only a GBNF grammar is shown
        out.update(
            {
                "grammar": constraint.source
                if constraint is not None and constraint.kind == "gbnf"
                else "",
                "grammar_lazy": bool(options.get("grammar_lazy", False)),
                "grammar_triggers": list(options.get("grammar_triggers", [])),
                "preserved_tokens": list(options.get("preserved_tokens", [])),
            }
        )
    out.update(
        {
            "chat_format": "Content-only",
            # the server's --reasoning-format (default auto, shown as deepseek) reaches a task,
            # not the defaults /props shows
            "reasoning_format": "none" if only_metrics else "deepseek",
            "reasoning_in_content": False,
            "generation_prompt": str(options.get("generation_prompt", "")),
            "samplers": list(params.samplers),
            "speculative.types": "none",
            "timings_per_token": bool(options.get("timings_per_token", False)),
            "post_sampling_probs": bool(getattr(parsed, "post_sampling_probs", False)),
            "backend_sampling": bool(options.get("backend_sampling", False)),
            "lora": [],
        }
    )
    if not only_metrics:  # the fields a task reports back exactly as the request gave them
        out.update({key: options[key] for key in TASK_ECHOED if key in options})
    return out


def llama_timings(timings: dict[str, Any] | None) -> dict[str, Any] | None:
    """The engine's timings with llama-server's per-token times added, in its key order
    (server_slot_stats::to_json), by its formulas: 0.0 until the divisor is known, and
    generation's per-token time over its decode steps (the first token comes free)."""
    if timings is None:
        return None
    t = dict(timings)
    prompt_n, prompt_ms = t.get("prompt_n", 0), t.get("prompt_ms", 0.0)
    predicted_n, predicted_ms = t.get("predicted_n", 0), t.get("predicted_ms", 0.0)
    steps = max(predicted_n - 1, 0)
    out = {
        "cache_n": t.pop("cache_n", 0),
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n > 0 else 0.0,
        "prompt_per_second": t.get("prompt_per_second", 0.0),
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps > 0 else 0.0,
        "predicted_per_second": t.get("predicted_per_second", 0.0),
    }
    for key in (
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
    ):
        t.pop(key, None)
    out.update(t)  # anything else the engine reports (draft counts) stays, after llama-server's
    return out


# --- /props and /metrics ----------------------------------------------------------------------


@dataclass(frozen=True)
class Props:
    """What /props shows: the server's settings and the resident model's (built by the native
    engine's ``props``)."""

    defaults: Any  # the server's sampling defaults (the engine's SamplerParams)
    n_ctx: int
    total_slots: int  # -np
    model_alias: str
    model_ftype: str
    model_path: str
    build_info: str
    chat_template: str = ""  # the template's source ("" without one)
    chat_template_caps: Mapping[str, bool] | None = None  # what its probes found (None: none)
    bos_token: str = ""
    eos_token: str = ""


class DefaultTask:
    """A task with the server's default parameters (``defaults``: its SamplerParams), read by
    ``generation_settings`` as a parsed request: /props' defaults, an embedding or rerank
    task's parameters."""

    n_predict, stop, n_probs, cache_prompt = -1, (), 0, True

    def __init__(self, defaults: Any) -> None:
        self.sampler = defaults


def props_object(props: Props) -> dict[str, Any]:
    """llama-server's /props keys."""
    return {
        "default_generation_settings": {
            "params": generation_settings(DefaultTask(props.defaults), only_metrics=True),
            "n_ctx": props.n_ctx,
        },
        "total_slots": props.total_slots,
        "model_alias": props.model_alias,
        "model_ftype": props.model_ftype,
        "model_path": props.model_path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": "<__media__>",
        "endpoint_slots": True,  # GET /slots, on the engine address
        "endpoint_props": False,
        "endpoint_metrics": True,
        "ui": False,
        "ui_settings": {},
        "chat_template": props.chat_template,
        "chat_template_caps": template_caps(props.chat_template_caps),
        "bos_token": props.bos_token,
        "eos_token": props.eos_token,
        "build_info": props.build_info,
        "is_sleeping": False,
        "cors_proxy_enabled": False,
    }


def slot_object(
    view: SlotView,
    *,
    id_slot: int,
    n_ctx: int,
    n_prompt_tokens: int = 0,
    generation_prompt: str = "",
    speculative: bool = False,
) -> dict[str, Any]:
    """One slot of ``GET /slots``: llama-server's ``server_slot::to_json(only_metrics=true)``
    (``view`` is a copy of the slot's ``SlotView``; ``n_prompt_tokens`` the tokens its cache
    holds). Before any task only the first four keys; after one, the task's parameters
    (``task_params::to_json(true)``: a task's reasoning format, and on a chat the chat parser's
    format and the template's generation prompt)."""
    slot: dict[str, Any] = {
        "id": id_slot,
        "n_ctx": n_ctx,
        "speculative": speculative,  # --spec-type ngram-simple
        "is_processing": view.processing,
    }
    if view.parsed is None:
        return slot
    params = generation_settings(view.parsed, only_metrics=True)
    if view.pooled or view.refused:  # the slot holds the last embedding's tokens
        n_prompt_tokens = view.slot_tokens
    if not view.pooled:  # an embedding or rerank task: the defaults as they are (/props')
        params["reasoning_format"] = "deepseek"  # the server's --reasoning-format (auto)
    if view.kind == CHAT and not view.pooled:
        # the chat parser llama.cpp generates for a template ("Content-only" without Jinja)
        params["chat_format"] = view.parsed.options.get("chat_format", "peg-native")
        params["generation_prompt"] = generation_prompt
    slot.update(
        {
            "id_task": view.id_task,
            "n_prompt_tokens": n_prompt_tokens,
            "n_prompt_tokens_processed": view.prompt_n,
            "n_prompt_tokens_cache": view.cache_n,
            "params": params,
            "next_token": [
                {
                    "has_next_token": view.processing
                    or ((view.pooled or view.refused) and view.next_token_left),
                    "has_new_line": view.has_new_line,
                    "n_remain": view.n_remain(),
                    "n_decoded": view.n_decoded,
                }
            ],
        }
    )
    return slot


def template_caps(caps: Mapping[str, bool] | None) -> dict[str, bool]:
    """llama.cpp's ``caps::to_map``: the template's capabilities, sorted by name as its std::map
    is. The three caps chat_template.Caps does not probe take llama.cpp's result for a template
    without them: parallel tool calls only where tool calls work (its probe fails otherwise),
    no preserved reasoning and no reasoning effort (neither probe finds the variable used)."""
    if caps is None:
        return {}
    out = dict(caps)
    out.setdefault("supports_parallel_tool_calls", bool(out.get("supports_tool_calls", False)))
    out.setdefault("supports_preserve_reasoning", False)
    out.setdefault("supports_reasoning_effort", False)
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class MetricsScrape:
    """What one read of /metrics shows (built by the native engine's ``scrape``, which starts
    the rate window again)."""

    totals: Mapping[str, Any]  # the running counters since the start (NativeEngine.totals)
    window: Mapping[
        str, float
    ]  # prompt tokens and seconds, decode steps and seconds, since the last scrape
    processing: int  # runs holding a slot (requests_processing)
    deferred: int  # requests waiting for a slot (requests_deferred)
    busy_slots_per_decode: float  # n_busy_slots_per_decode
    # with several models resident (bankml serve --native --max-loaded): each model's counts
    # and memory (NativeEngine.models_state); empty with one model, and nothing more is written
    models: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def prometheus_text(scrape: MetricsScrape) -> str:
    """llama-server's --metrics exposition, from the engine's totals and rate window."""
    t, window = scrape.totals, scrape.window

    counters = [
        (
            "prompt_tokens_total",
            "Number of prompt tokens processed, excluding cached tokens",
            t["prompt_tokens"],
        ),
        (
            "prompt_tokens_cached_total",
            "Number of prompt tokens reused from the cache",
            t["prompt_tokens_cached"],
        ),
        ("prompt_seconds_total", "Total time spent processing prompts", t["prompt_seconds"]),
        ("tokens_predicted_total", "Number of generation tokens processed", t["tokens_predicted"]),
        (
            "tokens_predicted_seconds_total",
            "Total time spent generating tokens",
            t["predicted_seconds"],
        ),
        (
            "n_decode_total",
            "Total number of llama_decode() calls, excluding speculative decoding and "
            "multimodal decoding",
            t["decode_calls"],
        ),
        (
            "n_tokens_max",
            "Largest observed sequence length (prompt + generation)",
            t["n_tokens_max"],
        ),
        # bankml has no speculative decoding: llama-server's counters, always 0 here as there without a draft
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
        (
            "spec_decode_num_accepted_tokens_total",
            "Speculative: Total draft tokens accepted by the target model",
            0,
        ),
        (
            "spec_decode_num_drafts_total",
            "Speculative: Total speculative decoding verification steps",
            0,
        ),
    ]
    # the bucket's n_per_second: decode steps over time since the last scrape, 0.0 without time
    prompt_rate = (
        window["prompt_tokens"] / window["prompt_seconds"] if window["prompt_seconds"] > 0 else 0.0
    )
    predicted_rate = (
        window["steps"] / window["predicted_seconds"] if window["predicted_seconds"] > 0 else 0.0
    )
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s", predicted_rate),
        ("requests_processing", "Number of requests processing", scrape.processing),
        ("requests_deferred", "Number of requests deferred", scrape.deferred),
        (
            "n_busy_slots_per_decode",
            "Average number of busy slots per llama_decode() call",
            scrape.busy_slots_per_decode,
        ),
    ]
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, help_text, value in items:
            lines += [
                f"# HELP llamacpp:{name} {help_text}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {_num(value)}",
            ]
    lines += per_model_lines(scrape.models)
    return "\n".join(lines) + "\n"


PER_MODEL = (
    ("model_requests_total", "counter", "Requests answered by each model", "requests"),
    (
        "model_prompt_tokens_total",
        "counter",
        "Prompt tokens answered by each model",
        "prompt_tokens",
    ),
    (
        "model_completion_tokens_total",
        "counter",
        "Tokens generated by each model",
        "completion_tokens",
    ),
    (
        "model_resident_bytes",
        "gauge",
        "Memory reckoned for each model resident (its file and KV cache); 0 when not resident",
        "need_bytes",
    ),
)


def per_model_lines(models: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """bankml's own series, one line per model, with several models served (none with one):
    the native /metrics' tail, and P0's after its llama-server's series."""
    lines: list[str] = []
    for name, kind, help_text, key in PER_MODEL if models else ():
        lines += [f"# HELP bankml:{name} {help_text}", f"# TYPE bankml:{name} {kind}"]
        for model, counts in sorted(models.items()):
            label = model.replace("\\", "\\\\").replace('"', '\\"')
            value = counts.get(key, 0) if counts.get("resident") or key != "need_bytes" else 0
            shown = str(value) if isinstance(value, int) else _num(value or 0)
            lines.append(f'bankml:{name}{{model="{label}"}} {shown}')
    return lines


def _num(value: float) -> str:
    """A number as C++'s ostream writes a double (6 significant digits, no trailing zeros)."""
    return f"{float(value):.6g}"
