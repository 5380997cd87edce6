"""Training data: JSON lines -> fixed-length token sequences with loss masks -> batches with anchors.

Record formats (one JSON object per line; blank lines are skipped):
    {"text": "...", "loss_spans": [[start_char, end_char], ...]}   needs a tokenizer; loss_spans optional
    {"tokens": [id, ...], "loss_mask": [0/1, ...]}                  no tokenizer; loss_mask optional
Without loss_spans / loss_mask every token is supervised. With loss_spans, a token is supervised iff
its character range [start, end) is non-empty and overlaps one of the spans (so special tokens, whose
range is empty, never are). Other keys are ignored. A bad line (not UTF-8, not JSON, a bad field, a
token outside the vocabulary) is skipped with a warning naming the file and line (the first
`_MAX_WARNINGS`, then a count), so hours of training never end on one line; a stream whose every line is
bad is an error.

Sequences: each record becomes one sequence of exactly `seq_len` tokens: truncated, or padded with
`pad_id` and loss_mask 0. Records are not packed together: the backbone forward has no document mask,
so packing would let one document's context leak into another's teacher.

Order: records are numbered in file order (globs expanded and sorted). Host p of P keeps the records
with number % P == p, then a buffered shuffle (buffer `shuffle_buffer`, generator seeded by
(seed, epoch, p)) reorders them; epochs repeat forever with a new seed. The stream's position is
(epoch, records consumed in that epoch); restoring it replays the shuffle without tokenizing the
skipped records, so a resumed run sees exactly the batches an uninterrupted one would.

Anchors are drawn per sequence from a generator seeded by (seed, epoch, record number): the same
draw whatever the batch layout or number of hosts.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import warnings
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np

from dspark_jax.errors import UserError, json_object_line
from dspark_jax.train.anchors import sample_anchors


_MAX_WARNINGS = 20


class DataWarning(UserWarning):
    """A training record was skipped."""


class DataError(UserError):
    """A dataset file or record is unusable; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train: tuple[str, ...]  # JSONL files or glob patterns
    seq_len: int = 2048
    tokenizer: str | None = None  # a `tokenizers` Tokenizer JSON file; not needed for token-id records
    add_special_tokens: bool = True
    pad_id: int = 0
    shuffle_buffer: int = 10000
    seed: int = 0
    anchors_per_seq: int = 512

    def __post_init__(self):
        train = (self.train,) if isinstance(self.train, (str, os.PathLike)) else tuple(self.train)
        object.__setattr__(self, "train", tuple(str(p) for p in train))
        if not self.train:
            raise DataError("data.train: expected at least one JSONL file or glob pattern")
        for name in ("seq_len", "shuffle_buffer", "anchors_per_seq"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise DataError(f"data.{name}: expected a positive integer, got {v!r}")
        if self.seq_len < 2:
            raise DataError(f"data.seq_len: expected at least 2, got {self.seq_len}")


class Example(NamedTuple):
    tokens: np.ndarray  # i32[seq_len]
    loss_mask: np.ndarray  # bool[seq_len]
    record: int  # the record's number in the dataset
    epoch: int


def expand_paths(patterns: tuple[str, ...]) -> list[Path]:
    out = []
    for pat in patterns:
        hits = sorted(glob.glob(pat)) if glob.has_magic(pat) else [pat]
        if not hits:
            raise DataError(f"data.train: pattern {pat!r} matches no file")
        for h in hits:
            if not Path(h).is_file():
                raise DataError(f"data.train: {h} is not a file")
            out.append(Path(h))
    return out


def load_tokenizer(path: str | None):
    if path is None:
        return None
    from tokenizers import Tokenizer  # noqa: PLC0415

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises plain Exceptions
        raise DataError(f"data.tokenizer: cannot load {path} as a `tokenizers` JSON file ({err})") from None


def encode_record(rec: Any, tokenizer, *, add_special_tokens: bool = True, where: str = "record"
                  ) -> tuple[np.ndarray, np.ndarray]:
    """One parsed record -> (token ids i32[L], loss mask bool[L])."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if ("text" in rec) == ("tokens" in rec):
        raise DataError(f"{where}: a record needs exactly one of 'text' and 'tokens'")
    if "tokens" in rec:
        ids = rec["tokens"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ids):
            raise DataError(f"{where}: 'tokens' must be a list of non-negative integers")
        ids = np.asarray(ids, np.int32).reshape(-1)
        if "loss_mask" in rec:
            m = rec["loss_mask"]
            if not isinstance(m, list) or len(m) != len(ids) or not all(v in (0, 1) for v in m):
                raise DataError(f"{where}: 'loss_mask' must be a list of 0/1 (or booleans) with one entry per "
                                f"token ({len(ids)})")
            mask = np.asarray(m, bool)
        else:
            mask = np.ones(len(ids), bool)
        return ids, mask
    text = rec["text"]
    if not isinstance(text, str):
        raise DataError(f"{where}: 'text' must be a string")
    if tokenizer is None:
        raise DataError(f"{where}: a 'text' record needs a tokenizer (data.tokenizer in the run config)")
    enc = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    ids = np.asarray(enc.ids, np.int32)
    spans = rec.get("loss_spans")
    if spans is None:
        return ids, np.ones(len(ids), bool)
    if not isinstance(spans, list) or not all(isinstance(s, (list, tuple)) and len(s) == 2
                                              and all(isinstance(v, int) for v in s) and 0 <= s[0] <= s[1]
                                              for s in spans):
        raise DataError(f"{where}: 'loss_spans' must be a list of [start_char, end_char] with 0 <= start <= end")
    offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
    mask = np.zeros(len(ids), bool)
    for s, e in spans:
        mask |= (offsets[:, 0] < e) & (offsets[:, 1] > s)
    mask &= offsets[:, 1] > offsets[:, 0]
    return ids, mask


def fixed_length(ids: np.ndarray, mask: np.ndarray, seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full(seq_len, pad_id, np.int32)
    loss_mask = np.zeros(seq_len, bool)
    n = min(seq_len, len(ids))
    tokens[:n], loss_mask[:n] = ids[:n], mask[:n]
    return tokens, loss_mask


class JsonlStream:
    """An endless, seeded, host-sharded, shuffled stream of `Example`s (see the module docstring)."""

    def __init__(self, cfg: DataConfig, *, process_index: int | None = None, process_count: int | None = None,
                 vocab_size: int | None = None):
        if process_index is None or process_count is None:
            import jax  # noqa: PLC0415

            process_index, process_count = jax.process_index(), jax.process_count()
        if not 0 <= process_index < process_count:
            raise DataError(f"process_index {process_index} not in [0, {process_count})")
        self.cfg = cfg
        self.process_index, self.process_count = process_index, process_count
        self.vocab_size = vocab_size
        self.paths = expand_paths(cfg.train)
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.epoch, self.consumed = 0, 0
        self._it: Iterator | None = None
        self._count: int | None = None
        self.skipped = 0  # bad lines skipped so far
        self._bad_run = 0  # bad lines in a row

    # ---- position --------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def restore(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self._it = None

    def host_records(self) -> int:
        """How many records this host owns per epoch (one pass over the files, no tokenizing)."""
        if self._count is None:
            self._count = sum(1 for _ in self._host_lines())
        return self._count

    def seek(self, n: int) -> None:
        """Position the stream after its first n examples (over epochs), as if they had been read."""
        count = self.host_records()
        if count == 0:
            raise self._no_records()
        self.epoch, self.consumed = divmod(int(n), count)
        self._it = None

    def check_usable(self) -> None:
        """DataError unless this host's share holds a good record (read up to the first one; the stream's
        position is untouched): a trainer checks it before its compile, so an empty file or a file of only
        bad lines fails in seconds, not after minutes."""
        last = None
        for number, line, where in self._host_lines():
            try:
                self._example(number, line, where)
                return
            except DataError as err:
                last = err
        raise self._no_records() if last is None else self._all_bad(last)

    def _no_records(self) -> DataError:
        return DataError(f"data.train: host {self.process_index} of {self.process_count} has no records in "
                         f"{[str(p) for p in self.paths]}")

    def _all_bad(self, last: DataError) -> DataError:
        return DataError(f"data.train: every record of host {self.process_index} is bad (the last: {last})")

    # ---- iteration -------------------------------------------------------------------------------
    def _host_lines(self) -> Iterator[tuple[int, bytes, str]]:
        number = 0
        for path in self.paths:
            with open(path, "rb") as f:  # decoded per line: one bad byte spoils its line, not the file
                for line_no, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    if number % self.process_count == self.process_index:
                        yield number, line, f"{path} line {line_no}"
                    number += 1

    def _shuffled(self, epoch: int) -> Iterator[tuple[int, str, str]]:
        rng = np.random.default_rng([self.cfg.seed, epoch, self.process_index])
        buf: list = []
        for item in self._host_lines():
            if len(buf) < self.cfg.shuffle_buffer:
                buf.append(item)
                continue
            i = int(rng.integers(len(buf)))
            buf[i], item = item, buf[i]
            yield item
        rng.shuffle(buf)
        yield from buf

    def _raw(self) -> Iterator[tuple[int, str, str]]:
        skip = self.consumed
        while True:
            n = 0
            for n, item in enumerate(self._shuffled(self.epoch), start=1):
                if n <= skip:
                    continue
                self.consumed = n
                yield item
            if n == 0:
                raise self._no_records()
            skip = 0
            self.epoch, self.consumed = self.epoch + 1, 0

    def __iter__(self):
        return self

    def __next__(self) -> Example:
        if self._it is None:
            self._it = self._raw()
        while True:
            number, line, where = next(self._it)
            try:
                example = self._example(number, line, where)
            except DataError as err:
                self._skip(err)
                continue
            self._bad_run = 0
            return example

    def _example(self, number: int, line: bytes, where: str) -> Example:
        try:
            rec = json_object_line(line)
        except UserError as err:
            raise DataError(f"{where}: {err}") from None
        ids, mask = encode_record(rec, self.tokenizer, add_special_tokens=self.cfg.add_special_tokens, where=where)
        if self.vocab_size is not None and ids.size and int(ids.max()) >= self.vocab_size:
            raise DataError(f"{where}: token id {int(ids.max())} is outside the vocabulary ({self.vocab_size})")
        tokens, loss_mask = fixed_length(ids, mask, self.cfg.seq_len, self.cfg.pad_id)
        return Example(tokens, loss_mask, number, self.epoch)

    def _skip(self, err: DataError) -> None:
        """Warn about a bad line and go on; every line of this host's share bad in a row is an error."""
        self.skipped += 1
        self._bad_run += 1
        if self.skipped <= _MAX_WARNINGS:
            tail = " (further bad lines are counted, not shown)" if self.skipped == _MAX_WARNINGS else ""
            warnings.warn(f"skipping a bad training record: {err}{tail}", DataWarning, stacklevel=3)
        if self._bad_run >= self.host_records():
            raise self._all_bad(err)


