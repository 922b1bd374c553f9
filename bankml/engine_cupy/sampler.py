"""llama-server's sampler: request parameters, the default chain, mirostat, seeded RNG, logprobs.

What llama.cpp does (src/llama-sampler.cpp, common/sampling.cpp, tools/server/server-schema.cpp)
is followed step by step, including its float32 arithmetic where it decides which token is drawn:
softmax sums in float, the draw's cumulative sum in double, ``std::mt19937`` seeded with the
request's seed and ``std::uniform_real_distribution<double>`` built from two 32-bit draws as
libstdc++ does. NumPy's ``RandomState(seed)`` is the same Mersenne Twister with the same
``init_genrand`` seeding, so its raw 32-bit stream is used (tests check it against std::mt19937).

Candidates are kept as parallel NumPy arrays (ids, logits) with llama.cpp's ``sorted`` flag.
Sorting is stable (ties keep vocabulary order) where libstdc++'s ``partial_sort`` and
``std::sort`` leave ties in an order this module does not reproduce.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from bankml.engine_cupy.reasoning_budget import DONE, IDLE, ReasoningBudget

if TYPE_CHECKING:
    from bankml.engine_cupy.grammar import Constraint

F32 = np.float32
INT32_MAX = 2_147_483_647
DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed
DEFAULT_ORDER = (
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typ_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
)
DRY_MAX_BREAKER_BYTES = 40
DRY_MAX_TAIL_TOKENS = 20


class SamplerError(ValueError):
    """A request's sampling parameters are invalid; the message is llama-server's (HTTP 400)."""


# --- request parameters ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplerParams:
    """common_params_sampling as llama-server fills it from a request."""

    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    top_n_sigma: float = -1.0
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    seed: int = DEFAULT_SEED
    n_probs: int = 0
    min_keep: int = 0
    samplers: tuple[str, ...] = DEFAULT_ORDER
    adaptive_target: float = -1.0  # only read by the adaptive-p sampler, which bankml refuses
    adaptive_decay: float = 0.9
    ignore_eos: bool = False
    logit_bias: tuple[LogitBias, ...] = ()  # in the order llama-server applies them (EOG last)

    @classmethod
    def from_request(
        cls, body: Mapping[str, Any], defaults: SamplerParams | None = None
    ) -> SamplerParams:
        """Read the sampling fields of a /completion-style body (after the OpenAI fields are mapped).

        Raises SamplerError with llama-server's message for the values it refuses.
        """
        base = defaults or cls()
        values: dict[str, Any] = {}
        for spec in _FIELDS:
            spec.read(body, values, base)
        params = replace(base, **values)
        params.check()
        return params

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> SamplerParams:
        """The GGUF's ``general.sampling.*`` keys over llama.cpp's defaults (common_init_from_params)."""
        values: dict[str, Any] = {}
        for key, name, kind in _GGUF_KEYS:
            value = metadata.get("general.sampling." + key)
            if value is None:
                continue
            try:
                values[name] = kind(value)
            except (TypeError, ValueError):
                continue
        return replace(cls(), **values)

    def check(self) -> None:
        """common_sampler_init's checks, reported as 'Failed to initialize samplers: ...'."""
        rp = self.repeat_penalty
        if not math.isfinite(rp) or rp <= 0.0 or not math.isfinite(float(F32(1.0) / F32(rp))):
            raise SamplerError(
                "Failed to initialize samplers: penalty_repeat must be finite and greater than 0"
            )
        if not math.isfinite(self.frequency_penalty):
            raise SamplerError("Failed to initialize samplers: penalty_freq must be finite")
        if not math.isfinite(self.presence_penalty):
            raise SamplerError("Failed to initialize samplers: penalty_present must be finite")

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["dry_sequence_breakers"] = list(self.dry_sequence_breakers)
        out["samplers"] = list(self.samplers)
        return out


