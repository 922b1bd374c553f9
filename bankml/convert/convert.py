"""``convert(directory, out, fork)``: a Hugging Face safetensors directory to a pinned GGUF.

The output is byte for byte what llama.cpp build 11434's ``convert_hf_to_gguf.py`` writes for the
same directory and ``--outtype``. Every regular file at the top of the directory (and, in a
sentence-transformers directory, its modules' ``config.json``) is hashed into the fork's
``inputs``; the GGUF is hashed as it is written, to a temporary name beside ``out``,
and renamed into place only when the directory's files are still the ones hashed (same size,
mtime and inode, none added or removed); then its pin and provenance go into the fork. A refusal
(:class:`ConvertError`) leaves no output file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import gguf
import numpy as np

from bankml.convert import model
from bankml.convert.errors import ConvertError
from bankml.convert.safetensors import Shard, ShardReader
from bankml.convert.vocab import load_vocab, read_json
from bankml.gate.fileident import FileIdent
from bankml.gate.verify import Refused, check_fork, record_pin, sha256_file
from bankml.version import __version__

REFERENCE = "llama.cpp b11434's convert_hf_to_gguf.py"
KIND = "bankml convert (safetensors → GGUF {outtype}, made here, not downloaded)"
OUTTYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}


@contextlib.contextmanager
def _quiet_writer() -> Any:
    """gguf's writer logs each key written twice; the reference writes some twice on purpose."""
    log = logging.getLogger("gguf.gguf_writer")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@dataclass(frozen=True)
class Converted:
    path: str
    sha256: str
    bytes: int
    architecture: str
    tensors: int
    inputs: list[dict[str, Any]]
    fork: str


def _listing(directory: str) -> dict[str, FileIdent]:
    try:
        names = sorted(os.listdir(directory))
    except OSError as err:
        raise ConvertError(f"cannot read {directory}: {err.strerror or err}") from None
    out: dict[str, FileIdent] = {}
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            out[name] = FileIdent.of(path)
    # a sentence-transformers directory: its modules' config.json files (the pooling one is read)
    if "modules.json" in out:
        try:
            with open(os.path.join(directory, "modules.json"), encoding="utf-8") as f:
                modules = json.load(f)
        except (OSError, ValueError, RecursionError):
            modules = None  # read again, and refused, where it is used
        for module in modules if isinstance(modules, list) else []:
            sub = module.get("path") if isinstance(module, dict) else None
            if not isinstance(sub, str) or not sub or os.path.isabs(sub) or ".." in sub.split("/"):
                continue
            name = f"{sub}/config.json"
            if os.path.isfile(os.path.join(directory, name)):
                out[name] = FileIdent.of(os.path.join(directory, name))
    return dict(sorted(out.items()))


def _shards(directory: str, files: dict[str, FileIdent]) -> list[Shard]:
    index_name = "model.safetensors.index.json"
    parts = sorted(n for n in files if n.startswith("model") and n.endswith(".safetensors"))
    weight_map: dict[str, Any] = {}
    if index_name in files:
        index = read_json(os.path.join(directory, index_name), index_name)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None  # type: ignore[assignment]
        if not isinstance(weight_map, dict):
            raise ConvertError(f"{index_name}: no weight_map")
        parts = sorted({str(v) for v in weight_map.values()})
        missing = [p for p in parts if p not in files]
        if missing:
            raise ConvertError(
                f"missing shard{'s' if len(missing) > 1 else ''}: {', '.join(missing)}"
            )
    if not parts:
        if any(n.endswith((".bin", ".pt", ".pth")) for n in files):
            raise ConvertError("only PyTorch pickles (.bin): bankml converts safetensors only")
        raise ConvertError("no model*.safetensors in the directory")
    shards = [Shard(os.path.join(directory, p)) for p in parts]
    if weight_map:
        in_parts = {n for s in shards for n in s.tensors}
        missing_t = sorted(set(weight_map) - in_parts)
        extra = sorted(in_parts - set(weight_map))
        if missing_t or extra:
            lost = sorted({str(weight_map[n]) for n in missing_t})
            raise ConvertError(
                f"the shards do not hold the tensors {index_name} names: missing "
                f"{', '.join(missing_t[:5]) or 'none'}{' …' if len(missing_t) > 5 else ''}"
                f"{' (incomplete ' + ', '.join(lost) + ')' if lost and not extra else ''}; "
                f"unlisted {', '.join(extra[:5]) or 'none'}"
            )
    return shards


