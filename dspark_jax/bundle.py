"""A model bundle: everything `dspark generate` / `dspark demo` need, in one folder.

    bundle.json            {"backbone": {"family": "mhc"|"qwen3", "config": {...}},
                            "draft": {...draft config, any family...}, "tap_mode": "entry"|"output"}
    backbone.safetensors   the backbone's param tree, keys joined with "."
    draft.safetensors      the draft's param tree (docs/params.md), keys joined with "."
    calibration.json       optional STS temperatures (dspark calibrate), fitted on rounds of the optimal coupling
    calibration_invariant.json  optional, the same fitted on rounds of the drafter-invariant coupling (its
                           acceptance is lower); present, invariant rows schedule with it
    cost_table.json        optional measured cost table (dspark profile)
    tokenizer.json         optional `tokenizers` tokenizer

Loading is strict: every parameter the configs imply must be present with its shape, and nothing else.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import drafts
from dspark_jax import spec_round as sr
from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Config
from dspark_jax.calibration import Calibration
from dspark_jax.checkpoint.safetensors_io import CheckpointError, open_checkpoint, save_file, stored_shape
from dspark_jax.checkpoint.formats import check_finite
from dspark_jax.checkpoint.trees import check_tree
from dspark_jax.errors import UserError, read_json_file
from dspark_jax.validation import check_known_keys
from dspark_jax.schedule import CostTable


def backbone_families():
    return {
        "mhc": (MhcBackbone, MhcConfig.from_dict, lambda c: c.to_dict()),
        "qwen3": (Qwen3Backbone, Qwen3Config.from_hf_dict, lambda c: c.to_hf_dict()),
    }


def make_backbone(family: str, config: dict):
    fams = backbone_families()
    if family not in fams:
        raise ValueError(f"backbone 'family': expected one of {sorted(fams)}, got {family!r}")
    cls, from_dict, _ = fams[family]
    return cls(from_dict(config))


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


# Stored dtypes a floating-point parameter may be read from (cast to the parameter's dtype): the plain
# float formats. Integers, bools and fp8 (which needs its scales) would be silently wrong weights.
_FLOAT_STORAGE = ("F16", "BF16", "F32", "F64")


def unflatten_strict(flat_reader, abstract: dict, what: str) -> dict:
    """Read every leaf of `abstract` from the reader by its dotted name; names and shapes must match
    (`check_tree`, before anything is read), each stored dtype must be a plain float format and each value
    finite (CheckpointError naming the tensor); each leaf is cast to the abstract leaf's dtype."""
    want = flatten(abstract)
    infos = {n: flat_reader.info(n) for n in flat_reader.names}
    check_tree({n: stored_shape(i.dtype, i.shape) for n, i in infos.items()}, want, what)
    flat = {name: _read_param(flat_reader, infos[name], spec.dtype, what) for name, spec in want.items()}
    out: dict = {}
    for name, arr in flat.items():
        node = out
        *path, leaf = name.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = arr
    return out


def _read_param(flat_reader, info, dtype, what: str) -> jax.Array:
    if info.dtype not in _FLOAT_STORAGE:
        raise CheckpointError(f"{what}: tensor '{info.name}' is stored as {info.dtype}, expected a float "
                              f"format ({', '.join(_FLOAT_STORAGE)})")
    value = flat_reader.read(info.name)
    check_finite(value, f"{what}: tensor '{info.name}'")
    return jnp.asarray(value, dtype)


@dataclasses.dataclass
class Bundle:
    model: sr.SpecModel
    weights: sr.Weights
    backbone_family: str
    calibration: Calibration | None = None
    cost_table: CostTable | None = None
    tokenizer: Any = None
    path: Path | None = None
    invariant_calibration: Calibration | None = None  # calibration_invariant.json


