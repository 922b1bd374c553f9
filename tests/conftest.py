from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests import compact_diff, support

# The shared helpers' assertions are rewritten as the tests' own are, so that a failing one shows
# its values. This must run before anything imports them: this file imports none of them at the top.
pytest.register_assert_rewrite(
    "tests.bankml_process", "tests.engine_checks", "tests.native_support", "tests.receipt_answers"
)

# The suite's tiny models come in every weight type: their kernels are compiled once for all types
# (jit.every_type_compiled) rather than once per type set, here and in every process the suite
# starts. tests/test_decode_families.py checks a start's own type set in a fresh process.
os.environ.setdefault("BANKML_KERNEL_TYPES", "all")

# The suite starts hundreds of Python processes (servers, the command line): each would compile
# every bankml module it imports to bytecode again (about a second) where the environment says
# not to write bytecode caches; they write them in the checkout's __pycache__ folders instead,
# beside Numba's.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

if TYPE_CHECKING:
    from bankml.engine_cupy.engine import Engine
    from bankml.engine_cupy.model import Model
    from tests.native_support import Served


def pytest_assertrepr_compare(op: str, left: object, right: object) -> list[str] | None:
    """Large values compared and found different: tests/compact_diff.py's short explanation,
    never a full diff of their reprs (which can run for hours)."""
    return compact_diff.explain(op, left, right)


@pytest.fixture(scope="session", autouse=True)
def receipt_key_outside_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every bankml serve of the run (in process or not) signs with a key in a temporary
    directory, never one under the real HOME."""
    path = tmp_path_factory.mktemp("receipt-key") / "receipt-key.pem"
    os.environ["BANKML_RECEIPT_KEY"] = str(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def kernels_compiled_ahead(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """When the run includes tests on tiny models: tests/precompile.py in the background at
    nice 10, filling Numba's cache with their kernels ahead of them; ended with the run."""
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or not any(
        "tiny_dir" in getattr(item, "fixturenames", ()) for item in request.session.items
    ):  # one precompiler for the run, beside its first worker
        yield
        return
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.precompile",
            str(tmp_path_factory.mktemp("precompile")),
            str(support.default_model()),
        ],
        cwd=support.ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(10),
    )
    yield
    process.kill()
    process.wait()


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    return support.llama_server_binary()


@pytest.fixture(scope="session")
def template(llama_server_bin: Path) -> Path:
    """Qwen3's chat template from llama.cpp's models/templates (tests/tool_chats.py)."""
    from tests.tool_chats import TEMPLATE

    path = support.llama_templates_dir(llama_server_bin) / TEMPLATE
    if not path.exists():
        pytest.skip(f"{path} is not in the llama.cpp source tree")
    return path


@pytest.fixture(scope="session")
def default_model() -> Path:
    return support.default_model()


@pytest.fixture(scope="session")
def default_fork(default_model: Path) -> Path:
    return support.DEFAULT_FORK


@pytest.fixture(scope="session")
def default_model_q4_k_m(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model requantized by llama.cpp's own llama-quantize to Q4_K_M, the type most
    downloads have: Q4_K (repacked) and Q6_K ffn_down, Q5_0/Q8_0 elsewhere (576-wide rows cannot
    be K-quants)."""
    from tests import ggml_oracle

    out = tmp_path_factory.mktemp("q4_k_m") / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    subprocess.run(
        [
            str(ggml_oracle.reference_tool("llama-quantize")),
            "--allow-requantize",
            str(default_model),
            str(out),
            "Q4_K_M",
        ],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def reference_server(default_model: Path, llama_server_bin: Path):
    """One real llama-server with the default model, shared by the tests that only read from it."""
    with support.LlamaServer(default_model, binary=llama_server_bin) as server:
        yield server


@pytest.fixture(scope="session")
def signing_key(tmp_path_factory: pytest.TempPathFactory):
    """One receipt signing key for the servers the tests start and the receipts they check."""
    from bankml.receipts.keys import keygen

    return keygen(tmp_path_factory.mktemp("signing-key") / "receipt-key.pem")


@pytest.fixture(scope="module")
def template_pair(
    template: Path,
    signing_key,
    default_model: Path,
    default_fork: Path,
    llama_server_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
):
    """(``bankml serve --native`` signing with ``signing_key``, llama-server), both given Qwen3's
    chat template (``--chat-template-file``): the side-by-side pair of the tool-call, Messages and
    Responses tests, one pair for each test module, so that both servers of a pair get the same
    requests in the same order and their prompt caches hold the same prefixes."""
    from tests.native_server import native_process

    native = native_process(default_model, default_fork, tmp_path_factory.mktemp("template-pair"))
    native.engine_args += [
        "--chat-template-file",
        str(template),
        "--receipt-key",
        str(signing_key.path),
    ]
    reference = support.LlamaServer(
        default_model, args=["--chat-template-file", str(template)], binary=llama_server_bin
    )
    with native, reference:
        yield native, reference


# The fixtures below import what they use when they run: a test run that needs none of them
# loads nothing more for them.


@pytest.fixture(scope="module")
def default_engine(default_model: Path) -> Model:
    """The default model loaded on the CPU, once per test module."""
    from bankml.engine_cupy.model import Model

    return Model.load(default_model, device="cpu", progress=False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory for a test module's tiny models (tests/tiny_models.py)."""
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture
def served(default_model: Path, default_fork: Path) -> Served:
    """bankml --native on the default model in this process, one slot (one for the whole run)."""
    from tests.native_support import shared_served

    return shared_served(default_model, default_fork)


@pytest.fixture
def alone_server(default_model: Path, default_fork: Path) -> Served:
    """The one-slot server (``served``), where a test compares several slots with one."""
    from tests.native_support import shared_served

    return shared_served(default_model, default_fork)


@pytest.fixture(scope="module")
def parallel(
    default_model: Path, default_fork: Path, tmp_path_factory: pytest.TempPathFactory
) -> Served:
    """The ``--parallel 4 -kvu`` server in this process (one for the whole run)."""
    from tests.native_support import parallel_served

    return parallel_served(default_model, default_fork, tmp_path_factory)


@pytest.fixture(scope="module")
def engines(default_model: Path) -> tuple[Engine, Engine]:
    """(one slot, four slots) over one loaded default model, once per test module."""
    from tests.native_support import one_and_four_slots

    return one_and_four_slots(default_model)
