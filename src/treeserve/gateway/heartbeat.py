"""This process's heartbeat: a thread of its own writes "still here" (`Instances.heartbeat`: the
process's `gateway_instances` row, and nothing else) every HEARTBEAT_INTERVAL, in a short transaction
of its own, whatever the settlement writer is doing. Beaten on the writer thread, a writer stalled on
the database (a long batch, a lock wait behind another process, a slow PostgreSQL) for INSTANCE_TIMEOUT
stopped the beats, and another process's sweep gave back the holdings of requests still in flight here.

What a beat means: the requests this process holds can still end here (be answered, released, settled).
So the beats stop while the app's event loop, where they end, has not run for LOOP_STUCK_AFTER (and a
sweep then gives their holdings back, as a crashed process's), but not while the writer is stalled:
what it has queued is owed (released holds at their real cost), committed when it moves again, and a
sweep would give it back meanwhile (docs/GATEWAY.md: holdings and heartbeats).

A process stopped and resumed (SIGSTOP/SIGCONT, a paused container, a suspended machine where the
monotonic clock runs on) ran neither its loop nor this thread meanwhile: that time is not the loop's
silence. It is told apart by this thread's own wait, which overran by as long while the process used
next to no CPU time (a loop stuck in a call that holds the GIL keeps the thread waiting too, but burns CPU)."""
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
SUSPENDED_AFTER = 1.0  # seconds (or an interval, if longer) the wait overran, next to no CPU used: a suspension


class Heartbeat:
    """`beat` every `interval` seconds on a thread of its own, from `start` to `close`. Each beat's
    outcome ("ok", "failed", "withheld": the event loop stuck) goes to each of `observers`; each
    suspension of the process (its seconds) to each of `suspension_observers`. `clock` and `cpu_clock`
    (time.monotonic, time.process_time) are what it reads."""

    outcomes = ("ok", "failed", "withheld")

    def __init__(self, beat: Callable[[], None], interval: float = HEARTBEAT_INTERVAL,
                 clock: Callable[[], float] = time.monotonic, cpu_clock: Callable[[], float] = time.process_time):
        self.beat, self.interval, self.clock, self.cpu_clock = beat, interval, clock, cpu_clock
        self.stuck_after = LOOP_STUCK_AFTER
        self.observers: list[Callable[[str], None]] = []
        self.suspension_observers: list[Callable[[float], None]] = []
        self.started_at = self.beaten_at = clock()  # (beaten_at: the last beat committed)
        self.suspended = 0.0  # seconds this process was seen suspended, in all
        self._tick: tuple[float, float] | None = None  # the loop's last tick, `suspended` then (None: no loop watched)
        self._resting: tuple[float, float] | None = None  # clock and cpu_clock as this thread began its wait
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = self._withholding = False

    def start(self) -> None:
        """Beats from now on. Each start's thread has its own stop event: a thread that `close` stopped
        but did not see end (its beat outlasted CLOSE_WAIT) ends after that beat, never beats beside
        this one (clearing one shared event revived it)."""
        if self._thread is None:
            self._stop = threading.Event()
            self.started_at = self.beaten_at = self.clock()
            self._resting = None
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
        self._tick = (self.clock(), self.suspended)  # (one assignment: this thread reads it whole)

    def unwatch(self) -> None:
        """No event loop watched from now on (shutting down: the process beats until `close`)."""
        self._tick = None

    def age(self) -> float:
        """Seconds since this process's last committed beat (since `start`, before the first)."""
        return self.clock() - self.beaten_at

    def loop_silence(self) -> float | None:
        """Seconds the watched event loop has not ticked while this process ran (its suspensions left
        out); None while no loop is watched."""
        tick = self._tick
        if tick is None:
            return None
        ticked_at, suspended_then = tick
        return self.clock() - ticked_at - (self.suspended - suspended_then)

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.beat_once()
            stop.wait(self.interval)

    def beat_once(self) -> str:
        """One beat, or none while the loop is stuck; its outcome, told to `observers`. The thread calls
        it every interval (its wait begins as this returns)."""
        outcome = self._once(self._suspension())
        self._outcome(outcome)
        self._resting = (self.clock(), self.cpu_clock())
        return outcome

    def _once(self, suspended: float) -> str:
        if self._loop_stuck():
            return "withheld"
        try:
            self.beat()
        except Exception as error:  # (tried again next interval; a process silent INSTANCE_TIMEOUT is swept)
            log.warning("the gateway's heartbeat failed, %.1f s since the last one: %s", self.age(), error,
                        exc_info=not self._failing)
            self._failing = True
            return "failed"
        if not suspended and self.age() > LATE_AFTER * self.interval:
            log.warning("the gateway's heartbeat was late: %.1f s since the last one", self.age())
        self._failing, self.beaten_at = False, self.clock()
        return "ok"

    def _suspension(self) -> float:
        """Seconds this thread's last wait overran while the process used next to no CPU time: the
        process was stopped (SIGSTOP, a paused container, a suspended machine), its loop with it, and
        that time is not the loop's silence (logged, added to `suspended`, told to `suspension_observers`).
        A wait that overran while the process burnt CPU (a call holding the GIL) is no suspension."""
        if self._resting is None:
            return 0.0
        rested_at, cpu_then = self._resting
        overran = self.clock() - rested_at - self.interval
        if overran < max(SUSPENDED_AFTER, self.interval) or self.cpu_clock() - cpu_then > overran / 2:
            return 0.0
        self.suspended += overran
        log.warning("this gateway process was suspended for %.1f s (stopped by SIGSTOP, a paused container or a "
                    "suspended machine, or given no CPU): neither its event loop nor its heartbeat ran; the loop is "
                    "not taken for stuck (another process may have given back what this one held meanwhile)", overran)
        for observer in self.suspension_observers:
            self._tell(observer, overran)
        return overran

    def _loop_stuck(self) -> bool:
        """Whether the watched event loop has not ticked for `stuck_after` while the process ran
        (logged when it starts and ends)."""
        silence = self.loop_silence()
        stuck = silence is not None and silence > self.stuck_after
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
            self._tell(observer, outcome)

    @staticmethod
    def _tell(observer: Callable, what: str | float) -> None:
        try:
            observer(what)
        except Exception:  # (one that raised ended the thread, silently: no beats from then on)
            log.exception("an observer of the gateway's heartbeat failed on %r (the beats go on)", what)


async def keep_ticking(heartbeat: Heartbeat) -> None:
    """The event loop's tick, every heartbeat interval, until cancelled (then no loop is watched:
    shutting down, settlements still committing, the process still beats)."""
    try:
        while True:
            heartbeat.tick()
            await asyncio.sleep(heartbeat.interval)
    finally:
        heartbeat.unwatch()
