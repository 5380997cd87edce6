"""`dspark train` (dspark_jax.train.cli) end to end, in a subprocess."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import CONFIGS


@pytest.mark.slow
def test_cli_trains_checkpoints_and_resumes(tmp_path):
    """`dspark train --config configs/train_tiny.yaml` end to end (compiles the full tiny config)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "dspark_jax", "train", "--config", str(CONFIGS / "train_tiny.yaml"),
           "--run-dir", str(run_dir), "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run(cmd + ["--steps", "3"], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 3 and np.isfinite(recs[-1]["loss"])
    assert (run_dir / "checkpoints" / "3").is_dir() and (run_dir / "run_config.json").is_file()
    r = subprocess.run(cmd + ["--steps", "5"], env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 3" in r.stderr
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 5
