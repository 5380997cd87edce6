"""Orbax checkpoints of draft parameters (dspark_jax.checkpoint.orbax_io): the config in the metadata, a
restore straight into an expert sharding, and strict targets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.checkpoint import TINY, flat

from dspark_jax.checkpoint import orbax_io, v41
from dspark_jax.checkpoint.safetensors_io import CheckpointError


# ---------------------------------------------------------------------------------------------
# Orbax
# ---------------------------------------------------------------------------------------------
def test_orbax_restore_straight_into_expert_sharding(tiny_ckpt, tmp_path):
    from dspark_jax import drafts
    from dspark_jax.parallel import make_mesh

    assert jax.device_count() == 8
    folder, _ = tiny_ckpt
    params, _ = v41.load_v41_draft(folder, TINY, dtype="float32")
    orbax_io.save_params(tmp_path / "ck", params, config=TINY)
    with pytest.raises(CheckpointError, match="already exists"):
        orbax_io.save_params(tmp_path / "ck", params)
    assert orbax_io.saved_config(tmp_path / "ck") == TINY

    mesh = make_mesh(expert=8)
    shardings = drafts.param_shardings(TINY, mesh)
    w1_sharding = shardings["blocks_0"]["ffn"]["experts"]["w1"]
    assert w1_sharding.spec[0] == "expert"
    abstract = jax.tree.map(lambda s, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shardings, drafts.abstract_params(TINY))
    for target in (abstract, shardings):
        restored = orbax_io.restore_params(tmp_path / "ck", target)
        w1 = restored["blocks_0"]["ffn"]["experts"]["w1"]
        assert w1.sharding == w1_sharding
        assert {s.data.shape for s in w1.addressable_shards} == {(1, TINY.dim, TINY.moe_inter_dim)}
        assert len({s.device for s in w1.addressable_shards}) == 8
        for p, x in flat(params).items():
            got = restored
            for k in p:
                got = got[k]
            assert np.array_equal(np.asarray(got), x), p
    host = orbax_io.restore_params(tmp_path / "ck")
    assert isinstance(host["main_proj"]["kernel"], np.ndarray)

    bad = dict(abstract)
    bad.pop("norm")
    with pytest.raises(CheckpointError, match=r"leaves not in the target \['norm/scale'\]"):
        orbax_io.restore_params(tmp_path / "ck", bad)
    wrong = jax.tree.map(lambda x: x, abstract)
    wrong["norm"]["scale"] = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=shardings["norm"]["scale"])
    with pytest.raises(CheckpointError, match=r"leaf 'norm/scale' has shape \[64\] in the checkpoint"):
        orbax_io.restore_params(tmp_path / "ck", wrong)


def test_a_checkpoint_manager_step_is_one_line_naming_its_items(tmp_path):
    """A step folder of an Orbax CheckpointManager holds its items in sub-folders: Orbax read no tree from it
    (a restore failed on the missing _METADATA with a long traceback); the error names the items to pass."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path / "ckpts", item_names=("state",)) as manager:
        manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.ones(2, np.float32)})))
        manager.wait_until_finished()
    step = tmp_path / "ckpts" / "3"
    with pytest.raises(CheckpointError, match=rf"^{step}: an Orbax CheckpointManager step holding the item "
                                              r"folder\(s\) \['state'\], not one tree; pass the item folder$"):
        orbax_io.checkpoint_metadata(step)
    assert orbax_io.checkpoint_metadata(step / "state")[0]["w"].shape == (2,)
