"""A gateway process's heartbeat (gateway/heartbeat.py) beats on a thread of its own: a settlement writer
stalled on the database does not make the process look dead to another process's sweep, which gave back
the holdings of its requests in flight (budgets and rate limits then admitted past their limits); a stuck
event loop, where its requests end, does stop the beats."""
from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time

import pytest
from sqlalchemy import select, update

from treeserve.gateway import instances as instances_module
from treeserve.gateway import settlement as settlement_module
from treeserve.gateway import store as store_module
from treeserve.gateway.heartbeat import Heartbeat, keep_ticking
from treeserve.gateway.metrics import GatewayMetrics
from treeserve.gateway.schema import ApiKey, Instance, User, utcnow
from treeserve.gateway.settlement import Settlement
from treeserve.gateway.store import Store
from treeserve.gateway.usage import Usage

BEAT = 0.2  # seconds between beats here (5 s in a gateway)
DEAD_AFTER = 1.0  # seconds of silence after which a sweep takes a process for dead here (60 s in a gateway)


@pytest.fixture
def quick(monkeypatch):
    """Beats every BEAT s, processes dead after DEAD_AFTER s, for the Stores made from now on."""
    monkeypatch.setattr(store_module, "HEARTBEAT_INTERVAL", BEAT)
    monkeypatch.setattr(instances_module, "INSTANCE_TIMEOUT", DEAD_AFTER)


def _keys(store: Store, count: int) -> list:
    store.accounts.create_user("u")
    return [store.accounts.authenticate(store.accounts.create_key(user_id="u", max_budget=1.0,
                                                                  max_parallel_requests=1)[0]) for _ in range(count)]


def _settlement(reservation, request_id: str, cost: float) -> Settlement:
    return Settlement(reservation, request_id, "m", None, "chat", False, "success", Usage(1, 1), cost, utcnow())


def _silent_for(reader: Store, store: Store) -> float:
    """Seconds since `store`'s process last beat, as another process reads it."""
    with reader.db.session() as s:
        seen_at = s.scalar(select(Instance.seen_at).where(Instance.instance_id == store.instances.instance_id))
    if seen_at.tzinfo is None:
        seen_at = seen_at.replace(tzinfo=dt.timezone.utc)
    return (utcnow() - seen_at).total_seconds()


def _owed(store: Store) -> tuple:
    """(each key's (reserved, in_flight, spend), the user's (reserved, spend)), rounded."""
    with store.db.session() as s:
        keys = [(round(k.reserved, 9), k.in_flight, round(k.spend, 9))
                for k in s.scalars(select(ApiKey).order_by(ApiKey.id))]
        user = s.get(User, "u")
        return keys, (round(user.reserved, 9), round(user.spend, 9))


def _in_thread(job, results: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(job()), daemon=True)
    thread.start()
    return thread


def test_a_slow_settlement_batch_does_not_stop_the_heartbeat(quick, database, monkeypatch):
    """The writer thread held up in a batch (here: before its transaction, so SQLite's one writer is free)
    for 3 s, three times the time after which a process is dead: the process still beats, and another
    process's sweep leaves its request in flight alone; both settle, nothing given back twice."""
    gate = threading.Event()
    commit = settlement_module.commit_settlements

    def slow_commit(db, items):
        gate.wait(30)
        commit(db, items)
    monkeypatch.setattr(settlement_module, "commit_settlements", slow_commit)
    owner, sweeper = Store(database), Store(database)
    owner.migrate()
    try:
        settled_key, serving_key = _keys(owner, 2)
        owner.start()
        in_flight = owner.admission.admit(serving_key, 0.25)  # (a request still running: its holding)
        answered = owner.admission.admit(settled_key, 0.25)
        owner.admission.release(answered, 0.1)
        owner.ledger.settle_later(_settlement(answered, "answered", 0.1))
        time.sleep(3 * DEAD_AFTER)
        assert _silent_for(sweeper, owner) < DEAD_AFTER / 2, "the heartbeat stopped with the settlement writer"
        assert owner.ledger.writer_busy_for() > 2 * DEAD_AFTER  # (the writer is stalled)
        assert sweeper.instances.sweep() == 0, "a live process's requests in flight were given back"
        gate.set()
        owner.ledger.flush()
        owner.admission.release(in_flight, 0.2)
        owner.ledger.settle(_settlement(in_flight, "in flight", 0.2))
        assert _owed(owner) == ([(0.0, 0, 0.1), (0.0, 0, 0.2)], (0.0, 0.3))
    finally:
        gate.set()
        for each in (owner, sweeper):
            each.close()


