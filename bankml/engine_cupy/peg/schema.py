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
