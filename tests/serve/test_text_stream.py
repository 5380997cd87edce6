"""TextStream (serve/openai_api.py), the streamed text of a completion: its deltas joined equal the decode of
all its tokens, also where byte-level tokens split a character, or form no valid UTF-8 at all (issue 44:
"stream = non-stream"; that the streamed and the non-streamed request get the same TOKENS is the sampling's
part, tests/serve/test_http.py). On the embedded default's byte-level BPE tokenizer; the default model's own
sampled output is checked in tests/test_assets.py."""

import numpy as np
import pytest

from dspark_jax import assets
from dspark_jax.serve.openai_api import TextStream

DEFAULT = assets.default_bundle_path()
pytestmark = pytest.mark.skipif(DEFAULT is None, reason="embedded default model not present")


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEFAULT / "tokenizer.json"))


def _byte_alphabet() -> dict[int, str]:
    """Byte -> the character byte-level BPE writes it as (printable bytes as themselves, the rest shifted
    past 255), the mapping the ByteLevel pre-tokenizer and decoder share."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = {b: chr(b) for b in kept}
    shifted = (b for b in range(256) if b not in chars)
    chars.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return chars


def streamed(tokenizer, ids, chunk: int = 1) -> tuple[str, int]:
    """The text a stream sends for `ids` pushed `chunk` tokens at a time, and how many pushes sent nothing."""
    stream, parts = TextStream(tokenizer, []), []
    for i in range(0, len(ids), chunk):
        parts.append(stream.push(list(ids[i:i + chunk])))
    parts.append(stream.push([], final=True))
    return "".join(parts), sum(p == "" for p in parts[:-1])


def test_characters_split_across_single_byte_tokens(tokenizer):
    alphabet = _byte_alphabet()
    text = "def f():  # é, ß, €, 中文, 😀 — ok\n"
    ids = [tokenizer.token_to_id(alphabet[b]) for b in text.encode()]
    assert None not in ids  # every byte has its own token in a byte-level vocabulary
    assert tokenizer.decode(ids) == text
    for chunk in (1, 2, 3):
        got, held = streamed(tokenizer, ids, chunk)
        assert got == text, chunk
        if chunk == 1:
            assert held >= 9  # the pushes that ended inside a multi-byte character sent nothing


def test_random_token_sequences_stream_to_their_whole_decode(tokenizer):
    """Random ids over the whole vocabulary (the single-byte tokens made common): split characters, invalid
    bytes (decoded as U+FFFD) and their mixtures, pushed one or several tokens at a time."""
    rng = np.random.default_rng(0)
    alphabet = _byte_alphabet()
    byte_ids = np.array([tokenizer.token_to_id(alphabet[b]) for b in range(128, 256)])
    vocab = tokenizer.get_vocab_size()
    split = 0
    for i in range(300):
        ids = np.where(rng.random(40) < 0.5, rng.choice(byte_ids, 40), rng.integers(0, vocab, 40)).tolist()
        whole = tokenizer.decode(ids)
        got, held = streamed(tokenizer, ids, chunk=1 + i % 3)
        assert got == whole, ids
        split += held > 0
    assert split > 100  # most sequences held text back at least once
