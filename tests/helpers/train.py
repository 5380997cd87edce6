"""Set-up shared by the trainer tests (train/test_trainer.py, train/test_rollout.py, train/test_config.py):
the tiny model configs, run configs, initial parameters, trainers and a fixed batch."""

import functools
import json

import jax

from dspark_jax import drafts
from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
from dspark_jax.drafts.v41.config import DSparkConfig
from dspark_jax.parallel import make_mesh
from dspark_jax.train import data as D
from dspark_jax.train.config import RunConfig
from dspark_jax.train.trainer import Trainer

from helpers.paths import CONFIGS, TINY_TRAIN_JSONL

DATA = TINY_TRAIN_JSONL

FAST_COMPILE = {"xla_backend_optimization_level": 0}


def write_model_files(tmp_path_factory):
    """The tiny draft and mHC backbone configs of the trainer tests, in a fresh folder -> the folder."""
    root = tmp_path_factory.mktemp("train_models")
    d = json.loads((CONFIGS / "tiny_v41.json").read_text())
    # kv_fp8 off: fp8 rounding is discontinuous, so a one-ulp difference from another reduction order
    # (another mesh) flips a rounding and moves the loss by ~1e-5; Adam's first steps then amplify it. The
    # step-equivalence tests compare smooth models. (fp8 training is covered by the fused-loss test
    # of train/test_model.py and the slow CLI test on configs/train_tiny.yaml.)
    d.update(hc_sinkhorn_iters=2, n_layers=1, target_layer_ids=[0, 1], kv_fp8=False)
    (root / "draft.json").write_text(json.dumps(d))
    b = json.loads((CONFIGS / "tiny_mhc_backbone.json").read_text())
    b.update(hc_sinkhorn_iters=2, n_layers=2, kv_fp8=False)
    (root / "backbone.json").write_text(json.dumps(b))
    return root


def run_config(model_files, run_dir, **over) -> dict:
    raw = {
        "run_dir": str(run_dir), "seed": 0, "steps": 10, "global_batch": 8, "grad_accum": 1,
        "compute_dtype": "float32", "compiler_options": FAST_COMPILE,
        "backbone": {"family": "mhc", "config": str(model_files / "backbone.json")},
        "draft": {"config": str(model_files / "draft.json")},
        "data": {"train": [str(DATA)], "seq_len": 48, "shuffle_buffer": 16, "anchors_per_seq": 6},
        "optim": {"lr": 3e-3, "warmup_frac": 0.1},
        "loss": {"vocab_chunk": 96},
        "checkpoint": {"every": 2, "keep": 5},
        "log": {"every": 1},
    }
    raw.update(over)
    return raw


@functools.lru_cache(maxsize=None)
def initial_params(draft_json, backbone_json):
    dcfg = DSparkConfig.from_json(draft_json).replace(param_dtype="float32")
    bb = MhcBackbone(MhcConfig.from_json(backbone_json))
    return (jax.device_get(drafts.init_params(dcfg, jax.random.key(1))),
            jax.device_get(bb.init_params(jax.random.key(0))))


def make_trainer(model_files, run_dir, mesh, **over):
    cfg = RunConfig.from_dict(run_config(model_files, run_dir, **over))
    dp, bp = initial_params(str(model_files / "draft.json"), str(model_files / "backbone.json"))
    return Trainer(cfg, mesh=mesh, draft_params=dp, backbone_params=bp)


def fixed_batch(accum=1):
    cfg = D.DataConfig(train=(str(DATA),), seq_len=48, shuffle_buffer=16, seed=0, anchors_per_seq=6)
    batch = next(D.Batches(D.JsonlStream(cfg, process_index=0, process_count=1), per_host_batch=8))
    return {k: v.reshape(accum, 8 // accum, *v.shape[2:]) for k, v in batch.items()}


def one_device():
    return make_mesh(devices=jax.devices()[:1])
