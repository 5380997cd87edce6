"""The OpenAI request and response shapes for `dspark serve`: parsing with field-naming errors, the chat
template, incremental detokenization with stop strings, and the response / stream-chunk objects.

Pure host code (no FastAPI, no JAX): `serve/http.py` wires it to the engine loop.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any

# Parameters of the OpenAI API that we do not support yet: any value but the default is a 400 naming it.
UNSUPPORTED = {"n": 1, "logprobs": None, "echo": False, "best_of": 1, "suffix": None, "logit_bias": None,
               "presence_penalty": 0, "frequency_penalty": 0, "top_logprobs": None, "tools": None,
               "tool_choice": None, "response_format": None}
MAX_STOP_STRINGS = 4
CHAT_ROLES = ("system", "user", "assistant")
# The default largest request body (`dspark serve --max-body-bytes`; 413 beyond). A request is a prompt
# and a few parameters: a whole context as text (~4 bytes a token) or as token ids in JSON (<= 8 bytes a
# token) is under 1 MiB up to 128k tokens. 4 MiB leaves room for that and keeps a client from making the
# server buffer and tokenize a body of any size.
DEFAULT_MAX_BODY_BYTES = 4 << 20


class ApiError(Exception):
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}': {message}", param=param, code="invalid_value")


@dataclasses.dataclass
class Params:
    """One parsed completion request."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_strings: list[str]
    stop_tokens: list[int]
    stream: bool
    include_usage: bool
    user: str | None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"expected a number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(name, f"expected a number in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}")
    return float(v)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise bad(name, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def check_unsupported(body: dict) -> None:
    for name, default in UNSUPPORTED.items():
        if name in body and body[name] is not None and body[name] != default:
            raise ApiError(400, f"'{name}' is not supported by this server (only {name}={default!r})", param=name,
                           code="unsupported_parameter")


def encode_text(tokenizer, text: str) -> list[int]:
    """`text`'s token ids (no special tokens). A `tokenizers.Tokenizer`'s `encode_batch` gives the ids
    `encode` gives but releases the GIL while it works; `encode` holds it, so a multi-MB prompt froze
    every other thread of the server (its event loop included) for seconds, even from a worker thread."""
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
    return tokenizer.encode(text, add_special_tokens=False).ids


def parse_prompt(prompt: Any, tokenizer, vocab: int, name: str = "prompt") -> list[int]:
    """A string (needs the tokenizer), a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise bad(name, "this model has no tokenizer; send a list of token ids")
        ids = encode_text(tokenizer, prompt)
        if not ids:
            raise bad(name, "empty; expected at least one token")
        return list(ids)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad_ids = [t for t in prompt if not 0 <= t < vocab]
        if bad_ids:
            raise bad(name, f"token ids must be in [0, {vocab}), got {bad_ids[:5]}")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad(name, "one prompt per request (a batch of prompts is not supported; send one request each)")
    raise bad(name, "expected a non-empty string or a non-empty list of token ids")


def parse_stop(stop: Any, vocab: int, max_stop_tokens: int) -> tuple[list[str], list[int]]:
    if stop is None:
        return [], []
    items = [stop] if isinstance(stop, (str, int)) and not isinstance(stop, bool) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) or _is_int(s) for s in items):
        raise bad("stop", "expected a string, a token id, or a list of them")
    strings = [s for s in items if isinstance(s, str)]
    tokens = [s for s in items if not isinstance(s, str)]
    if any(not s for s in strings):
        raise bad("stop", "stop strings must not be empty")
    if len(strings) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    if any(not 0 <= t < vocab for t in tokens):
        raise bad("stop", f"stop token ids must be in [0, {vocab}), got {tokens}")
    if len(tokens) > max_stop_tokens:
        raise bad("stop", f"at most {max_stop_tokens} stop token ids, got {len(tokens)}")
    return strings, tokens


def parse_common(body: Any, prompt: list[int], *, vocab: int, max_len: int, max_stop_tokens: int,
                 default_max_tokens: int) -> Params:
    """Everything but the prompt, validated; `prompt` already parsed."""
    room = max_len - len(prompt) - 1
    if room < 1:
        raise ApiError(400, f"the prompt has {len(prompt)} tokens; this server's context is {max_len} tokens "
                       f"(prompt + max_tokens + 1)", param="prompt", code="context_length_exceeded")
    max_tokens = _integer(body, "max_tokens", None, 1, 2 ** 31 - 1)
    if max_tokens is None:
        max_tokens = min(default_max_tokens, room)
    if max_tokens > room:
        raise ApiError(400, f"'max_tokens': {max_tokens} does not fit: the prompt has {len(prompt)} tokens and the "
                       f"context is {max_len} (at most {room})", param="max_tokens", code="context_length_exceeded")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"expected true or false, got {stream!r}")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("stream_options", "expected an object")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", "expected a string")
    strings, tokens = parse_stop(body.get("stop"), vocab, max_stop_tokens)
    return Params(prompt=prompt, max_tokens=max_tokens,
                  temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                  top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                  top_k=_integer(body, "top_k", 0, 0, vocab), seed=_integer(body, "seed", None, 0, 2 ** 32 - 1),
                  stop_strings=strings, stop_tokens=tokens, stream=stream,
                  include_usage=bool(opts.get("include_usage", False)), user=user)


def chat_prompt(messages: Any) -> str:
    """The plain chat template: one "Role: content" line per message, then "Assistant:" to answer.

        System: You are terse.
        User: Hello
        Assistant:
    (the embedded models are not chat-tuned: they continue this text as they would any text)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty list of {role, content} objects")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "expected an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"expected one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if isinstance(content, list):  # the content-parts form: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "expected a string")
        lines.append(f"{role.capitalize()}: {content}\n")
    return "".join(lines) + "Assistant:"


class TextStream:
    """Token ids in, text deltas out, cut at the first stop string (which is not returned).

    Byte-level BPE can split a character across tokens; text ending in U+FFFD is held back until the
    next token completes it, and so is any tail that could still grow into a stop string."""

    def __init__(self, tokenizer, stop_strings: list[str]):
        self.tokenizer, self.stops = tokenizer, stop_strings
        self.tokens: list[int] = []
        self.sent = 0  # characters of the decoded text already returned
        self.stopped = False

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens) if self.tokenizer is not None else ""

    def push(self, tokens: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        text = self._text()
        hits = [i for i in (text.find(s, self.sent) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.sent = text[self.sent:min(hits)], min(hits)
            return out
        safe = len(text)
        if not final:
            safe = len(text.rstrip("\ufffd"))  # an incomplete character: wait for its next bytes
            hold = 0
            for s in self.stops:  # a tail that is a proper prefix of a stop string may still become one
                hold = max([hold] + [n for n in range(1, min(len(s), safe + 1)) if text[safe - n:safe] == s[:n]])
            safe -= hold
        safe = max(safe, self.sent)
        out, self.sent = text[self.sent:safe], safe
        return out

    @property
    def text(self) -> str:
        return self._text()[:self.sent]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def dspark_stats(rounds: int, accepted: int, generated: int) -> dict:
    """The extension field: the request's speculative rounds, accepted drafts and tau (tokens per round)."""
    return {"rounds": rounds, "accepted_drafts": accepted, "tau": generated / rounds if rounds else 0.0}


def completion_object(rid: str, model: str, created: int, *, chat: bool, chunk: bool, text: str | None = None,
                      delta: dict | None = None, finish: str | None = None, extra: dict | None = None) -> dict:
    """A completion, a chat completion, or one stream chunk of either (chat chunks carry `delta`)."""
    if not chat:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    elif chunk:
        choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text or ""}, "logprobs": None,
                  "finish_reason": finish}
        obj = "chat.completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if extra:
        out.update(extra)
    return out


def now() -> int:
    return int(time.time())
