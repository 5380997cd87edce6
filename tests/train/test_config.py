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


# ---------------------------------------------------------------------------------------------------
# Every field checked at load time (issue 17): type, range and finiteness, one line naming the dotted key


def _tiny_raw() -> dict:
    import yaml

    return yaml.safe_load((CONFIGS / "train_tiny.yaml").read_text())


def _write_with(tmp_path, dotted: str, value):
    """train_tiny.yaml with one field changed, written as YAML (so .inf, .nan, true, 'no' go through
    the YAML reader as a user's file would)."""
    import yaml

    raw = _tiny_raw()
    *parents, leaf = dotted.split(".")
    node = raw
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


BAD_VALUES = [
    ("optim.lr", float("inf"), "expected a positive finite number, got inf"),
    ("optim.lr", True, "expected a positive finite number, got True"),
    ("optim.lr", 0, "positive"),
    ("optim.lr", "1e-4", "YAML read a string"),
    ("optim.b1", 2.0, "in [0, 1)"),
    ("optim.b2", 1.0, "in [0, 1)"),
    ("optim.weight_decay", -5, ">= 0"),
    ("optim.weight_decay", float("nan"), ">= 0"),
    ("optim.warmup_frac", "0.1", "in [0, 1)"),
    ("optim.clip_norm", -1.0, "positive"),
    ("optim.eps", 0.0, "positive"),
    ("loss.ce_weight", -1, ">= 0"),
    ("loss.l1_weight", float("inf"), ">= 0"),
    ("loss.conf_weight", True, ">= 0"),
    ("loss.decay_gamma", float("nan"), "positive finite number"),
    ("loss.decay_gamma", "four", "positive finite number"),
    ("loss.fused", "no", "true or false"),
    ("loss.detach_conf_inputs", 1, "true or false"),
    ("loss.vocab_chunk", 0, "positive integer or null"),
    ("loss.fp8_grad", "exactly", "'straight_through' or 'exact'"),
    ("seed", "abc", "an integer in [0, 2**32)"),
    ("seed", -1, "an integer in [0, 2**32)"),
    ("seed", 2 ** 32, "an integer in [0, 2**32)"),
    ("backbone.init_seed", "abc", "an integer"),
    ("draft.init_seed", 1.5, "an integer"),
    ("backbone.family", "llama", "'mhc' or 'qwen3'"),
    ("backbone.tap_mode", "middle", "'entry', 'output' or null"),
    ("backbone.params", 3, "a path or null"),
    ("draft.init", "", "a path or null"),
    ("data.pad_id", -1, "token id"),
    ("data.pad_id", True, "token id"),
    ("data.add_special_tokens", "yes", "true or false"),
    ("data.tokenizer", 5, "a path or null"),
    ("data.train", [1], "JSONL file"),
    ("data.seq_len", 1, "at least 2"),
    ("data.shuffle_buffer", 0, "positive integer"),
    ("data.anchors_per_seq", True, "positive integer"),
    ("run_dir", "", "a folder path"),
    ("steps", 0, "positive integer"),
    ("global_batch", True, "positive integer"),
    ("grad_accum", 2.0, "positive integer"),
    ("compute_dtype", "float16", "'float32' or 'bfloat16'"),
    ("compiler_options", [1], "mapping of XLA option"),
    ("mesh.data", 0, "positive integer or -1"),
    ("mesh.fsdp", -2, "positive integer or -1"),
    ("mesh.tensor", True, "positive integer or -1"),
    ("checkpoint.every", 0, "positive integer"),
    ("checkpoint.keep", -1, "positive integer"),
    ("log.every", 1.0, "positive integer"),
    ("distributed.coordinator", 1234, "host:port"),
    ("distributed.num_processes", 0, "positive integer or null"),
    ("distributed.process_id", -1, "an integer >= 0 or null"),
    ("distributed.auto", "yes", "true or false"),
    ("distributed.cpu_collectives", 1, "collectives name"),
]


