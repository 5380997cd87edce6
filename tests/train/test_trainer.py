"""The trainer (dspark_jax.train.trainer): the jitted step on one device, an 8-device mesh and two processes,
checkpoint resume, the frozen backbone, and the DeepSpec family on a Qwen3 backbone."""

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CONFIGS
from helpers.train import fixed_batch, initial_params, make_trainer, one_device, run_config

from dspark_jax.errors import UserError
from dspark_jax.parallel import make_mesh
from dspark_jax.train.trainer import micro_loss, step_normalizer


def test_loss_falls_on_a_fixed_batch(trainer1):
    tr = trainer1
    tr.state = tr._init_state(initial_params(*_paths(tr))[0])
    batch = fixed_batch()
    hist = [jax.device_get(tr.step(batch)) for _ in range(8)]
    losses = [float(h["loss"]) for h in hist]
    assert all(np.isfinite(losses))
    # Measured: 2.44 -> 2.12 in 8 steps (-13%; the run's 10-step cosine schedule flattens it at ~2.11).
    # With the random backbone of an earlier init it was 2.51 -> 2.11 (-16%), which the old bound of 0.85
    # was set against; the end point is the same. Steps that do not update the draft leave it unchanged.
    assert losses[-1] < 0.9 * losses[0], losses
    assert float(hist[-1]["l1"]) < float(hist[0]["l1"])  # the draft moves toward the backbone
    assert hist[0]["supervised_slots"] > 100


def _paths(tr):
    return str(tr.cfg.draft.config), str(tr.cfg.backbone.config)


def test_draft_init_starts_from_the_given_params(trainer1, model_files, tmp_path):
    """draft.init (`dspark train --init`, continued training): the optimizer starts from the checkpoint's
    parameters, bit for bit, not from a random init; the checkpoint is a plain params tree."""
    from dspark_jax.checkpoint.orbax_io import save_params
    from dspark_jax.train.config import RunConfig
    from dspark_jax.train.trainer import Trainer

    dp, bp = initial_params(*_paths(trainer1))
    given = jax.tree.map(lambda x: np.asarray(x, np.float32) + 0.25, dp)  # no random init equals this
    path = save_params(tmp_path / "init", given)
    raw = run_config(model_files, tmp_path / "run", draft={"config": str(model_files / "draft.json"),
                                                             "init": str(path)})
    tr = Trainer(RunConfig.from_dict(raw), mesh=one_device(), backbone_params=bp)
    assert tr.spec == trainer1.spec  # the same compiled step: only the starting point differs
    for a, b in zip(jax.tree.leaves(tr.state.params), jax.tree.leaves(given)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_backbone_gets_no_update_and_no_gradient(trainer1):
    tr = trainer1
    dp, bp = initial_params(*_paths(tr))
    tr.state = tr._init_state(dp)
    batch = fixed_batch()
    for _ in range(2):
        tr.step(batch)
    # The optimizer holds exactly the draft's parameters; the backbone's are untouched, bit for bit.
    assert jax.tree.structure(tr.state.params) == jax.tree.structure(dp)
    for a, b in zip(jax.tree.leaves(tr.backbone_params), jax.tree.leaves(bp)):
        np.testing.assert_array_equal(a, b)
    # d loss / d backbone params == 0 exactly, although the loss does depend on them.
    spec = tr.spec
    mb = {k: jnp.asarray(v[0]) for k, v in batch.items()}
    norm = step_normalizer(spec, {k: jnp.asarray(v) for k, v in batch.items()})
    vg = jax.jit(jax.value_and_grad(lambda bb: micro_loss(spec, tr.state.params, bb, mb, norm)[0]))
    bb = jax.tree.map(jnp.asarray, bp)
    value, grads = vg(bb)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))
    shifted = jax.tree.map(lambda x: x * 1.1 if x.dtype == jnp.float32 else x, bb)
    assert abs(float(vg(shifted)[0]) - float(value)) > 1e-4


