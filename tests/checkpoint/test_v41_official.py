"""V4.1 checkpoints in the OFFICIAL layout (SPEC 3), written by the independent `official_writer`, load
strictly and exactly; other scale spellings are named errors; `ffn.gate.bias_vl` follows `cfg.vision`;
export -> load -> export is byte-identical.

Expected values come from the writer's own codes (decoded in float64 by the writer), and our tree is
spelled out from docs/params.md (`helpers.checkpoint.expected_tree`), so neither the V4.1 table nor
`checkpoint.formats` is its own oracle.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers import CONFIGS
from helpers.checkpoint import expected_tree  # docs/params.md spelled out once, for both test files
from helpers.official_writer import (
    dequantize_official, official_v41_tensors, quantize_fp8_block32, write_safetensors, write_sharded,
)

from dspark_jax.checkpoint import v41
from dspark_jax.checkpoint.safetensors_io import CheckpointError, open_checkpoint
from dspark_jax.checkpoint.trees import unflatten_paths
from dspark_jax.drafts.v41.config import DSparkConfig

TINY = DSparkConfig.from_json(CONFIGS / "tiny_v41.json")
BACKBONE = {"layers.0.attn.wq_a.weight": np.zeros((4, 4), ml_dtypes.bfloat16),  # ignored by the loader
            "layers.0.attn.wq_a.scale": np.full((1, 1), 127, np.uint8).view(ml_dtypes.float8_e8m0fnu)}


def cfg_for(vision: bool) -> DSparkConfig:
    return TINY.replace(vision=vision)


def flat(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        out.update(flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
    return out


def official(tmp_path: Path, fmt="fp8", vision=False, fp4_dtype="I8", seed=0, edit=None, shards=3) -> dict:
    """Write a tiny official checkpoint (sharded, with backbone tensors); `edit(tensors)` may alter it."""
    tensors = official_v41_tensors(TINY, np.random.default_rng(seed), fmt=fmt, vision=vision, fp4_dtype=fp4_dtype)
    ref = dequantize_official(tensors)
    tensors.update(BACKBONE)
    if edit:
        edit(tensors)
    write_sharded(tmp_path, tensors, shards, metadata={"format": "pt"})
    return ref


# ---------------------------------------------------------------------------------------------
# Official checkpoints load exactly
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,fp4_dtype,vision", [("fp8", "I8", False), ("fp8", "F4", True),
                                                  ("bf16", "I8", False), ("bf16", "I8", True)])
def test_official_checkpoint_loads_exactly(tmp_path, fmt, fp4_dtype, vision):
    cfg = cfg_for(vision)
    ref = official(tmp_path, fmt, vision, fp4_dtype)
    r = open_checkpoint(tmp_path)
    if fmt == "fp8":  # the writer really used the official names and storage
        assert r.info("mtp.0.main_proj.scale").dtype == "F8_E8M0" and "mtp.0.main_proj.weight.scale" not in r
        assert r.info("mtp.1.ffn.experts.7.w1.weight").dtype == fp4_dtype
    params, tied = v41.load_v41_draft(tmp_path, cfg, dtype="float32")
    got, want = flat(params), expected_tree(ref, cfg)
    assert set(got) == set(want)
    for p, x in want.items():
        # decoding fp8 / fp4 / bf16 is exact in float32: any difference is a loader bug
        assert got[p].dtype == np.float32 and got[p].shape == x.shape, p
        assert np.array_equal(got[p], x), p
    assert np.array_equal(tied["embed"], ref["embed.weight"]) and np.array_equal(tied["head"], ref["head.weight"])


def test_official_fp8_streams_to_bf16_and_back_with_the_same_values(tmp_path):
    ref = official(tmp_path / "src", vision=True)
    cfg = cfg_for(True)
    v41.convert_v41_safetensors(tmp_path / "src", cfg, tmp_path / "bf16", fmt="bf16")
    v41.convert_v41_safetensors(tmp_path / "bf16", cfg, tmp_path / "fp8", fmt="fp8", fp4_dtype="F4")
    want = expected_tree(ref, cfg)
    for d in ("bf16", "fp8"):
        got = flat(v41.load_v41_draft(tmp_path / d, cfg, dtype="float32")[0])
        for p, x in want.items():
            assert np.array_equal(got[p], x), (d, p)
    r = open_checkpoint(tmp_path / "fp8")
    assert "mtp.0.attn.wq_b.scale" in r and "mtp.1.ffn.experts.0.w2.scale" in r
    assert not [n for n in r.names if n.endswith(".weight.scale")]


# ---------------------------------------------------------------------------------------------
# Other scale conventions are named
# ---------------------------------------------------------------------------------------------
def _rename(old: str, new: str):
    def edit(t):
        t[new] = t.pop(old)
    return edit


@pytest.mark.parametrize("found,expected", [
    ("mtp.0.main_proj.weight.scale", "mtp.0.main_proj.scale"),  # dspark_jax before issue 13
    ("mtp.1.attn.wq_a.weight_scale_inv", "mtp.1.attn.wq_a.scale"),  # Hugging Face fp8 spelling
    ("mtp.1.ffn.experts.7.w1.weight.scale", "mtp.1.ffn.experts.7.w1.scale"),
    ("mtp.1.ffn.shared_experts.w2.weight_scale", "mtp.1.ffn.shared_experts.w2.scale"),  # compressed-tensors
])
def test_foreign_scale_names_are_errors_naming_both(tmp_path, found, expected):
    official(tmp_path, edit=_rename(expected, found))
    with pytest.raises(CheckpointError, match=rf"tensor '{found}' found where the official layout has "
                                              rf"'{expected}' \(the scale of an F8_E4M3"):
        v41.load_v41_draft(tmp_path, TINY, dtype="float32")


def test_foreign_scale_beside_the_official_one_is_an_error(tmp_path):
    def edit(t):  # both spellings: still ambiguous, still named
        t["mtp.0.attn.wkv.weight.scale"] = t["mtp.0.attn.wkv.scale"]
    official(tmp_path, edit=edit)
    with pytest.raises(CheckpointError, match=r"'mtp\.0\.attn\.wkv\.weight\.scale' found where the official "
                                              r"layout has 'mtp\.0\.attn\.wkv\.scale'"):
        v41.load_v41_draft(tmp_path, TINY, dtype="float32")


def test_whole_checkpoint_in_the_old_convention_is_an_error(tmp_path):
    def edit(t):
        for n in [n for n in t if n.startswith("mtp.") and n.endswith(".scale")]:
            t[n[: -len(".scale")] + ".weight.scale"] = t.pop(n)
    official(tmp_path, edit=edit)
    with pytest.raises(CheckpointError, match=r"tensor 'mtp\.\d\.[\w.]+\.weight\.scale' found where the official "
                                              r"layout has 'mtp\.\d\.[\w.]+(?<!weight)\.scale'"):
        v41.load_v41_draft(tmp_path, TINY, dtype="float32")


# ---------------------------------------------------------------------------------------------
# bias_vl exactly with vision
# ---------------------------------------------------------------------------------------------
def test_bias_vl_present_exactly_with_vision(tmp_path):
    official(tmp_path / "vis", vision=True)
    official(tmp_path / "txt", vision=False)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\).*'mtp\.0\.ffn\.gate\.bias_vl'.*vision tower"):
        v41.load_v41_draft(tmp_path / "vis", cfg_for(False), dtype="float32")
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.0\.ffn\.gate\.bias_vl'.*vision tower"):
        v41.load_v41_draft(tmp_path / "txt", cfg_for(True), dtype="float32")
    for vision in (False, True):
        params, tied = v41.load_v41_draft(tmp_path / ("vis" if vision else "txt"), cfg_for(vision), dtype="float32")
        assert ("bias_vl" in params["blocks_1"]["ffn"]["gate"]) == vision
        out = tmp_path / f"out_{vision}"
        v41.export_v41_draft(params, tied, cfg_for(vision), out, fmt="fp8")
        names = open_checkpoint(out).names
        assert sorted(n for n in names if "bias_vl" in n) == (
            [f"mtp.{s}.ffn.gate.bias_vl" for s in range(TINY.n_layers)] if vision else [])
    # a tree and a config that disagree about vision do not export
    with pytest.raises(CheckpointError, match=r"unexpected \[.*blocks_0/ffn/gate/bias_vl"):
        v41.export_v41_draft(params, None, cfg_for(False), tmp_path / "bad", fmt="bf16")


# ---------------------------------------------------------------------------------------------
# Export -> load -> export is byte-identical
# ---------------------------------------------------------------------------------------------
def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("fmt,fp4_dtype", [("bf16", "I8"), ("fp8", "I8"), ("fp8", "F4")])
def test_export_load_export_is_byte_identical(tmp_path, fmt, fp4_dtype):
    cfg = cfg_for(fmt == "fp8" and fp4_dtype == "F4")
    official(tmp_path / "src", fmt="bf16", vision=cfg.vision)
    params, tied = v41.load_v41_draft(tmp_path / "src", cfg, dtype="float32")
    rng = np.random.default_rng(1)
    # off every grid, so the first export really rounds (and hits blocks whose max rounds to half the
    # format maximum, where the encoder's choice of scale matters)
    params = {"/".join(p): (x * (1 + 0.01 * rng.standard_normal(x.shape))).astype(np.float32)
              for p, x in flat(params).items()}
    params = unflatten_paths({tuple(k.split("/")): v for k, v in params.items()})
    v41.export_v41_draft(params, tied, cfg, tmp_path / "a", fmt=fmt, fp4_dtype=fp4_dtype, max_shard_bytes=60_000)
    back, back_tied = v41.load_v41_draft(tmp_path / "a", cfg, dtype="float32")
    v41.export_v41_draft(back, back_tied, cfg, tmp_path / "b", fmt=fmt, fp4_dtype=fp4_dtype, max_shard_bytes=60_000)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert len(a) > 2 and set(a) == set(b)
    for name in a:
        assert a[name] == b[name], name
    # and the streaming converter writes the same bytes from the exported files
    v41.convert_v41_safetensors(tmp_path / "a", cfg, tmp_path / "c", fmt=fmt, fp4_dtype=fp4_dtype,
                                max_shard_bytes=60_000)
    assert _files(tmp_path / "c") == a


# ---------------------------------------------------------------------------------------------
# The writer itself (so the other tests rest on a checked oracle)
# ---------------------------------------------------------------------------------------------
def test_writer_files_read_back_with_the_safetensors_package(tmp_path):
    from safetensors import safe_open

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    q, s = quantize_fp8_block32(np.linspace(-3, 3, 64 * 40).reshape(64, 40))
    write_safetensors(tmp_path / "w.safetensors", {"x": x, "q": q, "q_s": s}, {"k": "v"}, order="sorted")
    with safe_open(tmp_path / "w.safetensors", framework="numpy") as f:
        assert f.metadata() == {"k": "v"} and np.array_equal(f.get_tensor("x"), x)
        assert (f.get_slice("q").get_dtype(), f.get_slice("q").get_shape()) == ("F8_E4M3", [64, 40])
        assert (f.get_slice("q_s").get_dtype(), f.get_slice("q_s").get_shape()) == ("F8_E8M0", [2, 2])
    raw = (tmp_path / "w.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert [k for k in header if k != "__metadata__"] == ["q", "q_s", "x"]
    # SPEC 3: every value decodes as e4m3 * 2^(byte - 127), and fits the block's power-of-two scale
    e = s.view(np.uint8).astype(int) - 127
    dec = q.astype(np.float64) * np.exp2(np.repeat(np.repeat(e, 32, 0), 32, 1)[:, :40])
    assert np.abs(dec - np.linspace(-3, 3, 64 * 40).reshape(64, 40)).max() <= 3 * 2.0 ** -4
