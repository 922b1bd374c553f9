"""bankml: a verifying loopback gateway for local GGUF language models."""

__version__ = "0.1.0"
