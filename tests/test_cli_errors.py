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


def test_train_init_override_names_a_missing_checkpoint_before_the_compile(tmp_path, capsys):
    """`dspark train --init DIR` replaces draft.init; a missing folder is one line naming the field."""
    from helpers import CONFIGS

    code, err = _run(["train", "--config", str(CONFIGS / "train_tiny.yaml"), "--run-dir", str(tmp_path / "run"),
                      "--init", str(tmp_path / "no_init"), "--no-progress"], capsys)
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("dspark train: draft.init: ") and "no_init" in err[0], err


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


# Numeric flags (issue 17): each is refused in one line naming it, before any model load or compile (these
# cases all return within the test's time: none loads a model).
FLAG_CASES = [  # (argv builder, the command the line starts with, the flag it must name)
    (lambda t: ["convert", str(t / "src"), str(t / "dst"), "--to", "bf16", "--max-shard-gb", "-1"], "convert",
     "--max-shard-gb"),
    (lambda t: ["convert", str(t / "src"), str(t / "dst"), "--to", "bf16", "--max-shard-gb", "nan"], "convert",
     "--max-shard-gb"),
    (lambda t: ["bench", "acceptance", "--prompts", "0"], "bench acceptance", "--prompts"),
    (lambda t: ["bench", "acceptance", "--prompts", "-2"], "bench acceptance", "--prompts"),
    (lambda t: ["bench", "acceptance", "--temperatures", "0", "-1"], "bench acceptance", "--temperatures"),
    (lambda t: ["bench", "acceptance", "--slots", "0"], "bench acceptance", "--slots"),
    (lambda t: ["demo", "--random-tiny", "--temperatures", "nan"], "demo", "--temperatures"),
    (lambda t: ["demo", "--random-tiny", "--max-tokens", "0"], "demo", "--max-tokens"),
    (lambda t: ["demo", "--random-tiny", "--prompts", "0"], "demo", "--prompts"),
    (lambda t: ["serve", "--random-tiny", "--grace", "inf"], "serve", "--grace"),
    (lambda t: ["serve", "--random-tiny", "--grace", "nan"], "serve", "--grace"),
    (lambda t: ["serve", "--random-tiny", "--num-verify", "-1"], "serve", "--num-verify"),
    (lambda t: ["profile", "--random-tiny", "--repeats", "0", "--out", str(t / "c.json")], "profile", "--repeats"),
    (lambda t: ["profile", "--random-tiny", "--slots", "0", "--out", str(t / "c.json")], "profile", "--slots"),
    (lambda t: ["generate", "--random-tiny", "--prompts", str(_prompts(t)), "--slots", "0"], "generate", "--slots"),
    (lambda t: ["bench", "decode", "--random-tiny", "--batches", "1,x"], "bench decode", "--batches"),
    (lambda t: ["bench", "decode", "--random-tiny", "--repeats", "0"], "bench decode", "--repeats"),
    (lambda t: ["bench", "serve", "--random-tiny", "--min-tokens", "9", "--max-tokens", "8"], "bench serve",
     "--min-tokens"),
    (lambda t: ["bench", "serve", "--random-tiny", "--temperature", "nan"], "bench serve", "--temperature"),
    (lambda t: ["bench", "serve", "--random-tiny", "--concurrency", "0"], "bench serve", "--concurrency"),
    (lambda t: ["bench", "schedule", "--rounds", "0"], "bench schedule", "--rounds"),
    (lambda t: ["bench", "schedule", "--t-fixed-ms", "inf"], "bench schedule", "--t-fixed-ms"),
    (lambda t: ["bench", "verify", "--repeats", "0"], "bench verify", "--repeats"),
    (lambda t: ["bench", "verify", "--logit-scale", "nan"], "bench verify", "--logit-scale"),
    (lambda t: ["bench", "kernels", "--iters", "0"], "bench kernels", "--iters"),
    (lambda t: ["bench", "memory", "--slots", "0"], "bench memory", "--slots"),
    (lambda t: ["bench", "convert", "--shard-gb", "0"], "bench convert", "--shard-gb"),
    (lambda t: ["bench", "convert", "--stages", "0"], "bench convert", "--stages"),
]


@pytest.mark.parametrize("argv,command,flag", FLAG_CASES,
                         ids=[f"{c.replace(' ', '-')}{f}-{i}" for i, (_, c, f) in enumerate(FLAG_CASES)])
