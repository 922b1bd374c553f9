"""The engine's GGUF reader against gguf.GGUFReader: the same keys, values and tensors on good
files, the same refusals (exception and message) on malformed ones."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quants

from bankml.engine_cupy import weights
from bankml.engine_cupy.gguf_file import GGUFFile, metadata, open_file, read_metadata
from bankml.engine_cupy.tokenizer import Tokenizer, TokenizerError


def write_all_types(path: Path, endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    """Every value type, arrays of them and of strings, a nested array, typed and block tensors."""
    w = GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁ 日本")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.strs", ["a", "", "ü", "<0x0A>"])
    w.add_array("t.empty", [])
    rng = numpy.random.default_rng(1)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(numpy.float32))
    w.add_tensor("f16", rng.standard_normal((2, 5)).astype(numpy.float16))
    w.add_tensor("i32", numpy.arange(7, dtype=numpy.int32))
    q8 = quants.quantize(rng.standard_normal((4, 64)).astype(numpy.float32), T.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_as_gguf(path: Path) -> gguf.GGUFReader:
    """GGUFFile reads ``path`` as gguf's reader does; that reader."""
    theirs, ours = gguf.GGUFReader(path), GGUFFile(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    for key in keys:
        assert ours.fields[key].contents() == theirs.fields[key].contents(), key
    assert metadata(ours, keys) == metadata(theirs, keys)
    assert ours.alignment == theirs.alignment and ours.data_offset == theirs.data_offset
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, t in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes) == (
            t.name,
            t.tensor_type,
            t.n_elements,
            t.n_bytes,
        )
        assert mine.shape == tuple(int(d) for d in t.shape)
        assert mine.data_offset == t.data_offset
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        assert numpy.array_equal(mine.data, t.data)
    return theirs


def test_default_model_reads_as_gguf_reads_it(default_model: Path) -> None:
    theirs = assert_same_as_gguf(default_model)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert read_metadata(default_model, keys) == {k: theirs.fields[k].contents() for k in keys}


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_reads_as_gguf_reads_it(
    tmp_path: Path, endianess: gguf.GGUFEndian
) -> None:
    path = write_all_types(tmp_path / "all.gguf", endianess)
    assert_same_as_gguf(path)
    if endianess == gguf.GGUFEndian.LITTLE:
        values = read_metadata(path, ["t.str", "t.strs", "t.u64", "t.f32", "t.bool", "absent"])
        assert values == {
            "t.str": "héllo ▁ 日本",
            "t.strs": ["a", "", "ü", "<0x0A>"],
            "t.u64": 2**63 + 5,
            "t.f32": float(numpy.float32(0.1)),
            "t.bool": True,
        }


def outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the exception itself is what is compared
        return type(err).__name__, str(err)
    return "ok", ""


def gguf_refusal(path: Path) -> tuple[str, str]:
    """What the model loader has always made of a file: gguf.GGUFReader's verdict, a ValueError
    worded as an UnsupportedModel."""

    def load() -> None:
        try:
            gguf.GGUFReader(path, "r")
        except ValueError as err:
            raise weights.UnsupportedModel(f"{path}: not a readable GGUF file ({err})") from err

    return outcome(load)


def _patched(data: bytes, at: int, new: bytes) -> bytes:
    return data[:at] + new + data[at + len(new) :]


