"""The registry of pinned and derived models (pure, no Twisted).

- ``names``: a file's model name, its suffix-less alias, a derived model's name check.
- ``keepalive``: ``keep_alive`` values (Go durations, seconds, 0, negative).
- ``header``: what listings show of a GGUF header (architecture, weight type, size label).
- ``pins``: every model pinned by a ``*.FORK.json`` in a directory, plus the startup model.
- ``residency``: which model is loaded, its expiry, and the re-verification of every load.
- ``modelfile``: Ollama's Modelfile grammar.
- ``layer``: a derived model's layer: its rules, merges, range checks and digest.
- ``manifest``: ``<name>.MODEL.json`` written atomically and read back (digest and pin checked).
- ``create``: ``create``, ``copy`` and ``delete`` of derived models, and their status lines.
- ``catalog``: name resolution over pins and derived models.
- ``cli``: ``bankml create NAME -f Modelfile [--registry DIR] [--models DIR]``.
"""
