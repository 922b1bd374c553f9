"""Derived models: the Modelfile grammar, the layer's rules and digest, manifests, create/copy/delete."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pytest

from bankml.cli.registry import USAGE, create_main, default_registry_dir
from bankml.registry.catalog import Catalog
from bankml.registry.create import (
    CreateError,
    copy,
    create,
    create_request,
    delete,
    spec_from_modelfile,
)
from bankml.registry.layer import Layer, LayerError, f32_text, jstr, merge, spec_from_instructions
from bankml.registry.manifest import ManifestError, read_manifest, rfc3339_ns
from bankml.registry.modelfile import ModelfileError, format_value, parse_modelfile
from bankml.registry.pins import discover
from tests.registry_support import TEMPLATE, pin_into, write_gguf

# -- the grammar ----------------------------------------------------------------------------------


def test_grammar() -> None:
    text = (
        "\ufeff# a comment\n"
        "from ./Tiny-F16.gguf\n"
        '  SYSTEM """You are\n  "mindX".\n"""\n'
        "PARAMETER Temperature 0.7   \n"
        'PARAMETER stop "<|im_end|>"\n'
        "parameter stop  </s>\n"
        "MESSAGE user  what is # not a comment\n"
        'MESSAGE assistant "  spaced  "\n'
        'LICENSE """MIT\\n"""\n'
        "requires 0.3.6\n"
    )
    got = [(i.name, i.arg, i.value, i.line) for i in parse_modelfile(text)]
    assert got == [
        ("from", "", "./Tiny-F16.gguf", 2),
        ("system", "", 'You are\n  "mindX".\n', 3),
        ("parameter", "temperature", "0.7", 6),
        ("parameter", "stop", "<|im_end|>", 7),
        ("parameter", "stop", "</s>", 8),
        ("message", "user", "what is # not a comment", 9),
        ("message", "assistant", "  spaced  ", 10),
        ("license", "", "MIT\\n", 11),  # no escapes inside quotes
        ("requires", "", "0.3.6", 12),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "FROM x\nRUN y\n",
            'Modelfile line 2: command must be one of "from", "license", "template", "system", '
            '"adapter", "parameter", "message" or "requires" (not \'RUN\')',
        ),
        ("FROM\n", "Modelfile line 1: FROM needs a value"),
        ("PARAMETER\n", "Modelfile line 1: PARAMETER needs a parameter name"),
        ("PARAMETER top_k\n", "Modelfile line 1: PARAMETER top_k needs a value"),
        (
            "\n\nMESSAGE tool hi\n",
            'Modelfile line 3: MESSAGE role must be one of "system", "user" or "assistant" '
            "(not 'tool')",
        ),
        ('SYSTEM """never closed\n', 'Modelfile line 1: SYSTEM: no closing """ for its value'),
        ('SYSTEM "a" b\n', "Modelfile line 1: SYSTEM: text after the closing \": 'b'"),
    ],
)
def test_grammar_refusals(text: str, message: str) -> None:
    with pytest.raises(ModelfileError) as err:
        parse_modelfile(text)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("value", "written"),
    [
        ("plain words", "plain words"),
        ("two\nlines", '"two\nlines"'),
        (" edge", '" edge"'),
        ('say "hi"\nthen', '"""say "hi"\nthen"""'),
    ],
)
def test_values_written_back_parse_back(value: str, written: str) -> None:
    assert format_value(value) == written
    assert parse_modelfile(f"SYSTEM {written}\n")[0].value == value


# -- the rules ------------------------------------------------------------------------------------


def _spec(text: str):
    return spec_from_instructions(parse_modelfile(text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("SYSTEM hi\n", "no FROM line for the model was specified"),
        ("FROM a\nFROM b\n", "more than one FROM: a bankML model has one base"),
        (
            "FROM a\nADAPTER ./lora.gguf\n",
            "ADAPTER: LoRA adapters are not merged (bankml plays the pinned weights only)",
        ),
    ],
)
def test_from_and_adapter_rules(text: str, message: str) -> None:
    with pytest.raises(LayerError) as err:
        _spec(text).check()
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            "PARAMETER mirostat 2",
            "PARAMETER mirostat: not reproduced (bankml samples with llama-server's chain; a "
            "layer takes temperature, top_k, top_p, min_p, seed, num_ctx, num_predict, "
            "repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty and stop)",
        ),
        (
            "PARAMETER num_thread 4",
            "PARAMETER num_thread: a resource option (how to run a model, not what it answers); "
            "bankml serve sets those",
        ),
        (
            "PARAMETER fancy 1",
            "PARAMETER fancy: not a known parameter (temperature, top_k, top_p, min_p, seed, "
            "num_ctx, num_predict, repeat_penalty, repeat_last_n, presence_penalty, "
            "frequency_penalty and stop)",
        ),
        ("PARAMETER top_k 4.5", 'PARAMETER top_k "4.5": not an integer'),
        ("PARAMETER seed 1_000", 'PARAMETER seed "1_000": not an integer'),
        ("PARAMETER temperature warm", 'PARAMETER temperature "warm": not a number'),
        ("PARAMETER temperature inf", 'PARAMETER temperature "inf": not a finite number'),
        ("PARAMETER top_p 1e39", 'PARAMETER top_p "1e39": not a finite number'),  # f32 overflow
        ("REQUIRES soon", 'REQUIRES "soon": requires must be a valid semver (e.g. 0.14.0)'),
    ],
)
def test_parameter_refusals(line: str, message: str) -> None:
    with pytest.raises(LayerError) as err:
        _spec(f"FROM a\n{line}\n")
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("param", "value", "ok"),
    [
        ("num_ctx", "0", False),
        ("num_ctx", "1", True),
        ("num_predict", "-3", False),
        ("num_predict", "-2", True),
        ("repeat_penalty", "0", False),
        ("repeat_penalty", "0.1", True),
        ("top_k", "-5", True),
        ("seed", "-1", True),
        ("presence_penalty", "-2", True),
        ("frequency_penalty", "-2", True),
        ("temperature", "-0.1", False),
        ("top_p", "-0.5", False),
        ("min_p", "0", True),
        ("repeat_last_n", "-1", False),
    ],
)
def test_range_checks(param: str, value: str, ok: bool) -> None:
    spec = _spec(f"FROM a\nPARAMETER {param} {value}\n")
    if ok:
        merge(spec, "ab" * 32, None, None)
        return
    with pytest.raises(LayerError) as err:
        merge(spec, "ab" * 32, None, None)
    assert str(err.value) == f"PARAMETER {param} {value}: out of range"


def test_last_wins_and_accumulation() -> None:
    spec = _spec(
        "FROM a\nSYSTEM one\nSYSTEM two\nPARAMETER top_k 10\nPARAMETER top_k 20\n"
        "PARAMETER stop x\nPARAMETER stop y\nLICENSE l1\nLICENSE l2\n"
        "MESSAGE user u\nMESSAGE assistant a\nREQUIRES 0.3.6\nREQUIRES v2.1\n"
        "PARAMETER temperature 0.7\n"
    )
    layer = merge(spec, "ab" * 32, None, None)
    assert layer.system == "two" and layer.requires == "2.1"
    assert layer.parameters == {"temperature": 0.7, "top_k": 20}  # in PARAMS order
    assert list(layer.parameters) == ["temperature", "top_k"]
    assert layer.stop == ("x", "y") and layer.license == ("l1", "l2")
    assert layer.messages == (("user", "u"), ("assistant", "a"))


def test_merge_over_a_parent() -> None:
    parent = merge(
        _spec(
            "FROM a\nSYSTEM p\nPARAMETER top_k 5\nPARAMETER seed 7\nPARAMETER stop s\n"
            "LICENSE pl\nMESSAGE user pm\n"
        ),
        "ab" * 32,
        None,
        None,
    )
    child = merge(_spec("FROM p\nPARAMETER top_k 9\nLICENSE cl\n"), "ab" * 32, parent, None)
    assert child.parameters == {"top_k": 9, "seed": 7}
    assert child.system == "p" and child.stop == ("s",) and child.messages == (("user", "pm"),)
    assert child.license == ("pl", "cl")
    again = merge(_spec("FROM p\n"), "ab" * 32, parent, None)
    assert again.digest() == parent.digest()  # nothing added: the same layer


def test_template_only_when_it_is_the_base_s() -> None:
    with pytest.raises(LayerError) as err:
        merge(_spec('FROM a\nTEMPLATE "{{ .Prompt }}"\n'), "ab" * 32, None, TEMPLATE)
    assert str(err.value).startswith(
        "TEMPLATE: the base's own chat template is used; a replacement template is not taken"
    )
    spec = _spec("FROM a\n")
    spec.template = TEMPLATE
    layer = merge(spec, "ab" * 32, None, TEMPLATE)
    assert layer.template_sha256 == hashlib.sha256(TEMPLATE.encode()).hexdigest()


# -- content and digest ---------------------------------------------------------------------------


def test_f32_text_shortest_digits_never_an_exponent() -> None:
    assert f32_text(0.7) == "0.7"
    assert f32_text(1.0) == "1"
    assert f32_text(0.1 + 0.2) == "0.3"  # the f32 nearest 0.30000000000000004
    assert f32_text(1e-10) == "0.0000000001"
    assert f32_text(3e38) == "300000000000000000000000000000000000000"
    assert f32_text(-0.0) == "-0"
    assert f32_text(1.1) == "1.1"
    assert f32_text(16777217.0) == "16777216"


def test_jstr() -> None:
    assert jstr('a"b\\c\nd\te\x01 é €') == '"a\\"b\\\\c\\nd\\u0009e\\u0001 é €"'


def test_content_is_exact_and_the_digest_its_sha256() -> None:
    layer = Layer(
        base_sha256="ab" * 32,
        system="You are mindX.",
        parameters={"temperature": 0.7, "num_ctx": 2048},
        stop=("<|im_end|>",),
        messages=(("user", 'say "hi"'),),
        license=("MIT",),
    )
    content = (
        '{"base_sha256": "' + "ab" * 32 + '", "system": "You are mindX.", '
        '"parameters": {"temperature": 0.7, "num_ctx": 2048}, "stop": ["<|im_end|>"], '
        '"template_sha256": null, "license": ["MIT"], '
        '"messages": [{"role": "user", "content": "say \\"hi\\""}], "requires": null}'
    )
    assert layer.content() == content
    assert layer.digest() == hashlib.sha256(content.encode()).hexdigest()
    assert json.loads(content)["messages"][0]["content"] == 'say "hi"'
    assert Layer.from_json(json.loads(content)) == layer  # read back: the same layer


def test_timestamps() -> None:
    assert rfc3339_ns(0) == "1970-01-01T00:00:00.000000000Z"
    assert rfc3339_ns(1_764_584_775_123_456_789) == "2025-12-01T10:26:15.123456789Z"


# -- create, manifests, copy, delete --------------------------------------------------------------


@pytest.fixture
def forks(tmp_path: Path) -> Path:
    d = tmp_path / "forks"
    d.mkdir()
    write_gguf(d / "Tiny-F16.gguf", name="Tiny")
    pin_into(d, d / "Tiny-F16.gguf")
    return d


def _catalog(forks: Path) -> Catalog:
    return Catalog.load(discover(str(forks)), str(forks), log=lambda line: None)


MODELFILE = (
    "FROM tiny-f16\nSYSTEM You are mindX.\nPARAMETER num_ctx 2048\nPARAMETER temperature 0.7\n"
    'PARAMETER stop "<|im_end|>"\nMESSAGE user hi\nLICENSE MIT\n'
)


def test_create_status_lines_and_manifest(forks: Path) -> None:
    lines: list[str] = []
    created = create(
        "MindX",
        spec_from_modelfile(MODELFILE),
        _catalog(forks),
        parsed_modelfile=True,
        status=lines.append,
        now_ns=lambda: 0,
    )
    pin = _catalog(forks).registry.pins[0]
    digest = created.manifest.digest
    assert (
        lines
        == created.status
        == [
            "parsing modelfile",
            "verifying Tiny-F16.gguf (the guard, then its sha256 against Tiny-F16.gguf.FORK.json)",
            f"using existing layer sha256:{pin.sha256}",
            "creating system layer",
            "creating parameters layer",
            "creating license layer",
            "creating messages layer",
            f"writing manifest mindx.MODEL.json (digest sha256:{digest})",
            "success",
        ]
    )
    path = forks / "mindx.MODEL.json"
    assert created.path == str(path) and not (forks / "mindx.MODEL.json.part").exists()
    text = path.read_text(encoding="utf-8")
    layer = created.manifest.layer
    assert text == (
        "{\n"
        ' "kind": "bankml derived model (a layer over a pinned base; no weights)",\n'
        ' "bankml": "0.1.0",\n'
        ' "name": "mindx",\n'
        ' "created_at": "1970-01-01T00:00:00.000000000Z",\n'
        ' "base": {"name": "tiny-f16", "file": "Tiny-F16.gguf", "sha256": "' + pin.sha256 + '", '
        '"fork": "Tiny-F16.gguf.FORK.json", "path": "' + os.path.realpath(pin.path) + '"},\n'
        ' "layer": ' + layer.content() + ",\n"
        ' "digest": "sha256:' + digest + '"\n'
        "}\n"
    )
    doc = json.loads(text)
    assert doc["layer"]["system"] == "You are mindX."
    assert doc["layer"]["parameters"] == {"temperature": 0.7, "num_ctx": 2048}
    assert doc["layer"]["stop"] == ["<|im_end|>"]
    assert hashlib.sha256(json.dumps(doc["layer"]).encode()).hexdigest() == digest
    assert read_manifest(str(path)).layer == layer


def test_the_digest_is_stable_and_leaves_out_name_and_time(forks: Path) -> None:
    a = create("a", spec_from_modelfile(MODELFILE), _catalog(forks), now_ns=lambda: 1)
    b = create("b", spec_from_modelfile(MODELFILE), _catalog(forks), now_ns=lambda: 2)
    assert a.manifest.digest == b.manifest.digest
    c = copy("a", "c", _catalog(forks))
    assert c.manifest.digest == a.manifest.digest
    empty = copy("tiny-f16", "plain", _catalog(forks))
    assert empty.manifest.layer == Layer(a.manifest.base.sha256)


def test_a_manifest_edited_by_hand_is_refused(forks: Path) -> None:
    created = create("mindx", spec_from_modelfile(MODELFILE), _catalog(forks))
    path = Path(created.path)
    original = path.read_text(encoding="utf-8")
    path.write_text(original.replace("You are mindX.", "You are evil."), encoding="utf-8")
    with pytest.raises(ManifestError) as err:
        read_manifest(str(path))
    want = Layer.from_json(json.loads(path.read_text())["layer"]).digest()
    assert str(err.value) == (
        f"its digest sha256:{created.manifest.digest} is not its content's (sha256:{want}): "
        "edited by hand, refused — create it again"
    )
    catalog = _catalog(forks)
    assert "mindx" not in catalog.derived
    assert catalog.skipped == [(str(path), str(err.value))]
    # a base sha256 changed by hand (the layer still names the old one)
    path.write_text(original.replace('"sha256": "', '"sha256": "0', 1), encoding="utf-8")
    with pytest.raises(ManifestError, match="edited by hand"):
        read_manifest(str(path))
    # a manifest copied by hand under another name
    path.write_text(original, encoding="utf-8")
    (forks / "other.MODEL.json").write_text(original, encoding="utf-8")
    with pytest.raises(ManifestError, match="renamed by hand"):
        read_manifest(str(forks / "other.MODEL.json"))


def test_a_changed_pin_refuses_the_derived_model(forks: Path) -> None:
    created = create("mindx", spec_from_modelfile(MODELFILE), _catalog(forks))
    old = created.manifest.base.sha256
    write_gguf(forks / "Tiny-F16.gguf", name="Tiny", seed=5)  # new weights, pinned again
    pin_into(forks, forks / "Tiny-F16.gguf")
    new = _catalog(forks).registry.pins[0].sha256
    catalog = _catalog(forks)
    assert "mindx" not in catalog.derived
    assert catalog.skipped == [
        (
            created.path,
            f'its base Tiny-F16.gguf was {old} when it was created; the pin now says "{new}" '
            "— create it again",
        )
    ]


def test_create_refusals(forks: Path, tmp_path: Path) -> None:
    catalog = _catalog(forks)
    with pytest.raises(CreateError) as err:
        create("x", spec_from_modelfile("FROM nothing\n"), catalog)
    assert str(err.value) == "FROM nothing: no such model — pins: tiny-f16"
    with pytest.raises(CreateError) as err:
        create("tiny-f16", spec_from_modelfile("FROM tiny-f16\n"), catalog)
    assert str(err.value).startswith("tiny-f16 is a pinned model's name")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write_gguf(elsewhere / "Loose.gguf", name="Loose")
    with pytest.raises(CreateError) as err:
        create("x", spec_from_modelfile(f"FROM {elsewhere / 'Loose.gguf'}\n"), catalog)
    assert str(err.value).startswith(f"FROM {elsewhere / 'Loose.gguf'}: no *.FORK.json in ")
    with pytest.raises(CreateError) as err:
        create("x", spec_from_modelfile(f"FROM {elsewhere}/\n"), catalog)
    # a directory is converted: this one holds no Hugging Face checkout, and nothing is written
    assert str(err.value) == f"FROM {elsewhere}/: refuse: no config.json in the directory"
    assert not list(forks.glob("x-F16*"))
    (forks / "Tiny-F16.gguf").write_bytes((forks / "Tiny-F16.gguf").read_bytes() + b"\0")
    with pytest.raises(CreateError) as err:
        create("x", spec_from_modelfile("FROM tiny-f16\n"), _catalog(forks))
    assert str(err.value).startswith("FROM tiny-f16: refuse: Tiny-F16.gguf sha256 ")
    assert "!= pinned" in str(err.value)
    with pytest.raises(CreateError) as err:
        create("x", spec_from_modelfile("FROM a\n"), Catalog(discover(None), None))
    assert str(err.value) == "creating a model needs a registry directory (bankml serve --registry)"


def test_from_a_derived_model_inherits_its_layer(forks: Path) -> None:
    create("mindx", spec_from_modelfile(MODELFILE), _catalog(forks))
    child = create(
        "mindx-2", spec_from_modelfile("FROM mindx\nPARAMETER top_k 3\n"), _catalog(forks)
    )
    assert child.manifest.layer.system == "You are mindX."
    assert child.manifest.layer.parameters == {"temperature": 0.7, "top_k": 3, "num_ctx": 2048}
    assert child.manifest.base.name == "tiny-f16"


def test_delete(forks: Path) -> None:
    created = create("mindx", spec_from_modelfile(MODELFILE), _catalog(forks))
    with pytest.raises(CreateError) as err:
        delete("tiny-f16", _catalog(forks))
    assert err.value.status == 400 and "bankml does not delete pins over HTTP" in err.value.message
    with pytest.raises(CreateError) as err:
        delete("nope", _catalog(forks))
    assert (err.value.status, err.value.message) == (404, "model 'nope' not found")
    assert delete("MindX:latest", _catalog(forks)) == created.path
    assert not Path(created.path).exists() and "mindx" not in _catalog(forks).derived
    with pytest.raises(CreateError) as err:
        copy("nope", "x", _catalog(forks))
    assert err.value.status == 404


# -- /api/create's body ---------------------------------------------------------------------------


def test_create_request_forms() -> None:
    req = create_request({"model": "m", "modelfile": "FROM a\nSYSTEM s\n", "stream": False})
    assert (req.name, req.spec.base, req.spec.system, req.parsed_modelfile, req.stream) == (
        "m",
        "a",
        "s",
        True,
        False,
    )
    req = create_request(
        {
            "name": "m",
            "from": "a",
            "system": "s",
            "license": "MIT",
            "parameters": {"temperature": 0.5, "top_k": 4.0, "stop": ["x", "y"]},
            "messages": [{"role": "user", "content": "u"}],
        }
    )
    assert req.spec.from_count == 1 and req.spec.parameters == {"temperature": 0.5, "top_k": 4}
    assert req.spec.stop == ["x", "y"] and req.spec.license == ["MIT"] and req.stream


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"from": "a"}, "model is required (the name of the model to create)"),
        (
            {"model": "m", "files": {"a.gguf": "sha256:x"}},
            "files: bankml makes layers over pinned models; it takes no uploaded weights",
        ),
        (
            {"model": "m", "adapters": {"a": "b"}},
            "adapters: LoRA adapters are not merged (bankml plays the pinned weights only)",
        ),
        (
            {"model": "m", "quantize": "q4_K_M"},
            "quantize: bankml does not requantize; pin the quantized file you want",
        ),
        (
            {"model": "m", "from": "a", "parameters": {"temperature": "hot"}},
            "parameters.temperature: must be a number",
        ),
        (
            {"model": "m", "from": "a", "parameters": {"top_k": 1.5}},
            'PARAMETER top_k "1.5": not an integer',
        ),
        ({"model": "m", "modelfile": "FROM a\nADAPTER x\n"}, None),
        ({"model": "m", "stream": "yes"}, "stream: true or false"),
        (
            {"model": "m", "from": "a", "messages": [{"role": "tool", "content": "x"}]},
            'each message needs a role: "system", "user" or "assistant"',
        ),
    ],
)
def test_create_request_refusals(body: dict, message: str | None) -> None:
    try:
        req = create_request(body)
    except CreateError as err:
        assert message is not None and err.message == message
        return
    with pytest.raises(LayerError):  # refused when the layer is built
        req.spec.check()


# -- the command ----------------------------------------------------------------------------------


def _run(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = create_main(argv, environ=env, stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_create_main(forks: Path, tmp_path: Path) -> None:
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM ./forks/Tiny-F16.gguf\nSYSTEM You are mindX.\n", encoding="utf-8")
    env = {"BANKML_FORKS": str(forks), "HOME": str(tmp_path)}
    code, out, err = _run(["mindx", "-f", str(modelfile)], env)  # FROM relative to the Modelfile
    assert code == 0, err
    assert out.splitlines()[0] == "parsing modelfile" and out.splitlines()[-1] == "success"
    digest = read_manifest(str(forks / "mindx.MODEL.json")).digest
    sha = _catalog(forks).registry.pins[0].sha256
    assert (
        err == f"bankml create: mindx (digest sha256:{digest}) over Tiny-F16.gguf (sha256 {sha})\n"
    )
    assert _run(["mindx"], env)[::2] == (1, "bankml create: -f Modelfile is required\n")
    code, _, err = _run(["x", "--file", str(tmp_path / "none")], env)
    assert code == 1 and err.startswith(f"bankml create: cannot read {tmp_path / 'none'}: ")
    bad = tmp_path / "Bad"
    bad.write_text("FROM tiny-f16\nPARAMETER mirostat 2\n", encoding="utf-8")
    code, _, err = _run(["x", "-f", str(bad), "--registry", str(forks)], env)
    assert code == 2 and err.startswith("bankml create: refuse: PARAMETER mirostat: not reproduced")
    (forks / "broken.MODEL.json").write_text("{}", encoding="utf-8")
    code, _, err = _run(["y", "-f", str(modelfile), "--registry", "--models", str(forks)], env)
    assert code == 0 and err.startswith(f"bankml create: skipping {forks / 'broken.MODEL.json'}: ")
    new_dir = tmp_path / "new" / "forks"
    code, _, err = _run(["z", "-f", str(modelfile), "--registry", str(new_dir)], env)
    assert code == 2 and new_dir.is_dir()  # created, and it pins nothing: refused
    assert "no *.FORK.json in" in err


@pytest.mark.parametrize(
    "argv, why",
    [
        ([], "the following arguments are required: NAME"),
        (["x", "y"], "unrecognized arguments: y"),
        (["x", "--bogus"], "unrecognized arguments: --bogus"),
        (["x", "-f"], "argument -f/--file: expected one argument"),
    ],
)
def test_create_usage_errors_exit_1_with_the_usage(
    argv: list[str], why: str, tmp_path, capsys
) -> None:
    code, out, err = _run(argv, {"HOME": str(tmp_path)})
    assert (code, out, err) == (1, "", "")
    printed = capsys.readouterr().err
    assert printed == f"usage: {USAGE.removeprefix('usage: ')}\nbankml create: error: {why}\n"


def test_default_registry_dir() -> None:
    assert default_registry_dir({"BANKML_FORKS": "/f", "HOME": "/h"}) == "/f"
    assert default_registry_dir({"HOME": "/h"}) == "/h/.local/share/bankml/forks"


def test_copy_and_delete_bodies() -> None:
    from bankml.registry.create import copy_request, delete_request

    assert copy_request({"source": "a", "destination": "b"}) == ("a", "b")
    assert delete_request({"name": "x"}) == "x" and delete_request({"model": "y"}) == "y"
    for body, message in (
        ({"destination": "b"}, "source is required (the model to copy)"),
        ({"source": "a", "destination": ""}, "destination is required (the name of the copy)"),
        ([], "the request body must be a JSON object"),
    ):
        with pytest.raises(CreateError) as err:
            copy_request(body)
        assert err.value.message == message
    with pytest.raises(CreateError) as err:
        delete_request({"model": 3})
    assert err.value.message == "model is required (the name of the model to delete)"
