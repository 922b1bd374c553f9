"""The GGUF header guard on the real default model and on synthetic, hostile headers.

Valid synthetic files come from gguf-py's GGUFWriter (an independent writer) and from the small
struct builder (tests/gguf_bytes.py), which can also write what no honest writer would: huge
counts, deep nesting, lengths past the end, overlapping tensors.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGMLQuantizationType
from gguf.quants import quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bankml.gate import guard
from bankml.gate.guard import GuardResult, guard_bytes, guard_file
from tests.gguf_bytes import (
    LLAMA_KVS,
    build,
    kv,
    kv_array,
    kv_str,
    kv_u32,
    kv_u64,
    s,
    tensor,
)

N = 16384  # the test vectors' tensor size

# -- small files built field by field ------------------------------------------------------------


def small_valid() -> bytes:
    """Two tensors, a vocabulary array, a nested array: every part of the format, all valid."""
    vocab = b"".join(s(t) for t in ["<s>", "a", "bc", ""])
    nested = (
        struct.pack("<IQ", 4, 2)
        + struct.pack("<2I", 1, 2)
        + struct.pack("<IQ", 4, 1)
        + struct.pack("<I", 3)
    )
    kvs = LLAMA_KVS + [
        kv_array("tokenizer.ggml.tokens", 8, 4, vocab),
        kv_array("x.nested", 9, 2, nested),
        kv_array("x.scores", 6, 3, struct.pack("<3f", 0.0, 1.0, 2.0)),
        kv_u32("llama.block_count", 2),
    ]
    tensors = [tensor("a", [8, 2], 0, 0), tensor("b", [32], 1, 64)]
    return build(kvs, tensors)


def judge(data: bytes, filename: str = "m.gguf", engine: str = "mainline") -> GuardResult:
    return guard_bytes(data, len(data), filename, engine)


def refused_with(data: bytes, needle: str, **kw) -> GuardResult:
    result = judge(data, **kw)
    assert result.verdict == "refuse", result
    assert any(needle in reason for reason in result.reasons), result.reasons
    return result


# -- the real default model ---------------------------------------------------------------------


def test_default_model_plays_and_agrees_with_gguf_reader(default_model: Path) -> None:
    result = guard_file(default_model)
    reader = GGUFReader(default_model)  # trusts the header, fine on a file we know is good
    assert result.verdict == "play" and result.reasons == ()
    assert result.tensors == len(reader.tensors)
    expected: dict[int, int] = {}
    for t in reader.tensors:
        expected[int(t.tensor_type)] = expected.get(int(t.tensor_type), 0) + 1
    assert result.types == {GGMLQuantizationType(i).name: expected[i] for i in sorted(expected)}
    assert result.arch == reader.fields["general.architecture"].contents()
    assert result.name == reader.fields["general.name"].contents()
    assert result.data_start == reader.data_offset
    layers = reader.fields["llama.block_count"].contents()
    kv_heads = reader.fields["llama.attention.head_count_kv"].contents()
    head_dim = (
        reader.fields["llama.embedding_length"].contents()
        // reader.fields["llama.attention.head_count"].contents()
    )
    assert result.kv_f16_bytes_per_token == layers * kv_heads * 2 * head_dim * 2


def test_default_model_json_and_text_shapes(default_model: Path) -> None:
    result = guard_file(default_model)
    assert list(result.as_dict()) == [
        "gguf_version",
        "arch",
        "name",
        "tensors",
        "types",
        "engine",
        "reasons",
        "kv_f16_bytes_per_token",
        "verdict",
    ]
    assert result.to_json().startswith('{"gguf_version": 3, "arch": "llama", ')
    head = result.to_text().splitlines()[0]
    assert head == "play " + " ".join(f"{k}:{v}" for k, v in result.types.items())


def test_default_model_needs_rereads_when_the_first_prefix_is_short(
    default_model: Path, monkeypatch
) -> None:
    monkeypatch.setattr(guard, "PREFIX_BYTES", 1000)  # the real header is ~1.8 MB: several re-reads
    assert guard_file(default_model).verdict == "play"


def test_truncated_model_in_the_header_needs_more(default_model: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_model.read_bytes()[:300_000])
    result = guard_file(cut)
    assert result.verdict == "need_more" and result.bytes_needed > 300_000
    assert result.as_dict() == {"verdict": "need_more", "bytes_needed": result.bytes_needed}
    assert result.to_text() == f"need_more {result.bytes_needed}"


def test_truncated_model_in_the_data_is_refused(default_model: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_model.read_bytes()[:20_000_000])
    result = guard_file(cut)
    assert result.verdict == "refuse"
    assert any(
        "data runs past the end of the file (file 20000000 bytes" in r for r in result.reasons
    )


# -- valid synthetic files ----------------------------------------------------------------------


def test_gguf_writer_file_plays(tmp_path: Path) -> None:
    path = tmp_path / "w.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("writer test")
    writer.add_block_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("w.f32", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.add_tensor("w.f16", np.ones(96, dtype=np.float16))
    q8 = quantize(
        np.linspace(-1, 1, 128, dtype=np.float32).reshape(2, 64), GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("w.q8", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = guard_file(path)
    assert result.verdict == "play", result.reasons
    assert result.types == {"F32": 1, "F16": 1, "Q8_0": 1}
    assert result.kv_f16_bytes_per_token == 4 * 2 * (16 + 16) * 2
    assert (result.arch, result.name, result.tensors) == ("llama", "writer test", 3)


def test_struct_built_valid_file_plays() -> None:
    result = judge(small_valid())
    assert result.verdict == "play", result.reasons
    assert result.types == {"F32": 1, "F16": 1}


# -- the guard's test vectors ------------------------------------------------------------------


def test_vector_q1_0_and_f16_play() -> None:
    data = build(LLAMA_KVS, [tensor("q1", [N], 41, 0), tensor("f16", [N], 1, N // 128 * 18)])
    result = judge(data)
    assert result.verdict == "play", result.reasons
    assert result.types == {"F16": 1, "Q1_0": 1}  # ordered by type id


def test_vector_q2_0_group_64_plays_and_group_128_is_refused() -> None:
    assert (
        judge(build(LLAMA_KVS, [tensor("q2", [N], 42, 0)], data_size=N // 64 * 18)).verdict
        == "play"
    )
    result = refused_with(
        build(LLAMA_KVS, [tensor("q2", [N], 42, 0)], data_size=N // 128 * 34), "Q2_0"
    )
    assert result.reasons == (
        "1 Q2_0 tensors smaller than group-64 layout: legacy group-128 Prism file, "
        "use *-Q2_0_g64.gguf or *-PQ2_0.gguf",
    )


def test_vector_pq2_0_refused_on_mainline_plays_on_prism() -> None:
    data = build(LLAMA_KVS, [tensor("p", [N], 142, 0)], data_size=N // 4)
    assert judge(data).reasons == (guard.PRISM_ON_MAINLINE,)
    assert judge(data, engine="prism").verdict == "play"
    assert judge(data, engine="prism").types == {"PQ2_0": 1}


def test_vector_bonsai_2_refused_on_mainline_plays_on_prism() -> None:
    data = build(
        [kv_str("general.architecture", "qwen3"), kv_str("general.name", "Ternary Bonsai 2 27B")]
    )
    assert judge(data).reasons == (guard.BONSAI_ON_MAINLINE,)
    assert judge(data, engine="prism").verdict == "play"
    assert judge(build(LLAMA_KVS), filename="x-prism-fork-required.gguf").verdict == "refuse"


def test_vector_qwen3_8b_kv_shape() -> None:
    kvs = [
        kv_str("general.architecture", "qwen3"),
        kv_u32("qwen3.block_count", 36),
        kv_u32("qwen3.attention.head_count_kv", 8),
        kv_u32("qwen3.attention.key_length", 128),
    ]
    assert judge(build(kvs)).kv_f16_bytes_per_token == 147456


def test_vector_first_40_bytes_need_more(default_model: Path) -> None:
    with open(default_model, "rb") as f:
        prefix = f.read(40)
    result = guard_bytes(prefix, None, default_model.name)
    assert result.verdict == "need_more" and result.bytes_needed > 40


# -- hostile headers ----------------------------------------------------------------------------


def test_bad_magic() -> None:
    result = refused_with(b"GGML" + small_valid()[4:], "not a GGUF file")
    assert result.as_dict() == {
        "gguf_version": 0,
        "arch": None,
        "name": None,
        "tensors": 0,
        "types": {},
        "engine": "mainline",
        "reasons": ["not a GGUF file"],
        "verdict": "refuse",
    }
    assert judge(b"").verdict == "need_more"  # nothing yet: could still be a GGUF
    assert judge(b"PK\x03\x04").reasons == ("not a GGUF file",)


@pytest.mark.parametrize("version", [0, 1, 4, 2**32 - 1])
def test_bad_version(version: int) -> None:
    refused_with(build(LLAMA_KVS, version=version), f"gguf version {version} is not supported")


def test_big_endian_file_is_named() -> None:
    data = b"GGUF" + struct.pack(">IQQ", 3, 0, 0)
    assert judge(data).reasons == (
        "gguf version 50331648 is not supported (2 and 3 are): a big-endian GGUF, which ggml on this machine "
        "cannot read",
    )


def test_version_2_plays() -> None:
    assert judge(build(LLAMA_KVS, version=2)).verdict == "play"


@pytest.mark.parametrize("n_kv", [2**63, 2**64 - 1, 70_000])
def test_huge_kv_count(n_kv: int) -> None:
    refused_with(build(LLAMA_KVS, n_kv=n_kv), "metadata keys")


def test_counts_larger_than_the_file_can_hold_need_more_at_once() -> None:
    for data in (build(LLAMA_KVS, n_kv=60_000), build(LLAMA_KVS, n_tensors=5000)):
        result = judge(data)
        assert result.verdict == "need_more" and result.bytes_needed > len(data)


@pytest.mark.parametrize("n_tensors", [2**63, 2**40, 2**20 + 1])
def test_huge_tensor_count(n_tensors: int) -> None:
    refused_with(
        build(LLAMA_KVS, n_tensors=n_tensors), f"header claims {n_tensors} tensors, more than"
    )


def test_huge_count_with_unknown_size_stops_at_the_prefix() -> None:
    data = build(LLAMA_KVS, n_kv=60_000)
    result = guard_bytes(data, None, "m.gguf")
    assert result.verdict == "need_more" and result.bytes_needed == 24 + 60_000 * 13


def test_two_million_nested_arrays_refused() -> None:
    depth = 2_000_000
    payload = struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 0, 0)
    data = build([kv("deep", 9, payload)])
    assert judge(data).reasons == ("gguf arrays nested deeper than 64",)
    assert guard_bytes(data, None, "m.gguf").reasons == ("gguf arrays nested deeper than 64",)


def test_nesting_of_64_plays_and_65_is_refused() -> None:
    def nested(depth: int) -> bytes:
        return kv(
            "n", 9, struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 0, 1) + b"\x07"
        )

    assert judge(build([nested(64)])).verdict == "play"
    refused_with(build([nested(65)]), "nested deeper than 64")


def test_array_count_past_any_header() -> None:
    refused_with(build([kv_array("big", 8, 2**61, b"")]), "claims 2305843009213693952 elements")
    refused_with(build([kv_array("big", 12, 2**40, b"")]), "claims 1099511627776 elements")
    refused_with(build([kv_array("big", 9, 2**40, b"")]), "claims 1099511627776 elements")


def test_array_count_past_the_file_needs_more_without_walking() -> None:
    data = build([kv_array("tokenizer.ggml.tokens", 8, 10_000_000, b"")])
    assert judge(data).bytes_needed == len(data) + 80_000_000


def test_key_length_over_the_cap() -> None:
    data = build([struct.pack("<Q", 2**62) + b"k" * 16])
    assert judge(data).reasons == (
        "metadata key at offset 24 is 4611686018427387904 bytes, more than the 65536 allowed",
    )
    refused_with(
        build([kv_str("general.name", "x"), struct.pack("<Q", 70_000) + b"k"]),
        "more than the 65536",
    )
    refused_with(build(LLAMA_KVS, [(struct.pack("<Q", 2**40), 0)]), "tensor name at offset")


def test_string_value_longer_than_any_header() -> None:
    refused_with(build([kv("s", 8, struct.pack("<Q", 2**63) + b"abc")]), "value of 's' at offset")
    vocab = s("ok") + struct.pack("<Q", 2**50)
    refused_with(build([kv_array("tokenizer.ggml.tokens", 8, 2, vocab)]), "string at offset")


def test_string_just_past_the_end_is_a_truncated_file(tmp_path: Path) -> None:
    data = build(LLAMA_KVS + [kv("s", 8, struct.pack("<Q", 50) + b"abc")])
    path = tmp_path / "t.gguf"
    path.write_bytes(data)
    result = guard_file(path)
    assert result.verdict == "need_more" and result.bytes_needed == len(data) + 47


def test_header_over_the_cap_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(guard, "MAX_HEADER_BYTES", 1000)
    data = build(LLAMA_KVS + [kv("s", 8, s("x" * 2000))])
    assert (
        guard_bytes(data, None, "m.gguf").verdict == "play"
    )  # all there: the cap bounds re-reads only
    result = guard_bytes(data[:200], None, "m.gguf")
    assert result.verdict == "refuse" and "more than the 1000 this guard reads" in result.reasons[0]


@pytest.mark.parametrize("vtype", [13, 255, 2**32 - 1])
def test_unknown_value_type(vtype: int) -> None:
    assert judge(build([kv("x", vtype, b"\0" * 16)])).reasons == (
        f"unknown gguf value type {vtype}",
    )
    assert judge(build([kv_array("x", vtype, 1, b"\0" * 16)])).reasons == (
        f"unknown gguf value type {vtype}",
    )


@pytest.mark.parametrize(
    "value, text",
    [
        (kv_u32("general.alignment", 0), "general.alignment 0 is not a positive integer"),
        (kv_str("general.alignment", "32"), "general.alignment 32 is not a positive integer"),
        (
            kv("general.alignment", 6, struct.pack("<f", 0.5)),
            "general.alignment 0.5 is not a positive integer",
        ),
        (
            kv("general.alignment", 6, struct.pack("<f", float("inf"))),
            "general.alignment inf is not a positive integer",
        ),
        (
            kv("general.alignment", 5, struct.pack("<i", -32)),
            "general.alignment -32 is not a positive integer",
        ),
    ],
)
def test_alignment_not_a_positive_integer(value: bytes, text: str) -> None:
    assert judge(build(LLAMA_KVS + [value])).reasons == (text,)


def test_alignment_not_a_power_of_two() -> None:
    data = build(
        LLAMA_KVS + [kv_u32("general.alignment", 48)], [tensor("a", [12], 0, 0)], alignment=48
    )
    assert judge(data).reasons == ("general.alignment 48 is not a power of two, as ggml requires",)


def test_alignment_float_and_64_play() -> None:
    data = build(
        LLAMA_KVS + [kv("general.alignment", 6, struct.pack("<f", 64.0))],
        [tensor("a", [16], 0, 0), tensor("b", [4], 0, 64)],
        alignment=64,
    )
    result = judge(data)
    assert result.verdict == "play" and result.alignment == 64 and result.data_start % 64 == 0


@pytest.mark.parametrize("type_id", [4, 5, 31, 43, 99, 141, 2**32 - 1])
def test_unknown_tensor_type(type_id: int) -> None:
    data = build(
        LLAMA_KVS, [tensor("a", [32], type_id, 0), tensor("b", [32], 0, 128)], data_size=256
    )
    assert f"type ids [{type_id}] unknown to every build this guard knows" in judge(data).reasons
    assert judge(data).types == {"F32": 1, str(type_id): 1}


def test_tensor_data_past_the_end() -> None:
    data = build(LLAMA_KVS, [tensor("blk.0.w", [64], 0, 0)], data_size=100)
    refused_with(data, "1 tensors whose data runs past the end of the file")
    result = refused_with(data, "'blk.0.w'")
    assert len(result.reasons) == 1


def test_tensor_offset_far_past_the_end() -> None:
    refused_with(
        build(LLAMA_KVS, [tensor("far", [8], 0, 2**62)], data_size=32), "past the end of the file"
    )


def test_overlapping_tensors() -> None:
    data = build(LLAMA_KVS, [tensor("a", [16], 0, 0), tensor("b", [16], 0, 32)], data_size=96)
    assert judge(data).reasons == ("1 tensors whose data overlaps the next tensor's: 'a'",)


def test_misaligned_offset() -> None:
    data = build(LLAMA_KVS, [tensor("a", [4], 0, 0), tensor("b", [4], 0, 20)], data_size=64)
    assert judge(data).reasons == (
        "1 tensors whose data offset is not a multiple of general.alignment (32): 'b'",
    )


def test_duplicate_tensor_names() -> None:
    data = build(LLAMA_KVS, [tensor("w", [8], 0, 0), tensor("w", [8], 0, 32)])
    assert judge(data).reasons == ("1 duplicate tensor names: 'w'",)


def test_too_many_dimensions() -> None:
    assert judge(build(LLAMA_KVS, [tensor("five", [1, 1, 1, 1, 1], 0, 0)])).reasons == (
        "tensor 'five' has 5 dimensions, ggml allows at most 4",
    )
    refused_with(
        build(LLAMA_KVS, [(s("huge") + struct.pack("<I", 2**32 - 1), 0)]), "4294967295 dimensions"
    )


def test_negative_and_overflowing_dimensions() -> None:
    refused_with(
        build(LLAMA_KVS, [tensor("neg", [2**63], 0, 0)], data_size=64),
        "dimension >= 2^63 (negative to ggml): 'neg'",
    )
    refused_with(
        build(LLAMA_KVS, [tensor("ovf", [2**32, 2**32], 0, 0)], data_size=64),
        "overflows int64: 'ovf'",
    )


def test_long_tensor_name_and_partial_block_row() -> None:
    refused_with(
        build(LLAMA_KVS, [tensor("n" * 64, [8], 0, 0)]), "tensors named with 64 bytes or more"
    )
    refused_with(
        build(LLAMA_KVS, [tensor("q", [48], 8, 0)], data_size=64),
        "not a whole number of their type's blocks: 'q'",
    )


def test_many_faults_are_listed_briefly() -> None:
    tensors = [tensor(f"t{i}", [4], 0, 16 * i + 8) for i in range(10)]
    reasons = refused_with(build(LLAMA_KVS, tensors, data_size=256), "general.alignment").reasons
    assert reasons == (
        "10 tensors whose data offset is not a multiple of general.alignment (32): "
        "'t0', 't1', 't2' and 7 more",
    )


def test_kv_cache_product_overflow() -> None:
    big = 2**64 - 1
    kvs = [
        kv_str("general.architecture", "llama"),
        kv_u64("llama.block_count", big),
        kv_u64("llama.attention.head_count_kv", big),
        kv_u64("llama.attention.key_length", big),
    ]
    result = judge(build(kvs))
    assert result.reasons == (
        "KV cache size per token overflows (llama.block_count × head_count_kv × key/value length): "
        "malformed header",
    )
    assert "kv_f16_bytes_per_token" not in result.as_dict()


def test_kv_cache_from_embedding_length_when_key_length_is_missing() -> None:
    kvs = [
        kv_str("general.architecture", "llama"),
        kv_u32("llama.block_count", 30),
        kv_u32("llama.attention.head_count_kv", 3),
        kv_u32("llama.embedding_length", 576),
        kv_u32("llama.attention.head_count", 9),
    ]
    assert judge(build(kvs)).kv_f16_bytes_per_token == 30 * 3 * (64 + 64) * 2


def test_duplicate_key_last_wins() -> None:
    data = build([kv_str("general.name", "first"), kv_str("general.name", "second")])
    assert judge(data).name == "second"


def test_every_reason_is_reported_together() -> None:
    data = build(
        [kv_str("general.architecture", "llama"), kv_str("general.name", "Bonsai 2")],
        [tensor("p", [N], 142, 0), tensor("u", [32], 77, 4096), tensor("u", [32], 0, 4100)],
        data_size=8192,
    )
    reasons = judge(data).reasons
    assert len(reasons) == 5, reasons
    assert reasons[:3] == (
        "type ids [77] unknown to every build this guard knows",
        guard.PRISM_ON_MAINLINE,
        guard.BONSAI_ON_MAINLINE,
    )


# -- no input makes the guard raise --------------------------------------------------------------

VALID = small_valid()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    st.integers(0, len(VALID)),
    st.booleans(),
)
def test_mutated_headers_never_raise(
    mutations: list[tuple[int, int]], cut: int, size_known: bool
) -> None:
    data = bytearray(VALID)
    for index, value in mutations:
        data[index] = value
    data = bytes(data[:cut]) if cut else bytes(data)
    result = guard_bytes(data, len(data) if size_known else None, "m.gguf")
    assert result.verdict in ("play", "refuse", "need_more")
    assert (result.verdict == "refuse") == bool(result.reasons)
    assert (result.verdict == "need_more") == (result.bytes_needed is not None)
    result.to_json(), result.to_text()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_after_a_valid_start_never_raise(tail: bytes) -> None:
    data = b"GGUF" + struct.pack("<IQQ", 3, 3, 3) + tail
    assert guard_bytes(data, len(data), "m.gguf").verdict in ("play", "refuse", "need_more")
