"""User errors at the CLI boundary (dspark_jax/errors.py, dspark_jax/cli.py): one line on stderr naming the
file / field, exit 2, no traceback unless --debug; nothing is generated before the output path is known
to be writable."""

import json
import os

import pytest

from dspark_jax.cli import main
from dspark_jax.errors import UserError, is_user_error, one_line


def _run(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def _prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"tokens": [1, 2], "max_tokens": 2}\n')
    return p


CASES = [  # (argv builder, what the one line must contain)
    (lambda t: ["generate", "--random-tiny", "--prompts", str(t / "missing.jsonl")], "missing.jsonl"),
    (lambda t: ["generate", "--random-tiny", "--prompts", str(_prompts(t)), "--out", str(t / "no_dir" / "o.jsonl")],
     "no_dir"),
    (lambda t: ["generate", "--random-tiny", "--prompts", str(t)], "Is a directory"),
    (lambda t: ["generate", "--bundle", str(t / "no_bundle"), "--prompts", str(_prompts(t))], "no_bundle"),
    (lambda t: ["generate", "--random-tiny", "--prompts", str(_prompts(t)), "--mesh", "data=two"], "--mesh"),
    (lambda t: ["generate", "--random-tiny", "--prompts", str(_prompts(t)), "--temperature", "nan"], "--temperature"),
    (lambda t: ["generate", "--random-tiny", "--prompts", str(_prompts(t)), "--max-tokens", "0"], "--max-tokens"),
]


@pytest.mark.parametrize("argv,needle", CASES, ids=["missing-prompts", "out-dir", "prompts-dir", "bundle", "mesh", "temperature", "max-tokens"])
def test_a_user_error_is_one_line_and_exit_2(tmp_path, capsys, argv, needle):
    code, err = _run(argv(tmp_path), capsys)
    assert code == 2, err
    assert len(err) == 1 and needle in err[0] and err[0].startswith("dspark generate: "), err
    assert not (tmp_path / "no_dir").exists()


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError):
        main(["generate", "--random-tiny", "--debug", "--prompts", str(tmp_path / "missing.jsonl")])


def test_an_internal_error_keeps_its_traceback(monkeypatch, tmp_path):
    from dspark_jax.serve import generate_cli

    def broken(args):
        raise KeyError("an internal bug")

    monkeypatch.setattr(generate_cli, "run", broken)
    with pytest.raises(KeyError):
        main(["generate", "--prompts", "x"])


def test_what_counts_as_a_user_error():
    assert is_user_error(UserError("x")) and is_user_error(FileNotFoundError(2, "No such file", "f.json"))
    assert not is_user_error(OSError("no file named")) and not is_user_error(KeyError("k"))
    try:
        json.loads("{")  # a ValueError raised inside the json module, not by our checks
    except ValueError as err:
        assert not is_user_error(err)
    from dspark_jax.drafts.v41.config import DSparkConfig

    with pytest.raises(ValueError) as info:
        DSparkConfig.from_dict({"dim": 8})
    assert is_user_error(info.value)
    assert one_line(FileNotFoundError(2, "No such file or directory", "a/b.json")) == \
        "a/b.json: No such file or directory"
    assert os.environ.get("DSPARK_DEBUG") in (None, "", "0")


def test_serve_refuses_an_unusable_compile_cache_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, err = _run(["serve", "--random-tiny", "--compile-cache", str(blocker / "cache")], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("dspark serve: --compile-cache") and "a_file" in err[0], err
