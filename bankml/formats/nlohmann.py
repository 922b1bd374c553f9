"""JSON as llama-server reads and writes it (nlohmann::json), for every body bankml sends.

- ``dumps``: compact, UTF-8 kept as it is, a NaN or infinity written as null.
- ``loads_json``: a request body as strictly as nlohmann reads it (no NaN or Infinity, no number
  beyond a double).
- ``json_type``, ``c_int``, ``c_float``, ``json_string``, ``json_flag``: nlohmann's conversions
  and the type errors they print, so a refusal reads as llama-server's.

Pure Python: no Twisted, no NumPy.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

INT_MIN, INT_MAX = -(2**31), 2**31 - 1


# json.dumps with these options builds an encoder per call; one kept encoder writes the same
# text (a streamed answer dumps an event per token)
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def dumps(obj: Any) -> bytes:
    """JSON as llama-server (nlohmann) writes it: compact, UTF-8 kept as it is, and a NaN or
    infinity written as null (never Python's NaN/Infinity, which are not JSON)."""
    try:
        text = _ENCODER.encode(obj)
    except ValueError:  # rare: a non-finite float somewhere; walk the object only then
        text = _ENCODER.encode(finite_or_null(obj))
    return text.encode("utf-8", "surrogatepass")


def finite_or_null(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None, as nlohmann's dump writes it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def _not_json(name: str) -> Any:
    """Python reads NaN, Infinity and -Infinity; JSON (and nlohmann) has no such values."""
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent; one beyond a double's range is nlohmann's
    parse error (Python would read it as an infinity)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number overflow parsing '{text}'")
    return value


def check_unicode(obj: Any) -> None:
    """ValueError for a string (a value or a key) that is not Unicode text: a lone surrogate,
    which Python's reader keeps from a ``\\ud800`` escape (or the bytes ED A0 80) and nlohmann
    refuses; UTF-8 cannot encode it, so it would fail in the tokenizer. Walked without recursion:
    the depth is the client's."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
            strings: Any = item.keys()
        elif isinstance(item, list):
            stack.extend(item)
            continue
        elif isinstance(item, str):
            strings = (item,)
        else:
            continue
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(
                    f"invalid string: lone surrogate U+{ord(text[err.start]):04X} (not Unicode text)"
                ) from None


def loads_json(raw: bytes) -> Any:
    """A request body as JSON, as strictly as nlohmann reads it (no NaN or Infinity, no number
    beyond a double, no lone surrogate, no nesting past Python's recursion limit); ValueError
    when it is not JSON."""
    try:
        obj = json.loads(raw, parse_constant=_not_json, parse_float=_finite_float)
    except RecursionError:
        raise ValueError("nested too deep") from None
    if b"\\u" in raw or b"\xed" in raw:  # a surrogate comes from an escape or CESU-8 bytes
        check_unicode(obj)
    return obj


def json_type(value: Any) -> str:
    """nlohmann's type_name() of a parsed JSON value, as its type errors print it."""
    return {bool: "boolean", str: "string", list: "array", dict: "object", type(None): "null"}.get(
        type(value), "number"
    )


def type_error(expected: str, value: Any) -> ValueError:
    """nlohmann's conversion error (type_error.302) for ``value`` read as ``expected``."""
    return ValueError(
        f"[json.exception.type_error.302] type must be {expected}, but is {json_type(value)}"
    )


def json_string(value: Any) -> str:
    """nlohmann's get<std::string>."""
    if not isinstance(value, str):
        raise type_error("string", value)
    return value


def json_flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """json_value(body, name, default): anything but a boolean reads as the default."""
    value = body.get(name)
    return value if isinstance(value, bool) else default


def c_int(value: Any) -> int:
    """nlohmann's get<int> (a llama_token): any number converts as C++ converts it, a boolean
    to 0/1, an integer wrapping to 32 bits, a double truncated (x86's INT_MIN where it does not
    fit); anything else is its type error."""
    if isinstance(value, bool) or isinstance(value, int) and -(2**63) <= value < 2**64:
        return (int(value) - INT_MIN) % 2**32 + INT_MIN
    if isinstance(value, (int, float)):  # an integer beyond 64 bits is a double to nlohmann
        fits = math.isfinite(value) and INT_MIN <= math.trunc(value) <= INT_MAX
        return math.trunc(value) if fits else INT_MIN
    raise type_error("number", value)


def c_float(value: Any) -> Any:
    """A C ``float`` as nlohmann writes it: widened to double (0.8 -> 0.800000011920929);
    infinities and NaN (and doubles beyond a float's range, which become infinities) are null."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return value
    try:
        widened = struct.unpack("<f", struct.pack("<f", float(value)))[0]
    except OverflowError:
        return None
    return widened if math.isfinite(widened) else None
