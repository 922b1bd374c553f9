"""llama-server's /props, /slots and /metrics bodies from plain data (no server, no engine)."""

from __future__ import annotations

from types import SimpleNamespace

from bankml.engine_cupy.sampler import SamplerParams
from bankml.formats.llama import (
    MetricsScrape,
    Props,
    generation_settings,
    prometheus_text,
    props_object,
    slot_object,
    template_caps,
)
from bankml.formats.slot_actions import filename_ok, stoi
from bankml.formats.slot_view import SlotView

PROPS_KEYS = [
    "default_generation_settings",
    "total_slots",
    "model_alias",
    "model_ftype",
    "model_path",
    "modalities",
    "media_marker",
    "endpoint_slots",
    "endpoint_props",
    "endpoint_metrics",
    "ui",
    "ui_settings",
    "chat_template",
    "chat_template_caps",
    "bos_token",
    "eos_token",
    "build_info",
    "is_sleeping",
    "cors_proxy_enabled",
]


def props(**changes: object) -> Props:
    fields: dict[str, object] = {
        "defaults": SamplerParams(),
        "n_ctx": 4096,
        "total_slots": 2,
        "model_alias": "tiny.gguf",
        "model_ftype": "Q4_1",
        "model_path": "/models/tiny.gguf",
        "build_info": "bankml 0 native",
    }
    fields.update(changes)
    return Props(**fields)  # type: ignore[arg-type]


def test_props_are_llama_servers_keys_in_its_order() -> None:
    out = props_object(
        props(
            chat_template="{{ messages }}",
            chat_template_caps={"supports_tools": True, "supports_tool_calls": False},
            bos_token="<s>",
            eos_token="</s>",
        )
    )
    assert list(out) == PROPS_KEYS
    assert out["default_generation_settings"]["n_ctx"] == 4096
    assert out["default_generation_settings"]["params"] == generation_settings(
        SimpleNamespace(sampler=SamplerParams(), n_predict=-1, stop=(), n_probs=0),
        only_metrics=True,
    )
    assert (out["total_slots"], out["model_alias"], out["model_ftype"]) == (2, "tiny.gguf", "Q4_1")
    assert (out["model_path"], out["build_info"]) == ("/models/tiny.gguf", "bankml 0 native")
    assert (out["chat_template"], out["bos_token"], out["eos_token"]) == (
        "{{ messages }}",
        "<s>",
        "</s>",
    )
    # llama.cpp's caps map: sorted, the three unprobed caps added by its rules
    assert out["chat_template_caps"] == {
        "supports_parallel_tool_calls": False,
        "supports_preserve_reasoning": False,
        "supports_reasoning_effort": False,
        "supports_tool_calls": False,
        "supports_tools": True,
    }


def test_props_without_a_template_show_empty_strings_and_no_caps() -> None:
    out = props_object(props())
    assert (out["chat_template"], out["bos_token"], out["eos_token"]) == ("", "", "")
    assert out["chat_template_caps"] == {}
    assert template_caps(None) == {}


def test_an_idle_slot_before_any_task_has_four_keys() -> None:
    out = slot_object(SlotView(), id_slot=1, n_ctx=2048)
    assert out == {"id": 1, "n_ctx": 2048, "speculative": False, "is_processing": False}


def parsed(n_predict: int = 16) -> SimpleNamespace:
    return SimpleNamespace(sampler=SamplerParams(), n_predict=n_predict, options={}, n_probs=0)


def test_a_running_chat_slot_shows_its_task_and_counters() -> None:
    view = SlotView()
    view.begin("chat", {"messages": []}, parsed(16))
    view.on_chunk(SimpleNamespace(text="a\n", timings={"cache_n": 3, "prompt_n": 7}))
    out = slot_object(
        view, id_slot=0, n_ctx=4096, n_prompt_tokens=12, generation_prompt="<|assistant|>"
    )
    assert list(out) == [
        "id",
        "n_ctx",
        "speculative",
        "is_processing",
        "id_task",
        "n_prompt_tokens",
        "n_prompt_tokens_processed",
        "n_prompt_tokens_cache",
        "params",
        "next_token",
    ]
    assert out["is_processing"] is True
    assert (out["id_task"], out["n_prompt_tokens"]) == (0, 12)
    assert (out["n_prompt_tokens_processed"], out["n_prompt_tokens_cache"]) == (7, 3)
    assert out["params"]["reasoning_format"] == "deepseek"
    assert out["params"]["chat_format"] == "peg-native"
    assert out["params"]["generation_prompt"] == "<|assistant|>"
    assert out["next_token"] == [
        {"has_next_token": True, "has_new_line": True, "n_remain": 15, "n_decoded": 1}
    ]


def test_a_finished_completion_slot_keeps_its_parameters_with_zero_counts() -> None:
    view = SlotView()
    view.begin("llama_completion", {"prompt": "x"}, parsed(8))
    view.on_chunk(SimpleNamespace(text="b", timings=None))
    view.end()
    out = slot_object(view, id_slot=0, n_ctx=4096, n_prompt_tokens=5)
    assert out["is_processing"] is False
    assert out["params"]["chat_format"] == "Content-only"  # not a chat: the task's own
    assert out["params"]["generation_prompt"] == ""
    assert out["next_token"] == [
        {"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}
    ]


TOTALS = {
    "requests": 2,
    "prompt_tokens": 30,
    "prompt_seconds": 0.5,
    "tokens_predicted": 11,
    "predicted_seconds": 0.25,
    "decode_calls": 12,
    "n_tokens_max": 25,
    "prompt_tokens_cached": 4,
}


def metric_values(text: str) -> dict[str, str]:
    return {
        line.split()[0].removeprefix("llamacpp:"): line.split()[1]
        for line in text.splitlines()
        if not line.startswith("#")
    }


def test_metrics_are_llama_servers_exposition_of_the_numbers_given() -> None:
    text = prometheus_text(
        MetricsScrape(
            totals=TOTALS,
            window={"prompt_tokens": 30, "prompt_seconds": 0.5, "steps": 9, "predicted_seconds": 0},
            processing=1,
            deferred=3,
            busy_slots_per_decode=1.5,
        )
    )
    assert text.endswith("\n")
    assert text.startswith(
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached "
        "tokens\n# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 30\n"
    )
    assert metric_values(text) == {
        "prompt_tokens_total": "30",
        "prompt_tokens_cached_total": "4",
        "prompt_seconds_total": "0.5",
        "tokens_predicted_total": "11",
        "tokens_predicted_seconds_total": "0.25",
        "n_decode_total": "12",
        "n_tokens_max": "25",
        "spec_decode_num_draft_tokens_total": "0",
        "spec_decode_num_accepted_tokens_total": "0",
        "spec_decode_num_drafts_total": "0",
        "prompt_tokens_seconds": "60",  # 30 tokens over 0.5 s
        "predicted_tokens_seconds": "0",  # no generation time in the window: 0.0
        "requests_processing": "1",
        "requests_deferred": "3",
        "n_busy_slots_per_decode": "1.5",
    }
    assert "# TYPE llamacpp:requests_deferred gauge" in text


def test_slot_action_checks_read_ids_and_filenames_as_llama_cpp_does() -> None:
    assert stoi("  +12abc") == 12
    assert stoi("-3") == -3
    assert stoi("x1") is None
    assert stoi("2147483648") is None  # past a C int: std::stoi throws
    assert filename_ok("slot.bin")
    for bad in ("", ".", "a/b", "..x", " lead", "trail.", "trail ", "a:b", "\x7f", "x" * 256):
        assert not filename_ok(bad), bad