def _snapshot(tr):
    return jax.device_get(tr.state.params), jax.device_get(tr.state.opt_state)


def test_resume_from_checkpoint_is_bit_identical(model_files, tmp_path):
    mesh = one_device()
    tr = make_trainer(model_files, tmp_path / "run", mesh)
    tr.fit(until=4, progress=False)
    want = _snapshot(tr)
    assert sorted(tr.manager.all_steps()) == [2, 4]
    log = tmp_path / "run" / "metrics.jsonl"
    first = [json.loads(x) for x in log.read_text().splitlines()]
    tr2 = make_trainer(model_files, tmp_path / "run", mesh)
    assert tr2.restore(step=2) == 2
    assert int(tr2.state.step) == 2
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2]  # rewound with the state
    tr2.fit(until=4, progress=False)
    got = _snapshot(tr2)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]  # no step logged twice
    for r in recs[-2:]:
        assert r.keys() >= {"loss", "ce", "l1", "conf", "accept_rate@1", "accept_rate@5", "tau_estimate",
                            "conf_bias", "lr", "grad_norm", "tokens_per_s"}
    strip = lambda r: {k: v for k, v in r.items() if k != "tokens_per_s"}  # noqa: E731
    assert [strip(r) for r in first] == [strip(r) for r in recs]


def _corrupt(step_dir):
    """Truncate every data file of a checkpoint to half its size (a torn write)."""
    files = [f for f in step_dir.rglob("*") if f.is_file() and f.stat().st_size > 0]
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return len(files)


def test_resume_skips_a_corrupt_latest_checkpoint_and_keeps_it(model_files, tmp_path):
    mesh = one_device()
    run = tmp_path / "run"
    tr = make_trainer(model_files, run, mesh)
    tr.fit(until=4, progress=False)
    want = _snapshot(tr)
    assert _corrupt(run / "checkpoints" / "4") > 0
    tr2 = make_trainer(model_files, run, mesh)
    with pytest.warns(UserWarning, match=r"checkpoints/4 is unreadable .* it is kept, trying the previous one"):
        assert tr2.restore() == 2
    assert (run / "checkpoints" / "4").is_dir()  # kept, not deleted
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    with pytest.warns(UserWarning, match="unreadable checkpoint of step 4 moved to"):
        tr2.fit(until=4, progress=False)
    for a, b in zip(jax.tree.leaves(_snapshot(tr2)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    assert len(list((run / "unreadable_checkpoints").iterdir())) == 1
    assert make_trainer(model_files, run, mesh).restore() == 4  # the re-saved step 4 is intact
    # every checkpoint unreadable: a clear error naming the folder, nothing moved
    for step in (2, 4):
        _corrupt(run / "checkpoints" / str(step))
    with pytest.warns(UserWarning), pytest.raises(UserError, match=r"no intact checkpoint in .*checkpoints"):
        make_trainer(model_files, run, mesh).restore()
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]


@pytest.fixture(scope="module")
def mesh_results(model_files, tmp_path_factory):
    """Two steps on one device (one batch of 8) and on a data=2 x fsdp=2 x expert=2 mesh of 8 devices
    (two accumulated micro-batches of 4): same sequences, so the same numbers."""
    out = {}
    for name, mesh, accum in (("one", one_device(), 1), ("mesh", make_mesh(2, 2, 2), 2)):
        tr = make_trainer(model_files, tmp_path_factory.mktemp(name), mesh, grad_accum=accum)
        batch = fixed_batch(accum)
        metrics = [jax.device_get(tr.step(batch))]
        mu = jax.device_get(adam_mu(tr.state))
        metrics.append(jax.device_get(tr.step(batch)))
        out[name] = (metrics, mu, tr)
    return out


def adam_mu(state):
    """Adam's first moment: linear in the (clipped) gradients, so it shows the sharded gradient sums
    without Adam's g / (|g| + eps), which maps rounding noise on near-zero gradients to +-lr steps."""
    return state.opt_state[1][0].mu


def _assert_same_step(a, b):
    """Metrics of both steps (the second at the updated parameters) and Adam's first moment after the
    first step (= 0.1 x the clipped gradient) to 1e-5 of its largest entry: elementwise relative error
    is meaningless where a gradient sum cancels to ~0. (Later moments are not compared: Adam's first
    update g / (|g| + eps) turns rounding noise on those near-zero gradients into +-lr steps.)"""
    (ma, pa), (mb, pb) = a, b
    for x, y in zip(ma, mb):
        for key in ("loss", "ce", "l1", "conf", "accept_rate", "tau_estimate", "conf_bias", "grad_norm", "lr",
                    "supervised_slots"):
            # atol 1e-6: conf_bias is a difference of two O(1) means (~1e-3), so it carries their rounding
            np.testing.assert_allclose(x[key], y[key], rtol=1e-5, atol=1e-6, err_msg=key)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(pa))
    assert scale > 0
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_step_on_8_device_mesh_equals_one_device(mesh_results):
    metrics, mu, tr = mesh_results["mesh"]
    _assert_same_step(mesh_results["one"][:2], (metrics, mu))
    w1 = tr.state.params["blocks_0"]["ffn"]["experts"]["w1"]
    assert "expert" in str(w1.sharding.spec) and len(w1.sharding.device_set) == 8
    mu = tr.state.opt_state[1][0].mu["blocks_0"]["ffn"]["experts"]["w1"]
    assert mu.sharding == w1.sharding  # the Adam moments follow their parameters
    assert tr.compiled.batch_shardings["tokens"].spec[1] == ("data", "fsdp")


