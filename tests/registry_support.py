"""Small GGUF files, pinned registry directories and FORK.json files for the registry, Ollama
format and verify tests.

The files are real GGUFs (written with gguf.GGUFWriter) that the guard plays: a header with an
architecture, a name, a chat template and a few small tensors. Their weights are never read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from bankml.gate import verify
from tests.support import LlamaServer, http_json

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_gguf(
    path: Path,
    arch: str = "llama",
    name: str = "Tiny",
    size_label: str | None = None,
    template: str | None = TEMPLATE,
    temperature: float | None = None,
    seed: int = 0,
) -> Path:
    """A small GGUF with an F32 norm and two F16 matrices (so its weight type is F16)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    if size_label:
        writer.add_string("general.size_label", size_label)
    if template is not None:
        writer.add_chat_template(template)
    if temperature is not None:
        writer.add_float32("general.sampling.temp", temperature)
    writer.add_uint32(f"{arch}.context_length", 2048)
    rng = np.random.default_rng(seed)
    writer.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float32))
    for t in ("token_embd.weight", "output.weight"):
        writer.add_tensor(
            t,
            rng.standard_normal((16, 32)).astype(np.float16),
            raw_dtype=GGMLQuantizationType.F16,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def pin_into(directory: Path, model: Path, fork_name: str | None = None) -> Path:
    """Pin ``model`` (by its basename) in ``<directory>/<fork_name or file>.FORK.json``."""
    fork = directory / (fork_name or f"{model.name}.FORK.json")
    verify.pin(model, fork)
    return fork


def write_fork(path: Path, files: list[dict], **provenance) -> Path:
    """A FORK.json written by hand: ``files`` after any provenance fields given."""
    path.write_text(json.dumps({**provenance, "files": files}), encoding="utf-8")
    return path


def answers_alone(
    files: dict[str, Path], reference_url: str, binary: Path, prompt: str, n_predict: int
) -> dict[str, str]:
    """Each model's greedy completion of ``prompt`` from the real llama-server on its file
    alone: ``""`` the default model (already served at ``reference_url``), then each of
    ``files`` (name -> GGUF) in a llama-server of its own."""
    body = {"prompt": prompt, "max_tokens": n_predict, "temperature": 0}
    out = {"": http_json(reference_url + "/v1/completions", body)[1]["choices"][0]["text"]}
    for name, path in files.items():
        with LlamaServer(path, binary=binary) as alone:
            status, answer = http_json(alone.url + "/v1/completions", body)
            assert status == 200, answer
            out[name] = answer["choices"][0]["text"]
    return out


def flip_last_byte(path: Path) -> None:
    """Change a pinned file in place: its last byte flipped, the size kept (no longer its pin)."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x01]))
