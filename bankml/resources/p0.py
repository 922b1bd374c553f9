"""The P0 resource tree: bankml's own endpoints, and llama-server's behind the checks.

```
/bankml, /bankml/usage, /bankml/metrics   resources/bankml.py
/openapi.json                             resources/description.py (the API's description)
/health, /props, /v1/models               ProxyGet (passed through)
/v1/chat/completions                      ChatProxy (receipt added)
anything else                             404 {"error": {"code": 404, "message": "File Not Found", ...}}
```
"""

from __future__ import annotations

from twisted.web.resource import Resource

from bankml.gateway import Gateway
from bankml.proxy_resource import ChatProxy, ProxyGet
from bankml.resources.bankml import BankmlResource
from bankml.resources.description import ApiDescription
from bankml.serving.routes import Branch, LlamaRoute
from bankml.usage import UsageSampler


def p0_root(gateway: Gateway, sampler: UsageSampler) -> Resource:
    root = Branch()
    root.putChild(b"bankml", BankmlResource(gateway, sampler))
    root.putChild(b"openapi.json", LlamaRoute(ApiDescription()))
    for name in (b"health", b"props"):
        root.putChild(name, ProxyGet(gateway, "/" + name.decode()))
    v1 = Branch()
    root.putChild(b"v1", v1)
    v1.putChild(b"models", ProxyGet(gateway, "/v1/models"))
    chat = Branch()
    v1.putChild(b"chat", chat)
    chat.putChild(b"completions", ChatProxy(gateway))
    return root
