"""`dspark bench roofline` (issue 38): the analytic minima are the formulas the issue states, a routed MoE
compiles to its minimum flops while the all-experts one does E/k times them, and the CLI prints the table."""

import math

import jax
import jax.numpy as jnp
import pytest

from helpers import CONFIGS
from dspark_jax.bench import roofline
from dspark_jax.cli import main
from dspark_jax.drafts.v41.config import DSparkConfig
from dspark_jax.errors import UserError

S = jax.ShapeDtypeStruct


def test_moe_minimum_is_gate_shared_and_k_experts_per_token():
    d, i, e, k, n = 8, 4, 16, 2, 3
    params = {"gate": {"kernel": S((d, e), jnp.bfloat16), "bias": S((e,), jnp.float32)},
              "shared": {w: S(shape, jnp.bfloat16) for w, shape in (("w1", (d, i)), ("w3", (d, i)), ("w2", (i, d)))},
              "experts": {w: S((e, *shape), jnp.bfloat16) for w, shape in (("w1", (d, i)), ("w3", (d, i)),
                                                                          ("w2", (i, d)))}}
    flops, nbytes = roofline.moe_minimum(params, n, k, io_bytes=100)
    assert flops == 2 * n * (d * e + 3 * d * i + k * 3 * d * i)
    per_expert = 3 * d * i * 2
    assert nbytes == (d * e * 2 + e * 4 + 3 * d * i * 2) + min(e, n * k) * per_expert + 100
    _, many = roofline.moe_minimum(params, 100, k, io_bytes=0)  # 200 pairs: every expert, read once
    assert many == (d * e * 2 + e * 4 + 3 * d * i * 2) + e * per_expert


def test_decode_minimum_reads_the_filled_cache_not_its_length():
    from dspark_jax.backbones.qwen3 import Qwen3Config

    cfg = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    kw = dict(cfg=cfg, rows=3, new=1, param_bytes=10_000, embed_bytes=64 * 16 * 2, io_bytes=0)
    f1, b1 = roofline.decode_minimum(filled=10, **kw)
    f2, b2 = roofline.decode_minimum(filled=20, **kw)
    kv_row = 2 * 2 * 2 * 4 * 2  # layers x (K, V) x kv heads x head_dim x bf16
    assert b2 - b1 == 3 * 10 * kv_row
    assert f2 - f1 == 2 * 4 * 3 * 4 * 4 * 10  # layers x 4 x tokens x heads x head_dim x 10 more keys


def test_routed_moe_compiles_to_its_minimum_flops_and_the_dense_one_to_e_over_k_times():
    cfg = DSparkConfig.from_json(CONFIGS / "tiny_v41.json").replace(n_routed_experts=16, n_activated_experts=2)
    routed = roofline.measure(roofline.moe_program(4, "routed", cfg))
    dense = roofline.measure(roofline.moe_program(4, "dense", cfg))
    assert routed["flops_ratio"] == pytest.approx(1.0, rel=0.02)
    assert dense["flops"] > 4 * routed["flops"]  # 16 experts for 2: E/k = 8 on the expert part
    assert routed["unknown_trip_loops"] == 0 and math.isfinite(routed["bytes_ratio"])


def test_unknown_program_is_named_with_the_flag():
    with pytest.raises(UserError, match="--programs: unknown program 'moe/x/routed'"):
        roofline.build("moe/x/routed")


def test_cli_prints_one_row_per_program(capsys):
    assert main(["bench", "roofline", "--programs", "moe/5/routed,moe/5/dense"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("moe/")]
    assert [r[0] for r in rows] == ["moe/5/routed", "moe/5/dense"]
    assert float(rows[0][3].rstrip("!")) < 1.05 < float(rows[1][3].rstrip("!"))


def test_training_step_compiles_near_its_minimum_flops():
    """The training program (issue 38, deliverable 5): loss, gradient and AdamW of a many-expert draft. Its
    minimum counts 6x the trained matrices per token and 4x the frozen head; the routed MoE and the tile
    loop's own backward keep the compiled flops within the 1.5x target."""
    cfg = DSparkConfig.from_json(CONFIGS / "tiny_v41.json").replace(n_routed_experts=16, n_activated_experts=3)
    row = roofline.measure(roofline.train_program(cfg))
    assert row["unknown_trip_loops"] == 0
    assert 1.0 <= row["flops_ratio"] <= 1.5, row["flops_ratio"]
