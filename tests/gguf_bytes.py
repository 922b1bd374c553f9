"""A struct-level GGUF writer for the guard, verify and CLI tests.

It writes every part of the format (strings, key/values of each type, arrays, tensor infos, the
aligned data section) field by field with ``struct``, so it can also write what no honest writer
would: huge counts, deep nesting, lengths past the end, overlapping tensors. ``build`` puts a file
together; ``LLAMA_KVS`` are a minimal header's key/values (a llama architecture and a name).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES

# Independent of bankml.gate.guard: gguf-py's layouts plus the pinned llama.cpp's Q2_0 (ggml-common.h).
LAYOUTS = {int(t): v for t, v in GGML_QUANT_SIZES.items()} | {42: (64, 18)}


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def kv_str(key: str, value: str) -> bytes:
    return kv(key, 8, s(value))


def kv_u32(key: str, value: int) -> bytes:
    return kv(key, 4, struct.pack("<I", value))


def kv_u64(key: str, value: int) -> bytes:
    return kv(key, 10, struct.pack("<Q", value))


def kv_array(key: str, elem: int, count: int, payload: bytes) -> bytes:
    return kv(key, 9, struct.pack("<IQ", elem, count) + payload)


def tensor(name: str, dims: list[int], type_id: int, offset: int) -> tuple[bytes, int]:
    """A tensor info and the end of its data (offset + bytes) when its layout is known."""
    info = s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)
    count = int(np.prod(dims, dtype=object)) if dims else 1
    block, size = LAYOUTS.get(type_id, (1, 0))
    return info, offset + count // block * size


def build(
    kvs: list[bytes] = (),
    tensors: list[tuple[bytes, int]] = (),
    *,
    data_size: int | None = None,
    magic: bytes = b"GGUF",
    version: int = 3,
    n_tensors: int | None = None,
    n_kv: int | None = None,
    alignment: int = 32,
) -> bytes:
    head = magic + struct.pack(
        "<IQQ",
        version,
        len(tensors) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
    )
    out = head + b"".join(kvs) + b"".join(info for info, _ in tensors)
    if tensors:
        out += b"\0" * (-len(out) % alignment)
    if data_size is None:
        data_size = max((end for _, end in tensors), default=0)
    return out + b"\0" * data_size


LLAMA_KVS = [kv_str("general.architecture", "llama"), kv_str("general.name", "tiny")]


def with_kvs(path: str | os.PathLike[str], extra: list[bytes]) -> bytes:
    """The GGUF file at ``path`` (version 3, default alignment) with the key/values ``extra``
    appended to its own: the tensor infos and data as they were, the data realigned."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    source = Path(path).read_bytes()
    last = list(reader.fields.values())[-1]
    kv_end = last.offset + sum(int(p.nbytes) for p in last.parts)
    pos = kv_end
    for _ in range(len(reader.tensors)):  # name, n_dims, dims, type, offset
        (n,) = struct.unpack_from("<Q", source, pos)
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", source, pos)
        pos += 4 + 8 * n_dims + 4 + 8
    n_tensors, n_kv = struct.unpack_from("<QQ", source, 8)
    out = source[:8] + struct.pack("<QQ", n_tensors, n_kv + len(extra))
    out += source[24:kv_end] + b"".join(extra) + source[kv_end:pos]
    out += b"\0" * (-len(out) % 32)
    return out + source[reader.data_offset :]