WORKER = textwrap.dedent("""
    import os, sys, json, pickle
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from jax.experimental import multihost_utils
    from dspark_jax.train.config import DistributedConfig, RunConfig
    from dspark_jax.train.trainer import Trainer, init_distributed
    from dspark_jax.parallel import make_mesh

    pid, port, work = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    init_distributed(DistributedConfig(coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=pid))
    assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    with open(os.path.join(work, "inputs.pkl"), "rb") as f:
        raw, draft_params, backbone_params, batch = pickle.load(f)
    trainer = Trainer(RunConfig.from_dict(raw), mesh=make_mesh(2, 2, 2), draft_params=draft_params,
                      backbone_params=backbone_params)
    half = batch["tokens"].shape[1] // 2
    local = {k: v[:, pid * half:(pid + 1) * half] for k, v in batch.items()}
    metrics = [jax.device_get(trainer.step(local))]
    mu = multihost_utils.process_allgather(trainer.state.opt_state[1][0].mu, tiled=True)
    metrics.append(jax.device_get(trainer.step(local)))
    if pid == 0:
        with open(os.path.join(work, "out.pkl"), "wb") as f:
            pickle.dump((metrics, jax.device_get(mu)), f)
    print("worker", pid, "done", flush=True)
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one_process(mesh_results, model_files, tmp_path):
    """jax.distributed with CPU (gloo) collectives: 2 processes x 4 devices run the step of the
    8-device mesh, each feeding its half of the batch."""
    raw = run_config(model_files, tmp_path / "run", grad_accum=2)
    dp, bp = initial_params(str(model_files / "draft.json"), str(model_files / "backbone.json"))
    with open(tmp_path / "inputs.pkl", "wb") as f:
        pickle.dump((raw, dp, bp, fixed_batch(2)), f)
    (tmp_path / "worker.py").write_text(WORKER)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(pid), str(port), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=900)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    assert all(p.returncode == 0 for p in procs), "\n\n".join(x[-3000:] for x in logs)
    with open(tmp_path / "out.pkl", "rb") as f:
        metrics, mu = pickle.load(f)
    m_ref, mu_ref, _ = mesh_results["mesh"]
    _assert_same_step((m_ref, mu_ref), (metrics, mu))


def test_dspark_train_trains_the_deepspec_family(tmp_path):
    """The trainer runs unchanged on a Qwen3 backbone + DeepSpec draft: taps at layer outputs by
    default, a conflicting tap mode is refused, the loss falls on a fixed batch."""
    from dspark_jax.parallel import make_mesh
    from dspark_jax.train import data as D
    from dspark_jax.train.config import RunConfig
    from dspark_jax.train.trainer import Trainer

    data = CONFIGS.parent / "tests" / "data" / "tiny_train.jsonl"
    raw = {"run_dir": str(tmp_path / "run"), "steps": 10, "global_batch": 4, "compute_dtype": "float32",
           "compiler_options": {"xla_backend_optimization_level": 0},
           "backbone": {"family": "qwen3", "config": str(CONFIGS / "tiny_qwen3_backbone.json")},
           "draft": {"config": str(CONFIGS / "tiny_deepspec.json")},
           "data": {"train": [str(data)], "seq_len": 32, "shuffle_buffer": 8, "anchors_per_seq": 4},
           "optim": {"lr": 3e-3, "warmup_frac": 0.1}, "loss": {"vocab_chunk": 128}, "log": {"every": 1}}
    mesh = make_mesh(devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="reads backbone taps 'output'"):
        Trainer(RunConfig.from_dict({**raw, "backbone": {**raw["backbone"], "tap_mode": "entry"}}), mesh=mesh)
    tr = Trainer(RunConfig.from_dict(raw), mesh=mesh)
    assert tr.spec.tap_mode == "output" and tr.spec_pair()[0].tap_mode == "output"
    batch = next(D.Batches(D.JsonlStream(D.DataConfig(train=(str(data),), seq_len=32, shuffle_buffer=8, seed=0,
                                                      anchors_per_seq=4), process_index=0, process_count=1),
                           per_host_batch=4))
    losses = [float(jax.device_get(tr.step(batch))["loss"]) for _ in range(6)]
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], losses


def _no_compile(*_args, **_kw):
    raise AssertionError("the trainer compiled before checking its inputs")


@pytest.mark.parametrize("case", ["empty data file", "every line bad", "run_dir a file", "run_dir under a file"])
def test_bad_inputs_are_refused_before_the_compile(model_files, tmp_path, monkeypatch, case):
    """Issue 40: an empty data file, a file of only bad lines and a run_dir that cannot be a folder are
    named before the training step compiles (minutes at real sizes), not after."""
    from dspark_jax.train import trainer as trainer_mod
    from dspark_jax.train.config import RunConfig
    from dspark_jax.train.trainer import Trainer

    monkeypatch.setattr(trainer_mod, "compile_step", _no_compile)
    data, run = tmp_path / "train.jsonl", tmp_path / "run"
    from helpers.train import DATA

    data.write_text(DATA.read_text())
    want = {"empty data file": "has no records", "every line bad": "every record of host 0 is bad",
            "run_dir a file": "is a file; expected a folder", "run_dir under a file": "the folder cannot be created"}[case]
    if case == "empty data file":
        data.write_text("\n")
    elif case == "every line bad":
        data.write_text('{"tokens": "not a list"}\nnot json\n')
    elif case == "run_dir a file":
        run.write_text("x")
    else:
        (tmp_path / "file").write_text("x")
        run = tmp_path / "file" / "run"
    cfg = RunConfig.from_dict(run_config(model_files, run, data={"train": [str(data)], "seq_len": 48,
                                                                 "shuffle_buffer": 16, "anchors_per_seq": 6}))
    with pytest.raises(UserError, match=want) as info:
        Trainer(cfg, mesh=one_device())
    assert ("run_dir" if case.startswith("run_dir") else "data.train") in str(info.value)