def malformed_variants(good: bytes) -> list[bytes]:
    version_at, key0_at = 4, 24
    (klen,) = struct.unpack_from("<Q", good, key0_at)
    vtype_at = key0_at + 8 + klen
    variants = [good[:n] for n in range(0, 700, 3)]  # the header cut anywhere, the data too
    variants += [
        good[: len(good) - 1],
        b"GGML" + good[4:],
        _patched(good, version_at, struct.pack("<I", 4)),
        _patched(good, version_at, struct.pack("<I", 1)),
        _patched(good, vtype_at, struct.pack("<I", 13)),  # no such value type
        _patched(good, key0_at + 8, b"\xff"),  # a key that is not UTF-8
    ]
    # the second key renamed as the first (same length in this file): a repeated key
    at = good.index(b"t.u8")
    variants.append(_patched(good, good.index(b"t.i8"), good[at : at + 4]))
    variants.append(_patched(good, good.index(b"t.i8"), b"GGUF"))  # "GGUF" alone is a fine key
    # general.alignment 48: not a power of two
    align_at = good.index(b"general.alignment") + len("general.alignment") + 4
    variants.append(_patched(good, align_at, struct.pack("<I", 48)))
    variants.append(_patched(good, align_at - 4, struct.pack("<I", 5)))  # as int32
    # a tensor type ggml does not know, and a repeated tensor name
    name_at = good.index(struct.pack("<Q", 3) + b"f16") + 8
    type_at = name_at + 3 + 4 + 2 * 8
    variants.append(_patched(good, type_at, struct.pack("<I", 99)))
    variants.append(_patched(good, name_at, b"i32"))
    variants.append(_patched(good, name_at + 3, struct.pack("<I", 3)))  # a dimension too many
    return variants


def test_malformed_files_are_refused_as_gguf_refuses_them(tmp_path: Path) -> None:
    good = write_all_types(tmp_path / "good.gguf").read_bytes()
    path = tmp_path / "bad.gguf"
    accepted = 0
    for i, data in enumerate(malformed_variants(good)):
        path.write_bytes(data)
        expected = gguf_refusal(path)
        assert outcome(lambda: weights.open_reader(path)) == expected, (i, len(data))
        if expected[0] == "ok":
            accepted += 1
            assert_same_as_gguf(path)
    assert accepted >= 1  # the "GGUF" key


def test_open_file_words_a_refusal_as_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="GGUF magic invalid"):
        open_file(path)
    with pytest.raises(FileNotFoundError):
        open_file(tmp_path / "absent.gguf")


def test_tokenizer_refusals_keep_their_words(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf at all, just text" * 4)
    with pytest.raises(TokenizerError, match=r"x\.gguf is not a GGUF file"):
        Tokenizer.from_gguf(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 7, 0, 0))
    with pytest.raises(TokenizerError, match="gguf version 7 is not supported"):
        Tokenizer.from_gguf(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k")
    with open(path, "ab") as f:
        f.write(struct.pack("<I", 13))
    with pytest.raises(TokenizerError, match="unknown gguf value type 13"):
        Tokenizer.from_gguf(path)


def test_a_key_named_like_a_gguf_count_is_refused_as_gguf_refuses_it(tmp_path: Path) -> None:
    """gguf.GGUFReader keeps the header's counts as fields GGUF.version, GGUF.tensor_count and
    GGUF.kv_count: a key of one of those names is a repeated key to it (KeyError)."""
    path = tmp_path / "k.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("GGUF.kv_count", 3)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expected = gguf_refusal(path)
    assert expected[0] == "KeyError"
    assert outcome(lambda: weights.open_reader(path)) == expected


def _resident_kib(address: int) -> int:
    """Rss of the mapping holding ``address`` in this process (/proc/self/smaps), in KiB."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:
            low, high = (int(a, 16) for a in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_dropped_pages_leave_the_process_and_read_back_the_same(default_model: Path) -> None:
    """drop_pages takes a tensor's whole pages out of the process's resident memory (the
    engine does so for the tensors it copied); read again, they are the file's bytes."""
    reader = GGUFFile(default_model)
    tensor = max(reader.tensors, key=lambda t: t.data.nbytes)
    address = reader._map.__array_interface__["data"][0]
    before = tensor.data.tobytes()  # every page of it resident
    resident = _resident_kib(address)
    reader.drop_pages(tensor.data)
    dropped = resident - _resident_kib(address)
    assert dropped >= tensor.data.nbytes // 1024 - 8  # all but the two partial end pages
    assert tensor.data.tobytes() == before
    reader.drop_pages(numpy.zeros(1 << 20, numpy.uint8))  # not of this file: nothing
