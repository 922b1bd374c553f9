"""The GGUF header guard: `play`, `refuse` with every reason, or `need_more`, from a bounded prefix.

The guard reads only the header (key/values and tensor infos), never the weights, and trusts
nothing in it: every count and length is checked against the bytes that can exist before it is
used, arrays are walked with an explicit stack (no recursion), and scalar arrays are skipped by
size without being materialised. It applies bankml's GGUF rules (docs/modules/guard.md) plus
the structural checks llama.cpp's own loader makes (ggml/src/gguf.cpp), so a file the guard plays is one the engine can map.

Pure functions, no Twisted: `guard_bytes` on a prefix, `guard_file` on a path.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Any

from gguf.constants import GGML_QUANT_SIZES

# -- limits -------------------------------------------------------------------------------------

PREFIX_BYTES = 32 * 1024 * 1024  # first read: min(32 MiB, size)
MAX_HEADER_BYTES = 256 * 1024 * 1024  # bounded memory: no header may need more than this
MAX_NESTING = 64  # deeper nested arrays are refused
MAX_KV = 1 << 16  # real models carry < 100 keys; a tokenizer is one key
MAX_TENSORS = 1 << 20  # real models carry < 100k tensor infos
MAX_KEY_BYTES = 1 << 16
GGML_MAX_NAME = 64  # ggml.h: a tensor name must be shorter than this
GGML_MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
INT64_MAX = (1 << 63) - 1
I128_MIN, I128_MAX = -(1 << 127), (1 << 127) - 1

# Smallest encodings, used to refuse impossible counts before looping over them.
MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, one-byte value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims (0), type, offset
HEADER_FIXED_BYTES = 4 + 4 + 8 + 8

# -- GGUF value types ---------------------------------------------------------------------------

T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL = range(8)
T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = range(8, 13)

SCALAR_FORMATS: dict[int, struct.Struct] = {
    T_UINT8: struct.Struct("<B"),
    T_INT8: struct.Struct("<b"),
    T_UINT16: struct.Struct("<H"),
    T_INT16: struct.Struct("<h"),
    T_UINT32: struct.Struct("<I"),
    T_INT32: struct.Struct("<i"),
    T_FLOAT32: struct.Struct("<f"),
    T_BOOL: struct.Struct("<?"),
    T_UINT64: struct.Struct("<Q"),
    T_INT64: struct.Struct("<q"),
    T_FLOAT64: struct.Struct("<d"),
}
MIN_VALUE_BYTES = {t: s.size for t, s in SCALAR_FORMATS.items()} | {T_STRING: 8, T_ARRAY: 4 + 8}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# -- ggml tensor types --------------------------------------------------------------------------

TYPE_NAMES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
    40: "NVFP4",
    41: "Q1_0",
    42: "Q2_0",
    142: "PQ2_0",
    143: "PTQ1_0",
}
Q2_0, PQ2_0, PTQ1_0 = 42, 142, 143
PRISM_TYPES = (PQ2_0, PTQ1_0)

# (elements per block, bytes per block). gguf-py has every mainline layout but Q2_0, which the
# pinned llama.cpp (ggml-common.h: QK2_0 64, 2-byte scale + 16 bytes) adds. The PrismML types'
# layouts are not public: their sizes are unknown and their extents are not checked.
BLOCK_LAYOUTS: dict[int, tuple[int, int]] = {int(t): v for t, v in GGML_QUANT_SIZES.items()}
BLOCK_LAYOUTS[Q2_0] = (64, 18)

KNOWN_TYPES = frozenset(TYPE_NAMES)

BONSAI_LABEL = re.compile(r"bonsai[\s_-]*2|prism-fork-required", re.IGNORECASE)

# -- the refusal reasons, word for word ----------------------------------------------------------

NOT_GGUF = "not a GGUF file"
NESTED_TOO_DEEP = f"gguf arrays nested deeper than {MAX_NESTING}"
PRISM_ON_MAINLINE = "PQ2_0/PTQ1_0 are PrismML-fork types; mainline and llama.rn refuse them"
BONSAI_ON_MAINLINE = (
    "Bonsai 2 weights are in a rotated basis and need the fork's Hadamard transform; "
    "mainline loads the Q2_0 band silently and outputs gibberish"
)


def type_name(type_id: int) -> str:
    return TYPE_NAMES.get(type_id, str(type_id))


# -- result -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GuardResult:
    """What the guard decided about one header. `reasons` is empty exactly when verdict is play."""

    verdict: str  # "play" | "refuse" | "need_more"
    reasons: tuple[str, ...] = ()
    engine: str = "mainline"
    gguf_version: int = 0
    arch: str | None = None
    name: str | None = None
    tensors: int = 0
    types: dict[str, int] = field(default_factory=dict)
    bytes_needed: int | None = None
    kv_f16_bytes_per_token: int | None = None
    file_size: int | None = None
    data_start: int | None = None
    alignment: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The verdict as a JSON object, keys in their documented order."""
        if self.verdict == "need_more":
            return {"verdict": "need_more", "bytes_needed": self.bytes_needed}
        out: dict[str, Any] = {
            "gguf_version": self.gguf_version,
            "arch": self.arch,
            "name": self.name,
            "tensors": self.tensors,
            "types": dict(self.types),
            "engine": self.engine,
            "reasons": list(self.reasons),
        }
        if self.kv_f16_bytes_per_token is not None:
            out["kv_f16_bytes_per_token"] = self.kv_f16_bytes_per_token
        out["verdict"] = self.verdict
        return out

    def to_json(self) -> str:
        # ", " and ": " separators and raw non-ASCII, as the documented JSON shape has them.
        return json.dumps(self.as_dict(), ensure_ascii=False)

    def to_text(self) -> str:
        if self.verdict == "need_more":
            return f"need_more {self.bytes_needed}"
        head = " ".join([self.verdict] + [f"{name}:{count}" for name, count in self.types.items()])
        return "\n".join([head] + [f"  - {reason}" for reason in self.reasons])


