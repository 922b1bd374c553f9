"""Reading a Hugging Face model directory's safetensors shards, trusting nothing in them.

A shard is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and ``data_offsets`` (relative to the end of the header), then the data. Every header is
checked before any tensor is read: the offsets must tile the data exactly, each tensor's byte
count must be its shape times its dtype's size, and the file must end where the last tensor ends
(a shorter file is a truncated download). Tensors are read through one read-only mmap per shard.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from bankml.convert.errors import ConvertError

# the dtypes bankml converts (to F32 first, as the reference converter does), and their sizes
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
# integer tensors a checkpoint may carry beside its weights (BERT's embeddings.position_ids):
# their sizes are checked like any tensor's, and a tensor the conversion keeps must be a weight
INDEX_BYTES = {"I64": 8, "I32": 4}
# dtypes a safetensors file may hold that bankml refuses (quantized checkpoints, integers)
KNOWN_DTYPES = {
    *DTYPE_BYTES,
    "BOOL",
    "U8",
    "I8",
    "U16",
    "I16",
    "U32",
    "I32",
    "U64",
    "I64",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E8M0",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "C64",
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


def not_converted(where: str, dtype: str) -> str:
    return (
        f"{where}: dtype {dtype} is not converted (bankml converts F32, F16, BF16 and F64 weights)"
    )


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


class Shard:
    """One checked safetensors file; ``tensors`` sorted by name, as the reference indexes them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = os.path.basename(path)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise ConvertError(
                        f"{self.name}: truncated ({size} bytes, no safetensors header)"
                    )
                n = int.from_bytes(head, "little")
                if n > MAX_HEADER_BYTES or 8 + n > size:
                    raise ConvertError(
                        f"{self.name}: the header says it is {n} bytes long but the file has "
                        f"{size} bytes: truncated or not a safetensors file"
                    )
                raw = f.read(n)
        except OSError as err:
            raise ConvertError(f"cannot read {self.name}: {err.strerror or err}") from None
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise ConvertError(f"{self.name}: the safetensors header is not JSON ({err})") from None
        if not isinstance(header, dict):
            raise ConvertError(f"{self.name}: the safetensors header is not a JSON object")
        self.size = size
        self.data_start = 8 + n
        self.tensors = {s.name: s for s in sorted(self._specs(header), key=lambda s: s.name)}

    def _specs(self, header: dict[str, Any]) -> list[TensorSpec]:
        specs: list[TensorSpec] = []
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            where = f"{self.name}: tensor {name!r}"
            if not isinstance(meta, dict):
                raise ConvertError(f"{where}: its header entry is not an object")
            dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
            if dtype not in KNOWN_DTYPES:
                raise ConvertError(f"{where}: unknown dtype {dtype!r}")
            if dtype not in DTYPE_BYTES and dtype not in INDEX_BYTES:
                raise ConvertError(not_converted(where, dtype))
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
            ):
                raise ConvertError(f"{where}: shape {shape!r} is not a list of sizes")
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]
            ):
                raise ConvertError(f"{where}: data_offsets {offsets!r} are not a byte range")
            want = int(np.prod(shape, dtype=np.int64)) * {**DTYPE_BYTES, **INDEX_BYTES}[dtype]
            if offsets[1] - offsets[0] != want:
                raise ConvertError(
                    f"{where}: the header gives it {offsets[1] - offsets[0]} bytes but "
                    f"{dtype} {shape} needs {want}: the header lies about its sizes"
                )
            specs.append(
                TensorSpec(
                    name,
                    dtype,
                    tuple(shape),
                    self.data_start + offsets[0],
                    self.data_start + offsets[1],
                )
            )
        at = self.data_start
        for s in sorted(specs, key=lambda s: (s.begin, s.end)):
            if s.begin != at:
                what = "overlaps another" if s.begin < at else "leaves a gap before it"
                raise ConvertError(
                    f"{self.name}: tensor {s.name!r} at data offset {s.begin - self.data_start} "
                    f"{what}: the header lies about its offsets"
                )
            at = s.end
        if at > self.size:
            raise ConvertError(
                f"{self.name}: truncated: its header needs {at} bytes, the file has {self.size}"
            )
        if at != self.size:
            raise ConvertError(
                f"{self.name}: {self.size - at} bytes after the last tensor the header names"
            )
        return specs


class ShardReader:
    """Reads tensors with plain reads (not mmap: a shard cut short while it is read must be a
    refusal, not a SIGBUS); one open file per shard, closed together."""

    def __init__(self) -> None:
        self._files: dict[str, io.BufferedReader] = {}

    def array(self, shard: Shard, spec: TensorSpec) -> np.ndarray:
        """The tensor as float32, or float16 when stored so (what the reference keeps)."""
        f = self._files.get(shard.path)
        if f is None:
            try:
                f = open(shard.path, "rb")  # noqa: SIM115 (closed by close())
            except OSError as err:
                raise ConvertError(f"cannot read {shard.name}: {err.strerror or err}") from None
            self._files[shard.path] = f
        size = spec.end - spec.begin
        buf = bytearray(size)
        try:
            f.seek(spec.begin)
            got = f.readinto(buf)
        except OSError as err:
            raise ConvertError(f"cannot read {shard.name}: {err.strerror or err}") from None
        if got != size:
            raise ConvertError(f"{shard.name}: changed while it was read (now shorter)")
        count = size // DTYPE_BYTES[spec.dtype]
        if spec.dtype == "BF16":
            bits = np.frombuffer(buf, dtype="<u2", count=count)
            data = (bits.astype(np.uint32) << 16).view(np.float32)
        elif spec.dtype == "F16":
            data = np.frombuffer(buf, dtype="<f2", count=count)
        elif spec.dtype == "F32":
            data = np.frombuffer(buf, dtype="<f4", count=count)
        else:
            data = np.frombuffer(buf, dtype="<f8", count=count).astype(np.float32)
        return data.reshape(spec.shape)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def iter_tensors(shards: list[Shard]) -> Iterator[tuple[Shard, TensorSpec]]:
    for shard in shards:
        for spec in shard.tensors.values():
            yield shard, spec
