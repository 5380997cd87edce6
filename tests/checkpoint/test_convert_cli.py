"""`dspark convert` (dspark_jax.checkpoint.convert_cli): V4.1 drafts between the official layouts, bf16 and
Orbax, and DeepSpec drafts to bf16, Orbax and a serving bundle; errors are one line and exit code 2."""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest
from helpers import CONFIGS
from helpers.checkpoint import TINY, flat
from helpers.deepspec import BCFG, released_like, write_checkpoint

from dspark_jax.backbones.qwen3 import Qwen3Backbone
from dspark_jax.checkpoint import v41
from dspark_jax.checkpoint.safetensors_io import open_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A DeepSpec-layout checkpoint folder of the tiny config -> (folder, float64 weights, raw config)."""
    return released_like(str(tmp_path_factory.mktemp("deepspec")))


# ---------------------------------------------------------------------------------------------
# dspark convert
# ---------------------------------------------------------------------------------------------
def test_convert_cli_roundtrip_and_errors(tiny_ckpt, tmp_path, capsys, monkeypatch):
    from dspark_jax.cli import main

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli.main rewrites it

    folder, _ = tiny_ckpt
    cfg_path = tmp_path / "cfg.json"
    TINY.to_json(cfg_path)
    assert main(["convert", str(folder), str(tmp_path / "ob"), "--to", "orbax", "--config", str(cfg_path),
                 "--dtype", "float32", "--quiet"]) == 0
    # config travels in the Orbax metadata; orbax -> official fp8 layout, F4-typed experts
    assert main(["convert", str(tmp_path / "ob"), str(tmp_path / "fp8"), "--to", "fp8", "--fp4-dtype", "F4",
                 "--quiet"]) == 0
    assert open_checkpoint(tmp_path / "fp8").info("mtp.0.ffn.experts.0.w1.weight").dtype == "F4"
    # the config written beside the safetensors output is found again
    assert main(["convert", str(tmp_path / "fp8"), str(tmp_path / "bf16"), "--to", "bf16", "--quiet"]) == 0
    ref, ref_tied = v41.load_v41_draft(folder, TINY, dtype="float32")
    for d in ("fp8", "bf16"):
        got, tied = v41.load_v41_draft(tmp_path / d, TINY, dtype="float32")
        for p, x in flat(ref).items():
            assert np.array_equal(x, flat(got)[p]), (d, p)
        assert np.array_equal(tied["head"], ref_tied["head"])
    capsys.readouterr()

    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "x"), "--to", "bf16",
                 "--config", str(cfg_path)]) == 2
    assert "nope: no such file or directory" in capsys.readouterr().err
    assert main(["convert", str(folder), str(tmp_path / "bf16"), "--to", "bf16", "--config", str(cfg_path)]) == 2
    assert "exists and is not empty (pass --overwrite" in capsys.readouterr().err
    assert main(["convert", str(folder), str(tmp_path / "y"), "--to", "bf16"]) == 2
    assert "no config: pass --config" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "fp8"), str(tmp_path / "fp8"), "--to", "bf16", "--overwrite"]) == 2
    assert "must not contain the input" in capsys.readouterr().err
    assert open_checkpoint(tmp_path / "fp8").info("mtp.0.ffn.experts.0.w1.weight").dtype == "F4"  # untouched
    wrong = tmp_path / "wrong.json"
    TINY.replace(n_routed_experts=4, n_activated_experts=2).to_json(wrong)
    assert main(["convert", str(folder), str(tmp_path / "z"), "--to", "fp8", "--config", str(wrong)]) == 2
    assert "tensor 'mtp.0.ffn.gate.weight': shape [8, 64], expected [4, 64]" in capsys.readouterr().err


def test_dspark_convert_deepspec_to_bf16_orbax_and_a_serving_bundle(checkpoint, tmp_path):
    """`dspark convert --family deepspec`: the DeepSpec layout again (bf16 and via Orbax), and a bundle of a
    Hugging Face Qwen3 target folder + the draft that the engine serves."""
    import ml_dtypes

    from dspark_jax.bundle import load_bundle
    from dspark_jax.checkpoint.qwen3_hf import hf_layer_map
    from dspark_jax.checkpoint.safetensors_io import save_file
    from dspark_jax.cli import main
    from dspark_jax.serve.engine import Engine, EngineConfig, Request

    folder, weights, raw = checkpoint
    assert main(["convert", str(folder), str(tmp_path / "bf16"), "--to", "bf16", "--quiet"]) == 0  # family from config
    assert main(["convert", str(folder), str(tmp_path / "orbax"), "--family", "deepspec", "--to", "orbax",
                 "--quiet"]) == 0
    assert main(["convert", str(tmp_path / "orbax"), str(tmp_path / "back"), "--to", "bf16", "--quiet"]) == 0
    for out in ("bf16", "back"):
        a, b = open_checkpoint(folder), open_checkpoint(tmp_path / out)
        assert sorted(a.names) == sorted(b.names)
        assert all(a.view(n).tobytes() == b.view(n).tobytes() for n in a.names)
    assert main(["convert", str(folder), str(tmp_path / "x"), "--to", "fp8", "--quiet"]) == 2

    # A Qwen3 target in the Hugging Face layout, and the draft trained against it (its embed/head copies).
    bb = Qwen3Backbone(BCFG)
    bp = jax.device_get(bb.init_params(jax.random.key(0)))
    target = tmp_path / "qwen3_target"
    target.mkdir()
    (target / "config.json").write_text((CONFIGS / "tiny_qwen3_backbone.json").read_text())
    hf = {"model.embed_tokens.weight": bp["embed"], "model.norm.weight": bp["norm"]["scale"]}
    for suffix, (mod, leaf), _, _ in hf_layer_map(BCFG):
        for i in range(BCFG.num_hidden_layers):
            w = np.asarray(bp["layers"][mod][leaf][i])
            hf[f"model.layers.{i}.{suffix}"] = np.ascontiguousarray(w.T) if w.ndim == 2 else w
    save_file(target / "model.safetensors", {k: np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in hf.items()})
    embed = np.asarray(np.asarray(bp["embed"]).astype(ml_dtypes.bfloat16), np.float64)  # the same bf16 values
    write_checkpoint(tmp_path / "draft", raw, {**weights, "embed_tokens.weight": embed, "lm_head.weight": embed})
    assert main(["convert", str(folder), str(tmp_path / "bad"), "--to", "bundle", "--backbone", str(target),
                 "--quiet"]) == 2  # its embed/head are not this target's
    assert main(["convert", str(tmp_path / "draft"), str(tmp_path / "bundle"), "--to", "bundle", "--backbone",
                 str(target), "--dtype", "float32", "--quiet"]) == 0
    bundle = load_bundle(tmp_path / "bundle", impl="xla")
    assert bundle.model.tap_mode == "output" and bundle.model.cfg.family == "qwen3"
    # One prefill and one round (max_tokens 2 keeps it to one compiled width: this is a plumbing check).
    res = Engine(bundle.model, bundle.weights, EngineConfig(mode="off", max_slots=2, max_len=32, progress=False)
                 ).generate([Request([5, 6, 7], max_tokens=2, id=0), Request([9], max_tokens=2, id=1)])
    assert [r.finish_reason for r in res] == ["length", "length"] and all(len(r.tokens) == 2 for r in res)


def _tree(folder):
    """Every path under `folder` with the bytes of each file."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def test_a_full_disk_midway_is_one_line_and_leaves_the_output_folder_as_it_was(tiny_ckpt, tmp_path, capsys,
                                                                                monkeypatch, full_disk):
    """Issue 40: out of disk space, `dspark convert` printed [Errno 28] naming no file and left a
    `.partial` that made the rerun refuse the folder as "not empty". Now the line names the shard and the
    reason, the folder is as it was (made by the run: removed again, parent too; old files under
    --overwrite: kept byte for byte) and the rerun succeeds."""
    from dspark_jax.cli import main

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli.main rewrites it
    folder, _ = tiny_ckpt
    cfg = tmp_path / "cfg.json"
    TINY.to_json(cfg)

    def convert(dst, *more):
        return main(["convert", str(folder), str(dst), "--to", "bf16", "--config", str(cfg), "--quiet", *more])

    small = ("--max-shard-gb", "0.00005")  # ~54 kB shards: several, so the disk fills in the middle of one
    assert convert(tmp_path / "ref", *small) == 0
    shards = sorted((tmp_path / "ref").glob("*.safetensors"))
    assert len(shards) >= 3
    room = shards[0].stat().st_size + shards[1].stat().st_size // 2  # the second shard does not fit
    capsys.readouterr()

    def fails(dst, *more):
        full_disk(room)
        assert convert(dst, *small, *more) == 2
        assert capsys.readouterr().err == (f"dspark convert: cannot write {dst / shards[1].name}: No space left on "
                                           f"device; {dst} is left as it was before this run (the partial output "
                                           "was removed)\n")
        monkeypatch.undo()  # the disk has room again
        monkeypatch.setattr(sys, "argv", list(sys.argv))

    fails(tmp_path / "new" / "out")
    assert not (tmp_path / "new").exists()
    assert convert(tmp_path / "new" / "out", *small) == 0
    assert _tree(tmp_path / "new" / "out") == _tree(tmp_path / "ref")

    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty")
    assert _tree(tmp_path / "empty") == {}

    old = tmp_path / "old"  # a one-file conversion and a file of the user's; --overwrite replaces the former
    assert convert(old) == 0
    (old / "notes.txt").write_text("mine")
    before = _tree(old)
    fails(old, "--overwrite")
    assert _tree(old) == before
    assert convert(old, *small, "--overwrite") == 0
    assert _tree(old) == {**_tree(tmp_path / "ref"), "notes.txt": b"mine"}  # the old single file is gone

    # what only SIGKILL leaves (a failed run removes its staging folder) is named, not just "not empty"
    (tmp_path / "killed" / ".dspark-convert-k3x").mkdir(parents=True)
    capsys.readouterr()
    assert convert(tmp_path / "killed") == 2
    assert capsys.readouterr().err == (f"dspark convert: {tmp_path / 'killed'} holds only .dspark-convert-k3x, the "
                                       "partial output of an interrupted dspark convert: delete it (or pass "
                                       "--overwrite)\n")
