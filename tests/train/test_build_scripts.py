"""The default build's stage bookkeeping (scripts/train_drafts.py, scripts/plot_training_curves.py).

A warm restart adds a stage to a draft's run folder; the build resumes an unfinished stage rather than
starting another, joins every stage's metrics with the steps counted on, and the curves plot marks where
each restart began. The comparison drafts' run configs are the DSpark draft's but for the one draft
field that defines them. These are file operations only: no training runs here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_metrics(path: Path, steps: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "tau_estimate": 1.0 + s / 10}) + "\n" for s in steps))


def test_stages_join_with_steps_counted_on_and_an_unfinished_stage_is_resumed(tmp_path):
    train_drafts = load_script("train_drafts")
    run = tmp_path / "dspark"
    write_metrics(run / "stage1" / "metrics.jsonl", [1, 2, 3])
    write_metrics(run / "stage2" / "metrics.jsonl", [1, 2])
    train_drafts.join_metrics(run)
    assert train_drafts.joined_stages(run) == 2

    # Stage 3 has begun (its folder exists) but is not exported: the last joined stage is still 2,
    # which is what makes the next --continue-steps call resume stage 3 instead of adding stage 4.
    write_metrics(run / "stage3" / "metrics.jsonl", [1, 2])
    (run / "stage10").mkdir()  # numbered, not sorted as text
    (run / "stage10" / "metrics.jsonl").write_text("")
    assert train_drafts.stage_numbers(run) == [1, 2, 3, 10]
    assert train_drafts.joined_stages(run) == 2

    train_drafts.join_metrics(run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert [r.get("stage", 1) for r in rows] == [1, 1, 1, 2, 2, 3, 3]
    assert train_drafts.joined_stages(run) == 3

    curves = load_script("plot_training_curves")
    assert curves.restart_steps(rows) == [3, 5]
    assert curves.restart_steps(rows[:3]) == []


def test_a_stage_already_done_is_skipped_and_one_out_of_order_is_refused(tmp_path, monkeypatch, capsys):
    train_drafts = load_script("train_drafts")
    monkeypatch.setattr(train_drafts, "ROOT", tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "default_train_draft_dspark.yaml").write_text("run_dir: runs/dspark\n")
    run = tmp_path / "runs" / "dspark"
    write_metrics(run / "stage1" / "metrics.jsonl", [1, 2])
    write_metrics(run / "stage2" / "metrics.jsonl", [1, 2])
    train_drafts.join_metrics(run)

    def no_training(*_):
        raise AssertionError("no stage should train here")

    monkeypatch.setattr(train_drafts, "run_train", no_training)
    assert train_drafts.continue_draft("dspark", 10, None, stage=2) == 0  # a rerun of the build: nothing to do
    assert "stage 2 is already trained" in capsys.readouterr().out
    assert train_drafts.continue_draft("dspark", 10, None, stage=4) == 2
    assert "stage 3, which is not trained yet" in capsys.readouterr().err


# The comparison drafts of both defaults: same data, seed, steps and optimiser as the DSpark draft, and
# a draft config that differs in exactly the field(s) that make it the comparison.
_COMPARISONS = [
    ("default_train_draft_dspark.yaml", "default_train_draft_parallel.yaml", {"markov_rank": 0}),
    ("default_train_draft_dspark.yaml", "default_train_draft_onetoken.yaml", {"block_size": 1}),
    ("default_qwen3_train_draft.yaml", "default_qwen3_train_draft_parallel.yaml",
     {"markov_rank": 0, "confidence_head_with_markov": False}),
    ("default_qwen3_train_draft.yaml", "default_qwen3_train_draft_onetoken.yaml", {"block_size": 1}),
]


@pytest.mark.parametrize("dspark, other, changed", _COMPARISONS, ids=[c[1] for c in _COMPARISONS])
def test_comparison_drafts_share_the_dspark_drafts_recipe(dspark, other, changed):
    configs = ROOT / "configs"
    runs = [yaml.safe_load((configs / name).read_text()) for name in (dspark, other)]
    assert runs[0]["run_dir"] != runs[1]["run_dir"]
    draft_cfgs = [json.loads((configs / run["draft"].pop("config")).read_text()) for run in runs]
    for run in runs:
        run.pop("run_dir")
    assert runs[0] == runs[1]  # data, seed, steps, batch, optimiser, loss: the same budget
    diff = {k: v for k, v in draft_cfgs[1].items() if draft_cfgs[0].get(k) != v}
    assert diff == changed and set(draft_cfgs[0]) == set(draft_cfgs[1])
