"""The DeepSpec draft family ("qwen3", SPEC 4): DeepSeek's DeepSpec drafts for Qwen3 targets
(`Qwen3DSparkModel`): Qwen3 decoder layers whose attention also reads the target's features, the Markov
head and a biased confidence head on the post-norm hidden.

    config.py          DeepSpecConfig (DeepSpec's config.json, plus our dtypes)
    model.py           parameters, the context K/V state, prefill / ingest / propose
    heads.py           the confidence head
    train_forward.py   the teacher-forced forward of SPEC 8 (full context before each anchor)
Checkpoints: `dspark_jax.checkpoint.deepspec`.
"""

from __future__ import annotations

from dspark_jax.drafts.deepspec import model, train_forward
from dspark_jax.drafts.deepspec.config import FAMILY, TAP_MODE, DeepSpecConfig, claims


class DeepSpecFamily:
    """`drafts.base.DraftFamily` for DeepSpec drafts."""

    name = FAMILY
    tap_mode = TAP_MODE  # layer OUTPUTS, -1 = the embeddings
    checkpoint_format = "deepspec"
    config_class = DeepSpecConfig

    claims = staticmethod(claims)
    config_from_dict = staticmethod(DeepSpecConfig.from_dict)
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
        from dspark_jax.checkpoint.deepspec import expand_table  # noqa: PLC0415  (checkpoint/ imports the models)

        return expand_table(cfg)


DRAFT_FAMILY = DeepSpecFamily()