def make_batch(examples: list[Example], num_anchors: int, seed: int) -> dict[str, np.ndarray]:
    """Stack examples and draw their anchors: tokens i32[B, T], loss_mask, anchors i32[B, N], anchor_valid."""
    tokens = np.stack([e.tokens for e in examples])
    loss_mask = np.stack([e.loss_mask for e in examples])
    anchors, valid = sample_anchors(loss_mask, num_anchors, [[seed, e.epoch, e.record] for e in examples])
    return {"tokens": tokens, "loss_mask": loss_mask, "anchors": anchors, "anchor_valid": valid}


class Batches:
    """Host-local training batches [grad_accum, per_host_batch, ...] from a `JsonlStream`."""

    def __init__(self, stream: JsonlStream, per_host_batch: int, grad_accum: int = 1):
        self.stream, self.per_host_batch, self.grad_accum = stream, per_host_batch, grad_accum

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        micro = []
        for _ in range(self.grad_accum):
            ex = [next(self.stream) for _ in range(self.per_host_batch)]
            micro.append(make_batch(ex, self.stream.cfg.anchors_per_seq, self.stream.cfg.seed))
        return {k: np.stack([m[k] for m in micro]) for k in micro[0]}

    def state(self) -> dict:
        return self.stream.state()

    def restore(self, state: dict) -> None:
        self.stream.restore(state)
