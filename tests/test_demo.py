"""`dspark demo` (dspark_jax/demo.py, issue 40): one progress bar for the whole demo on stderr; on stdout the
tables, the batch-1 rows beside the all-slots table, and one line per engine saying where its time went.
The end-to-end run is the tiny random model at a few tokens; its cost tables are measured as the demo does."""

import contextlib
import io
import re

import pytest

from dspark_jax import demo
from dspark_jax.cli import main

PROMPTS, TOKENS, BATCH1, RUNS, TEMPS = 3, 6, 2, 2, (0.0, 1.0)
ROW = re.compile(r"^\s*(?P<T>\S+) (?P<name>\S+)\s+(?P<tokens>\d+)\s+(?P<seconds>\S+)\s+(?P<tok_s>\S+)\s+(?P<tau>\S+)"
                 r"\s+(?P<verified>\S+)\s+(?P<spec>\d+)/(?P<rounds>\d+)\s+(?P<speedup>\S+)x$")
SPENT = re.compile(r"^  (?P<name>\S+), (?P<slots>\d+) slots?: (?P<compile>\S+) s compiling (?P<compiles>\d+) "
                   r"programs?, (?P<warm>\S+) s warm-up runs, (?P<decode>\S+) s decoding in (?P<runs>\d+) timed runs "
                   r"\(host (?P<host>\S+) s, waiting for the "
                   r"device (?P<device>\S+) s\), (?P<speedup>\S+)x plain$")
BAR = re.compile(r"\d+%\|")  # what every tqdm bar line holds (the engines' and the profile's included)


