"""``bankml convert`` against llama.cpp build 11434's own ``convert_hf_to_gguf.py``, byte for byte.

The directories are made here (tests/hf_dirs.py): the default model turned back into a Hugging
Face checkout (BF16 weights, its tokenizer as tokenizer.json), and small random llama, qwen2,
qwen3, gemma3 and BERT models (F32, F16 and BF16 weights, one of them in two shards with an
index); and one real sentence-transformers BERT directory, all-MiniLM-L6-v2
(scripts/fetch-minilm.sh), in every output type. The reference
runs in its own venv with torch's CPU build (scripts/convert-reference-venv.sh, made by ``make
test-deps``). Then the converted default model is served by ``bankml serve --native`` and by
llama-server and must give the same greedy completion, a round trip (GGUF F16 → safetensors F16
→ GGUF) must give the same bytes back, and each refusal is checked: it says why, exits 2 and
leaves no output file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from bankml.convert import OUTTYPES, ConvertError, convert, model
from bankml.engine_cupy.gguf_file import GGUFFile, read_metadata
from tests import hf_dirs, support
from tests.native_server import native_process


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def reference_python() -> str:
    py = hf_dirs.reference_python()
    if py is None:
        out = subprocess.run(
            [str(support.ROOT / "scripts" / "convert-reference-venv.sh")],
            check=True,
            capture_output=True,
            text=True,
        )
        py = out.stdout.strip().splitlines()[-1]
    return py


# the cases compared with the reference: (architecture, shards, outtype, SentencePiece?)
CASES = [
    ("llama", 1, "q8_0", False),
    ("qwen2", 1, "f16", False),
    ("qwen2", 1, "bf16", False),
    ("qwen3", 2, "f16", False),
    ("qwen3", 1, "f32", False),
    ("gemma3", 1, "f16", False),
    ("gemma3", 1, "f16", True),
    ("llama", 1, "f16", True),
]


# all-MiniLM-L6-v2 (a sentence-transformers BERT directory) in every output type
MINILM_OUTTYPES = ["f16", "q8_0", "bf16", "f32"]


# BertForSequenceClassification checkpoints (rerankers): their labels, the output type
RERANKERS = {
    "reranker-one-label": (["LABEL_0"], "f16"),
    "reranker-two-labels": (["irrelevant", "relevant"], "q8_0"),
}


# Llama 3 RoPE scaling (rope_freqs.weight): head_dim -> rope_scaling, Llama 3.2's and 3.1's
LLAMA3 = {
    64: {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    128: {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


def case_id(case: tuple[str, int, str, bool]) -> str:
    arch, shards, outtype, spm = case
    return (
        f"{arch}-{outtype}" + (f"-{shards}shards" if shards > 1 else "") + ("-spm" if spm else "")
    )


@pytest.fixture(scope="module")
def references(
    reference_python: str,
    smollm2: Path,
    default_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, Path]]:
    """Every directory of the module and the reference's GGUF of it: one reference process
    converts them all (torch and transformers load once)."""
    root = tmp_path_factory.mktemp("reference")
    spm = hf_dirs.train_sentencepiece(reference_python)
    dirs: dict[str, tuple[Path, str]] = {"smollm2": (smollm2, "f16")}
    for case in CASES:
        arch, shards, outtype, with_spm = case
        name = case_id(case)
        where = root / name / f"Tiny-{arch}"
        if arch == "gemma3":
            d = hf_dirs.tiny_gemma3_dir(default_model, where, spm=spm if with_spm else None)
        else:
            d = hf_dirs.tiny_dir(
                default_model,
                where,
                arch,
                shards=shards,
                seed=len(name),
                spm=spm if with_spm else None,
            )
        dirs[name] = (d, outtype)
    for head_dim, rope in LLAMA3.items():
        name = f"llama3-{head_dim}"
        where = root / name / "Tiny-llama3"
        d = hf_dirs.tiny_dir(
            default_model,
            where,
            "llama",
            seed=head_dim,
            head_dim=head_dim,
            rope_scaling=rope,
            qk_scale=40.0 if head_dim == 64 else 1.0,  # served below: RoPE shows in its logits
        )
        dirs[name] = (d, "f16")
    where = root / "llama3-64-v5" / "Tiny-llama3"  # transformers v5's rope_parameters
    d = hf_dirs.tiny_dir(
        default_model, where, "llama", seed=5, head_dim=64, rope_scaling=LLAMA3[64],
        rope_parameters=True,
    )  # fmt: skip
    dirs["llama3-64-v5"] = (d, "f16")
    minilm = hf_dirs.minilm_dir()
    for outtype in MINILM_OUTTYPES:
        dirs[f"minilm-{outtype}"] = (minilm, outtype)
    dirs["tiny-bert"] = (hf_dirs.tiny_bert_dir(minilm, root / "tiny-bert" / "Tiny-bert"), "f16")
    for name, (labels, outtype) in RERANKERS.items():
        where = root / name / "Tiny-reranker"
        dirs[name] = (hf_dirs.tiny_bert_dir(minilm, where, labels=labels), outtype)
    jobs = [[str(d), outtype, str(root / f"{name}.gguf")] for name, (d, outtype) in dirs.items()]
    # two reference processes, half the jobs each: the machine's two cores
    runs = [
        subprocess.Popen(
            [
                reference_python,
                "-c",
                hf_dirs.REFERENCE_DRIVER,
                hf_dirs.reference_script(),
                json.dumps(jobs[half::2]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for half in (0, 1)
    ]
    for run in runs:
        _, stderr = run.communicate()
        assert run.returncode == 0, stderr[-3000:]
    return {name: (d, root / f"{name}.gguf") for name, (d, _) in dirs.items()}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bankml", "convert", *args],
        capture_output=True,
        text=True,
        cwd=support.ROOT,
    )


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    return hf_dirs.smollm2_dir(
        default_model, tmp_path_factory.mktemp("hf") / "SmolLM2-135M-Instruct"
    )


@pytest.fixture(scope="module")
def converted(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The default model's directory through `bankml convert` (the command line)."""
    out_dir = tmp_path_factory.mktemp("out")
    out, fork = (
        out_dir / "SmolLM2-135M-Instruct-F16.gguf",
        out_dir / "SmolLM2-135M-Instruct-F16.gguf.FORK.json",
    )
    result = run_cli(
        str(smollm2), "-o", str(out), "--fork", str(fork), "--source", "made by tests/hf_dirs.py"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("pinned ")
    return out, fork, line.removeprefix("pinned ")


def test_the_default_model_converts_byte_identical_to_the_reference(
    converted: tuple[Path, Path, str], references: dict[str, tuple[Path, Path]]
) -> None:
    out, fork, sha = converted
    ref = references["smollm2"][1]
    assert sha256(ref) == sha == sha256(out)
    assert out.stat().st_size == ref.stat().st_size


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tiny_models_convert_byte_identical_to_the_reference(
    case: tuple[str, int, str, bool], references: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Tiny random models (F32, F16 and BF16 weights); the SentencePiece ones use a BPE
    tokenizer.model trained here (Gemma's ids, padded to the model's 512 tokens, with
    tokenizer_config.json's added tokens), its pieces read from the protobuf."""
    arch, _, outtype, spm = case
    d, ref = references[case_id(case)]
    done = convert(
        str(d), str(tmp_path / "ours.gguf"), str(tmp_path / "ours.FORK.json"), outtype=outtype
    )
    assert done.sha256 == sha256(ref) == sha256(tmp_path / "ours.gguf")
    assert done.architecture == arch
    reader = GGUFFile(done.path)
    assert reader.fields["tokenizer.ggml.model"].contents() == ("llama" if spm else "gpt2")
    assert reader.fields["general.file_type"].contents() == int(OUTTYPES[outtype])


@pytest.mark.parametrize("head_dim", LLAMA3)
def test_llama3_rope_scaling_converts_byte_identical_to_the_reference(
    head_dim: int, references: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """Llama 3.2's (head_dim 64, factor 32) and 3.1's (128, factor 8) RoPE scaling: the
    reference's rope_freqs.weight (F32, head_dim / 2 factors, first of the tensors)."""
    d, ref = references[f"llama3-{head_dim}"]
    done = convert(str(d), str(tmp_path / "ours.gguf"), str(tmp_path / "ours.FORK.json"))
    assert done.sha256 == sha256(ref) == sha256(tmp_path / "ours.gguf")
    reader = GGUFFile(done.path)
    first = reader.tensors[0]
    assert first.name == "rope_freqs.weight" and first.tensor_type == gguf.GGMLQuantizationType.F32
    factors = np.array(first.data)
    assert factors.shape == (head_dim // 2,)
    assert factors[0] == 1.0 and factors[-1] == LLAMA3[head_dim]["factor"]
    assert ((factors > 1) & (factors < LLAMA3[head_dim]["factor"])).any()  # the smooth band


def test_transformers_v5_rope_parameters_convert_byte_identical_to_the_reference(
    references: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """transformers v5 writes Llama 3's RoPE scaling and rope_theta into one ``rope_parameters``
    object (no ``rope_scaling``, no top-level ``rope_theta``): read as the reference reads it,
    the same rope_freqs.weight and freq_base 500000."""
    d, ref = references["llama3-64-v5"]
    config = json.loads((d / "config.json").read_text())
    assert "rope_scaling" not in config and "rope_theta" not in config
    done = convert(str(d), str(tmp_path / "ours.gguf"), str(tmp_path / "ours.FORK.json"))
    assert done.sha256 == sha256(ref) == sha256(tmp_path / "ours.gguf")
    reader = GGUFFile(done.path)
    assert reader.tensors[0].name == "rope_freqs.weight"
    assert reader.fields["llama.rope.freq_base"].contents() == 500000.0


def test_a_llama3_model_is_served_as_llama_server_serves_it(
    references: dict[str, tuple[Path, Path]], llama_server_bin: Path, tmp_path: Path
) -> None:
    """The converted head_dim-64 model (Q and K scaled up so that RoPE moves the logits):
    llama-server divides its RoPE frequencies by rope_freqs.weight, and so does bankml: the
    same greedy completion and the same log-probabilities, which the factors change (the same
    file with every factor 1 gives other ones)."""
    d, _ = references["llama3-64"]
    done = convert(str(d), str(tmp_path / "ours.gguf"), str(tmp_path / "ours.FORK.json"))
    out, fork = Path(done.path), Path(done.fork)
    unscaled = tmp_path / "unscaled.gguf"
    shutil.copy(out, unscaled)
    factors = next(t for t in GGUFFile(unscaled).tensors if t.name == "rope_freqs.weight")
    with unscaled.open("r+b") as f:  # every factor 1, in place
        f.seek(factors.data_offset)
        f.write(np.ones(factors.n_elements, np.float32).tobytes())
    body = {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0}
    body.update(cache_prompt=False, n_probs=1)

    def logprobs(answer: dict) -> list[float]:
        return [p["top_logprobs"][0]["logprob"] for p in answer["completion_probabilities"]]

    with support.LlamaServer(out, binary=llama_server_bin) as ref:
        ref_status, ref_answer = support.http_json(ref.url + "/completion", body)
    with support.LlamaServer(unscaled, binary=llama_server_bin) as ref:
        _, unscaled_answer = support.http_json(ref.url + "/completion", body)
    assert logprobs(unscaled_answer) != logprobs(ref_answer)
    with native_process(out, fork, tmp_path / "native") as served:
        status, answer = support.http_json(served.engine_url + "/completion", body)
    assert status == ref_status == 200
    assert answer["content"] == ref_answer["content"] and answer["content"]
    assert answer["tokens_predicted"] == ref_answer["tokens_predicted"] == 8
    assert logprobs(answer) == logprobs(ref_answer)


def test_the_confirmed_llama3_powers_are_torchs(reference_python: str) -> None:
    """CONFIRMED_POWERS, where no power is guarded: each is the reference's torch power."""
    code = (
        "import json, sys, torch\n"
        "out = {}\n"
        "for base, dim in json.loads(sys.argv[1]):\n"
        "    p = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)\n"
        "    out[f'{base} {dim}'] = p.view(torch.int32).tolist()\n"
        "print(json.dumps(out))\n"
    )
    cases = sorted(model.CONFIRMED_POWERS)
    result = subprocess.run(
        [reference_python, "-c", code, json.dumps(cases)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    theirs = json.loads(result.stdout)
    for base, dim in cases:
        ours, _ = model.llama3_powers(base, dim)
        assert ours.view(np.int32).tolist() == theirs[f"{base} {dim}"]


def test_llama3_factors_that_hang_on_a_last_bit_are_refused(
    default_model: Path, tmp_path: Path
) -> None:
    """A power near a rounding midpoint whose factor changes one ULP away: refused, no file.
    rope_theta 500000 at head_dim 96 has such a power in its smooth band."""
    powed, unsure = model.llama3_powers(500000.0, 96)
    assert unsure.any()
    factors = model._llama3_factors(powed, 8.0, 1.0, 4.0, 8192)
    assert not model.llama3_guard(powed, unsure, 8.0, 1.0, 4.0, 8192, factors)
    assert model.llama3_guard(powed, np.zeros_like(unsure), 8.0, 1.0, 4.0, 8192, factors)
    d = hf_dirs.tiny_dir(
        default_model,
        tmp_path / "src" / "Tiny-llama3",
        "llama",
        head_dim=96,
        rope_scaling=LLAMA3[128],
    )
    refused(d, tmp_path, "llama3 RoPE factors (rope_theta 500000.0, head_dim 96)", "last bit")
    _edit_json(d / "config.json", rope_scaling={**LLAMA3[128], "low_freq_factor": 4.0})
    refused(d, tmp_path, "low_freq_factor == high_freq_factor")


@pytest.mark.parametrize("outtype", MINILM_OUTTYPES)
def test_a_sentence_transformers_bert_converts_byte_identical_to_the_reference(
    outtype: str, references: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """all-MiniLM-L6-v2: WordPiece vocabulary (phantom-space tokens, jina-v2-en by its
    check-text hash), position and token-type embeddings kept in F32, mean pooling read from
    modules.json and 1_Pooling/config.json, an I64 position_ids tensor left out."""
    d, ref = references[f"minilm-{outtype}"]
    done = convert(
        str(d), str(tmp_path / "ours.gguf"), str(tmp_path / "ours.FORK.json"), outtype=outtype
    )
    assert done.sha256 == sha256(ref) == sha256(tmp_path / "ours.gguf")
    assert done.architecture == "bert"
    assert "1_Pooling/config.json" in [i["path"] for i in done.inputs]
    fields = read_metadata(done.path, ("tokenizer.ggml.model", "bert.pooling_type"))
    assert fields == {"tokenizer.ggml.model": "bert", "bert.pooling_type": 1}


def test_a_bert_checkpoint_in_its_original_naming_converts_byte_identical(
    references: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """BERT's own names: "bert." prefixes, LayerNorm gamma/beta, a pooler and an MLM head
    dropped, BF16/F16/F32 weights, CLS pooling from a Pooling module elsewhere than 1_Pooling."""
    d, ref = references["tiny-bert"]
    done = convert(str(d), str(tmp_path / "ours.gguf"), str(tmp_path / "ours.FORK.json"))
    assert done.sha256 == sha256(ref) == sha256(tmp_path / "ours.gguf")
    assert read_metadata(done.path, ("bert.pooling_type",)) == {"bert.pooling_type": 2}


@pytest.mark.parametrize("name", RERANKERS)
def test_a_bert_reranker_converts_byte_identical_to_the_reference(
    name: str, references: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """A BertForSequenceClassification: its classifier written as cls.output (weight and bias),
    its labels as bert.classifier.output_labels, the pooler left out."""
    d, ref = references[name]
    labels, outtype = RERANKERS[name]
    done = convert(
        str(d), str(tmp_path / "ours.gguf"), str(tmp_path / "ours.FORK.json"), outtype=outtype
    )
    assert done.sha256 == sha256(ref) == sha256(tmp_path / "ours.gguf")
    reader = GGUFFile(done.path)
    assert reader.fields["bert.classifier.output_labels"].contents() == labels
    names = {t.name for t in reader.tensors}
    assert {"cls.output.weight", "cls.output.bias"} <= names and "cls.weight" not in names


def test_bert_settings_it_cannot_convert_are_refused(tmp_path: Path) -> None:
    d = hf_dirs.tiny_bert_dir(hf_dirs.minilm_dir(), tmp_path / "src" / "Tiny-bert")
    pooling = d / "1_Pool" / "config.json"
    pooling.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    refused(d, tmp_path, "1_Pool/config.json: only mean, CLS and last-token pooling")
    pooling.write_text(json.dumps({"pooling_mode": "cls"}))
    _edit_json(d / "config.json", position_embedding_type="relative_key")
    refused(d, tmp_path, "position_embedding_type 'relative_key' is not converted")
    reranker = hf_dirs.tiny_bert_dir(
        hf_dirs.minilm_dir(), tmp_path / "rr" / "Tiny-reranker", labels=["LABEL_0", "LABEL_1"]
    )
    refused(reranker, tmp_path, "AutoConfig's placeholder labels (LABEL_0, LABEL_1)")
    _edit_json(reranker / "config.json", id2label={"a": "x"})
    refused(reranker, tmp_path, "id2label's keys are not label numbers")


def test_a_converted_f16_model_converts_back_to_the_same_bytes(
    default_model: Path, tmp_path: Path
) -> None:
    """GGUF F16 → safetensors F16 (its weights exact) → GGUF: the same file again."""
    first_dir = hf_dirs.tiny_dir(default_model, tmp_path / "a" / "Tiny-llama", "llama", seed=3)
    first = convert(str(first_dir), str(tmp_path / "first.gguf"), str(tmp_path / "f.FORK.json"))
    reader = GGUFFile(first.path)
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv = int(reader.fields["llama.attention.head_count_kv"].contents())
    tensors = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        data = np.array(t.data)
        if parts[0] == "blk":
            if parts[2] in ("attn_q", "attn_k"):
                data = hf_dirs.unpermute(data, heads if parts[2] == "attn_q" else kv)
            name = f"model.layers.{parts[1]}.{hf_dirs.HF_NAMES[parts[2]]}.{parts[3]}"
        else:
            name = f"{hf_dirs.HF_NAMES[parts[0]]}.{parts[1]}"
        tensors[name] = ("F16" if data.dtype == np.float16 else "F32", data)
    second_dir = tmp_path / "b" / "Tiny-llama"
    shutil.copytree(first_dir, second_dir)
    (second_dir / "model.safetensors").unlink()
    hf_dirs.write_safetensors(second_dir / "model.safetensors", dict(sorted(tensors.items())))
    second = convert(str(second_dir), str(tmp_path / "second.gguf"), str(tmp_path / "s.FORK.json"))
    assert second.sha256 == first.sha256


def test_the_converted_model_is_served_as_llama_server_serves_it(
    converted: tuple[Path, Path, str], llama_server_bin: Path, tmp_path: Path
) -> None:
    out, fork, _ = converted
    body = {
        "prompt": "The capital of France is",
        "n_predict": 8,
        "temperature": 0,
        "cache_prompt": False,
    }
    with support.LlamaServer(out, binary=llama_server_bin) as ref:
        ref_status, ref_answer = support.http_json(ref.url + "/completion", body)
    with native_process(out, fork, tmp_path / "native") as served:
        status, answer = support.http_json(served.engine_url + "/completion", body)
    assert status == ref_status == 200
    assert answer["content"] == ref_answer["content"] and answer["content"]
    assert answer["tokens_predicted"] == ref_answer["tokens_predicted"] == 8


# --- refusals: the reason, exit 2, no output file ------------------------------------------------


@pytest.fixture
def tiny(default_model: Path, tmp_path: Path) -> Path:
    return hf_dirs.tiny_dir(default_model, tmp_path / "src" / "Tiny-llama", "llama", seed=5)


def refused(directory: Path, tmp_path: Path, *words: str) -> str:
    out, fork = tmp_path / "out.gguf", tmp_path / "out.FORK.json"
    result = run_cli(str(directory), "-o", str(out), "--fork", str(fork))
    assert result.returncode == 2, result.stdout + result.stderr
    line = result.stdout.strip()
    assert line.startswith("refuse: ")
    for word in words:
        assert word in line
    assert not out.exists() and not fork.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.gguf")]
    return line


def _edit_json(path: Path, **changes: object) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def test_an_unknown_architecture_is_refused(tiny: Path, tmp_path: Path) -> None:
    _edit_json(tiny / "config.json", architectures=["MambaForCausalLM"])
    refused(tiny, tmp_path, "architecture 'MambaForCausalLM' is not converted")


def test_an_unknown_tokenizer_is_refused(tiny: Path, tmp_path: Path) -> None:
    tok = json.loads((tiny / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][::2]  # another pre-tokenizer hash
    (tiny / "tokenizer.json").write_text(json.dumps(tok))
    refused(tiny, tmp_path, "pre-tokenizer is not one llama.cpp build 11434 knows")
    (tiny / "tokenizer.model").write_bytes(b"\x0a\x05\x0a\x03")  # a piece cut short
    refused(tiny, tmp_path, "tokenizer.model: a truncated protobuf")
    (tiny / "tokenizer.model").unlink()
    tok = json.loads((tiny / "tokenizer.json").read_text())
    tok["model"]["byte_fallback"] = True
    (tiny / "tokenizer.json").write_text(json.dumps(tok))
    refused(tiny, tmp_path, "byte-fallback BPE")


def test_a_missing_or_truncated_shard_is_refused(default_model: Path, tmp_path: Path) -> None:
    d = hf_dirs.tiny_dir(default_model, tmp_path / "src" / "Tiny-qwen3", "qwen3", shards=2)
    second = d / "model-00002-of-00002.safetensors"
    data = second.read_bytes()
    second.write_bytes(data[:-100])
    refused(d, tmp_path, "model-00002-of-00002.safetensors: truncated")
    second.unlink()
    refused(d, tmp_path, "missing shard: model-00002-of-00002.safetensors")


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _rewrite(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_a_header_that_lies_about_sizes_or_offsets_is_refused(tiny: Path, tmp_path: Path) -> None:
    st = tiny / "model.safetensors"
    header, data = _header(st)
    name = "model.norm.weight"
    lying = json.loads(json.dumps(header))
    lying[name]["shape"] = [lying[name]["shape"][0] * 2]
    _rewrite(st, lying, data)
    refused(tiny, tmp_path, name, "lies about its sizes")
    lying = json.loads(json.dumps(header))
    first = min(
        (v for k, v in lying.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0]
    )
    second = sorted(
        (v for k, v in lying.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][0]
    )[1]
    second["data_offsets"] = [
        first["data_offsets"][0],
        first["data_offsets"][0] + second["data_offsets"][1] - second["data_offsets"][0],
    ]
    _rewrite(st, lying, data)
    refused(tiny, tmp_path, "lies about its offsets")


def test_a_dtype_it_cannot_convert_is_refused(tiny: Path, tmp_path: Path) -> None:
    st = tiny / "model.safetensors"
    header, data = _header(st)
    entry = header["model.norm.weight"]
    entry["dtype"] = "F8_E4M3"
    entry["shape"] = [entry["shape"][0] * 4]  # the same bytes, one byte an element
    _rewrite(st, header, data)
    refused(tiny, tmp_path, "model.norm.weight", "dtype F8_E4M3 is not converted")


def test_a_directory_changing_while_read_is_refused(tiny: Path, tmp_path: Path) -> None:
    def touch() -> None:
        (tiny / "config.json").write_text((tiny / "config.json").read_text() + " ")

    with pytest.raises(ConvertError, match=r"changed while it was read \(config.json\)"):
        convert(
            str(tiny), str(tmp_path / "out.gguf"), str(tmp_path / "f.json"), after_hashing=touch
        )
    assert not (tmp_path / "out.gguf").exists() and not (tmp_path / "f.json").exists()
    assert os.listdir(tmp_path) == ["src"]


def test_an_existing_output_is_not_overwritten(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "out.gguf").write_bytes(b"mine")
    result = run_cli(
        str(tiny), "-o", str(tmp_path / "out.gguf"), "--fork", str(tmp_path / "f.json")
    )
    assert result.returncode == 2 and "already exists" in result.stdout
    assert (tmp_path / "out.gguf").read_bytes() == b"mine"


# --- bankml create FROM a directory ----------------------------------------------------------------


def test_create_from_a_directory_converts_pins_and_derives(
    default_model: Path, tmp_path: Path
) -> None:
    tiny = hf_dirs.tiny_dir(default_model, tmp_path / "checkout" / "Tiny-qwen3", "qwen3", seed=7)
    registry = tmp_path / "forks"
    modelfile = tmp_path / "checkout" / "Modelfile"
    modelfile.write_text("FROM ./Tiny-qwen3\nSYSTEM You are terse.\n")

    def create() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "bankml",
                "create",
                "terse",
                "-f",
                str(modelfile),
                "--registry",
                str(registry),
            ],
            capture_output=True,
            text=True,
            cwd=support.ROOT,
        )

    result = create()
    assert result.returncode == 0, result.stdout + result.stderr
    out, fork = registry / "terse-F16.gguf", registry / "terse-F16.gguf.FORK.json"
    sha = sha256(out)
    lines = result.stdout.splitlines()
    assert lines[:4] == [
        "parsing modelfile",
        f"converting {tiny} (safetensors) to terse-F16.gguf",
        f"pinned terse-F16.gguf sha256:{sha} in terse-F16.gguf.FORK.json",
        "verifying terse-F16.gguf (the guard, then its sha256 against terse-F16.gguf.FORK.json)",
    ]
    assert lines[-1] == "success"
    doc = json.loads(fork.read_text())
    assert doc["source"] == str(tiny) and doc["files"][0]["sha256"] == sha
    assert [i["path"] for i in doc["inputs"]] == sorted(p.name for p in tiny.iterdir())
    manifest = json.loads((registry / "terse.MODEL.json").read_text())
    assert manifest["base"]["file"] == "terse-F16.gguf" and manifest["base"]["sha256"] == sha
    assert (
        convert(str(tiny), str(tmp_path / "again.gguf"), str(tmp_path / "again.json")).sha256 == sha
    )
    # a second create of the name would overwrite the converted file: refused, nothing changed
    again = create()
    assert again.returncode == 2
    assert (
        "bankml create: refuse: FROM ./Tiny-qwen3: terse-F16.gguf already exists in" in again.stderr
    )
    assert sha256(out) == sha


def test_a_fork_that_is_not_a_fork_leaves_no_output(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "f.json").write_text("not json")
    result = run_cli(
        str(tiny), "-o", str(tmp_path / "out.gguf"), "--fork", str(tmp_path / "f.json")
    )
    assert result.returncode == 2 and "is not JSON" in result.stdout
    assert not (tmp_path / "out.gguf").exists() and (tmp_path / "f.json").read_text() == "not json"


def test_progress_is_shown_when_asked(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a terminal (progress=None and a tty) or when asked: the hashing and the writing."""
    convert(str(tiny), str(tmp_path / "o.gguf"), str(tmp_path / "o.json"), progress=True)
    err = capsys.readouterr().err
    assert "sha256 model.safetensors" in err and "convert:" in err
    convert(str(tiny), str(tmp_path / "p.gguf"), str(tmp_path / "p.json"), progress=False)
    assert capsys.readouterr().err == ""