def _json_type(value: Any) -> str:
    """nlohmann::json's type_name()."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _get_number(name: str, value: Any) -> float | int:
    """get<float>() / get<int>(): numbers, and booleans as 0/1 (nlohmann converts them)."""
    if isinstance(value, bool):
        return int(value)
    if not isinstance(value, (int, float)):
        raise SamplerError(
            f"Field '{name}': [json.exception.type_error.302] type must be number, "
            f"but is {_json_type(value)}"
        )
    return value


def _as_float32(value: float | int) -> float:
    """A JSON number read as a C float (get<float>())."""
    with np.errstate(over="ignore"):
        return float(F32(value))


def _as_int32(value: float | int) -> int:
    """A JSON number read as int32_t (get<int32_t>(): a float is truncated)."""
    v = int(value) if not isinstance(value, float) or math.isfinite(value) else 0
    return ((v + 2**31) % 2**32) - 2**31


@dataclass(frozen=True)
class _Field:
    """One field_num of server-schema.cpp: names, C type, clamping or hard limits."""

    attr: str
    names: tuple[str, ...]
    kind: str  # "f32" | "i32" | "u32"
    lo: float | None = None
    hi: float | None = None
    hard: bool = False
    handler: Callable[[Any, SamplerParams], Any] | None = None

    def read(self, body: Mapping[str, Any], out: dict[str, Any], base: SamplerParams) -> None:
        for name in self.names:
            if name in body and body[name] is not None:
                out[self.attr] = self.convert(name, body[name], base)
                return

    def convert(self, name: str, raw: Any, base: SamplerParams) -> Any:
        if self.handler is not None:
            return self.handler(raw, base)
        number = _get_number(name, raw)
        if self.kind == "f32":
            value: float | int = _as_float32(number)
        elif self.kind == "u32":
            value = (
                int(number) % 2**32 if not isinstance(number, float) or math.isfinite(number) else 0
            )
        else:
            value = _as_int32(number)
        if self.hard:
            if value < self.lo or value > self.hi:  # type: ignore[operator]
                lo, hi, got = (_to_string(v, self.kind) for v in (self.lo, self.hi, value))
                raise SamplerError(
                    f"Field '{name}': Value must be between {lo} <= value <= {hi}, but got {got}"
                )
            return value
        if self.lo is not None:
            value = max(self.lo, value)
        if self.hi is not None:
            value = min(self.hi, value)
        return value


def _to_string(value: Any, kind: str) -> str:
    """std::to_string: "%f" for a float field, the integer for the others."""
    return f"{float(value):f}" if kind == "f32" else str(int(value))


def _dry_base(raw: Any, base: SamplerParams) -> float:
    value = _as_float32(_get_number("dry_base", raw))
    return base.dry_base if value < 1.0 else value


def _breakers(raw: Any, base: SamplerParams) -> tuple[str, ...]:
    # json_value(..., vector<string>()) yields an empty vector for anything but an array of strings
    ok = isinstance(raw, list) and all(isinstance(b, str) for b in raw)
    if not ok or not raw:
        raise SamplerError(
            "Field 'dry_sequence_breakers': Error: dry_sequence_breakers must be a non-empty "
            "array of strings"
        )
    return tuple(raw)


_NAME_ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}
_CANONICAL = {
    "dry",
    "top_k",
    "top_p",
    "top_n_sigma",
    "typ_p",
    "min_p",
    "temperature",
    "xtc",
    "infill",
    "penalties",
    "adaptive_p",
}
for _c in list(_CANONICAL):
    if "_" in _c:
        _NAME_ALIASES[_c.replace("_", "-")] = _c
        _NAME_ALIASES[_c.replace("_", "")] = _c
_CHARS = {
    "d": "dry",
    "k": "top_k",
    "y": "typ_p",
    "p": "top_p",
    "s": "top_n_sigma",
    "m": "min_p",
    "t": "temperature",
    "x": "xtc",
    "i": "infill",
    "e": "penalties",
    "a": "adaptive_p",
}


def _samplers(raw: Any, base: SamplerParams) -> tuple[str, ...]:
    """common_sampler_types_from_names / _from_chars: unknown names are skipped, as llama.cpp does."""
    if isinstance(raw, str):
        names = [_CHARS[c] for c in raw if c in _CHARS]
    elif isinstance(raw, list):
        if not all(isinstance(n, str) for n in raw):
            bad = next(n for n in raw if not isinstance(n, str))
            raise SamplerError(
                f"Field 'samplers': [json.exception.type_error.302] type must be string, "
                f"but is {_json_type(bad)}"
            )
        names = []
        for n in raw:
            low = n.lower()
            name = low if low in _CANONICAL else _NAME_ALIASES.get(low)
            if name is not None:
                names.append(name)
    else:
        return base.samplers
    unsupported = sorted({n for n in names if n in ("infill", "adaptive_p")})
    if unsupported:
        raise SamplerError(
            f"samplers: {', '.join(unsupported)} is not implemented by bankml's sampler"
        )
    return tuple(names)


_FIELDS: tuple[_Field, ...] = (
    _Field("top_k", ("top_k",), "i32", 0, INT32_MAX),
    _Field("top_p", ("top_p",), "f32", 0.0, 1.0),
    _Field("min_p", ("min_p",), "f32", 0.0, 1.0),
    _Field("top_n_sigma", ("top_n_sigma",), "f32"),
    _Field("xtc_probability", ("xtc_probability",), "f32", 0.0, 1.0),
    _Field("xtc_threshold", ("xtc_threshold",), "f32", 0.0, 1.0),
    _Field("typical_p", ("typical_p",), "f32"),
    _Field("temperature", ("temperature",), "f32", 0.0, math.inf),
    _Field("dynatemp_range", ("dynatemp_range",), "f32"),
    _Field("dynatemp_exponent", ("dynatemp_exponent",), "f32"),
    _Field("repeat_last_n", ("repeat_last_n",), "i32", 0, INT32_MAX, hard=True),
    _Field("repeat_penalty", ("repeat_penalty",), "f32"),
    _Field("frequency_penalty", ("frequency_penalty",), "f32"),
    _Field("presence_penalty", ("presence_penalty",), "f32"),
    _Field("dry_multiplier", ("dry_multiplier",), "f32"),
    _Field("dry_base", ("dry_base",), "f32", handler=_dry_base),
    _Field("dry_allowed_length", ("dry_allowed_length",), "i32", 0, INT32_MAX, hard=True),
    _Field("dry_penalty_last_n", ("dry_penalty_last_n",), "i32", 0, INT32_MAX, hard=True),
    _Field("mirostat", ("mirostat",), "i32", 0, 2),
    _Field("mirostat_tau", ("mirostat_tau",), "f32"),
    _Field("mirostat_eta", ("mirostat_eta",), "f32"),
    _Field("seed", ("seed",), "u32"),
    _Field("n_probs", ("n_probs", "logprobs"), "i32"),
    _Field("min_keep", ("min_keep",), "i32", 0, INT32_MAX, hard=True),
    _Field("adaptive_target", ("adaptive_target",), "f32", -float(np.finfo(F32).max), 1.0),
    _Field("adaptive_decay", ("adaptive_decay",), "f32", 0.0, float(F32(0.99)), hard=True),
    _Field("dry_sequence_breakers", ("dry_sequence_breakers",), "json", handler=_breakers),
    _Field("samplers", ("samplers",), "json", handler=_samplers),
)

_GGUF_KEYS = (
    ("top_k", "top_k", int),
    ("top_p", "top_p", float),
    ("min_p", "min_p", float),
    ("xtc_probability", "xtc_probability", float),
    ("xtc_threshold", "xtc_threshold", float),
    ("temp", "temperature", float),
    ("penalty_last_n", "repeat_last_n", int),
    ("penalty_repeat", "repeat_penalty", float),
    ("mirostat", "mirostat", int),
    ("mirostat_tau", "mirostat_tau", float),
    ("mirostat_eta", "mirostat_eta", float),
)


# --- logit bias -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogitBias:
    """llama_logit_bias: added to one token's logit before any other stage (-inf bans it)."""

    bias: float
    token: int


_C_SPACE = " \t\n\v\f\r"


def _strtol_whole(key: str) -> int | None:
    """``strtol(key, &end, 10)`` cast to llama_token, or None unless ``*end == 0``.

    No digits leaves ``end`` at the start, so "" reads as 0; an overflow saturates at LONG_MIN/MAX
    before the int32 cast, as in C."""
    text = key.lstrip(_C_SPACE)
    sign = -1 if text[:1] == "-" else 1
    body = text[1:] if text[:1] in "+-" else text
    digits = len(body) - len(body.lstrip("0123456789"))
    if digits == 0:
        return 0 if key == "" else None
    if body[digits:]:
        return None
    value = max(-(2**63), min(2**63 - 1, sign * int(body[:digits])))
    return ((value + 2**31) % 2**32) - 2**31


def _bias_value(raw: Any) -> float | None:
    """parse_bias: a number as a float, ``false`` as -inf; anything else skips the entry."""
    if raw is False:
        return -math.inf
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None
    return _as_float32(raw)


