"""llama.cpp's built-in chat templates: how llama-server started with ``--no-jinja`` writes a
chat's prompt (src/llama-chat.cpp of build 11434, reached through ``llama_chat_apply_template``
from common/chat.cpp ``common_chat_templates_apply_legacy``).

Without Jinja, llama-server does not run the model's template: it recognises it and writes the
prompt with one of its own fixed formats, byte for byte what this module writes:

- ``NAMES``: the built-in templates by the names ``--chat-template NAME`` takes (``chatml``,
  ``llama3``, ``gemma`` ...; llama.cpp's name table, in its sorted order);
- ``detect_template(text)``: the format a template's text is read as (``llm_chat_detect_template``:
  a built-in name, else the first of llama.cpp's marker tests the text passes), None when none;
- ``apply_builtin(kind, chat, add_assistant)``: the prompt of ``(role, content)`` pairs in one
  format (``llm_chat_apply_template``);
- ``render_legacy(source, messages, add_generation_prompt)``: a chat request's messages as
  ``common_chat_templates_apply_legacy`` renders them (content parts joined by newlines, nothing
  but role and content read), refused with llama-server's message where the template is none of
  the built-in ones.

Roles are written as given (no ``developer`` -> ``system``); tool calls and reasoning are not
rendered; a role or a content is read up to its first NUL, as the C strings they are there. Strings are trimmed of ASCII whitespace only and roles upper-cased in ASCII only, as
the C++ does. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# the formats (llm_chat_template), named as llama.cpp's enum without its prefix
CHATML = "CHATML"
LLAMA_2 = "LLAMA_2"
LLAMA_2_SYS = "LLAMA_2_SYS"
LLAMA_2_SYS_BOS = "LLAMA_2_SYS_BOS"
LLAMA_2_SYS_STRIP = "LLAMA_2_SYS_STRIP"
MISTRAL_V1 = "MISTRAL_V1"
MISTRAL_V3 = "MISTRAL_V3"
MISTRAL_V3_TEKKEN = "MISTRAL_V3_TEKKEN"
MISTRAL_V7 = "MISTRAL_V7"
MISTRAL_V7_TEKKEN = "MISTRAL_V7_TEKKEN"
PHI_3 = "PHI_3"
PHI_4 = "PHI_4"
FALCON_3 = "FALCON_3"
ZEPHYR = "ZEPHYR"
MONARCH = "MONARCH"
GEMMA = "GEMMA"
ORION = "ORION"
OPENCHAT = "OPENCHAT"
VICUNA = "VICUNA"
VICUNA_ORCA = "VICUNA_ORCA"
DEEPSEEK = "DEEPSEEK"
DEEPSEEK_2 = "DEEPSEEK_2"
DEEPSEEK_3 = "DEEPSEEK_3"
DEEPSEEK_OCR = "DEEPSEEK_OCR"
COMMAND_R = "COMMAND_R"
LLAMA_3 = "LLAMA_3"
CHATGLM_3 = "CHATGLM_3"
CHATGLM_4 = "CHATGLM_4"
GLMEDGE = "GLMEDGE"
MINICPM = "MINICPM"
EXAONE_3 = "EXAONE_3"
EXAONE_4 = "EXAONE_4"
EXAONE_MOE = "EXAONE_MOE"
RWKV_WORLD = "RWKV_WORLD"
GRANITE_3_X = "GRANITE_3_X"
GRANITE_4_0 = "GRANITE_4_0"
GRANITE_4_1 = "GRANITE_4_1"
GIGACHAT = "GIGACHAT"
MEGREZ = "MEGREZ"
YANDEX = "YANDEX"
BAILING = "BAILING"
BAILING_THINK = "BAILING_THINK"
BAILING2 = "BAILING2"
LLAMA4 = "LLAMA4"
SMOLVLM = "SMOLVLM"
DOTS1 = "DOTS1"  # detected only: the name table has no name for it
HUNYUAN_MOE = "HUNYUAN_MOE"
OPENAI_MOE = "OPENAI_MOE"
HUNYUAN_DENSE = "HUNYUAN_DENSE"
HUNYUAN_VL = "HUNYUAN_VL"
KIMI_K2 = "KIMI_K2"
SEED_OSS = "SEED_OSS"
GROK_2 = "GROK_2"
PANGU_EMBED = "PANGU_EMBED"
SOLAR_OPEN = "SOLAR_OPEN"

# LLM_CHAT_TEMPLATES: --chat-template's names (a std::map: listed in sorted order)
NAMES: dict[str, str] = dict(
    sorted(
        {
            "chatml": CHATML,
            "llama2": LLAMA_2,
            "llama2-sys": LLAMA_2_SYS,
            "llama2-sys-bos": LLAMA_2_SYS_BOS,
            "llama2-sys-strip": LLAMA_2_SYS_STRIP,
            "mistral-v1": MISTRAL_V1,
            "mistral-v3": MISTRAL_V3,
            "mistral-v3-tekken": MISTRAL_V3_TEKKEN,
            "mistral-v7": MISTRAL_V7,
            "mistral-v7-tekken": MISTRAL_V7_TEKKEN,
            "phi3": PHI_3,
            "phi4": PHI_4,
            "falcon3": FALCON_3,
            "zephyr": ZEPHYR,
            "monarch": MONARCH,
            "gemma": GEMMA,
            "orion": ORION,
            "openchat": OPENCHAT,
            "vicuna": VICUNA,
            "vicuna-orca": VICUNA_ORCA,
            "deepseek": DEEPSEEK,
            "deepseek2": DEEPSEEK_2,
            "deepseek3": DEEPSEEK_3,
            "deepseek-ocr": DEEPSEEK_OCR,
            "command-r": COMMAND_R,
            "llama3": LLAMA_3,
            "chatglm3": CHATGLM_3,
            "chatglm4": CHATGLM_4,
            "glmedge": GLMEDGE,
            "minicpm": MINICPM,
            "exaone3": EXAONE_3,
            "exaone4": EXAONE_4,
            "exaone-moe": EXAONE_MOE,
            "rwkv-world": RWKV_WORLD,
            "granite": GRANITE_3_X,
            "granite-4.0": GRANITE_4_0,
            "granite-4.1": GRANITE_4_1,
            "gigachat": GIGACHAT,
            "megrez": MEGREZ,
            "yandex": YANDEX,
            "bailing": BAILING,
            "bailing-think": BAILING_THINK,
            "bailing2": BAILING2,
            "llama4": LLAMA4,
            "smolvlm": SMOLVLM,
            "hunyuan-moe": HUNYUAN_MOE,
            "gpt-oss": OPENAI_MOE,
            "hunyuan-dense": HUNYUAN_DENSE,
            "hunyuan-vl": HUNYUAN_VL,
            "kimi-k2": KIMI_K2,
            "seed_oss": SEED_OSS,
            "grok-2": GROK_2,
            "pangu-embedded": PANGU_EMBED,
            "solar-open": SOLAR_OPEN,
        }.items()
    )
)

# every format, named or not
KINDS: tuple[str, ...] = (*dict.fromkeys(NAMES.values()), DOTS1)

# common_chat_templates_apply_legacy's refusal of a template none of the built-in ones
NOT_SUPPORTED = "this custom template is not supported, try using --jinja"


class BuiltinTemplateError(ValueError):
    """The template is none of llama.cpp's built-in ones; the text is llama-server's."""


_SPACE = " \t\n\v\f\r"  # isspace() in the C locale


def _trim(text: str) -> str:
    return text.strip(_SPACE)


def _upper(text: str) -> str:
    """std::toupper byte by byte in the C locale: ASCII letters only."""
    return "".join(chr(ord(c) - 32) if "a" <= c <= "z" else c for c in text)


def detect_template(tmpl: str) -> str | None:
    """llm_chat_detect_template: the format of a built-in name, else the one the template's
    text is recognised as (llama.cpp's tests, in its order); None for an unknown template."""
    if tmpl in NAMES:
        return NAMES[tmpl]

    def has(*needles: str) -> bool:
        return all(n in tmpl for n in needles)

    if has("<|im_start|>"):
        return PHI_4 if has("<|im_sep|>") else SMOLVLM if has("<end_of_utterance>") else CHATML
    if tmpl.startswith("mistral") or has("[INST]"):
        if has("[SYSTEM_PROMPT]"):
            return MISTRAL_V7
        if has("' [INST] ' + system_message") or has("[AVAILABLE_TOOLS]"):
            if has(" [INST]"):
                return MISTRAL_V1
            if has('"[INST]"'):
                return MISTRAL_V3_TEKKEN
            return MISTRAL_V3
        if has("content.strip()"):
            return LLAMA_2_SYS_STRIP
        if has("bos_token + '[INST]"):
            return LLAMA_2_SYS_BOS
        if has("<<SYS>>"):
            return LLAMA_2_SYS
        return LLAMA_2
    if has("<|assistant|>", "<|end|>"):
        return PHI_3
    if has("[gMASK]<sop>"):
        return CHATGLM_4
    if has("<|assistant|>", "<|user|>"):
        if has("<|tool_declare|>"):
            return EXAONE_MOE
        return FALCON_3 if has("</s>") else GLMEDGE
    if has("<|{{ item['role'] }}|>", "<|begin_of_image|>"):
        return GLMEDGE
    if has("<|user|>", "<|endoftext|>"):
        return ZEPHYR
    if has("bos_token + message['role']"):
        return MONARCH
    if has("<start_of_turn>"):
        return GEMMA
    if has("'\\n\\nAssistant: ' + eos_token"):
        return ORION
    if has("GPT4 Correct "):
        return OPENCHAT
    if has("USER: ", "ASSISTANT: "):
        return VICUNA_ORCA if has("SYSTEM: ") else VICUNA
    if has("### Instruction:", "<|EOT|>"):
        return DEEPSEEK
    if has("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>"):
        return COMMAND_R
    if has("<|start_header_id|>", "<|end_header_id|>"):
        return LLAMA_3
    if has("[gMASK]sop"):
        return CHATGLM_3
    if has("<用户>"):
        return MINICPM
    if has("'Assistant: ' + message['content'] + eos_token"):
        return DEEPSEEK_2
    if has("<｜Assistant｜>", "<｜User｜>", "<｜end▁of▁sentence｜>"):
        return DEEPSEEK_3
    if has("[|system|]", "[|assistant|]", "[|endofturn|]"):
        return EXAONE_4 if has("[|tool|]") else EXAONE_3
    if has("rwkv-world") or has("{{- 'User: ' + message['content']|trim + '\\n\\n' -}}"):
        return RWKV_WORLD
    if has("<|start_of_role|>"):
        if has("<tool_call>") or has("<tools>"):
            return GRANITE_4_0 if has("g4_default_system_message") else GRANITE_4_1
        return GRANITE_3_X
    if has(
        "message['role'] + additional_special_tokens[0] + message['content'] + "
        "additional_special_tokens[1]"
    ):
        return GIGACHAT
    if has("<|role_start|>"):
        return MEGREZ
    if has(" Ассистент:"):
        return YANDEX
    if has("<role>ASSISTANT</role>", "'HUMAN'"):
        return BAILING
    if has("<role>ASSISTANT</role>", '"HUMAN"', "<think>"):
        return BAILING_THINK
    if has("<role>ASSISTANT</role>", "<role>HUMAN</role>", "<|role_end|>"):
        return BAILING2
    if has("<|header_start|>", "<|header_end|>"):
        return LLAMA4
    if has("<|endofuserprompt|>"):
        return DOTS1
    if has("<|extra_0|>", "<|extra_4|>"):
        return HUNYUAN_MOE
    if has("<|start|>", "<|channel|>"):
        return OPENAI_MOE
    if has("<｜hy_Assistant｜>", "<｜hy_begin▁of▁sentence｜>"):
        return HUNYUAN_VL
    if has("<｜hy_Assistant｜>", "<｜hy_place▁holder▁no▁3｜>"):
        return HUNYUAN_DENSE
    if has("<|im_assistant|>assistant<|im_middle|>"):
        return KIMI_K2
    if has("<seed:bos>"):
        return SEED_OSS
    if has("'Assistant: '  + message['content'] + '<|separator|>"):
        return GROK_2
    if has("[unused9]系统：[unused10]"):
        return PANGU_EMBED
    if has("<|begin|>", "<|end|>", "<|content|>"):
        return SOLAR_OPEN
    return None


def apply_builtin(kind: str, chat: Sequence[tuple[str, str]], add_assistant: bool) -> str:
    """llm_chat_apply_template: the prompt of (role, content) pairs in format ``kind``, with the
    assistant's turn opened after them when ``add_assistant`` (where the format has one)."""
    out: list[str] = []
    w = out.append
    if kind == CHATML:
        for role, content in chat:
            w(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        if add_assistant:
            w("<|im_start|>assistant\n")
    elif kind in (MISTRAL_V7, MISTRAL_V7_TEKKEN):
        space = " " if kind == MISTRAL_V7 else ""
        for role, content in chat:
            if role == "system":
                w(f"[SYSTEM_PROMPT]{space}{content}[/SYSTEM_PROMPT]")
            elif role == "user":
                w(f"[INST]{space}{content}[/INST]")
            else:
                w(f"{space}{content}</s>")
    elif kind in (MISTRAL_V1, MISTRAL_V3, MISTRAL_V3_TEKKEN):
        leading = " " if kind == MISTRAL_V1 else ""
        trailing = "" if kind == MISTRAL_V3_TEKKEN else " "
        inside = False
        for role, content in chat:
            if not inside:
                w(f"{leading}[INST]{trailing}")
                inside = True
            if role == "system":
                w(f"{content}\n\n")
            elif role == "user":
                w(f"{content}{leading}[/INST]")
            else:
                w(f"{trailing}{_trim(content) if kind == MISTRAL_V3 else content}</s>")
                inside = False
    elif kind in (LLAMA_2, LLAMA_2_SYS, LLAMA_2_SYS_BOS, LLAMA_2_SYS_STRIP):
        inside = True
        w("[INST] ")
        for role, content in chat:
            text = _trim(content) if kind == LLAMA_2_SYS_STRIP else content
            if not inside:
                inside = True
                w("<s>[INST] " if kind == LLAMA_2_SYS_BOS else "[INST] ")
            if role == "system":
                w(f"<<SYS>>\n{text}\n<</SYS>>\n\n" if kind != LLAMA_2 else f"{text}\n")
            elif role == "user":
                w(f"{text} [/INST]")
            else:
                w(f"{text}</s>")
                inside = False
    elif kind == PHI_3:
        for role, content in chat:
            w(f"<|{role}|>\n{content}<|end|>\n")
        if add_assistant:
            w("<|assistant|>\n")
    elif kind == PHI_4:
        for role, content in chat:
            w(f"<|im_start|>{role}<|im_sep|>{content}<|im_end|>")
        if add_assistant:
            w("<|im_start|>assistant<|im_sep|>")
    elif kind == FALCON_3:
        for role, content in chat:
            w(f"<|{role}|>\n{content}\n")
        if add_assistant:
            w("<|assistant|>\n")
    elif kind == ZEPHYR:
        for role, content in chat:
            w(f"<|{role}|>\n{content}<|endoftext|>\n")
        if add_assistant:
            w("<|assistant|>\n")
    elif kind == MONARCH:
        for i, (role, content) in enumerate(chat):
            w(f"{'' if i == 0 else '<s>'}{role}\n{content}</s>\n")
        if add_assistant:
            w("<s>assistant\n")
    elif kind == GEMMA:
        system = ""
        for role, content in chat:
            if role == "system":
                system += _trim(content)
                continue
            role = "model" if role == "assistant" else role
            w(f"<start_of_turn>{role}\n")
            if system and role != "model":
                w(f"{system}\n\n")
                system = ""
            w(f"{_trim(content)}<end_of_turn>\n")
        if add_assistant:
            w("<start_of_turn>model\n")
    elif kind == ORION:
        system = ""
        for role, content in chat:
            if role == "system":
                system += content
            elif role == "user":
                w("Human: ")
                if system:
                    w(f"{system}\n\n")
                    system = ""
                w(f"{content}\n\nAssistant: </s>")
            else:
                w(f"{content}</s>")
    elif kind == OPENCHAT:
        for role, content in chat:
            if role == "system":
                w(f"{content}<|end_of_turn|>")
            else:
                w(f"GPT4 Correct {_upper(role[:1])}{role[1:]}: {content}<|end_of_turn|>")
        if add_assistant:
            w("GPT4 Correct Assistant:")
    elif kind in (VICUNA, VICUNA_ORCA):
        for role, content in chat:
            if role == "system":
                w(f"SYSTEM: {content}\n" if kind == VICUNA_ORCA else f"{content}\n\n")
            elif role == "user":
                w(f"USER: {content}\n")
            elif role == "assistant":
                w(f"ASSISTANT: {content}</s>\n")
        if add_assistant:
            w("ASSISTANT:")
    elif kind == DEEPSEEK:
        for role, content in chat:
            if role == "system":
                w(content)
            elif role == "user":
                w(f"### Instruction:\n{content}\n")
            elif role == "assistant":
                w(f"### Response:\n{content}\n<|EOT|>\n")
        if add_assistant:
            w("### Response:\n")
    elif kind == COMMAND_R:
        tokens = {
            "system": "<|SYSTEM_TOKEN|>",
            "user": "<|USER_TOKEN|>",
            "assistant": "<|CHATBOT_TOKEN|>",
        }
        for role, content in chat:
            if role in tokens:
                w(f"<|START_OF_TURN_TOKEN|>{tokens[role]}{_trim(content)}<|END_OF_TURN_TOKEN|>")
        if add_assistant:
            w("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")
    elif kind == LLAMA_3:
        for role, content in chat:
            w(f"<|start_header_id|>{role}<|end_header_id|>\n\n{_trim(content)}<|eot_id|>")
        if add_assistant:
            w("<|start_header_id|>assistant<|end_header_id|>\n\n")
    elif kind == CHATGLM_3:
        w("[gMASK]sop")
        for role, content in chat:
            w(f"<|{role}|>\n {content}")
        if add_assistant:
            w("<|assistant|>")
    elif kind == CHATGLM_4:
        w("[gMASK]<sop>")
        for role, content in chat:
            w(f"<|{role}|>\n{content}")
        if add_assistant:
            w("<|assistant|>\n")
    elif kind == GLMEDGE:
        for role, content in chat:
            w(f"<|{role}|>\n{content}")
        if add_assistant:
            w("<|assistant|>")
    elif kind == MINICPM:
        for role, content in chat:
            w(f"<用户>{_trim(content)}<AI>" if role == "user" else _trim(content))
    elif kind == DEEPSEEK_2:
        for role, content in chat:
            if role == "system":
                w(f"{content}\n\n")
            elif role == "user":
                w(f"User: {content}\n\n")
            elif role == "assistant":
                w(f"Assistant: {content}<｜end▁of▁sentence｜>")
        if add_assistant:
            w("Assistant:")
    elif kind == DEEPSEEK_3:
        for role, content in chat:
            if role == "system":
                w(f"{content}\n\n")
            elif role == "user":
                w(f"<｜User｜>{content}")
            elif role == "assistant":
                w(f"<｜Assistant｜>{content}<｜end▁of▁sentence｜>")
        if add_assistant:
            w("<｜Assistant｜>")
    elif kind == DEEPSEEK_OCR:
        for _, content in chat:
            w(content)
    elif kind in (EXAONE_3, EXAONE_4):
        for role, content in chat:
            if role == "system":
                w(f"[|system|]{_trim(content)}[|endofturn|]\n")
            elif role == "user":
                w(f"[|user|]{_trim(content)}\n")
            elif role == "assistant":
                w(f"[|assistant|]{_trim(content)}[|endofturn|]\n")
            elif role == "tool" and kind == EXAONE_4:
                w(f"[|tool|]{_trim(content)}[|endofturn|]\n")
        if add_assistant:
            w("[|assistant|]")
    elif kind == EXAONE_MOE:
        for role, content in chat:
            if role in ("system", "user", "assistant", "tool"):
                w(f"<|{role}|>\n{_trim(content)}<|endofturn|>\n")
        if add_assistant:
            w("<|assistant|>\n")
    elif kind == RWKV_WORLD:
        for i, (role, content) in enumerate(chat):
            if role == "system":
                w(f"System: {_trim(content)}\n\n")
            elif role == "user":
                w(f"User: {_trim(content)}\n\n")
                if i == len(chat) - 1:
                    w("Assistant:")
            elif role == "assistant":
                w(f"Assistant: {_trim(content)}\n\n")
    elif kind == GRANITE_3_X:
        for role, content in chat:
            w(f"<|start_of_role|>{role}<|end_of_role|>")
            if role == "assistant_tool_call":
                w("<|tool_call|>")
            w(f"{content}<|end_of_text|>\n")
        if add_assistant:
            w("<|start_of_role|>assistant<|end_of_role|>")
    elif kind in (GRANITE_4_0, GRANITE_4_1):
        for role, content in chat:
            if role == "assistant_tool_call":
                w("<|start_of_role|>assistant<|end_of_role|><|tool_call|>")
            else:
                w(f"<|start_of_role|>{role}<|end_of_role|>")
            w(f"{content}<|end_of_text|>\n")
        if add_assistant:
            w("<|start_of_role|>assistant<|end_of_role|>")
    elif kind == GIGACHAT:
        has_system = bool(chat) and chat[0][0] == "system"
        w(f"<s>{chat[0][1]}<|message_sep|>" if has_system else "<s>")
        for role, content in chat[1 if has_system else 0 :]:
            if role == "user":
                w(
                    f"user<|role_sep|>{content}<|message_sep|>"
                    "available functions<|role_sep|>[]<|message_sep|>"
                )
            elif role == "assistant":
                w(f"assistant<|role_sep|>{content}<|message_sep|>")
        if add_assistant:
            w("assistant<|role_sep|>")
    elif kind == MEGREZ:
        for role, content in chat:
            w(f"<|role_start|>{role}<|role_end|>{content}<|turn_end|>")
        if add_assistant:
            w("<|role_start|>assistant<|role_end|>")
    elif kind == YANDEX:
        for role, content in chat:
            if role == "user":
                w(f" Пользователь: {content}\n\n")
            elif role == "assistant":
                w(f" Ассистент: {content}\n\n")
        if add_assistant:
            w(" Ассистент:[SEP]")
    elif kind in (BAILING, BAILING_THINK):
        for role, content in chat:
            w(f"<role>{'HUMAN' if role == 'user' else _upper(role)}</role>{content}")
        if add_assistant:
            w("<role>ASSISTANT</role>")
            if kind == BAILING_THINK:
                w("<think>")
    elif kind == BAILING2:
        if not (chat and chat[0][0] == "system"):
            w("<role>SYSTEM</role>detailed thinking off<|role_end|>")
        for role, content in chat:
            w(f"<role>{'HUMAN' if role == 'user' else _upper(role)}</role>{content}<|role_end|>")
        if add_assistant:
            w("<role>ASSISTANT</role>")
    elif kind == LLAMA4:
        for role, content in chat:
            w(f"<|header_start|>{role}<|header_end|>\n\n{_trim(content)}<|eot|>")
        if add_assistant:
            w("<|header_start|>assistant<|header_end|>\n\n")
    elif kind == SMOLVLM:
        w("<|im_start|>")
        for role, content in chat:
            if role == "system":
                w(f"{content}\n\n")
            elif role == "user":
                w(f"User: {content}<end_of_utterance>\n")
            else:
                w(f"Assistant: {content}<end_of_utterance>\n")
        if add_assistant:
            w("Assistant:")
    elif kind == DOTS1:
        for role, content in chat:
            if role == "system":
                w(f"<|system|>{content}<|endofsystem|>")
            elif role == "user":
                w(f"<|userprompt|>{content}<|endofuserprompt|>")
            else:
                w(f"<|response|>{content}<|endofresponse|>")
        if add_assistant:
            w("<|response|>")
    elif kind == HUNYUAN_MOE:
        for role, content in chat:
            if role == "system":
                w(f"<|startoftext|>{content}<|extra_4|>")
            elif role == "assistant":
                w(f"{content}<|eos|>")
            else:
                w(f"<|startoftext|>{content}<|extra_0|>")
    elif kind == OPENAI_MOE:
        for role, content in chat:
            w(f"<|start|>{role}<|message|>{content}")
            w("<|return|>" if role == "assistant" else "<|end|>")
        if add_assistant:
            w("<|start|>assistant")
    elif kind == HUNYUAN_DENSE:
        for i, (role, content) in enumerate(chat):
            if i == 0 and role == "system":
                w(f"{content}<｜hy_place▁holder▁no▁3｜>")
            if role == "assistant":
                w(f"<｜hy_Assistant｜>{content}<｜hy_place▁holder▁no▁2｜>")
            elif role == "user":
                w(f"<｜hy_User｜>{content}<｜hy_Assistant｜>")
    elif kind == HUNYUAN_VL:
        w("<｜hy_begin▁of▁sentence｜>")
        for i, (role, content) in enumerate(chat):
            if i == 0 and role == "system":
                w(f"{content}<｜hy_place▁holder▁no▁3｜>")
            elif role == "user":
                w(f"{content}<｜hy_User｜>")
            elif role == "assistant":
                w(f"{content}<｜hy_Assistant｜>")
    elif kind == KIMI_K2:
        heads = {
            "system": "<|im_system|>system<|im_middle|>",
            "user": "<|im_user|>user<|im_middle|>",
            "assistant": "<|im_assistant|>assistant<|im_middle|>",
            "tool": "<|im_system|>tool<|im_middle|>",
        }
        for role, content in chat:
            w(f"{heads.get(role, '')}{content}<|im_end|>")
        if add_assistant:
            w("<|im_assistant|>assistant<|im_middle|>")
    elif kind == SEED_OSS:
        for role, content in chat:
            text = _trim(content) if role == "assistant" else content
            w(f"<seed:bos>{role}\n{text}<seed:eos>")
        if add_assistant:
            w("<seed:bos>assistant\n")
    elif kind == GROK_2:
        for role, content in chat:
            if role == "system":
                w(f"System: {_trim(content)}<|separator|>\n\n")
            elif role == "user":
                w(f"Human: {_trim(content)}<|separator|>\n\n")
            elif role == "assistant":
                w(f"Assistant: {content}<|separator|>\n\n")
        if add_assistant:
            w("Assistant:")
    elif kind == PANGU_EMBED:
        names = {
            "system": "系统",
            "user": "用户",
            "assistant": "助手",
            "tool": "工具",
            "function": "方法",
        }
        for i, (role, content) in enumerate(chat):
            if i == 0 and role != "system":
                w("[unused9]系统：[unused10]")
            if role in names:
                w(f"[unused9]{names[role]}：{content}[unused10]")
        if add_assistant:
            w("[unused9]助手：")
    elif kind == SOLAR_OPEN:
        for role, content in chat:
            w(f"<|begin|>{role}<|content|>{content}<|end|>")
        if add_assistant:
            w("<|begin|>assistant")
    else:
        raise BuiltinTemplateError(NOT_SUPPORTED)
    return "".join(out)


def legacy_content(message: Mapping[str, Any]) -> str:
    """A message's text as common_chat_templates_apply_legacy reads it: the string content,
    then each text (or media marker) part after a newline where there is text before it."""
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "media_marker"):
                continue
            if text:
                text += "\n"
            text += str(part.get("text") or "")
    return text


def _c_string(text: str) -> str:
    """The text as a C string reads it (llama_chat_message's role and content): up to its
    first NUL."""
    return text.split("\0", 1)[0]


def render_legacy(
    source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool
) -> str:
    """common_chat_templates_apply_legacy's prompt: ``source`` (the template's text, or a
    built-in name) detected, the messages' roles and texts written in that format.
    BuiltinTemplateError with llama-server's message when the template is not recognised."""
    kind = detect_template(source)
    if kind is None:
        raise BuiltinTemplateError(NOT_SUPPORTED)
    chat = [(_c_string(str(m.get("role", ""))), _c_string(legacy_content(m))) for m in messages]
    return apply_builtin(kind, chat, add_generation_prompt)


def supported(source: str) -> bool:
    """common_chat_verify_template without Jinja: whether the text is a built-in template."""
    return detect_template(source) is not None
