"""JSON schemas as llama-server's GBNF grammars, text for text.

llama-server reads a schema in two steps, and so does this module: ``parse_schema`` checks it
and builds typed nodes (refusing what falls outside the convertible subset, with llama-server's
``JSON schema error at <path>: <why>``), then ``_Converter`` writes the GBNF rules: one rule per
named part, properties in schema order, required ones first, optional ones as nested ``-rest``
rules, integer bounds as digit ranges, string formats, lengths and anchored patterns, item counts
through bounded repetitions, and the ``space`` rule between tokens. The rules come out sorted by
name, one ``name ::= body`` a line.

    schema_to_gbnf(schema)                          /completion's ``json_schema``
    chat_schema_gbnf(schema, generation_prompt)     a chat request's ``response_format`` (the chat
                                                    template's answer parser: the generation
                                                    prompt, blanks, then the value bare or in a
                                                    ```json fence)

Both raise ``SchemaConversionError`` with llama-server's text (``JSON schema conversion failed:``
and the reasons, one a line). A pattern the converter cannot express is accepted as any string,
as llama-server does (it only logs a warning).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT_MAX = 2**31 - 1

SPACE_RULE = '| " " | "\\n"{1,2} [ \\t]{0,20}'

# name -> (body, dependencies)
PRIMITIVE_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "boolean": ('("true" | "false")', ()),
    "decimal-part": ("[0-9]{1,16}", ()),
    "integral-part": ("[0] | [1-9] [0-9]{0,15}", ()),
    "number": (
        '("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
        ("integral-part", "decimal-part"),
    ),
    "integer": ('("-"? integral-part)', ("integral-part",)),
    "value": (
        "object | array | string | number | boolean | null",
        ("object", "array", "string", "number", "boolean", "null"),
    ),
    "object": (
        '"{" space ( string ":" space value ("," space string ":" space value)* )? space "}"',
        ("string", "value"),
    ),
    "array": ('"[" space ( value ("," space value)* )? space "]"', ("value",)),
    "uuid": (
        '"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} '
        '"-" [0-9a-fA-F]{12} "\\""',
        (),
    ),
    "char": ('[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})', ()),
    "string": ('"\\"" char* "\\""', ("char",)),
    "null": ('"null"', ()),
}

STRING_FORMAT_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "date": (
        '[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )',
        (),
    ),
    "time": (
        '([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? '
        '( "Z" | ( "+" | "-" ) ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )',
        (),
    ),
    "date-time": ('date "T" time', ("date", "time")),
    "date-string": ('"\\"" date "\\""', ("date",)),
    "time-string": ('"\\"" time "\\""', ("time",)),
    "date-time-string": ('"\\"" date-time "\\""', ("date-time",)),
}

RESERVED_NAMES = frozenset({"root", *PRIMITIVE_RULES, *STRING_FORMAT_RULES})

# The rules of the chat template's JSON value parser, present in every chat schema grammar.
CHAT_JSON_RULES: dict[str, str] = {
    "json-array": '"[" space ("]" | json-value (space "," space json-value)* space "]")',
    "json-bool": '"true" | "false"',
    "json-null": '"null"',
    "json-number": '"-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? (("e" | "E") [+-]? [0-9]+)?',
    "json-object": (
        '"{" space ("}" | json-string space ":" space json-value '
        '(space "," space json-string space ":" space json-value)* space "}")'
    ),
    "json-string": '"\\"" ( [^"\\\\] | "\\\\" ( ["\\\\/ bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\\""',
    "json-value": "json-object | json-array | json-string | json-number | json-bool | json-null",
}

_INVALID_RULE_CHARS = re.compile(r"[^a-zA-Z0-9-]+")
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_LITERAL_ESCAPE = re.compile(r'[\r\n"\\]')
_NON_LITERAL = frozenset("|.()[]{}*+?^$")
_ESCAPED_IN_REGEX_NOT_LITERAL = frozenset("^$.[]()|{}*+?")
MAX_PATTERN_DEPTH = 100


CONVERSION_FAILED = "JSON schema conversion failed:\n"
# a chat request's schema is compiled with the chat template's answer parser, which says so
CHAT_PARSER_FAILED = (
    "Unable to generate parser for this template. Automatic parser generation failed: "
)


class SchemaConversionError(ValueError):
    """A schema llama-server refuses; the message is its text."""


class _SchemaError(Exception):
    """One reason, before the ``JSON schema conversion failed:`` heading is put on."""


# --- the schema as typed nodes (llama-server's common_chat_schema_from_json) -------------------------


@dataclass
class Node:
    kind: str  # any ref any_of all_of const enum null boolean number integer string array tuple object


@dataclass
class Ref(Node):
    ref: str = ""
    target: Node | None = None


@dataclass
class Alternatives(Node):  # any_of / all_of
    children: list[Node] = field(default_factory=list)


@dataclass
class Const(Node):
    value: Any = None


@dataclass
class Enum(Node):
    values: list[Any] = field(default_factory=list)


@dataclass
class Integer(Node):
    minimum: int = INT64_MIN
    maximum: int = INT64_MAX


@dataclass
class String(Node):
    pattern: str = ""
    format: str = ""  # "", "uuid", "date", "time", "date-time"
    min_length: int = 0
    max_length: int = -1


@dataclass
class Array(Node):
    items: Node = field(default_factory=lambda: Node("any"))
    min_items: int = 0
    max_items: int = -1


@dataclass
class Tuple(Node):
    items: list[Node] = field(default_factory=list)


@dataclass
class Property:
    name: str
    schema: Node
    required: bool


@dataclass
class Object(Node):
    properties: list[Property] = field(default_factory=list)
    additional: Node | None = None  # None: no other property allowed


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return _is_int(v) or isinstance(v, float)


class _Builder:
    def __init__(self, root: Any):
        self.root = root
        self.refs: dict[str, Node | None] = {}
        self.pending: list[Ref] = []

    @staticmethod
    def fail(path: str, msg: str) -> None:
        raise _SchemaError(f"JSON schema error at {path}: {msg}")

    def build(self) -> Node:
        node = self.node(self.root, "#")
        for ref in self.pending:
            ref.target = self.refs[ref.ref]
        return node

    def count(self, schema: dict, key: str, path: str, default: int) -> int:
        if key not in schema:
            return default
        value = schema[key]
        if not _is_int(value) or value < 0:
            self.fail(path, f"{key} must be a non-negative integer")
        return value

    def bound(self, schema: dict, key: str, path: str, round_up: bool) -> int:
        value = schema[key]
        if _is_int(value):
            return value
        if not _is_number(value):
            self.fail(path, f"{key} must be a number")
        return int(math.ceil(value) if round_up else math.floor(value))

    def format(self, schema: dict, path: str) -> str:
        if "format" not in schema:
            return ""
        value = schema["format"]
        if not isinstance(value, str):
            self.fail(path, "format must be a string")
        if value in ("date", "time", "date-time"):
            return value
        if value == "uuid" or (
            len(value) == 5 and value.startswith("uuid") and "1" <= value[4] <= "5"
        ):
            return "uuid"
        return ""

    def resolve(self, ref: str, path: str) -> Any:
        target = self.root
        for sel in ref[1:].split("/")[1:]:
            if isinstance(target, dict) and sel in target:
                target = target[sel]
            elif isinstance(target, list):
                idx = int(sel) if sel.isdigit() else len(target)
                if idx >= len(target):
                    self.fail(path, f"cannot resolve $ref {ref}, {sel} is out of range")
                target = target[idx]
            else:
                self.fail(path, f"cannot resolve $ref {ref}, {sel} not found")
        return target

    def ref(self, value: Any, path: str) -> Node:
        if not isinstance(value, str):
            self.fail(path, "$ref must be a string")
        if not value.startswith("#/"):
            self.fail(
                path,
                f"unsupported $ref {value}, only references into the same document are supported",
            )
        if value not in self.refs:
            self.refs[value] = None  # a cycle back to this $ref stops here
            self.refs[value] = self.node(self.resolve(value, path), value)
        node = Ref("ref", value)
        self.pending.append(node)
        return node

    def alternatives(self, kind: str, alts: Any, path: str) -> Node:
        if not isinstance(alts, list):
            self.fail(path, "must be an array of schemas")
        if not alts:
            self.fail(path, "must not be empty")
        return Alternatives(kind, [self.node(a, f"{path}/{i}") for i, a in enumerate(alts)])

    def object(self, schema: dict, path: str) -> Node:
        node = Object("object")
        required: set[str] = set()
        if isinstance(schema.get("required"), list):
            required = {n for n in schema["required"] if isinstance(n, str)}
        if "properties" in schema:
            properties = schema["properties"]
            if not isinstance(properties, dict):
                self.fail(path, "properties must be an object")
            for name, prop in properties.items():
                node.properties.append(
                    Property(name, self.node(prop, f"{path}/properties/{name}"), name in required)
                )
        if "additionalProperties" in schema:
            additional = schema["additionalProperties"]
            if isinstance(additional, bool):
                if additional:
                    node.additional = Node("any")
            elif isinstance(additional, dict):
                node.additional = self.node(additional, f"{path}/additionalProperties")
            else:
                self.fail(path, "additionalProperties must be a boolean or a schema")
        elif "properties" not in schema:
            node.additional = Node("any")  # {"type": "object"} alone accepts any object
        return node

    def array(self, schema: dict, path: str) -> Node:
        node = Array("array")
        if "items" in schema or "prefixItems" in schema:
            key = "items" if "items" in schema else "prefixItems"
            items = schema[key]
            if isinstance(items, list):
                return Tuple(
                    "tuple", [self.node(it, f"{path}/{key}/{i}") for i, it in enumerate(items)]
                )
            node.items = self.node(items, f"{path}/{key}")
        node.min_items = self.count(schema, "minItems", path, 0)
        node.max_items = self.count(schema, "maxItems", path, -1)
        return node

    def string(self, schema: dict, path: str) -> Node:
        node = String("string")
        if "pattern" in schema:
            if not isinstance(schema["pattern"], str):
                self.fail(path, "pattern must be a string")
            node.pattern = schema["pattern"]
        node.format = self.format(schema, path)
        node.min_length = self.count(schema, "minLength", path, 0)
        node.max_length = self.count(schema, "maxLength", path, -1)
        return node

    def integer(self, schema: dict, path: str) -> Node:
        node = Integer("integer")
        if "minimum" in schema:
            node.minimum = self.bound(schema, "minimum", path, True)
        elif "exclusiveMinimum" in schema:
            node.minimum = self.bound(schema, "exclusiveMinimum", path, False) + 1
        if "maximum" in schema:
            node.maximum = self.bound(schema, "maximum", path, False)
        elif "exclusiveMaximum" in schema:
            node.maximum = self.bound(schema, "exclusiveMaximum", path, True) - 1
        return node

    def node(self, schema: Any, path: str) -> Node:
        if not isinstance(schema, dict):
            self.fail(path, "schema must be an object")
        if "$ref" in schema:
            return self.ref(schema["$ref"], path)
        if "oneOf" in schema or "anyOf" in schema:
            key = "oneOf" if "oneOf" in schema else "anyOf"
            return self.alternatives("any_of", schema[key], f"{path}/{key}")
        typ = schema.get("type")
        if isinstance(typ, list):
            # {"type": ["a", "b"], ...} is {"anyOf": [{"type": "a", ...}, {"type": "b", ...}]}
            if not typ:
                self.fail(path, "type must not be empty")
            return Alternatives(
                "any_of",
                [self.node({**schema, "type": t}, f"{path}/type/{i}") for i, t in enumerate(typ)],
            )
        if "const" in schema:
            return Const("const", schema["const"])
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                self.fail(path, "enum must be a non-empty array")
            return Enum("enum", list(values))
        if typ is not None and not isinstance(typ, str):
            self.fail(path, "type must be a string or an array of strings")
        name = typ or ""
        has_properties = "properties" in schema or (
            "additionalProperties" in schema and schema["additionalProperties"] is not True
        )
        if not name:
            if has_properties:
                return self.object(schema, path)
            if "allOf" in schema:
                return self.alternatives("all_of", schema["allOf"], f"{path}/allOf")
            if "items" in schema or "prefixItems" in schema:
                return self.array(schema, path)
            if (
                "pattern" in schema
                or "minLength" in schema
                or "maxLength" in schema
                or self.format(schema, path)
            ):
                return self.string(schema, path)
            return Node("any")
        if name == "object":
            if not has_properties and "allOf" in schema:
                return self.alternatives("all_of", schema["allOf"], f"{path}/allOf")
            return self.object(schema, path)
        if name == "string":
            if "allOf" in schema:
                return self.alternatives("all_of", schema["allOf"], f"{path}/allOf")
            return self.string(schema, path)
        if name == "array":
            return self.array(schema, path)
        if name == "integer":
            return self.integer(schema, path)
        if name in ("number", "boolean", "null"):
            return Node(name)
        self.fail(path, f"unrecognized type {name}")
        raise AssertionError  # fail raised


def parse_schema(schema: Any) -> Node:
    """The typed nodes of a schema; raises SchemaConversionError where llama-server refuses it."""
    try:
        return _Builder(schema).build()
    except _SchemaError as err:
        raise SchemaConversionError(f"{CONVERSION_FAILED}{err}") from None


# --- GBNF text helpers -------------------------------------------------------------------------------


def dump_json(value: Any) -> str:
    """JSON text as llama-server writes it (no spaces, UTF-8 kept)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def format_literal(literal: str) -> str:
    return '"' + _LITERAL_ESCAPE.sub(lambda m: _LITERAL_ESCAPES[m.group()], literal) + '"'


