"""One engine, driven by its own thread, fed by many callers: the core of `dspark serve`.

    loop = EngineLoop(make_engine, max_queue=64)
    loop.start()                                   # compiles every program in the thread; loop.ready after
    ticket = loop.submit(Request(...), on_event)   # on_event(Event) is called from the loop thread
    loop.cancel(ticket)                            # the slot is freed before the next round
    loop.begin_shutdown(grace_s=30)                # refuse new work; callers cut theirs once grace_over
    loop.shutdown(grace_s=30)                      # refuse new work, finish what runs, stop

Continuous batching is the engine's: requests join free slots between rounds and every round's tokens
are handed out as the round is read. The loop adds what a server needs around it:
  * back-pressure: at most `max_slots + max_queue` requests are accepted at once (`QueueFull` beyond);
  * isolation: if the engine raises, every request it held gets an error event (their callers answer
    500), the engine is rebuilt with `make_engine()` (its compiled programs stay in JAX's cache) and the
    next requests are served;
  * callers on other threads: submit/cancel only enqueue commands; the loop thread alone touches the
    engine, between steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import sys
import threading
import time
import traceback
from typing import Callable

from dspark_jax.serve import program_store
from dspark_jax.serve.engine import Engine, Event, Request, RequestError, Result


WARMUPS = ("full", "quick", "none")


class QueueFull(RuntimeError):
    """Every slot is busy and the waiting queue is full; try again later."""


class ShuttingDown(RuntimeError):
    """The server is stopping and accepts no new requests."""


@dataclasses.dataclass
class Ticket:
    """One accepted request, as the loop tracks it."""

    number: int
    request: Request
    on_event: Callable[[Event], None]
    engine_id: int | None = None  # set once the loop thread has submitted it


@dataclasses.dataclass
class LoopStats:
    rounds: int = 0
    failures: int = 0
    rebuilds: int = 0


class EngineLoop:
    def __init__(self, make_engine: Callable[[], Engine], *, max_queue: int = 64, warmup: str = "full",
                 on_round: Callable[[float], None] | None = None):
        if warmup not in WARMUPS:
            raise ValueError(f"EngineLoop warmup: expected one of {WARMUPS}, got {warmup!r}")
        self._make_engine = make_engine
        self.engine = make_engine()
        self.max_queue = int(max_queue)
        self.capacity = self.engine.config.max_slots + self.max_queue
        self._warmup = warmup
        self._on_round = on_round
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tickets: dict[int, Ticket] = {}  # accepted and not finished
        self._by_engine_id: dict[int, Ticket] = {}
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._accepting = True
        self._grace_deadline: float | None = None  # time.monotonic() at which the shutdown grace ends
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.stats = LoopStats()
        self._thread = threading.Thread(target=self._run, name="dspark-engine-loop", daemon=True)

    # ---- callers (any thread) ----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def validate(self, request: Request) -> Request:
        """-> the request checked; RequestError naming what is wrong (the engine's own checks)."""
        return self.engine.validate(request)

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Ticket:
        self.validate(request)
        with self._lock:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self._tickets) >= self.capacity:
                raise QueueFull(f"all {self.engine.config.max_slots} slots are busy and {self.max_queue} requests "
                                "are waiting")
            ticket = Ticket(next(self._numbers), request, on_event)
            self._tickets[ticket.number] = ticket
        self._commands.put(("submit", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        self._commands.put(("cancel", ticket))

    @property
    def accepted(self) -> int:
        """Requests accepted and not finished (running or waiting)."""
        return len(self._tickets)

    @property
    def active_slots(self) -> int:
        return self.engine.active

    @property
    def queue_depth(self) -> int:
        return max(0, self.accepted - self.active_slots)

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests from now on; the accepted ones have `grace_s` seconds (`grace_over` after).
        Returns at once. Safe in a signal handler: it takes no lock (the interrupted thread may hold it,
        inside submit), and both assignments are atomic. A second call can only shorten the grace."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        if self._grace_deadline is None or deadline < self._grace_deadline:
            self._grace_deadline = deadline

    @property
    def stopping(self) -> bool:
        """The server is shutting down: no new request is accepted."""
        return not self._accepting

    @property
    def grace_over(self) -> bool:
        """The shutdown grace has run out: whoever still waits for a request should answer it now (the
        HTTP handlers end streams with an error event and answer 503) instead of waiting for the engine."""
        return self._grace_deadline is not None and time.monotonic() >= self._grace_deadline

    def shutdown(self, grace_s: float = 30.0) -> bool:
        """Refuse new requests, let the accepted ones finish for up to `grace_s` (from an earlier
        `begin_shutdown`'s start when there was one), cancel the rest, stop.
        -> True when everything finished within the grace period."""
        self.begin_shutdown(grace_s)
        with self._lock:  # a submit that saw _accepting before it turned False has added its ticket by now
            pass
        while self._tickets and not self.grace_over and self._thread.is_alive():
            time.sleep(0.02)
        clean = not self._tickets
        self._commands.put(("cancel_all", None))
        self._stop.set()  # the idle loop polls its commands every 50 ms and sees it
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        self.engine.close(wait=False)  # a background compiler stops at its next program
        return clean

    # ---- the loop thread ---------------------------------------------------------------------
    def _run(self) -> None:
        if self._warmup != "none":
            self._warm_up()
        self.ready.set()
        while True:
            idle = self.engine.idle
            if self._stop.is_set() and idle:
                return
            self._take_commands(block=idle)
            if self.engine.idle:
                continue
            t0 = time.perf_counter()
            try:
                events = self.engine.step()
            except Exception as err:  # noqa: BLE001 (any engine fault: fail these requests, keep serving)
                self._recover(err)
                continue
            dt = time.perf_counter() - t0
            self.stats.rounds += 1
            if self._on_round is not None:
                self._on_round(dt)
            for ev in events:
                self._deliver(ev)

    def _warm_up(self) -> None:
        """Compile before the server says it is ready. "full": every program the engine can dispatch
        (no request ever waits for a compile; minutes on a CPU, see `--compile-cache`); "quick": what
        one greedy and one sampled request run (the rest compile in the background while serving, policy
        "background", see serve_cli.WARMUP_POLICY)."""
        if self._warmup == "full":
            n = self.engine.warm_up()
            store = program_store.current()
            print(f"dspark serve: warm-up done, {n} programs" + (f" ({store.summary()})" if store else ""),
                  file=sys.stderr, flush=True)
            return
        vocab = self.engine.vocab
        reqs = [Request([1 % vocab, 2 % vocab], max_tokens=2 * self.engine.k + 2, temperature=t, seed=0)
                for t in (0.0, 1.0)]
        try:
            self.engine.generate(reqs)
        finally:
            self.engine.close(wait=False)  # its background compiler (--warmup quick): the new engine's takes over
            self.engine = self._make_engine()  # fresh metrics and state; the compiled programs stay cached

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, ticket: Ticket | None) -> None:
        if kind == "submit":
            if ticket.number not in self._tickets:  # cancelled before it was submitted
                return
            try:
                ticket.engine_id = self.engine.submit(ticket.request)
            except RequestError as err:  # checked in submit(); kept so a bad one can never stop the loop
                self._finish(ticket, Event(-1, ticket.request.id, [], "error", str(err),
                                           Result(ticket.request.id, [], "error", str(err))))
                return
            self._by_engine_id[ticket.engine_id] = ticket
        elif kind == "cancel":
            if ticket.engine_id is None:
                if self._tickets.get(ticket.number) is ticket:
                    self._finish(ticket, Event(-1, ticket.request.id, [], "cancelled",
                                               result=Result(ticket.request.id, [], "cancelled")))
            else:  # False when it already finished: its finish event was (or is being) delivered
                self.engine.cancel(ticket.engine_id)
        elif kind == "cancel_all":
            self.engine.cancel_all()

    def _deliver(self, ev: Event) -> None:
        ticket = self._by_engine_id.get(ev.id)
        if ticket is None:
            return
        if ev.finish_reason:
            self._by_engine_id.pop(ev.id, None)
            self._finish(ticket, ev)
        else:
            self._call(ticket, ev)

    def _finish(self, ticket: Ticket, ev: Event) -> None:
        with self._lock:
            self._tickets.pop(ticket.number, None)
        self._call(ticket, ev)

    @staticmethod
    def _call(ticket: Ticket, ev: Event) -> None:
        try:
            ticket.on_event(ev)
        except Exception:  # noqa: BLE001 (one caller's broken callback must not stop the loop)
            traceback.print_exc()

    def _recover(self, err: Exception) -> None:
        """The engine raised: every request it held fails with the error; a fresh engine takes over."""
        self.stats.failures += 1
        message = f"internal engine error: {type(err).__name__}: {err}"
        traceback.print_exc()
        held = list(self._by_engine_id.values())
        self._by_engine_id.clear()
        for ticket in held:
            self._finish(ticket, Event(ticket.engine_id, ticket.request.id, [], "error", message,
                                       Result(ticket.request.id, [], "error", message)))
        self.engine.close(wait=False)
        self.engine = self._make_engine()
        self.stats.rebuilds += 1
