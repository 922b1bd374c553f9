"""Residency: which models are loaded, until when, and the re-verification of every load.

Up to ``max_loaded`` models resident at once (``--max-loaded``), and at most ``budget`` bytes of
them (``--models-memory``: each model's file size plus the KV cache it will need, as ``need``
reckons it). A pure state object; the server drives it on the thread that holds the run lock (every
completion, load and unload), and its reaper calls ``reap`` once a second when that lock is free.
Times are wall-clock seconds given by the caller (``/api/ps`` shows them as ``expires_at``).

``acquire(pin)``:

- the same pin resident with the same file identity: reused, no hash, ``load_ns`` 0, and it
  becomes the most recently used;
- the same pin, another identity: dropped, and 503 ``<file> changed since bankml verified it``;
- a pin whose file is absent: 404; one the forward pass does not play: 400 with the reason;
- a file whose bytes no longer match its pin (changed since it was pinned): 503, not loaded;
- one that alone needs more than the budget: 503, nothing unloaded;
- otherwise, while the models resident are ``max_loaded`` or the budget has no room for it, the
  least recently used model that no request is using (``in_use`` 0) is dropped; when every one
  left is in use: 503 (``busy``: the caller answers with Retry-After), nothing loaded. The file
  is verified in full (the guard, then its sha256 against the fork) before any model is
  dropped for it and before ``open_model`` reads a weight, and its identity must be the same
  after the hash as before it: a file refused leaves every resident model as it was. A load
  that fails leaves nothing of it resident.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bankml.engine_cupy.gguf_file import read_metadata
from bankml.gate import verify
from bankml.gate.fileident import FileIdent
from bankml.registry.keepalive import FOREVER, UNLOAD, KeepAlive
from bankml.registry.pins import Pin

PS_FOREVER_SECONDS = 292 * 365.25 * 24 * 3600  # Ollama shows "kept for good" as now + 292 years


class LoadError(Exception):
    """A model that may not be loaded now: HTTP ``status`` and the message."""

    def __init__(self, status: int, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.busy = busy  # every resident model is answering: try again shortly


@dataclass
class Resident:
    pin: Pin
    verified: verify.Verified
    handle: Any  # what open_model returned (the engine); the caller closes it on unload
    loaded_at: float
    expires_at: float | None = None  # None: kept for good
    shown_as: str = ""  # the model whose request loaded the weights (Ollama names its runner so)
    context_length: int = 0
    in_use: int = 0  # requests running on it now: it is never unloaded under them
    need: int = 0  # the bytes it was reckoned to need (file and KV cache) when it was loaded
    # router mode's stop-timeout: armed (a reactor DelayedCall) when the model is unloaded
    # while it generates; once it fires, ``stopping`` says why its running generations end
    stop_timer: Any = None
    stopping: str | None = None
    # the unloads queued for it and not run yet (a token each -> why): a generation that
    # starts on it before they run gets the stop-timeout too
    awaited: dict[object, str] = field(default_factory=dict)

    @property
    def ident(self) -> FileIdent:
        return self.verified.ident


@dataclass(frozen=True)
class Acquired:
    resident: Resident
    load_ns: int  # 0 when it was already resident


class Residency:
    """Up to ``max_loaded`` models resident (1 by default), least recently used first."""

    def __init__(
        self,
        open_model: Callable[[verify.Verified], Any],
        on_unload: Callable[[Resident, str], None] = lambda resident, why: None,
        log: Callable[[str], None] = lambda line: None,
        verify_model: Callable[[str, str], verify.Verified] | None = None,
        ident_of: Callable[[str], FileIdent] = FileIdent.of,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        max_loaded: int = 1,
        budget: int | None = None,
        need: Callable[[Pin], int] = lambda pin: 0,
    ) -> None:
        self.open_model = open_model
        self.on_unload = on_unload
        self.log = log
        # looked up at call time, so the verify module's function is the one that runs
        self.verify_model = verify_model or (lambda path, fork: verify.verify(path, fork))
        self.ident_of = ident_of
        self.clock_ns = clock_ns
        self.max_loaded = max(1, int(max_loaded))
        self.budget = budget  # bytes; None: no bound but max_loaded
        self.need = need
        # pin name -> Resident, least recently used first
        self.residents: OrderedDict[str, Resident] = OrderedDict()

    @property
    def resident(self) -> Resident | None:
        """The most recently used resident model (None when none is loaded)."""
        return next(reversed(self.residents.values()), None)

    @resident.setter
    def resident(self, value: Resident | None) -> None:
        """Every model dropped from the books (none told), and ``value`` the only one."""
        self.residents = OrderedDict()
        if value is not None:
            self.residents[value.pin.name] = value

    def get(self, name: str) -> Resident | None:
        return self.residents.get(name)

    def unchanged(self, resident: Resident) -> bool:
        """Whether a resident model's file still has the identity it was verified with."""
        return self._current_ident(resident.verified.path) == resident.ident

    def in_use_bytes(self) -> int:
        """The bytes the resident models were reckoned to need."""
        return sum(r.need for r in self.residents.values())

    # -- loading -------------------------------------------------------------------------------

    def drop(self, why: str, name: str | None = None) -> Resident | None:
        """Unload ``name`` (the most recently used model when None), telling ``on_unload`` why."""
        if name is None:
            here = self.resident
            name = here.pin.name if here is not None else None
        gone = self.residents.pop(name, None) if name is not None else None
        if gone is not None:
            self.log(f"{gone.pin.name} unloaded ({why})")
            self.on_unload(gone, why)
        return gone

    def drop_all(self, why: str) -> None:
        for name in list(self.residents):
            self.drop(why, name)

    def _current_ident(self, path: str) -> FileIdent | None:
        try:
            return self.ident_of(path)
        except OSError:
            return None

    def acquire(
        self, pin: Pin, now: float, shown_as: str = "", context_length: int = 0
    ) -> Acquired:
        """The resident model for ``pin``: reused when unchanged, else verified and loaded."""
        here = self.residents.get(pin.name)
        if here is not None:
            if self._current_ident(here.verified.path) == here.ident:
                self.residents.move_to_end(pin.name)
                self._record(here, shown_as, context_length)
                return Acquired(here, 0)
            if here.in_use == 0:
                self.drop("its file changed", pin.name)
            raise LoadError(
                503,
                f"{pin.file} changed since bankml verified it: unloaded, and refused; "
                "the next request verifies it again",
            )
        if pin.path is None:
            raise LoadError(404, f"{pin.file} is pinned but not on this machine")
        if pin.native_reason is not None:
            raise LoadError(
                400,
                f"{pin.name}: bankML's native forward pass does not play it: {pin.native_reason}",
            )
        need = int(self.need(pin))
        drops = self._idle_to_drop(pin, need)  # refused at once when no room can be made
        started = self.clock_ns()
        # verified before anything is unloaded: a file refused leaves the others resident
        verified = self._verify(pin)
        for idle in drops:
            counted = len(self.residents) >= self.max_loaded
            why = "another model was asked for" if counted else "--models-memory needed room"
            self.drop(why, idle.pin.name)
        try:
            handle = self.open_model(verified)
        except OSError as err:
            raise LoadError(500, f"cannot open {pin.file}: {err.strerror or err}") from None
        except Exception as err:  # the loader failed half way: nothing of the model stays
            self.log(f"{pin.name}: load failed: {type(err).__name__}: {err}")
            raise LoadError(500, f"cannot load {pin.file}: {err}") from None
        self.log(
            f"bankml serve --native: {pin.name} verified (sha256 {verified.sha256}); loading it"
        )
        resident = Resident(pin, verified, handle, loaded_at=now, need=need)
        self._record(resident, shown_as, context_length)
        self.residents[pin.name] = resident
        return Acquired(resident, max(self.clock_ns() - started, 1))

    def _idle_to_drop(self, pin: Pin, need: int) -> list[Resident]:
        """The idle models, least recently used first, to unload so that ``pin`` may load:
        fewer than ``max_loaded`` resident and ``need`` within what the budget leaves. When
        unloading every idle one would not be enough, LoadError: the load is refused."""
        budget = self.budget
        if budget is not None and need > budget:
            raise LoadError(
                503,
                f"{pin.name} needs {_mib(need)} (its file and KV cache), more than the "
                f"--models-memory budget of {_mib(budget)}: not loaded",
            )
        drops, full_by_count = self._room(need)
        if drops is None:
            why = (
                f"{self.max_loaded} models are resident (--max-loaded)"
                if full_by_count
                else f"the --models-memory budget of {_mib(budget or 0)} is in use"
            )
            raise LoadError(
                503,
                f"{pin.name} cannot be loaded now: {why} and each is answering a request; "
                "try again when one is done",
                busy=True,
            )
        return drops

    def _room(self, need: int) -> tuple[list[Resident] | None, bool]:
        """(the idle models, least recently used first, to unload so that a model needing
        ``need`` bytes may load, or None when unloading every idle one is not enough; whether
        the count (``max_loaded``) rather than the budget is what stays full then)."""
        budget = self.budget
        count, used = len(self.residents), self.in_use_bytes()
        idle = [r for r in self.residents.values() if r.in_use == 0]
        drops: list[Resident] = []
        while count >= self.max_loaded or (budget is not None and used + need > budget):
            if not idle:
                return None, count >= self.max_loaded
            gone = idle.pop(0)
            drops.append(gone)
            count, used = count - 1, used - gone.need
        return drops, False

    def room_now(self, pin: Pin, need: int) -> bool:
        """Whether ``acquire(pin)`` (``need`` bytes) can go on now without waiting for a
        request to end: ``pin`` resident, or its room made by unloading idle models only. A
        load that can never fit says True: it is refused at once."""
        if pin.name in self.residents or (self.budget is not None and need > self.budget):
            return True
        return self._room(need)[0] is not None

    def verify_pin(self, pin: Pin) -> verify.Verified:
        """``pin``'s file verified in full as a load verifies it (LoadError when refused),
        changing nothing here: a caller may run it on another thread before ``acquire``."""
        return self._verify(pin)

    def _verify(self, pin: Pin) -> verify.Verified:
        assert pin.path is not None
        before = self._current_ident(os.path.realpath(pin.path))
        try:
            verified = self.verify_model(pin.path, pin.fork_path)
        except verify.Refused as err:
            if err.reason.endswith("changed while it was being hashed: refused"):
                raise LoadError(503, err.reason) from None
            if f" != pinned {pin.sha256}: " in err.reason:
                # the file changed since it was pinned: the server's state, not the request's
                raise LoadError(503, f"refuse: {err.reason}") from None
            raise LoadError(400, f"refuse: {err.reason}") from None
        if before is not None and verified.ident != before:
            raise LoadError(503, f"{pin.file} changed while it was being hashed: refused")
        return verified

    @staticmethod
    def _record(resident: Resident, shown_as: str, context_length: int) -> None:
        """``/api/ps``'s naming: replaced on a (re)load, when empty, or when num_ctx differs."""
        if shown_as and (not resident.shown_as or context_length != resident.context_length):
            resident.shown_as = shown_as
            resident.context_length = context_length
        elif not resident.shown_as:
            resident.shown_as = resident.pin.name
            resident.context_length = context_length

    # -- after a request, and the reaper --------------------------------------------------------

    def touch(self, name: str, keep_alive: KeepAlive, now: float) -> None:
        """Apply a request's keep-alive to the pin ``name`` when it is resident (keep_alive 0
        unloads it once no other request uses it)."""
        here = self.residents.get(name)
        if here is None:
            return
        if keep_alive.kind == UNLOAD:
            if here.in_use == 0:
                self.drop("keep_alive 0", name)
            else:
                here.expires_at = now  # the reaper unloads it once its requests are done
        elif keep_alive.kind == FOREVER:
            here.expires_at = None
        else:
            here.expires_at = keep_alive.expires_at(now)

    def unload(self, name: str) -> bool:
        """Drop ``name`` now (an empty request with keep_alive 0); False when it was not
        resident. One that a request is using is unloaded when that request is done."""
        here = self.residents.get(name)
        if here is None:
            return False
        if here.in_use:
            here.expires_at = 0.0
            return True
        self.drop("keep_alive 0", name)
        return True

    def _expired(self, now: float) -> list[Resident]:
        return [
            r
            for r in self.residents.values()
            if r.expires_at is not None and r.expires_at <= now and r.in_use == 0
        ]

    def expired(self, now: float) -> bool:
        return bool(self._expired(now))

    def reap(self, now: float) -> Resident | None:
        """Drop every idle model whose keep-alive has run out (the reaper's one step); the
        last one dropped, None when none was."""
        gone = None
        for here in self._expired(now):
            gone = self.drop("keep_alive expired", here.pin.name)
        return gone

    def ps_expires_at(self, now: float, resident: Resident | None = None) -> float | None:
        """``expires_at`` for /api/ps (kept for good: now + 292 years) of ``resident`` (the
        most recently used one when None); None when none is loaded."""
        here = resident if resident is not None else self.resident
        if here is None:
            return None
        return now + PS_FOREVER_SECONDS if here.expires_at is None else here.expires_at