def build_repetition(item: str, min_items: int, max_items: int, separator: str = "") -> str:
    has_max = max_items != INT_MAX
    if max_items == 0:
        return ""
    if min_items == 0 and max_items == 1:
        return item + "?"
    if not separator:
        if min_items == 1 and not has_max:
            return item + "+"
        if min_items == 0 and not has_max:
            return item + "*"
        return f"{item}{{{min_items},{max_items if has_max else ''}}}"
    result = (
        item
        + " "
        + build_repetition(
            f"({separator} {item})",
            0 if min_items == 0 else min_items - 1,
            max_items - 1 if has_max else max_items,
        )
    )
    return f"({result})?" if min_items == 0 else result


def _digit_range(out: list[str], lo: str, hi: str) -> None:
    out.append(f"[{lo}]" if lo == hi else f"[{lo}-{hi}]")


def _more_digits(out: list[str], min_digits: int, max_digits: int) -> None:
    out.append("[0-9]")
    if min_digits == max_digits == 1:
        return
    out.append("{")
    out.append(str(min_digits))
    if max_digits != min_digits:
        out.append(",")
        if max_digits != INT_MAX:
            out.append(str(max_digits))
    out.append("}")


def _uniform_range(out: list[str], lo: str, hi: str) -> None:
    i = 0
    while i < len(lo) and i < len(hi) and lo[i] == hi[i]:
        i += 1
    if i > 0:
        out.append(f'"{lo[:i]}"')
    if i < len(lo) and i < len(hi):
        if i > 0:
            out.append(" ")
        sub_len = len(lo) - i - 1
        if sub_len > 0:
            lo_sub, hi_sub = lo[i + 1 :], hi[i + 1 :]
            zeros, nines = "0" * sub_len, "9" * sub_len
            to_reached = False
            out.append("(")
            if lo_sub == zeros:
                _digit_range(out, lo[i], chr(ord(hi[i]) - 1))
                out.append(" ")
                _more_digits(out, sub_len, sub_len)
            else:
                out.append(f"[{lo[i]}] (")
                _uniform_range(out, lo_sub, nines)
                out.append(")")
                if ord(lo[i]) < ord(hi[i]) - 1:
                    out.append(" | ")
                    if hi_sub == nines:
                        _digit_range(out, chr(ord(lo[i]) + 1), hi[i])
                        to_reached = True
                    else:
                        _digit_range(out, chr(ord(lo[i]) + 1), chr(ord(hi[i]) - 1))
                    out.append(" ")
                    _more_digits(out, sub_len, sub_len)
            if not to_reached:
                out.append(" | ")
                _digit_range(out, hi[i], hi[i])
                out.append(" ")
                _uniform_range(out, zeros, hi_sub)
            out.append(")")
        else:
            out.append(f"[{lo[i]}-{hi[i]}]")