class _HashingFile:
    """A binary file that hashes what is written to it (GGUFWriter writes through it)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.digest = hashlib.sha256()
        self.n = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.f.write(view)
        self.digest.update(view)
        self.n += len(view)
        return len(view)

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def _progress(total: int, enabled: bool | None) -> Any:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="convert",
        file=sys.stderr,
        leave=False,
    )


def convert(
    directory: str,
    out: str,
    fork: str,
    *,
    source: str | None = None,
    outtype: str = "f16",
    progress: bool | None = None,
    now: Callable[[], float] = time.time,
    after_hashing: Callable[[], None] | None = None,
) -> Converted:
    """Convert ``directory`` into the GGUF ``out`` and pin it in ``fork``; ConvertError if refused."""
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype {outtype}: one of {', '.join(OUTTYPES)}")
    ftype = OUTTYPES[outtype]
    if not os.path.isdir(directory):
        raise ConvertError(f"{directory} is not a directory")
    directory = os.path.realpath(directory)
    out_abs = os.path.abspath(out)
    if os.path.exists(out_abs):
        raise ConvertError(f"{out} already exists: not overwritten")
    try:
        check_fork(fork)  # before the work, not after it
    except Refused as err:
        raise ConvertError(err.reason) from None
    files = _listing(directory)
    if os.path.dirname(out_abs) == directory:  # the output is no input
        files.pop(os.path.basename(out_abs), None)

    # hash the inputs first: what the fork records is what was read
    inputs: list[dict[str, Any]] = []
    for name, ident in files.items():
        try:
            sha = sha256_file(os.path.join(directory, name), progress=progress)
        except OSError as err:
            raise ConvertError(f"cannot read {name}: {err.strerror or err}") from None
        inputs.append({"path": name, "bytes": ident.size, "sha256": sha})
    if after_hashing is not None:
        after_hashing()

    hp, hf, arch = model.load_config(directory)
    if arch.name == "qwen3" and model.qwen3_reranker(directory, hp, hf):
        raise ConvertError("a Qwen3 reranker is not converted yet")
    shards = _shards(directory, files)
    reader = ShardReader()
    with _quiet_writer(), contextlib.closing(reader):
        named = model.index_tensors(arch, shards)
        vocab = load_vocab(
            directory, hp.get("vocab_size"), arch.space_prefix_key, wordpiece=arch.name == "bert"
        )
        items = model.plan_tensors(
            hp,
            arch,
            hf,
            ftype,
            named,
            reader.array,
            vocab.n_real if arch.name == "gemma3" else None,
        )
        writer = gguf.GGUFWriter(path=None, arch=arch.name)
        for item in items:
            writer.add_tensor_info(
                item.name, item.shape, np.dtype(np.float32), item.nbytes, raw_dtype=item.qtype
            )
        _metadata(writer, directory, hp, arch, ftype)
        model.add_parameters(writer, hp, arch, ftype, directory)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        model.add_vocab(writer, vocab, hp, arch)
        sha, size = _write(writer, items, out_abs, directory, files, progress)

    record = {
        "kind": KIND.format(outtype=outtype.upper()),
        "source": source if source is not None else directory,
        "converter": f"bankml {__version__} convert --outtype {outtype}: byte-identical to {REFERENCE} --outtype {outtype}",
        "converted_at_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now())),
        "inputs": inputs,
    }
    try:
        record_pin(fork, os.path.basename(out_abs), size, sha, record)
    except Refused as err:
        os.unlink(out_abs)
        raise ConvertError(err.reason) from None
    return Converted(out_abs, sha, size, arch.name, len(items), inputs, os.path.abspath(fork))


def _metadata(
    w: gguf.GGUFWriter,
    directory: str,
    hp: dict[str, Any],
    arch: model.Arch,
    ftype: gguf.LlamaFileType,
) -> None:
    total, shared, expert, count = w.get_total_parameter_count()
    meta = gguf.Metadata.load(None, Path(directory), None, total)
    penalty = model.generation_repeat_penalty(directory)
    if penalty is not None:
        meta.sampling_penalty_repeat = penalty
    if meta.name is None:
        meta.name = os.path.basename(directory)
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, count)
    w.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(w)


def _write(
    w: gguf.GGUFWriter,
    items: list[model.Item],
    out: str,
    directory: str,
    files: dict[str, FileIdent],
    progress: bool | None,
) -> tuple[str, int]:
    out_dir = os.path.dirname(out)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".part", dir=out_dir)
    except OSError as err:
        raise ConvertError(f"cannot write in {out_dir}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb") as raw:
            f = _HashingFile(raw)
            w.fout = [f]  # type: ignore[list-item]
            w.path = None
            w.state = gguf.gguf_writer.WriterState.EMPTY
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            w.write_padding(f, f.tell())  # type: ignore[arg-type]
            bar = _progress(sum(i.nbytes for i in items), progress)
            try:
                for item in items:
                    data = item.load()
                    if data.nbytes != item.nbytes:
                        raise ConvertError(
                            f"{item.name}: {data.nbytes} bytes, expected {item.nbytes}"
                        )
                    f.write(data.reshape(-1).view(np.uint8))
                    w.write_padding(f, item.nbytes)  # type: ignore[arg-type]
                    if bar is not None:
                        bar.update(item.nbytes)
            finally:
                if bar is not None:
                    bar.close()
            raw.flush()
            os.fsync(raw.fileno())
        now = _listing(directory)
        now.pop(os.path.basename(out), None)
        now = {n: i for n, i in now.items() if not n.startswith(f".{os.path.basename(out)}.")}
        if now != files:
            changed = sorted(
                set(now) ^ set(files) | {n for n in now if n in files and now[n] != files[n]}
            )
            raise ConvertError(
                f"the directory changed while it was read ({', '.join(changed)}): not converted"
            )
        if os.path.exists(out):
            raise ConvertError(f"{out} appeared while converting: not overwritten")
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return f.digest.hexdigest(), f.n
