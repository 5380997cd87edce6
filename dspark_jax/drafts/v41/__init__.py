"""The DeepSeek-V4.1 draft family ("deepseek_v41", SPEC 2): mHC blocks with window-only latent MQA and
MoE over a ring of the last W backbone positions, the Markov head and a bias-free confidence head.

    config.py          DSparkConfig (ours, and DeepSeek's HF and inference config.json spellings)
    model.py           Flax modules, parameters, the ring state, prefill / ingest / propose
    heads.py           Markov weights and the confidence head
    train_forward.py   the teacher-forced forward of SPEC 8
Checkpoints: `dspark_jax.checkpoint.v41` (the official `mtp.*` layout, fp8 / fp4).
"""

from __future__ import annotations

from dspark_jax.drafts.v41 import model, train_forward
from dspark_jax.drafts.v41.config import FAMILY, TAP_MODE, DSparkConfig, parse_config


class V41Family:
    """`drafts.base.DraftFamily` for the V4.1 draft."""

    name = FAMILY
    tap_mode = TAP_MODE  # the residual at the ENTRY of the tap layers (SPEC 2.2)
    checkpoint_format = "v41"
    config_class = DSparkConfig

    @staticmethod
    def claims(raw) -> bool:
        # Only our own spelling names the family; the foreign spellings are the registry's default.
        return isinstance(raw, dict) and raw.get("family") == FAMILY

    @staticmethod
    def config_from_dict(raw: dict, **overrides) -> DSparkConfig:
        cfg = parse_config(raw)
        return cfg.replace(**overrides) if overrides else cfg

    init_params = staticmethod(model.init_params)
    abstract_params = staticmethod(model.abstract_params)
    param_logical_axes = staticmethod(model.param_logical_axes)
    init_state = staticmethod(model.init_state)
    prefill = staticmethod(model.prefill)
    ingest = staticmethod(model.ingest)
    draft_hidden = staticmethod(model.draft_hidden)
    propose = staticmethod(model.propose)
    train_forward = staticmethod(train_forward.train_forward)

    @staticmethod
    def checkpoint_table(cfg) -> list:
        from dspark_jax.checkpoint.v41 import expand_table  # noqa: PLC0415  (checkpoint/ imports the models)

        return expand_table(cfg)


DRAFT_FAMILY = V41Family()