def build_min_max_int(
    lo: int, hi: int, out: list[str], decimals_left: int = 16, top_level: bool = True
) -> None:
    """The digit-range grammar of the integers in [lo, hi] (INT64_MIN / INT64_MAX: unbounded)."""
    has_min, has_max = lo != INT64_MIN, hi != INT64_MAX
    if has_min and has_max:
        if lo < 0 and hi < 0:
            out.append('"-" (')
            build_min_max_int(-hi, -lo, out, decimals_left, True)
            out.append(")")
            return
        if lo < 0:
            out.append('"-" (')
            build_min_max_int(0, -lo, out, decimals_left, True)
            out.append(") | ")
            lo = 0
        lo_s, hi_s = str(lo), str(hi)
        for digits in range(len(lo_s), len(hi_s)):
            _uniform_range(out, lo_s, "9" * digits)
            lo_s = "1" + "0" * digits
            out.append(" | ")
        _uniform_range(out, lo_s, hi_s)
        return
    less_decimals = max(decimals_left - 1, 1)
    if has_min:
        if lo < 0:
            out.append('"-" (')
            build_min_max_int(INT64_MIN, -lo, out, decimals_left, False)
            out.append(") | [0] | [1-9] ")
            _more_digits(out, 0, decimals_left - 1)
        elif lo == 0:
            if top_level:
                out.append("[0] | [1-9] ")
                _more_digits(out, 0, less_decimals)
            else:
                _more_digits(out, 1, decimals_left)
        elif lo <= 9:
            c = str(lo)
            start = "1" if top_level else "0"
            if c > start:
                _digit_range(out, start, chr(ord(c) - 1))
                out.append(" ")
                _more_digits(out, 1, less_decimals)
                out.append(" | ")
            _digit_range(out, c, "9")
            out.append(" ")
            _more_digits(out, 0, less_decimals)
        else:
            lo_s = str(lo)
            c = lo_s[0]
            if c > "1":
                _digit_range(out, "1" if top_level else "0", chr(ord(c) - 1))
                out.append(" ")
                _more_digits(out, len(lo_s), less_decimals)
                out.append(" | ")
            _digit_range(out, c, c)
            out.append(" (")
            build_min_max_int(int(lo_s[1:]), INT64_MAX, out, less_decimals, False)
            out.append(")")
            if c < "9":
                out.append(" | ")
                _digit_range(out, chr(ord(c) + 1), "9")
                out.append(" ")
                _more_digits(out, len(lo_s) - 1, less_decimals)
        return
    if has_max:
        if hi >= 0:
            if top_level:
                out.append('"-" [1-9] ')
                _more_digits(out, 0, less_decimals)
                out.append(" | ")
            build_min_max_int(0, hi, out, decimals_left, True)
        else:
            out.append('"-" (')
            build_min_max_int(-hi, INT64_MAX, out, decimals_left, False)
            out.append(")")
        return
    raise ValueError("At least one of min_value or max_value must be set")


