"""A `dspark train` checkpoint given where a draft checkpoint is expected (`dspark convert SRC ...`).

`dspark train` writes RUN/run_config.json and RUN/checkpoints/<step>/default/: orbax's CheckpointManager
layout, one Orbax item per step holding the train state {"step", "params", "opt_state"} (train/trainer.py,
`Trainer.save`). `find_train_checkpoint` recognises the run folder, its checkpoints/ folder, a step folder
and a step's default/ item, and picks the step: the one named, else the latest. `restore_draft_params`
reads back "params" alone (the draft, f32): the optimizer state is twice its size and no export needs it.
The draft config is not in the checkpoint; run_config.json names its file (`draft_config_path`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path

import numpy as np

from dspark_jax.checkpoint.orbax_io import is_orbax_checkpoint
from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.errors import read_json_file

ITEM = "default"  # the item name CheckpointManager gives a single unnamed item
RUN_CONFIG = "run_config.json"


@dataclasses.dataclass(frozen=True)
class TrainCheckpoint:
    item: Path  # the Orbax item folder of the chosen step
    step: int
    steps: tuple[int, ...]  # every step of the checkpoints folder, ascending

    @property
    def run_dir(self) -> Path:
        return self.item.parent.parent.parent

    def describe(self) -> str:
        """What the folder is, for a one-line message: 'a dspark train checkpoint folder (orbax, 2 steps: 0..3)'."""
        n = len(self.steps)
        span = f"step {self.steps[0]}" if n == 1 else f"{n} steps: {self.steps[0]}..{self.steps[-1]}"
        return f"a dspark train checkpoint folder (orbax, {span})"


def is_step_folder(path: Path) -> bool:
    """A folder named by its step holding the train item (a convert-written Orbax checkpoint has no item
    folder, so the two are never confused)."""
    return path.name.isdigit() and is_orbax_checkpoint(path / ITEM)


def step_folders(folder: Path) -> dict[int, Path]:
    return {int(p.name): p for p in folder.iterdir() if p.is_dir() and is_step_folder(p)}


def find_train_checkpoint(path: str | os.PathLike) -> TrainCheckpoint | None:
    """The train checkpoint `path` is or holds (see the module docstring), else None. A run folder with no
    step yet (stopped before its first checkpoint) is an error saying so."""
    p = Path(path)
    if not p.is_dir():
        return None
    if p.name == ITEM and is_step_folder(p.parent):
        step_dir = p.parent
    elif is_step_folder(p):
        step_dir = p
    else:
        folder = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        steps = step_folders(folder)
        if not steps:
            if (p / RUN_CONFIG).is_file():
                raise CheckpointError(f"{p} is a dspark train run folder with no checkpoint yet ({folder} has no "
                                      "step folders): training saves one every checkpoint.every steps and at the end")
            return None
        step_dir = steps[max(steps)]
    return TrainCheckpoint(step_dir / ITEM, int(step_dir.name), tuple(sorted(step_folders(step_dir.parent))))


def draft_config_path(ckpt: TrainCheckpoint) -> Path:
    """The draft config file named by the run's run_config.json (draft.config), or an error saying what to
    pass instead."""
    run_config = ckpt.run_dir / RUN_CONFIG
    if not run_config.is_file():
        raise CheckpointError(f"no config: pass --config (the draft config of {ckpt.describe()} is named in its run "
                              f"folder's {RUN_CONFIG}, and there is no {run_config})")
    raw = read_json_file(run_config, "run config")
    name = (raw.get("draft") or {}).get("config") if isinstance(raw, dict) else None
    if not isinstance(name, str):
        raise CheckpointError(f"no config: pass --config ({run_config} names no draft.config)")
    path = Path(name)
    if not path.exists():
        raise CheckpointError(f"no config: pass --config ({run_config} names draft.config {name}, which does not "
                              "exist)")
    return path


@contextlib.contextmanager
def _quiet_absl():
    """Orbax warns that the item has no _CHECKPOINT_METADATA: in the CheckpointManager layout that file is
    the step folder's, so the warning is noise on a command's one-line output."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def restore_draft_params(ckpt: TrainCheckpoint) -> dict:
    """The draft parameters of the step as host numpy arrays, without reading the optimizer state."""
    import jax  # noqa: PLC0415
    import orbax.checkpoint as ocp  # noqa: PLC0415  (slow import; only when used)

    item = ckpt.item.absolute()
    with _quiet_absl(), ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(item)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict) or "params" not in tree:
        raise CheckpointError(f"{item}: expected a dspark train state {{'step', 'params', 'opt_state'}}, got the "
                              f"keys {sorted(tree) if isinstance(tree, dict) else type(tree).__name__}")
    want = {"params": tree["params"]}
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), want)
    with _quiet_absl(), ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(item, args=ocp.args.PyTreeRestore(item=want, restore_args=as_numpy,
                                                               partial_restore=True))["params"]