def parse_logit_bias(
    raw: Any, n_vocab: int, tokenize: Callable[[str], list[int]]
) -> tuple[LogitBias, ...]:
    """llama-server's ``logit_bias`` handler: ``[[id|text, bias], ...]`` or ``{"id"|"text": bias}``.

    It never refuses: malformed entries, ids outside the vocabulary and other JSON types are
    skipped silently, as llama-server skips them. Text is tokenized without special tokens and
    every one of its tokens gets the bias."""
    out: list[LogitBias] = []

    def add(key: Any, value: Any, key_is_text: bool) -> None:
        bias = _bias_value(value)
        if bias is None:
            return
        if key_is_text:
            out.extend(LogitBias(bias, t) for t in tokenize(key))
        elif 0 <= key < n_vocab:
            out.append(LogitBias(bias, key))

    if isinstance(raw, list):
        for el in raw:
            if not isinstance(el, list) or len(el) != 2:
                continue
            key = el[0]
            if isinstance(key, int) and not isinstance(key, bool):
                add(_as_int32(key), el[1], False)
            elif isinstance(key, str):
                add(key, el[1], True)
    elif isinstance(raw, dict):
        for key, value in raw.items():
            token = _strtol_whole(key)
            add(key if token is None else token, value, token is None)
    return tuple(out)


def apply_logit_bias(c: Candidates, biases: Sequence[LogitBias]) -> None:
    """llama_sampler_logit_bias on the full, unshuffled vocabulary (index == id): each entry
    added in turn in float32, so a token listed twice gets both."""
    if not biases:
        return
    logits = c.logits.copy()
    with np.errstate(invalid="ignore"):
        np.add.at(
            logits,
            np.array([b.token for b in biases], dtype=np.int64),
            np.array([b.bias for b in biases], dtype=F32),
        )
    c.logits = logits


# --- random numbers ---------------------------------------------------------------------------------


def resolve_seed(seed: int) -> int:
    """get_rng_seed: LLAMA_DEFAULT_SEED means a fresh seed from the system."""
    if seed == DEFAULT_SEED:
        return int.from_bytes(os.urandom(4), "little") ^ (time.time_ns() & 0xFFFFFFFF)
    return seed & 0xFFFFFFFF


class MT19937:
    """std::mt19937 (seeded as its constructor does) and the libstdc++ distributions llama.cpp uses."""

    def __init__(self, seed: int):
        self._state = np.random.RandomState(
            seed & 0xFFFFFFFF
        )  # init_genrand(seed): same as std::mt19937

    def next_u32(self) -> int:
        return int(self._state.randint(0, 2**32, dtype=np.uint64))

    def raw(self, n: int) -> list[int]:
        return [int(v) for v in self._state.randint(0, 2**32, size=n, dtype=np.uint64)]

    def uniform_double(self) -> float:
        """uniform_real_distribution<double>(0, 1): generate_canonical<double, 53> from two draws."""
        a = float(self.next_u32())
        b = float(self.next_u32())
        r = (a + b * 4294967296.0) / 18446744073709551616.0
        return r if r < 1.0 else math.nextafter(1.0, 0.0)

    def uniform_float(self) -> float:
        """uniform_real_distribution<float>(0, 1): one draw, rounded to float first."""
        r = F32(F32(self.next_u32()) / F32(4294967296.0))
        return float(r) if r < 1.0 else float(np.nextafter(F32(1.0), F32(0.0)))


# --- candidates and the chain's stages --------------------------------------------------------------


def _expf(x: np.ndarray) -> np.ndarray:
    """glibc's expf of each element (kernels.exact_ops.expf), as llama.cpp's samplers call it."""
    from bankml.engine_cupy.kernels.exact_ops import expf

    return expf(x)


def _logf(x: np.ndarray | float) -> Any:
    """glibc's logf (kernels.exact_ops.logf): an array for an array, a float32 for a number."""
    from bankml.engine_cupy.kernels.exact_ops import logf

    out = logf(x)
    return out if np.ndim(x) else F32(out.reshape(-1)[0])


