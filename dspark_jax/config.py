"""Deprecated: draft configs moved to `dspark_jax.drafts` (`load_config` / `config_from_dict` for any
family, `dspark_jax.drafts.v41.config.DSparkConfig` for V4.1) and the validation helpers to
`dspark_jax.validation`. These names stay for one release."""

from __future__ import annotations

import warnings

from dspark_jax.drafts.v41.config import DSparkConfig  # noqa: F401
from dspark_jax.validation import (SCORE_FUNCS, ConfigError, check_field, did_you_mean, is_int,  # noqa: F401
                                   is_number, read_json_config)

warnings.warn("dspark_jax.config is deprecated: use dspark_jax.drafts (configs of every family) and "
              "dspark_jax.validation", DeprecationWarning, stacklevel=2)
