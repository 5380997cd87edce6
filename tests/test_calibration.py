"""STS calibration: ECE, prefix-survival labels, temperature recovery on synthetic rounds, the
outcome-selection negative control, save/load, apply under jit, and the `dspark calibrate` CLI."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import cli
from dspark_jax.calibration import (
    Calibration, default_grid, ece, ece_per_position, fit_sts, reliability, summary_ece, survival_labels)

TRUE_TEMPS = np.array([0.5, 2.0, 1.3, 3.0])


def simulate_rounds(seed, n, temps, mu=2.5, sd=3.0):
    """Synthetic held-out rounds with known temperatures.

    Raw logits z ~ N(mu, sd); the true conditional acceptance of draft k is sigmoid(z_k / T_k) and
    drafts are accepted left to right until the first rejection. The verify length m is fixed BEFORE
    the outcome, like a serving engine would: all K in 30% of rounds, by confidence in 35% (the longest
    prefix whose raw survival clears a random threshold) and by load in 35% (uniform in 0..K, blind to
    the request). So m may depend on z, never on the outcome.
    """
    rng = np.random.default_rng(seed)
    k = len(temps)
    z = rng.normal(mu, sd, size=(n, k))
    accept_prob = 1.0 / (1.0 + np.exp(-z / np.asarray(temps)))
    accepted = np.cumprod(rng.random((n, k)) < accept_prob, axis=1).sum(axis=1)
    raw_survival = np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=1)
    by_confidence = (raw_survival >= rng.uniform(0.0, 0.5, size=n)[:, None]).sum(axis=1)
    by_load = rng.integers(0, k + 1, size=n)
    kind = rng.random(n)
    verified = np.where(kind < 0.3, k, np.where(kind < 0.65, by_confidence, by_load))
    return z.astype(np.float32), np.minimum(accepted, verified), verified


@pytest.fixture(scope="module")
def rounds():
    return simulate_rounds(0, 100_000, TRUE_TEMPS)


@pytest.fixture(scope="module")
def fitted(rounds):
    return fit_sts(*rounds)


# ---------------------------------------------------------------------------------------------------
# Building blocks


def test_ece_equal_width_bins_by_hand():
    pred = [0.1, 0.12, 0.9, 0.95, 1.0]
    label = [0, 1, 1, 1, 1]
    # 10 bins: {0.1, 0.12} in bin 1 (mean 0.11 vs 0.5); {0.9, 0.95, 1.0} in bin 9 (mean 0.95 vs 1)
    assert ece(pred, label, bins=10) == pytest.approx((2 * 0.39 + 3 * 0.05) / 5)
    # one bin: |mean pred - mean label| over everything
    assert ece(pred, label, bins=1) == pytest.approx(abs(np.mean(pred) - 0.8))
    mean_pred, freq, count = reliability(pred, label, bins=10)
    np.testing.assert_array_equal(count, [0, 2, 0, 0, 0, 0, 0, 0, 0, 3])
    assert mean_pred[1] == pytest.approx(0.11) and freq[1] == 0.5 and np.isnan(freq[0])
    assert ece([], [], bins=10) == 0.0


def test_labels_are_prefix_survival_observed_up_to_verified_length():
    label, observed = survival_labels([0, 2, 1, 3], [0, 3, 2, 3], 3)
    np.testing.assert_array_equal(label, [[0, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    np.testing.assert_array_equal(observed, [[0, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])


def test_default_grid():
    grid = default_grid()
    assert grid[0] == 0.05 and grid[-1] == 20.0 and 1.0 in grid
    ratios = grid[1:] / grid[:-1]
    assert np.all(ratios > 1) and ratios.max() < 1.05


def test_summary_ece_is_count_weighted():
    assert summary_ece([0.1, 0.4], [300, 100]) == pytest.approx(0.175)


# ---------------------------------------------------------------------------------------------------
# Fitting


def test_fit_recovers_known_temperatures(fitted):
    rel_err = np.abs(np.asarray(fitted.temperatures) / TRUE_TEMPS - 1.0)
    assert np.all(rel_err < 0.10), (fitted.temperatures, rel_err)
    assert fitted.num_samples == 100_000


def test_fit_cuts_cumulative_ece_in_sample_and_held_out(rounds, fitted):
    # the raw scores are off by 5% or more ...
    assert fitted.ece_before >= 0.05
    # ... and STS brings the cumulative ECE under 2%, on the fitted rounds and on fresh ones
    assert fitted.ece_after < 0.02
    z, n, m = simulate_rounds(1, 100_000, TRUE_TEMPS)
    eces, counts = ece_per_position(z, n, m, fitted.temperatures)
    raw_eces, _ = ece_per_position(z, n, m, None)
    assert summary_ece(raw_eces, counts) >= 0.05
    assert summary_ece(eces, counts) < 0.02 and np.all(eces < 0.02), eces
    # the metadata is exactly what ece_per_position reports on the fitting rounds
    before, counts = ece_per_position(*rounds, None)
    assert fitted.ece_before == pytest.approx(summary_ece(before, counts))


def test_outcome_selected_lengths_bias_the_fit(rounds):
    """Negative control: logging 'verified up to the first rejection' (an outcome-dependent length)
    keeps position k only where drafts 1..k-1 survived, so the fit chases the conditional rate and
    the later temperatures come out far from the truth."""
    z, n, m = rounds
    biased = fit_sts(z, n, np.minimum(m, n + 1))
    rel_err = np.abs(np.asarray(biased.temperatures) / TRUE_TEMPS - 1.0)
    assert rel_err.max() > 0.3, rel_err


def test_unverified_positions_are_not_failures(rounds):
    """Negative control: pretending every round verified all K drafts turns each unverified position
    into a rejection, and the fit drifts far from the truth."""
    z, n, m = rounds
    wrong = fit_sts(z, n, np.full_like(m, z.shape[1]))
    rel_err = np.abs(np.asarray(wrong.temperatures) / TRUE_TEMPS - 1.0)
    assert rel_err.max() > 0.3, rel_err


def test_fit_leaves_unobserved_positions_alone():
    z, n, m = simulate_rounds(2, 5_000, TRUE_TEMPS[:3])
    m = np.minimum(m, 2)  # position 3 never verified
    cal = fit_sts(z, np.minimum(n, m), m)
    assert float(cal.temperatures[2]) == 1.0
    assert float(cal.temperatures[0]) != 1.0


def test_fit_with_a_custom_grid_picks_from_it():
    z, n, m = simulate_rounds(3, 20_000, TRUE_TEMPS[:2])
    cal = fit_sts(z, n, m, grid=[0.25, 0.5, 1.0, 4.0], bins=10)
    assert set(np.asarray(cal.temperatures).tolist()) <= {0.25, 0.5, 1.0, 4.0}
    assert float(cal.temperatures[0]) == 0.5


@pytest.mark.parametrize("args, match", [
    ((np.zeros(4), [0] * 4, [0] * 4), "conf_logits: expected shape"),
    ((np.full((2, 3), np.nan), [0, 0], [0, 0]), "conf_logits: row 0"),
    ((np.zeros((2, 3)), [0], [0, 0]), "num_accepted: expected shape"),
    ((np.zeros((2, 3)), [0, 0], [0, 4]), "num_verified: row 1 is 4"),
    ((np.zeros((2, 3)), [0, 3], [0, 2]), "num_accepted: row 1 is 3"),
    ((np.zeros((2, 3)), [0, -1], [0, 2]), "num_accepted: row 1 is -1"),
    ((np.zeros((2, 3)), [0, 0.5], [0, 2]), "num_accepted: expected integers"),
])
def test_fit_input_errors_name_the_field(args, match):
    with pytest.raises(ValueError, match=match):
        fit_sts(*args)
    with pytest.raises(ValueError, match="grid"):
        fit_sts(np.zeros((2, 3)), [0, 0], [1, 1], grid=[1.0, -2.0])


# ---------------------------------------------------------------------------------------------------
# The Calibration object


def test_apply_is_sigmoid_over_temperature_and_jits():
    cal = Calibration(np.array([0.5, 2.0, 1.0], np.float32))
    z = jnp.array([[1.0, -2.0, 0.3], [4.0, 2.0, -1.0]], jnp.float32)
    want = 1.0 / (1.0 + np.exp(-np.asarray(z) / np.array([0.5, 2.0, 1.0])))
    np.testing.assert_allclose(np.asarray(cal.apply(z)), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(cal.apply)(z)), want, rtol=1e-6)
    # as a pytree argument: new temperatures, same compiled function
    f = jax.jit(lambda c, x: c.apply(x))
    np.testing.assert_allclose(np.asarray(f(cal, z)), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(f(Calibration.identity(3), z)), 1 / (1 + np.exp(-np.asarray(z))),
                               rtol=1e-6)
    assert cal.apply(z[:, None, :]).shape == (2, 1, 3)
    with pytest.raises(ValueError, match="last axis of 3"):
        cal.apply(jnp.zeros((2, 4)))


def test_save_load_round_trip(tmp_path, fitted):
    path = tmp_path / "cal.json"
    fitted.save(path)
    data = json.loads(path.read_text())
    assert set(data) == {"temperatures", "ece_before", "ece_after", "num_samples"}
    assert len(data["temperatures"]) == 4
    loaded = Calibration.load(path)
    np.testing.assert_array_equal(np.asarray(loaded.temperatures), np.asarray(fitted.temperatures))
    assert loaded.ece_before == fitted.ece_before and loaded.ece_after == fitted.ece_after
    assert loaded.num_samples == fitted.num_samples
    # a file from another engine may hold only the temperatures
    (tmp_path / "sglang.json").write_text('{"temperatures": [1.2, 0.9]}')
    foreign = Calibration.load(tmp_path / "sglang.json")
    assert np.asarray(foreign.temperatures).tolist() == pytest.approx([1.2, 0.9])
    assert foreign.ece_before is None and foreign.num_samples == 0


@pytest.mark.parametrize("text, match", [
    ("[1, 2]", "key 'temperatures'"),
    ('{"temps": [1.0]}', "key 'temperatures'"),
    ('{"temperatures": []}', "'temperatures' must be"),
    ('{"temperatures": [1.0, 0.0]}', "'temperatures' must be"),
    ('{"temperatures": [1.0, "x"]}', "'temperatures' must be"),
    ('{"temperatures": [1.0], "ece_after": -1}', "'ece_after'"),
    ('{"temperatures": [1.0], "num_samples": 2.5}', "'num_samples'"),
    ("{oops", "not valid JSON"),
])
def test_load_errors_name_the_field(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        Calibration.load(path)


# ---------------------------------------------------------------------------------------------------
# dspark calibrate


def write_records(path, z, n, m):
    with open(path, "w") as f:
        for zi, ni, mi in zip(z, n, m):
            f.write(json.dumps({"logits": [float(v) for v in zi], "num_accepted": int(ni),
                                "num_verified": int(mi)}) + "\n")


def run_cli(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", sys.argv[:])  # cli.main rewrites sys.argv; restore it after
    return cli.main(["calibrate", *map(str, argv)])


def test_calibrate_cli_writes_json_and_one_png_per_position(tmp_path, monkeypatch, capsys):
    z, n, m = simulate_rounds(4, 400, TRUE_TEMPS[:3])
    records = tmp_path / "records.jsonl"
    write_records(records, z, n, m)
    out, plots = tmp_path / "out" / "cal.json", tmp_path / "plots"
    assert run_cli(monkeypatch, records, "--out", out, "--plot-dir", plots, "--bins", 10) == 0
    cal = Calibration.load(out)
    assert cal.num_positions == 3 and cal.num_samples == 400
    np.testing.assert_array_equal(np.asarray(cal.temperatures),
                                  np.asarray(fit_sts(z, n, m, bins=10).temperatures))
    for k in (1, 2, 3):
        png = plots / f"reliability_k{k}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (plots / "reliability_k4.png").exists()
    assert "ECE" in capsys.readouterr().out


@pytest.mark.parametrize("lines, match", [
    (['{"logits": [1, 2], "num_accepted": 0, "num_verified": 1}', '{"logits": [1, 2], "num_verified": 1}'],
     "line 2: missing field 'num_accepted'"),
    (['{"logits": [1, 2], "num_accepted": 0, "num_verified": 1}', "",
      '{"logits": [1, 2, 3], "num_accepted": 0, "num_verified": 1}'],
     "line 3: field 'logits' has 3 values, expected 2"),
    (['{"logits": [1, 2], "num_accepted": 2, "num_verified": 1}'], "line 1: field 'num_accepted'"),
    (['{"logits": [1, 2], "num_accepted": 0, "num_verified": 3}'], "line 1: field 'num_verified'"),
    (['{"logits": [1, 2], "num_accepted": true, "num_verified": 1}'], "line 1: field 'num_accepted'"),
    (['{"logits": [1, "a"], "num_accepted": 0, "num_verified": 1}'], "line 1: field 'logits'"),
    (['{"logits": [1, 2], "num_accepted": 0, "num_verified": 1}', "not json"], "line 2: not valid JSON"),
    ([""], "no records"),
    (['{"logits": [1, 2], "num_accepted": 0, "num_verified": 1}', b'{"logits": [1, 2]\xff}'],
     "line 2: not UTF-8 text (byte 17)"),
])
def test_calibrate_cli_bad_records_name_line_and_field(tmp_path, monkeypatch, capsys, lines, match):
    records = tmp_path / "records.jsonl"
    records.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    assert run_cli(monkeypatch, records, "--out", tmp_path / "cal.json") == 2
    err = capsys.readouterr().err
    assert match in err and str(records) in err
    assert not (tmp_path / "cal.json").exists()


def test_calibrate_cli_refuses_records_with_no_verified_position(tmp_path, monkeypatch, capsys):
    records = tmp_path / "records.jsonl"
    records.write_text('{"logits": [1, 2], "num_accepted": 0, "num_verified": 0}\n' * 3)
    assert run_cli(monkeypatch, records, "--out", tmp_path / "cal.json") == 2
    err = capsys.readouterr().err
    assert str(records) in err and "no position was verified" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cal.json").exists()


def test_calibrate_cli_warns_about_positions_no_record_verified(tmp_path, monkeypatch, capsys):
    z, n, m = simulate_rounds(4, 400, TRUE_TEMPS)
    m = np.minimum(m, 2)  # positions 3 and 4 never verified
    records = tmp_path / "records.jsonl"
    write_records(records, z, np.minimum(n, m), m)
    assert run_cli(monkeypatch, records, "--out", tmp_path / "cal.json", "--plot-dir", tmp_path / "plots") == 0
    err = capsys.readouterr().err
    assert f"{records}: no record verified position(s) 3, 4; their temperature stays 1.0" in err
    assert [float(t) for t in Calibration.load(tmp_path / "cal.json").temperatures[2:]] == [1.0, 1.0]
