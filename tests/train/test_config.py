"""Run configs (dspark_jax.train.config): the YAML file, errors naming the key (also at the CLI boundary),
and the learning-rate schedule they set."""

import dataclasses
import sys

import numpy as np
import pytest
from helpers import CONFIGS
from helpers.train import run_config

from dspark_jax.train.config import RunConfig, RunConfigError


def test_run_config_yaml_and_errors(tmp_path, monkeypatch, capsys):
    cfg = RunConfig.from_yaml(CONFIGS / "train_tiny.yaml")
    assert cfg.backbone.config == str(CONFIGS / "tiny_mhc_backbone.json")
    assert cfg.data.train == (str(CONFIGS / "../tests/data/tiny_train.jsonl"),)
    assert cfg.loss.fused and cfg.optim.weight_decay == 0.0 and cfg.optim.clip_norm == 1.0
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: {train: [x.jsonl]}\ndraft: {config: a.json}\nbackbone: {config: b.json}\n"
                   "optim: {lr: 1, foo: 2}\n")
    with pytest.raises(RunConfigError, match="optim.foo"):
        RunConfig.from_yaml(bad)
    from dspark_jax.cli import main

    monkeypatch.setattr(sys, "argv", sys.argv[:])  # cli.main rewrites sys.argv; restore it after
    assert main(["train", "--config", str(bad)]) == 2  # the CLI boundary: one line naming the key
    assert "optim.foo" in capsys.readouterr().err
    with pytest.raises(RunConfigError, match="multiple of grad_accum"):
        RunConfig.from_dict(run_config(tmp_path, tmp_path, global_batch=6, grad_accum=4))
    # the lr schedule: warmup from lr/warmup (never 0), peak, cosine to 0
    from dspark_jax.train.trainer import lr_schedule

    sched = lr_schedule(dataclasses.replace(cfg.optim, lr=1.0, warmup_frac=0.1), 100)
    np.testing.assert_allclose([sched(0), sched(9), sched(10), sched(55), sched(100)], [0.1, 1.0, 1.0, 0.5, 0.0],
                               atol=1e-6)
