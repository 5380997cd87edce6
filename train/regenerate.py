"""On-policy training data: the backbone's own continuations of training-split prompts (`dspark regenerate`).

A draft trained on corpus text learns the corpus; a draft trained on its backbone's samples learns the
backbone, which is what verification accepts (DeepSpec's data regeneration, EAGLE-3, DFlash). This module
cuts prompts from training records, has the backbone continue each one through the serving engine, and
writes `{"tokens": prompt + response, "loss_mask": [0]*len(prompt) + [1]*len(response)}` lines that
`dspark_jax.train.data` reads (extra keys: "index", "temperature", "seed", "finish_reason").

    prompts = prompt_windows(load_documents(["corpus/train.jsonl"], tokenizer), RegenConfig(...))
    regenerate(model, weights, prompts, "regen.jsonl", RegenConfig(...))

Deterministic by seed: the prompts are drawn by a generator seeded with `seed`; prompt i is continued
at temperature temperatures[i % len(temperatures)] with request seed `request_seed(seed, i)`, and the
engine's randomness is keyed by that seed alone (not by slot or batch), so a result does not depend on
what else is served. Any engine mode is lossless, so "plain" (cheapest while the draft is poor) and the
speculative modes give samples from the same distribution; with the same seed, plain decoding and
speculative decoding give the same greedy tokens.

Resumable: each result is appended (and flushed) the moment it finishes; a run that finds the file
keeps its complete lines, drops a torn last line, and serves only the missing indices. A sidecar
`<out>.regen.json` records the settings; resuming with different ones is an error. When every index is
done the file is rewritten in index order, so an interrupted and an uninterrupted run give the same
bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from dspark_jax.errors import UserError, json_object_line
from dspark_jax.serve.engine import Engine, EngineConfig, Request
from dspark_jax.serve.request_check import check_filters
from dspark_jax.train.data import DataError, encode_record, expand_paths


@dataclasses.dataclass(frozen=True)
class RegenConfig:
    num_prompts: int = 1024
    prompt_len: int = 64  # tokens of training text before the continuation
    max_new_tokens: int = 192
    temperatures: tuple[float, ...] = (0.0, 1.0)
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    slots: int = 32
    mode: str = "plain"  # engine mode; every mode is lossless

    def __post_init__(self):
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        for name in ("num_prompts", "prompt_len", "max_new_tokens", "slots"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"regenerate {name}: expected an integer >= 1, got {v!r}")
        if not self.temperatures or any(not (np.isfinite(t) and t >= 0) for t in self.temperatures):
            raise ValueError(f"regenerate temperatures: expected finite values >= 0, got {self.temperatures}")
        check_filters(self.top_k, self.top_p, error=lambda field, message: ValueError(f"regenerate {field}: {message}"))
        if self.mode not in ("plain", "off", "fixed", "sync", "async"):
            raise ValueError(f"regenerate mode: expected plain, off, fixed, sync or async, got {self.mode!r}")

    def fingerprint(self) -> dict:
        """The settings a resumed run must share (slots and mode change speed, not results)."""
        d = dataclasses.asdict(self)
        d.pop("slots"), d.pop("mode")
        d["temperatures"] = list(self.temperatures)
        return d


def request_seed(seed: int, index: int) -> int:
    """A 32-bit request seed from (run seed, prompt index): independent streams per prompt."""
    digest = hashlib.sha256(f"dspark-regenerate:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def load_documents(paths: Sequence[str], tokenizer=None, vocab_size: int | None = None) -> list[np.ndarray]:
    """JSONL training records ("text" needs `tokenizer`, or "tokens") -> token arrays, in file order.
    With `vocab_size`, a token outside [0, vocab_size) is an error naming the file and line, here rather
    than as a nameless prompt error from the engine after the model is built."""
    docs = []
    for path in expand_paths(tuple(str(p) for p in paths)):
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                where = f"{path} line {n}"
                try:
                    rec = json_object_line(raw)
                except UserError as err:
                    raise DataError(f"{where}: {err}") from None
                if rec is None:
                    continue
                if isinstance(rec.get("tokens"), list):
                    check_token_ids(rec["tokens"], vocab_size, where)  # the exact bad token, before encoding
                ids, _ = encode_record(rec, tokenizer, add_special_tokens=False, where=where)
                check_token_ids(ids.tolist(), vocab_size, where)  # also a tokenizer larger than the model
                docs.append(ids)
    return docs


def check_token_ids(tokens: Sequence, vocab_size: int | None, where: str) -> None:
    """DataError naming `where` and the first entry that is not a token id in [0, vocab_size) (any
    non-negative integer when vocab_size is None)."""
    for i, t in enumerate(tokens):
        if not (isinstance(t, int) and not isinstance(t, bool)):
            raise DataError(f"{where}: token {t!r} (entry {i} of 'tokens') is not a token id (an integer)")
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            span = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocab_size)"
            raise DataError(f"{where}: token {t} (entry {i} of 'tokens') outside the vocabulary {span}")


def prompt_windows(docs: Sequence[np.ndarray], cfg: RegenConfig) -> list[list[int]]:
    """`cfg.num_prompts` windows of `cfg.prompt_len` tokens: documents visited in a seeded random order
    (cycling when there are fewer documents than prompts), one window at a seeded random offset each."""
    eligible = [d for d in docs if len(d) >= cfg.prompt_len + 1]
    if not eligible:
        raise DataError(f"regenerate: no training record has more than {cfg.prompt_len} tokens (--prompt-len)")
    rng = np.random.default_rng(cfg.seed)
    prompts: list[list[int]] = []
    while len(prompts) < cfg.num_prompts:
        for j in rng.permutation(len(eligible)):
            doc = eligible[j]
            start = int(rng.integers(0, len(doc) - cfg.prompt_len + 1))
            prompts.append([int(t) for t in doc[start:start + cfg.prompt_len]])
            if len(prompts) == cfg.num_prompts:
                break
    return prompts


def cache_len_for(prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int) -> int:
    """A cache that holds the longest prompt, its whole continuation and one last round's drafts (+2:
    the engine stops a row 2 positions before the cache end)."""
    return max((len(p) for p in prompts), default=1) + max_new_tokens + block_size + 2


def training_record(prompt: Sequence[int], response: Sequence[int]) -> dict:
    """One `dspark train` JSONL record: the loss is on the response only."""
    return {"tokens": [int(t) for t in prompt] + [int(t) for t in response],
            "loss_mask": [0] * len(prompt) + [1] * len(response)}


def training_line(index: int, prompt: Sequence[int], response: Sequence[int], temperature: float, seed: int,
                  finish_reason: str) -> str:
    rec = {"index": index, "temperature": temperature, "seed": seed, "finish_reason": finish_reason,
           **training_record(prompt, response)}
    return json.dumps(rec) + "\n"


def _sidecar(out: Path) -> Path:
    return out.with_name(out.name + ".regen.json")


def read_done(out: Path, num_prompts: int) -> dict[int, str]:
    """Complete lines of an earlier run by index. A torn last line (no newline, or unparsable) is cut off."""
    if not out.is_file():
        return {}
    data = out.read_bytes()
    done: dict[int, str] = {}
    good_end = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            rec = json.loads(line)
            idx = int(rec["index"])
        except (ValueError, KeyError, TypeError):
            break
        if not 0 <= idx < num_prompts:
            raise DataError(f"{out}: line with index {idx} outside this run's {num_prompts} prompts")
        done[idx] = line.decode()
        good_end += len(line)
    if good_end < len(data):
        with open(out, "r+b") as f:
            f.truncate(good_end)
    return done


def check_resume(out: Path, cfg: RegenConfig) -> None:
    side = _sidecar(out)
    want = cfg.fingerprint()
    if side.is_file():
        have = json.loads(side.read_text())
        if have != want:
            diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
            raise DataError(f"{out}: written with other settings ({', '.join(diff)} differ; see {side}); "
                            "pass a new --out or the same settings")
    elif out.is_file() and out.stat().st_size:
        raise DataError(f"{out}: exists without {side.name}; not a file this command wrote (pass a new --out)")
    side.write_text(json.dumps(want, indent=2) + "\n")


def regenerate(model, weights, prompts: Sequence[Sequence[int]], out, cfg: RegenConfig, *,
               cost_table=None, progress: bool = True) -> dict:
    """Continue every prompt with the backbone (through the engine) and append training lines to `out`.
    -> {"done", "served", "tokens", "tokens_per_s"}."""
    if len(prompts) != cfg.num_prompts:
        raise ValueError(f"regenerate: got {len(prompts)} prompts for num_prompts={cfg.num_prompts}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    check_resume(out, cfg)
    done = read_done(out, cfg.num_prompts)
    todo = [i for i in range(cfg.num_prompts) if i not in done]
    k = model.block_size
    engine = Engine(model, weights, EngineConfig(
        max_slots=cfg.slots, max_len=cache_len_for(prompts, cfg.max_new_tokens, k), mode=cfg.mode,
        num_verify=k if cfg.mode == "fixed" else None, progress=False), cost_table=cost_table)
    owner = {}
    for i in todo:
        temp = cfg.temperatures[i % len(cfg.temperatures)]
        req = Request(list(prompts[i]), max_tokens=cfg.max_new_tokens, temperature=temp, top_k=cfg.top_k,
                      top_p=cfg.top_p, seed=request_seed(cfg.seed, i), id=i)
        owner[engine.submit(req)] = req
    tokens: dict[int, list[int]] = {}
    bar = tqdm(total=cfg.num_prompts, initial=len(done), desc="regenerate", unit="prompt",
               disable=not progress, mininterval=2.0)
    generated, t0 = 0, time.perf_counter()
    with open(out, "a") as f:
        for ev in engine.stream():
            req = owner.get(ev.id)
            if req is None:
                continue
            tokens.setdefault(req.id, []).extend(ev.tokens)
            generated += len(ev.tokens)
            if not ev.finish_reason:
                continue
            if ev.finish_reason == "error":
                raise RuntimeError(f"regenerate: prompt {req.id} failed in the engine: {ev.error}")
            line = training_line(req.id, req.prompt, tokens.pop(req.id), req.temperature, req.seed,
                                 ev.finish_reason)
            f.write(line)
            f.flush()
            done[req.id] = line
            bar.update(1)
            bar.set_postfix(tok_s=f"{generated / max(bar.format_dict['elapsed'], 1e-9):.0f}")
    bar.close()
    _rewrite_in_order(out, done, cfg.num_prompts)
    wall = max(time.perf_counter() - t0, 1e-9)
    return {"done": len(done), "served": len(todo), "tokens": generated, "tokens_per_s": generated / wall}


def _rewrite_in_order(out: Path, done: dict[int, str], n: int) -> None:
    """Every index done -> the file in index order (atomic replace), independent of finish order."""
    if len(done) < n:
        return
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(done[i] for i in range(n))
    os.replace(tmp, out)
