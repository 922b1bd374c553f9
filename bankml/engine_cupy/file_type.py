"""A GGUF file's type as llama-server names it (``/props`` model_ftype, ``/v1/models`` meta.ftype).

llama.cpp takes ``general.file_type`` (a ``llama_ftype``) when the header has it; otherwise it
guesses from the commonest tensor type, counted in its loader's tensor order (layer, then name;
the first type to reach the top count wins), and marks the name "(guessed)". The names are
``llama_ftype_name``'s, e.g. "Q4_K - Medium", "all F32", "IQ4_NL - 4.5 bpw".
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable

GUESSED = 1024  # LLAMA_FTYPE_GUESSED: not specified in the file

# llama_ftype -> llama_ftype_name
FTYPE_NAMES: dict[int, str] = {
    0: "all F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K - Medium",
    11: "Q3_K - Small",
    12: "Q3_K - Medium",
    13: "Q3_K - Large",
    14: "Q4_K - Small",
    15: "Q4_K - Medium",
    16: "Q5_K - Small",
    17: "Q5_K - Medium",
    18: "Q6_K",
    19: "IQ2_XXS - 2.0625 bpw",
    20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small",
    22: "IQ3_XS - 3.3 bpw",
    23: "IQ3_XXS - 3.0625 bpw",
    24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw",
    26: "IQ3_S - 3.4375 bpw",
    27: "IQ3_S mix - 3.66 bpw",
    28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw",
    30: "IQ4_XS - 4.25 bpw",
    31: "IQ1_M - 1.75 bpw",
    32: "BF16",
    36: "TQ1_0 - 1.69 bpw ternary",
    37: "TQ2_0 - 2.06 bpw ternary",
    38: "MXFP4 MoE",
    39: "NVFP4",
    40: "Q1_0",
    41: "Q2_0",
}

# ggml tensor type name -> the llama_ftype the loader guesses from it (any other type: all F32)
GUESS_FROM_TENSOR_TYPE: dict[str, int] = {
    "F32": 0,
    "F16": 1,
    "BF16": 32,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q8_0": 7,
    "Q2_K": 10,
    "Q3_K": 12,
    "Q4_K": 15,
    "Q5_K": 17,
    "Q6_K": 18,
    "TQ1_0": 36,
    "TQ2_0": 37,
    "IQ2_XXS": 19,
    "IQ2_XS": 20,
    "IQ2_S": 28,
    "IQ3_XXS": 23,
    "IQ1_S": 24,
    "IQ1_M": 31,
    "IQ4_NL": 25,
    "IQ4_XS": 30,
    "IQ3_S": 26,
    "NVFP4": 39,
    "Q1_0": 40,
    "Q2_0": 41,
}


def ftype_name(ftype: int) -> str:
    """``llama_ftype_name``: the name, prefixed "(guessed) " when the GUESSED bit is set."""
    name = FTYPE_NAMES.get(ftype & ~GUESSED, "unknown, may not work")
    return f"(guessed) {name}" if ftype & GUESSED else name


def _loader_order(name: str) -> tuple[int, str]:
    """The loader's weight_name_comparer: sscanf's "blk.%d." layer (-1 for none), then the name."""
    match = re.match(r"blk\.\s*([+-]?\d+)", name)
    return (int(match.group(1)) if match else -1, name)


def guess_ftype(tensors: Iterable[tuple[str, str]]) -> int:
    """The loader's guess from (tensor name, ggml type name) pairs, GUESSED bit set."""
    counts: dict[str, int] = {}
    top, top_type = 0, "F32"
    for _, type_name in sorted(tensors, key=lambda t: _loader_order(t[0])):
        counts[type_name] = counts.get(type_name, 0) + 1
        if counts[type_name] > top:
            top, top_type = counts[type_name], type_name
    return GUESS_FROM_TENSOR_TYPE.get(top_type, 0) | GUESSED


def model_ftype(file_type: int | None, tensors: Iterable[tuple[str, str]]) -> str:
    """The name llama-server reports: general.file_type's when present, else the guess's."""
    return ftype_name(guess_ftype(tensors) if file_type is None else int(file_type))


@functools.lru_cache(maxsize=8)
def file_ftype_name(path: str | os.PathLike[str]) -> str:
    """``model_ftype`` of a GGUF file, read from its header (cached: a served file is pinned)."""
    from bankml.engine_cupy.gguf_file import metadata
    from bankml.engine_cupy.weights import open_reader

    reader = open_reader(path)
    value = metadata(reader, ["general.file_type"]).get("general.file_type")
    file_type = None if value is None else int(value)
    return model_ftype(file_type, ((t.name, t.tensor_type.name) for t in reader.tensors))
