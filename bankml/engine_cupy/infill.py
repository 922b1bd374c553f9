"""llama-server's ``/infill`` prompt: the fill-in-the-middle tokens a /completion then runs.

``infill_tokens`` checks a body in llama-server's order and lays out its prompt as llama-server
does (its repo-level pattern):

    [FIM_REP]myproject\\n [FIM_SEP]file0\\n text0 ... [FIM_SEP]filename\\n
    [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

(``spm_infill``: the suffix part before the prefix part). Without a FIM_SEP token each extra
chunk follows a ``--- snippet ---`` line instead, without a FIM_REP token there is no project
line. The prefix keeps its last ``3 * (n_batch // 4)`` tokens, the suffix its first
``n_batch // 4 - 2 - len(prompt)``; the extra context keeps its last
``n_ctx - n_batch - 2 * n_predict`` tokens (``n_batch`` the server's -b, ``n_predict`` its -n,
``n_ctx`` a slot's context). A model without the prefix, suffix and middle tokens is refused
(501), as llama-server refuses it, before the body is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bankml.engine_cupy.request import RequestError, json_type

Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special)

_SNIPPET = "\n\n--- snippet ---\n\n"
_EXTRA_TYPE = '"input_extra" must be an array of {"filename": string, "text": string}'
_CHUNK_TEXT = 'extra_context chunk must contain a "text" field with a string value'
_CHUNK_FILENAME = 'extra_context chunk\'s "filename" field must be a string'


def fim_problem(special: Mapping[str, int | None]) -> str | None:
    """llama-server's refusal of a model without FIM tokens, or None."""
    missing = "".join(
        f"{name} token is missing. "
        for role, name in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle"))
        if special.get(role) is None
    )
    return f"Infill is not supported by this model: {missing}" if missing else None


def _mixed(tokenize: Tokenize, value: Any) -> list[int]:
    """tokenize_mixed(value, add_special=false, parse_special=false): a string, or strings and
    ids (nlohmann's get<llama_token> takes a number or a boolean)."""
    if isinstance(value, list):
        out: list[int] = []
        for part in value:
            if isinstance(part, str):
                out += tokenize(part, False, False)
            elif isinstance(part, (int, float)):
                out.append(int(part))
            else:
                raise RequestError(
                    f"[json.exception.type_error.302] type must be number, but is {json_type(part)}"
                )
        return out
    if not isinstance(value, str):
        raise RequestError(
            f"[json.exception.type_error.302] type must be string, but is {json_type(value)}"
        )
    return tokenize(value, False, False)


def infill_tokens(
    body: Mapping[str, Any],
    special: Mapping[str, int | None],
    tokenize: Tokenize,
    add_bos: bool,
    n_batch: int,
    n_predict: int,
    n_ctx: int,
    spm_infill: bool = False,
) -> list[int]:
    """handle_infill's checks then format_prompt_infill's tokens (see the module doc).
    llama-server's "prompt"/"input_prefix"/"input_suffix" messages that it sets and then
    overwrites are not given: a prompt that is not a string is the empty prompt, a missing
    prefix or suffix is nlohmann's missing key (the suffix's first)."""
    problem = fim_problem(special)
    if problem is not None:
        raise RequestError(
            problem,
            501,
            {"error": {"code": 501, "message": problem, "type": "not_supported_error"}},
        )
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise RequestError(_EXTRA_TYPE)
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise RequestError(_CHUNK_TEXT)
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise RequestError(_CHUNK_FILENAME)
    prompt = body.get("prompt")
    prompt_tokens = tokenize(prompt, False, True) if isinstance(prompt, str) else []
    for key in ("input_suffix", "input_prefix"):
        if key not in body:
            raise RequestError(f"[json.exception.out_of_range.403] key '{key}' not found")
    prefix = _mixed(tokenize, body["input_prefix"])
    suffix = _mixed(tokenize, body["input_suffix"])
    return layout(
        special,
        tokenize,
        add_bos,
        prefix,
        suffix,
        [(c.get("filename", "tmp"), c["text"]) for c in extra],
        prompt_tokens,
        n_batch,
        n_predict,
        n_ctx,
        spm_infill,
    )


def layout(
    special: Mapping[str, int | None],
    tokenize: Tokenize,
    add_bos: bool,
    prefix: list[int],
    suffix: list[int],
    extra: Sequence[tuple[str, str]],
    prompt: list[int],
    n_batch: int,
    n_predict: int,
    n_ctx: int,
    spm_infill: bool,
) -> list[int]:
    """format_prompt_infill on tokenized parts: ``extra`` is (filename, text) per chunk."""
    pre, suf, mid = special["fim_pre"], special["fim_suf"], special["fim_mid"]
    rep, sep = special.get("fim_rep"), special.get("fim_sep")
    assert pre is not None and suf is not None and mid is not None
    extra_tokens: list[int] = []
    if rep is not None:
        extra_tokens += [rep, *tokenize("myproject\n", False, False)]
    for filename, text in extra:
        if sep is not None:
            extra_tokens += [sep, *tokenize(filename + "\n", False, False)]
        else:
            extra_tokens += tokenize(_SNIPPET, False, False)
        extra_tokens += tokenize(text, False, False)
    if sep is not None:
        extra_tokens += [sep, *tokenize("filename\n", False, False)]
    n_prefix_take = min(len(prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_tokens))
    prefix_part = [pre, *prefix[len(prefix) - n_prefix_take :], *prompt]
    suffix_part = [suf, *suffix[:n_suffix_take]]
    first, last = (suffix_part, prefix_part) if spm_infill else (prefix_part, suffix_part)
    if add_bos:
        bos = special.get("bos")
        first = [-1 if bos is None else bos, *first]  # llama_vocab_bos: LLAMA_TOKEN_NULL
    kept = extra_tokens[len(extra_tokens) - n_extra_take :]
    return [*kept, *first, *last, mid]
