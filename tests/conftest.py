"""Test set-up shared by every test module (the shared helpers are the `helpers` package beside this file).

Eight host CPU devices so the sharding tests can build real meshes; this must happen before jax
initialises its backends, which is why it lives here and not in a test.
"""

import os
import sys
from pathlib import Path

# `python -m pytest` puts the working directory, the repository root, first on sys.path. There the
# top-level kernels/ folder (installed as dspark_jax.kernels) hides the `kernels` distribution that
# transformers >= 5 imports when it loads a model, and every torch oracle fails with "cannot import name
# 'CUDAProperties' from 'kernels'". The project is installed, so the tests never need the root on the path.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]

# Engines compile each program when first dispatched: a test dispatches few of an engine's programs, and
# compiling all of them ahead of time (the default policy, serve/compiling.py) would multiply the suite's
# time. Tests of the compile policies name theirs. Subprocesses (the CLI tests) inherit it.
os.environ.setdefault("DSPARK_COMPILE", "lazy")
# No persistent compilation cache (dspark_jax/user_cache.py): a cache enabled in the pytest process stays on
# for every later test, and loads from it would replace the compiles that tests count. What tests write to
# the user's cache folder (measured cost tables) stays in this checkout (both CI steps share it), not in
# the real home. Subprocesses inherit both.
os.environ.setdefault("DSPARK_COMPILE_CACHE", "off")
os.environ["XDG_CACHE_HOME"] = str(_ROOT / ".pytest_cache" / "user_cache")

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# Fixtures shared by several test modules.
pytest_plugins = ["helpers.fixtures"]

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module.

    XLA:CPU maps each executable's code into the process; one pytest process that keeps all of the suite's
    programs alive crosses the kernel's per-process mapping limit (vm.max_map_count, 65530), and the next
    compile dies with a segmentation fault. Tests within a module still share their compiles."""
    yield
    jax.clear_caches()
    gc.collect()
