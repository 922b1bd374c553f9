"""bankml's API as an OpenAPI 3.1 document: the package's ``openapi.json``, read as it ships.

Pure Python (no Twisted), so the serving layer, tests and tools read one description. Each
operation names the addresses that answer it (``x-bankml-addresses``: ``listen`` is ``--listen``,
``engine`` the ``--upstream`` address bankml binds with ``--native``) and the modes that serve it
(``x-bankml-modes``: ``native``, ``p0``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, NamedTuple

METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
ADDRESSES = ("listen", "engine")
MODES = ("native", "p0")


class Route(NamedTuple):
    method: str  # upper case, as on the wire
    path: str  # as in the document, path parameters in braces: /slots/{id}
    address: str  # "listen" or "engine"


@lru_cache(maxsize=1)
def _raw() -> bytes:
    return resources.files("bankml").joinpath("openapi.json").read_bytes()


def description_bytes() -> bytes:
    """The document's bytes, as a server sends them (``application/json``)."""
    return _raw()


def load_description() -> dict[str, Any]:
    """The document, parsed afresh (a caller may change its copy)."""
    return json.loads(_raw())


def routes(mode: str = "native") -> list[Route]:
    """Every (method, path, address) the document describes for `mode`, in document order."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    out: list[Route] = []
    for path, item in load_description()["paths"].items():
        for method in METHODS:
            operation = item.get(method)
            if operation is None or mode not in operation["x-bankml-modes"]:
                continue
            addresses = ["listen"] if mode == "p0" else operation["x-bankml-addresses"]
            out += [Route(method.upper(), path, address) for address in addresses]
    return out