def save_bundle(path, *, backbone_family: str, backbone, backbone_params, draft_cfg, draft_params,
                tap_mode: str | None = None, calibration: Calibration | None = None,
                cost_table: CostTable | None = None, tokenizer_json: str | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    to_dict = backbone_families()[backbone_family][2]
    meta = {"backbone": {"family": backbone_family, "config": to_dict(backbone.cfg)},
            "draft": draft_cfg.to_dict(), "tap_mode": tap_mode or draft_cfg.tap_mode}
    (path / "bundle.json").write_text(json.dumps(meta, indent=2) + "\n")
    save_file(path / "backbone.safetensors", {k: np.asarray(v) for k, v in flatten(backbone_params).items()})
    save_file(path / "draft.safetensors", {k: np.asarray(v) for k, v in flatten(draft_params).items()})
    if calibration is not None:
        calibration.save(path / "calibration.json")
    if cost_table is not None:
        cost_table.to_json(path / "cost_table.json")
    if tokenizer_json is not None:
        (path / "tokenizer.json").write_text(tokenizer_json)
    return path


def load_bundle(path, *, impl: str = "auto") -> Bundle:
    """A serving bundle; every problem (a missing or malformed file, a config field, a tensor's name,
    shape, dtype or values, a calibration for another block size, a bad tokenizer) is a UserError
    naming the file."""
    path, meta_path = _bundle_paths(Path(path))
    meta = read_json_file(meta_path, "bundle metadata")
    if not isinstance(meta, dict):
        raise UserError(f"{meta_path}: expected a JSON object")
    check_known_keys(meta, _META_KEYS, str(meta_path))
    if isinstance(meta.get("backbone"), dict):
        check_known_keys(meta["backbone"], _BACKBONE_KEYS, f"{meta_path} 'backbone'")
    for key in ("backbone", "draft"):
        if not isinstance(meta.get(key), dict):
            raise UserError(f"{meta_path}: missing key '{key}'" if key not in meta
                            else f"{meta_path}: '{key}' must be an object")
    try:
        backbone = make_backbone(meta["backbone"].get("family"), meta["backbone"].get("config", {}))
    except ValueError as err:
        raise UserError(f"{meta_path} 'backbone': {err}") from None
    try:
        cfg = drafts.config_from_dict(meta["draft"])
    except ValueError as err:
        raise UserError(f"{meta_path} 'draft': {err}") from None
    try:  # the pairing (vocabulary, width, taps) before any tensor is read
        model = sr.SpecModel(backbone, cfg, tap_mode=meta.get("tap_mode"), impl=impl)
    except ValueError as err:
        raise UserError(f"{meta_path}: {err}") from None
    bparams = unflatten_strict(open_checkpoint(path / "backbone.safetensors"), backbone.abstract_params(),
                               f"{path / 'backbone.safetensors'}")
    dparams = unflatten_strict(open_checkpoint(path / "draft.safetensors"), drafts.abstract_params(cfg),
                               f"{path / 'draft.safetensors'}")
    calibration = _calibration(path / "calibration.json", cfg.block_size)
    invariant = _calibration(path / INVARIANT_CALIBRATION, cfg.block_size)
    table = CostTable.from_json(path / "cost_table.json") if (path / "cost_table.json").is_file() else None
    tokenizer = _tokenizer(path / "tokenizer.json", backbone.vocab_size)
    weights = sr.Weights(bparams, dparams, backbone.tied(bparams), coupling_temperatures(calibration, invariant,
                                                                                          cfg.block_size))
    return Bundle(model, weights, meta["backbone"].get("family"), calibration, table, tokenizer, path, invariant)


INVARIANT_CALIBRATION = "calibration_invariant.json"


def coupling_temperatures(optimal: Calibration | None, invariant: Calibration | None, block_size: int) -> jax.Array:
    """`Weights.temperatures`: f32[K] when one calibration serves both couplings (ones without any), f32[2, K]
    (optimal, invariant) when the invariant coupling has its own."""
    def temps(cal):
        return np.asarray(cal.temperatures if cal else np.ones(block_size), np.float32)

    if invariant is None:
        return jnp.asarray(temps(optimal))
    return jnp.asarray(np.stack([temps(optimal), temps(invariant)]))


_META_KEYS = ("backbone", "draft", "tap_mode")
_BACKBONE_KEYS = ("family", "config")


def _bundle_paths(path: Path) -> tuple[Path, Path]:
    """(the bundle folder, its bundle.json) for a folder or for its bundle.json itself; a missing, looping
    or misplaced bundle.json is a UserError saying which."""
    if path.name == "bundle.json" and not path.is_dir():
        path = path.parent  # the file was named instead of its folder: use its folder
    meta_path = path / "bundle.json"
    try:
        meta_path.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UserError(f"{meta_path}: a symbolic link loop") from None
        if meta_path.is_symlink():
            raise UserError(f"{meta_path}: a symbolic link to {os.readlink(meta_path)}, which does not exist") from None
        if not path.is_dir():
            raise UserError(f"{path}: no such bundle folder" if not path.exists()
                            else f"{path}: not a folder; expected a bundle folder (bundle.json + safetensors)") from None
        raise UserError(f"{path}: not a dspark bundle (no bundle.json)") from None
    if meta_path.is_dir():
        raise UserError(f"{meta_path}: is a folder; expected the bundle's JSON file")
    return path, meta_path


def _calibration(path: Path, block_size: int) -> Calibration | None:
    """The bundle's STS temperatures, which must be one per draft position of THIS draft."""
    if not path.is_file():
        return None
    calibration = Calibration.load(path)
    if len(calibration.temperatures) != block_size:
        raise UserError(f"{path}: {len(calibration.temperatures)} temperatures for a draft of block_size "
                        f"{block_size} (one per draft position); refit it with `dspark calibrate`")
    return calibration


def _tokenizer(path: Path, vocab_size: int):
    if not path.is_file():
        return None
    from tokenizers import Tokenizer  # noqa: PLC0415  (only for a bundle with a tokenizer.json)

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 (the tokenizers library raises a bare Exception)
        raise UserError(f"{path}: not a Hugging Face tokenizer file ({err})") from None
    if tokenizer.get_vocab_size() > vocab_size:
        raise UserError(f"{path}: the tokenizer has {tokenizer.get_vocab_size()} tokens, more than the model's "
                        f"vocab_size {vocab_size}")
    return tokenizer


@functools.lru_cache(maxsize=4)
def random_bundle(backbone_config_path, draft_config_path, *, family: str = "mhc", seed: int = 0) -> Bundle:
    """Random weights for the given configs (tests, and the demo before a trained default exists).
    Cached: the same arguments give the same (hashable) model, so compiled programs are reused."""
    raw = json.loads(Path(backbone_config_path).read_text())
    backbone = make_backbone(family, raw)
    cfg = drafts.load_config(draft_config_path)
    k1, k2 = jax.random.split(jax.random.key(seed))
    bparams = backbone.init_params(k1)
    dparams = drafts.init_params(cfg, k2)
    model = sr.SpecModel(backbone, cfg)
    return Bundle(model, sr.Weights(bparams, dparams, backbone.tied(bparams), jnp.ones(cfg.block_size)), family)