def test_a_settlement_writer_waiting_on_a_locked_key_does_not_stop_the_heartbeat(quick, postgres):
    """PostgreSQL: another transaction holds a key's row (an operator's, another process's long one); this
    process's settlement batch on that key waits for it 3 s. Its heartbeats (the instances row alone, a
    connection of their own) go on, and a sweep leaves its other request, in flight, alone."""
    url = postgres.new_database()
    owner, sweeper, blocker = Store(url), Store(url), Store(url)
    owner.migrate()
    swept: list[int] = []
    try:
        locked_key, serving_key = _keys(owner, 2)
        owner.start()
        in_flight = owner.admission.admit(serving_key, 0.25)
        answered = owner.admission.admit(locked_key, 0.25)
        owner.admission.release(answered, 0.1)
        with blocker.db.transaction() as hold:
            hold.execute(update(ApiKey).where(ApiKey.id == locked_key.id).values(spend=ApiKey.spend))
            owner.ledger.settle_later(_settlement(answered, "answered", 0.1))
            time.sleep(3 * DEAD_AFTER)
            silent, busy = _silent_for(sweeper, owner), owner.ledger.writer_busy_for()
            sweep = _in_thread(sweeper.instances.sweep, swept)
            sweep.join(5)  # (one that takes the process for dead waits on the locked key: it ends below)
        sweep.join(30)
        assert busy > 2 * DEAD_AFTER  # (the writer waited on the key's row all along)
        assert silent < DEAD_AFTER / 2, "the heartbeat stopped with the settlement writer"
        assert swept == [0], "a live process's requests in flight were given back"
        owner.ledger.flush()
        owner.admission.release(in_flight, 0.2)
        owner.ledger.settle(_settlement(in_flight, "in flight", 0.2))
        assert _owed(owner) == ([(0.0, 0, 0.1), (0.0, 0, 0.2)], (0.0, 0.3))
    finally:
        for each in (owner, sweeper, blocker):
            each.close()


def test_requests_waiting_on_a_locked_key_with_every_pooled_connection_do_not_stop_the_heartbeat(quick, postgres):
    """PostgreSQL: another transaction holds a key's row; this process's requests on that key wait for it
    in their admission transactions, more of them than its pool has connections (10, and 20 over). The
    beat took its connection from that pool: it waited for one past the pool's 30 s, the process went
    silent, and a sweep gave back its other request in flight (its key over-admitted). A beat's
    connection is its own."""
    url = postgres.new_database()
    owner, sweeper, blocker = Store(url), Store(url), Store(url)
    owner.migrate()
    waiting: list = []
    try:
        locked_key, serving_key = _keys(owner, 2)
        owner.start()
        in_flight = owner.admission.admit(serving_key, 0.25)
        with blocker.db.transaction() as hold:
            hold.execute(update(ApiKey).where(ApiKey.id == locked_key.id).values(spend=ApiKey.spend))
            admits = [_in_thread(lambda: _refused_or(owner.admission.admit, locked_key, 0.0), waiting)
                      for _ in range(32)]  # (each holds a pooled connection while it waits on the row)
            time.sleep(3 * DEAD_AFTER)
            silent = _silent_for(sweeper, owner)
            swept = sweeper.instances.sweep()
        for admit in admits:
            admit.join(30)
        assert silent < DEAD_AFTER / 2, "the heartbeat waited for a connection behind the requests"
        assert swept == 0, "a live process's requests in flight were given back"
        owner.admission.release(in_flight, 0.2)
        owner.ledger.settle(_settlement(in_flight, "in flight", 0.2))
        assert _owed(owner)[0][1] == (0.0, 0, 0.2)
    finally:
        for each in (owner, sweeper, blocker):
            each.close()


