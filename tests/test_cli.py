"""The serving CLIs end to end on the tiny random model: profile a cost table, generate with it."""

import json
import math

import pytest

from dspark_jax.cli import main
from dspark_jax.schedule import CostTable


@pytest.mark.slow  # 20-65 s: in the CI's slow step, to keep the default suite near 20 min
def test_profile_then_generate_async(tmp_path, capsys):
    table = tmp_path / "cost.json"
    assert main(["profile", "--random-tiny", "--impl", "xla", "--slots", "2", "--max-len", "64", "--repeats", "1",
                 "--out", str(table)]) == 0
    t = CostTable.from_json(table)
    # the widths the engine compiles for K = 5: 1, 2, 4 and K + 1
    assert t.batch_tokens.tolist() == [2 * w for w in (1, 2, 4, 6)] and (t.steps_per_sec > 0).all()
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"tokens": [1, 2, 3], "max_tokens": 5, "id": "a"}\n{"prompt": "no tokenizer"}\n'
                        b'not json\n{"tokens": [4, 5], "max_tokens": 4, "temperature": 1.0, "id": "b"}\n'
                        b'{"tokens": [1], "id": "\xff"}\n{"tokens": [1], "top_k": 1e10, "id": "k"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--random-tiny", "--impl", "xla", "--prompts", str(prompts), "--out", str(out),
                 "--mode", "async", "--cost-table", str(table), "--slots", "2", "--max-len", "64"]) == 0
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert len(recs["a"]["tokens"]) == 5 and len(recs["b"]["tokens"]) == 4
    errors = {r["line"]: r["error"] for r in recs.values() if r["finish_reason"] == "error"}
    assert sorted(errors) == [2, 3, 5, 6] and "tokenizer" in errors[2] and errors[3].startswith("line 3:")
    assert errors[5] == "line 5: not UTF-8 text (byte 23)"
    assert errors[6].startswith("line 6: request 'top_k'")
    summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert summary["tokens"] == 9 and summary["emitted"] == 7  # 2 first tokens come from prefill


@pytest.mark.slow  # 20-65 s: in the CI's slow step, to keep the default suite near 20 min
def test_engine_profiles_its_cost_table_at_start_when_asked():
    from dspark_jax.bundle import random_bundle
    from dspark_jax.configs import CONFIGS
    from dspark_jax.serve.engine import Engine, EngineConfig, Request

    b = random_bundle(CONFIGS / "tiny_mhc_backbone.json", CONFIGS / "tiny_v41.json")
    eng = Engine(b.model, b.weights, EngineConfig(mode="sync", max_slots=2, max_len=64, progress=False,
                                                  profile_on_start=True))
    assert eng.cost_table is not None and eng.cost_table.max_batch_tokens == 2 * (b.model.block_size + 1)
    (res,) = eng.generate([Request([1, 2, 3], max_tokens=4)])
    assert len(res.tokens) == 4


@pytest.mark.slow
def test_bench_serve_sweeps_every_policy_and_plots(tmp_path, capsys):
    png, out = tmp_path / "serve.png", tmp_path / "serve.json"
    assert main(["bench", "serve", "--random-tiny", "--impl", "xla", "--concurrency", "1,2", "--static", "1,5",
                 "--requests-per-client", "2", "--min-tokens", "3", "--max-tokens", "8", "--max-prompt", "16",
                 "--max-len", "256", "--repeats", "1", "--plot", str(png), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["concurrency"] for r in rows] == [1, 2] and png.stat().st_size > 0
    for r in rows:
        assert set(r["tok_s"]) == {"plain", "static 1", "static 5", "sync", "async"}
        assert all(v > 0 for v in r["tok_s"].values())
        assert r["mean_verify"]["plain"] == 0 and 0 < r["mean_verify"]["static 1"] <= 1
    assert "async/best-static" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_serve_over_http_completes_every_request(tmp_path, capsys):
    out = tmp_path / "http.json"
    assert main(["bench", "serve", "--http", "--warmup", "quick", "--random-tiny", "--impl", "xla",
                 "--concurrency", "1,2", "--requests-per-client", "2", "--min-tokens", "3", "--max-tokens", "8",
                 "--max-prompt", "16", "--max-len", "64", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        for mode in ("plain", "async"):
            s = r[mode]
            assert s["ok"] == s["requests"] == 2 * r["concurrency"] and not s["errors"], s
            assert s["tok_s"] > 0
            # The random tiny bundle has no tokenizer, so its streams carry no text: no latency is
            # measurable, and the bench says NaN rather than 0.
            assert all(math.isnan(s[k]) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")), s
        assert r["plain"]["mean_verify"] == 0
    assert "async/plain" in capsys.readouterr().out


@pytest.mark.slow
def test_generate_on_a_mesh_emits_the_one_device_tokens(tmp_path):
    """`--mesh data=2,expert=4` on the 8 host devices: the tiny draft's experts and the slots sharded, the
    kernels in interpret mode inside shard_map (impl pallas), the same greedy tokens as one device."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f'{{"tokens": [{i + 1}, {i + 2}, 3], "max_tokens": 6, "id": {i}}}\n' for i in range(4)))
    outs = {}
    for name, extra in (("one", []), ("mesh", ["--mesh", "data=2,expert=4"])):
        out = tmp_path / f"{name}.jsonl"
        assert main(["generate", "--random-tiny", "--impl", "pallas", "--prompts", str(prompts), "--out", str(out),
                     "--mode", "off", "--slots", "4", "--max-len", "32", *extra]) == 0
        recs = sorted(map(json.loads, out.read_text().splitlines()), key=lambda r: r["line"])  # finishing order
        outs[name] = [r["tokens"] for r in recs]
    assert outs["mesh"] == outs["one"] and all(len(t) == 6 for t in outs["one"])


def test_generate_rejects_a_bad_mesh(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"tokens": [1, 2]}\n')
    assert main(["generate", "--random-tiny", "--prompts", str(prompts), "--mesh", "data=2,experts=4"]) == 2
    assert "--mesh: mesh: expected comma-separated AXIS=N" in capsys.readouterr().err


def test_generate_gives_the_lines_that_set_a_seed_the_invariant_coupling_under_auto():
    from dspark_jax.serve.generate_cli import parse_requests

    lines = [b'{"tokens": [1, 2], "seed": 5}', b'{"tokens": [3]}']
    for setting, want in (("auto", ["invariant", "optimal"]), ("optimal", ["optimal"] * 2),
                          ("invariant", ["invariant"] * 2)):
        reqs, errors, _ = parse_requests(lines, None, {"max_tokens": 4, "temperature": 1.0, "coupling": setting},
                                         vocab=512, max_stop_tokens=4)
        assert not errors and [r.coupling for r in reqs] == want, setting