def models_memory(given: int | None) -> int | None:
    """The budget ``--models-memory`` sets: the bytes given, else half of the machine's RAM
    (None, no budget, where the RAM cannot be read). Native and P0 alike."""
    if given is not None:
        return int(given)
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 2
    except (ValueError, OSError, AttributeError):
        return None


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


# -- what a model needs resident: its KV cache, reckoned from its GGUF header -----------------

# bytes per value of llama-server's KV cache types (-ctk, -ctv): ggml's block sizes
LLAMA_CACHE_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q4_0": 18 / 32,
    "q4_1": 20 / 32,
    "iq4_nl": 18 / 32,
    "q5_0": 22 / 32,
    "q5_1": 24 / 32,
}
LLAMA_CTX_PAD = 256  # llama.cpp rounds a context up to a multiple of 256 cells


def kv_shape(path: str) -> tuple[int, int, int, int] | None:
    """(layers, KV heads, key length, value length) of a model's attention, from its GGUF
    header (a per-layer count: the largest); None where the header does not say."""
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    if not isinstance(arch, str):
        return None
    keys = [
        f"{arch}.block_count",
        f"{arch}.attention.head_count_kv",
        f"{arch}.attention.head_count",
        f"{arch}.embedding_length",
        f"{arch}.attention.key_length",
        f"{arch}.attention.value_length",
    ]
    meta = read_metadata(path, keys)

    def count(key: str, default: int = 0) -> int:
        value = meta.get(key, default)
        if isinstance(value, list):  # per-layer counts: the largest
            value = max((v for v in value if isinstance(v, int)), default=default)
        return value if isinstance(value, int) and value > 0 else 0

    n_layer, n_head, n_embd = count(keys[0]), count(keys[2]), count(keys[3])
    n_head_kv = count(keys[1], n_head)
    if not (n_layer and n_head and n_embd and n_head_kv):
        return None
    k_len = count(keys[4]) or n_embd // n_head
    return n_layer, n_head_kv, k_len, count(keys[5]) or k_len


