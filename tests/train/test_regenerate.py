"""`dspark regenerate`: on-policy training data from the backbone, resumable and deterministic by seed."""

import json

import numpy as np
import pytest

from helpers import CONFIGS
from dspark_jax.bundle import random_bundle
from dspark_jax.serve.engine import Engine, EngineConfig, Request
from dspark_jax.train.data import DataConfig, DataError, JsonlStream
from dspark_jax.train.regenerate import (RegenConfig, load_documents, prompt_windows, regenerate, request_seed)

CFG = RegenConfig(num_prompts=6, prompt_len=5, max_new_tokens=7, temperatures=(0.0, 1.0), seed=3, slots=4)


@pytest.fixture(scope="module")
def bundle():
    return random_bundle(CONFIGS / "tiny_mhc_backbone.json", CONFIGS / "tiny_v41.json")


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory, bundle):
    rng = np.random.default_rng(0)
    vocab = bundle.model.backbone.vocab_size
    path = tmp_path_factory.mktemp("regen") / "train.jsonl"
    lens = [3, 12, 20, 9, 30]  # the 3-token record is too short for a 5-token prompt + 1
    path.write_text("".join(json.dumps({"tokens": rng.integers(2, vocab, n).tolist()}) + "\n" for n in lens))
    return path


@pytest.fixture(scope="module")
def prompts(docs_file):
    return prompt_windows(load_documents([str(docs_file)]), CFG)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, bundle, prompts):
    out = tmp_path_factory.mktemp("full") / "regen.jsonl"
    stats = regenerate(bundle.model, bundle.weights, prompts, out, CFG, progress=False)
    return out, stats


def test_prompts_are_seeded_windows_of_long_enough_records(docs_file, prompts):
    docs = load_documents([str(docs_file)])
    assert len(prompts) == CFG.num_prompts and all(len(p) == CFG.prompt_len for p in prompts)
    joined = [" ".join(map(str, d)) for d in docs if len(d) > CFG.prompt_len]
    assert all(any(" ".join(map(str, p)) in d for d in joined) for p in prompts)
    assert prompt_windows(docs, CFG) == prompts
    assert prompt_windows(docs, RegenConfig(**{**CFG.fingerprint(), "seed": 4})) != prompts
    with pytest.raises(DataError, match="prompt-len"):
        prompt_windows(docs, RegenConfig(num_prompts=2, prompt_len=40))


def test_lines_are_training_records_with_the_loss_on_the_continuation(full_run, prompts):
    out, stats = full_run
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in recs] == list(range(CFG.num_prompts)) and stats["done"] == CFG.num_prompts
    for i, r in enumerate(recs):
        assert r["temperature"] == CFG.temperatures[i % 2] and r["seed"] == request_seed(CFG.seed, i)
        assert r["tokens"][:CFG.prompt_len] == prompts[i] and len(r["tokens"]) == CFG.prompt_len + 7
        assert r["loss_mask"] == [0] * CFG.prompt_len + [1] * 7
    # The draft trainer reads the file as it is: the prompt is context, never a target.
    ex = next(iter(JsonlStream(DataConfig(train=(str(out),), seq_len=16, shuffle_buffer=1, anchors_per_seq=2))))
    assert not ex.loss_mask[:CFG.prompt_len].any() and ex.loss_mask[CFG.prompt_len:12].all()


def test_continuations_are_the_backbones_own(full_run, bundle, prompts):
    """Greedy lines equal plain decoding of the prompt; sampled lines equal the engine's seeded sample."""
    out, _ = full_run
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    engine = Engine(bundle.model, bundle.weights, EngineConfig(max_slots=2, max_len=24, mode="plain", progress=False))
    reqs = [Request(prompts[i], max_tokens=7, temperature=r["temperature"], seed=r["seed"]) for i, r in enumerate(recs)]
    got = engine.generate(reqs)
    assert [g.tokens for g in got] == [r["tokens"][CFG.prompt_len:] for r in recs]


@pytest.mark.slow  # 20-65 s: in the CI's slow step, to keep the default suite near 20 min
def test_speculative_mode_gives_the_same_greedy_data(tmp_path, bundle, prompts, full_run):
    cfg = RegenConfig(**{**CFG.fingerprint(), "mode": "fixed", "slots": 3})
    out = tmp_path / "spec.jsonl"
    regenerate(bundle.model, bundle.weights, prompts, out, cfg, progress=False)
    greedy = lambda p: [line for line in p.read_text().splitlines() if '"temperature": 0.0' in line]  # noqa: E731
    assert greedy(out) == greedy(full_run[0]) and len(greedy(out)) == 3


def test_an_interrupted_run_resumes_to_the_same_bytes(tmp_path, bundle, prompts, full_run):
    full = full_run[0].read_bytes()
    lines = full.splitlines(keepends=True)
    out = tmp_path / "regen.jsonl"
    out.write_bytes(lines[4] + lines[1] + lines[2][:17])  # two finished (out of order) and a torn one
    (tmp_path / "regen.jsonl.regen.json").write_text(json.dumps(CFG.fingerprint()))
    stats = regenerate(bundle.model, bundle.weights, prompts, out, CFG, progress=False)
    assert stats["served"] == CFG.num_prompts - 2 and out.read_bytes() == full
    again = regenerate(bundle.model, bundle.weights, prompts, out, CFG, progress=False)
    assert again["served"] == 0 and out.read_bytes() == full


