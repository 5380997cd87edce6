"""Output files are replaced only when the command succeeds, and never name one of its inputs (issue 40)."""

import os
import stat

import pytest

from dspark_jax.cli import main
from dspark_jax.errors import UserError
from dspark_jax.output_files import check_not_an_input, replaced_on_success, write_text


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".partial")))


def test_the_target_changes_only_when_the_block_succeeds(tmp_path):
    out = tmp_path / "results.jsonl"
    out.write_text("earlier results\n")
    with pytest.raises(RuntimeError):
        with replaced_on_success(out) as f:
            f.write("half")
            assert out.read_text() == "earlier results\n"  # nothing touched while the work runs
            raise RuntimeError("the model failed to load")
    assert out.read_text() == "earlier results\n" and _leftovers(tmp_path) == []
    with replaced_on_success(out) as f:
        f.write("new results\n")
    assert out.read_text() == "new results\n" and _leftovers(tmp_path) == []


def test_a_failed_streaming_run_keeps_what_it_wrote_beside_the_target(tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    out.write_text("earlier results\n")
    with pytest.raises(KeyboardInterrupt):
        with replaced_on_success(out, keep_partial=True) as f:
            f.write('{"line": 1}\n')
            raise KeyboardInterrupt
    assert out.read_text() == "earlier results\n"
    assert (tmp_path / "results.jsonl.partial").read_text() == '{"line": 1}\n'
    assert "results.jsonl.partial" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):  # nothing written: nothing kept
        with replaced_on_success(tmp_path / "other.jsonl", keep_partial=True):
            raise KeyboardInterrupt
    assert not (tmp_path / "other.jsonl.partial").exists() and not (tmp_path / "other.jsonl").exists()


def test_the_new_file_keeps_the_old_ones_permissions(tmp_path):
    out = tmp_path / "table.json"
    out.write_text("{}")
    os.chmod(out, 0o640)
    write_text(out, '{"a": 1}')
    assert stat.S_IMODE(out.stat().st_mode) == 0o640 and out.read_text() == '{"a": 1}'
    fresh = tmp_path / "fresh.json"
    write_text(fresh, "{}")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask  # not mkstemp's 0600


def test_a_path_that_cannot_be_written_fails_before_any_work(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        with replaced_on_success(tmp_path / "no_dir" / "o.jsonl"):
            pytest.fail("the block must not run")
    with pytest.raises(UserError, match="is a directory"):
        with replaced_on_success(tmp_path):
            pytest.fail("the block must not run")


def test_an_output_that_is_an_input_is_refused(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("{}\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(prompts)
    for out in (prompts, tmp_path / "." / "prompts.jsonl", link):
        with pytest.raises(UserError, match="--prompts"):
            check_not_an_input(out, [("--cost-table", None), ("--prompts", prompts)])
    check_not_an_input(tmp_path / "results.jsonl", [("--prompts", prompts)])


def test_generate_never_loses_an_earlier_results_file_or_its_prompts(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"tokens": [1, 2], "max_tokens": 2}\n')
    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    # A run that fails on a bad bundle (after the output was opened) leaves the earlier results as they were.
    assert main(["generate", "--bundle", str(tmp_path / "no_bundle"), "--prompts", str(prompts),
                 "--out", str(out)]) == 2
    assert out.read_text() == "earlier results\n" and _leftovers(tmp_path) == []
    # --out naming the prompts is refused before anything runs; the prompts are intact.
    assert main(["generate", "--random-tiny", "--prompts", str(prompts), "--out", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "--prompts" in err, err
    assert prompts.read_text() == '{"tokens": [1, 2], "max_tokens": 2}\n'


def test_calibrate_refuses_to_write_over_its_records(tmp_path, capsys):
    records = tmp_path / "records.jsonl"
    records.write_text('{"logits": [0.0], "num_accepted": 0, "num_verified": 1}\n')
    assert main(["calibrate", str(records), "--out", str(records)]) == 2
    assert "RECORDS" in capsys.readouterr().err
    assert records.read_text() == '{"logits": [0.0], "num_accepted": 0, "num_verified": 1}\n'