def _refused_or(call, *args):
    """`call`'s result, or the error it raised (a request refused: its key's parallel slot taken)."""
    try:
        return call(*args)
    except Exception as error:
        return error


def test_a_process_whose_event_loop_is_stuck_stops_beating_until_it_runs_again(quick, database):
    """Its requests end on its event loop: one that has not run for the heartbeat's bound holds them for
    good, so the beats stop (logged, counted "withheld") and a sweep gives back what it holds, as a crashed
    process's; the loop running again, the beats come back. A closed Store beats no more."""
    owner, sweeper = Store(database), Store(database)
    owner.migrate()
    outcomes: list[str] = []
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    try:
        (key,) = _keys(owner, 1)
        owner.heartbeat.stuck_after = DEAD_AFTER / 2
        owner.heartbeat.observers.append(outcomes.append)
        owner.start()
        runner.start()
        ticking = asyncio.run_coroutine_threadsafe(keep_ticking(owner.heartbeat), loop)
        owner.admission.admit(key, 0.25)
        time.sleep(2 * DEAD_AFTER)
        assert sweeper.instances.sweep() == 0  # (the loop runs: alive)
        loop.call_soon_threadsafe(time.sleep, 4 * DEAD_AFTER)  # (the loop stuck in a blocking call)
        time.sleep(3 * DEAD_AFTER)
        assert "withheld" in outcomes and _silent_for(sweeper, owner) > DEAD_AFTER
        assert sweeper.instances.sweep() == 1
        time.sleep(2 * DEAD_AFTER)  # (the loop has run again)
        assert _silent_for(sweeper, owner) < DEAD_AFTER / 2 and outcomes[-1] == "ok"
        assert _owed(owner) == ([(0.0, 0, 0.0)], (0.0, 0.0))
        ticking.cancel()
        owner.close()
        silent = _silent_for(sweeper, owner)
        time.sleep(3 * BEAT)
        assert _silent_for(sweeper, owner) > silent + 2 * BEAT, "a closed Store still beats"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        for each in (owner, sweeper):
            each.close()


def _beat_until(heartbeat: Heartbeat, calls: list, count: int) -> None:
    """Runs `heartbeat` until it has beaten `count` times (10 s at most), then closes it."""
    heartbeat.start()
    try:
        deadline = time.monotonic() + 10
        while len(calls) < count and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        heartbeat.close()


def test_a_failing_heartbeat_is_logged_counted_and_tried_again(caplog):
    """A beat that fails (the database down) is logged (its traceback once) and counted, and the thread
    goes on beating; a late beat is logged; `/metrics` shows the outcomes and the age of the last beat."""
    calls: list[float] = []

    def beat():
        calls.append(time.monotonic())
        if len(calls) <= 4:
            raise RuntimeError("database down")
    heartbeat, metrics = Heartbeat(beat, interval=0.05), GatewayMetrics()
    metrics.watch(heartbeat, lambda: 7.0)
    with caplog.at_level(logging.WARNING, logger="treeserve.gateway"):
        _beat_until(heartbeat, calls, 7)
    count = len(calls)
    time.sleep(0.2)
    assert len(calls) == count >= 7, "the heartbeat thread stopped at a failure, or beat after close"
    failed = [r for r in caplog.records if "heartbeat failed" in r.getMessage()]
    assert len(failed) == 4 and [bool(r.exc_info) for r in failed] == [True, False, False, False]
    assert any("heartbeat was late" in r.getMessage() for r in caplog.records)  # (4 failures: 0.2 s)
    scrape = metrics.render().decode()
    assert 'treeserve_gateway:heartbeats_total{outcome="failed"} 4.0' in scrape
    assert 'treeserve_gateway:heartbeats_total{outcome="ok"}' in scrape
    assert "treeserve_gateway:settlement_writer_busy_seconds 7.0" in scrape
    assert "treeserve_gateway:heartbeat_age_seconds" in scrape