def top_k_order(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits, descending, ties in index order (a stable partial sort).

    Up to ``sampler_kernels.MAX_K`` in one compiled pass over the logits; with a NaN among them,
    or a larger k, by NumPy's partition and stable sort (the same order where both apply)."""
    if 0 < k <= _kernels().MAX_K:
        order, ok = _kernels().top_k_stable(np.ascontiguousarray(logits, dtype=F32), k)
        if ok:
            return order
    return _top_k_order_numpy(logits, k)


def _top_k_order_numpy(logits: np.ndarray, k: int) -> np.ndarray:
    n = len(logits)
    if k >= n or n <= 256:
        return np.argsort(-logits, kind="stable")[:k]
    kth = np.partition(logits, n - k)[n - k]
    above = np.flatnonzero(logits > kth)
    ties = np.flatnonzero(logits == kth)[: k - len(above)]
    chosen = np.concatenate([above, ties])
    chosen.sort()
    return chosen[np.argsort(-logits[chosen], kind="stable")]


_sampler_kernels: Any = None


def _kernels() -> Any:
    """sampler_kernels, imported on the first draw (it loads Numba; parsing a request must not)."""
    global _sampler_kernels
    if _sampler_kernels is None:
        from bankml.engine_cupy import sampler_kernels

        _sampler_kernels = sampler_kernels
    return _sampler_kernels


def warm_up() -> None:
    """Compile (or load from Numba's cache) the sampler's kernels for the logits they are given,
    writable and read-only, so that the first draw does not (a few seconds on a fresh machine)."""
    plan = fast_chain(SamplerParams())
    assert plan is not None
    ids, _ = _vocabulary_arrays(8)
    logits = np.zeros(8, dtype=F32)
    for writeable in (True, False):
        logits.flags.writeable = writeable
        order, _ = _kernels().top_k_stable(logits, 2)
        for row in (ids, ids.copy()):
            _kernels().chain_tail(
                logits, row, order, plan.codes, plan.ints, plan.floats, plan.min_keep, 0.5
            )


@functools.cache
def _vocabulary_arrays(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids 0..n-1 and n zero probabilities every draw starts from, made once per size and
    read-only (the stages replace a candidate array, never write into one)."""
    ids = np.arange(n, dtype=np.int32)
    p = np.zeros(n, dtype=F32)
    ids.flags.writeable = False
    p.flags.writeable = False
    return ids, p


def _fsum(x: np.ndarray) -> F32:
    """A float accumulator added to in order (``float s = 0; for ... s += x``)."""
    return np.cumsum(x, dtype=F32)[-1] if len(x) else F32(0)


@dataclass
class Candidates:
    """llama_token_data_array: ids, logits, probabilities, the sorted flag and the selection."""

    ids: np.ndarray
    logits: np.ndarray
    p: np.ndarray
    sorted: bool = False
    selected: int = -1

    @classmethod
    def from_logits(cls, logits: np.ndarray, copy: bool = True) -> Candidates:
        """The whole vocabulary; ``copy=False`` borrows float32 contiguous logits (the stages
        never write into them, and the fast chain gives the draw arrays of its own)."""
        ids, p = _vocabulary_arrays(len(logits))
        if copy:
            return cls(ids, np.array(logits, dtype=F32), p)
        return cls(ids, np.ascontiguousarray(logits, dtype=F32), p)

    @property
    def size(self) -> int:
        return len(self.ids)

    def take(self, index: np.ndarray | slice) -> None:
        self.ids, self.logits, self.p = self.ids[index], self.logits[index], self.p[index]

    def sort_desc(self) -> None:
        """partial_sort of the whole set by logit, descending (ties keep their current order)."""
        if not self.sorted:
            self.take(np.argsort(-self.logits, kind="stable"))
            self.sorted = True

    def softmax(self, do_sort: bool) -> None:
        """llama_sampler_softmax_impl: float expf and a float running sum."""
        if do_sort:
            self.sort_desc()
        max_l = self.logits[0] if self.sorted else self.logits.max()
        with np.errstate(invalid="ignore"):  # an infinite bias gives NaN, as in C
            p = _expf(self.logits - max_l)
            self.p = (p / _fsum(p)).astype(F32)


def apply_temperature(c: Candidates, temp: float) -> None:
    """llama_sampler_temp_impl: divide, or at temp <= 0 keep only the first maximum."""
    if c.size == 0:
        return
    if temp <= 0.0:
        first_max = int(np.argmax(c.logits))
        keep = c.logits[first_max]
        c.logits = np.full(c.size, -np.inf, dtype=F32)
        c.logits[first_max] = keep
        return
    c.logits = (c.logits / F32(temp)).astype(F32)


def apply_top_k(c: Candidates, k: int) -> None:
    if k <= 0:
        return
    k = min(k, c.size)
    if not c.sorted:
        c.take(top_k_order(c.logits, k))
        c.sorted = True
    else:
        c.take(slice(0, k))


def apply_top_p(c: Candidates, p: float, min_keep: int) -> None:
    if p >= 1.0:
        return
    c.softmax(False)
    c.sort_desc()
    cum = np.cumsum(c.p, dtype=F32)
    ok = (cum >= F32(p)) & (np.arange(1, c.size + 1) >= min_keep)
    hits = np.flatnonzero(ok)
    last = int(hits[0]) + 1 if len(hits) else c.size
    c.take(slice(0, last))


def apply_min_p(c: Candidates, p: float, min_keep: int) -> None:
    if p <= 0.0 or c.size == 0:
        return
    log_p = _logf(F32(p))
    if not c.sorted:
        min_logit = F32(c.logits.max() + log_p)
        keep = c.logits >= min_logit
        n_keep = int(keep.sum())
        if n_keep > 0 and n_keep >= min_keep:
            c.take(np.flatnonzero(keep))
            return
    c.sort_desc()
    min_logit = F32(c.logits[0] + log_p)
    below = np.flatnonzero((c.logits[1:] < min_logit) & (np.arange(1, c.size) >= min_keep))
    i = int(below[0]) + 1 if len(below) else c.size
    c.take(slice(0, i))


def apply_typical(c: Candidates, p: float, min_keep: int) -> None:
    if p >= 1.0:
        return
    c.softmax(True)
    log_p = _logf(c.p)
    entropy = _fsum((-c.p * log_p).astype(F32))
    shifted = np.abs(-log_p - entropy).astype(F32)
    order = np.argsort(shifted, kind="stable")
    cum = np.cumsum(c.p[order], dtype=F32)
    idx = np.arange(len(order))
    ok = (cum > F32(p)) & ((min_keep == 0) | (idx >= min_keep - 1))
    hits = np.flatnonzero(ok)
    last = int(hits[0]) + 1 if len(hits) else len(order)
    c.take(order[:last])
    c.sorted = False


def apply_top_n_sigma(c: Candidates, n: float) -> None:
    if n <= 0.0 or c.size <= 1:
        return
    finite = c.logits != -np.inf
    valid = c.logits[finite]
    if len(valid) == 0:
        return
    top = max(F32(c.logits[0]), valid.max())
    mean = F32(_fsum(valid) / F32(len(valid)))
    std = F32(math.sqrt(float(np.sum((valid.astype(np.float64) - float(mean)) ** 2)) / len(valid)))
    c.logits = np.where(c.logits < F32(top - F32(n) * std), F32(-np.inf), c.logits).astype(F32)


def apply_penalties(
    c: Candidates, counts: Mapping[int, int], repeat: float, freq: float, present: float
) -> None:
    if not counts:
        c.sorted = False
        return
    seen = np.fromiter(counts.keys(), dtype=np.int64)
    n = np.fromiter(counts.values(), dtype=np.int64)
    table = np.zeros(int(max(seen.max(), c.ids.max())) + 1, dtype=np.int64)
    table[seen] = n
    count = table[c.ids]
    hit = count > 0
    l = c.logits[hit]
    l = np.where(l <= 0, l * F32(repeat), l / F32(repeat)).astype(F32)
    l = (l - (count[hit].astype(F32) * F32(freq) + F32(present))).astype(F32)
    c.logits = c.logits.copy()
    c.logits[hit] = l
    c.sorted = False


def apply_xtc(
    c: Candidates, probability: float, threshold: float, min_keep: int, rng: MT19937
) -> None:
    if c.size < 2:
        return
    if rng.uniform_float() > probability:
        return
    c.softmax(True)
    above = c.p >= F32(threshold)
    pos_last = 0
    if above[0]:
        drops = np.flatnonzero(~above)
        pos_last = (int(drops[0]) if len(drops) else c.size) - 1
    if c.size - pos_last >= min_keep and pos_last > 0:
        c.take(slice(pos_last, None))


def apply_dynamic_temperature(c: Candidates, temp: float, delta: float, exponent: float) -> None:
    """llama_sampler_temp_ext with a range: temperature from the normalized entropy."""
    if c.size <= 1:
        return
    min_t = max(F32(0.0), F32(F32(temp) - F32(delta)))
    max_t = F32(F32(temp) + F32(delta))
    max_entropy = -_logf(F32(1.0) / F32(c.size))
    c.softmax(True)
    pos = c.p[c.p > 0]
    entropy = -_fsum((pos * _logf(pos)).astype(F32))
    normalized = F32(entropy / max_entropy)
    dyn = F32(min_t + (max_t - min_t) * F32(math.pow(float(normalized), float(F32(exponent)))))
    apply_temperature(c, float(dyn))
    with np.errstate(over="ignore", under="ignore"):
        e = np.exp(c.logits.astype(np.float64) - float(c.logits[0]))
    c.p = (e / np.cumsum(e)[-1]).astype(F32)


def sample_dist(c: Candidates, rng: MT19937) -> None:
    """llama_sampler_dist: float expf, double running sum, one double draw; a single candidate
    still consumes the draw."""
    if c.size == 0:
        c.selected = -1
        return
    c.selected = 0
    rnd = rng.uniform_double()
    if c.size == 1:
        c.p = np.ones(1, dtype=F32)
        return
    max_l = c.logits[0] if c.sorted else c.logits.max()
    with np.errstate(invalid="ignore"):  # an infinite bias gives NaN, as in C
        p = _expf(c.logits - max_l)
    cum = np.cumsum(p.astype(np.float64))
    total = cum[-1]
    hit = int(np.searchsorted(cum, total * rnd, side="left"))
    c.selected = min(hit, c.size - 1)
    c.p = (p / total).astype(F32)


def discrete_distribution(p: np.ndarray, rng: MT19937) -> int:
    """std::discrete_distribution<int> over p (libstdc++): fewer than 2 weights draw nothing."""
    if len(p) < 2:
        return 0
    w = p.astype(np.float64)
    cp = np.cumsum(w / np.cumsum(w)[-1])
    cp[-1] = 1.0
    return int(np.searchsorted(cp, rng.uniform_double(), side="left"))


# --- penalty and DRY windows ---------------------------------------------------------------------------


class PenaltyWindow:
    """The last ``n`` accepted tokens and their counts (llama_sampler_penalties)."""

    def __init__(self, n: int):
        self.n = n
        self.window: deque[int] = deque()
        self.counts: Counter[int] = Counter()

    def accept(self, token: int) -> None:
        if self.n == 0:
            return
        self.counts[token] += 1
        if len(self.window) >= self.n:
            old = self.window.popleft()
            self.counts[old] -= 1
            if self.counts[old] == 0:
                del self.counts[old]
        self.window.append(token)


def dry_breaker_sequences(
    breakers: Sequence[str], pieces: Sequence[bytes], tokenize: Callable[[str], list[int]]
) -> dict[int, list[tuple[int, ...]]]:
    """get_overlapping_token_sequences for each breaker: head token -> tails (empty = single token)."""
    table: dict[int, list[tuple[int, ...]]] = {}
    for breaker in breakers:
        raw = breaker.encode("utf-8")[:DRY_MAX_BREAKER_BYTES]
        if not raw:
            continue
        for token_id, word in enumerate(pieces):
            if raw in word:
                table.setdefault(token_id, []).append(())
                continue
            pos = word.find(raw[:1])
            while pos != -1:
                matched = min(len(raw), len(word) - pos)
                if word[pos : pos + matched] == raw[:matched]:
                    tail_bytes = raw[matched:]
                    try:
                        tail_text = tail_bytes.decode("utf-8")
                    except UnicodeDecodeError:
                        raise SamplerError(
                            f"dry_sequence_breakers: {breaker!r} splits a character where a "
                            f"token ends; bankml tokenizes only whole characters"
                        ) from None
                    tail = tuple(tokenize(tail_text)[:DRY_MAX_TAIL_TOKENS])
                    tails = table.setdefault(token_id, [])
                    if tail not in tails:
                        tails.append(tail)
                pos = word.find(raw[:1], pos + 1)
    return table


class DryPenalty:
    """llama_sampler_dry: repeats found with a reverse Z-algorithm, capped by sequence breakers."""

    def __init__(self, params: SamplerParams, breakers: dict[int, list[tuple[int, ...]]]):
        self.mult = params.dry_multiplier
        self.base = params.dry_base
        self.allowed = params.dry_allowed_length
        self.last_n = max(params.dry_penalty_last_n, 0)
        self.breakers = breakers
        self.tokens: deque[int] = deque(maxlen=self.last_n if self.last_n > 0 else 1)

    @property
    def enabled(self) -> bool:
        return self.mult != 0.0 and self.base >= 1.0 and self.last_n != 0

    def accept(self, token: int) -> None:
        if self.enabled:
            self.tokens.append(token)

    def _rat(self, i: int) -> int:
        return self.tokens[len(self.tokens) - 1 - i]

    def _rep_limit(self, n: int) -> int:
        for i in range(n):
            tails = self.breakers.get(self._rat(i))
            if tails is None:
                continue
            longest = -1
            for tail in tails:
                if longest < len(tail) <= i and all(
                    tail[o] == self._rat(i - o - 1) for o in range(len(tail))
                ):
                    longest = len(tail)
            if longest >= 0:
                return i - longest
        return n

    def _repeat_counts(self, n: int, rep_limit: int) -> list[int]:
        counts = [0] * n
        last = n - 1
        lt = rt = 0
        for k in range(1, n):
            if k > rt:
                m = 0
                while m + k < n and self._rat(m) == self._rat(m + k):
                    m += 1
                counts[last - k] = min(m, rep_limit)
                if m > 0:
                    lt, rt = k, k + m - 1
            else:
                p = k - lt
                right = rt - k + 1
                if counts[last - p] < right:
                    counts[last - k] = min(counts[last - p], rep_limit)
                else:
                    i = rt + 1
                    while i < n and self._rat(i) == self._rat(i - k):
                        i += 1
                    counts[last - k] = min(i - k, rep_limit)
                    lt, rt = k, i - 1
        return counts

    def apply(self, c: Candidates) -> None:
        if not self.enabled:
            return
        n = min(len(self.tokens), self.last_n)
        if n <= self.allowed:
            return
        rep_limit = self._rep_limit(n)
        if rep_limit < self.allowed:
            return
        counts = self._repeat_counts(n, rep_limit)
        max_repeat: dict[int, int] = {}
        for i in range(n - 1):
            if counts[i] >= self.allowed:
                token = self._rat(n - 2 - i)
                if max_repeat.get(token, -1) < counts[i]:
                    max_repeat[token] = counts[i]
        max_exponent = (
            int(F32(88.7228391) / F32(math.log(self.base))) if self.base > 1.000001 else 0
        )
        penalty_by_token: dict[int, float] = {}
        for token, length in max_repeat.items():
            if () in self.breakers.get(token, ()):
                continue  # single-token breakers are never penalised
            exp = length - self.allowed
            if max_exponent > 0 and exp > max_exponent:
                exp = max_exponent
            penalty_by_token[token] = float(
                F32(F32(self.mult) * F32(math.pow(float(F32(self.base)), exp)))
            )
        if penalty_by_token:
            logits = c.logits.copy()
            for pos in np.flatnonzero(np.isin(c.ids, list(penalty_by_token))):
                logits[pos] = F32(logits[pos] - F32(penalty_by_token[int(c.ids[pos])]))
            c.logits = logits
        c.sorted = False


# --- the compiled chain ------------------------------------------------------------------------------

FAST_CHAIN = True  # tests switch it off to compare with the stages above


@dataclass(frozen=True)
class FastChain:
    """A chain whose first top-k and what follows run compiled (sampler_kernels.chain_tail)."""

    prefix: tuple[str, ...]  # the stages before the first top-k, run as usual
    rest: tuple[str, ...]  # the first top-k and after: the NumPy stages that stand in
    k: int
    codes: np.ndarray  # chain_tail's stage codes after the first top-k (no-op stages left out)
    ints: np.ndarray
    floats: np.ndarray
    min_keep: int


def _penalties_act(p: SamplerParams) -> bool:
    """Whether the penalties stage changes anything (llama-server skips it otherwise)."""
    return p.repeat_last_n != 0 and not (
        p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
    )


def _xtc_acts(p: SamplerParams) -> bool:
    """Whether the XTC stage can remove candidates."""
    return p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5


def fast_chain(p: SamplerParams) -> FastChain | None:
    """The compiled plan for these parameters, or None where a stage after the first top-k is
    not one chain_tail does (typical-p, XTC, dynamic temperature, penalties, DRY, top-n-sigma when
    they act) or there is no top-k; a stage that cannot act (``_stage`` would do nothing) is left
    out. The conditions are ``Sampler._stage``'s, read once."""
    if p.mirostat != 0 or p.top_k <= 0 or "top_k" not in p.samplers:
        return None
    first = p.samplers.index("top_k")
    steps: list[tuple[int, int, Any]] = []
    for name in p.samplers[first + 1 :]:
        if name == "top_k":
            steps.append((_TOP_K, p.top_k, 0.0))
        elif name == "top_p":
            if not p.top_p >= 1.0:  # apply_top_p's test (a NaN acts)
                steps.append((_TOP_P, 0, F32(p.top_p)))
        elif name == "min_p":
            if not p.min_p <= 0.0:
                steps.append((_MIN_P, 0, _logf(F32(p.min_p))))
        elif name == "temperature":
            if p.dynatemp_range > 0:
                return None
            if p.temperature != 1.0:
                if p.temperature <= 0.0:
                    steps.append((_GREEDY, 0, 0.0))
                else:
                    steps.append((_TEMPERATURE, 0, F32(p.temperature)))
        elif name == "typ_p":
            if not p.typical_p >= 1.0:
                return None
        elif name == "xtc":
            if _xtc_acts(p):
                return None
        elif name == "penalties":
            if _penalties_act(p):
                return None
        elif name == "dry":
            if p.dry_multiplier != 0.0 and p.dry_base >= 1.0 and max(p.dry_penalty_last_n, 0) != 0:
                return None
        elif name == "top_n_sigma":
            if not p.top_n_sigma <= 0.0:
                return None
    return FastChain(
        prefix=p.samplers[:first],
        rest=p.samplers[first:],
        k=p.top_k,
        codes=np.array([s[0] for s in steps], dtype=np.int64),
        ints=np.array([s[1] for s in steps], dtype=np.int64),
        floats=np.array([s[2] for s in steps], dtype=F32),
        min_keep=p.min_keep,
    )


# chain_tail's stage codes, as sampler_kernels numbers them (that module loads Numba)
_TOP_K, _TOP_P, _MIN_P, _TEMPERATURE, _GREEDY = 0, 1, 2, 3, 4


# --- the sampler --------------------------------------------------------------------------------------


@dataclass
class VocabInfo:
    """What the sampler needs from the tokenizer: pieces (special=true) for DRY and a tokenizer."""

    pieces: Sequence[bytes]
    tokenize: Callable[[str], list[int]]
    breaker_cache: dict[tuple[str, ...], dict[int, list[tuple[int, ...]]]] = field(
        default_factory=dict
    )
    # the prepare thread and the engine thread may both ask for a table
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def dry_breakers(self, breakers: Sequence[str]) -> dict[int, list[tuple[int, ...]]]:
        """The breaker table for these strings (a scan of the whole vocabulary, so kept)."""
        key = tuple(breakers)
        with self._lock:
            if key not in self.breaker_cache:
                self.breaker_cache[key] = dry_breaker_sequences(key, self.pieces, self.tokenize)
            return self.breaker_cache[key]


class Sampler:
    """common_sampler without grammar: the chain (or mirostat), its RNGs and its windows."""

    def __init__(self, params: SamplerParams, vocab: VocabInfo | None, n_vocab: int):
        self.params = params
        self.n_vocab = n_vocab
        self.seed = resolve_seed(params.seed)
        self.rng = MT19937(self.seed)  # dist / mirostat
        self.xtc_rng = MT19937(self.seed)  # XTC has its own generator, same seed
        self.penalties = PenaltyWindow(params.repeat_last_n)
        breakers: dict[int, list[tuple[int, ...]]] = {}
        dry_on = (
            params.dry_multiplier != 0.0
            and params.dry_base >= 1.0
            and params.dry_penalty_last_n != 0
        )
        if dry_on and vocab is not None and "dry" in params.samplers:
            breakers = vocab.dry_breakers(params.dry_sequence_breakers)
        self.dry = DryPenalty(params, breakers)
        self.mu = 2.0 * params.mirostat_tau
        self.last: Candidates | None = None  # the candidates the last draw chose from
        self._fast = fast_chain(params)

    def accept(self, token: int) -> None:
        """Record a prompt or drawn token in the penalty and DRY windows."""
        if self.params.mirostat == 0:
            self.penalties.accept(token)
            self.dry.accept(token)

    def sample(
        self,
        logits: np.ndarray,
        allowed: Callable[[int], bool] | None = None,
        mask: Callable[[], np.ndarray] | None = None,
    ) -> int:
        """common_sampler_sample: the chain on raw logits; if a grammar rejects the token, the chain
        again on the grammar-masked logits (a second draw, as llama.cpp does)."""
        c = self._run_chain(Candidates.from_logits(logits, copy=False))
        token = int(c.ids[c.selected])
        if allowed is None or allowed(token):
            return token
        masked = np.array(logits, dtype=F32)
        masked[~mask()] = -np.inf  # type: ignore[misc]
        c = self._run_chain(Candidates.from_logits(masked, copy=False))
        return int(c.ids[c.selected])

    def _run_chain(self, c: Candidates) -> Candidates:
        """The chain on candidates whose logits may be the caller's (borrowed, read only)."""
        borrowed = c.logits
        p = self.params
        apply_logit_bias(c, p.logit_bias)  # common_sampler_init puts it first, mirostat or not
        self.last = c
        plan = self._fast
        if plan is not None and FAST_CHAIN and plan.k <= _kernels().MAX_K:
            if self._run_fast(plan, c):
                return c
            names = plan.rest  # the prefix ran: the chain goes on from its top-k, in NumPy
        else:
            names = p.samplers
        if np.may_share_memory(c.logits, borrowed):
            c.logits = c.logits.copy()  # the draw's candidates must not alias the caller's logits
        if p.mirostat == 1:
            self._temp(c, p.temperature)
            self._mirostat_v1(c)
            return c
        if p.mirostat == 2:
            self._temp(c, p.temperature)
            self._mirostat_v2(c)
            return c
        for name in names:
            self._stage(name, c)
        sample_dist(c, self.rng)
        return c

    def _run_fast(self, plan: FastChain, c: Candidates) -> bool:
        """The stages before the first top-k as usual, then the top-k and everything after it in
        two compiled calls; False (the prefix done, nothing drawn) where that does not apply: a
        prefix left the candidates sorted, or a logit is NaN."""
        for name in plan.prefix:
            self._stage(name, c)
        if c.sorted:
            return False
        kernels = _kernels()
        logits = np.ascontiguousarray(c.logits, dtype=F32)
        order, ok = kernels.top_k_stable(logits, plan.k)
        if not ok or len(order) == 0:
            return False
        rnd = self.rng.uniform_double()  # sample_dist's one draw (there is a candidate)
        c.ids, c.logits, c.p, selected = kernels.chain_tail(
            logits, c.ids, order, plan.codes, plan.ints, plan.floats, plan.min_keep, rnd
        )
        c.selected = int(selected)
        c.sorted = True
        return True

    @staticmethod
    def _temp(c: Candidates, temp: float) -> None:
        if temp != 1.0:
            apply_temperature(c, temp)

    def _stage(self, name: str, c: Candidates) -> None:
        p = self.params
        if name == "penalties":
            if _penalties_act(p):
                apply_penalties(
                    c,
                    self.penalties.counts,
                    p.repeat_penalty,
                    p.frequency_penalty,
                    p.presence_penalty,
                )
        elif name == "dry":
            self.dry.apply(c)
        elif name == "top_n_sigma":
            apply_top_n_sigma(c, p.top_n_sigma)
        elif name == "top_k":
            apply_top_k(c, p.top_k)
        elif name == "typ_p":
            apply_typical(c, p.typical_p, p.min_keep)
        elif name == "top_p":
            apply_top_p(c, p.top_p, p.min_keep)
        elif name == "min_p":
            apply_min_p(c, p.min_p, p.min_keep)
        elif name == "xtc":
            if _xtc_acts(p):
                apply_xtc(c, p.xtc_probability, p.xtc_threshold, p.min_keep, self.xtc_rng)
        elif name == "temperature":
            if p.dynatemp_range > 0:
                apply_dynamic_temperature(c, p.temperature, p.dynatemp_range, p.dynatemp_exponent)
            elif p.temperature != 1.0:
                apply_temperature(c, p.temperature)

    def _update_mu(self, prob: float) -> None:
        surprise = -float(np.log2(np.float64(prob)).astype(F32)) if prob > 0 else math.inf
        self.mu = float(
            F32(
                F32(self.mu)
                - F32(self.params.mirostat_eta) * F32(surprise - self.params.mirostat_tau)
            )
        )

    def _mirostat_v1(self, c: Candidates, m: int = 100) -> None:
        c.softmax(True)
        sum_ti_bi = F32(0.0)
        sum_ti_sq = F32(0.0)
        for i in range(min(m - 1, c.size - 1)):
            t_i = _logf(F32(i + 2) / F32(i + 1))
            b_i = _logf(F32(c.p[i] / c.p[i + 1]))
            sum_ti_bi = F32(sum_ti_bi + t_i * b_i)
            sum_ti_sq = F32(sum_ti_sq + t_i * t_i)
        with np.errstate(all="ignore"):
            s_hat = F32(sum_ti_bi / sum_ti_sq)
            eps = F32(s_hat - 1)
            k = F32(
                np.power(
                    F32(eps * F32(2.0 ** float(F32(self.mu))))
                    / F32(1 - F32(float(self.n_vocab) ** -float(eps))),
                    F32(1) / s_hat,
                )
            )
        k_int = int(k) if math.isfinite(float(k)) else 1
        apply_top_k(c, max(k_int, 1))
        c.softmax(True)
        c.selected = discrete_distribution(c.p, self.rng)
        self._update_mu(float(c.p[c.selected]))

    def _mirostat_v2(self, c: Candidates) -> None:
        c.softmax(True)
        with np.errstate(divide="ignore"):
            surprise = -np.log2(c.p.astype(np.float64)).astype(F32)
        over = np.flatnonzero(surprise > F32(self.mu))
        c.take(slice(0, max(int(over[0]) if len(over) else c.size, 1)))
        c.softmax(True)
        c.selected = discrete_distribution(c.p, self.rng)
        self._update_mu(float(c.p[c.selected]))


# --- the grammar and the reasoning budget around the chain ---------------------------------------------


class GuidedSampler:
    """common_sampler with its grammar and reasoning budget: ``sample`` and ``accept`` as
    common_sampler_sample and common_sampler_accept do them.

    A draw: the budget first (while it forces, every logit but the forced token's is -inf), then
    the chain, then the drawn token checked against the grammar and, if refused, the chain again
    on the budget's logits with the grammar's mask (``Sampler.sample``). A lazy grammar is left
    out while the budget counts or forces (the reasoning block is free text); when the budget
    ends, its end sequence is replayed into the grammar, since a trigger may lie in it.

    ``prefill``: the generation prompt's tokens (``prefill_tokens``), taken by the budget and,
    where the grammar needs it (``ConstraintSpec.needs_prefill``), by the grammar."""

    def __init__(
        self,
        sampler: Sampler,
        grammar: Constraint | None = None,
        budget: ReasoningBudget | None = None,
        prefill: Sequence[int] = (),
    ):
        self.sampler = sampler
        self.grammar = grammar
        self.budget = budget
        self.lazy = grammar is not None and grammar.spec.lazy
        if grammar is not None and grammar.spec.needs_prefill:
            grammar.prefill(prefill)
        if budget is not None:
            for t in prefill:
                budget.accept(t)

    @property
    def last(self) -> Candidates | None:
        """The candidates the last draw chose from (post-sampling probabilities)."""
        return self.sampler.last

    def _grammar_applies(self) -> bool:
        """grammar_should_apply."""
        if self.grammar is None:
            return False
        if self.budget is None or not self.lazy:
            return True
        return self.budget.state in (IDLE, DONE)

    def sample(self, logits: np.ndarray) -> int:
        if self.budget is not None:
            logits = self.budget.apply(logits)
        if not self._grammar_applies():
            return self.sampler.sample(logits)
        assert self.grammar is not None
        return self.sampler.sample(logits, self.grammar.allows, self.grammar.mask)

    def accept(self, token: int, generated: bool = True) -> None:
        """A drawn token (``generated``), or a prompt token (only the chain's windows see it)."""
        take = generated and self._grammar_applies()
        if self.budget is not None and generated:
            self.budget.accept(token)
            if self.grammar is not None and not take and self.budget.state == DONE:
                for end_token in self.budget.end_sequence() or ():
                    self.grammar.accept(end_token)
        if self.grammar is not None and take:
            self.grammar.accept(token)
        self.sampler.accept(token)


def prefill_tokens(
    generation_prompt: str, tokens: Sequence[int], pieces: Sequence[bytes]
) -> list[int]:
    """common_sampler_init's prefill: the generation prompt's tokens (``tokens``, tokenized with
    special tokens parsed), less a first token whose piece begins with a blank that the prompt's
    text does not begin with (some tokenizers add one before a first special token)."""
    out = []
    for i, t in enumerate(tokens):
        piece = pieces[t]
        if i == 0 and piece[:1].isspace() and not generation_prompt.encode()[:1].isspace():
            continue
        out.append(t)
    return out


# --- log-probabilities ----------------------------------------------------------------------------------


@dataclass
class TokenProbs:
    """get_token_probabilities: the top ``n`` (id, p) from raw logits and the drawn token's p."""

    top: list[tuple[int, float]]
    p_token: float


def token_logprobs(logits: np.ndarray, n_probs: int, token: int) -> TokenProbs:
    """Softmax of the raw logits as llama-server reports them (get_token_probabilities):
    ``std::partial_sort`` for the top n, expf of (logit - max), summed in float in the order the
    partial sort leaves the whole vocabulary (``partial_sort_order``), each divided."""
    logits = np.asarray(logits, dtype=F32)
    n = min(max(n_probs, 0), len(logits))
    every = partial_sort_order(logits, n) if n else np.arange(len(logits))
    order = every[:n]
    max_l = logits[order[0]] if n else logits.max()
    p = _expf(logits - max_l)
    total = _fsum(p[every])
    # only the reported probabilities are divided (each division is the same float32 one)
    probs = (p[np.append(order, token)] / total).astype(F32)
    return TokenProbs([(int(i), float(q)) for i, q in zip(order, probs[:-1])], float(probs[-1]))


def partial_sort_order(logits: np.ndarray, k: int, block: int = 1024) -> np.ndarray:
    """The vocabulary in the order libstdc++'s ``std::partial_sort(first, first + k, last)`` by
    ``a.logit > b.logit`` leaves it: ``__heap_select`` (a heap of the first k, and each later
    token greater than its top swapped in through ``__pop_heap``, which puts the top in that
    token's place), then ``__sort_heap`` of the first k. The later tokens are scanned a block at
    a time against the heap's top, which only rises, so Python sees only the tokens that may
    enter it."""
    key = logits.tolist()  # float32 values, compared exactly as doubles
    n = len(key)
    k = min(k, n)
    heap = list(range(k))

    def greater(a: int, b: int) -> bool:
        return bool(key[a] > key[b])

    def push(hole: int, top: int, value: int) -> None:
        parent = (hole - 1) // 2
        while hole > top and greater(heap[parent], value):
            heap[hole] = heap[parent]
            hole = parent
            parent = (hole - 1) // 2
        heap[hole] = value

    def adjust(hole: int, length: int, value: int) -> None:
        top = second = hole
        while second < (length - 1) // 2:
            second = 2 * (second + 1)
            if greater(heap[second], heap[second - 1]):
                second -= 1
            heap[hole] = heap[second]
            hole = second
        if length % 2 == 0 and second == (length - 2) // 2:
            second = 2 * (second + 1)
            heap[hole] = heap[second - 1]
            hole = second - 1
        push(hole, top, value)

    if k >= 2:  # __make_heap
        for parent in range((k - 2) // 2, -1, -1):
            adjust(parent, k, heap[parent])
    order = np.arange(n)
    values = np.asarray(logits, dtype=F32)
    for start in range(k, n, block):
        ahead = np.flatnonzero(values[start : start + block] > values[heap[0]]) + start
        for i in ahead.tolist():
            if k and greater(i, heap[0]):  # __pop_heap(first, middle, i)
                order[i] = heap[0]
                adjust(0, k, i)
    for last in range(k - 1, 0, -1):  # __sort_heap
        value = heap[last]
        heap[last] = heap[0]
        adjust(0, last, value)
    order[:k] = heap
    return order


def post_sampling_probs(c: Candidates, n_probs: int, token: int) -> TokenProbs:
    """populate_token_probs(post_sampling=true): the chain's final candidates sorted by p
    (common_sampler_get_candidates), the top ``n`` up to the first p of 0, and the drawn token's p
    (1.0 when it is not among them, llama-server's initial value)."""
    order = np.arange(c.size) if c.sorted else np.argsort(-c.p, kind="stable")
    ids, p = c.ids[order], c.p[order]
    hit = np.flatnonzero(ids == token)
    p_token = float(p[hit[0]]) if len(hit) else 1.0
    top = []
    for i in range(min(max(n_probs, 0), len(ids))):
        if p[i] == 0.0:
            break
        top.append((int(ids[i]), float(p[i])))
    return TokenProbs(top, p_token)


def logarithm(p: float) -> float:
    """completion_token_output::logarithm: ln p in float, float's lowest for p = 0."""
    return float(np.finfo(F32).min) if p == 0.0 else float(_logf(F32(p)))
