"""twistd plugin: `twistd -n bankml --fork FORK.json FILE ...` (options: bankml/tap.py).

ServiceMaker provides IPlugin and IServiceMaker and imports bankml.tap only when the plugin is
used, so listing twistd's plugins stays cheap.
"""

from twisted.application.service import ServiceMaker

bankml = ServiceMaker(
    "bankml",
    "bankml.tap",
    "A verifying loopback gateway for a pinned GGUF model, with a receipt on every answer",
    "bankml",
)
