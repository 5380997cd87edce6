"""Serving bundles (dspark_jax/bundle.py): every broken file is a UserError naming the file and what is
wrong, never a library traceback or a silently wrong model; a saved bundle records its draft family's tap mode."""

import json
import shutil

import numpy as np
import pytest
from helpers.deepspec import CFG, pair

from dspark_jax.bundle import load_bundle
from dspark_jax.errors import UserError

SOURCE = __import__("pathlib").Path(__file__).resolve().parents[1] / "dspark_jax" / "assets" / "default_qwen3"


@pytest.fixture
def bundle(tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(SOURCE, dst, ignore=shutil.ignore_patterns("cost_tables", "logs"))
    return dst


def _edit_json(path, change):
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d))


def _edit_tensors(path, change):
    from dspark_jax.checkpoint.safetensors_io import open_checkpoint, save_file

    src = open_checkpoint(path)
    tensors = {n: np.asarray(src.read(n)) for n in src.names}
    del src
    change(tensors)
    save_file(path, tensors)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


CASES = {  # name: (break the bundle, the file the message names, a phrase it contains)
    "no bundle.json": (lambda b: (b / "bundle.json").unlink(), "b", "not a dspark bundle"),
    "bundle.json not JSON": (lambda b: (b / "bundle.json").write_text('{"draft": '), "bundle.json",
                             "not valid JSON (Expecting value at line 1 column 11)"),
    "bundle.json not UTF-8": (lambda b: (b / "bundle.json").write_bytes(b'{"x": "\xff"}'), "bundle.json", "not UTF-8"),
    "bundle.json a list": (lambda b: (b / "bundle.json").write_text("[]"), "bundle.json", "expected a JSON object"),
    "no backbone key": (lambda b: _edit_json(b / "bundle.json", lambda d: d.pop("backbone")), "bundle.json",
                        "missing key 'backbone'"),
    # bundle.json is strict like every other config reader (issue 40)
    "unknown top-level key": (lambda b: _edit_json(b / "bundle.json", lambda d: d.update(comment="x")), "bundle.json",
                              "unknown key 'comment'; expected some of backbone, draft, tap_mode"),
    "top-level key typo": (lambda b: _edit_json(b / "bundle.json", lambda d: d.update(tap_mod=d.pop("tap_mode"))),
                           "bundle.json", "unknown key 'tap_mod' (did you mean 'tap_mode'?)"),
    "backbone key typo": (lambda b: _edit_json(b / "bundle.json", lambda d: d["backbone"].update(
        confg=d["backbone"].pop("config"))), "bundle.json 'backbone'", "(did you mean 'config'?)"),
    "bundle.json a symlink loop": (lambda b: ((b / "bundle.json").unlink(), (b / "bundle.json").symlink_to(b / "bundle.json")),
                                   "bundle.json", "a symbolic link loop"),
    "bundle.json a dangling symlink": (lambda b: ((b / "bundle.json").unlink(),
                                                  (b / "bundle.json").symlink_to(b / "gone.json")),
                                       "bundle.json", "gone.json, which does not exist"),
    "bundle.json a folder": (lambda b: ((b / "bundle.json").unlink(), (b / "bundle.json").mkdir()), "bundle.json",
                             "is a folder; expected the bundle's JSON file"),
    "draft key typo": (lambda b: _edit_json(b / "bundle.json", lambda d: d["draft"].update(markov_rnak=3)),
                       "bundle.json", "markov_rank"),
    "truncated draft": (lambda b: _truncate(b / "draft.safetensors"), "draft.safetensors", "truncated"),
    "missing backbone weights": (lambda b: (b / "backbone.safetensors").unlink(), "backbone.safetensors", ""),
    "tokenizer garbage": (lambda b: (b / "tokenizer.json").write_text("garbage"), "tokenizer.json",
                          "not a Hugging Face tokenizer file"),
    "calibration for another K": (lambda b: _edit_json(b / "calibration.json",
                                                       lambda d: d.update(temperatures=d["temperatures"][:2])),
                                  "calibration.json", "2 temperatures for a draft of block_size"),
    "invariant calibration for another K": (
        lambda b: (b / "calibration_invariant.json").write_text('{"temperatures": [1, 1]}'),
        "calibration_invariant.json", "2 temperatures for a draft of block_size"),
    "calibration NaN": (lambda b: (b / "calibration.json").write_text('{"temperatures": [NaN, 1, 1, 1, 1, 1, 1]}'),
                        "calibration.json", "temperatures"),
    # the one strict tree check (dspark_jax.checkpoint.trees.check_tree) names the leaf and the file
    "draft tensor missing": (lambda b: _edit_tensors(b / "draft.safetensors", lambda t: t.pop(min(t))),
                             "draft.safetensors", "tensors do not match: missing ['"),
    "draft tensor unexpected": (lambda b: _edit_tensors(b / "draft.safetensors",
                                                        lambda t: t.update({"bogus.weight": np.zeros(2, np.float32)})),
                                "draft.safetensors", "unexpected ['bogus.weight']"),
    "backbone tensor mis-shaped": (lambda b: _edit_tensors(b / "backbone.safetensors",
                                                           lambda t: t.update({"norm.scale": t["norm.scale"][:-1]})),
                                   "backbone.safetensors", "tensor 'norm.scale' has shape ["),
    # dtypes and values: an integer tensor or a NaN would load as silently wrong weights
    "draft tensor NaN": (lambda b: _edit_tensors(b / "draft.safetensors", lambda t: t["norm.scale"].__setitem__(0, np.nan)),
                         "draft.safetensors", "tensor 'norm.scale': 1 non-finite value(s)"),
    "backbone tensor inf": (lambda b: _edit_tensors(b / "backbone.safetensors",
                                                    lambda t: t["norm.scale"].__setitem__(slice(0, 2), np.inf)),
                            "backbone.safetensors", "tensor 'norm.scale': 2 non-finite value(s)"),
    "draft tensor int": (lambda b: _edit_tensors(b / "draft.safetensors",
                                                 lambda t: t.update({"norm.scale": t["norm.scale"].astype(np.int32)})),
                         "draft.safetensors", "tensor 'norm.scale' is stored as I32, expected a float format"),
    "draft tensor bool": (lambda b: _edit_tensors(b / "draft.safetensors",
                                                  lambda t: t.update({"norm.scale": t["norm.scale"] > 0})),
                          "draft.safetensors", "tensor 'norm.scale' is stored as BOOL"),
    # the draft paired with the backbone (vocabulary, width, depth, taps), before any tensor is read
    "draft vocab differs": (lambda b: _edit_json(b / "bundle.json", lambda d: d["draft"].update(
        vocab_size=2 * d["draft"]["vocab_size"], mask_token_id=0)), "bundle.json", "'vocab_size': expected the backbone's"),
    "draft target depth differs": (lambda b: _edit_json(b / "bundle.json", lambda d: d["draft"].update(
        num_target_layers=d["draft"]["num_target_layers"] + 1)), "bundle.json", "'num_target_layers'"),
    "draft tap ids as a string": (lambda b: _edit_json(b / "bundle.json", lambda d: d["draft"].update(
        target_layer_ids="012")), "bundle.json", "'target_layer_ids'"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_broken_bundle_file_is_named(bundle, name):
    brk, file, phrase = CASES[name]
    brk(bundle)
    with pytest.raises(UserError) as info:
        load_bundle(bundle)
    msg = str(info.value)
    assert file in msg and phrase in msg, msg


def test_the_intact_copy_loads(bundle):
    b = load_bundle(bundle)
    assert b.tokenizer is not None and b.calibration is not None and b.invariant_calibration is not None
    np.testing.assert_allclose(np.asarray(b.weights.temperatures),
                               [b.calibration.temperatures, b.invariant_calibration.temperatures], rtol=1e-6)


def test_an_invariant_calibration_gives_invariant_rows_their_own_temperatures(bundle):
    """calibration_invariant.json present: Weights.temperatures holds both (optimal, invariant), and each row of a
    round divides its confidence logits by its own coupling's."""
    import jax.numpy as jnp

    from dspark_jax.spec_round import row_temperatures

    optimal = json.loads((bundle / "calibration.json").read_text())["temperatures"]
    k = len(optimal)
    inv = [0.5 + 0.25 * i for i in range(k)]
    (bundle / "calibration_invariant.json").write_text(json.dumps({"temperatures": inv}))
    b = load_bundle(bundle)
    np.testing.assert_allclose(np.asarray(b.weights.temperatures), [optimal, inv], rtol=1e-6)
    (bundle / "calibration_invariant.json").unlink()  # without it, one calibration serves both
    np.testing.assert_allclose(np.asarray(load_bundle(bundle).weights.temperatures), optimal, rtol=1e-6)
    rows = np.asarray(row_temperatures(b.weights.temperatures, jnp.asarray([False, True, True])))
    np.testing.assert_allclose(rows, [optimal, inv, inv], rtol=1e-6)
    one = np.asarray(row_temperatures(jnp.asarray(optimal), jnp.asarray([False, True])))
    np.testing.assert_allclose(one, [optimal, optimal], rtol=1e-6)


def test_a_bundle_json_path_loads_its_folder(bundle):
    assert load_bundle(bundle / "bundle.json").path == bundle


def test_a_missing_bundle_folder_or_a_file_is_named(tmp_path):
    with pytest.raises(UserError, match="no such bundle folder"):
        load_bundle(tmp_path / "nowhere")
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(UserError, match="weights.bin: not a folder"):
        load_bundle(tmp_path / "weights.bin")


def test_a_bundle_records_the_family_tap_mode(tmp_path):
    from dspark_jax.bundle import load_bundle, save_bundle

    bb, weights = pair()
    save_bundle(tmp_path, backbone_family="qwen3", backbone=bb, backbone_params=weights.backbone, draft_cfg=CFG,
                draft_params=weights.draft)
    assert json.loads((tmp_path / "bundle.json").read_text())["tap_mode"] == "output"
    assert load_bundle(tmp_path, impl="xla").model.tap_mode == "output"