def _escape_length(pattern: str, pos: int) -> int:
    """Length of a GBNF escape at pos (keep in step with llama.cpp's grammar parser), 0 if none."""
    if pos + 1 >= len(pattern) or pattern[pos] != "\\":
        return 0
    nxt = pattern[pos + 1]
    if nxt in 'trn\\"[]-':
        return 2
    n_hex = {"x": 2, "u": 4, "U": 8}.get(nxt)
    if n_hex is None or pos + 2 + n_hex > len(pattern):
        return 0
    if not all(h in "0123456789abcdefABCDEF" for h in pattern[pos + 2 : pos + 2 + n_hex]):
        return 0
    return 2 + n_hex


def _stoi(text: str) -> int:
    """std::stoi: leading blanks, a sign and digits; anything after is ignored."""
    m = re.match(r"[ \t\n\v\f\r]*([+-]?\d+)", text)
    if not m:
        raise ValueError(text)
    value = int(m.group(1))
    if not -(2**31) <= value <= INT_MAX:
        raise ValueError(text)
    return value


class _UnsupportedPattern(Exception):
    pass


class _InvalidPattern(Exception):
    pass


# --- the converter (llama-server's common_chat_schema_converter) ---------------------------------------


class _Converter:
    def __init__(self, dotall: bool = False):
        self.dotall = dotall
        self.rules: dict[str, str] = {"space": SPACE_RULE}
        self.refs_being_resolved: set[str] = set()
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def add_rule(self, name: str, rule: str) -> str:
        esc = _INVALID_RULE_CHARS.sub("-", name)
        if esc not in self.rules or self.rules[esc] == rule:
            self.rules[esc] = rule
            return esc
        i = 0
        while f"{esc}{i}" in self.rules and self.rules[f"{esc}{i}"] != rule:
            i += 1
        key = f"{esc}{i}"
        self.rules[key] = rule
        return key

    def add_primitive(self, name: str, rule: tuple[str, tuple[str, ...]]) -> str:
        n = self.add_rule(name, rule[0])
        for dep in rule[1]:
            dep_rule = PRIMITIVE_RULES.get(dep) or STRING_FORMAT_RULES.get(dep)
            if dep_rule is None:
                self.errors.append(f"Rule {dep} not known")
                continue
            if dep not in self.rules:
                self.add_primitive(dep, dep_rule)
        return n

    def format_grammar(self) -> str:
        return "".join(f"{k} ::= {v}\n" for k, v in sorted(self.rules.items()))

    def check_errors(self) -> None:
        if self.errors:
            raise _SchemaError(CONVERSION_FAILED + "\n".join(self.errors))

    # -- patterns

    def visit_pattern(self, pattern: str, name: str) -> str:
        snapshot = dict(self.rules)
        try:
            return self.pattern_to_rule(pattern, name)
        except _UnsupportedPattern as err:
            self.rules = snapshot
            self.warnings.append(
                f"pattern {pattern} is not supported ({err}), accepting any string"
            )
            return self.add_rule(name, self.add_primitive("string", PRIMITIVE_RULES["string"]))
        except _InvalidPattern as err:
            self.rules = snapshot
            self.errors.append(f"Invalid pattern {pattern}: {err}")
            return ""

    def pattern_to_rule(self, pattern: str, name: str) -> str:
        if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
            raise _UnsupportedPattern("not anchored with '^' and '$'")
        sub = pattern[1:-1]
        sub_rule_ids: dict[str, str] = {}
        state = {"i": 0, "depth": 0}
        length = len(sub)

        def to_rule(ls: tuple[str, bool]) -> str:
            return f'"{ls[0]}"' if ls[1] else ls[0]

        def get_dot() -> str:
            rule = "[\\U00000000-\\U0010FFFF]" if self.dotall else "[^\\x0A\\x0D]"
            return self.add_rule("dot", rule)

        def transform() -> tuple[str, bool]:
            seq: list[tuple[str, bool]] = []

            def join_seq() -> tuple[str, bool]:
                ret: list[tuple[str, bool]] = []
                literal = ""
                for item in seq:
                    if item[1]:
                        literal += item[0]
                    else:
                        if literal:
                            ret.append((literal, True))
                            literal = ""
                        ret.append(item)
                if literal:
                    ret.append((literal, True))
                return " ".join(to_rule(x) for x in ret), False

            while state["i"] < length:
                i = state["i"]
                c = sub[i]
                if c == ".":
                    seq.append((get_dot(), False))
                    state["i"] += 1
                elif c == "(":
                    state["i"] += 1
                    i = state["i"]
                    if i < length and sub[i] == "?":
                        if i + 1 < length and sub[i + 1] == ":":
                            state["i"] += 2
                        else:
                            raise _UnsupportedPattern("unsupported group syntax")
                    state["depth"] += 1
                    if state["depth"] > MAX_PATTERN_DEPTH:
                        raise _UnsupportedPattern("pattern nesting too deep")
                    seq.append(("(" + to_rule(transform()) + ")", False))
                elif c == ")":
                    state["i"] += 1
                    if state["depth"] == 0:
                        raise _InvalidPattern("unbalanced parentheses")
                    state["depth"] -= 1
                    return join_seq()
                elif c in "^$":
                    raise _UnsupportedPattern("anchor inside the pattern")
                elif c == "[":
                    brackets = c
                    i += 1
                    while i < length and sub[i] != "]":
                        if sub[i] == "\\":
                            n = _escape_length(sub, i)
                            if n == 0:
                                raise _UnsupportedPattern(
                                    "unsupported escape in character class: " + sub[i : i + 2]
                                )
                            brackets += sub[i : i + n]
                            i += n
                        else:
                            brackets += sub[i]
                            i += 1
                    if i >= length:
                        raise _InvalidPattern("unterminated character class")
                    brackets += "]"
                    state["i"] = i + 1
                    seq.append((brackets, False))
                elif c == "|":
                    seq.append(("|", False))
                    state["i"] += 1
                elif c in "*+?":
                    if not seq:
                        raise _InvalidPattern("nothing to repeat")
                    seq[-1] = (to_rule(seq[-1]) + c, False)
                    state["i"] += 1
                elif c == "{":
                    curly = c
                    i += 1
                    while i < length and sub[i] != "}":
                        curly += sub[i]
                        i += 1
                    if i >= length:
                        raise _UnsupportedPattern("unterminated curly brackets")
                    curly += "}"
                    state["i"] = i + 1
                    nums = curly[1:-1].split(",")
                    min_times, max_times = 0, INT_MAX
                    if len(nums) not in (1, 2):
                        raise _UnsupportedPattern("wrong number of values in curly brackets")
                    try:
                        if len(nums) == 1:
                            min_times = max_times = _stoi(nums[0])
                        else:
                            if nums[0]:
                                min_times = _stoi(nums[0])
                            if nums[1]:
                                max_times = _stoi(nums[1])
                    except ValueError:
                        raise _UnsupportedPattern("invalid number in curly brackets") from None
                    if not seq:
                        raise _InvalidPattern("nothing to repeat")
                    last, is_literal = seq[-1]
                    if not is_literal:
                        if last not in sub_rule_ids:
                            sub_rule_ids[last] = ""
                            sub_rule_ids[last] = self.add_rule(f"{name}-{len(sub_rule_ids)}", last)
                        last = sub_rule_ids[last]
                    seq[-1] = (
                        build_repetition(f'"{last}"' if is_literal else last, min_times, max_times),
                        False,
                    )
                else:
                    literal = ""
                    while i < length:
                        if sub[i] == "\\":
                            if i == length - 1:
                                raise _InvalidPattern("trailing backslash")
                            nxt = sub[i + 1]
                            if nxt in _ESCAPED_IN_REGEX_NOT_LITERAL:
                                literal += nxt
                                i += 2
                            else:
                                n = _escape_length(sub, i)
                                if n == 0:
                                    raise _UnsupportedPattern(
                                        "unsupported escape: " + sub[i : i + 2]
                                    )
                                literal += sub[i : i + n]
                                i += n
                        elif sub[i] == '"':
                            literal += '\\"'
                            i += 1
                        elif sub[i] not in _NON_LITERAL and (
                            i == length - 1
                            or not literal
                            or sub[i + 1] == "."
                            or sub[i + 1] not in _NON_LITERAL
                        ):
                            literal += sub[i]
                            i += 1
                        else:
                            break
                    state["i"] = i
                    if not literal:  # nothing was consumed, e.g. a stray ']' or '}'
                        raise _UnsupportedPattern("unsupported character: " + c)
                    seq.append((literal, True))
            return join_seq()

        rule = to_rule(transform())
        if state["depth"] != 0:
            raise _InvalidPattern("unbalanced parentheses")
        return self.add_rule(name, f'"\\"" ({rule}) "\\""')

    # -- objects

    def not_strings(self, strings: Sequence[str]) -> str:
        """A JSON string that is none of ``strings`` (a trie of their characters)."""
        trie: dict[str, Any] = {}
        root_is_word = False
        for s in strings:
            node = trie
            if not s:
                root_is_word = True
            for ch in s:
                node = node.setdefault(ch, {})
        char_rule = self.add_primitive("char", PRIMITIVE_RULES["char"])
        out = ['["] ( ']

        def visit(node: dict[str, Any]) -> None:
            rejects = ""
            for i, ch in enumerate(sorted(node, key=ord)):
                child = node[ch]
                rejects += ch
                if i:
                    out.append(" | ")
                out.append(f"[{ch}]")
                if child:
                    out.append(" (")
                    visit(child)
                    out.append(")")
                else:
                    out.append(f" {char_rule}+")
            if node:
                out.append(f' | [^"{rejects}] {char_rule}*')

        visit(trie)
        out.append(" )")
        if not root_is_word:
            out.append("?")
        out.append(' ["]')
        return "".join(out)

    def resolve_ref(self, node: Ref) -> str:
        fragment = node.ref[node.ref.find("#") + 1 :] if "#" in node.ref else node.ref
        ref_name = "ref" + _INVALID_RULE_CHARS.sub("-", fragment)
        if ref_name not in self.rules and node.ref not in self.refs_being_resolved:
            if node.target is None:
                self.errors.append(f"Unresolved $ref {node.ref}")
                return ""
            self.refs_being_resolved.add(node.ref)
            ref_name = self.visit(node.target, ref_name)
            self.refs_being_resolved.discard(node.ref)
        return ref_name

    def object_rule(
        self,
        properties: Sequence[tuple[str, Node]],
        required: set[str],
        name: str,
        additional: Node | None,
    ) -> str:
        dash = "-" if name else ""
        required_props: list[str] = []
        optional_props: list[str] = []
        kv_names: dict[str, str] = {}
        prop_names: list[str] = []
        for prop_name, prop_schema in properties:
            prop_rule = self.visit(prop_schema, f"{name}{dash}{prop_name}")
            kv_names[prop_name] = self.add_rule(
                f"{name}{dash}{prop_name}-kv",
                f'{format_literal(dump_json(prop_name))} space ":" space {prop_rule}',
            )
            (required_props if prop_name in required else optional_props).append(prop_name)
            prop_names.append(prop_name)
        if additional is not None:
            sub_name = f"{name}{dash}additional"
            value_rule = (
                self.visit(additional, f"{sub_name}-value")
                if additional.kind != "any"
                else self.add_primitive("value", PRIMITIVE_RULES["value"])
            )
            key_rule = (
                self.add_primitive("string", PRIMITIVE_RULES["string"])
                if not prop_names
                else self.add_rule(f"{sub_name}-k", self.not_strings(prop_names))
            )
            kv_names["*"] = self.add_rule(f"{sub_name}-kv", f'{key_rule} ":" space {value_rule}')
            optional_props.append("*")
        if not required_props and not optional_props:
            return '"{" space "}"'
        rule = '"{" space ' + ' "," space '.join(kv_names[p] for p in required_props)
        if optional_props:
            rule += " ("
            if required_props:
                rule += ' "," space ( '

            def recursive_refs(ks: Sequence[str], first_is_optional: bool) -> str:
                if not ks:
                    return ""
                k = ks[0]
                kv = kv_names[k]
                comma_ref = f'( "," space {kv} )'
                if first_is_optional:
                    res = comma_ref + ("*" if k == "*" else "?")
                else:
                    res = kv + (" " + comma_ref + "*" if k == "*" else "")
                if len(ks) > 1:
                    res += " " + self.add_rule(
                        f"{name}{dash}{k}-rest", recursive_refs(ks[1:], True)
                    )
                return res

            rule += " | ".join(
                recursive_refs(optional_props[i:], False) for i in range(len(optional_props))
            )
            if required_props:
                rule += " )"
            rule += " )?"
        return rule + ' space "}"'

    def visit_all_of(self, node: Alternatives, name: str, rule_name: str) -> str:
        required: set[str] = set()
        properties: list[tuple[str, Node]] = []
        enum_values: dict[str, int] = {}

        def add_component(comp: Node, is_required: bool) -> None:
            if isinstance(comp, Ref):
                if comp.target is not None:
                    add_component(comp.target, is_required)
            elif isinstance(comp, Object):
                for prop in comp.properties:
                    properties.append((prop.name, prop.schema))
                    if is_required:
                        required.add(prop.name)
            elif isinstance(comp, Enum):
                for v in comp.values:
                    key = format_literal(dump_json(v))
                    enum_values[key] = enum_values.get(key, 0) + 1

        for child in node.children:
            if isinstance(child, Alternatives) and child.kind == "any_of":
                for alt in child.children:
                    add_component(alt, False)
            else:
                add_component(child, True)
        if enum_values:
            # std::map order: the literals sorted bytewise
            common = [
                k
                for k in sorted(enum_values, key=lambda s: s.encode())
                if enum_values[k] == len(node.children)
            ]
            if common:
                return self.add_rule(rule_name, "(" + " | ".join(common) + ")")
        return self.add_rule(rule_name, self.object_rule(properties, required, name, None))

    def visit_primitive(self, rule_name: str, typ: str) -> str:
        return self.add_primitive("root" if rule_name == "root" else typ, PRIMITIVE_RULES[typ])

    def visit(self, node: Node, name: str) -> str:
        rule_name = name + "-" if name in RESERVED_NAMES else (name or "root")
        sub_name = name + ("-" if name else "")
        kind = node.kind
        if isinstance(node, Ref):
            return self.add_rule(rule_name, self.resolve_ref(node))
        if isinstance(node, Alternatives):
            if kind == "all_of":
                return self.visit_all_of(node, name, rule_name)
            rules = [
                self.visit(alt, name + ("-" if name else "alternative-") + str(i))
                for i, alt in enumerate(node.children)
            ]
            return self.add_rule(rule_name, " | ".join(rules))
        if isinstance(node, Const):
            return self.add_rule(rule_name, format_literal(dump_json(node.value)))
        if isinstance(node, Enum):
            values = [format_literal(dump_json(v)) for v in node.values]
            return self.add_rule(rule_name, "(" + " | ".join(values) + ")")
        if isinstance(node, Object):
            if (
                not node.properties
                and node.additional is not None
                and node.additional.kind == "any"
            ):
                return self.add_rule(
                    rule_name, self.add_primitive("object", PRIMITIVE_RULES["object"])
                )
            required = {p.name for p in node.properties if p.required}
            props = [(p.name, p.schema) for p in node.properties]
            return self.add_rule(
                rule_name, self.object_rule(props, required, name, node.additional)
            )
        if isinstance(node, Tuple):
            parts = [self.visit(it, f"{sub_name}tuple-{i}") for i, it in enumerate(node.items)]
            return self.add_rule(rule_name, '"[" space ' + ' "," space '.join(parts) + ' space "]"')
        if isinstance(node, Array):
            if node.items.kind == "any" and node.min_items == 0 and node.max_items < 0:
                return self.visit_primitive(rule_name, "array")
            item = self.visit(node.items, f"{sub_name}item")
            max_items = INT_MAX if node.max_items < 0 else node.max_items
            body = build_repetition(item, node.min_items, max_items, '"," space')
            return self.add_rule(rule_name, f'"[" space {body} space "]"')
        if isinstance(node, String):
            if node.pattern:
                return self.visit_pattern(node.pattern, rule_name)
            if node.format == "uuid":
                return self.visit_primitive(rule_name, "uuid")
            if node.format:
                prim = f"{node.format}-string"
                return self.add_rule(rule_name, self.add_primitive(prim, STRING_FORMAT_RULES[prim]))
            if node.min_length > 0 or node.max_length >= 0:
                char = self.add_primitive("char", PRIMITIVE_RULES["char"])
                max_len = INT_MAX if node.max_length < 0 else node.max_length
                rep = build_repetition(char, node.min_length, max_len)
                return self.add_rule(rule_name, f'"\\"" {rep} "\\""')
            return self.visit_primitive(rule_name, "string")
        if isinstance(node, Integer):
            if node.minimum == INT64_MIN and node.maximum == INT64_MAX:
                return self.visit_primitive(rule_name, "integer")
            out = ["("]
            build_min_max_int(node.minimum, node.maximum, out)
            out.append(")")
            return self.add_rule(rule_name, "".join(out))
        if kind in ("number", "boolean", "null"):
            return self.visit_primitive(rule_name, kind)
        return self.add_rule(rule_name, self.add_primitive("value", PRIMITIVE_RULES["value"]))


