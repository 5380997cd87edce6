"""`dspark bench moe` (issue 38, deliverable 6): both routings of each program timed side by side in one
run, with the compiles during the timed calls counted; bad flags are one line naming the flag."""

import pytest

from dspark_jax.bench import moe
from dspark_jax.cli import main
from dspark_jax.errors import UserError

SMALL = ["--experts", "8", "--top-k", "2", "--dim", "64", "--inter", "32", "--batches", "1", "--train-seqs", "2",
         "--train-len", "24", "--anchors", "2", "--repeats", "2", "--warmup", "1"]


def test_prints_each_program_with_both_routings_and_no_compile_while_timed(capsys):
    assert main(["bench", "moe", *SMALL]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith(("propose/", "train"))]
    assert [r[0] for r in rows] == ["propose/1", "train"]
    for r in rows:
        assert float(r[1]) > 0 and float(r[3]) > 0 and r[5].endswith("x") and r[6] == "0", r


def test_both_routings_run_the_same_arrays():
    """The side by side compares the paths, not two draws: the arguments are equal for both routings."""
    import jax
    import numpy as np

    args = moe.argparse.Namespace(experts=8, top_k=2, dim=64, inter=32, train_seqs=2, train_len=24, anchors=2)
    dense, routed = (moe.build(args, "propose/2", r) for r in ("dense", "routed"))
    for a, b in zip(jax.tree.leaves(dense.args), jax.tree.leaves(routed.args)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("flags,message", [
    (["--top-k", "9", "--experts", "8"], "--top-k 9: at most --experts (8)"),
    (["--batches", "1,x"], "--batches: expected comma-separated integers"),
    (["--repeats", "0"], "--repeats: expected an integer >= 1"),
])
def test_bad_flags_are_named(flags, message):
    parser = moe.argparse.ArgumentParser()
    moe.add_arguments(parser)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        moe.run(parser.parse_args(flags))
