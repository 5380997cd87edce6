#!/usr/bin/env python
"""A server's time to ready on a first and on later starts (issue 40, "first run").

Starts `dspark serve` (the embedded default unless --bundle says otherwise) --starts times in a row with
one fresh user cache folder ($XDG_CACHE_HOME in a temporary folder, so nothing of an earlier run is
reused), polls GET /health until it says ok, then stops the server with SIGTERM and waits for its exit.
The first start measures the cost table and compiles every program; a later one reads both from the
user cache. Prints a table: seconds to ready, exit status, and the cache's size after each start.

    python scripts/server_time_to_ready.py [--bundle DIR] [--slots 8] [--max-len 512] [--starts 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

READY_TIMEOUT_S = 1200  # a first start on a busy 2-core machine took over 5 minutes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200 and json.loads(r.read()).get("status") == "ok"
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return False


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def one_start(cmd: list[str], env: dict, port: int) -> tuple[float, int]:
    """(seconds from launch to /health ok, exit status after SIGTERM)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not healthy(port):
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}) before ready:\n{proc.stderr.read()}")
            if time.perf_counter() - t0 > READY_TIMEOUT_S:
                raise SystemExit(f"not ready after {READY_TIMEOUT_S} s")
            time.sleep(0.5)
        ready = time.perf_counter() - t0
        proc.send_signal(signal.SIGTERM)
        return ready, proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=None)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--starts", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dspark-ready-") as tmp:
        env = {**os.environ, "XDG_CACHE_HOME": tmp}
        env.pop("DSPARK_COMPILE_CACHE", None)  # the default: the user cache's xla/ folder
        port = free_port()
        cmd = [sys.executable, "-m", "dspark_jax.cli", "serve", "--port", str(port), "--slots", str(args.slots),
               "--max-len", str(args.max_len)] + (["--bundle", args.bundle] if args.bundle else [])
        print(f"{'start':>5s} {'ready s':>8s} {'exit':>4s} {'user cache MB':>13s}")
        for i in range(args.starts):
            ready, code = one_start(cmd, env, port)
            print(f"{i + 1:5d} {ready:8.1f} {code:4d} {folder_bytes(Path(tmp)) / 2**20:13.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
