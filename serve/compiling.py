"""When the engine's programs compile: the compile policy, a compile counter, the background compiler.

An engine dispatches a fixed, known set of jitted programs (admit buckets, plain and speculative rounds
per verify width, catch-up widths: `Engine.programs()`). A program compiled while requests are being
served stalls all of them for the compile (seconds on a CPU, 10x a round), so the policy decides when
the set is compiled:
  * "eager" (the default): every program, before the first one is dispatched, ahead of time and in
    parallel (XLA compiles outside the GIL). The first request waits for all of them; no request after
    it ever waits for a compile. With JAX's persistent compilation cache on (`dspark serve --compile-cache`),
    a second process loads them from disk instead.
  * "background": a thread compiles them in the background, the programs the first request needs first;
    the engine serves with what is compiled (a wider compiled verify width, one round per call, or plain
    steps, all lossless) and waits only for a program it cannot do without (an admit bucket, the first
    plain step). The first token comes early; speculation reaches full speed once the set is compiled.
  * "lazy": each program compiles when first dispatched (the old behaviour; what the tests use, since
    they dispatch few of the programs).
Why eager is the default: it is the only policy whose timings are steady from the second request on,
which is what a benchmark, a rollout and a server after warm-up need; `background` is for interactive
use where the first token matters more than the first minute's speed.

The environment variable DSPARK_COMPILE sets the default policy (the test suite sets "lazy").
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, Iterable

import jax

POLICIES = ("eager", "background", "lazy")
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a compile, or a persistent-cache load
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def default_policy() -> str:
    """The compile policy an EngineConfig gets when none is named: $DSPARK_COMPILE, else "eager"."""
    return os.environ.get("DSPARK_COMPILE", "eager")


class _Counter:
    """Counts XLA compilations in this process (listeners registered on first use). JAX reports the time
    of "compile or load from the persistent cache" as one event, and a cache hit as another: a compile
    is the first without the second."""

    def __init__(self):
        self._calls = 0
        self._hits = 0
        self.seconds = 0.0  # in compile-or-load: a load from the persistent cache takes its (short) time too
        self._lock = threading.Lock()
        self._registered = False

    @property
    def count(self) -> int:
        return self._calls - self._hits

    def _listen_duration(self, name: str, duration: float, **_) -> None:
        if name == _COMPILE_EVENT:
            with self._lock:
                self._calls += 1
                self.seconds += duration

    def _listen_event(self, name: str, **_) -> None:
        if name == _CACHE_HIT_EVENT:
            with self._lock:
                self._hits += 1

    def ensure(self) -> None:
        if not self._registered:
            jax.monitoring.register_event_duration_secs_listener(self._listen_duration)
            jax.monitoring.register_event_listener(self._listen_event)
            self._registered = True


_COUNTER = _Counter()


def compiles_so_far() -> int:
    """XLA compilations in this process since the counter was first used (persistent-cache hits are not
    compilations). Call once early (e.g. `compiles_so_far()` before the work) to start counting."""
    _COUNTER.ensure()
    return _COUNTER.count


@contextlib.contextmanager
def count_compiles():
    """with count_compiles() as c: ...  ->  c["n"] XLA compilations inside (loads from the persistent cache
    are not), c["s"] seconds spent compiling or loading."""
    _COUNTER.ensure()
    n0, s0 = _COUNTER.count, _COUNTER.seconds
    out = {"n": 0, "s": 0.0}
    try:
        yield out
    finally:
        out["n"], out["s"] = _COUNTER.count - n0, _COUNTER.seconds - s0


# Memory maps one compiled program holds on XLA:CPU (each fused kernel is its own JIT object; measured
# 500-800 on the tiny and the embedded models), against the kernel's per-process limit vm.max_map_count
# (65,530 by default). Past it, LLVM cannot allocate a program's code and XLA aborts the process.
MAPS_PER_CPU_PROGRAM = 800


def map_headroom() -> int | None:
    """Memory maps this process may still create (Linux), else None (unknown: no limit assumed)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps") as f:
            used = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return limit - used


def fits_in_memory_maps(programs: int) -> bool:
    """Whether `programs` more compiled programs fit in this process's memory maps (always, off CPU)."""
    if jax.default_backend() != "cpu":
        return True
    headroom = map_headroom()
    return headroom is None or programs * MAPS_PER_CPU_PROGRAM <= headroom


def release_programs() -> None:
    """Drop every compiled program of this process (JAX's caches). Call it between engines that each
    compiled their whole set (policy "eager") when the earlier ones are done: on XLA:CPU a few engines'
    sets exceed the memory maps a process may hold (`fits_in_memory_maps`)."""
    jax.clear_caches()


def compile_workers() -> int:
    """Threads that compile at once: one per core (XLA compiles outside the GIL), at least one."""
    return max(1, os.cpu_count() or 1)


def compile_all(keys: Iterable[Hashable], compile_one: Callable[[Hashable], None], *, progress=None) -> None:
    """compile_one(key) for every key, in parallel threads; `progress(n)` after each (e.g. a tqdm update).
    The first error is raised after the others finish."""
    keys = list(keys)
    if not keys:
        return
    with ThreadPoolExecutor(max_workers=min(compile_workers(), len(keys)), thread_name_prefix="dspark-compile") as pool:
        futures = [pool.submit(compile_one, k) for k in keys]
        for f in futures:
            f.result()
            if progress is not None:
                progress(1)


class BackgroundCompiler:
    """Compiles keys one after another in a worker thread, in the order given, skipping those `done(key)`
    already reports. A non-daemon thread that stops at the next key once `stop()` is called or the
    interpreter exits: it never ends the process in the middle of an XLA compile (an abort)."""

    def __init__(self, keys: Iterable[Hashable], compile_one: Callable[[Hashable], None],
                 done: Callable[[Hashable], bool]):
        self._keys = list(keys)
        self._compile_one, self._done = compile_one, done
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dspark-background-compile")
        _at_interpreter_exit(self._stop.set)
        self._thread.start()

    def _run(self) -> None:
        try:
            for key in self._keys:
                if self._stop.is_set():
                    return
                if not self._done(key):
                    self._compile_one(key)
        except BaseException as err:  # noqa: BLE001 (kept for the engine: it compiles what it needs itself)
            self.error = err
        finally:
            self.finished.set()

    def stop(self, wait: bool = True) -> None:
        self._stop.set()
        if wait and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()


def _at_interpreter_exit(fn: Callable[[], None]) -> None:
    """Run fn when the interpreter starts to exit, BEFORE it joins non-daemon threads (so a worker can
    stop at its next key instead of compiling everything first). threading._register_atexit is what
    concurrent.futures uses for the same purpose; without it, atexit (after the join) is the fallback."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(fn)
            return
    except RuntimeError:  # already shutting down
        fn()
        return
    import atexit  # noqa: PLC0415

    atexit.register(fn)
