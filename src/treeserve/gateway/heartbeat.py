"""This process's heartbeat: a thread of its own writes "still here" (`Instances.heartbeat`: the
process's `gateway_instances` row, and nothing else) every HEARTBEAT_INTERVAL, in a short transaction
of its own, whatever the settlement writer is doing. Beaten on the writer thread, a writer stalled on
the database (a long batch, a lock wait behind another process, a slow PostgreSQL) for INSTANCE_TIMEOUT
stopped the beats, and another process's sweep gave back the holdings of requests still in flight here.

What a beat means: the requests this process holds can still end here (be answered, released, settled).
So the beats stop while the app's event loop, where they end, has not run for LOOP_STUCK_AFTER (and a
sweep then gives their holdings back, as a crashed process's), but not while the writer is stalled:
what it has queued is owed (released holds at their real cost), committed when it moves again, and a
sweep would give it back meanwhile (docs/GATEWAY.md: holdings and heartbeats)."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("treeserve.gateway")
HEARTBEAT_INTERVAL = 5.0  # seconds between a process's "still here" in gateway_instances
LOOP_STUCK_AFTER = 60.0  # seconds without an event loop tick after which the beats stop
LATE_AFTER = 3.0  # a beat committed this many intervals after the last one is logged late
CLOSE_WAIT = 10.0  # seconds `close` waits for a beat in flight (one can take longer: it then ends on its own)


class Heartbeat:
    """`beat` every `interval` seconds on a thread of its own, from `start` to `close`. Each beat's
    outcome ("ok", "failed", "withheld": the event loop stuck) goes to each of `observers`."""

    outcomes = ("ok", "failed", "withheld")

    def __init__(self, beat: Callable[[], None], interval: float = HEARTBEAT_INTERVAL):
        self.beat, self.interval = beat, interval
        self.stuck_after = LOOP_STUCK_AFTER
        self.observers: list[Callable[[str], None]] = []
        self.started_at = self.beaten_at = time.monotonic()  # (beaten_at: the last beat committed)
        self.ticked_at: float | None = None  # the event loop's last tick (None: no loop watched)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = self._withholding = False

    def start(self) -> None:
        """Beats from now on. Each start's thread has its own stop event: a thread that `close` stopped
        but did not see end (its beat outlasted CLOSE_WAIT) ends after that beat, never beats beside
        this one (clearing one shared event revived it)."""
        if self._thread is None:
            self._stop = threading.Event()
            self.started_at = self.beaten_at = time.monotonic()
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name="gateway-heartbeat",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        """No beats from now on (one in flight is waited for CLOSE_WAIT seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=CLOSE_WAIT)
            self._thread = None

    def tick(self) -> None:
        """The event loop ran just now (`keep_ticking`)."""
        self.ticked_at = time.monotonic()

    def unwatch(self) -> None:
        """No event loop watched from now on (shutting down: the process beats until `close`)."""
        self.ticked_at = None

    def age(self) -> float:
        """Seconds since this process's last committed beat (since `start`, before the first)."""
        return time.monotonic() - self.beaten_at

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._outcome(self._once())
            stop.wait(self.interval)

    def _once(self) -> str:
        if self._loop_stuck():
            return "withheld"
        try:
            self.beat()
        except Exception as error:  # (tried again next interval; a process silent INSTANCE_TIMEOUT is swept)
            log.warning("the gateway's heartbeat failed, %.1f s since the last one: %s", self.age(), error,
                        exc_info=not self._failing)
            self._failing = True
            return "failed"
        if self.age() > LATE_AFTER * self.interval:
            log.warning("the gateway's heartbeat was late: %.1f s since the last one", self.age())
        self._failing, self.beaten_at = False, time.monotonic()
        return "ok"

    def _loop_stuck(self) -> bool:
        """Whether the watched event loop has not ticked for `stuck_after` (logged when it starts and ends)."""
        stuck = self.ticked_at is not None and time.monotonic() - self.ticked_at > self.stuck_after
        if stuck != self._withholding:
            self._withholding = stuck
            if stuck:
                log.error("the gateway's event loop has not run for %.0f s: no heartbeats until it does "
                          "(another process will give back what this one holds)", self.stuck_after)
            else:
                log.warning("the gateway's event loop runs again: heartbeats again")
        return stuck

    def _outcome(self, outcome: str) -> None:
        for observer in self.observers:
            try:
                observer(outcome)
            except Exception:  # (one that raised ended the thread, silently: no beats from then on)
                log.exception("an observer of the gateway's heartbeat failed on %r (the beats go on)", outcome)


async def keep_ticking(heartbeat: Heartbeat) -> None:
    """The event loop's tick, every heartbeat interval, until cancelled (then no loop is watched:
    shutting down, settlements still committing, the process still beats)."""
    try:
        while True:
            heartbeat.tick()
            await asyncio.sleep(heartbeat.interval)
    finally:
        heartbeat.unwatch()
