"""verify, pin, pinned_sha256, sha256_file and FileIdent: on the real default model and small files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from bankml.gate import verify as verify_module
from bankml.gate.fileident import FileIdent
from bankml.gate.verify import Refused, Verified, pin, pinned_sha256, sha256_file, verify
from tests import support
from tests.gguf_bytes import LLAMA_KVS, build, tensor
from tests.registry_support import write_fork


def small_model(directory: Path, name: str = "m.gguf") -> Path:
    path = directory / name
    path.write_bytes(build(LLAMA_KVS, [tensor("a", [64], 0, 0)]))
    return path


def refusal(path: Path, fork: Path, engine: str = "mainline") -> Refused:
    with pytest.raises(Refused) as caught:
        verify(path, fork, engine)
    return caught.value


# -- the real default model ---------------------------------------------------------------------


def test_default_model_verifies(default_model: Path, default_fork: Path) -> None:
    started = time.time()
    verified = verify(default_model, default_fork)
    assert isinstance(verified, Verified)
    assert verified.sha256 == support.DEFAULT_SHA256
    assert verified.path == os.path.realpath(default_model)
    assert verified.guard.verdict == "play" and verified.guard.arch == "llama"
    assert verified.ident == FileIdent.of(default_model)
    assert started <= verified.verified_at <= time.time()
    assert verified.fork_path == os.path.realpath(default_fork)
    assert verified.as_dict()["sha256"] == support.DEFAULT_SHA256


def test_sha256_file_matches_sha256sum(default_model: Path) -> None:
    theirs = subprocess.run(
        ["sha256sum", str(default_model)], capture_output=True, text=True, check=True
    )
    assert sha256_file(default_model) == theirs.stdout.split()[0] == support.DEFAULT_SHA256


def test_default_model_through_a_symlink_is_pinned_by_the_link_name(
    default_model: Path, tmp_path: Path
) -> None:
    link = tmp_path / "alias.gguf"
    link.symlink_to(default_model)
    fork = write_fork(
        tmp_path / "f.json", [{"path": "alias.gguf", "sha256": support.DEFAULT_SHA256.upper()}]
    )
    verified = verify(link, fork)
    assert verified.path == os.path.realpath(default_model)  # the engine is given the real file
    assert verified.sha256 == support.DEFAULT_SHA256


def test_default_model_mis_pinned(default_model: Path, tmp_path: Path) -> None:
    wrong = "0" * 64
    fork = write_fork(tmp_path / "f.json", [{"path": default_model.name, "sha256": wrong}])
    refused = refusal(default_model, fork)
    assert (
        refused.reason
        == f"{default_model.name} sha256 {support.DEFAULT_SHA256} != pinned {wrong}: refused"
    )
    assert refused.exit_code == 2


# -- sha256_file ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size", [0, 1, verify_module.HASH_BLOCK_BYTES, verify_module.HASH_BLOCK_BYTES + 3]
)
def test_sha256_file_sizes(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_sha256_file_progress_bar_on_request(tmp_path: Path, capsys) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 100_000)
    assert sha256_file(path, progress=True) == hashlib.sha256(b"x" * 100_000).hexdigest()
    assert "sha256 blob" in capsys.readouterr().err
    sha256_file(path)  # not a terminal under pytest: no bar
    assert capsys.readouterr().err == ""


def test_sha256_file_unreadable(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        sha256_file(tmp_path / "missing")


# -- pinned_sha256 (FORK.json parsed as JSON) -----------------------------------------------------

SHA_A, SHA_B = "a" * 64, "b" * 64


def fork_text(*files: dict, **extra) -> str:
    return json.dumps({**extra, "files": list(files)})


def test_pinned_sha256_finds_the_basename_and_ignores_provenance() -> None:
    text = fork_text(
        {"sha256": SHA_A.upper(), "bytes": 5, "path": "m.gguf"},
        {"path": "other", "sha256": SHA_B},
        inputs=[{"path": "m.gguf", "sha256": SHA_B}],
        kind="convert",
    )
    assert pinned_sha256(text, "m.gguf") == SHA_A


def test_pinned_sha256_unpinned_cases() -> None:
    assert pinned_sha256(fork_text({"path": "other.gguf", "sha256": SHA_A}), "m.gguf") is None
    assert (
        pinned_sha256(fork_text({"path": "models/m.gguf", "sha256": SHA_A}), "m.gguf") is None
    )  # a directory
    assert (
        pinned_sha256(json.dumps({"inputs": [{"path": "m.gguf", "sha256": SHA_A}]}), "m.gguf")
        is None
    )
    assert pinned_sha256(json.dumps({"files": "m.gguf"}), "m.gguf") is None
    assert pinned_sha256(json.dumps(["m.gguf"]), "m.gguf") is None


def test_pinned_sha256_same_pin_twice_is_fine_two_pins_are_ambiguous() -> None:
    same = fork_text(
        {"path": "m.gguf", "sha256": SHA_A}, {"path": "m.gguf", "sha256": SHA_A.upper()}
    )
    assert pinned_sha256(same, "m.gguf") == SHA_A
    with pytest.raises(Refused) as caught:
        pinned_sha256(
            fork_text({"path": "m.gguf", "sha256": SHA_A}, {"path": "m.gguf", "sha256": SHA_B}),
            "m.gguf",
        )
    assert (
        caught.value.reason
        == "m.gguf has 2 different sha256 records in FORK.json: ambiguous, refused"
    )
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("sha", ["a" * 63, "g" * 64, 12, None, "a" * 65])
def test_pinned_sha256_malformed_pin(sha) -> None:
    with pytest.raises(Refused) as caught:
        pinned_sha256(fork_text({"path": "m.gguf", "sha256": sha}), "m.gguf")
    assert (
        caught.value.reason
        == f"m.gguf has a malformed sha256 record in FORK.json ({sha!r}): refused"
    )


@pytest.mark.parametrize("text", ["", "{", "not json", "[" * 100_000])
def test_pinned_sha256_not_json(text: str) -> None:
    with pytest.raises(Refused) as caught:
        pinned_sha256(text, "m.gguf")
    assert caught.value.reason.startswith("FORK.json is not JSON (")
    assert caught.value.reason.endswith("): m.gguf unpinned, refused")
    assert caught.value.exit_code == 2


# -- verify: every refusal ----------------------------------------------------------------------


def test_small_model_verifies_after_pin(tmp_path: Path) -> None:
    model = small_model(tmp_path)
    fork = tmp_path / "m.gguf.FORK.json"
    sha = pin(model, fork)
    assert sha == hashlib.sha256(model.read_bytes()).hexdigest()
    assert verify(model, fork).sha256 == sha


def test_unpinned(tmp_path: Path) -> None:
    model = small_model(tmp_path)
    fork = write_fork(tmp_path / "f.json", [{"path": "models/m.gguf", "sha256": SHA_A}])
    refused = refusal(model, fork)
    assert (refused.reason, refused.exit_code) == (
        "m.gguf has no sha256 record in FORK.json: unpinned, refused",
        2,
    )


def test_fork_not_json(tmp_path: Path) -> None:
    model = small_model(tmp_path)
    bad = tmp_path / "f.json"
    bad.write_text('{"files": [')
    assert refusal(model, bad).exit_code == 2


@pytest.mark.parametrize("make", ["missing", "directory"])
def test_fork_unreadable(tmp_path: Path, make: str) -> None:
    model = small_model(tmp_path)
    fork = tmp_path / "f.json"
    if make == "directory":
        fork.mkdir()
    refused = refusal(model, fork)
    expected = "No such file or directory" if make == "missing" else "Is a directory"
    assert refused.reason == f"cannot read {fork}: {expected}"
    assert refused.exit_code == 1


def test_model_unreadable(tmp_path: Path) -> None:
    fork = write_fork(tmp_path / "f.json", [{"path": "gone.gguf", "sha256": SHA_A}])
    refused = refusal(tmp_path / "gone.gguf", fork)
    assert refused.reason == f"cannot read {tmp_path / 'gone.gguf'}: No such file or directory"
    assert refused.exit_code == 1


def test_guard_refusal_comes_before_the_pin(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    fork = write_fork(tmp_path / "f.json", [])  # unpinned too, but the guard speaks first
    refused = refusal(model, fork)
    assert (refused.reason, refused.exit_code) == ("guard refused: not a GGUF file", 2)


def test_guard_reasons_are_joined(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(build(LLAMA_KVS, [tensor("w", [8], 0, 0), tensor("w", [8], 0, 20)]))
    refused = refusal(model, write_fork(tmp_path / "f.json", []))
    assert refused.reason == (
        "guard refused: 1 duplicate tensor names: 'w'; "
        "1 tensors whose data offset is not a multiple of general.alignment (32): 'w'; "
        "1 tensors whose data overlaps the next tensor's: 'w'"
    )


def test_truncated_model(default_model: Path, tmp_path: Path) -> None:
    model = tmp_path / default_model.name
    with open(default_model, "rb") as f:
        model.write_bytes(f.read(100_000))
    refused = refusal(model, Path(support.DEFAULT_FORK))
    assert refused.reason.startswith("guard needs ") and refused.reason.endswith(
        " header bytes: file truncated"
    )
    assert int(refused.reason.split()[2]) > 100_000
    assert refused.exit_code == 3


def test_prism_engine_is_passed_to_the_guard(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(build(LLAMA_KVS, [tensor("p", [256], 142, 0)], data_size=64))
    fork = tmp_path / "f.json"
    pin(model, fork)
    assert refusal(model, fork).reason.startswith(
        "guard refused: PQ2_0/PTQ1_0 are PrismML-fork types"
    )
    assert verify(model, fork, engine="prism").guard.engine == "prism"


def test_file_changed_while_hashed(tmp_path: Path, monkeypatch) -> None:
    model = small_model(tmp_path)
    fork = tmp_path / "f.json"
    pin(model, fork)
    real_sha256_file = verify_module.sha256_file

    def hash_then_rewrite(path, progress=None):
        digest = real_sha256_file(path, progress)
        with open(path, "ab") as f:  # another writer appends while the hash was running
            f.write(b"\0" * 32)
        return digest

    monkeypatch.setattr(verify_module, "sha256_file", hash_then_rewrite)
    refused = refusal(model, fork)
    assert (refused.reason, refused.exit_code) == (
        "m.gguf changed while it was being hashed: refused",
        2,
    )


@pytest.mark.parametrize(
    "reason, code",
    [
        ("cannot read x: y", 1),
        ("cannot hash x: y", 1),
        ("guard needs 9 header bytes: file truncated", 3),
        ("guard refused: not a GGUF file", 2),
        ("x sha256 a != pinned b: refused", 2),
    ],
)
def test_refused_exit_codes(reason: str, code: int) -> None:
    assert Refused(reason).exit_code == code and str(Refused(reason)) == reason


# -- pin --------------------------------------------------------------------------------------------


def test_pin_creates_the_fork(tmp_path: Path) -> None:
    model = small_model(tmp_path)
    fork = tmp_path / "new.FORK.json"
    sha = pin(model, fork)
    assert json.loads(fork.read_text()) == {
        "files": [{"path": "m.gguf", "bytes": model.stat().st_size, "sha256": sha}]
    }
    assert [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".FORK.")
    ] == []  # no temp file left


def test_pin_updates_keeping_provenance_and_other_entries(tmp_path: Path) -> None:
    model = small_model(tmp_path)
    fork = write_fork(
        tmp_path / "f.json",
        [
            {"path": "other.gguf", "sha256": SHA_A},
            {"path": "m.gguf", "sha256": SHA_B, "note": "keep"},
            {"path": "m.gguf", "sha256": SHA_A},
        ],
        kind="the test's",
        source="here",
    )
    sha = pin(model, fork)
    doc = json.loads(fork.read_text())
    assert doc["kind"] == "the test's" and doc["source"] == "here"
    assert doc["files"] == [
        {"path": "other.gguf", "sha256": SHA_A},
        {"path": "m.gguf", "sha256": sha, "note": "keep", "bytes": model.stat().st_size},
    ]
    assert verify(model, fork).sha256 == sha


def test_pin_refuses_to_overwrite_a_fork_that_is_not_json(tmp_path: Path) -> None:
    model = small_model(tmp_path)
    fork = tmp_path / "f.json"
    fork.write_text("not json")
    with pytest.raises(Refused) as caught:
        pin(model, fork)
    assert "is not JSON" in caught.value.reason and caught.value.reason.endswith("not overwritten")
    assert fork.read_text() == "not json"


def test_pin_unreadable_model(tmp_path: Path) -> None:
    with pytest.raises(Refused) as caught:
        pin(tmp_path / "missing.gguf", tmp_path / "f.json")
    assert caught.value.reason == "cannot hash missing.gguf: No such file or directory"
    assert not (tmp_path / "f.json").exists()


# -- FileIdent --------------------------------------------------------------------------------------


def test_file_ident_follows_symlinks_and_sees_replacement(tmp_path: Path) -> None:
    model = small_model(tmp_path)
    link = tmp_path / "link.gguf"
    link.symlink_to(model)
    first = FileIdent.of(link)
    st = model.stat()
    assert first == FileIdent(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    replacement = tmp_path / "new.gguf"
    replacement.write_bytes(model.read_bytes())
    os.replace(replacement, model)  # same bytes, new inode: a different file
    assert FileIdent.of(link) != first
    assert FileIdent.of(link).as_dict()["size"] == st.st_size


# -- while_hashing: the work that overlaps the hash ---------------------------------------------


def test_while_hashing_starts_after_the_guard_and_before_the_hash(
    tmp_path: Path, monkeypatch
) -> None:
    model = small_model(tmp_path)
    fork = tmp_path / "f.json"
    pin(model, fork)
    events: list[str] = []
    real_sha256_file = verify_module.sha256_file

    def recorded_hash(path, progress=None):
        events.append("hash")
        return real_sha256_file(path, progress)

    monkeypatch.setattr(verify_module, "sha256_file", recorded_hash)
    verified = verify(model, fork, while_hashing=lambda path: events.append(f"start {path}"))
    assert events == [f"start {verified.path}", "hash"]


def test_while_hashing_is_not_started_for_a_refused_header_or_an_unpinned_file(
    tmp_path: Path,
) -> None:
    started: list[str] = []
    not_gguf = tmp_path / "n.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    unpinned = small_model(tmp_path)
    fork = write_fork(tmp_path / "f.json", [])
    for path in (not_gguf, unpinned):
        with pytest.raises(Refused):
            verify(path, fork, while_hashing=started.append)
    assert started == []
