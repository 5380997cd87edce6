"""Deprecated: the draft API moved to `dspark_jax.drafts` (every family) and `dspark_jax.drafts.v41`
(the V4.1 family's modules). These names stay for one release."""

from __future__ import annotations

import warnings

from dspark_jax.drafts import (DraftOutput, abstract_params, base_logits, block_inputs, count_params, ingest,  # noqa: F401
                               init_params, init_state, param_logical_axes, param_shardings, prefill, propose,
                               reset_rows)
from dspark_jax.drafts.v41.heads import confidence_logits  # noqa: F401
from dspark_jax.drafts.v41.model import Block, DraftState, DSparkDraft, draft_hidden, ring_dtype  # noqa: F401

warnings.warn("dspark_jax.draft is deprecated: use dspark_jax.drafts (and dspark_jax.drafts.v41 for the V4.1 "
              "modules)", DeprecationWarning, stacklevel=2)
