"""Where the repository's files are, for tests in any folder of tests/."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
TESTS = REPO / "tests"
FIXTURES = TESTS / "fixtures"  # the full V4.1-Flash config.json files
TINY_TRAIN_JSONL = TESTS / "data" / "tiny_train.jsonl"  # the tiny training set (configs/train_tiny.yaml reads it)