def training_context_of(path: str) -> int:
    """``<arch>.context_length`` of a GGUF (0 where it does not say): llama-server's ``-c 0``."""
    arch = read_metadata(path, ["general.architecture"]).get("general.architecture")
    key = f"{arch}.context_length"
    value = read_metadata(path, [key]).get(key) if isinstance(arch, str) else None
    return value if isinstance(value, int) and value > 0 else 0


def llama_server_kv_bytes(
    path: str, n_ctx: int, type_k: str | None = None, type_v: str | None = None
) -> int:
    """The KV cache llama-server allocates for a model with ``-c n_ctx`` (0: the model's
    training context), ``-ctk``, ``-ctv`` (f16 by default): ``n_ctx`` rounded up to 256 cells,
    times the layers, the KV heads and each head's key and value length, times the bytes per
    value of each type. 0 where the header does not say."""
    shape = kv_shape(path)
    cells = n_ctx or training_context_of(path)
    if shape is None or cells <= 0:
        return 0
    cells = -(-cells // LLAMA_CTX_PAD) * LLAMA_CTX_PAD
    n_layer, n_head_kv, k_len, v_len = shape
    per_k = LLAMA_CACHE_BYTES.get(type_k or "f16", 2.0)
    per_v = LLAMA_CACHE_BYTES.get(type_v or "f16", 2.0)
    return int(cells * n_layer * n_head_kv * (k_len * per_k + v_len * per_v))
