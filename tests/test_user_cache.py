"""The user's cache folder (dspark_jax/user_cache.py, issue 40): where the compilation cache and measured
cost tables go, and that nothing is written inside a bundle folder."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from dspark_jax import user_cache
from dspark_jax.schedule import CostTable
from dspark_jax.serve import profile


def test_the_compile_cache_folder_follows_the_flag_then_the_environment_then_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("DSPARK_COMPILE_CACHE", raising=False)
    assert user_cache.compile_cache_dir(None) == tmp_path / "xdg" / "dspark" / "xla"
    assert user_cache.compile_cache_dir("off") is None
    assert user_cache.compile_cache_dir(str(tmp_path / "c")) == tmp_path / "c"
    monkeypatch.setenv("DSPARK_COMPILE_CACHE", "off")
    assert user_cache.compile_cache_dir(None) is None
    assert user_cache.compile_cache_dir(str(tmp_path / "c")) == tmp_path / "c"  # the flag wins
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DSPARK_COMPILE_CACHE")
    assert user_cache.compile_cache_dir(None) == tmp_path / "home" / ".cache" / "dspark" / "xla"


def test_cost_tables_are_cached_in_the_user_folder_keyed_by_bundle_content(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    (bundle_dir / "bundle.json").write_text('{"a": 1}')
    (bundle_dir / "draft.safetensors").write_bytes(os.urandom(3 << 20))  # over the sampled size
    measured = []

    def fake_profile(model, weights, *, slots, max_len, progress):
        measured.append((slots, max_len))
        return CostTable(np.array([1, 2]), np.array([100.0, 60.0 + len(measured)]), max_batch_tokens=16)

    monkeypatch.setattr(profile, "profile_cost_table", fake_profile)
    bundle = types.SimpleNamespace(path=str(bundle_dir), model=None, weights=None)
    before = sorted(p.name for p in bundle_dir.iterdir())

    first, where = profile.cached_cost_table(bundle, slots=8, max_len=64)
    assert where.startswith("measured now, cached at " + str(tmp_path / "xdg" / "dspark" / "cost_tables"))
    again, where = profile.cached_cost_table(bundle, slots=8, max_len=64)
    assert where.startswith("cached ") and len(measured) == 1
    assert again.to_dict() == first.to_dict()
    profile.cached_cost_table(bundle, slots=4, max_len=64)  # another shape: measured
    assert len(measured) == 2
    assert sorted(p.name for p in bundle_dir.iterdir()) == before  # nothing written inside the bundle

    # Changed weights (same size, a byte in the sampled tail): another model, measured again.
    data = bytearray((bundle_dir / "draft.safetensors").read_bytes())
    data[-1] ^= 1
    (bundle_dir / "draft.safetensors").write_bytes(bytes(data))
    _, where = profile.cached_cost_table(bundle, slots=8, max_len=64)
    assert where.startswith("measured now") and len(measured) == 3


def test_a_bundle_without_a_folder_is_measured_and_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(profile, "profile_cost_table", lambda *a, **k: CostTable(
        np.array([1]), np.array([100.0]), max_batch_tokens=16))
    _, where = profile.cached_cost_table(types.SimpleNamespace(path=None, model=None, weights=None),
                                         slots=1, max_len=64)
    assert where.startswith("measured now") and not (tmp_path / "xdg").exists()


@pytest.mark.parametrize("flag", [None, "off"])
def test_generate_compiles_into_the_user_cache_unless_off(tmp_path, flag):
    """The default of a real run (no $DSPARK_COMPILE_CACHE): programs land in <XDG_CACHE_HOME>/dspark/xla, and
    in the engine's program store inside it."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": [1, 2, 3], "max_tokens": 2}) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_COMPILE_CACHE"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    cmd = [sys.executable, "-m", "dspark_jax.cli", "generate", "--random-tiny", "--impl", "xla", "--mode", "plain",
           "--slots", "1", "--max-len", "32", "--compile", "lazy", "--prompts", str(prompts),
           "--out", str(tmp_path / "out.jsonl")] + (["--compile-cache", flag] if flag else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    cache = tmp_path / "xdg" / "dspark" / "xla"
    if flag == "off":
        assert not cache.exists()
    else:
        assert cache.is_dir() and len(list(cache.glob("*-cache"))) >= 2  # the admit and the plain step, at least
        assert len(list((cache / "dspark-programs").glob("*.program"))) >= 2  # the engine's own store too
