"""bankml.formats.nlohmann.dumps (one kept encoder) writes what json.dumps with its options
writes, byte for byte, with non-finite floats as null."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from bankml.formats.nlohmann import dumps, finite_or_null

OBJECTS: list[Any] = [
    None,
    0,
    -1.5,
    0.1 + 0.2,
    1e300,
    "plain",
    "é ü 日本 🐉",
    'quote " backslash \\ newline \n tab \t nul \x00 \x1f',
    "\ud800 lone surrogate",
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": " dragon"}}]},
    {"nested": {"list": [1, 2.5, "x", True, False, None, [], {}]}},
    [{"logprob": -0.25, "top_logprobs": [{"id": 5, "bytes": [32, 100]}]}],
]


@pytest.mark.parametrize("obj", OBJECTS, ids=range(len(OBJECTS)))
def test_dumps_writes_what_json_dumps_writes(obj: Any) -> None:
    want = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    assert dumps(obj) == want.encode("utf-8", "surrogatepass")


def test_non_finite_floats_are_null_however_deep() -> None:
    obj = {"a": [math.nan, 1.0, {"b": math.inf}], "c": -math.inf}
    assert dumps(obj) == b'{"a":[null,1.0,{"b":null}],"c":null}'
    assert finite_or_null(obj) == {"a": [None, 1.0, {"b": None}], "c": None}
    assert dumps({"ok": 1.0}) == b'{"ok":1.0}'  # the encoder is used again after a refusal
