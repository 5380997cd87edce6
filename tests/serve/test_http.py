"""`dspark serve`: a real server on 127.0.0.1 (uvicorn in a thread; a subprocess for SIGTERM), spoken to with
the `openai` client and raw HTTP."""

import functools
import json
import logging
import re
import socket
import threading
import time

import httpx
import jax
import numpy as np
import pytest

from helpers import CONFIGS

from dspark_jax import drafts
from dspark_jax import spec_round as sr
from dspark_jax.bundle import make_backbone
from dspark_jax.drafts.v41.config import DSparkConfig
from dspark_jax.serve.engine import Engine, EngineConfig, Request
from dspark_jax.serve.http import ThreadedServer, create_app
from dspark_jax.serve.loop import EngineLoop
from dspark_jax.serve.metrics import ServerMetrics

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

SLOTS, QUEUE, MAX_LEN = 2, 2, 96
CONFIG = EngineConfig(max_slots=SLOTS, max_len=MAX_LEN, mode="off", progress=False)


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = open(CONFIGS.parent / "serve" / "engine.py").read()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|noise|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def tiny_model():
    """The tiny mhc + V4.1 pair with random weights and the fp8 KV rounding off (exactness across batch
    shapes, as the engine's exactness tests)."""
    raw = json.loads((CONFIGS / "tiny_mhc_backbone.json").read_text())
    backbone = make_backbone("mhc", {**raw, "kv_fp8": False})
    cfg = DSparkConfig.from_json(CONFIGS / "tiny_v41.json").replace(kv_fp8=False)
    k1, k2 = jax.random.split(jax.random.key(0))
    bparams = backbone.init_params(k1)
    weights = sr.Weights(bparams, drafts.init_params(cfg, k2), backbone.tied(bparams), jax.numpy.ones(cfg.block_size))
    return sr.SpecModel(backbone, cfg, impl="xla"), weights


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def server(model):
    m, w = model
    metrics = ServerMetrics()
    loop = EngineLoop(lambda: Engine(m, w, CONFIG), max_queue=QUEUE, warmup="quick", on_round=metrics.observe_round)
    metrics.attach(loop)
    app = create_app(loop, tokenizer=tiny_tokenizer(), model_name="tiny", default_max_tokens=8, metrics=metrics)
    loop.start()
    srv = ThreadedServer(app)
    srv.loop = loop
    yield srv
    srv.stop()
    loop.shutdown(5)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def wait_idle(loop, timeout=30.0):
    deadline = time.time() + timeout
    while loop.accepted and time.time() < deadline:
        time.sleep(0.02)
    assert loop.accepted == 0


def test_models_health_and_a_completion(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    r = client.completions.create(model="tiny", prompt="def step(self):", max_tokens=12, temperature=0, seed=1)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    ext = r.model_extra["dspark"]
    assert ext["rounds"] >= 1 and ext["tau"] == pytest.approx(12 / ext["rounds"])
    assert 0 <= ext["accepted_drafts"] <= 12
    ids = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}).json()
    assert ids["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_streaming_gives_the_same_text_as_one_response(server, client):
    kw = dict(model="tiny", prompt="class Engine:", max_tokens=20, temperature=1.0, seed=7)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 20


def test_chat_completion_and_chat_stream(server, client):
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, seed=2)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    text = r.choices[0].message.content
    parts = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, seed=2,
                                                stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == text
    assert parts[-1].choices[0].finish_reason == "length"


def test_stop_strings_and_stop_tokens(server, client, model):
    kw = dict(model="tiny", prompt="def run(self):", max_tokens=40, temperature=0, seed=3)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 6
    stop = full[4:6]
    cut = full.find(stop)
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    m, w = model
    greedy = Engine(m, w, CONFIG).generate([Request([9, 10], max_tokens=30)])[0].tokens
    first = greedy.index(greedy[2])  # the stop token ends the text and is not part of it
    stopped = post(server, "/v1/completions", {"prompt": [9, 10], "max_tokens": 30, "temperature": 0,
                                               "stop": [greedy[2]]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == tiny_tokenizer().decode(greedy[:first])
    assert stopped["usage"]["completion_tokens"] == first + 1


BAD = [  # (body changes, the param the error must name)
    ({"n": 2}, "n"), ({"logprobs": 1}, "logprobs"), ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"),
    ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"top_k": 1e10}, "top_k"), ({"top_k": 2 ** 40}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10 ** 6}, "max_tokens"), ({"prompt": ""}, "prompt"), ({"prompt": [1, 10 ** 6]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"), ({"prompt": [1] * 200}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop"), ({"seed": -1}, "seed"),
    ({"stream": "yes"}, "stream"), ({"user": 5}, "user"), ({"frequency_penalty": 1.0}, "frequency_penalty"),
]


