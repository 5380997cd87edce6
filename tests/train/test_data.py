"""The training data path (dspark_jax.train.data): token and text records, loss masks and spans, bad lines,
seeded shuffles, host partitions and seeking."""

import json

import numpy as np
import pytest
from helpers.train import DATA

from dspark_jax.train import data as D


def _stream(tmp_path, lines, **kw):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cfg = D.DataConfig(train=(str(path),), **{"seq_len": 8, "shuffle_buffer": 4, **kw})
    return D.JsonlStream(cfg, process_index=0, process_count=1)


def test_token_records_fixed_length_and_masks(tmp_path):
    s = _stream(tmp_path, [{"tokens": [5, 6, 7], "loss_mask": [0, 1, 1]},
                           {"tokens": list(range(1, 13))}], shuffle_buffer=1)
    got = {e.record: e for e in (next(s), next(s))}
    np.testing.assert_array_equal(got[0].tokens, [5, 6, 7, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(got[0].loss_mask, [0, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(got[1].tokens, np.arange(1, 9))  # truncated
    assert got[1].loss_mask.all()
    with pytest.raises(D.DataError, match="line 1.*loss_mask"):
        next(_stream(tmp_path, [{"tokens": [1, 2], "loss_mask": [1]}]))
    with pytest.raises(D.DataError, match="needs a tokenizer"):
        next(_stream(tmp_path, [{"text": "hi"}]))
    with pytest.raises(D.DataError, match="outside the vocabulary"):
        s = _stream(tmp_path, [{"tokens": [1, 600]}])
        s.vocab_size = 512
        next(s)


def test_a_bad_training_line_is_skipped_with_a_warning_naming_it(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"tokens": [1, 2]}\n{"tokens": [3, "\xff"]}\nnot json\n{"tokens": [1, -4]}\n{"tokens": [5, 6]}\n')
    s = D.JsonlStream(D.DataConfig(train=(str(path),), seq_len=4, shuffle_buffer=1), process_index=0, process_count=1)
    with pytest.warns(D.DataWarning) as caught:
        got = [next(s).tokens[:2].tolist() for _ in range(4)]
    assert got == [[1, 2], [5, 6], [1, 2], [5, 6]]  # two epochs of the good lines, in file order
    said = [str(w.message) for w in caught]
    assert any(f"{path} line 2: not UTF-8" in m for m in said) and any("line 3: not valid JSON" in m for m in said)
    assert any("line 4: 'tokens' must be a list of non-negative integers" in m for m in said)
    assert s.skipped == 6


def test_text_records_with_loss_spans(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "user": 1, ":": 2, "hi": 3, "bot": 4, "hello": 5, "there": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_path = tmp_path / "tok.json"
    tok.save(str(tok_path))
    text = "user: hi bot: hello there"
    start = text.index("hello")
    s = _stream(tmp_path, [{"text": text, "loss_spans": [[start, len(text)]]}], tokenizer=str(tok_path))
    e = next(s)
    # WhitespaceSplit keeps "user:" whole -> [UNK]; tokens: user: hi bot: hello there
    np.testing.assert_array_equal(e.tokens[:5], [0, 3, 0, 5, 6])
    np.testing.assert_array_equal(e.loss_mask[:5], [0, 0, 0, 1, 1])
    assert not e.loss_mask[5:].any()


def test_shuffle_is_seeded_and_hosts_partition_the_records(tmp_path):
    lines = [{"tokens": [i + 1, i + 2]} for i in range(30)]
    first_epoch = lambda s: [next(s).record for _ in range(30)]  # noqa: E731
    a = first_epoch(_stream(tmp_path, lines, seed=1))
    assert sorted(a) == list(range(30)) and a != list(range(30))
    assert first_epoch(_stream(tmp_path, lines, seed=1)) == a
    assert first_epoch(_stream(tmp_path, lines, seed=2)) != a
    path = tmp_path / "d.jsonl"
    cfg = D.DataConfig(train=(str(path),), seq_len=4, shuffle_buffer=8, seed=1)
    hosts = [D.JsonlStream(cfg, process_index=p, process_count=3) for p in range(3)]
    seen = [sorted(next(h).record for _ in range(10)) for h in hosts]
    assert sorted(sum(seen, [])) == list(range(30))
    assert all(all(r % 3 == p for r in rec) for p, rec in enumerate(seen))


def test_seek_continues_exactly_like_an_uninterrupted_stream():
    cfg = D.DataConfig(train=(str(DATA),), seq_len=48, shuffle_buffer=16, seed=3, anchors_per_seq=4)
    one = D.Batches(D.JsonlStream(cfg, process_index=1, process_count=2), per_host_batch=5)
    seq = [next(one) for _ in range(7)]  # 35 examples: crosses the 24-record epoch of this host
    two = D.Batches(D.JsonlStream(cfg, process_index=1, process_count=2), per_host_batch=5)
    two.stream.seek(4 * 5)
    for want in seq[4:]:
        got = next(two)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
