#!/usr/bin/env python
"""Train the default model's byte-level BPE tokenizer (`tokenizers`) on the training split of the corpus.

    python scripts/train_tokenizer.py --corpus build/default_model/corpus --vocab 4096 \
        --out dspark_jax/assets/default/tokenizer.json

Special tokens (fixed ids, first in the vocabulary): 0 `<|endoftext|>` (document separator),
1 `<|noise|>` (the DSpark draft's noise token, `noise_token_id`). Byte-level, so any text round-trips.
Then tokenizes both splits into flat uint16 token streams (`train.bin`, `heldout.bin`, documents joined
by `<|endoftext|>`) next to the corpus, for the backbone and draft trainers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

SPECIALS = ["<|endoftext|>", "<|noise|>"]


def iter_texts(path: Path):
    with open(path) as f:
        for line in f:
            yield json.loads(line)["text"]


def main(argv=None) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="build/default_model/corpus")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--out", default="build/default_model/tokenizer.json")
    args = ap.parse_args(argv)
    corpus = Path(args.corpus)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, special_tokens=SPECIALS, show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(iter_texts(corpus / "train.jsonl"), trainer=trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    print(f"tokenizer: vocab {tok.get_vocab_size()} -> {args.out}")

    eot = tok.token_to_id("<|endoftext|>")
    for split in ("train", "heldout"):
        texts = list(iter_texts(corpus / f"{split}.jsonl"))
        ids: list[np.ndarray] = []
        batch = 64
        for i in tqdm(range(0, len(texts), batch), desc=f"tokenize {split}", unit="batch"):
            for enc in tok.encode_batch(texts[i:i + batch]):
                ids.append(np.asarray(enc.ids + [eot], np.uint16))
        flat = np.concatenate(ids)
        flat.tofile(corpus / f"{split}.bin")
        nbytes = sum(len(t.encode()) for t in texts)
        print(f"{split}: {len(texts)} files, {flat.size} tokens ({nbytes / flat.size:.2f} bytes/token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
