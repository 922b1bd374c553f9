"""The engine's one reader of GGUF headers: key/values and the tensor table, over a memory map.

Every engine module that needs something from a GGUF header asks here: the forward pass's
hyper-parameters and tensors (weights), the vocabulary (tokenizer), the chat template, the
sampling defaults, the file type and the training context. (The gate's guard keeps its own
hardened parser: it judges files before anything else trusts them.)

* ``GGUFFile(path)`` reads the whole header once: it walks the key/values with ``struct``,
  keeping where each value lies, and decodes a value only when asked
  (``fields[key].contents()``, strings as strict UTF-8); the tensor table gives each tensor's
  name, ggml type, shape and its bytes as a NumPy view of the file's memory map. It accepts and
  refuses the files ``gguf.GGUFReader`` accepts and refuses (both byte orders, versions 2 and 3;
  duplicate keys or tensors, an unknown value or tensor type, a bad ``general.alignment``, a
  tensor past the end of the file are refused). ``open_file`` raises, for a file it refuses,
  what ``gguf.GGUFReader`` raises on it, so the model loader's refusals read as they always have.
* ``read_metadata(path, keys)`` walks the key/values alone and decodes only the named ones
  (strings keeping undecodable bytes as surrogate escapes): what a tokenizer or a chat template
  needs without opening the model.
* ``metadata(source, keys)``: the named values from a path, a ``GGUFFile`` or an open
  ``gguf.GGUFReader``; absent keys are left out.

Why not ``gguf.GGUFReader`` itself: it makes a NumPy view of the file for every element of every
array and every string (about 250,000 for a 49,152-token vocabulary with its merges), which took
2.7 s to open the default model (0.5 s with its internals bypassed), and it decodes strings
strictly. Reading the default model's header here takes a few tens of milliseconds
(docs/modules/gguf_file.md).

Verified by tests/test_gguf_file.py (every key and tensor of the default model and of synthetic
files against ``gguf.GGUFReader``; malformed files refused with its errors), and by every test
that loads a model, a tokenizer or a chat template.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # NumPy and gguf load with the first GGUFFile: read_metadata needs neither
    import numpy
    from gguf import GGMLQuantizationType

# GGUF value types: the scalars' struct codes, then string and array
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_UINT32 = 4
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# the names gguf.GGUFReader gives the header's counts among its fields (a key may not reuse them)
_PSEUDO_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")
# ggml types whose tensors gguf.GGUFReader views as typed elements (the others as bytes)
_ELEMENT_DTYPES = {
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
}


class GGUFError(ValueError):
    """The file is not a GGUF this reader reads; the message says why."""


class _Values:
    """Decodes and skips the values of a GGUF key/value section in ``buf`` (any buffer)."""

    def __init__(self, buf: Any, order: str, errors: str) -> None:
        self.buf = buf
        self.order = order  # "<" or ">"
        self.errors = errors  # how string values decode: "strict" or "surrogateescape"
        self.u32 = struct.Struct(order + "I").unpack_from
        self.u64 = struct.Struct(order + "Q").unpack_from

    def string(self, pos: int) -> tuple[str, int]:
        (n,) = self.u64(self.buf, pos)
        end = pos + 8 + n
        return str(self.buf[pos + 8 : end], "utf-8", self.errors), end

    def value(self, pos: int, vtype: int, keep: bool) -> tuple[object, int]:
        """The value of type ``vtype`` at ``pos`` (None unless ``keep``) and the offset past it."""
        if vtype in _SCALARS:
            fmt = self.order + _SCALARS[vtype]
            return struct.unpack_from(fmt, self.buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            if keep:
                return self.string(pos)
            (n,) = self.u64(self.buf, pos)
            return None, pos + 8 + n
        if vtype != _ARRAY:
            raise GGUFError(f"unknown gguf value type {vtype}")
        (elem,) = self.u32(self.buf, pos)
        (count,) = self.u64(self.buf, pos + 4)
        pos += 12
        if elem in _SCALARS:
            fmt = f"{self.order}{count}{_SCALARS[elem]}"
            size = struct.calcsize(fmt)
            return (list(struct.unpack_from(fmt, self.buf, pos)) if keep else None), pos + size
        items: list[object] = []
        if elem == _STRING:  # the vocabulary's arrays: one loop, no call per element
            buf, u64, errors = self.buf, self.u64, self.errors
            for _ in range(count):
                (n,) = u64(buf, pos)
                if keep:
                    items.append(str(buf[pos + 8 : pos + 8 + n], "utf-8", errors))
                pos += 8 + n
            return (items if keep else None), pos
        for _ in range(count):
            item, pos = self.value(pos, elem, keep)
            items.append(item)
        return (items if keep else None), pos


def _header_start(
    buf: Any, path: str | os.PathLike[str], swapped: bool
) -> tuple[str, int, int, int]:
    """(byte order, version, tensor count, key/value count) of a GGUF; ``swapped``: a file of
    the other byte order is read too (else its version reads as a huge number)."""
    if len(buf) < 24 or bytes(buf[:4]) != _MAGIC:
        raise GGUFError(f"{os.fspath(path)} is not a GGUF file")
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if swapped and version & 0xFFFF == 0:  # written for the other byte order
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in _VERSIONS:
        raise GGUFError(f"gguf version {version} is not supported")
    n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
    return order, version, n_tensors, n_kv


def read_metadata(path: str | os.PathLike[str], wanted: Iterable[str]) -> dict[str, object]:
    """The named key/values of a GGUF file, the others skipped undecoded; absent keys left out.

    Little-endian files only; a repeated key keeps its last value. Strings keep undecodable
    bytes as surrogate escapes."""
    wanted = set(wanted)
    values: dict[str, object] = {}
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _, _, _, n_kv = _header_start(buf, path, swapped=False)
        walk = _Values(buf, "<", "surrogateescape")
        pos = 24
        for _ in range(n_kv):
            key, pos = walk.string(pos)
            (vtype,) = walk.u32(buf, pos)
            item, pos = walk.value(pos + 4, vtype, key in wanted)
            if key in wanted:
                values[key] = item
    return values


class Field:
    """One key/value of a ``GGUFFile``, decoded when asked (as ``gguf.ReaderField``)."""

    __slots__ = ("_values", "_pos", "_vtype")

    def __init__(self, values: _Values, pos: int, vtype: int) -> None:
        self._values, self._pos, self._vtype = values, pos, vtype

    def contents(self) -> Any:
        return self._values.value(self._pos, self._vtype, True)[0]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: ``shape`` in ggml order ([row width, rows, ...]), ``data`` its
    elements (F16/F32/F64/I8-I64) or its bytes (the block types), rows as NumPy shapes them."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: numpy.ndarray


class GGUFFile:
    """A GGUF file's header: ``fields`` (key -> Field) and ``tensors`` (TensorInfo, in order).

    Raises GGUFError for a file it cannot read (see ``open_file`` for gguf's wording), the
    memory map's own errors (a missing or empty file) as they come."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import numpy

        self.path = os.fspath(path)
        # a plain ndarray view: slices of a numpy.memmap pay a Python-level hook each
        # Any: its private ``_mmap`` is what madvise needs, the view a buffer numpy types omit
        self._memmap: Any = numpy.memmap(self.path, mode="r")
        self._map: Any = self._memmap.view(numpy.ndarray)
        try:
            self._read_header()
        except GGUFError:
            raise
        except (struct.error, ValueError, OverflowError) as err:  # a short or garbled header
            raise GGUFError(f"{self.path}: {err}") from err

    def drop_pages(self, data: Any) -> None:
        """Take the file's pages under ``data`` (a tensor's bytes, a view of the map) out of this
        process's memory: for a tensor the engine copied (Q/K/V and gate/up concatenated) and
        never reads here again, so that it is not counted twice (the copy, and the file's pages
        its reading made resident). Whole pages inside ``data`` only; a later read of them
        faults them in from the file again, so nothing can read other bytes."""
        start = data.__array_interface__["data"][0] - self._map.__array_interface__["data"][0]
        end = start + data.nbytes
        if not (start >= 0 and end <= self._map.nbytes):
            return  # not a view of this map
        page = mmap.PAGESIZE
        first, last = -(-start // page) * page, end // page * page
        if last > first:
            self._memmap._mmap.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _read_header(self) -> None:
        buf = memoryview(self._map)  # struct and str read it without copies
        order, self.version, n_tensors, n_kv = _header_start(buf, self.path, swapped=True)
        self.byte_order = order
        values = _Values(buf, order, "strict")
        fields: dict[str, Field] = {}
        pos = 24
        for _ in range(n_kv):
            key, pos = values.string(pos)
            if key in fields or key in _PSEUDO_KEYS:
                raise GGUFError(f"key {key} appears twice")
            (vtype,) = values.u32(buf, pos)
            fields[key] = Field(values, pos + 4, vtype)
            _, pos = values.value(pos + 4, vtype, False)
        self.fields: Mapping[str, Field] = fields

        table = []
        for _ in range(n_tensors):
            name, pos = values.string(pos)
            (n_dims,) = values.u32(buf, pos)
            dims = struct.unpack_from(f"{order}{n_dims}Q", buf, pos + 4)
            pos += 4 + 8 * n_dims
            raw_type, offset = struct.unpack_from(order + "IQ", buf, pos)
            pos += 12
            table.append((name, dims, raw_type, offset))

        self.alignment = _DEFAULT_ALIGNMENT
        if "general.alignment" in fields:
            field = fields["general.alignment"]
            if field._vtype != _UINT32:
                raise GGUFError("general.alignment is not a uint32")
            self.alignment = int(field.contents())
            if self.alignment == 0 or self.alignment & (self.alignment - 1):
                raise GGUFError("general.alignment is not a power of two")
        self.data_offset = pos + (-pos % self.alignment)
        self.tensors = self._tensors(table)

    def _tensors(self, table: list[tuple[str, tuple[int, ...], int, int]]) -> list[TensorInfo]:
        import numpy
        from gguf import GGMLQuantizationType
        from gguf.constants import GGML_QUANT_SIZES
        from gguf.quants import quant_shape_to_byte_shape

        tensors, names = [], set()
        for name, dims, raw_type, offset in table:
            if name in names:
                raise GGUFError(f"tensor {name} appears twice")
            names.add(name)
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFError(f"tensor {name} has an unknown type {raw_type}") from None
            n_elements = int(numpy.prod(numpy.array(dims, dtype=numpy.uint64)))
            block, size = GGML_QUANT_SIZES[qtype]
            n_bytes = n_elements * size // block
            shape = tuple(reversed(dims))
            dtype = _ELEMENT_DTYPES.get(qtype.name)
            if dtype is None:
                dtype, count = "uint8", n_bytes
                shape = quant_shape_to_byte_shape(shape, qtype)
            else:
                count = n_elements
            start = self.data_offset + offset
            item = numpy.dtype(dtype)
            data = self._map[start : start + item.itemsize * count].view(item)[:count]
            if self.byte_order != "<":
                data = data.view(item.newbyteorder(">"))
            if data.size != count:
                raise GGUFError(f"tensor {name} runs past the end of the file")
            tensors.append(
                TensorInfo(
                    name=name,
                    tensor_type=qtype,
                    shape=tuple(int(d) for d in dims),
                    n_elements=n_elements,
                    n_bytes=n_bytes,
                    data_offset=start,
                    data=data.reshape(shape),
                )
            )
        return tensors


def open_file(path: str | os.PathLike[str]) -> GGUFFile:
    """``GGUFFile(path)``; a file it refuses raises what ``gguf.GGUFReader`` raises on it."""
    try:
        return GGUFFile(path)
    except GGUFError as err:
        refusal = err
    from gguf import GGUFReader

    GGUFReader(os.fspath(path), "r")  # raises its own error for a file it cannot read
    raise refusal


def metadata(source: str | os.PathLike[str] | object, keys: Iterable[str]) -> dict[str, Any]:
    """The named key/values of a GGUF (a path, a GGUFFile or a gguf.GGUFReader); absent keys
    left out. A path is read with ``read_metadata``, an open file through its fields."""
    if isinstance(source, (str, os.PathLike)):
        return read_metadata(source, keys)
    fields = getattr(source, "fields", None)
    if fields is None:
        raise TypeError("expected a GGUF path or a gguf.GGUFReader")
    return {key: fields[key].contents() for key in keys if key in fields}
