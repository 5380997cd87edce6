"""A `dspark train` checkpoint as `dspark convert`'s input (dspark_jax.checkpoint.train_checkpoint): found from
the run folder, its checkpoints/ folder, a step folder or the step's item; its draft read without the
optimizer state; exported with --no-tied; everything else refused in one line naming what it is."""

from __future__ import annotations

import logging
import shutil
import sys

import jax
import numpy as np
import pytest
from helpers.train import make_trainer, one_device, write_model_files

from dspark_jax import drafts
from dspark_jax.checkpoint import v41
from dspark_jax.checkpoint.orbax_io import save_params
from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.checkpoint.train_checkpoint import find_train_checkpoint, restore_draft_params


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder written by the trainer itself (Trainer.fit -> Trainer.save) with checkpoints at steps 1
    and 2 -> (run folder, draft config, {step: the trainer's draft params at that step})."""
    model_files = write_model_files(tmp_path_factory)
    run_dir = tmp_path_factory.mktemp("train") / "run"
    tr = make_trainer(model_files, run_dir, one_device(), checkpoint={"every": 1, "keep": 5})
    params = {}
    for step in (1, 2):
        tr.fit(until=step, progress=False)
        params[step] = jax.device_get(tr.state.params)
    return run_dir, drafts.load_config(model_files / "draft.json"), params


def _main(args):
    from dspark_jax.cli import main

    return main(["convert", *map(str, args), "--quiet"])


def test_find_train_checkpoint_from_every_level_of_the_run(run, tmp_path):
    run_dir, _, _ = run
    ckpts = run_dir / "checkpoints"
    for src, step in ((run_dir, 2), (ckpts, 2), (ckpts / "1", 1), (ckpts / "1" / "default", 1)):
        found = find_train_checkpoint(src)
        assert (found.item, found.step, found.steps, found.run_dir) == (ckpts / str(step) / "default", step, (1, 2),
                                                                        run_dir), src
    assert found.describe() == "a dspark train checkpoint folder (orbax, 2 steps: 1..2)"
    # what convert wrote, a safetensors folder, a file: not train checkpoints
    save_params(tmp_path / "convert_orbax", {"params": {"w": np.ones(2, np.float32)}})
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "model.safetensors").write_bytes(b"")
    for other in (tmp_path / "convert_orbax", tmp_path / "st", tmp_path / "st" / "model.safetensors"):
        assert find_train_checkpoint(other) is None, other
    # a run stopped before its first checkpoint
    (tmp_path / "young" / "checkpoints").mkdir(parents=True)
    shutil.copy(run_dir / "run_config.json", tmp_path / "young")
    with pytest.raises(CheckpointError, match=r"young is a dspark train run folder with no checkpoint yet"):
        find_train_checkpoint(tmp_path / "young")


def test_restore_draft_params_reads_the_step_s_draft_only(run):
    run_dir, _, params = run
    got = restore_draft_params(find_train_checkpoint(run_dir / "checkpoints" / "1"))
    assert jax.tree.structure(got) == jax.tree.structure(params[1])  # no optimizer state, no step
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params[1])):
        assert isinstance(a, np.ndarray) and a.dtype == np.float32
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params[1]), jax.tree.leaves(params[2])))


def test_dspark_convert_exports_a_train_checkpoint_s_draft(run, tmp_path, capsys, caplog, monkeypatch):
    """Issue 40: a train run folder gave a 62-line Orbax traceback. Now convert exports the draft (the latest
    step, or the step folder given) byte for byte as the library's export of the trainer's params, and
    everything it cannot do is one line naming what the folder is and what to pass."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli.main rewrites it
    run_dir, cfg, params = run
    for step, src, fmt in ((2, run_dir, "bf16"), (1, run_dir / "checkpoints" / "1", "fp8")):
        want = v41.export_v41_draft(params[step], None, cfg, tmp_path / f"want{step}", fmt=fmt)
        assert _main([src, tmp_path / f"got{step}", "--to", fmt, "--no-tied"]) == 0
        assert (tmp_path / f"got{step}" / want[0].name).read_bytes() == want[0].read_bytes()
        assert f"(the draft at step {step} of the dspark train checkpoint {run_dir})" in capsys.readouterr().out
    assert drafts.load_config(tmp_path / "got2" / "dspark_config.json") == cfg

    what = f"{run_dir} is a dspark train checkpoint folder (orbax, 2 steps: 1..2)"
    caplog.set_level(logging.WARNING)
    for more, line in (([], f"{what}: it holds the draft only (training reads the embedding and head from the "
                            "backbone); pass --no-tied to export the draft of step 2 alone"),
                       (["--to", "orbax"], f"{what}; convert exports its draft --to bf16 or --to fp8 (with "
                                           "--no-tied)")):
        args = [run_dir, tmp_path / "refused", *(more or ["--to", "bf16"])]
        assert _main(args) == 2
        assert capsys.readouterr().err == f"dspark convert: {line}\n"
        assert not (tmp_path / "refused").exists()
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # Orbax's included

    # a checkpoints folder copied away from its run: the config it names is gone, --config is the way
    shutil.copytree(run_dir / "checkpoints", tmp_path / "copied")
    assert _main([tmp_path / "copied", tmp_path / "c", "--to", "bf16", "--no-tied"]) == 2
    assert capsys.readouterr().err == (
        f"dspark convert: no config: pass --config (the draft config of a dspark train checkpoint folder (orbax, 2 "
        f"steps: 1..2) is named in its run folder's run_config.json, and there is no "
        f"{tmp_path / 'run_config.json'})\n")
    cfg.to_json(tmp_path / "draft.json")
    assert _main([tmp_path / "copied", tmp_path / "c", "--to", "bf16", "--no-tied", "--config",
                  tmp_path / "draft.json"]) == 0
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == (tmp_path / "got2" / "model.safetensors").read_bytes()