def schema_to_gbnf(schema: Any) -> str:
    """The GBNF llama-server's converter builds for a schema (/completion's ``json_schema``)."""
    node = parse_schema(schema)
    conv = _Converter()
    conv.visit(node, "")
    try:
        conv.check_errors()
    except _SchemaError as err:
        raise SchemaConversionError(str(err)) from None
    return conv.format_grammar()


def chat_schema_gbnf(schema: Any, generation_prompt: str) -> str:
    """The GBNF a chat request's schema gets from llama-server's chat template parser (for a
    template without reasoning or tool calls): the generation prompt, blanks, and the value
    either bare or inside a ```json fence. The sampler is fed the generation prompt before the
    first draw (``without_prefix``)."""
    conv = _Converter()
    try:
        node = _Builder(schema).build()
        schema_rule = conv.visit(node, "response-format-schema")
        conv.check_errors()
    except _SchemaError as err:
        raise SchemaConversionError(f"{CHAT_PARSER_FAILED}{err}") from None
    for name, body in CHAT_JSON_RULES.items():
        conv.add_rule(name, body)
    conv.add_rule("response-format", schema_rule)
    prefix = format_literal(generation_prompt) + " " if generation_prompt else ""
    conv.add_rule(
        "root",
        f'{prefix}space space ("```json" space response-format space "```"'
        " | space response-format space)",
    )
    return conv.format_grammar()


def without_prefix(grammar: str, generation_prompt: str) -> str:
    """The grammar after the generation prompt's tokens were accepted: the root's leading
    literal taken away (what the sampler's prefill does to llama-server's grammar state)."""
    if not generation_prompt:
        return grammar
    head = f"root ::= {format_literal(generation_prompt)} "
    lines = [
        line[:9] + line[len(head) :] if line.startswith(head) else line
        for line in grammar.split("\n")
    ]
    return "\n".join(lines)
