"""``GET /openapi.json``: the OpenAPI 3.1 description of bankml's API, as the package ships it.

The bytes are ``bankml/openapi.json`` unchanged (``bankml.openapi.description_bytes``), so a
client, a fuzzer or a code generator reads the same document the tests check the server against.
Both modes and both addresses serve it; behind ``LlamaRoute`` another method is the usual 404.
"""

from __future__ import annotations

from typing import Any

from twisted.web.server import NOT_DONE_YET, Request

from bankml.openapi import description_bytes
from bankml.serving.writers import JsonResource, write_json


class ApiDescription(JsonResource):
    isLeaf = True

    def render_GET(self, request: Request) -> Any:
        write_json(request, 200, description_bytes())
        return NOT_DONE_YET
