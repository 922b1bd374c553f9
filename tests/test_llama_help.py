"""Every flag llama-server lists in its ``--help`` has a verdict in bankml's table.

The reference binary's ``--help`` is read line by line (each flag line names all its spellings,
then a value's placeholder when it takes one): each spelling must be a row of
``bankml.llama_server.FLAGS`` with a verdict (served, ignored with a note on stderr, refused with
its reason, or answered by ``bankml llama-server`` itself), taking a value exactly when
llama-server's does; every row's spellings must be in the help (a flag llama-server dropped is
not kept). Each verdict then acts as it says through ``dropin_argv``. A flag added upstream fails
here until it is given a verdict.
"""

from __future__ import annotations

import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

from bankml.llama_server import ENV_NAMES, FLAGS, IGNORE, MODEL, OWN, REFUSE, SERVE, Flag
from bankml.serving.llama_flags import FlagError, dropin_argv, native_settings

BY_SPELLING = {s: flag for flag in FLAGS for s in flag.spellings}


@lru_cache(maxsize=1)
def help_entries(binary: Path) -> tuple[tuple[tuple[str, ...], bool], ...]:
    """(spellings, takes a value) of each flag line of ``BINARY --help``."""
    text = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    out = []
    for line in text.splitlines():
        if not line.startswith("-") or line.startswith("-----"):
            continue  # a description's continuation, or a section's title
        head = re.split(r"\s{2,}", re.sub(r",\s+", ", ", line.strip()), maxsplit=1)[0]
        spellings, value = [], False
        for part in head.split(", "):
            words = part.split(" ", 1)
            if words[0].startswith("-"):
                spellings.append(words[0])
                value = value or len(words) > 1
        out.append((tuple(spellings), value))
    return tuple(out)


@pytest.fixture(scope="module")
def entries(llama_server_bin: Path) -> tuple[tuple[tuple[str, ...], bool], ...]:
    found = help_entries(llama_server_bin)
    assert len(found) > 250  # the whole help was read
    return found


def test_every_flag_of_llama_servers_help_has_a_verdict(entries) -> None:
    missing, wrong_value = [], []
    for spellings, takes_value in entries:
        for spelling in spellings:
            flag = BY_SPELLING.get(spelling)
            if flag is None or flag.action not in (SERVE, IGNORE, REFUSE, MODEL, OWN):
                missing.append(spelling)
            elif flag.takes_value != takes_value:
                wrong_value.append(spelling)
    assert missing == [], "flags of llama-server's --help without a verdict"
    assert wrong_value == [], "flags that take a value in one table and not the other"


def test_each_flags_environment_variable_is_llama_servers(llama_server_bin: Path) -> None:
    """``ENV_NAMES`` (a preset's keys spelled as variables) is the help's ``(env: NAME)`` of each
    flag line, with whether that line has a negation (``--no-...`` after the first spelling)."""
    text = subprocess.run(
        [str(llama_server_bin), "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    found: dict[str, tuple[str, bool]] = {}
    spellings: list[str] = []
    for line in text.splitlines():
        if line.startswith("-") and not line.startswith("-----"):
            head = re.split(r"\s{2,}", re.sub(r",\s+", ", ", line.strip()), maxsplit=1)[0]
            spellings = [p.split(" ", 1)[0] for p in head.split(", ") if p.startswith("-")]
        env = re.search(r"\(env: (\w+)\)", line)
        if env and spellings:
            negated = any(s.lstrip("-").startswith("no") for s in spellings[1:])
            first = BY_SPELLING[spellings[0]].spellings[0]
            found[env.group(1)] = (first, negated and not spellings[0].startswith("--no-"))
    assert len(found) > 100
    assert found == ENV_NAMES


def test_every_row_is_a_flag_of_llama_servers_help(entries) -> None:
    listed = {s for spellings, _ in entries for s in spellings}
    assert sorted(s for s in BY_SPELLING if s not in listed) == []


def test_every_ignored_or_refused_flag_says_why() -> None:
    assert all(flag.reason for flag in FLAGS if flag.action in (IGNORE, REFUSE, OWN))
    spellings = [s for flag in FLAGS for s in flag.spellings]
    assert len(spellings) == len(set(spellings))


def test_each_side_of_each_option_has_one_row() -> None:
    """FLAGS keys bankml's verdicts to llama-server's options (bankml/llama_options.py): each
    option and each negation it has is one row's spellings, all of them, in llama-server's order
    after the one bankml puts first; a preset's own options have none. (No binary needed: an
    option a regenerated table adds fails here.)"""
    from bankml.llama_options import OPTIONS

    sides = [
        side
        for args, negations, _, _, preset_only in OPTIONS
        if not preset_only
        for side in (args, negations)
        if side
    ]
    rows = [f.spellings for f in FLAGS]
    assert sorted(sorted(s) for s in sides) == sorted(sorted(r) for r in rows)
    by_side = {frozenset(side): side for side in sides}
    for row in rows:
        assert row[1:] == tuple(s for s in by_side[frozenset(row)] if s != row[0])
    assert ENV_NAMES["LLAMA_ARG_CTX_SIZE"] == ("--ctx-size", False)
    assert ENV_NAMES["LLAMA_ARG_JINJA"] == ("--jinja", True)


def _run(flag: Flag, spelling: str) -> tuple[list[str], list[str]]:
    return dropin_argv(["-m", "m.gguf", spelling, *(["1"] if flag.takes_value else [])])


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.action in (SERVE, IGNORE, REFUSE)])
def test_each_verdict_acts_as_it_says(flag: Flag) -> None:
    for spelling in flag.spellings:
        if flag.action == REFUSE:
            with pytest.raises(FlagError) as err:
                _run(flag, spelling)
            assert str(err.value) == f"{spelling}: {flag.reason}"
        elif flag.action == IGNORE:
            argv, notes = _run(flag, spelling)
            assert notes == [f"ignoring {spelling}: {flag.reason}"]
            assert spelling not in argv
        elif flag.name == "models-preset":  # with -m, llama-server's single-model mode
            argv, notes = _run(flag, spelling)
            assert notes == [
                "ignoring --models-preset: with -m one model is served and no preset read"
            ]
            assert spelling not in argv
        else:
            argv, notes = _run(flag, spelling)
            assert notes == [] and f"--{flag.name}" in argv