@pytest.mark.parametrize("field,value,expected", BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_each_bad_value_is_refused_naming_the_dotted_field(tmp_path, field, value, expected):
    from dspark_jax.validation import ConfigError

    path = _write_with(tmp_path, field, value)
    with pytest.raises(ConfigError) as info:
        RunConfig.from_yaml(path)
    msg = str(info.value)
    assert isinstance(info.value, RunConfigError) and str(path) in msg
    assert f"{field}" in msg and expected in msg, msg
    assert "\n" not in msg
    import yaml

    with pytest.raises(RunConfigError, match=field.replace(".", r"\.")):  # from_dict too, without the file
        RunConfig.from_dict(yaml.safe_load(path.read_text()), base_dir=CONFIGS)


def test_the_lr_message_names_field_expectation_and_value(tmp_path):
    with pytest.raises(RunConfigError, match=r"config field 'optim.lr': expected a positive finite number, got inf$"):
        RunConfig.from_yaml(_write_with(tmp_path, "optim.lr", float("inf")))


@pytest.mark.parametrize("over, match", [
    ({"loss": {"ce_weight": 0.0, "l1_weight": 0.0, "conf_weight": 0.0}}, "nothing would be trained"),
    ({"mesh": {"data": -1, "fsdp": -1}}, "at most one axis may be -1"),
    ({"distributed": {"num_processes": 2, "process_id": 2}}, "distributed.process_id"),
])
def test_rules_across_fields(tmp_path, over, match):
    raw = _tiny_raw()
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    with pytest.raises(RunConfigError, match=match):
        RunConfig.from_dict(raw, base_dir=CONFIGS)


def test_every_field_of_the_run_config_has_a_check():
    from dspark_jax.train import config as C

    sections = {"backbone": C.BackboneSpec, "draft": C.DraftSpec, "data": C.DataConfig, "optim": C.OptimConfig,
                "loss": C.LossConfig, "mesh": C.MeshConfig, "checkpoint": C.CheckpointConfig, "log": C.LogConfig,
                "distributed": C.DistributedConfig}
    names = set()
    for f in dataclasses.fields(RunConfig):
        if f.name in sections:
            names |= {f"{f.name}.{g.name}" for g in dataclasses.fields(sections[f.name])}
        else:
            names.add(f.name)
    assert names == set(C._FIELD_CHECKS)


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*train*.yaml")))
def test_the_shipped_run_configs_load(name):
    cfg = RunConfig.from_yaml(CONFIGS / name)
    assert cfg.optim.lr > 0 and cfg.steps > 0


def test_overrides_are_checked_too():
    cfg = RunConfig.from_yaml(CONFIGS / "train_tiny.yaml")
    with pytest.raises(RunConfigError, match="steps"):
        cfg.replace(steps=True)


def test_pad_id_outside_the_vocabulary(tmp_path, monkeypatch, capsys):
    cfg = RunConfig.from_yaml(CONFIGS / "train_tiny.yaml")
    cfg.check_vocab(cfg.data.pad_id + 1)
    with pytest.raises(RunConfigError, match=r"data.pad_id': expected a token id in \[0, 5\)"):
        dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pad_id=5)).check_vocab(5)


@pytest.mark.parametrize("field,value,match", [("seed", "abc", "'seed'"), ("backbone.init_seed", "abc", "init_seed"),
                                               ("data.pad_id", 10 ** 6, "data.pad_id")])
def test_train_cli_refuses_before_compiling(tmp_path, monkeypatch, capsys, field, value, match):
    """One line naming the field and exit 2, with no traceback; the pad_id is checked against the draft's
    vocabulary where the trainer pairs data and model, before the step's compile."""
    from dspark_jax.cli import main

    monkeypatch.setattr(sys, "argv", sys.argv[:])  # cli.main rewrites sys.argv; restore it after
    path = _write_with(tmp_path, field, value)
    import yaml

    raw = yaml.safe_load(path.read_text())  # written elsewhere: point the relative inputs back at configs/
    raw["backbone"]["config"] = str(CONFIGS / "tiny_mhc_backbone.json")
    raw["draft"]["config"] = str(CONFIGS / "tiny_v41.json")
    raw["data"]["train"] = [str(CONFIGS / "../tests/data/tiny_train.jsonl")]
    raw["run_dir"] = str(tmp_path / "run")
    path.write_text(yaml.safe_dump(raw))
    import dspark_jax.train.trainer as T

    monkeypatch.setattr(T, "compile_step", lambda spec: pytest.fail("compiled before the config was checked"))
    assert main(["train", "--config", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("field,value,match", [
    ("data.train", ["nomatch*.jsonl"], "data.train: pattern 'nomatch*.jsonl' matches no file"),
    ("data.tokenizer", "missing_tokenizer.json", "data.tokenizer: cannot load"),
    ("backbone.params", "missing_ckpt", "backbone.params: "),
    ("draft.init", "missing_ckpt", "draft.init: "),
])
def test_train_cli_checks_named_files_before_compiling(tmp_path, monkeypatch, capsys, field, value, match):
    """The data files, the tokenizer and the checkpoints a run config names are looked at before the step's
    compile (minutes at real sizes): one line naming the field, exit 2."""
    import yaml

    from dspark_jax.cli import main
    import dspark_jax.train.trainer as T

    monkeypatch.setattr(sys, "argv", sys.argv[:])  # cli.main rewrites sys.argv; restore it after
    raw = yaml.safe_load((CONFIGS / "train_tiny.yaml").read_text())
    raw["backbone"]["config"] = str(CONFIGS / "tiny_mhc_backbone.json")
    raw["draft"]["config"] = str(CONFIGS / "tiny_v41.json")
    raw["data"]["train"] = [str(CONFIGS / "../tests/data/tiny_train.jsonl")]
    raw["run_dir"] = str(tmp_path / "run")
    section, key = field.split(".")
    raw[section][key] = value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    monkeypatch.setattr(T, "compile_step", lambda spec: pytest.fail("compiled before the named files were checked"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
