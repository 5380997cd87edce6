"""Fixtures several test modules share (a pytest plugin: tests/conftest.py lists it in `pytest_plugins`).
Module-scoped, so each module that uses one builds it once; the builders are in the helpers modules."""

import pytest

from helpers.backbones import mhc_fixture, qwen3_hf_fixture
from helpers.checkpoint import tiny_v41_checkpoint
from helpers.train import make_trainer, one_device, write_model_files


@pytest.fixture(scope="module")
def qwen3_hf(tmp_path_factory):
    """Untied: (torch model, checkpoint folder, loaded cfg, loaded params, seq, HF logits, HF hidden)."""
    return qwen3_hf_fixture(False, tmp_path_factory)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen3_hf_both(request, tmp_path_factory, qwen3_hf):
    return qwen3_hf_fixture(True, tmp_path_factory) if request.param else qwen3_hf


@pytest.fixture(scope="module")
def mhc():
    """The tiny mHC backbone config as shipped (MoE FFN)."""
    return mhc_fixture(True)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny V4.1 checkpoint in the official layout (helpers.checkpoint.tiny_v41_checkpoint)."""
    return tiny_v41_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    return write_model_files(tmp_path_factory)


@pytest.fixture(scope="module")
def trainer1(model_files, tmp_path_factory):
    return make_trainer(model_files, tmp_path_factory.mktemp("run1"), one_device())
