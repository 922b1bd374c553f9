"""``bankml convert``: a Hugging Face safetensors directory to a pinned GGUF (docs/modules/convert.md)."""

from bankml.convert.convert import OUTTYPES, Converted, convert
from bankml.convert.errors import ConvertError

__all__ = ["OUTTYPES", "ConvertError", "Converted", "convert"]
