"""The registry: names, discovery of pinned models, resolution, keep-alive, residency."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bankml.gate import verify
from bankml.registry import names
from bankml.registry.catalog import Catalog, Derived
from bankml.registry.create import create, spec_from_modelfile
from bankml.registry.keepalive import (
    DEFAULT,
    FOR,
    FOREVER,
    UNLOAD,
    BadKeepAlive,
    KeepAlive,
    go_duration_seconds,
    parse_keep_alive,
)
from bankml.registry.pins import NOT_HERE, NotFound, discover
from bankml.registry.residency import PS_FOREVER_SECONDS, LoadError, Residency, models_memory
from tests.registry_support import pin_into, write_fork, write_gguf

# -- names ----------------------------------------------------------------------------------------


def test_model_names_and_aliases() -> None:
    assert names.model_name("Bonsai-1.7B-Q1_0.gguf") == "bonsai-1.7b-q1_0"
    assert names.model_name("/a/b/MindX-Gen39-F16.GGUF") == "mindx-gen39-f16"
    assert names.base_name("mindx-gen39-f16") == "mindx-gen39"
    assert names.base_name("bonsai-8b-q2_0_g64") == "bonsai-8b"  # before -q2_0
    assert names.base_name("bonsai-8b-q2_0") == "bonsai-8b"
    assert names.base_name("qwen3-q4_k_m") == "qwen3"
    assert names.base_name("plain") == "plain"
    assert names.tag("x") == "x:latest"
    assert names.request_name(" Bonsai-1.7B-Q1_0:LATEST ") == "bonsai-1.7b-q1_0"
    assert names.request_name("bonsai-1.7b-q1_0.gguf") == "bonsai-1.7b-q1_0"
    assert names.request_name("x:q4") == "x:q4"  # another tag never matches a name


@pytest.mark.parametrize(
    ("requested", "message"),
    [
        ("x:q4", "model name 'x:q4': the only tag is :latest"),
        ("", "model name '': 1 to 128 of a-z, 0-9, '.', '_' and '-'"),
        ("a b", "model name 'a b': 1 to 128 of a-z, 0-9, '.', '_' and '-'"),
        ("a" * 129, f"model name '{'a' * 129}': 1 to 128 of a-z, 0-9, '.', '_' and '-'"),
        (".hidden", "model name '.hidden': may not start with '.' or '-'"),
        ("-x", "model name '-x': may not start with '.' or '-'"),
        ("x.gguf", "model name 'x.gguf': may not end with .gguf (that names a file)"),
        (
            "Tiny-F16",
            "tiny-f16 is a pinned model's name (its file's); a derived model needs its own "
            "— e.g. tiny-f16-persona",
        ),
    ],
)
def test_check_name_refusals(requested: str, message: str) -> None:
    with pytest.raises(names.BadName) as err:
        names.check_name(requested, {"tiny-f16"})
    assert str(err.value) == message


def test_check_name_accepts() -> None:
    assert names.check_name(" MindX:latest ") == "mindx"
    assert names.check_name("a" * 128) == "a" * 128
    assert names.check_name("my_model-1.2") == "my_model-1.2"


# -- keep_alive -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "kind", "seconds"),
    [
        ("5m", FOR, 300.0),
        ("1h30m", FOR, 5400.0),
        ("2.5s", FOR, 2.5),
        (90, FOR, 90.0),
        ("90", FOR, 90.0),
        (1.5, FOR, 1.5),
        ("300ms", FOR, 0.3),
        ("1µs", FOR, 1e-6),
        ("1h1m1s1ms1us1ns", FOR, 3661.001001001),
        (0, UNLOAD, 0.0),
        ("0", UNLOAD, 0.0),
        ("0s", UNLOAD, 0.0),
        (-1, FOREVER, 0.0),
        ("-1", FOREVER, 0.0),
        ("-1m", FOREVER, 0.0),
    ],
)
def test_keep_alive_as_ollama_reads_it(value: object, kind: str, seconds: float) -> None:
    got = parse_keep_alive(value)
    assert got.kind == kind
    assert got.seconds == pytest.approx(seconds)


def test_keep_alive_default() -> None:
    assert parse_keep_alive(None) == DEFAULT == KeepAlive(FOR, 300.0)
    assert parse_keep_alive("") == DEFAULT
    mine = KeepAlive(FOR, 60.0)
    assert parse_keep_alive(None, mine) is mine


@pytest.mark.parametrize("value", ["5 minutes", "m", "5x", ".s", "1.5.5s", "+", "-", "5", "1e"])
def test_keep_alive_bad_strings(value: str) -> None:
    if value == "5":  # a bare number is seconds, not an error
        assert parse_keep_alive(value).seconds == 5.0
        return
    with pytest.raises(BadKeepAlive) as err:
        parse_keep_alive(value)
    assert str(err.value) == f'keep_alive "{value}": not a duration ("5m", "1h", seconds, 0 or -1)'


@pytest.mark.parametrize("value", [True, [1], {"a": 1}])
def test_keep_alive_bad_types(value: object) -> None:
    with pytest.raises(BadKeepAlive) as err:
        parse_keep_alive(value)
    assert str(err.value) == "keep_alive must be a duration string or a number of seconds"


def test_go_durations() -> None:
    assert go_duration_seconds("1.s") == 1.0
    assert go_duration_seconds(".5m") == 30.0
    assert go_duration_seconds("-2h") == -7200.0
    assert go_duration_seconds("1μs") == pytest.approx(1e-6)  # Greek mu, as Go takes it
    with pytest.raises(ValueError):
        go_duration_seconds("3000000h")  # past int64 nanoseconds
    assert KeepAlive(FOR, 10).expires_at(100.0) == 110.0
    assert KeepAlive(FOREVER).expires_at(100.0) is None


# -- discovery and resolution ---------------------------------------------------------------------


@pytest.fixture
def registry_dir(tmp_path: Path) -> Path:
    """A startup model beside its fork, and a registry directory with three pins and noise."""
    start = tmp_path / "start"
    start.mkdir()
    write_gguf(start / "Start-Q8_0.gguf", name="Start")
    pin_into(start, start / "Start-Q8_0.gguf")
    forks = tmp_path / "forks"
    forks.mkdir()
    write_gguf(forks / "MindX-Gen39-F16.gguf", name="MindX", seed=1)
    write_gguf(forks / "Other-Q4_0.gguf", name="Other", seed=2)
    write_gguf(forks / "Odd.gguf", arch="mamba", name="Odd", seed=3)
    pin_into(forks, forks / "MindX-Gen39-F16.gguf", "a.FORK.json")
    pin_into(forks, forks / "Other-Q4_0.gguf", "b.FORK.json")
    pin_into(forks, forks / "Odd.gguf", "c.FORK.json")
    # a later fork naming a file already held (the first holder wins), a missing file, a
    # non-GGUF path and a path with a directory
    write_fork(
        forks / "d.FORK.json",
        [
            {"path": "Other-Q4_0.gguf", "sha256": "0" * 64},
            {"path": "Missing-Q1_0.gguf", "sha256": "1" * 64, "bytes": 1234},
            {"path": "README.md", "sha256": "2" * 64},
            {"path": "sub/Nested.gguf", "sha256": "3" * 64},
        ],
    )
    (forks / "e.FORK.json").write_text("not json", encoding="utf-8")
    write_fork(forks / "f.FORK.json", [])
    (forks / "g.FORK.json").write_text('{"kind": "no files"}', encoding="utf-8")
    return tmp_path


def _registry(root: Path):
    start = root / "start"
    return discover(
        str(root / "forks"),
        search=[str(start)],
        startup=(str(start / "Start-Q8_0.gguf"), str(start / "Start-Q8_0.gguf.FORK.json")),
    )


def test_discovery_order_and_entries(registry_dir: Path) -> None:
    reg = _registry(registry_dir)
    assert reg.names() == [
        "start-q8_0",
        "mindx-gen39-f16",
        "other-q4_0",
        "odd",
        "missing-q1_0",
        "nested",
    ]
    start, mindx, other, odd, missing, nested = reg.pins
    assert start.fork_path.endswith("Start-Q8_0.gguf.FORK.json") and start.native
    assert mindx.sha256 == verify.sha256_file(registry_dir / "forks" / "MindX-Gen39-F16.gguf")
    assert mindx.header is not None and mindx.header.arch == "llama"
    assert mindx.header.quant == "F16"
    assert other.fork_path.endswith("b.FORK.json")  # the first holder, not d.FORK.json
    assert odd.native_reason == (
        "architecture mamba: the forward pass plays llama, qwen2, qwen3, gemma3"
    )
    assert missing.path is None and missing.native_reason == NOT_HERE
    assert missing.bytes == 1234 and missing.sha256 == "1" * 64
    assert nested.sha256 == ""  # a path with a directory never matches a basename: unpinned
    assert mindx.bytes == os.path.getsize(registry_dir / "forks" / "MindX-Gen39-F16.gguf")


def test_without_a_registry_only_the_startup_model(registry_dir: Path) -> None:
    start = registry_dir / "start"
    reg = discover(None, startup=(str(start / "Start-Q8_0.gguf"), str(start / "x.FORK.json")))
    assert reg.names() == ["start-q8_0"]
    assert reg.pins[0].sha256 == ""  # an unreadable fork: unpinned (verify refuses it on load)


def test_files_are_looked_for_beside_the_startup_model_first(registry_dir: Path) -> None:
    start, forks = registry_dir / "start", registry_dir / "forks"
    write_gguf(start / "Other-Q4_0.gguf", name="Other", seed=2)  # the same bytes, elsewhere
    other = _registry(registry_dir).by_name("other-q4_0")
    assert other is not None and other.path == str(start / "Other-Q4_0.gguf")
    assert os.path.samefile(other.fork_path, forks / "b.FORK.json")


def test_resolution(registry_dir: Path) -> None:
    reg = _registry(registry_dir)
    assert reg.resolve(None).name == "start-q8_0"
    assert reg.resolve("  ").name == "start-q8_0"
    assert reg.resolve("MindX-Gen39-F16").name == "mindx-gen39-f16"
    assert reg.resolve("mindx-gen39-f16:latest").name == "mindx-gen39-f16"
    assert reg.resolve("MindX-Gen39-F16.gguf").name == "mindx-gen39-f16"
    assert reg.resolve("mindx-gen39").name == "mindx-gen39-f16"  # the unique alias
    assert reg.resolve("other").name == "other-q4_0"
    with pytest.raises(NotFound) as err:
        reg.resolve("mindx-gen39-f16:q4")
    assert str(err.value) == (
        "model 'mindx-gen39-f16:q4' not found: bankml serves pinned models only "
        "(start-q8_0, mindx-gen39-f16, other-q4_0, odd, missing-q1_0, nested)"
    )


def test_an_alias_held_by_two_pins_is_not_found(tmp_path: Path) -> None:
    for name in ("Same-F16.gguf", "Same-Q8_0.gguf"):
        write_gguf(tmp_path / name, name=name)
        pin_into(tmp_path, tmp_path / name)
    reg = discover(str(tmp_path))
    assert reg.resolve("same-f16").name == "same-f16"
    with pytest.raises(NotFound):
        reg.resolve("same")
    with pytest.raises(NotFound):  # no startup model: a blank name names nothing
        reg.resolve("")


def _derive(root: Path, name: str, modelfile: str) -> None:
    forks = root / "forks"
    catalog = Catalog.load(discover(str(forks)), str(forks))
    create(name, spec_from_modelfile(modelfile), catalog)


def test_catalog_resolution_order(registry_dir: Path) -> None:
    forks = registry_dir / "forks"
    _derive(registry_dir, "mindx-gen39", "FROM mindx-gen39-f16\nSYSTEM You are mindX.\n")
    _derive(registry_dir, "helper", "FROM other-q4_0\n")
    catalog = Catalog.load(_registry(registry_dir), str(forks))
    layer = catalog.resolve("mindx-gen39")  # the derived model, not the pin's alias
    assert isinstance(layer, Derived) and layer.layer.system == "You are mindX."
    assert layer.pin.name == "mindx-gen39-f16"
    assert catalog.resolve("mindx-gen39-f16").name == "mindx-gen39-f16"  # the pin
    assert catalog.resolve("Helper:latest").name == "helper"
    assert catalog.resolve("").name == "start-q8_0"
    with pytest.raises(NotFound) as err:
        catalog.resolve("nothing")
    assert str(err.value).endswith("nested); derived: helper, mindx-gen39")


# -- residency -----------------------------------------------------------------------------------


class Loads:
    """Counts what residency asks of the file system and the engine."""

    def __init__(self) -> None:
        self.verified: list[str] = []
        self.opened: list[str] = []
        self.closed: list[tuple[str, str]] = []
        self.events: list[str] = []

    def verify(self, path: str, fork: str) -> verify.Verified:
        self.verified.append(os.path.basename(path))
        self.events.append("verify " + os.path.basename(path))
        return verify.verify(path, fork)

    def open(self, verified: verify.Verified) -> str:
        self.opened.append(os.path.basename(verified.path))
        self.events.append("open " + os.path.basename(verified.path))
        return "engine for " + os.path.basename(verified.path)

    def unload(self, resident, why: str) -> None:
        self.closed.append((resident.pin.name, why))
        self.events.append("drop " + resident.pin.name)


def _residency(loads: Loads, log: list[str] | None = None) -> Residency:
    return Residency(
        loads.open,
        on_unload=loads.unload,
        log=(log.append if log is not None else lambda line: None),
        verify_model=loads.verify,
    )


def test_every_load_verifies_before_a_switch_drops(registry_dir: Path) -> None:
    reg, loads, log = _registry(registry_dir), Loads(), []
    res = _residency(loads, log)
    first = res.acquire(reg.resolve("mindx-gen39"), now=0.0, shown_as="mindx-gen39-f16")
    assert first.load_ns > 0 and first.resident.handle == "engine for MindX-Gen39-F16.gguf"
    again = res.acquire(reg.resolve("mindx-gen39-f16"), now=1.0)
    assert again.load_ns == 0 and loads.verified == ["MindX-Gen39-F16.gguf"]  # no rehash
    res.acquire(reg.resolve("other"), now=2.0)
    res.acquire(reg.resolve("mindx-gen39"), now=3.0)
    assert loads.events == [
        "verify MindX-Gen39-F16.gguf",
        "open MindX-Gen39-F16.gguf",
        "verify Other-Q4_0.gguf",  # verified before the model it replaces is dropped
        "drop mindx-gen39-f16",
        "open Other-Q4_0.gguf",
        "verify MindX-Gen39-F16.gguf",  # verified again on its next load
        "drop other-q4_0",
        "open MindX-Gen39-F16.gguf",
    ]
    assert log[0] == "bankml serve --native: mindx-gen39-f16 verified (sha256 " + (
        reg.resolve("mindx-gen39").sha256 + "); loading it"
    )
    assert log[1] == "mindx-gen39-f16 unloaded (another model was asked for)"


def test_a_refused_file_at_the_bound_unloads_nothing(registry_dir: Path) -> None:
    """A load whose file no longer matches its pin is refused before any resident model is
    dropped to make room for it: the model resident stays, and answers without a rehash."""
    reg, loads = _registry(registry_dir), Loads()
    res = _residency(loads)
    res.acquire(reg.resolve("mindx-gen39"), now=0.0)
    write_gguf(registry_dir / "forks" / "Other-Q4_0.gguf", name="Other", seed=99)
    with pytest.raises(LoadError) as err:
        res.acquire(reg.resolve("other"), now=1.0)
    assert err.value.status == 503 and err.value.message.startswith("refuse: ")
    assert loads.closed == [] and res.resident is not None
    assert res.resident.pin.name == "mindx-gen39-f16"
    assert res.acquire(reg.resolve("mindx-gen39"), now=2.0).load_ns == 0
    assert loads.events == [
        "verify MindX-Gen39-F16.gguf",
        "open MindX-Gen39-F16.gguf",
        "verify Other-Q4_0.gguf",
    ]


def test_a_file_changed_while_resident_is_unloaded_and_refused(registry_dir: Path) -> None:
    reg, loads = _registry(registry_dir), Loads()
    res = _residency(loads)
    pin = reg.resolve("other")
    res.acquire(pin, now=0.0)
    path = registry_dir / "forks" / "Other-Q4_0.gguf"
    os.utime(path, ns=(1, 1))  # same bytes, another identity
    with pytest.raises(LoadError) as err:
        res.acquire(pin, now=1.0)
    assert err.value.status == 503
    assert err.value.message == (
        "Other-Q4_0.gguf changed since bankml verified it: unloaded, and refused; the next "
        "request verifies it again"
    )
    assert res.resident is None and loads.closed == [("other-q4_0", "its file changed")]
    res.acquire(pin, now=2.0)  # verified again: the bytes still match the pin
    assert loads.verified == ["Other-Q4_0.gguf", "Other-Q4_0.gguf"]
    write_gguf(path, name="Other", seed=99)  # now the bytes differ from the pin
    with pytest.raises(LoadError):
        res.acquire(pin, now=3.0)
    with pytest.raises(LoadError) as err:
        res.acquire(pin, now=4.0)
    assert err.value.status == 503 and err.value.message.startswith(
        "refuse: Other-Q4_0.gguf sha256 "
    )
    assert err.value.message.endswith(f"!= pinned {pin.sha256}: refused")


def test_absent_and_unplayable_pins(registry_dir: Path) -> None:
    reg, loads = _registry(registry_dir), Loads()
    res = _residency(loads)
    with pytest.raises(LoadError) as err:
        res.acquire(reg.resolve("missing-q1_0"), now=0.0)
    assert (err.value.status, err.value.message) == (
        404,
        "Missing-Q1_0.gguf is pinned but not on this machine",
    )
    with pytest.raises(LoadError) as err:
        res.acquire(reg.resolve("odd"), now=0.0)
    assert err.value.status == 400
    assert err.value.message == (
        "odd: bankML's native forward pass does not play it: architecture mamba: the forward "
        "pass plays llama, qwen2, qwen3, gemma3"
    )
    assert loads.verified == []


def test_keep_alive_touch_and_reaper(registry_dir: Path) -> None:
    reg, loads, log = _registry(registry_dir), Loads(), []
    res = _residency(loads, log)
    pin = reg.resolve("other")
    res.acquire(pin, now=100.0)
    assert res.ps_expires_at(100.0) == pytest.approx(100.0 + PS_FOREVER_SECONDS)
    res.touch("mindx-gen39-f16", KeepAlive(UNLOAD), now=100.0)  # not resident: no effect
    assert res.resident is not None
    res.touch(pin.name, parse_keep_alive("5m"), now=100.0)
    assert res.ps_expires_at(101.0) == 400.0
    assert res.reap(399.9) is None and res.resident is not None
    res.touch(pin.name, parse_keep_alive(-1), now=200.0)
    assert res.reap(10_000.0) is None  # kept for good
    res.touch(pin.name, parse_keep_alive("1s"), now=300.0)
    dropped = res.reap(301.0)
    assert dropped is not None and res.resident is None and res.ps_expires_at(301.0) is None
    assert log[-1] == "other-q4_0 unloaded (keep_alive expired)"
    res.acquire(pin, now=400.0)
    res.touch(pin.name, parse_keep_alive(0), now=400.0)
    assert res.resident is None and log[-1] == "other-q4_0 unloaded (keep_alive 0)"


def test_ps_naming(registry_dir: Path) -> None:
    reg, loads = _registry(registry_dir), Loads()
    res = _residency(loads)
    pin = reg.resolve("other")
    got = res.acquire(pin, now=0.0, shown_as="helper", context_length=4096)
    assert (got.resident.shown_as, got.resident.context_length) == ("helper", 4096)
    res.acquire(pin, now=1.0, shown_as="other-q4_0", context_length=4096)
    assert got.resident.shown_as == "helper"  # same num_ctx: the loader's name stays
    res.acquire(pin, now=2.0, shown_as="other-q4_0", context_length=1024)
    assert (got.resident.shown_as, got.resident.context_length) == ("other-q4_0", 1024)


def test_a_derived_model_over_a_file_verified_since_with_another_pin(registry_dir: Path) -> None:
    from bankml.registry.catalog import stale_layer

    _derive(registry_dir, "helper", "FROM other-q4_0\n")
    catalog = Catalog.load(_registry(registry_dir), str(registry_dir / "forks"))
    helper = catalog.resolve("helper")
    assert stale_layer(helper, helper.pin.sha256) is None
    assert stale_layer(helper.pin, "0" * 64) is None  # a pin has no layer
    assert stale_layer(helper, "0" * 64) == (
        f"its base Other-Q4_0.gguf was {helper.pin.sha256} when it was created; the pin now "
        f'says "{"0" * 64}" — create it again'
    )


def test_the_models_memory_budget_is_the_size_given_else_half_the_ram() -> None:
    """--models-memory (native and P0 alike): the bytes given, else half of MemTotal."""
    with open("/proc/meminfo", encoding="ascii") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert models_memory(3 << 30) == 3 << 30
    half = models_memory(None)
    assert half is not None and abs(half - total // 2) <= total // 100