def test_each_heartbeat_outcome_is_scraped_from_the_start():
    """`heartbeats_total` has its three outcomes at 0 before any beat: a series that first appears at 1 (the
    first failed or withheld beat) is one that `increase()`, and an alert on it, does not see."""
    metrics = GatewayMetrics()
    metrics.watch(Heartbeat(lambda: None), lambda: 0.0)
    scrape = metrics.render().decode()
    for outcome in ("ok", "failed", "withheld"):
        assert f'treeserve_gateway:heartbeats_total{{outcome="{outcome}"}} 0.0' in scrape


def _beating() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gateway-heartbeat" and t.is_alive()]


def test_a_heartbeat_restarted_while_a_closed_ones_beat_is_in_flight_beats_on_one_thread(monkeypatch):
    """(`close` waits a while for a beat in flight, and one can take longer, a connect timeout and a statement
    timeout; `start` cleared the one stop event, which revived that thread: two threads beat)"""
    from treeserve.gateway import heartbeat as heartbeat_module

    monkeypatch.setattr(heartbeat_module, "CLOSE_WAIT", 0.1, raising=False)
    in_flight, release, calls = threading.Event(), threading.Event(), []

    def beat():
        calls.append(threading.current_thread())
        if len(calls) == 1:
            in_flight.set()
            release.wait(30)
    heartbeat = Heartbeat(beat, interval=0.05)
    before = set(_beating())
    heartbeat.start()
    try:
        assert in_flight.wait(10)
        heartbeat.close()  # (the beat still in flight)
        heartbeat.start()
        release.set()
        deadline = time.monotonic() + 10
        while len(calls) < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # (the old thread's beat returned: it would beat again now)
        beating = set(_beating()) - before
        assert len(beating) == 1, f"{len(beating)} heartbeat threads"
        assert {t for t in calls[-3:]} == beating
    finally:
        heartbeat.close()


def test_an_observer_that_raises_is_logged_and_the_beats_go_on(caplog):
    """(an exception from an observer, the metrics' callback, ended the thread silently: no beats from then on,
    and another process's sweep gave back this one's holdings)"""
    calls: list[float] = []
    heartbeat = Heartbeat(lambda: calls.append(time.monotonic()), interval=0.05)

    def observer(outcome: str) -> None:
        raise RuntimeError("observer broke")
    heartbeat.observers.append(observer)
    with caplog.at_level(logging.ERROR, logger="treeserve.gateway"):
        _beat_until(heartbeat, calls, 3)
    assert len(calls) >= 3, "the heartbeat thread ended at the observer's exception"
    logged = [r for r in caplog.records if "observer of the gateway's heartbeat failed" in r.getMessage()]
    assert logged and logged[0].exc_info


