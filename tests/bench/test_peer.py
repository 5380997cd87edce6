"""The transformers peer of `dspark bench decode` (dspark_jax.bench.peer): the converted HF model computes our
backbone's logits, and its batched, left-padded greedy decode is our own plain greedy decode row by row."""

import functools
import importlib.metadata
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import CONFIGS
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Config
from dspark_jax.bench import peer

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

PROMPTS = [[17, 3, 250, 9, 101], [4, 77, 310, 12, 5, 500, 42, 8, 200, 63, 1]]  # different lengths: left padding
NEW = 8
MAX_LEN = 32  # one cache shape for every prompt


def _perturbed(bb, params, seed):
    """init_params(key(0)), with norm scales drawn around 1 (init sets them all to 1) so that a swapped
    q_norm / k_norm or layer-norm mapping shows in the logits."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.asarray(1 + 0.2 * rng.standard_normal(a.shape), a.dtype)
        if "scale" in jax.tree_util.keystr(path) else a, params)


@functools.lru_cache(maxsize=None)
def _build(tied):
    cfg = Qwen3Config.from_hf_json(CONFIGS / "tiny_qwen3_backbone.json", tie_word_embeddings=tied)
    bb = Qwen3Backbone(cfg)
    params = _perturbed(bb, bb.init_params(jax.random.key(0)), seed=1)
    return bb, jax.jit(bb.forward), params, peer.to_transformers(bb, params)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model(request):
    return _build(request.param)


def _our_greedy(bb, fwd, params, prompt, n):
    """Plain greedy decode through forward + commit (batch 1, as in backbones/base.py's usage). The prompt
    goes in one token per call too, so that one compiled program (T = 1) does all of it."""
    cache = bb.init_cache(1, MAX_LEN)
    feed, tokens = list(prompt), []
    while len(tokens) < n:
        out = fwd(params, cache, jnp.asarray([[feed.pop(0)]], jnp.int32))
        cache = bb.commit(out.cache, jnp.ones((1,), jnp.int32))
        if not feed:  # the whole prompt is in: this token's logits pick the next token, fed back next call
            tokens.append(int(jnp.argmax(out.logits[0, -1])))
            feed.append(tokens[-1])
    return tokens


def test_available():
    assert peer.available() is None


def test_the_repository_root_first_on_the_path_is_named_not_a_traceback(monkeypatch):
    """`python -m ...` from the repository root puts its kernels/ folder (our Pallas kernels) in front
    of the `kernels` distribution transformers >= 5 imports; available() names the folder."""
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("no `kernels` distribution installed: nothing can be hidden")
    root = Path(__file__).resolve().parents[2]
    monkeypatch.delitem(sys.modules, "kernels", raising=False)  # find_spec answers from here first
    monkeypatch.syspath_prepend(str(root))
    assert peer.shadowed_kernels_package() == str(root / "kernels")
    assert str(root / "kernels") in peer.available()
    monkeypatch.undo()
    assert peer.shadowed_kernels_package() is None


def test_logits_match_our_forward(model):
    bb, fwd, params, hf = model
    assert not hf.training and next(hf.parameters()).dtype == torch.float32
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == bb.cfg.tie_word_embeddings
    seq = np.random.default_rng(0).integers(0, bb.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        ref = hf(torch.tensor(seq)).logits.numpy()
    ours = np.asarray(fwd(params, bb.init_cache(2, 12), jnp.asarray(seq, jnp.int32)).logits)
    np.testing.assert_allclose(ref, ours, atol=1e-4, rtol=0)


def test_greedy_generate_matches_our_plain_greedy_decode():
    bb, fwd, params, hf = _build(True)  # the untied head is covered by the logits test
    got, seconds = peer.greedy_generate(hf, PROMPTS, NEW, threads=1)
    assert seconds > 0 and [len(r) for r in got] == [NEW, NEW]
    want = [_our_greedy(bb, fwd, params, p, NEW) for p in PROMPTS]
    assert got == want
    assert len({t for row in want for t in row}) > 4  # not a degenerate repeat-one-token model
    # each row of the left-padded batch is what the prompt gives alone
    assert [peer.greedy_generate(hf, [p], NEW, threads=1)[0][0] for p in PROMPTS] == got


def test_conversion_is_strict():
    bb, _, params, hf = _build(True)
    cfg = bb.cfg
    bad = jax.tree.map(lambda a: a, params)
    bad["layers"]["k_proj"]["kernel"] = bad["layers"]["k_proj"]["kernel"][..., :-1]
    with pytest.raises(ValueError, match="k_proj"):
        peer.to_transformers(bb, bad)
    missing = {k: v for k, v in params.items() if k != "norm"}
    with pytest.raises(ValueError, match="tree"):
        peer.to_transformers(bb, missing)
    with pytest.raises(ValueError, match="dtype"):
        peer.to_transformers(bb, params, dtype="float16")
    with pytest.raises(ValueError, match="token ids"):
        peer.greedy_generate(hf, [[cfg.vocab_size]], 2)


def test_hf_tensor_table_covers_every_hf_parameter():
    transformers = pytest.importorskip("transformers")
    for tied in (True, False):
        cfg = Qwen3Config.from_hf_json(CONFIGS / "tiny_qwen3_backbone.json", tie_word_embeddings=tied)
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**peer.hf_config_dict(cfg)))
        want = {n: tuple(p.shape) for n, p in hf.named_parameters()}
        assert {n: s for n, _, s, _ in peer.hf_tensor_table(cfg)} == want


@pytest.mark.slow
def test_compiled_greedy_generate_matches_eager():
    _, _, _, hf = _build(True)
    eager, _ = peer.greedy_generate(hf, PROMPTS, NEW, threads=1)
    compiled, seconds = peer.greedy_generate(hf, PROMPTS, NEW, compiled=True, threads=1)
    assert compiled == eager and seconds > 0
