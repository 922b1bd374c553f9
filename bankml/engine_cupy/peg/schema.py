"""Questions about a parsed JSON schema that the PEG grammar writer asks (common/json-schema.cpp).

may_be_string(node) -> bool   whether a value the schema allows may be a string, through any
                              branch (a reference cycle counts as not a string)
"""

from __future__ import annotations

from bankml.engine_cupy.json_schema_grammar import Alternatives, Const, Enum, Node, Ref


def may_be_string(node: Node, visiting: set[int] | None = None) -> bool:
    visiting = set() if visiting is None else visiting
    if node.kind == "string":
        return True
    if isinstance(node, Const):
        return isinstance(node.value, str)
    if isinstance(node, Enum):
        return any(isinstance(v, str) for v in node.values)
    if isinstance(node, Ref):
        target = node.target
        if target is None or id(target) in visiting:
            return False
        visiting.add(id(target))
        result = may_be_string(target, visiting)
        visiting.discard(id(target))
        return result
    if isinstance(node, Alternatives):
        if node.kind == "any_of":
            return any(may_be_string(child, visiting) for child in node.children)
        # all_of: every child must allow a string; an unconstrained child says nothing
        any_string = False
        for child in node.children:
            if child.kind == "any":
                continue
            if not may_be_string(child, visiting):
                return False
            any_string = True
        return any_string
    return False


# common_chat_schema::value_type, in its order (a type set is a bit mask of them)
TYPE_NULL, TYPE_BOOLEAN, TYPE_NUMBER, TYPE_INTEGER, TYPE_STRING, TYPE_ARRAY, TYPE_OBJECT = (
    "null",
    "boolean",
    "number",
    "integer",
    "string",
    "array",
    "object",
)
ALL_TYPES = frozenset(
    (TYPE_NULL, TYPE_BOOLEAN, TYPE_NUMBER, TYPE_INTEGER, TYPE_STRING, TYPE_ARRAY, TYPE_OBJECT)
)


def _json_type(value: object) -> str:
    if value is None:
        return TYPE_NULL
    if isinstance(value, bool):
        return TYPE_BOOLEAN
    if isinstance(value, int):
        return TYPE_INTEGER
    if isinstance(value, float):
        return TYPE_NUMBER
    if isinstance(value, str):
        return TYPE_STRING
    return TYPE_ARRAY if isinstance(value, list) else TYPE_OBJECT


_KIND_TYPES = {
    "any": ALL_TYPES,
    "null": frozenset((TYPE_NULL,)),
    "boolean": frozenset((TYPE_BOOLEAN,)),
    "number": frozenset((TYPE_NUMBER, TYPE_INTEGER)),
    "integer": frozenset((TYPE_INTEGER,)),
    "string": frozenset((TYPE_STRING,)),
    "array": frozenset((TYPE_ARRAY,)),
    "tuple": frozenset((TYPE_ARRAY,)),
    "object": frozenset((TYPE_OBJECT,)),
}


def value_types(node: Node, visiting: set[int] | None = None) -> frozenset[str]:
    """The JSON types a value the schema allows may have (common_chat_schema::value_types); a
    reference cycle contributes none."""
    visiting = set() if visiting is None else visiting
    if node.kind in _KIND_TYPES:
        return _KIND_TYPES[node.kind]
    if isinstance(node, Const):
        return frozenset((_json_type(node.value),))
    if isinstance(node, Enum):
        return frozenset(_json_type(v) for v in node.values)
    if isinstance(node, Ref):
        target = node.target
        if target is None or id(target) in visiting:
            return frozenset()
        visiting.add(id(target))
        result = value_types(target, visiting)
        visiting.discard(id(target))
        return result
    if isinstance(node, Alternatives):
        if node.kind == "any_of":
            types: frozenset[str] = frozenset()
            for child in node.children:
                types |= value_types(child, visiting)
            return types
        types = ALL_TYPES
        for child in node.children:
            types &= value_types(child, visiting)
        return types
    return frozenset()
