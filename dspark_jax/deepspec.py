"""Deprecated: the DeepSpec draft family moved to `dspark_jax.drafts.deepspec` (config, model, heads,
train_forward). These names stay for one release."""

from __future__ import annotations

import warnings

from dspark_jax.drafts.deepspec.config import ARCHITECTURE, FAMILY, TAP_MODE, DeepSpecConfig  # noqa: F401
from dspark_jax.validation import MARKOV_HEAD_TYPES  # noqa: F401
from dspark_jax.drafts.deepspec.heads import confidence_logits  # noqa: F401
from dspark_jax.drafts.deepspec.model import *  # noqa: F401,F403
from dspark_jax.drafts.deepspec.train_forward import train_forward  # noqa: F401

warnings.warn("dspark_jax.deepspec is deprecated: use dspark_jax.drafts.deepspec", DeprecationWarning, stacklevel=2)