def test_resuming_with_other_settings_is_an_error(tmp_path, bundle, prompts, full_run):
    out = tmp_path / "regen.jsonl"
    regenerate(bundle.model, bundle.weights, prompts, out, CFG, progress=False)
    other = RegenConfig(**{**CFG.fingerprint(), "max_new_tokens": 8})
    with pytest.raises(DataError, match="max_new_tokens"):
        regenerate(bundle.model, bundle.weights, prompts, out, other, progress=False)
    stray = tmp_path / "mine.jsonl"
    stray.write_text('{"tokens": [1, 2]}\n')
    with pytest.raises(DataError, match="not a file this command wrote"):
        regenerate(bundle.model, bundle.weights, prompts, stray, CFG, progress=False)
    assert stray.read_text() == '{"tokens": [1, 2]}\n'


@pytest.mark.parametrize("field,value,match", [("num_prompts", 0, "num_prompts"), ("temperatures", (), "temperatures"),
                                               ("temperatures", (float("nan"),), "temperatures"),
                                               ("mode", "fast", "mode"), ("prompt_len", 2.5, "prompt_len"),
                                               ("top_k", -1, "top_k"), ("top_p", 0.0, "top_p"),
                                               ("top_p", float("nan"), "top_p")])
def test_bad_settings_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        RegenConfig(**{field: value})


def test_cli_writes_the_file_and_names_bad_arguments(tmp_path, docs_file, capsys):
    from dspark_jax.cli import main

    out = tmp_path / "cli.jsonl"
    args = ["regenerate", "--random-tiny", "--data", str(docs_file), "--out", str(out), "--num-prompts", "3",
            "--prompt-len", "4", "--max-tokens", "3", "--slots", "2", "--no-progress"]
    assert main(args) == 0
    assert len(out.read_text().splitlines()) == 3
    assert main([*args[:-1], "--temperatures", "0,hot"]) == 2
    assert "--temperatures" in capsys.readouterr().err
    assert main([*args, "--prompt-len", "64"]) == 2
    assert "prompt-len" in capsys.readouterr().err


@pytest.mark.slow  # 20-65 s: in the CI's slow step, to keep the default suite near 20 min
def test_cli_takes_the_backbone_from_a_training_run_config(tmp_path, docs_file):
    """--train-config: data before any draft exists (the build script's path), from the run's frozen
    backbone (here a random init of its own); the prompts depend only on the data and the seed. The run's
    own data.train is the file being written, so it does not exist yet (the build failed on that once)."""
    import yaml

    from dspark_jax.cli import main

    common = ["--data", str(docs_file), "--num-prompts", "2", "--prompt-len", "4", "--max-tokens", "3",
              "--temperatures", "0", "--slots", "2", "--no-progress"]
    a, b = tmp_path / "run.jsonl", tmp_path / "bundle.jsonl"
    raw = yaml.safe_load((CONFIGS / "train_tiny.yaml").read_text())
    for section, key in (("backbone", "config"), ("draft", "config")):
        raw[section][key] = str(CONFIGS / raw[section][key])
    raw["data"]["train"] = [str(a)]
    run_config = tmp_path / "run.yaml"
    run_config.write_text(yaml.safe_dump(raw))
    assert main(["regenerate", "--train-config", str(run_config), "--out", str(a), *common]) == 0
    assert main(["regenerate", "--random-tiny", "--out", str(b), *common]) == 0
    ra, rb = ([json.loads(x)["tokens"] for x in p.read_text().splitlines()] for p in (a, b))
    assert len(ra) == 2 and all(len(t) == 7 for t in ra)
    assert [t[:4] for t in ra] == [t[:4] for t in rb]


@pytest.mark.parametrize("bad, match", [(99999, "token 99999 (entry 1 of 'tokens') outside the vocabulary [0, {v})"),
                                        (-3, "token -3 (entry 1 of 'tokens') outside the vocabulary [0, {v})"),
                                        ("<eos>", "token '<eos>' (entry 1 of 'tokens') is not a token id")])
def test_cli_names_file_and_line_of_a_token_outside_the_vocabulary(tmp_path, bundle, capsys, bad, match):
    from dspark_jax.cli import main

    vocab = bundle.model.backbone.vocab_size
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"tokens": list(range(2, 12))}) + "\n\n" + json.dumps({"tokens": [2, bad, 3]}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["regenerate", "--random-tiny", "--data", str(data), "--out", str(out), "--num-prompts", "2",
                 "--prompt-len", "4", "--max-tokens", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{data} line 3: " + match.format(v=vocab) in err and "Traceback" not in err
    assert not out.exists()
    with pytest.raises(DataError, match="line 3"):  # the library call too, given the vocabulary
        load_documents([str(data)], vocab_size=vocab)
