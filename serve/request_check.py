"""The one boundary a request crosses: every field of `Request` checked and normalised, host-side.

`check_request` returns a copy the engine can trust (prompt and stop ids as tuples of Python ints,
numbers as Python int / float, `top_k` clipped to the vocabulary) or raises `RequestError` naming the
field. Everything after submit (admission writes int32 / float32 device rows) relies on it: a value
that passed here cannot overflow or fail there, so one bad request never takes a batch down.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

from dspark_jax.errors import UserError, json_object_line
from dspark_jax.sampling import COUPLINGS
from dspark_jax.validation import check_known_keys

_SEED_LIMIT = 2 ** 32


class RequestError(UserError):
    """A request field is wrong. `field` is the `Request` attribute's name (the HTTP layer maps it)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"request '{field}': {message}")
        self.field = field


@dataclasses.dataclass
class Request:
    """One generation request (Python API). `prompt` and `stop_tokens`: token ids; `top_k` 0 and
    `top_p` 1 are off; `seed` keys the request's randomness. `coupling` "invariant": the same seed gives
    the same tokens as plain decoding, whatever the draft, scheduler or batch did; "optimal": the most
    accepted drafts, exact in distribution only (`dspark_jax.sampling`, README "Same seed, same tokens")."""

    prompt: Sequence[int]
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: Sequence[int] = ()
    id: str | int | None = None
    coupling: str = "optimal"


# What `dspark serve --coupling` / `dspark generate --coupling` take: a coupling, or "auto" (below).
COUPLING_SETTINGS = ("auto",) + COUPLINGS


def choose_coupling(setting: str, seeded: bool) -> str:
    """The coupling of one request under a server's or a run's setting. "auto": a request that sets a seed
    asks for reproducible tokens, so it gets the invariant coupling (the same seed gives the same tokens,
    whatever the load); one without a seed gets the optimal coupling (the most accepted drafts)."""
    if setting not in COUPLING_SETTINGS:
        raise ValueError(f"coupling: expected one of {COUPLING_SETTINGS}, got {setting!r}")
    if setting == "auto":
        return "invariant" if seeded else "optimal"
    return setting


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _token_ids(field: str, value, vocab: int, *, allow_empty: bool) -> tuple[int, ...]:
    # A generator or a string would be consumed / split silently; only real sequences are token lists.
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) and not hasattr(value, "__array__"):
        raise RequestError(field, f"expected a list of token ids, got {type(value).__name__}")
    ids = list(value)
    if not ids and not allow_empty:
        raise RequestError(field, "empty; expected at least one token")
    bad = [t for t in ids if not _is_int(t) or not 0 <= int(t) < vocab]
    if bad:
        raise RequestError(field, f"token ids must be integers in [0, {vocab}), got {bad[:5]!r}")
    return tuple(int(t) for t in ids)


def check_filters(top_k, top_p, error=RequestError) -> None:
    """top_k an integer >= 0, top_p a number in (0, 1]; `error(field, message)` builds what is raised
    (requests raise RequestError; other callers, e.g. `dspark regenerate`, name their own setting)."""
    if not _is_int(top_k) or top_k < 0:
        raise error("top_k", f"expected an integer >= 0 (0 = off), got {top_k!r}")
    if not _is_real(top_p) or not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise error("top_p", f"expected a number in (0, 1] (1 = off), got {top_p!r}")


def check_length_and_temperature(max_tokens, temperature, error=RequestError) -> None:
    """max_tokens an integer >= 1, temperature a finite number >= 0; `error` as in `check_filters`
    (`dspark generate` checks its per-request defaults with it, naming its flags)."""
    if not _is_int(max_tokens) or max_tokens < 1:
        raise error("max_tokens", f"expected an integer >= 1, got {max_tokens!r}")
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise error("temperature", f"expected a finite number >= 0, got {temperature!r}")


def check_request(req, *, vocab: int, max_len: int, max_stop_tokens: int):
    """-> a normalised copy of `req`, or RequestError naming the first wrong field."""
    if not isinstance(req, Request):
        raise RequestError("request", f"expected a dspark_jax.serve.engine.Request, got {type(req).__name__}")
    prompt = _token_ids("prompt", req.prompt, vocab, allow_empty=False)
    if len(prompt) + 1 >= max_len:
        raise RequestError("prompt", f"{len(prompt)} tokens does not fit the cache "
                                     f"(max_len={max_len} leaves room for {max_len - 2})")
    check_length_and_temperature(req.max_tokens, req.temperature)
    check_filters(req.top_k, req.top_p)
    if not _is_int(req.seed) or not 0 <= req.seed < _SEED_LIMIT:
        raise RequestError("seed", f"expected an integer in [0, 2^32), got {req.seed!r}")
    if req.coupling not in COUPLINGS:
        raise RequestError("coupling", f"expected one of {COUPLINGS}, got {req.coupling!r}")
    stops = _token_ids("stop_tokens", req.stop_tokens, vocab, allow_empty=True)
    if len(stops) > max_stop_tokens:
        raise RequestError("stop_tokens", f"at most {max_stop_tokens} (EngineConfig.max_stop_tokens), "
                                          f"got {len(stops)}")
    # top_k >= vocab keeps every token: the same as off, and it must fit the int32 device row.
    top_k = 0 if req.top_k >= vocab else int(req.top_k)
    # No request emits more than the cache holds; clipping keeps the budget inside int32.
    max_tokens = min(int(req.max_tokens), max_len)
    return dataclasses.replace(req, prompt=prompt, max_tokens=max_tokens,
                               temperature=float(req.temperature), top_k=top_k, top_p=float(req.top_p),
                               seed=int(req.seed), stop_tokens=stops)


# The keys of a `dspark generate` prompt line (README "generate reads ..."). Any other key is refused for
# its line: a misspelled `temprature` would otherwise be ignored and the line served at the default.
PROMPT_LINE_KEYS = ("prompt", "tokens", "id", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop")


def prompt_record(raw, keys: Sequence[str] | None = None) -> dict | None:
    """One prompts-JSONL line (bytes or str) -> its JSON object, None for a blank line, or UserError saying
    what is wrong with the line (the caller names the file and line). It holds a 'prompt' (text) or
    'tokens' (a list), not both; with `keys`, every key must be one of them. Shared by `dspark generate`
    (serve/generate_cli.py) and `dspark demo` / `dspark bench acceptance` (evaluation.read_prompts)."""
    rec = json_object_line(raw)
    if rec is None:
        return None
    if keys is not None:
        check_known_keys(rec, keys)
    if "tokens" in rec and "prompt" in rec:
        raise UserError("give 'tokens' or 'prompt', not both")
    if "tokens" in rec:
        if not isinstance(rec["tokens"], list):
            raise UserError(f"'tokens': expected a list of token ids, got {type(rec['tokens']).__name__}")
    elif "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise UserError(f"'prompt': expected a string, got {type(rec['prompt']).__name__}")
    else:
        raise UserError("expected a 'prompt' (text) or 'tokens' (ids) field")
    return rec