def test_a_bad_numeric_flag_is_one_line_naming_it(tmp_path, capsys, argv, command, flag):
    code, err = _run(argv(tmp_path), capsys)
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith(f"dspark {command}: {flag}: expected "), err
    assert not (tmp_path / "dst").exists() and not (tmp_path / "c.json").exists()


OUTPUT_CASES = [  # (argv builder given the unwritable path, the command, the flag): refused before any work
    (lambda out: ["profile", "--random-tiny", "--out", out], "profile", "--out"),
    (lambda out: ["demo", "--random-tiny", "--plot", out], "demo", "--plot"),
    (lambda out: ["bench", "acceptance", "--json", out], "bench acceptance", "--json"),
    (lambda out: ["bench", "decode", "--random-tiny", "--json", out], "bench decode", "--json"),
    (lambda out: ["bench", "memory", "--json", out], "bench memory", "--json"),
    (lambda out: ["bench", "schedule", "--plot", out], "bench schedule", "--plot"),
    (lambda out: ["bench", "serve", "--random-tiny", "--plot", out], "bench serve", "--plot"),
    (lambda out: ["bench", "convert", "--json", out], "bench convert", "--json"),
    (lambda out: ["regenerate", "--random-tiny", "--data", "x.jsonl", "--out", out], "regenerate", "--out"),
]


@pytest.mark.parametrize("argv,command,flag", OUTPUT_CASES, ids=[c.replace(" ", "-") for _, c, _ in OUTPUT_CASES])
@pytest.mark.parametrize("where", ["missing folder", "a folder"])
def test_an_unwritable_output_path_is_refused_before_any_work(tmp_path, capsys, argv, command, flag, where):
    out = str(tmp_path / "no_dir" / "out.json") if where == "missing folder" else str(tmp_path)
    code, err = _run(argv(out), capsys)
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith(f"dspark {command}: {flag}: "), err
    assert not (tmp_path / "no_dir").exists()


def test_debug_is_accepted_after_the_benchmark_name_too():
    with pytest.raises(UserError, match="--prompts"):
        main(["bench", "acceptance", "--prompts", "0", "--debug"])
    with pytest.raises(UserError, match="--prompts"):
        main(["bench", "--debug", "acceptance", "--prompts", "0"])


# A prompts file (demo --prompts-file, bench acceptance; evaluation.read_prompts): a bad line is named by
# file and line, before the model loads.
BAD_PROMPT_FILES = [  # (file content, what the one line must say after "<file> line 2: ")
    (b'{"prompt": "a"}\n{"prompt": "\xff"}\n', "not UTF-8 text"),
    (b'{"prompt": "a"}\nnot json\n', "not valid JSON ("),
    (b'{"prompt": "a"}\n["a"]\n', "expected a JSON object"),
    (b'{"prompt": "a"}\n{"id": 3}\n', "expected a 'prompt' (text) or 'tokens' (ids) field"),
    (b'{"prompt": "a"}\n{"prompt": "b", "tokens": [1]}\n', "give 'tokens' or 'prompt', not both"),
]


@pytest.mark.parametrize("command", [["demo"], ["bench", "acceptance"]], ids=["demo", "bench-acceptance"])
@pytest.mark.parametrize("content,needle", BAD_PROMPT_FILES, ids=["utf8", "json", "object", "no-prompt", "both"])
def test_a_bad_prompts_file_line_is_named(tmp_path, capsys, command, content, needle):
    from dspark_jax.evaluation import default_dir

    if default_dir() is None:
        pytest.skip("the embedded default model is not installed")
    f = tmp_path / "prompts.jsonl"
    f.write_bytes(content)
    code, err = _run([*command, "--prompts-file", str(f)], capsys)
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith(f"dspark {' '.join(command)}: {f} line 2: {needle}"), err


def test_read_prompts_keeps_metadata_and_refuses_a_limit_below_one(tmp_path):
    from dspark_jax.evaluation import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "path": "x.py"}\n\n{"tokens": [1, 2]}\n')
    assert read_prompts(path) == [{"prompt": "a", "path": "x.py"}, {"tokens": [1, 2]}]
    assert read_prompts(path, 1) == [{"prompt": "a", "path": "x.py"}]
    for bad in (0, -1):  # 0 used to mean "all"
        with pytest.raises(UserError, match="expected an integer >= 1"):
            read_prompts(path, bad)