@pytest.mark.parametrize("change,param", BAD)
def test_bad_requests_answer_400_naming_the_field(server, change, param):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x = 1", "max_tokens": 4, **change})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


def _count(server, outcome: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    found = re.search(rf'dspark_requests_total{{outcome="{outcome}"}} ([0-9.e+]+)', text)
    return float(found.group(1)) if found else 0.0


def test_an_unknown_model_is_404_and_every_refusal_is_counted(server):
    """OpenAI answers a model it does not serve with 404 model_not_found; 400s and 404s count in the
    metrics as "invalid" and "not_found" (issue 40)."""
    invalid, not_found = _count(server, "invalid"), _count(server, "not_found")
    r = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x = 1", "max_tokens": 2})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "'gpt-4'" in err["message"]
    assert "'tiny'" in err["message"] and err["type"] == "invalid_request_error"
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}).status_code == 400
    assert _count(server, "not_found") == not_found + 1 and _count(server, "invalid") == invalid + 1


@pytest.mark.parametrize("body,param", [("not json", None), ([1, 2], None)])
def test_malformed_bodies_answer_400(server, body, param):
    r = httpx.post(server.url + "/v1/completions", content=json.dumps(body) if body != "not json" else body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


@pytest.mark.parametrize("messages,param", [([{"role": "wizard", "content": "x"}], "messages[0].role"),
                                            ([], "messages"), ([{"role": "user", "content": 3}], "messages[0].content")])
def test_bad_chat_messages_answer_400(server, messages, param):
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def _open_stream(server, body):
    """A streaming request held open: -> (httpx stream context, response, line iterator)."""
    cm = httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120)
    resp = cm.__enter__()
    return cm, resp, resp.iter_lines()


def _hold_engine(server, monkeypatch) -> threading.Event:
    """The engine's next step waits until the returned event is set (at most 60 s)."""
    gate = threading.Event()
    real = server.loop.engine.step
    monkeypatch.setattr(server.loop.engine, "step", lambda: gate.wait(60) and real())
    return gate


def test_a_full_queue_answers_429_and_the_accepted_requests_complete(server, monkeypatch):
    wait_idle(server.loop)
    # The engine is held until the extra request has been refused: on a fast machine the tiny model could
    # otherwise finish a held request first, free its place, and rightly accept the extra one.
    gate = _hold_engine(server, monkeypatch)
    try:
        held = [_open_stream(server, {"prompt": [3, 4], "max_tokens": 80, "temperature": 1.0, "seed": i})
                for i in range(SLOTS + QUEUE)]
        for _, resp, _ in held:
            assert resp.status_code == 200
        assert server.loop.accepted == SLOTS + QUEUE
        r = post(server, "/v1/completions", {"prompt": [3, 4], "max_tokens": 4})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        gate.set()
    for cm, _, lines in held:
        got = [line for line in lines if line.startswith("data: ")]
        cm.__exit__(None, None, None)
        assert got[-1] == "data: [DONE]"
        assert json.loads(got[-2][6:])["usage"]["completion_tokens"] == 80
    assert 'dspark_requests_total{outcome="rejected"}' in httpx.get(server.url + "/metrics").text