class _Clocks:
    """The monotonic and CPU clocks a heartbeat reads, moved by the test: one interval of a process running
    (its CPU clock moves a little), or stopped (SIGSTOP: neither moves but the monotonic one)."""

    def __init__(self):
        self.now, self.cpu = 1000.0, 10.0

    def monotonic(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.cpu

    def run(self, seconds: float, cpu: float | None = None) -> None:
        self.now += seconds
        self.cpu += seconds * 0.02 if cpu is None else cpu


def _clocked(clocks: _Clocks, outcomes: list) -> tuple[Heartbeat, GatewayMetrics]:
    """A heartbeat of 5 s intervals on `clocks` (stuck after 60 s), beaten once with its loop ticking."""
    heartbeat = Heartbeat(lambda: None, interval=5.0, clock=clocks.monotonic, cpu_clock=clocks.process_time)
    metrics = GatewayMetrics()
    metrics.watch(heartbeat, lambda: 0.0)
    heartbeat.observers.append(outcomes.append)
    heartbeat.stuck_after = 60.0
    heartbeat.tick()
    heartbeat.beat_once()
    return heartbeat, metrics


def _interval(heartbeat: Heartbeat, clocks: _Clocks, loop_runs: bool = True) -> None:
    """One interval as the thread waits it: the loop ticks (unless stuck), then the thread beats."""
    clocks.run(heartbeat.interval)
    if loop_runs:
        heartbeat.tick()
    heartbeat.beat_once()


def _said(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("loop_ticks_first", [False, True])
def test_a_process_stopped_and_resumed_is_not_taken_for_one_whose_event_loop_is_stuck(caplog, loop_ticks_first):
    """SIGSTOP, and SIGCONT ten minutes later (or a paused container, a suspended machine): neither the loop
    nor the heartbeat thread ran. The thread, waking first (or after the loop's first tick), saw the loop
    silent for ten minutes and withheld its beat as if the loop were stuck, logging so ("withheld" counted,
    an alert on it fired). It beats, says the process was suspended, and counts the seconds."""
    clocks, outcomes = _Clocks(), []
    heartbeat, metrics = _clocked(clocks, outcomes)
    for _ in range(3):
        _interval(heartbeat, clocks)
    with caplog.at_level(logging.WARNING, logger="treeserve.gateway"):
        clocks.run(600.0, cpu=0.0)  # (stopped in the thread's wait: nothing ran)
        _interval(heartbeat, clocks, loop_runs=loop_ticks_first)
        _interval(heartbeat, clocks)
    assert outcomes == ["ok"] * 6, "a suspended process's beat was withheld as a stuck loop's"
    said = _said(caplog)
    assert "suspended for 600.0 s" in said and "has not run" not in said and "was late" not in said
    scrape = metrics.render().decode()
    assert 'treeserve_gateway:heartbeats_total{outcome="withheld"} 0.0' in scrape
    assert "treeserve_gateway:suspended_seconds_total 600.0" in scrape


def test_a_loop_stuck_before_and_after_a_suspension_is_stuck_for_the_time_the_process_ran(caplog):
    """The loop's silence is counted while the process runs: stuck 40 s, suspended ten minutes, then
    stuck on, the beats are withheld once it has been silent 60 s of the process's running time."""
    clocks, outcomes = _Clocks(), []
    heartbeat, _ = _clocked(clocks, outcomes)
    for _ in range(8):  # (40 s: the loop stuck from here on)
        _interval(heartbeat, clocks, loop_runs=False)
    clocks.run(600.0, cpu=0.0)
    for _ in range(6):
        _interval(heartbeat, clocks, loop_runs=False)
    assert heartbeat.suspended == 600.0
    assert outcomes == ["ok"] * 13 + ["withheld"] * 2  # (silent 45, 50, 55, 60 s while running; then 65, 70)
    assert "the gateway's event loop has not run for 60 s" in _said(caplog)


def test_a_loop_stuck_in_a_call_that_holds_the_gil_is_not_taken_for_a_suspension(caplog):
    """A loop stuck in a call that holds the GIL (a runaway regular expression) keeps the heartbeat thread
    from running too, but the process burns CPU meanwhile: the loop is stuck, not the process suspended."""
    clocks, outcomes = _Clocks(), []
    heartbeat, metrics = _clocked(clocks, outcomes)
    _interval(heartbeat, clocks)
    clocks.run(100.0, cpu=100.0)
    _interval(heartbeat, clocks, loop_runs=False)
    assert outcomes == ["ok", "ok", "withheld"] and heartbeat.suspended == 0.0
    said = _said(caplog)
    assert "has not run for 60 s" in said and "suspended" not in said
    assert "treeserve_gateway:suspended_seconds_total 0.0" in metrics.render().decode()