def test_speculative_decoding_with_a_draft_model_or_lookup_files_stays_refused() -> None:
    assert BY_SPELLING["--spec-type"].action == SERVE  # the n-gram kinds: speculative.py
    for spelling in ("-md", "--spec-draft-n-max", "--spec-default"):
        assert BY_SPELLING[spelling].action == REFUSE
        assert "speculative decoding" in BY_SPELLING[spelling].reason
    for spelling in ("-lcs", "-lcd"):
        assert BY_SPELLING[spelling].action == REFUSE
        assert "not pinned" in BY_SPELLING[spelling].reason


def test_the_context_shift_flags_are_read_the_last_one_winning() -> None:
    def shift(*args: str) -> tuple[bool, int]:
        argv, notes = dropin_argv(["-m", "m.gguf", "--fork", "f.json", *args])
        assert notes == []
        options = {a.lstrip("-"): True for a in argv if a.endswith("context-shift")}
        if "--keep" in argv:
            options["keep"] = argv[argv.index("--keep") + 1]
        settings = native_settings(options)
        return settings["context_shift"], settings["n_keep"]

    assert shift() == (False, 0)  # llama-server's default: off
    assert shift("--context-shift", "--keep", "12") == (True, 12)
    assert shift("--context-shift", "--no-context-shift") == (False, 0)
    assert shift("--no-context-shift", "--context-shift") == (True, 0)
    with pytest.raises(FlagError):
        native_settings({"keep": "many"})


def test_the_chat_template_kwargs_flags_read_as_llama_servers() -> None:
    def kwargs(**options: str | bool) -> dict:
        return dict(native_settings(options)["chat_template_kwargs"])

    assert kwargs() == {"preserve_reasoning": True}  # llama-server's default
    assert kwargs(**{"no-reasoning-preserve": True}) == {"preserve_reasoning": False}
    assert kwargs(**{"reasoning-effort": "high"})["reasoning_effort"] == "high"
    assert "reasoning_effort" not in kwargs(**{"reasoning-effort": "default"})
    given = kwargs(**{"reasoning-effort": "low", "chat-template-kwargs": '{"reasoning_effort": 1}'})
    assert given["reasoning_effort"] == 1  # --chat-template-kwargs last
    assert native_settings({"tags": " b,a, b ,"})["tags"] == ["a", "b"]


def test_the_router_s_option_table_is_llama_servers(entries) -> None:
    """bankml/llama_options.py (written from llama.cpp's common/arg.cpp; the router renders a
    model's options by it): the same options as ``--help`` lists, each with its spellings in
    llama-server's order (its negations after them) and whether it takes a value."""
    from bankml.llama_options import OPTIONS

    listed = {spellings: takes_value for spellings, takes_value in entries}
    table = {
        args + negations: takes_value for args, negations, takes_value, _, own in OPTIONS if not own
    }
    assert table == listed


def test_flash_attention_off_is_refused_where_on_and_auto_are_ignored(tmp_path: Path) -> None:
    """bankml computes flash attention's bits (llama-server's -fa on and auto, on for the
    CPU): those are ignored; -fa off changes llama-server's answers (its logprobs and hidden
    states, docs/modules/embeddings.md) and is refused with the reason, on the command line and
    in a preset; a value llama-server does not know is its error."""
    from bankml.serving.presets import PresetError, load_presets

    for value in ("on", "auto", "1", "enabled", "-1"):
        _, notes = dropin_argv(["-m", "m.gguf", "-fa", value])
        assert notes == [f"ignoring -fa: {BY_SPELLING['-fa'].reason}"]
    for value in ("off", "0", "false", "disabled"):
        with pytest.raises(FlagError, match="computes flash attention"):
            dropin_argv(["-m", "m.gguf", "--flash-attn", value])
    with pytest.raises(FlagError, match="unknown value for --flash-attn: 'maybe'"):
        dropin_argv(["-m", "m.gguf", "-fa", "maybe"])
    preset = tmp_path / "models.ini"
    preset.write_text("[tiny]\nmodel = tiny.gguf\nflash-attn = off\n")
    with pytest.raises(PresetError, match="option 'flash-attn': bankml's native engine"):
        load_presets(str(preset), None, {})