def test_a_client_that_disconnects_is_cancelled_and_its_slot_reused(server):
    wait_idle(server.loop)
    cm, resp, lines = _open_stream(server, {"prompt": [3, 4], "max_tokens": 90, "temperature": 1.0})
    next(line for line in lines if line.startswith("data: "))
    cm.__exit__(None, None, None)  # the client goes away mid-stream
    wait_idle(server.loop, timeout=10)
    assert server.loop.engine.active == 0
    r = post(server, "/v1/completions", {"prompt": [3, 4], "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def _send_raw(url: str, head: dict, body: bytes) -> socket.socket:
    """A POST /v1/completions written by hand (a partial body, a chunked one, a Content-Length that lies)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    lines = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, "Content-Type": "application/json", **head}.items())
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\n{lines}\r\n".encode() + body)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    """-> (status, JSON body) of the one response on `sock` (its socket timeout bounds the wait)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed mid-response: {data!r}"
        body += chunk
    return int(head.split()[1]), json.loads(body)


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return found


def _left_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "dspark_jax.serve" and "client disconnected" in r.getMessage()]


@pytest.mark.parametrize("moment", ["streamed", "not streamed", "while sending its body"])
def test_a_client_that_leaves_is_cancelled_with_one_log_line_and_no_traceback(server, monkeypatch, caplog, moment):
    """Issue 40: a client that drops mid-request frees its slot and leaves exactly one log line (a drop while
    the body was being sent was uvicorn's "Exception in ASGI application" traceback; the others, nothing)."""
    wait_idle(server.loop)
    caplog.set_level(logging.WARNING)
    body = json.dumps({"prompt": [3, 4], "max_tokens": 80, "temperature": 1.0,
                       "stream": moment == "streamed"}).encode()
    gate = _hold_engine(server, monkeypatch)  # no token before the client leaves: the request is surely cut
    try:
        if moment == "while sending its body":
            sock = _send_raw(server.url, {"Content-Length": len(body)}, body[:len(body) // 2])
            time.sleep(0.3)  # uvicorn has started the handler, which waits for the rest of the body
        else:
            sock = _send_raw(server.url, {"Content-Length": len(body)}, body)
            _wait_for(lambda: server.loop.accepted == 1, 30, "the request accepted")
        sock.close()
        _wait_for(lambda: _left_lines(caplog), 10, "a log line for the client that left")
    finally:
        gate.set()
    wait_idle(server.loop, timeout=10)
    time.sleep(0.3)  # a second line or a traceback, had there been one, is logged by now
    lines = _left_lines(caplog)
    assert len(lines) == 1, lines
    if moment == "while sending its body":
        assert "POST /v1/completions cancelled: client disconnected while sending its body" in lines[0]
    else:
        assert re.fullmatch(r"request c\S+ cancelled: client disconnected after 0 tokens", lines[0]), lines
    assert not [r for r in caplog.records if r.exc_info or "Exception in ASGI" in r.getMessage()]


@pytest.fixture(scope="module")
def small_body_server(server):
    """A second app over the fixture's engine loop that accepts bodies of at most 1000 bytes."""
    srv = ThreadedServer(create_app(server.loop, tokenizer=tiny_tokenizer(), model_name="tiny", max_body_bytes=1000))
    yield srv
    srv.stop()


def test_a_body_over_the_limit_is_refused_with_413_before_it_is_read(server, small_body_server):
    """Issue 40: 413 (OpenAI error shape) as soon as the body is known to be too large: from Content-Length
    before any of it arrives, by counting a chunked one; counted in the metrics as too_large."""
    url = small_body_server.url
    ok = httpx.post(url + "/v1/completions", json={"prompt": "x" * 900, "max_tokens": 2}, timeout=120)
    assert ok.status_code == 400 and ok.json()["error"]["code"] == "context_length_exceeded"  # read and tokenized
    assert httpx.post(url + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 2}, timeout=120).status_code == 200

    with _send_raw(url, {"Content-Length": 10 ** 9}, b'{"prompt": "') as sock:  # the rest never comes
        status, body = _read_response(sock)
    assert status == 413, body
    err = body["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert "1000000000 bytes" in err["message"] and "at most 1000 bytes" in err["message"]

    chunk = b'{"prompt": "' + b"x" * 600
    with _send_raw(url, {"Transfer-Encoding": "chunked"}, b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2) as sock:
        status, body = _read_response(sock)  # 1224 bytes sent, no last chunk: the body never ends
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert "over 1000 bytes" in body["error"]["message"]
    assert _count(small_body_server, "too_large") == 2


def test_a_huge_prompt_is_tokenized_off_the_event_loop(server):
    """Issue 40: tokenizing a prompt of a few MB takes seconds; GET /health answers meanwhile (the
    tokenizer ran on the event loop, and `Tokenizer.encode` holds the GIL even in a worker thread)."""
    source = open(CONFIGS.parent / "serve" / "engine.py").read()
    prompt = (source * (3_500_000 // len(source) + 1))[:3_500_000]
    body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
    assert len(body) < 4 << 20  # under the default body limit
    got = {}

    def big():
        t0 = time.monotonic()
        got["response"] = httpx.post(server.url + "/v1/completions", content=body, timeout=120)
        got["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=big)
    thread.start()
    waits = []
    while thread.is_alive():
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        waits.append(time.monotonic() - t0)
        time.sleep(0.02)
    thread.join()
    r = got["response"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text  # tokenized
    assert got["seconds"] > 0.5, f"tokenizing took {got['seconds']:.2f} s: too fast to show a stalled event loop"
    assert max(waits) < min(1.0, got["seconds"] / 3), (max(waits), got["seconds"], len(waits))


def test_max_body_bytes_is_checked_and_uvicorn_outlasts_the_grace():
    import argparse

    from dspark_jax.errors import UserError
    from dspark_jax.serve import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert parser.parse_args([]).max_body_bytes == 4 << 20
    with pytest.raises(UserError, match="--max-body-bytes: expected an integer >= 1, got 0"):
        serve_cli.check_args(parser.parse_args(["--max-body-bytes", "0"]))
    for grace in (0.0, 0.5, 1.0, 30.0):  # the handlers get >= 1 s after the grace to write their last event
        assert serve_cli.uvicorn_grace_s(grace) >= grace + 1


def test_an_engine_failure_answers_500_and_the_server_recovers(server, monkeypatch):
    wait_idle(server.loop)
    engine = server.loop.engine
    real = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device fault")
        return real()

    monkeypatch.setattr(engine, "step", failing_step)
    r = post(server, "/v1/completions", {"prompt": [3, 4], "max_tokens": 60, "temperature": 0})
    assert r.status_code == 500 and "injected device fault" in r.json()["error"]["message"]
    assert server.loop.engine is not engine and server.loop.stats.rebuilds >= 1
    ok = post(server, "/v1/completions", {"prompt": [3, 4], "max_tokens": 6, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
    assert 'dspark_requests_total{outcome="error"}' in httpx.get(server.url + "/metrics").text


def test_a_seeded_request_is_the_same_alone_under_load_and_offline(server, model):
    body = {"prompt": [11, 12, 13], "max_tokens": 24, "temperature": 1.0, "seed": 1234}
    wait_idle(server.loop)
    alone = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    results = {}

    def fire(i, b):
        results[i] = post(server, "/v1/completions", b).json()["choices"][0]["text"]

    threads = [threading.Thread(target=fire, args=(i, {**body, "seed": 99 + i})) for i in range(3)]
    threads.append(threading.Thread(target=fire, args=("mine", body)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["mine"] == alone
    m, w = model
    # a request that sets a seed gets the drafter-invariant coupling (`--coupling auto`): the offline twin too
    offline = Engine(m, w, CONFIG).generate([Request([11, 12, 13], max_tokens=24, temperature=1.0, seed=1234,
                                                     coupling="invariant")])
    assert tiny_tokenizer().decode(offline[0].tokens) == alone


def test_metrics_expose_the_serving_numbers(server):
    post(server, "/v1/completions", {"prompt": [3, 4], "max_tokens": 6, "temperature": 0})
    text = httpx.get(server.url + "/metrics").text
    for name in ("dspark_requests_total", "dspark_prompt_tokens_total", "dspark_generated_tokens_total",
                 "dspark_tau", 'dspark_acceptance{position="1"}', "dspark_mean_verify", "dspark_queue_depth",
                 "dspark_active_slots", "dspark_round_seconds_bucket"):
        assert name in text, name
    tau = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("dspark_tau ")))
    assert tau >= 1.0
    assert np.isfinite(tau)


def httpx_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # 20-65 s: in the CI's slow step, to keep the default suite near 20 min
def test_sigterm_finishes_the_requests_in_flight_and_exits_0():
    """`dspark serve` in a subprocess: SIGTERM mid-stream; the stream completes, new work is refused, exit 0."""
    import signal
    import subprocess
    import sys

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "dspark_jax", "serve", "--random-tiny", "--port", str(port),
                             "--mode", "off", "--slots", "2", "--max-len", "160", "--grace", "60", "--warmup", "quick"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 900
        while httpx_status(url + "/health") != 200:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the server did not become ready"
            time.sleep(0.3)
        got = []
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={"prompt": [3, 4], "max_tokens": 120, "temperature": 1.0, "seed": 5, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    if not got:
                        proc.send_signal(signal.SIGTERM)
                        time.sleep(0.5)
                        with pytest.raises(httpx.TransportError):  # no new connections once stopping
                            httpx.get(url + "/health", timeout=2)
                    got.append(line)
        assert got[-1] == "data: [DONE]" and json.loads(got[-2][6:])["usage"]["completion_tokens"] == 120
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _serve_process(port: int, *flags: str):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "dspark_jax", "serve", "--random-tiny", "--port", str(port),
                             "--mode", "off", "--slots", "2", "--max-len", "64", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(proc, needle: str, timeout: float) -> list[str]:
    """Lines of the server's output up to the first that holds `needle` (within `timeout` seconds)."""
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "".join(lines)
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} within {timeout} s: {''.join(lines)}")


@pytest.mark.slow  # two server processes that load a model and start compiling: ~1 minute
@pytest.mark.parametrize("moment", ["loading", "compiling"])
def test_sigterm_while_loading_or_compiling_exits_0_without_an_abort(moment):
    """Issue 40: SIGTERM during the load or the warm-up used to end in an abort (exit 134: the interpreter
    finalised while XLA compiled in another thread). Now: exit 0 within seconds, no crash in the log."""
    import signal

    proc = _serve_process(_free_port(), "--warmup", "full")
    try:
        _read_until(proc, "loading the model" if moment == "loading" else "GET /health says ok when ready", 300)
        if moment == "compiling":
            time.sleep(3)  # inside the eager warm-up's compiles
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        out = proc.stdout.read()
        assert code == 0, out
        assert "FATAL" not in out and "terminate called" not in out and "Traceback" not in out, out
        assert ("while loading; stopped" if moment == "loading" else "stopped") in out, out
    finally:
        if proc.poll() is None:
            proc.kill()


def _load(url: str) -> tuple[int, int]:
    """(requests running, requests queued) as GET /health reports them."""
    health = httpx.get(url + "/health", timeout=5).json()
    return health["active"], health["queued"]


@pytest.mark.slow  # a server process that loads the model and compiles at its first request: ~1 minute
def test_past_the_grace_sigterm_ends_a_stream_with_an_error_event_and_a_queued_request_with_503():
    """Issue 40: once --grace runs out, a stream still running ends with an OpenAI error event then
    [DONE] (it was cut mid-body), a queued non-streamed request gets 503 shutting_down, the log has one
    line per cut request and no traceback, and the process exits 0."""
    import signal

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve_process(port, "--slots", "1", "--max-len", "4096", "--grace", "0.5", "--warmup", "none")
    queued = {}

    def send_queued():
        queued["r"] = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 8}, timeout=120)

    try:
        _wait_for(lambda: httpx_status(url + "/health") == 200 or proc.poll() is not None, 300, "ready")
        assert proc.poll() is None, proc.stdout.read()
        # Compile what the long request runs, so that the grace runs out while it generates.
        warm = {"prompt": [3, 4], "max_tokens": 8, "temperature": 1.0}
        assert httpx.post(url + "/v1/completions", json=warm, timeout=600).status_code == 200
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json={**warm, "max_tokens": 4000, "stream": True}) as r:
            assert r.status_code == 200
            thread = threading.Thread(target=send_queued)
            thread.start()
            _wait_for(lambda: _load(url) == (1, 1), 30, "one request running and one queued")
            proc.send_signal(signal.SIGTERM)
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        thread.join(60)
        code = proc.wait(60)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, out
    assert events[-1] == "data: [DONE]", events
    err = json.loads(events[-2][6:])["error"]
    assert err["code"] == "shutting_down" and err["type"] == "server_error", err
    stream_id, generated = re.search(r"request (\S+) was stopped after (\d+) tokens", err["message"]).groups()
    assert 0 < int(generated) < 4000, err  # cut mid-generation
    q = queued["r"]
    assert q.status_code == 503 and q.json()["error"]["code"] == "shutting_down", q.text
    queued_id = re.search(r"request (\S+) was stopped after 0 tokens", q.json()["error"]["message"]).group(1)
    for rid in (stream_id, queued_id):
        cut = [line for line in out.splitlines() if rid in line]
        assert len(cut) == 1 and "cut: the shutdown grace ran out" in cut[0], out
    assert "Traceback" not in out and "Exception in ASGI" not in out and "graceful shutdown exceeded" not in out, out


@pytest.fixture(scope="module")
def invariant_servers(model):
    """Two servers on the tiny pair: one verifying every draft of an oracle draft that samples the backbone with
    the draft's keys (so drafts are accepted at T = 1), `--coupling auto`; and a `mode="plain"` one."""
    from helpers.spec import sampled_oracle_propose

    m, w = model
    spec = sr.SpecModel(m.backbone, m.cfg, impl="xla", propose_fn=sampled_oracle_propose)
    servers = []
    for mdl, cfg in ((spec, EngineConfig(max_slots=4, max_len=MAX_LEN, mode="fixed", num_verify=m.block_size,
                                         progress=False)),
                     (m, EngineConfig(max_slots=4, max_len=MAX_LEN, mode="plain", progress=False))):
        loop = EngineLoop(lambda mdl=mdl, cfg=cfg: Engine(mdl, w, cfg), max_queue=16, warmup="full")
        app = create_app(loop, tokenizer=tiny_tokenizer(), model_name="tiny", coupling="auto")
        loop.start()
        srv = ThreadedServer(app, ready_timeout_s=900)
        srv.loop = loop
        servers.append(srv)
    yield servers
    for srv in servers:
        srv.stop()
        srv.loop.shutdown(5)


# Two servers compiling every program (~1-2 min): in the slow step.
@pytest.mark.slow
def test_a_seeded_request_gets_plain_decodings_text_twice_streamed_or_not_alone_or_under_load(invariant_servers):
    """Issue 44. A request with a seed gets the invariant coupling: the same text twice, streamed or not, alone
    or among 16 concurrent clients, and the text a plain server gives, while its drafts are accepted."""
    spec, plain = invariant_servers
    client = openai.OpenAI(base_url=spec.url + "/v1", api_key="none", max_retries=0)
    for body in ({"prompt": "class Engine:", "max_tokens": 24, "temperature": 1.0, "seed": 4321},
                 {"prompt": "def step(self):", "max_tokens": 24, "temperature": 0.7, "top_p": 0.9, "seed": 77}):
        want = post(plain, "/v1/completions", body).json()["choices"][0]["text"]
        first = post(spec, "/v1/completions", body).json()
        assert first["dspark"]["accepted_drafts"] > 0  # speculation really happened
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, model="tiny", **body))
        results = {}

        def fire(i, b):
            results[i] = post(spec, "/v1/completions", b).json()["choices"][0]["text"]

        others = [{**body, "seed": 500 + i, "max_tokens": 8 + i % 5, "temperature": 1.0} for i in range(13)]
        threads = [threading.Thread(target=fire, args=(i, b)) for i, b in enumerate(others)]
        threads += [threading.Thread(target=fire, args=(f"mine{j}", body)) for j in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        again = post(spec, "/v1/completions", body).json()["choices"][0]["text"]
        assert first["choices"][0]["text"] == want
        assert streamed == want and again == want
        assert [results[f"mine{j}"] for j in range(3)] == [want] * 3
