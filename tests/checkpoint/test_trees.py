"""The one strict tree check (dspark_jax.checkpoint.trees.check_tree), used by every loader / exporter
and by bundle loading."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.checkpoint.trees import check_tree

# ---------------------------------------------------------------------------------------------
# The one strict tree check (used by every loader / exporter and by bundle loading)
# ---------------------------------------------------------------------------------------------
def test_check_tree_names_the_first_bad_leaf_and_what_was_checked():
    want = {("a", "b"): jax.ShapeDtypeStruct((2, 3), jnp.float32), ("c",): jax.ShapeDtypeStruct((4,), jnp.bfloat16)}
    good = {("a", "b"): np.zeros((2, 3), np.float32), ("c",): jnp.zeros(4, jnp.bfloat16)}
    check_tree(good, want, "t", dtypes=True)
    check_tree({("c",): (4,), ("a", "b"): [2, 3]}, want, "t")  # plain shapes; order does not matter
    with pytest.raises(CheckpointError, match=r"^t: params do not match: missing \['c'\]$"):
        check_tree({("a", "b"): good[("a", "b")]}, want, "t", noun="param")
    with pytest.raises(CheckpointError, match=r"^f: tensors do not match: missing \['c'\], unexpected \['a/x'\]$"):
        check_tree({("a", "x"): 0, ("a", "b"): (2, 3)}, want, "f")
    many = {f"x{i}": (1,) for i in range(7)}
    with pytest.raises(CheckpointError, match=r"unexpected \['x0', 'x1', 'x2', 'x3', 'x4'\] \(\+2 more\)$"):
        check_tree(many, {}, "f")
    with pytest.raises(CheckpointError, match=r"^f: tensor 'a/b' has shape \[3, 2\], expected \[2, 3\]$"):
        check_tree({**good, ("a", "b"): np.zeros((3, 2))}, want, "f")
    with pytest.raises(CheckpointError, match=r"^f: tensor 'c' has dtype float32, expected bfloat16$"):
        check_tree({**good, ("c",): np.zeros(4, np.float32)}, want, "f", dtypes=True)
    check_tree({**good, ("c",): np.zeros(4, np.float32)}, want, "f")  # dtypes only when asked
