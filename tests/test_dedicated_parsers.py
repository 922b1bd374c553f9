"""The chat templates llama-server reads with a handler of its own (bankml.engine_cupy.autoparser
.dedicated) against llama.cpp's own, as test_autoparser_generator.py checks the autoparser's.

Side by side with ``tests/oracle/chat_params.cpp`` (llama.cpp's ``common_chat_templates_apply``
and ``common_chat_parse``, linked from the reference build): for every template of llama.cpp's
models/templates that a handler bankml follows reads, and every request of the generator's test
(no tools, reasoning on or off, a tool with tool_choice auto/required/none, parallel calls, a
response format, continued messages, force_pure_content), the prompt, generation prompt, GBNF
grammar, lazy flag and triggers, preserved tokens, thinking tags and PEG parser must be
identical, and so must the messages parsed from model outputs: generic ones, the handler's own
samples (reasoning, content and calls as its model writes them) and the template's rendering of
a tool call, whole and cut short, and every 7th prefix of a call parsed as a stream.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bankml.engine_cupy.autoparser.apply import ChatRequest, chat_params, specialized_template
from bankml.engine_cupy.autoparser.dedicated import HANDLERS
from bankml.engine_cupy.chat_template import ChatTemplate
from bankml.engine_cupy.peg.chat import ChatFormat, chat_peg_parse
from tests.test_autoparser_analysis import templates_dir  # noqa: F401
from tests.test_autoparser_generator import (  # noqa: F401
    OUTPUTS,
    VARIANTS,
    chat_params_oracle,
    message,
    ours,
    own_tool_call,
    streamed,
    their_message,
)

# outputs as each handler's models write them (beside the template's own rendering of a call),
# the first one with a call
SAMPLES: dict[str, list[str]] = {
    "GPT-OSS": [
        "<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant to=functions.get_weather"
        '<|channel|>commentary <|constrain|>json<|message|>{"city": "Paris"}',
        "<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>"
        '{"city": "Paris", "days": 2}',
        "<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is sunny.",
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Done.",
        '<|channel|>final<|message|>{"a": 1}',
        "<|channel|>commentary to=python<|message|>print(1)<|end|>",
    ],
    "Qwen3-Coder": [
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "<think>\nHmm.\n</think>\n\nIt is sunny.",
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        "<think>\nCall it.\n<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n"
        "</parameter>\n<parameter=city>\nNew York\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n"
        "</function>\n</tool_call>",
    ],
    "Kimi K2 Thinking": [
        "<think>Weather.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
        '{"city": "Lyon", "days": 2}<|tool_call_end|><|tool_calls_section_end|>',
        "<think>Straight to it<|tool_call_begin|>functions.get_weather:3"
        '<|tool_call_argument_begin|>{"city": "Rome"}',
        "<think>Hmm.</think>It is sunny.",
    ],
    "DeepSeek V3.2/V4": [
        "<think>Weather.</think>Checking.\n\n<DSML_function_calls>\n<DSML_invoke "
        'name="get_weather">\n<DSML_parameter name="city" string="true">Paris</DSML_parameter>\n'
        '<DSML_parameter name="days" string="false">2</DSML_parameter>\n</DSML_invoke>\n'
        "</DSML_function_calls>",
        "<think>Straight to it\n\n<DSML_tool_calls>\n<DSML_invoke "
        'name="get_weather">\n<DSML_parameter name="city" string="true">Rome</DSML_parameter>\n'
        "</DSML_invoke>\n</DSML_tool_calls>",
        "<think>Hmm.</think>It is sunny.",
        '</think>```json\n{"a": 1}\n```',
    ],
    "LFM2": [
        '<think>Weather.</think>Checking.<|tool_call_start|>[get_weather(city="Paris", days=2)]'
        "<|tool_call_end|>",
        "<|tool_call_start|>[get_weather(city='Rome'), get_weather(city=\"Lyon\")]"
        "<|tool_call_end|>",
        "<think>Hmm.</think>It is sunny.",
    ],
    "GigaChatV3": [
        'Checking.<|message_sep|>\n\nfunction call<|role_sep|>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris", "days": 2}}',
        'function call<|role_sep|>\n{"name": "get_weather", "arguments": {"city": "Rome"}}',
    ],
    "Functionary v3.2": [
        'get_weather\n{"city": "Rome", "days": 2}',
        'all\nChecking.>>>get_weather\n{"city": "Paris", "days": 2}',  # content, as llama-server
        'get_weather\n{"city": "Rome"}>>>get_weather\n{"city": "Lyon"}',
        "all\nIt is sunny.",
    ],
    "Ministral/Magistral Large 3": [
        '[THINK]Weather.[/THINK]Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon", "days": 2}',
        "[THINK]Hmm.[/THINK]It is sunny.",
        '```json\n{"a": 1}\n```',
    ],
    "MiniCPM5": [
        '<think>Weather.</think>Checking.<function name="get_weather"><param name="city">'
        'Paris</param><param name="days">2</param></function><function name="get_weather">'
        '<param name="city"><![CDATA[New </param> York]]></param></function>',
        '<function name="get_weather"><param name="city">Paris</param></function>',
        "<think>Hmm.</think>It is sunny.",
    ],
    "Cohere2 MoE": [
        '<|START_THINKING|>Weather.<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "0", '
        '"tool_name": "get_weather", "parameters": {"city": "Paris"}}]<|END_ACTION|>',
        "<|START_THINKING|>Hmm.<|END_THINKING|><|START_TEXT|>It is sunny.<|END_TEXT|>",
    ],
    "LLM-jp Harmony v1": [
        "<|channel|> analysis<|message|> Weather.<|end|><|start|> assistant to=functions.get_weather"
        '<|channel|> commentary <|constrain|> json<|message|> {"city": "Paris"}<|end|>'
        "<|start|> assistant to=functions.get_weather<|channel|> commentary<|message|> "
        '{"city": "Lyon"}',
        "<|channel|> analysis<|message|> Hmm.<|end|><|start|> assistant<|channel|> final"
        "<|message|> It is sunny.",
    ],
    "Muse Glimmer": [
        " to=self<|message|>Weather.<|eom|><|start|>assistant to=get_weather<|message|>"
        '<atem:function_calls>\n<atem:invoke name="get_weather">\n<atem:parameter name="city">'
        'Paris</atem:parameter>\n<atem:parameter name="days">2</atem:parameter>\n</atem:invoke>'
        "\n</atem:function_calls>",
        " to=self<|message|>Hmm.<|eom|><|start|>assistant to=user<|message|>It is sunny.<|eot|>",
    ],
    "Kimi K3": [
        "Weather.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="0"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="integer"<|sep|>2<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
        "Hmm.<|close|>think<|sep|><|open|>response<|sep|>It is sunny.<|close|>response<|sep|>"
        "<|close|>message<|sep|><|end_of_msg|>",
    ],
    "Ling 3.0 (Bailing V3)": [
        "Weather.</think>Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n"
        "</tool_call><|role_end|>",
        "Straight to it<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome"
        "</arg_value></tool_call>",
        "Hmm.</think>It is sunny.<|role_end|>",
    ],
    "MiniMax-M3": [
        "<mm:think>Weather.</mm:think>Checking.]<]minimax[>[<tool_call>\n"
        ']<]minimax[>[<invoke name="get_weather">\n]<]minimax[>[<city>Paris]<]minimax[>[</city>\n'
        "]<]minimax[>[<days>2]<]minimax[>[</days>\n]<]minimax[>[</invoke>\n"
        "]<]minimax[>[</tool_call>",
        "<mm:think>Hmm.</mm:think>It is sunny.",
    ],
    "Gemma4": [
        "<|channel>thought\nWeather.<channel|>Checking.<|tool_call>call:get_weather"
        '{city:<|"|>Paris<|"|>,days:2}<tool_call|>',
        "<|channel>thought\nHmm.<channel|>It is sunny.",
        '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>',
    ],
}
SAMPLES["LFM2.5"] = SAMPLES["LFM2"]


WEATHER = VARIANTS[3][0]["tools"][0]


def _call(call_id: str, city: str) -> dict[str, Any]:
    arguments = json.dumps({"city": city})
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


# calls answered out of order, then the answer (DeepSeek V4 sorts the results, the older Gemma 4
# template reads them from the calling message)
ANSWERED = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [_call("c1", "Paris"), _call("c2", "Rome")]},
    {"role": "tool", "tool_call_id": "c2", "content": '{"temp": 20}'},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny in Paris, 20 in Rome."},
    {"role": "user", "content": "Thanks"},
]
REQUESTS = [
    *VARIANTS,
    ({"messages": ANSWERED, "tools": [WEATHER]}, ChatRequest(ANSWERED, tools=[WEATHER])),
]


def _samples(handler: str) -> list[str]:
    """The handler's samples, DeepSeek's DSML marker spelled out (``<DSML_`` is
    ``<｜DSML｜`` in them)."""
    return [
        o.replace("<DSML_", "<\uff5cDSML\uff5c").replace("</DSML_", "</\uff5cDSML\uff5c")
        for o in SAMPLES.get(handler, [])
    ]


def followed(templates_dir: Path) -> list[tuple[str, str]]:  # noqa: F811
    """(file, handler) for each template a handler bankml follows reads."""
    out = []
    for path in sorted(templates_dir.glob("*.jinja")):
        name = specialized_template(path.read_text(encoding="utf-8"))
        if name in HANDLERS:
            out.append((path.name, name))
    return out


def test_dedicated_params_as_llama_cpp(
    templates_dir: Path,  # noqa: F811
    chat_params_oracle: Path,  # noqa: F811
) -> None:
    files = followed(templates_dir)
    assert {name for _, name in files} == set(HANDLERS)
    requests, cases = [], []
    for file, handler in files:
        template = ChatTemplate((templates_dir / file).read_text(encoding="utf-8"))
        own = own_tool_call(template)
        samples = _samples(handler)
        if "DSML" in template.source and "function_calls" not in template.source:  # V4
            samples = [o.replace("function_calls>", "tool_calls>") for o in samples]
        outputs = OUTPUTS + samples + own
        partial = streamed(samples[0])  # each handler's first sample holds a call
        for fields, request in REQUESTS:
            body = {
                "template": str(templates_dir / file),
                "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                "outputs": outputs,
                "partial_outputs": partial,
                **fields,
            }
            requests.append(json.dumps(body))
            cases.append((file, template, request, outputs, partial, fields))
    answers = subprocess.run(
        [str(chat_params_oracle)],
        input="\n".join(requests) + "\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert len(answers) == len(cases)
    differing: list[Any] = []
    calls: dict[str, int] = dict.fromkeys((f for f, _ in files), 0)
    partial_calls = dict(calls)
    for (file, template, request, outputs, partial, fields), line in zip(
        cases, answers, strict=True
    ):
        theirs = json.loads(line)
        assert "error" not in theirs, (file, fields, theirs)
        params = chat_params(template, request)
        for key, value in ours(params).items():
            if value != theirs[key]:
                differing.append((file, fields, key))
        assert params.parser is not None
        for is_partial, texts, parsed in (
            (False, outputs, theirs["parsed"]),
            (True, partial, theirs["partial"]),
        ):
            for output, their_msg in zip(texts, parsed, strict=True):
                try:
                    got = message(
                        chat_peg_parse(
                            params.parser,
                            output,
                            is_partial,
                            params.generation_prompt,
                            ChatFormat(params.format),
                        )
                    )
                except Exception:  # noqa: BLE001 - a refused output is compared as such
                    got = {"error": True}
                want = their_message(their_msg)
                counts = partial_calls if is_partial else calls
                counts[file] += bool(want.get("tool_calls"))
                if got != want:
                    differing.append((file, fields, is_partial, output[:60], got, want))
    assert differing == []
    # the outputs exercise each template's tool-call parser, whole and streamed
    assert min(calls.values()) >= 2, calls
    assert min(partial_calls.values()) >= 3, partial_calls


@pytest.mark.parametrize(
    "template, parser",
    [
        ("google-gemma-4-31B-it.jinja", "peg-gemma4"),
        ("MiniMax-M3.jinja", "peg-minimax-m3"),
        ("Qwen3-Coder.jinja", "peg-native"),
    ],
)
def test_a_chat_task_names_its_handlers_parser(
    engines: Any,
    templates_dir: Path,  # noqa: F811
    template: str,
    parser: str,
) -> None:
    """The chat parser's name as llama-server shows it (``__verbose``, ``/slots``): the
    handler's own format where it has one."""
    engine = engines[0]
    saved = engine.template
    engine.template = dataclasses.replace(saved, source=(templates_dir / template).read_text())
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "verbose": True}
        assert engine.parse_request(body, "chat").options["chat_format"] == parser
    finally:
        engine.template = saved