def test_generate_refuses_a_bad_key_for_its_line_only(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"tokens": [1, 2], "max_tokens": 3, "id": "good"}\n'
                       '{"tokens": [1, 2], "max_tokens": 3, "temprature": 1.0, "id": "typo"}\n'
                       '{"tokens": [1, 2], "prompt": "x", "max_tokens": 3, "id": "both"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--random-tiny", "--impl", "xla", "--prompts", str(prompts), "--out", str(out),
                 "--slots", "2", "--max-len", "32"]) == 0
    recs = {r["line"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert recs[1]["error"] is None and len(recs[1]["tokens"]) == 3
    assert recs[2]["error"] == ("line 2: unknown key 'temprature' (did you mean 'temperature'?); expected some of "
                                "prompt, tokens, id, max_tokens, temperature, top_k, top_p, seed, stop")
    assert recs[3]["error"] == "line 3: give 'tokens' or 'prompt', not both"


def test_generate_takes_stops_as_the_server_does(tmp_path, capsys):
    """Issue 40: one request format. A prompt line's "stop" is a string, a token id or a list of them (as
    the server takes it): a stop string cuts "text" before it and ends the request "stop"; an empty one is
    an error naming `stop`, the field the user wrote (embedded default bundle: it has a tokenizer)."""
    def generate(*lines):
        prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
        prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
        assert main(["generate", "--prompts", str(prompts), "--out", str(out), "--mode", "plain", "--slots", "2",
                     "--max-len", "64", "--compile", "lazy"]) == 0
        return {r["line"]: r for r in map(json.loads, out.read_text().splitlines())}

    line = {"prompt": "def ", "max_tokens": 24, "temperature": 0}
    free = generate(line)[1]
    text = free["text"]
    assert free["finish_reason"] == "length" and len(text) > 8, free
    stop = text[4:7]  # a string that first occurs at or before character 4
    cut = text.find(stop)
    got = generate({**line, "stop": stop}, {**line, "stop": [stop]}, {**line, "stop": [""]},
                   {**line, "stop": [1.5]})
    for n in (1, 2):
        assert got[n]["finish_reason"] == "stop" and got[n]["text"] == text[:cut], got[n]
        assert got[n]["tokens"] == free["tokens"][:len(got[n]["tokens"])]
    assert got[3]["error"] == "line 3: 'stop': stop strings must not be empty"
    assert got[4]["error"] == "line 4: 'stop': expected a string, a token id, or a list of them"


def test_serve_refuses_a_port_in_use_before_loading_the_model(monkeypatch, capsys):
    """Issue 40: a second server on a busy port used to load the whole bundle, print [Errno 98] and
    segfault; the port is now bound before the load, and a busy one is one line, exit 2."""
    import socket

    from dspark_jax.serve import serve_cli

    monkeypatch.setattr(serve_cli, "build_app", lambda args: pytest.fail("the model loaded before the port was bound"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = _run(["serve", "--random-tiny", "--port", str(port)], capsys)
    assert code == 2 and len(err) == 1, err
    assert f"--port {port}: cannot listen on 127.0.0.1:{port} (another server is listening there)" in err[0], err


@pytest.mark.parametrize("moment", ["printing the loading line", "inside the load", "as the load returns"])
def test_serve_stopped_at_any_moment_of_the_load_exits_0(moment, monkeypatch, capsys):
    """Issue 40: a supervisor signals as soon as it reads "loading the model", which can be while that
    line is still being printed; CI once caught the SIGTERM there, outside the handler's try, and the
    server died with a traceback. Every moment of the load must end in exit 0 and one line."""
    import builtins
    import os
    import signal

    from dspark_jax.serve import serve_cli

    def sigterm():
        os.kill(os.getpid(), signal.SIGTERM)

    def printing(*a, **k):
        builtins.print(*a, **k)
        if moment == "printing the loading line" and "loading the model" in str(a[0]):
            sigterm()

    def load(args):
        if moment == "inside the load":
            sigterm()
            pytest.fail("the signal did not interrupt the load")
        if moment == "as the load returns":  # after the load, before the handlers are restored
            serve_cli_handler = signal.getsignal(signal.SIGTERM)
            serve_cli_handler.armed = False
            sigterm()
        return object(), object()

    monkeypatch.setattr(serve_cli, "print", printing, raising=False)
    monkeypatch.setattr(serve_cli, "build_app", load)
    monkeypatch.setattr(serve_cli, "serve_until_stopped", lambda *a, **k: pytest.fail("served after a SIGTERM"))
    before = signal.getsignal(signal.SIGTERM)
    code, err = _run(["serve", "--random-tiny", "--port", "0", "--compile-cache", "off"], capsys)
    assert code == 0, err
    assert err[-1] == "dspark serve: SIGTERM while loading; stopped", err
    assert signal.getsignal(signal.SIGTERM) is before  # the load's handler is gone again