@pytest.fixture(scope="module")
def ran():
    """(exit code, stdout, stderr) of one small demo: 3 slots, then batch 1 on the first 2 prompts."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["demo", "--random-tiny", "--impl", "xla", "--prompts", str(PROMPTS), "--max-tokens", str(TOKENS),
                     "--max-len", "64", "--temperatures", *map(str, TEMPS), "--runs", str(RUNS),
                     "--batch1-prompts", str(BATCH1), "--plot", ""])
    return code, out.getvalue(), err.getvalue()


def _block(lines: list[str], first: str) -> list[str]:
    """The lines after the line `first`, up to the next empty line."""
    i = lines.index(first) + 1
    j = lines.index("", i) if "" in lines[i:] else len(lines)
    return lines[i:j]


def _table(stdout: str, title: str) -> list[dict]:
    block = _block(stdout.splitlines(), title)
    assert block[0] == demo.HEADER, block
    rows = [ROW.match(line) for line in block[1:]]
    assert all(rows), block
    return [r.groupdict() for r in rows]


@pytest.mark.slow  # ~4 min on 2 cores (two cost tables measured, six engines compiled): the CI's slow step
@pytest.mark.parametrize("slots,prompts,title", [(PROMPTS, PROMPTS, f"{PROMPTS} slots: {PROMPTS} prompts served together"),
                                                 (1, BATCH1, f"batch 1: 1 slot, the first {BATCH1} prompts one after another")])
def test_each_engine_size_prints_its_table(ran, slots, prompts, title):
    code, stdout, _ = ran
    assert code == 0
    rows = _table(stdout, title)
    assert [(float(r["T"]), r["name"]) for r in rows] == [(t, n) for t in TEMPS for n in demo.ENGINES]
    for r in rows:
        # no stop tokens: every request runs to its budget, the first token of each from its prefill
        assert int(r["tokens"]) == prompts * (TOKENS - 1), r
        # tok/s counts the prefill's first tokens too; the bound is what the printed roundings allow
        tok_s, seconds = float(r["tok_s"]), float(r["seconds"])
        assert abs(tok_s * seconds - prompts * TOKENS) <= tok_s * 0.005 + seconds * 0.05 + 1e-3, r
        if r["name"] == "plain":
            assert (r["speedup"], r["tau"], r["verified"], r["spec"]) == ("1.00", "1.000", "0.00", "0"), r
            # one at a time, a plain round emits one token; together, each round serves every prompt
            rounds = int(r["rounds"])
            assert rounds >= int(r["tokens"]) if slots == 1 else rounds < int(r["tokens"]), r


@pytest.mark.slow
def test_one_line_per_engine_says_where_its_time_went(ran):
    _, stdout, _ = ran
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("where the time went, per engine"))
    block = _block(lines, header)
    # a line per engine and size, then the demo's own time, then how long the whole demo took
    spent = [SPENT.match(line) for line in block[:-2]]
    assert all(spent), [line for line, m in zip(block, spent) if not m]
    own = block[-2]
    assert own.startswith("  the demo's own: ") and own.endswith(" of wall time for the warm-ups above"), block
    assert [(int(m["slots"]), m["name"]) for m in spent] == [(s, n) for s in (PROMPTS, 1) for n in demo.ENGINES]
    for m in spent:
        compile_s, warm, decode, host, device = (float(m[g]) for g in ("compile", "warm", "decode", "host", "device"))
        assert int(m["runs"]) == RUNS * len(TEMPS) and warm > 0 and 0 <= host <= decode, m.group(0)
        # every engine compiles programs of its own (plain steps, its verify widths) in its first warm-up
        assert int(m["compiles"]) > 0 and compile_s > 0, m.group(0)
        assert abs(host + device - decode) <= 0.011, m.group(0)
        if m["name"] == "plain":
            assert m["speedup"] == "1.00", m.group(0)
        # decoding counts every timed run, so at least the best run of each temperature in the table
        title = (f"{PROMPTS} slots: {PROMPTS} prompts served together" if m["slots"] != "1"
                 else f"batch 1: 1 slot, the first {BATCH1} prompts one after another")
        best = sum(float(r["seconds"]) for r in _table(stdout, title) if r["name"] == m["name"])
        assert decode >= best - 0.01 * len(TEMPS), (m.group(0), best)
    assert block[-1] == lines[-1] and lines[-1].startswith("demo finished in ")


@pytest.mark.slow
def test_one_progress_bar_for_the_whole_demo_on_stderr(ran):
    _, stdout, stderr = ran
    # tqdm redraws a bar with '\r' and ends it with '\n': a bar is one line of stderr, however often drawn
    bars = [line for line in stderr.split("\n") if BAR.search(line)]
    assert len(bars) == 1, bars
    last = bars[0].split("\r")[-1]
    # two engine sizes; each: its cost table, and per temperature one warm-up and the timed runs
    total = 2 * (1 + len(TEMPS) * (1 + len(demo.ENGINES) * RUNS))
    assert last.startswith("dspark demo: 100%|") and f"| {total}/{total} [" in last, last
    assert not BAR.search(stdout)


@pytest.mark.parametrize("n,batch1,sizes", [(8, 2, [(8, 8), (1, 2)]), (3, 5, [(3, 3), (1, 3)]), (8, 0, [(8, 8)]),
                                            (1, 2, [(1, 1)])])
def test_engine_sizes(n, batch1, sizes):
    """Batch-1 rows on at most the prompts there are, none when asked for none or when all is batch 1."""
    assert demo.engine_sizes(n, batch1) == sizes


class _M:
    def __init__(self, tokens_per_s, wall_s=1.0, host_s=0.25, tokens=10):
        self.tokens_per_s, self.wall_s, self.host_s, self.tokens = tokens_per_s, wall_s, host_s, tokens


def test_best_of_runs_goes_round_robin_and_keeps_the_fastest():
    speeds = {("a", 0): 5.0, ("b", 0): 1.0, ("a", 1): 3.0, ("b", 1): 4.0, ("a", 2): 6.0, ("b", 2): 2.0}
    calls = []

    def timed_run(name):
        i = calls.count(name)
        calls.append(name)
        return f"{name}{i}", _M(speeds[name, i])

    best = demo.best_of_runs(["a", "b"], timed_run, runs=3)
    assert calls == ["a", "b"] * 3
    assert {n: res for n, (res, _) in best.items()} == {"a": "a2", "b": "b1"}


def test_spent_keeps_compiles_apart_from_warm_up_and_decoding():
    s, plain = demo.Spent(), demo.Spent()
    s.add_warm_up(5.0, (3, 4.0))  # a warm-up of 5 s, 4 s of it compiling 3 programs
    s.add_run(_M(0, wall_s=1.5, host_s=0.75, tokens=10), (1, 0.5))  # a width first dispatched in a timed run
    s.add_run(_M(0, wall_s=0.5, host_s=0.25, tokens=10), (0, 0.0))
    plain.add_run(_M(0, wall_s=1.5, host_s=0.5, tokens=20), (0, 0.0))
    assert (s.compiles, s.compile_s, s.warm_up_s, s.decode_s, s.host_s, s.tokens, s.runs) == (4, 4.5, 1.0, 1.5, 0.5, 20, 2)
    line = demo.spent_line("scheduled, 8 slots", s, plain)
    assert line == ("  scheduled, 8 slots: 4.5 s compiling 4 programs, 1.0 s warm-up runs, 1.50 s decoding in 2 timed runs "
                    "(host 0.50 s, waiting for the device 1.00 s), 1.00x plain")
    assert demo.spent_line("x", s, demo.Spent()).endswith(" nanx plain")  # no plain runs: no ratio, not a crash
