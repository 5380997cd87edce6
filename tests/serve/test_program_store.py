"""The engine's program store (serve/program_store.py): a second engine, in a process that compiled
nothing, loads its programs from disk without tracing or compiling, and serves the same tokens."""

from __future__ import annotations

import copy
import logging
import os

import jax
import numpy as np
import pytest
from helpers import oracle_propose
from helpers import random_prompts as prompts
from helpers.spec import CFG, family

from dspark_jax import spec_round as sr
from dspark_jax.schedule import CostTable
from dspark_jax.serve import program_store
from dspark_jax.serve.engine import Engine, EngineConfig, Request

MAXLEN = 64


def _engine(mode="async"):
    bb, weights = family("mhc")
    model = sr.SpecModel(bb, CFG, impl="xla", propose_fn=oracle_propose)
    table = CostTable(np.array([1]), np.array([100.0]), max_batch_tokens=16)  # verifying is free
    return Engine(model, weights, EngineConfig(mode=mode, max_slots=2, max_len=MAXLEN, progress=False,
                                               compile="lazy"), table)


def _serve(eng):
    reqs = [Request(p, max_tokens=12, temperature=float(i), seed=i, id=i) for i, p in enumerate(prompts(2, seed=4))]
    return [r.tokens for r in eng.generate(reqs)]


@pytest.fixture
def store(tmp_path):
    program_store.enable(tmp_path / "programs")
    yield tmp_path / "programs"
    program_store.enable(None)


_PROGRAMS = ("admit", "plain_rounds", "spec_rounds", "catch_up", "evict")  # serve/decode_state.py


@pytest.fixture
def engine_compiles(caplog):
    """-> a function giving the engine programs JAX traced or compiled since the last call (JAX logs each
    by its function's name under jax.log_compiles; small eager ops such as the state's allocation also
    compile, and are not engine programs)."""
    caplog.set_level(logging.DEBUG)

    def names():
        found = sorted({n for r in caplog.records for n in _PROGRAMS if f" {n} " in f" {r.getMessage()} "})
        caplog.clear()
        return found

    with jax.log_compiles(True):
        yield names


def _fresh_process_state():
    jax.clear_caches()  # nothing compiled in memory: what the second engine runs comes from the store


@pytest.mark.slow  # compiles an async engine's programs twice over: minutes on 2 cores
def test_a_second_engine_loads_every_program_from_the_store_without_tracing(store, engine_compiles):
    """The first engine compiles and stores its programs; a second one, with nothing compiled in the process,
    loads them (no trace, no compile) and serves the same tokens, greedy and sampled; the greedy request is
    plain decoding's. A program file that cannot be read back is compiled again and rewritten."""
    want = _serve(_engine())
    files = sorted(store.glob("*.program"))
    assert len(files) >= 3  # admit, plain step, speculative round at least
    assert set(engine_compiles()) >= {"admit", "plain_rounds", "spec_rounds"}  # the check sees them
    _fresh_process_state()
    assert _serve(_engine()) == want
    assert engine_compiles() == []
    assert sorted(store.glob("*.program")) == files  # nothing new to store

    program_store.enable(None)
    assert _serve(_engine(mode="plain"))[0] == want[0]  # the jitted programs, no store: plain decoding

    program_store.enable(store)
    for f in files[::2]:
        f.write_bytes(b"not a program")
    _fresh_process_state()
    assert _serve(_engine()) == want
    assert engine_compiles() != []
    assert sorted(store.glob("*.program")) == files and all(f.stat().st_size > 100 for f in files)
    assert not list(store.glob("*.partial"))


def test_the_key_names_the_code_the_settings_the_static_options_and_the_shapes(monkeypatch):
    x = jax.ShapeDtypeStruct((2, 3), np.float32)
    base = program_store.program_key("f", (1, [("width", 4)]), (x,))
    assert base == program_store.program_key("f", (1, [("width", 4)]), (jax.ShapeDtypeStruct((2, 3), np.float32),))
    assert base != program_store.program_key("g", (1, [("width", 4)]), (x,))
    assert base != program_store.program_key("f", (1, [("width", 8)]), (x,))
    assert base != program_store.program_key("f", (1, [("width", 4)]), (jax.ShapeDtypeStruct((2, 4), np.float32),))
    assert base != program_store.program_key("f", (1, [("width", 4)]), (jax.ShapeDtypeStruct((2, 3), np.int32),))
    assert base != program_store.program_key("f", (1, [("width", 4)]), ((x,),))
    with jax.default_matmul_precision("bfloat16"):  # the suite runs at "highest"
        assert base != program_store.program_key("f", (1, [("width", 4)]), (x,))
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", flags + " --xla_cpu_enable_fast_math=true")
    assert base != program_store.program_key("f", (1, [("width", 4)]), (x,))
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert base == program_store.program_key("f", (1, [("width", 4)]), (x,))
    monkeypatch.setattr(program_store, "source_digest", lambda: "edited")
    assert base != program_store.program_key("f", (1, [("width", 4)]), (x,))


def test_the_key_is_the_same_in_every_process_and_misses_what_it_cannot_describe():
    """The static model is described by value (its default repr names a memory address, which differs in
    every process); a function it cannot name by module (a closure, a lambda) makes the key miss instead
    of colliding with another."""
    bb, _ = family("mhc")
    x = (jax.ShapeDtypeStruct((2, 3), np.float32),)
    one = sr.SpecModel(bb, CFG, impl="xla")
    other = sr.SpecModel(copy.copy(bb), copy.deepcopy(CFG), impl="xla")
    assert repr(one) != repr(other)  # the addresses
    assert program_store.program_key("f", (one,), x) == program_store.program_key("f", (other,), x)
    assert "0x" not in program_store.stable_repr(one)
    assert program_store.program_key("f", (one,), x) != program_store.program_key(
        "f", (sr.SpecModel(bb, CFG, impl="pallas"),), x)
    lambdas = [lambda *a: a, lambda *a: a]  # both alive: two addresses
    keys = [program_store.program_key("f", (sr.SpecModel(bb, CFG, propose_fn=f),), x) for f in lambdas]
    assert keys[0] != keys[1]