# -- parsing ------------------------------------------------------------------------------------


class _NeedMore(Exception):
    def __init__(self, end: int) -> None:
        self.end = end


class _Refuse(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


@dataclass
class _TensorInfo:
    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int
    nelements: int


class _Reader:
    """Bounds-checked little-endian reads over the prefix; every read checks before it unpacks."""

    def __init__(self, buf: bytes | memoryview) -> None:
        self.buf = buf
        self.avail = len(buf)
        self.pos = 0

    def need(self, n: int) -> int:
        """Reserve n bytes at pos; return the start. Past the prefix means need_more."""
        start, end = self.pos, self.pos + n
        if end > self.avail:
            self.need_more(end)
        self.pos = end
        return start

    def need_more(self, end: int) -> None:
        if end > MAX_HEADER_BYTES:
            raise _Refuse(
                f"GGUF header needs {end} bytes, more than the {MAX_HEADER_BYTES} this guard reads"
            )
        raise _NeedMore(end)

    def unpack(self, fmt: struct.Struct) -> Any:
        return fmt.unpack_from(self.buf, self.need(fmt.size))[0]

    def length(self, what: str, cap: int) -> int:
        """A u64 length, refused at once above cap; a length that merely runs past the prefix
        (or past the end of a truncated file) is need_more, like any other read."""
        at = self.pos
        n = self.unpack(_U64)
        if n > cap:
            raise _Refuse(f"{what} at offset {at} is {n} bytes, more than the {cap} allowed")
        return n

    def string(self, what: str, cap: int = MAX_HEADER_BYTES) -> str:
        n = self.length(what, cap)
        start = self.need(n)
        return bytes(self.buf[start : start + n]).decode("utf-8", "replace")

    def count_fits(self, count: int, min_bytes: int, what: str) -> None:
        """Judge a count by its smallest encoding before looping over it: past the header cap is
        refused, past the prefix is need_more, so no loop ever runs on an impossible count."""
        least = count * min_bytes
        if self.pos + least > MAX_HEADER_BYTES:
            raise _Refuse(
                f"{what} at offset {self.pos} claims {count} elements, at least {least} bytes, "
                f"more than the {MAX_HEADER_BYTES} a header may take"
            )
        if self.pos + least > self.avail:
            self.need_more(self.pos + least)


def _value_type(r: _Reader) -> int:
    vtype = r.unpack(_U32)
    if vtype not in MIN_VALUE_BYTES:
        raise _Refuse(f"unknown gguf value type {vtype}")
    return vtype


def _skip_strings(r: _Reader, count: int) -> None:
    """Walk `count` strings by their lengths without decoding them (a tokenizer's vocabulary)."""
    buf, avail, pos = r.buf, r.avail, r.pos
    unpack_u64 = _U64.unpack_from
    for _ in range(count):
        if pos + 8 > avail:
            r.pos = pos
            r.need_more(pos + 8)
        (n,) = unpack_u64(buf, pos)
        if n > MAX_HEADER_BYTES:
            raise _Refuse(
                f"string at offset {pos} is {n} bytes, more than the {MAX_HEADER_BYTES} allowed"
            )
        pos += 8 + n
    r.pos = pos
    if pos > avail:
        r.need_more(pos)


def _read_array(r: _Reader, key: str) -> str:
    """Walk an array value iteratively (nested arrays on an explicit stack); return `<array n>`."""
    elem = _value_type(r)
    count = r.unpack(_U64)
    r.count_fits(count, MIN_VALUE_BYTES[elem], f"array {key!r}")
    stack = [[elem, count]]
    while stack:
        top = stack[-1]
        elem, remaining = top
        if remaining == 0:
            stack.pop()
        elif elem in SCALAR_FORMATS:
            r.need(remaining * SCALAR_FORMATS[elem].size)
            stack.pop()
        elif elem == T_STRING:
            _skip_strings(r, remaining)
            stack.pop()
        else:  # an array of arrays: open the next inner one
            top[1] = remaining - 1
            if len(stack) >= MAX_NESTING:
                raise _Refuse(NESTED_TOO_DEEP)
            inner = _value_type(r)
            inner_count = r.unpack(_U64)
            r.count_fits(inner_count, MIN_VALUE_BYTES[inner], f"array {key!r}")
            stack.append([inner, inner_count])
    return f"<array {count}>"


def _read_value(r: _Reader, vtype: int, key: str) -> Any:
    if vtype in SCALAR_FORMATS:
        return r.unpack(SCALAR_FORMATS[vtype])
    if vtype == T_STRING:
        return r.string(f"value of {key!r}")
    return _read_array(r, key)


def _read_counts(r: _Reader) -> tuple[int, int, int]:
    if bytes(r.buf[:4]) != b"GGUF"[: min(4, r.avail)]:
        raise _Refuse(NOT_GGUF)
    r.need(4)  # the magic; a prefix that only starts it needs more
    version = r.unpack(_U32)
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = (
            ": a big-endian GGUF, which ggml on this machine cannot read"
            if swapped in (2, 3)
            else ""
        )
        raise _Refuse(f"gguf version {version} is not supported (2 and 3 are){hint}")
    n_tensors = r.unpack(_U64)
    n_kv = r.unpack(_U64)
    if n_kv > MAX_KV:
        raise _Refuse(f"header claims {n_kv} metadata keys, more than the {MAX_KV} allowed")
    if n_tensors > MAX_TENSORS:
        raise _Refuse(f"header claims {n_tensors} tensors, more than the {MAX_TENSORS} allowed")
    least = HEADER_FIXED_BYTES + n_kv * MIN_KV_BYTES + n_tensors * MIN_TENSOR_INFO_BYTES
    if least > r.avail:  # no loop over counts the bytes at hand cannot hold
        r.need_more(least)
    return version, n_tensors, n_kv


def _read_kvs(r: _Reader, n_kv: int) -> dict[str, Any]:
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string("metadata key", MAX_KEY_BYTES)
        vtype = _value_type(r)
        kv[key] = _read_value(r, vtype, key)  # a duplicate key: the last wins
    return kv


def _alignment(kv: dict[str, Any]) -> int:
    """general.alignment read as the guard documents it: a float >= 1 truncated, an int or bool >= 1."""
    value = kv.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(value, float) and math.isfinite(value) and value >= 1:
        return int(value)
    if isinstance(value, int) and value >= 1:
        return int(value)
    raise _Refuse(f"general.alignment {value} is not a positive integer")


def _read_tensor(r: _Reader, faults: dict[str, list[str]]) -> _TensorInfo:
    name = r.string("tensor name", MAX_KEY_BYTES)
    n_dims = r.unpack(_U32)
    if n_dims > GGML_MAX_DIMS:
        raise _Refuse(
            f"tensor {name!r} has {n_dims} dimensions, ggml allows at most {GGML_MAX_DIMS}"
        )
    dims = tuple(r.unpack(_U64) for _ in range(n_dims))
    type_id = r.unpack(_U32)
    offset = r.unpack(_U64)
    nelements = 1
    for d in dims:
        nelements *= d
    if any(d > INT64_MAX for d in dims):
        faults["negative dimension"].append(name)
        nelements = 0  # its size is meaningless: one reason, not a cascade of extent faults
    elif nelements > INT64_MAX:
        faults["element count overflow"].append(name)
        nelements = 0
    return _TensorInfo(name, dims, type_id, offset, nelements)


def _parse(
    r: _Reader,
) -> tuple[int, dict[str, Any], list[_TensorInfo], int, int, dict[str, list[str]]]:
    version, n_tensors, n_kv = _read_counts(r)
    kv = _read_kvs(r, n_kv)
    alignment = _alignment(kv)
    faults: dict[str, list[str]] = {k: [] for k in TENSOR_FAULTS}
    tensors = [_read_tensor(r, faults) for _ in range(n_tensors)]
    data_start = -(-r.pos // alignment) * alignment
    return version, kv, tensors, alignment, data_start, faults


# -- checks after a complete parse --------------------------------------------------------------

# Per-tensor faults found while parsing or checking, reported once per kind with the names.
TENSOR_FAULTS = {
    "negative dimension": "tensors with a dimension >= 2^63 (negative to ggml)",
    "element count overflow": "tensors whose element count overflows int64",
    "long name": f"tensors named with {GGML_MAX_NAME} bytes or more (ggml's limit is {GGML_MAX_NAME - 1})",
    "duplicate name": "duplicate tensor names",
    "row not whole blocks": "tensors whose rows are not a whole number of their type's blocks",
    "misaligned": "tensors whose data offset is not a multiple of general.alignment",
    "past end": "tensors whose data runs past the end of the file",
    "overlap": "tensors whose data overlaps the next tensor's",
}


def _names(names: list[str], shown: int = 3) -> str:
    text = ", ".join(repr(n) for n in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _int_kv(kv: dict[str, Any], key: str) -> int | None:
    value = kv.get(key)
    return int(value) if isinstance(value, int) else None  # a bool counts as an int


def kv_f16_bytes_per_token(kv: dict[str, Any]) -> int | None:
    """Bytes of f16 K and V cache per token: block_count x head_count_kv x (key + value length) x 2."""
    arch = str(kv.get("general.architecture"))
    layers = _int_kv(kv, f"{arch}.block_count")
    heads_kv = _int_kv(kv, f"{arch}.attention.head_count_kv")
    key_len = _int_kv(kv, f"{arch}.attention.key_length")
    value_len = _int_kv(kv, f"{arch}.attention.value_length")
    if key_len is None:
        embd = _int_kv(kv, f"{arch}.embedding_length")
        heads = _int_kv(kv, f"{arch}.attention.head_count")
        if embd is not None and heads:
            key_len = value_len = embd // heads
    if layers is None or heads_kv is None or key_len is None:
        return None
    return layers * heads_kv * (key_len + (value_len if value_len is not None else key_len)) * 2


def _tensor_nbytes(t: _TensorInfo) -> int | None:
    layout = BLOCK_LAYOUTS.get(t.type_id)
    if layout is None:
        return None
    block, size = layout
    return t.nelements // block * size


def _check_layout(
    tensors: list[_TensorInfo],
    alignment: int,
    data_start: int,
    file_size: int | None,
    legacy_q2: set[int],
    faults: dict[str, list[str]],
) -> None:
    """Names, block rows, offset alignment, extents inside the file, no two tensors overlapping."""
    seen: set[str] = set()
    for t in tensors:
        if len(t.name.encode("utf-8", "replace")) >= GGML_MAX_NAME:
            faults["long name"].append(t.name)
        if t.name in seen:
            faults["duplicate name"].append(t.name)
        seen.add(t.name)
        layout = BLOCK_LAYOUTS.get(t.type_id)
        if layout and t.dims and t.dims[0] % layout[0]:
            faults["row not whole blocks"].append(t.name)
        if t.offset % alignment:
            faults["misaligned"].append(t.name)
    # A PrismML tensor's size is unknown: only its start is checked. Legacy Q2_0 has its own reason.
    sized = sorted(
        (t.offset, _tensor_nbytes(t) or 0, i) for i, t in enumerate(tensors) if i not in legacy_q2
    )
    if file_size is not None:
        for offset, nbytes, i in sized:
            if data_start + offset + nbytes > file_size:
                faults["past end"].append(tensors[i].name)
    for (offset, nbytes, i), (next_offset, _, _) in zip(sized, sized[1:]):
        if offset + nbytes > next_offset:
            faults["overlap"].append(tensors[i].name)


def _legacy_q2_0(tensors: list[_TensorInfo], data_start: int, file_size: int | None) -> set[int]:
    """Indices of Q2_0 tensors whose span is shorter than the group-64 layout (structural check 4)."""
    by_offset = sorted(range(len(tensors)), key=lambda i: tensors[i].offset)
    short: set[int] = set()
    for rank, i in enumerate(by_offset):
        if tensors[i].type_id != Q2_0:
            continue
        if rank + 1 < len(by_offset):
            end = tensors[by_offset[rank + 1]].offset
        elif file_size is not None:
            end = file_size - data_start
        else:
            continue
        if end - tensors[i].offset < tensors[i].nelements // 64 * 18:
            short.add(i)
    return short


def _reasons(
    kv: dict[str, Any],
    tensors: list[_TensorInfo],
    alignment: int,
    data_start: int,
    file_size: int | None,
    filename: str,
    engine: str,
    faults: dict[str, list[str]],
) -> tuple[list[str], int | None]:
    reasons: list[str] = []
    per_token = kv_f16_bytes_per_token(kv)
    if per_token is not None and not I128_MIN <= per_token <= I128_MAX:
        arch = str(kv.get("general.architecture"))
        reasons.append(
            f"KV cache size per token overflows ({arch}.block_count × head_count_kv × key/value length): "
            "malformed header"
        )
        per_token = None
    type_ids = {t.type_id for t in tensors}
    unknown = sorted(type_ids - KNOWN_TYPES)
    if unknown:
        reasons.append(f"type ids {unknown} unknown to every build this guard knows")
    if engine != "prism" and type_ids & set(PRISM_TYPES):
        reasons.append(PRISM_ON_MAINLINE)
    legacy = _legacy_q2_0(tensors, data_start, file_size)
    if legacy:
        reasons.append(
            f"{len(legacy)} Q2_0 tensors smaller than group-64 layout: legacy group-128 Prism file, "
            "use *-Q2_0_g64.gguf or *-PQ2_0.gguf"
        )
    if engine != "prism":
        label = " ".join(
            str(v) for v in (kv.get("general.name"), kv.get("general.basename"), filename) if v
        )
        if BONSAI_LABEL.search(label):
            reasons.append(BONSAI_ON_MAINLINE)
    if alignment & (alignment - 1):
        reasons.append(f"general.alignment {alignment} is not a power of two, as ggml requires")
    _check_layout(tensors, alignment, data_start, file_size, legacy, faults)
    for kind, what in TENSOR_FAULTS.items():
        if faults[kind]:
            detail = (
                f" (file {file_size} bytes, data from offset {data_start})"
                if kind == "past end"
                else ""
            )
            if kind == "misaligned":
                detail = f" ({alignment})"
            reasons.append(f"{len(faults[kind])} {what}{detail}: {_names(faults[kind])}")
    return reasons, per_token


def _type_counts(tensors: list[_TensorInfo]) -> dict[str, int]:
    counts: dict[int, int] = {}
    for t in tensors:
        counts[t.type_id] = counts.get(t.type_id, 0) + 1
    return {type_name(tid): counts[tid] for tid in sorted(counts)}


def guard_bytes(
    prefix: bytes | bytearray | memoryview,
    file_size: int | None,
    filename: str,
    engine: str = "mainline",
) -> GuardResult:
    """Judge a GGUF header from the first bytes of a file.

    A read past the prefix gives need_more with the offset it needs; counts and lengths beyond
    the caps (MAX_KV, MAX_TENSORS, MAX_HEADER_BYTES ...) are refused at once. `file_size` (when
    known) lets the tensor extents be checked against the file; `filename` is the basename, used by the Bonsai label check. `engine` "prism" turns
    off the mainline-only checks; any other value means mainline.
    """
    engine = "prism" if engine == "prism" else "mainline"
    r = _Reader(memoryview(prefix))
    try:
        version, kv, tensors, alignment, data_start, faults = _parse(r)
    except _NeedMore as more:
        return GuardResult("need_more", engine=engine, bytes_needed=more.end, file_size=file_size)
    except _Refuse as refused:
        return GuardResult("refuse", (refused.reason,), engine=engine, file_size=file_size)
    reasons, per_token = _reasons(
        kv, tensors, alignment, data_start, file_size, filename, engine, faults
    )
    arch, name = kv.get("general.architecture"), kv.get("general.name")
    return GuardResult(
        verdict="refuse" if reasons else "play",
        reasons=tuple(reasons),
        engine=engine,
        gguf_version=version,
        arch=None if arch is None else str(arch),
        name=None if name is None else str(name),
        tensors=len(tensors),
        types=_type_counts(tensors),
        kv_f16_bytes_per_token=per_token,
        file_size=file_size,
        data_start=data_start,
        alignment=alignment,
    )


def guard_file(path: str | os.PathLike[str], engine: str = "mainline") -> GuardResult:
    """Guard a file: read min(32 MiB, size), and more when the header is longer.

    On need_more(n) with prefix < n <= size, the prefix grows to min(max(n, 2 x prefix), size).
    A need_more that survives (n beyond the file) means the file is truncated. Raises OSError
    when the file cannot be read.
    """
    filename = os.path.basename(os.fspath(path))
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(min(PREFIX_BYTES, size))
        del buf[f.readinto(buf) :]  # readinto: no second copy of the 32 MiB prefix
        while True:
            result = guard_bytes(buf, size, filename, engine)
            needed = result.bytes_needed
            if result.verdict != "need_more" or needed is None or not len(buf) < needed <= size:
                return result
            want = min(max(needed, 2 * len(buf)), size)
            more = f.read(want - len(buf))
            if not more:  # the file shrank under us: what we have is all there is
                return result
            buf = buf + more  # a new buffer: never resize one a memoryview may still export
