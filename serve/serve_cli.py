"""`dspark serve`: the OpenAI-compatible HTTP server (see serve/http.py; README "Serving over HTTP").

    dspark serve --bundle DIR [--host 127.0.0.1] [--port 8000] [--mode async] [--slots 8] [--max-len 512]
                 [--max-queue 64] [--grace 30] [--max-body-bytes 4194304]

Binds to loopback unless --host says otherwise; the port is bound before the model loads (a busy port
fails at once). SIGTERM / Ctrl-C: while loading, stop at once; while serving or compiling, stop accepting,
let the requests in flight finish for up to --grace seconds, then end each one still running with an
error (an SSE error event then [DONE]; 503 when not streamed), exit 0 (a compile in progress is abandoned).
The compiled programs are kept in the user's cache (--compile-cache, dspark_jax/user_cache.py; the engine's
program store, serve/program_store.py, in its dspark-programs/): a second start loads them without tracing
or compiling.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import signal
import socket
import sys
import threading

from dspark_jax.errors import UserError
from dspark_jax.serve.cli_common import (add_compile_cache_argument, add_model_arguments, enable_compile_cache,
                                         load_model)
from dspark_jax.serve.openai_api import DEFAULT_MAX_BODY_BYTES
from dspark_jax.serve.request_check import COUPLING_SETTINGS
from dspark_jax.validation import check_int_flags, check_number_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--mode", default="async", choices=("async", "sync", "off", "fixed", "plain"),
                        help="engine mode (async: the load-aware scheduler on a measured cost table)")
    parser.add_argument("--num-verify", type=int, default=None, help="drafts verified per round in mode fixed")
    parser.add_argument("--coupling", default="auto", choices=COUPLING_SETTINGS,
                        help="how drafts are accepted: invariant (a seed gives the tokens plain decoding gives, "
                             "whatever the load), optimal (the most accepted drafts, exact in distribution), auto "
                             "(invariant for requests that set a seed, optimal for the others)")
    parser.add_argument("--slots", type=int, default=8, help="concurrent requests in the batch")
    parser.add_argument("--max-len", type=int, default=512, help="context per request (prompt + completion)")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    parser.add_argument("--max-tokens", type=int, default=16, help="default max_tokens of a request")
    parser.add_argument("--cost-table", default=None,
                        help="cost table JSON for modes sync/async (default: the bundle's, else measured once "
                             "on this machine and cached)")
    parser.add_argument("--model-name", default=None, help="the model id in responses (default: the bundle name)")
    parser.add_argument("--warmup", default="full", choices=("full", "quick", "none"),
                        help="compile before /health says ready: every program (full; compile policy 'eager'), "
                             "a greedy and a sampled request's, the rest in the background while serving (quick; "
                             "'background'), nothing: each program compiles when first needed (none; 'lazy')")
    add_compile_cache_argument(parser)
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds in-flight requests get at shutdown; those still running after it end with "
                             "an error (code shutting_down)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted, else 413 before it is read (default 4 MiB: a "
                             "128k-token prompt as text or token ids is under 1 MiB; the limit keeps a client "
                             "from making the server buffer and tokenize any size)")
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))


def check_args(args) -> None:
    """Every numeric flag, before the model loads (`--grace inf` / `nan` failed only when the server
    started, after the model had loaded)."""
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: expected a port in [0, 65535], got {args.port}")
    check_int_flags(args, "slots", "max_tokens", "max_body_bytes")
    check_int_flags(args, "max_len", minimum=8)
    check_int_flags(args, "max_queue", "num_verify", minimum=0)
    check_number_flags(args, "grace")  # seconds; uvicorn's shutdown timeout is uvicorn_grace_s(grace)


# Seconds the HTTP handlers get, after the loop's grace, to write their last event (they see the grace end
# within http._POLL_S): uvicorn's own shutdown timeout must end after that, or it cuts the streams mid-body.
ANSWER_MARGIN_S = 2.0


def uvicorn_grace_s(grace: float) -> int:
    """uvicorn's timeout_graceful_shutdown (whole seconds) for the loop's --grace."""
    return math.ceil(grace + ANSWER_MARGIN_S)


# The engine's compile policy (serve/compiling.py) that goes with each --warmup.
WARMUP_POLICY = {"full": "eager", "quick": "background", "none": "lazy"}


def _cost_table(args, bundle):
    if args.mode not in ("sync", "async"):
        return None
    from dspark_jax.schedule import CostTable
    from dspark_jax.serve.profile import cached_cost_table

    if args.cost_table:
        return CostTable.from_json(args.cost_table)
    if bundle.cost_table is not None:
        return bundle.cost_table
    table, where = cached_cost_table(bundle, slots=args.slots, max_len=args.max_len, progress=True)
    print(f"dspark serve: cost table {where}", file=sys.stderr)
    return table


def build_app(args):
    """-> (FastAPI app, EngineLoop) for the parsed arguments (also used by the tests)."""
    from contextlib import asynccontextmanager

    from dspark_jax.serve.engine import Engine, EngineConfig
    from dspark_jax.serve.http import create_app
    from dspark_jax.serve.loop import EngineLoop
    from dspark_jax.serve.metrics import ServerMetrics

    bundle = load_model(args)
    table = _cost_table(args, bundle)
    config = EngineConfig(max_slots=args.slots, max_len=args.max_len, mode=args.mode, num_verify=args.num_verify,
                          progress=False, compile=WARMUP_POLICY[args.warmup])

    def make_engine():
        return Engine(bundle.model, bundle.weights, config, cost_table=table)

    metrics = ServerMetrics()
    loop = EngineLoop(make_engine, max_queue=args.max_queue, warmup=args.warmup, on_round=metrics.observe_round)
    metrics.attach(loop)
    name = args.model_name or (bundle.path.name if bundle.path is not None else "dspark-random-tiny")
    app = create_app(loop, tokenizer=bundle.tokenizer, model_name=name, default_max_tokens=args.max_tokens,
                     metrics=metrics, max_body_bytes=args.max_body_bytes, coupling=args.coupling)

    @asynccontextmanager
    async def lifespan(_app):
        loop.start()
        yield
        loop.shutdown(args.grace)

    app.router.lifespan_context = lifespan
    return app, loop


def bind_port(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening: connections are refused until the server starts)
    BEFORE the bundle loads, so a port in use fails in a second, not after the load."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port at once
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        why = "another server is listening there" if err.errno == errno.EADDRINUSE else err.strerror
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({why})") from None
    return sock


class _Stopped(BaseException):
    """SIGTERM or SIGINT while the bundle loads (before the server's own handlers are installed)."""


class _StopWhileLoading:
    """Signal handler for the load: raises _Stopped while armed (the load is a long blocking call, and
    raising is how it is interrupted); once disarmed, it only remembers the signal, so that one arriving
    between the end of the load and the handlers' restoration cannot escape as a traceback."""

    def __init__(self):
        self.armed, self.pending = True, None

    def __call__(self, signum, _frame):
        name = signal.Signals(signum).name
        if self.armed:
            raise _Stopped(name)
        self.pending = name


def run(args: argparse.Namespace) -> int:
    check_args(args)
    enable_compile_cache(args)  # before the port and the load: an unusable cache folder is refused at once
    sock = bind_port(args.host, args.port)
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    handler = _StopWhileLoading()
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    stopped = None
    try:
        # Inside the try: a supervisor may signal as soon as it reads this line, while print still runs.
        print(f"dspark serve: loading the model for http://{args.host}:{port}/v1", file=sys.stderr, flush=True)
        import uvicorn

        app, loop = build_app(args)
        handler.armed = False
    except _Stopped as stop:
        stopped = str(stop)
    except BaseException:
        sock.close()
        raise
    finally:
        handler.armed = False
        for s, old in previous.items():
            signal.signal(s, old)
    stopped = stopped or handler.pending
    if stopped:
        sock.close()
        print(f"dspark serve: {stopped} while loading; stopped", file=sys.stderr, flush=True)
        exit_now_if_compiling()
        return 0
    print(f"dspark serve: http://{args.host}:{port}/v1 (compiling; GET /health says ok when ready)",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level,
                            timeout_graceful_shutdown=uvicorn_grace_s(args.grace))
    log_requests_to_stderr(args.log_level)
    # The grace starts at the signal, not when uvicorn (after its own timeout) runs the lifespan shutdown.
    serve_until_stopped(config, sock, on_stop=lambda: loop.begin_shutdown(args.grace))
    exit_now_if_compiling()
    return 0


def exit_now_if_compiling() -> None:
    """End the process now, status 0, when one of our threads may still be inside an XLA compile (the
    warm-up, a background compiler, a cost-table profile): the interpreter's finalisation would stop that
    thread inside C++ and abort the process (exit 134, "FATAL: exception not rethrown"). Called after a
    clean shutdown, when nothing is left to write but the logs, which are flushed first."""
    busy = [t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith("dspark-")]
    if not busy:
        return
    print(f"dspark serve: stopped while compiling ({', '.join(sorted(set(busy)))})", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


def log_requests_to_stderr(level: str) -> None:
    """The HTTP layer's lines (a request cut at shutdown, a client that left) on stderr, as ours."""
    logger = logging.getLogger("dspark_jax.serve")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dspark serve: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def serve_until_stopped(config, sock: socket.socket, on_stop=None) -> None:
    """uvicorn.Server.run on `sock`, except that a SIGTERM ends the process with exit 0: uvicorn re-raises
    the signal that stopped it once it has shut down (the process would end "killed by SIGTERM"), but
    SIGTERM is how a server is asked to stop, and a clean stop is a success. `on_stop()` is called in
    the signal handler (SIGTERM or SIGINT), before uvicorn stops accepting."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if on_stop is not None:
                on_stop()
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                self._captured_signals = [s for s in self._captured_signals if s != signal.SIGTERM]

    GracefulServer(config).run(sockets=[sock])
