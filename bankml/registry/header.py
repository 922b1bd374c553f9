"""What the registry shows of a GGUF header: architecture, weight type, size label, defaults.

The header is read with the guard's own bounds-checked parser (the same prefix growth as
``guard_file``), so a listing never trusts a length the guard would not. Arrays are not decoded
(the parser reports them as ``<array n>``); only scalars and strings are kept.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bankml.gate.guard import PREFIX_BYTES, _NeedMore, _parse, _Reader, _Refuse, type_name


class HeaderError(ValueError):
    """A header the guard's parser refuses, or a truncated one."""


@dataclass(frozen=True)
class HeaderInfo:
    arch: str | None
    quant: str  # the most frequent tensor type other than F32 ("F32" when there is none)
    n_params: int  # every tensor's elements
    size_label: str | None
    kv: dict[str, Any] = field(repr=False)  # scalar and string keys only

    @property
    def parameter_size(self) -> str:
        """``general.size_label``, else the element count as ``X.YB`` (>= 1e9) or ``NM``."""
        if self.size_label:
            return self.size_label
        if self.n_params >= 1_000_000_000:
            return f"{self.n_params / 1e9:.1f}B"
        return f"{self.n_params / 1e6:.0f}M"

    @property
    def chat_template(self) -> str | None:
        value = self.kv.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    def sampling_metadata(self) -> dict[str, Any]:
        """The ``general.sampling.*`` keys (the model's own sampling defaults)."""
        return {k: v for k, v in self.kv.items() if k.startswith("general.sampling.")}

    def scalar_keys(self) -> dict[str, Any]:
        """Every scalar or string key, sorted by name (Ollama's ``model_info``)."""
        return dict(sorted(self.kv.items()))


def most_frequent_type(counts: dict[str, int]) -> str:
    """The commonest weight type other than F32 (the norms), ties to the lower type id."""
    types = {k: v for k, v in counts.items() if k != "F32"}
    return max(types, key=types.__getitem__) if types else "F32"


def _is_array(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("<array ") and value.endswith(">")


def read_header(path: str | os.PathLike[str]) -> HeaderInfo:
    """The header of a GGUF file; raises HeaderError (refused or truncated) or OSError."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = f.read(min(PREFIX_BYTES, size))
        while True:
            try:
                _version, kv, tensors, *_ = _parse(_Reader(memoryview(buf)))
                break
            except _NeedMore as more:
                if not len(buf) < more.end <= size:
                    raise HeaderError("GGUF header truncated") from None
                extra = f.read(min(max(more.end, 2 * len(buf)), size) - len(buf))
                if not extra:
                    raise HeaderError("GGUF header truncated") from None
                buf += extra
            except _Refuse as refused:
                raise HeaderError(refused.reason) from None
    ids = Counter(t.type_id for t in tensors)
    counts = {type_name(tid): ids[tid] for tid in sorted(ids)}
    scalars = {k: v for k, v in kv.items() if not _is_array(v)}
    arch = kv.get("general.architecture")
    label = kv.get("general.size_label")
    return HeaderInfo(
        arch=None if arch is None else str(arch),
        quant=most_frequent_type(counts),
        n_params=sum(t.nelements for t in tensors),
        size_label=label if isinstance(label, str) and label else None,
        kv=scalars,
    )
