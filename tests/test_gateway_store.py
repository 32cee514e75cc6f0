"""The gateway's storage layer on its own: migrations build exactly the ORM's schema, the gateway
imports no engine (nor PyTorch), budgets reset after their period, key fields are checked."""
from __future__ import annotations

import datetime as dt
import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, insert, select, text, update

from treeserve.errors import ParamError
from treeserve.gateway.errors import GatewayError
from treeserve.gateway.http_errors import to_api_error
from treeserve.gateway.schema import ApiKey, Base, Holding, Instance, RateWindow, User, utcnow
from treeserve.gateway.settlement import Settlement
from treeserve.gateway.store import Store
from treeserve.gateway.usage import Usage
from treeserve.wire.errors import APIError


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'g.db'}" if request.param == "sqlite" else \
        request.getfixturevalue("postgres").new_database()
    store = Store(url)
    store.migrate()
    yield store
    store.close()


def as_http(call, *args, **kwargs):
    """A service call whose refusal comes back as the app answers it (gateway/http_errors.py)."""
    try:
        return call(*args, **kwargs)
    except GatewayError as exc:
        raise to_api_error(exc) from exc


def test_the_migrations_build_the_orm_schema(store):
    store.migrate()  # a second time: a no-op
    with store.db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], diff


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_gateways_started_together_migrate_one_after_another(backend, request, tmp_path):
    """Several processes starting at once on a fresh database: one migrates, the others find it done."""
    import threading

    url = f"sqlite:///{tmp_path / 'g.db'}" if backend == "sqlite" else request.getfixturevalue("postgres").new_database()
    stores = [Store(url) for _ in range(4)]
    errors, barrier = [], threading.Barrier(len(stores))

    def start(store):
        barrier.wait()
        try:
            store.migrate()
        except Exception as exc:  # noqa: BLE001 (collected: the assertion below shows it)
            errors.append(exc)
    threads = [threading.Thread(target=start, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert errors == []
        with stores[0].db.engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        for store in stores:
            store.close()


def test_importing_the_gateway_loads_no_engine():
    code = ("import sys, treeserve.gateway.app, treeserve.cli_gateway; "
            "bad = [m for m in ('torch', 'treeserve.engine', 'treeserve.model') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_weak_password_hashes_only_where_asked():
    """The suite hashes passwords cheaply (tests/conftest.py); without that variable a command
    hashes them with argon2-cffi's defaults (RFC 9106 low-memory: 64 MiB, 3 passes, 4 lanes)."""
    import os

    from treeserve.gateway.passwords import INSECURE_FAST_ENV

    show = ("from treeserve.gateway.passwords import _hasher as h, hash_password, verify_password as v; "
            "print(h.time_cost, h.memory_cost, h.parallelism, v(hash_password('pass-word-1'), 'pass-word-1'))")
    env = {k: v for k, v in os.environ.items() if k != INSECURE_FAST_ENV}
    default = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True)
    assert default.stdout.split() == ["3", "65536", "4", "True"], default.stderr
    fast = subprocess.run([sys.executable, "-c", show], env={**env, INSECURE_FAST_ENV: "1"}, capture_output=True,
                          text=True, check=True)
    assert fast.stdout.split() == ["1", "1024", "1", "True"] and "for tests only" in fast.stderr


def test_a_budget_resets_after_its_period(store):
    token, _ = store.accounts.create_key(max_budget=1.0, budget_duration="30d")
    key = store.accounts.authenticate(token)
    reservation = store.admission.admit(key, 0.5)
    store.ledger.settle(Settlement(reservation, "a", "m", None, "chat", False, "success", Usage(1, 1), 1.0,
                                   utcnow()))
    with pytest.raises(APIError) as refused:
        as_http(store.admission.admit, key, 0.5)
    assert refused.value.code == "budget_exceeded" and "max_budget 1.0" in refused.value.message
    resets = store.accounts.key_info(token)["budget_reset_at"]  # (the refusal says when the budget is back)
    assert f"it resets at {dt.datetime.fromisoformat(resets).isoformat(timespec='seconds')}" in refused.value.message
    with store.db.transaction() as s:
        s.execute(update(ApiKey).values(budget_reset_at=utcnow() - dt.timedelta(seconds=1)))
    store.admission.admit(key, 0.5)
    info = store.accounts.key_info(token)
    assert info["spend"] == 0.0 and dt.datetime.fromisoformat(info["budget_reset_at"]) > utcnow() + dt.timedelta(days=29)


def _held(store, token: str) -> tuple[float, float]:
    info = store.accounts.key_info(token)
    return info["reserved"], store.accounts.user_info(info["user_id"])["user_info"]["reserved"]


def test_a_hold_is_cut_to_the_real_cost_at_the_answer_and_a_budget_is_spent_to_its_last_cent(store):
    """One request at a time, each settled late (as the writer thread does): the released hold is
    the real cost, never the worst case, so every request the budget pays for is admitted; 8 costs
    of 0.1 sum to 0.7999999999999999 in floating point, which must not let a 9th in under 0.8."""
    store.accounts.create_user("seq", max_budget=0.8)
    token, _ = store.accounts.create_key(max_budget=0.8, user_id="seq", max_parallel_requests=1)
    key = store.accounts.authenticate(token)
    unsettled = None
    for i in range(8):
        reservation = store.admission.admit(key, 0.5)  # its worst case, five times its cost
        store.admission.release(reservation, 0.1)
        assert (reservation.held, reservation.parallel) == (0.1, False)
        with store.db.session() as s:
            assert s.get(Holding, reservation.holding_id).worst_cost == 0.1  # what a sweep would give back
        if unsettled is not None:
            assert _held(store, token) == pytest.approx((0.2, 0.2))  # this one's cost and the last one's
            store.ledger.settle(Settlement(unsettled, f"r{i}", "m", None, "chat", False, "success", Usage(1, 1),
                                           0.1, utcnow()))
        assert _held(store, token) == pytest.approx((0.1, 0.1))
        unsettled = reservation
    store.ledger.settle(Settlement(unsettled, "r8", "m", None, "chat", False, "success", Usage(1, 1), 0.1,
                                   utcnow()))
    with store.db.session() as s:  # (the stored sum: /key/info shows it rounded, 0.8)
        spend = s.scalars(select(ApiKey.spend)).one()
    assert spend < 0.8 and spend == pytest.approx(0.8)  # the rounding this is about
    assert store.accounts.key_info(token)["spend"] == 0.8
    assert _held(store, token) == pytest.approx((0.0, 0.0), abs=1e-12)
    with pytest.raises(APIError) as refused:
        as_http(store.admission.admit, key, 0.5)
    assert refused.value.code == "budget_exceeded"
    with store.db.session() as s:
        assert s.scalars(select(ApiKey.in_flight)).one() == 0 and s.query(Holding).count() == 0


def test_a_budget_refusal_shows_no_negative_hold(store):
    """A worst case of 0.5 cut to its real cost 0.1, then settled, leaves the key's `reserved` at
    0.5 - 0.4 - 0.1 = -2.8e-17 in floating point; the next refusal said "(and -0.000000 held by requests
    in flight ...)" to the client. Nothing is held: it says 0.000000."""
    token, _ = store.accounts.create_key(max_budget=0.1)
    key = store.accounts.authenticate(token)
    reservation = store.admission.admit(key, 0.5)
    store.admission.release(reservation, 0.1)
    store.ledger.settle(Settlement(reservation, "r1", "m", None, "chat", False, "success", Usage(1, 1), 0.1,
                                   utcnow()))
    with store.db.session() as s:
        assert s.scalars(select(ApiKey.reserved)).one() < 0  # (the drift this is about)
    with pytest.raises(APIError) as refused:
        as_http(store.admission.admit, key, 0.5)
    assert refused.value.code == "budget_exceeded" and "-0.0" not in refused.value.message
    assert "spent 0.100000 (and 0.000000 held" in refused.value.message


def test_a_request_that_cost_its_worst_case_is_released_at_its_answer(store):
    """A budgeted key without a parallel limit, a request whose real cost is its worst case: nothing
    of its hold goes back, and none of its key's columns change, yet its holding is marked answered
    (its cost spent) at once; the release wrote an empty UPDATE (a syntax error, logged as a failed
    release, the holding left unanswered until its settlement)."""
    token, _ = store.accounts.create_key(max_budget=1.0)
    key = store.accounts.authenticate(token)
    reservation = store.admission.admit(key, 0.25)
    store.admission.release(reservation, 0.25)
    with store.db.session() as s:
        holding = s.get(Holding, reservation.holding_id)
        assert (holding.answered, holding.worst_cost) == (True, 0.25)
    assert store.accounts.key_info(token)["reserved"] == 0.25
    store.ledger.settle(Settlement(reservation, "r", "m", None, "chat", False, "success", Usage(1, 1), 0.25, utcnow()))
    assert (store.accounts.key_info(token)["reserved"], store.accounts.key_info(token)["spend"]) == (0.0, 0.25)


def test_only_a_key_without_any_limit_is_admitted_without_the_database(store):
    """The app admits a key that holds nothing on its event loop, without `Admission.admit`: every kind
    of limit (a user's budget included) must make the key hold something."""
    store.accounts.create_user("capped", max_budget=5.0)
    limited = [dict(max_budget=1.0), dict(max_parallel_requests=1), dict(rpm_limit=10), dict(tpm_limit=100),
               dict(user_id="capped")]
    for fields in limited:
        key = store.accounts.authenticate(store.accounts.create_key(**fields)[0])
        assert not key.holds_nothing, fields
        reservation = store.admission.admit(key, 0.5)
        assert reservation.holding_id is not None or reservation.counted, fields
    free = store.accounts.authenticate(store.accounts.create_key(user_id="free")[0])
    assert free.holds_nothing and store.admission.admit(free, 0.5) == free.nothing_held()
    with store.db.session() as s:
        assert s.query(Holding).filter(Holding.key_id == free.id).count() == 0


def test_a_tpm_limit_counts_the_tokens_requests_in_flight_may_use_then_what_they_used(store, monkeypatch):
    """Requests admitted together see each other's worst-case tokens (else every one admitted before
    the first settles is let in: a fast backend overshot the limit ~5x); each settlement puts what
    its request used in their place."""
    import treeserve.gateway.admission as admission

    now = utcnow()
    monkeypatch.setattr(admission, "utcnow", lambda: now)  # (all in one minute)
    token, _ = store.accounts.create_key(tpm_limit=100)
    key = store.accounts.authenticate(token)
    first, second = store.admission.admit(key, 0.0, 60), store.admission.admit(key, 0.0, 60)
    with pytest.raises(APIError) as full:
        as_http(store.admission.admit, key, 0.0, 60)
    assert (full.value.status, full.value.param) == (429, "tpm_limit")
    for i, reservation in enumerate((first, second)):
        store.ledger.settle(Settlement(reservation, f"t{i}", "m", None, "chat", False, "success", Usage(10, 5), 0.0,
                                       utcnow()))
    with store.db.session() as s:
        assert s.scalars(select(RateWindow.tokens)).one() == 30  # what they used, their holds given back
    store.admission.admit(key, 0.0, 60)  # room again
    unlimited = store.accounts.authenticate(store.accounts.create_key(rpm_limit=10)[0])
    assert store.admission.admit(unlimited, 0.0, 10**9).tokens == 0  # (no tpm_limit: nothing held)



def test_a_request_whose_worst_case_is_over_the_tpm_limit_holds_what_it_used_from_its_answer(store, monkeypatch):
    """A search's worst case (327,680 tokens by default) over a key's whole tpm_limit is admitted in an
    empty minute, and its answer (the release, before its settlement's batch) puts the tokens it used in
    its place: a next request sent at once was refused until the settlement came, with a 429 to retry
    at the minute's end. Its settlement then counts nothing twice."""
    import treeserve.gateway.admission as admission

    now = utcnow()
    monkeypatch.setattr(admission, "utcnow", lambda: now)  # (all in one minute)
    key = store.accounts.authenticate(store.accounts.create_key(tpm_limit=100_000)[0])
    search = store.admission.admit(key, 0.0, 327_680)  # (an empty minute: admitted, whatever its worst case)
    with pytest.raises(APIError) as held:
        as_http(store.admission.admit, key, 0.0, 10)
    assert (held.value.status, held.value.param) == (429, "tpm_limit")
    store.admission.release(search, 0.0, 3_000)
    after = store.admission.admit(key, 0.0, 327_680)  # (at once, its settlement not yet committed)
    store.ledger.settle(Settlement(search, "t0", "m", None, "search", False, "success", Usage(0, 3_000), 0.0, now))
    with store.db.session() as s:
        assert s.scalars(select(RateWindow.tokens)).one() == 3_000 + after.tokens


def test_the_settlement_that_crosses_a_keys_soft_budget_is_logged_once(store, caplog):
    """LiteLLM's soft_budget: a warning when a settlement takes the key's spend past it; nothing is
    refused, and later settlements say nothing more (until a budget period starts it again)."""
    token, info = store.accounts.create_key(soft_budget=0.25, key_alias="team-a")
    assert info["soft_budget"] == 0.25 and store.accounts.key_info(token)["soft_budget"] == 0.25
    key = store.accounts.authenticate(token)
    caplog.set_level("WARNING", logger="treeserve.gateway")
    for i in range(5):
        reservation = store.admission.admit(key, 0.0)
        store.ledger.settle(Settlement(reservation, f"s{i}", "m", None, "chat", False, "success", Usage(1, 1), 0.1,
                                       utcnow()))
    crossed = [r.getMessage() for r in caplog.records if "soft budget" in r.getMessage()]
    assert crossed == ["key team-a crossed its soft budget: spend 0.300000 of soft_budget 0.250000"], crossed
    with pytest.raises(ParamError) as negative:
        store.accounts.create_key(soft_budget=-1.0)
    assert negative.value.param == "soft_budget"


def test_key_fields_are_checked(store):
    with pytest.raises(ParamError) as bad:
        store.accounts.create_key(budget_duration="monthly")
    assert bad.value.param == "budget_duration"
    with pytest.raises(ParamError) as negative:
        store.accounts.create_key(rpm_limit=-1)
    assert negative.value.param == "rpm_limit"
    with pytest.raises(APIError) as missing:
        as_http(store.accounts.delete_keys, ["sk-not-there"])
    assert missing.value.status == 404


def test_durations_take_litellms_months():
    """'1mo' (LiteLLM's) is a calendar month: the same day, or the month's last when it is shorter."""
    from treeserve.gateway.keys import after

    utc = dt.timezone.utc
    jan31 = dt.datetime(2027, 1, 31, 12, 0, tzinfo=utc)
    assert after(jan31, "1mo", "p") == dt.datetime(2027, 2, 28, 12, 0, tzinfo=utc)
    assert after(dt.datetime(2028, 1, 31, tzinfo=utc), "1mo", "p").day == 29  # (a leap year)
    assert after(jan31, "12mo", "p") == jan31.replace(year=2028)
    assert after(dt.datetime(2026, 11, 30, tzinfo=utc), "3mo", "p") == dt.datetime(2027, 2, 28, tzinfo=utc)
    assert after(jan31, "4000000s", "p") - jan31 == dt.timedelta(seconds=4_000_000)
    assert after(jan31, "1200mo", "p").year == 2127
    for duration in ("1201mo", "99999999999999999d", "36501d", "0mo", "1month", "mo"):
        with pytest.raises(ParamError) as refused:
            after(jan31, duration, "budget_duration")
        assert refused.value.param == "budget_duration", duration


def test_a_key_and_a_user_take_a_budget_period_of_a_month(store):
    token, _ = store.accounts.create_key(max_budget=1.0, budget_duration="1mo", duration="2mo")
    info = store.accounts.key_info(token)
    resets, expires = dt.datetime.fromisoformat(info["budget_reset_at"]), dt.datetime.fromisoformat(info["expires"])
    assert 28 <= (resets - utcnow()).days <= 31 and 59 <= (expires - utcnow()).days <= 62
    store.accounts.create_user("mo-user", max_budget=2.0, budget_duration="1mo")
    assert store.accounts.user_info("mo-user")["user_info"]["budget_duration"] == "1mo"


def test_past_minutes_rate_windows_are_pruned(store):
    token, _ = store.accounts.create_key(rpm_limit=10)
    key = store.accounts.authenticate(token)
    store.admission.admit(key, 0.0)
    with store.db.transaction() as s:
        s.execute(update(RateWindow).values(window=RateWindow.window - 5))
    store.admission.admit(key, 0.0)
    assert store.admission.prune_rate_windows() == 1
    with store.db.session() as s:
        assert s.query(RateWindow).count() == 1


def test_a_budget_period_cleared_stops_resetting(store):
    token, _ = store.accounts.create_key(max_budget=1.0, budget_duration="1d")
    store.accounts.update_key(token, budget_duration=None)
    assert store.accounts.key_info(token)["budget_reset_at"] is None
    with store.db.transaction() as s:  # a reset time left from before: the key still works
        s.execute(update(ApiKey).values(budget_reset_at=utcnow() - dt.timedelta(seconds=1), budget_duration=None))
    store.admission.admit(store.accounts.authenticate(token), 0.1)
    assert store.accounts.key_info(token)["budget_reset_at"] is None


def test_what_a_dead_process_held_is_given_back_and_a_live_ones_is_not(store):
    token, _ = store.accounts.create_key(max_budget=1.0, max_parallel_requests=2, user_id="u1")
    key = store.accounts.authenticate(token)
    store.instances.heartbeat()
    settled = store.admission.admit(key, 0.25)
    store.ledger.settle(Settlement(settled, "done", "m", None, "chat", False, "success", Usage(1, 1), 0.1,
                                   utcnow()))
    store.admission.admit(key, 0.3)  # this process then dies before settling it ...
    # ... and this one, answered (its hold cut to its cost)
    store.admission.release(store.admission.admit(key, 0.4), 0.05)
    other = Store(store.db.url)
    try:
        assert other.instances.sweep() == 0, "a live process's requests were taken from it"
        long_ago = utcnow() - dt.timedelta(minutes=5)
        with store.db.transaction() as s:  # ... silent for five minutes
            s.execute(update(Instance).values(seen_at=long_ago))
            s.execute(update(Holding).values(created_at=long_ago))
        assert other.instances.sweep() == 2
        with other.db.session() as s:
            row = s.scalars(select(ApiKey)).one()
            user = s.get(User, "u1")
            assert (row.in_flight, round(row.reserved, 9), round(user.reserved, 9)) == (0, 0.0, 0.0)
            assert row.spend == pytest.approx(0.1) and s.query(Holding).count() == 0
        assert other.instances.sweep() == 0  # given back once
    finally:
        other.close()


def _silent(store: Store) -> None:
    """The store's process thought dead: its heartbeat and its holdings five minutes old."""
    long_ago = utcnow() - dt.timedelta(minutes=5)
    with store.db.transaction() as s:
        s.execute(update(Instance).values(seen_at=long_ago))
        s.execute(update(Holding).values(created_at=long_ago))


def _owed(store: Store, user_id: str) -> tuple:
    """(each key's (reserved, in_flight, spend), the user's (reserved, spend)), rounded."""
    with store.db.session() as s:
        keys = [(round(k.reserved, 9), k.in_flight, round(k.spend, 9)) for k in s.scalars(select(ApiKey)
                                                                                              .order_by(ApiKey.id))]
        user = s.get(User, user_id)
        return keys, (round(user.reserved, 9), round(user.spend, 9))


def test_a_process_thought_dead_that_answers_after_the_sweep_gives_nothing_back_twice(store):
    """A process whose heartbeats stopped (its event loop stuck a while, its beats failing) is
    swept while alive; its requests then answer and settle. Their release and settlement gave back
    again what the sweep had: the key's `reserved` and `in_flight` below 0, admitting past its budget
    and parallel limit. Now a holding gone means given back already: only the spend is written."""
    store.accounts.create_user("u")
    token, _ = store.accounts.create_key(user_id="u", max_budget=1.0, max_parallel_requests=2)
    key = store.accounts.authenticate(token)
    released, settled = store.admission.admit(key, 0.25), store.admission.admit(key, 0.5)
    _silent(store)
    other = Store(store.db.url)
    try:
        assert other.instances.sweep() == 2
    finally:
        other.close()
    store.admission.release(released, 0.1)
    for reservation, cost in ((released, 0.1), (settled, 0.2)):
        store.ledger.settle(Settlement(reservation, f"r{cost}", "m", None, "chat", False, "success", Usage(1, 1), cost,
                                       utcnow()))
    assert _owed(store, "u") == ([(0.0, 0, 0.3)], (0.0, 0.3))


def test_a_sweep_reads_the_holdings_it_gives_back_after_locking_their_keys(request):
    """The exact race (PostgreSQL, read committed): a sweep read a silent process's holdings, then
    waited on a key's row (here another transaction holds the first key); meanwhile the process, alive
    after all, released one holding (cut to its real cost, its slot freed) and settled another
    (deleted); the sweep then gave both back as it had read them, twice over. The sweep now holds the
    keys' rows first (LOCK ORDER) and reads the holdings as they are then."""
    import threading
    import time

    url = request.getfixturevalue("postgres").new_database()
    owner, sweeper, blocker = Store(url), Store(url), Store(url)
    owner.migrate()
    try:
        owner.accounts.create_user("u")
        keys = [owner.accounts.authenticate(owner.accounts.create_key(user_id="u", max_budget=1.0,
                                                                      max_parallel_requests=1)[0]) for _ in range(3)]
        first, released, settled = (owner.admission.admit(k, 0.25) for k in keys)
        _silent(owner)
        swept: list[int] = []
        with blocker.db.transaction() as hold:  # (the first key's row held: the sweep waits on it)
            hold.execute(update(ApiKey).where(ApiKey.id == keys[0].id).values(spend=ApiKey.spend))
            thread = threading.Thread(target=lambda: swept.append(sweeper.instances.sweep()))
            thread.start()
            time.sleep(1.5)  # (the sweep has read the holdings, and waits)
            owner.admission.release(released, 0.1)
            owner.ledger.settle(Settlement(settled, "settled", "m", None, "chat", False, "success", Usage(1, 1), 0.2,
                                           utcnow()))
        thread.join(30)
        owner.ledger.settle(Settlement(released, "released", "m", None, "chat", False, "success", Usage(1, 1), 0.1,
                                       utcnow()))
        assert _owed(owner, "u") == ([(0.0, 0, 0.0), (0.0, 0, 0.1), (0.0, 0, 0.2)], (0.0, 0.3))
        assert swept == [2]  # (the settled one: gone, not given back)
    finally:
        for each in (owner, sweeper, blocker):
            each.close()


def _deleted_keys_holding(url: str) -> tuple:
    """(the owner's store, the user's reservation of 0.25): its key deleted since (/key/delete leaves
    the holding, and its user's hold, to the request's release and settlement or to a sweep), its
    process silent."""
    owner = Store(url)
    owner.migrate()
    owner.accounts.create_user("u")
    token, _ = owner.accounts.create_key(user_id="u", max_budget=1.0, max_parallel_requests=1)
    reservation = owner.admission.admit(owner.accounts.authenticate(token), 0.25)
    owner.accounts.delete_keys([token])
    _silent(owner)
    return owner, reservation


def _in_thread(job, results: list, errors: list):
    import threading

    def run():
        try:
            results.append(job())
        except Exception as error:  # (a deadlock PostgreSQL broke: its victim's error)
            errors.append(error)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_settlement_racing_a_sweep_of_a_deleted_keys_holding_gives_its_users_hold_back_once(request):
    """A holding's key deleted (/key/delete leaves the holding), its process silent but alive: the
    sweep locks no key row, so the settlement, holding no key row either, read the holding as still
    there while the sweep, which had it, was giving it back; both gave the user's hold back (its
    `reserved` below 0, the user admitted past its budget). The settlement now holds the holdings'
    rows too (keys, then holdings: the sweep's order) and reads them once the sweep is done."""
    import time

    url = request.getfixturevalue("postgres").new_database()
    owner, reservation = _deleted_keys_holding(url)
    sweeper, blocker = Store(url), Store(url)
    results, errors = [], []
    try:
        with blocker.db.transaction() as hold:  # (the user's row held: the sweep waits on it, holding in hand)
            hold.execute(update(User).where(User.user_id == "u").values(spend=User.spend))
            sweep = _in_thread(sweeper.instances.sweep, results, errors)
            time.sleep(1.0)
            settle = _in_thread(lambda: owner.ledger.settle(Settlement(
                reservation, "r", "m", None, "chat", False, "success", Usage(1, 1), 0.1, utcnow())), results, errors)
            time.sleep(1.0)
        sweep.join(30)
        settle.join(30)
        assert errors == []
        assert _owed(owner, "u") == ([], (0.0, 0.1))
    finally:
        for each in (owner, sweeper, blocker):
            each.close()


def test_a_release_racing_a_sweep_of_a_deleted_keys_holding_does_not_deadlock(request):
    """A release wrote its user's row, then its holding; a sweep (with no key row to hold, the key
    deleted) held the holding, then wrote the user's row: each waited on the other, PostgreSQL
    aborted one (the release's error logged, or the sweep's). A release now writes its holding right
    after its key, in the sweep's order (keys, holdings, users, teams)."""
    import time

    url = request.getfixturevalue("postgres").new_database()
    owner, reservation = _deleted_keys_holding(url)
    sweeper, blocker = Store(url), Store(url)
    results, errors = [], []
    try:
        with blocker.db.transaction() as hold:  # (the user's row held: the release, then the sweep, wait on it)
            hold.execute(update(User).where(User.user_id == "u").values(spend=User.spend))
            release = _in_thread(lambda: owner.admission.release(reservation, 0.1), results, errors)
            time.sleep(1.0)
            sweep = _in_thread(sweeper.instances.sweep, results, errors)
            time.sleep(1.0)
        release.join(30)
        sweep.join(30)
        assert errors == []
        owner.ledger.settle(Settlement(reservation, "r", "m", None, "chat", False, "success", Usage(1, 1), 0.1,
                                       utcnow()))
        assert _owed(owner, "u") == ([], (0.0, 0.1))
    finally:
        for each in (owner, sweeper, blocker):
            each.close()


def test_a_settlements_key_locks_let_rows_that_name_the_key_be_written(request):
    """The keys' rows a settlement batch or a sweep holds (settlement.lock_keys) were held FOR UPDATE,
    stronger than the UPDATE that writes them: it also holds off the foreign key check of every row
    naming the key (a stored Responses API response, an uploaded file, a batch), which then waited for
    the batch's commit. FOR NO KEY UPDATE, as its UPDATE takes: those go on, key writers still wait."""
    from treeserve.gateway.schema import StoredResponse
    from treeserve.gateway.settlement import lock_keys

    url = request.getfixturevalue("postgres").new_database()
    settler, other = Store(url), Store(url)
    settler.migrate()
    try:
        token, _ = settler.accounts.create_key(max_budget=1.0)
        key_id = settler.accounts.authenticate(token).id
        with settler.db.transaction() as batch:
            lock_keys(batch, {key_id})
            with other.db.transaction() as conn:
                conn.execute(text("SET LOCAL lock_timeout = '2s'"))
                conn.execute(insert(StoredResponse).values(id="resp_1", api_key_id=key_id, response={}, history=[],
                                                           input_items=[], created_at=utcnow()))
            with pytest.raises(Exception, match="lock timeout"), other.db.transaction() as conn:
                conn.execute(text("SET LOCAL lock_timeout = '200ms'"))  # (a writer of the key still waits)
                conn.execute(update(ApiKey).where(ApiKey.id == key_id).values(spend=ApiKey.spend + 1))
    finally:
        settler.close()
        other.close()


def test_a_new_key_never_takes_a_deleted_keys_id(store):
    """On SQLite a new row took the highest id plus one: a key made after the newest key was deleted
    had its id, and with it that key's spend logs, daily spend and rate window."""
    ids = []
    for _ in range(3):
        token, _ = store.accounts.create_key()
        ids.append(store.accounts.authenticate(token).id)
        assert store.accounts.delete_keys([token]) == [token]
    assert len(set(ids)) == 3 and ids == sorted(ids)


def test_a_row_broken_before_does_not_stop_a_gateway_starting(tmp_path):
    """A key deleted by a tool with SQLite's foreign keys off (the sqlite3 shell) leaves its files
    pointing nowhere; a migration checks only what it broke itself (a reviewer's finding: every start
    refused)."""
    import sqlite3

    from sqlalchemy import insert

    from treeserve.gateway.schema import StoredFile

    url = f"sqlite:///{tmp_path / 'g.db'}"
    store = Store(url)
    store.migrate()
    token, _ = store.accounts.create_key()
    with store.db.transaction() as conn:
        conn.execute(insert(StoredFile).values(id="file-1", api_key_id=store.accounts.authenticate(token).id,
                                               purpose="batch", filename="a.jsonl", bytes=1, content=b"x",
                                               created_at=utcnow()))
    store.close()
    with sqlite3.connect(tmp_path / "g.db") as raw:  # (foreign keys off: the file stays, pointing nowhere)
        raw.execute("DELETE FROM api_keys")
    store = Store(url)
    try:
        store.migrate()
        store.migrate()
    finally:
        store.close()


def _store_at_revision(url: str, revision: str) -> Store:
    """A store whose database is migrated up to `revision` only (rows written in SQL then stand for an
    older gateway's; the next `migrate()` takes them through the revisions after it)."""
    from alembic import command
    from alembic.config import Config

    from treeserve.gateway.database import MIGRATIONS

    store = Store(url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with store.db.engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)
    return store


def test_the_key_id_migration_keeps_every_row_and_starts_past_every_id_seen(tmp_path):
    """Rebuilding api_keys on SQLite (migration 0008) must not run its ON DELETE actions (files,
    batches and stored responses cascade from a key), and a new key's id is past any id that spend
    logs or rate windows hold of a key deleted before."""
    from sqlalchemy import func, insert

    from treeserve.gateway.schema import SpendLog, StoredFile

    url = f"sqlite:///{tmp_path / 'old.db'}"
    store = _store_at_revision(url, "0007")
    with store.db.transaction() as conn:  # (in SQL: the ORM's api_keys has the columns of later revisions)
        kept, kept_id = _key_before(conn, "kept")
        _, gone_id = _key_before(conn, "gone")
        conn.execute(insert(StoredFile).values(id="file-1", api_key_id=kept_id, purpose="batch", filename="a.jsonl",
                                               bytes=1, content=b"x", created_at=utcnow()))
        conn.execute(insert(RateWindow).values(key_id=gone_id + 5, window=1, requests=1, tokens=0))
        conn.execute(text("DELETE FROM api_keys WHERE id = :id"), {"id": gone_id})
    store.close()
    store = Store(url)
    store.migrate()
    try:
        with store.db.session() as conn:
            assert conn.scalar(select(func.count()).select_from(StoredFile)) == 1
            assert conn.scalar(select(func.count()).select_from(SpendLog)) == 0
        assert store.accounts.key_info(kept)["key_alias"] == "kept"
        token, _ = store.accounts.create_key()
        assert store.accounts.authenticate(token).id == gone_id + 6
        with store.db.engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        store.close()


def _key_before(conn, alias: str) -> tuple[str, int]:
    """A key written as an older revision's api_keys holds it: (its token, its id)."""
    from treeserve.gateway import keys as keylib

    token = keylib.new_key()
    conn.execute(text("INSERT INTO api_keys (token_hash, key_name, key_alias, spend, reserved, in_flight, blocked, "
                      "metadata, created_at) VALUES (:hash, :name, :alias, 0, 0, 0, 0, '{}', :created)"),
                 {"hash": keylib.hash_key(token), "name": keylib.display_name(token), "alias": alias,
                  "created": utcnow()})
    return token, conn.scalar(text("SELECT id FROM api_keys WHERE key_alias = :alias"), {"alias": alias})


def test_concurrent_creates_take_an_alias_once(store):
    """Aliases are unique under concurrency, as the database's unique index keeps them: eight
    /key/generate calls at once with one alias make one key, and the others are refused as a taken
    alias is one at a time (400 key_alias_exists). (Read-then-write let several take it on PostgreSQL.)"""
    import threading

    from treeserve.gateway.errors import AliasTaken

    for round_ in range(4):
        alias, barrier = f"race-{round_}", threading.Barrier(8)
        made, refused = [], []

        def create():
            barrier.wait()
            try:
                made.append(store.accounts.create_key(key_alias=alias)[0])
            except AliasTaken as exc:
                refused.append(to_api_error(exc))
        threads = [threading.Thread(target=create) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(made) == 1 and len(refused) == 7, (alias, len(made), refused)
        assert {(e.status, e.code, e.param) for e in refused} == {(400, "key_alias_exists", "key_alias")}
    assert sorted(k["key_alias"] for k in store.accounts.list_keys()) == [f"race-{i}" for i in range(4)]


def test_a_create_waits_for_another_writer_of_its_alias_and_is_refused(store):
    """Another gateway's create of the alias, not committed yet when this one writes: this one waits
    for it and is refused (it used to see no such alias, and both keys kept it)."""
    import threading

    from treeserve.gateway import keys as keylib
    from treeserve.gateway.errors import AliasTaken

    other = keylib.new_key()
    outcome = []
    with store.db.engine.connect() as conn, conn.begin():
        conn.execute(text("INSERT INTO api_keys (token_hash, key_name, key_alias, spend, reserved, in_flight, blocked, "
                          "metadata, created_at) VALUES (:hash, :name, 'held', 0, 0, 0, false, '{}', :created)"),
                     {"hash": keylib.hash_key(other), "name": keylib.display_name(other), "created": utcnow()})

        def create():
            try:
                outcome.append(store.accounts.create_key(key_alias="held"))
            except AliasTaken as exc:
                outcome.append(exc)
        thread = threading.Thread(target=create)
        thread.start()
        thread.join(1.0)  # (it waits on the uncommitted row; the old check had answered already)
    thread.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], AliasTaken), outcome
    assert [k["key_alias"] for k in store.accounts.list_keys()] == ["held"]


def _at_once(call, n: int = 8) -> tuple[list, list]:
    """`call` from `n` threads let go together: (what the calls returned, the GatewayErrors they raised)."""
    import threading

    barrier, made, refused = threading.Barrier(n), [], []

    def run():
        barrier.wait()
        try:
            made.append(call())
        except GatewayError as exc:
            refused.append(exc)
    threads = [threading.Thread(target=run) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return made, refused


def test_concurrent_creates_of_a_user_make_it_once(store):
    """Eight /user/new calls at once for one user_id make the user once, and the others are refused
    as a second /user/new one after another is (400 user_exists). (On PostgreSQL both read no user,
    and the second insert's unique violation was a 500.)"""
    for round_ in range(4):
        user_id = f"racer-{round_}"
        made, refused = _at_once(lambda: store.accounts.create_user_with_key(user_id, None, {}))
        assert len(made) == 1 and len(refused) == 7, (user_id, made, refused)
        assert {(e.status, e.code) for e in map(to_api_error, refused)} == {(400, "user_exists")}
        assert len(store.accounts.user_info(user_id)["keys"]) == 1
    assert sorted(u["user_id"] for u in store.accounts.list_users()[0]) == [f"racer-{i}" for i in range(4)]


def test_concurrent_keys_for_a_new_user_make_the_user_once(store):
    """Eight /key/generate calls at once naming a user that does not exist yet: every key is made, and
    the user once (LiteLLM makes the user a key names; two first keys at once were a 500 on PostgreSQL)."""
    for round_ in range(4):
        user_id = f"newcomer-{round_}"
        made, refused = _at_once(lambda: store.accounts.create_key(user_id=user_id))
        assert len(made) == 8 and refused == [], (user_id, refused)
        assert len(store.accounts.user_info(user_id)["keys"]) == 8


def test_the_admin_api_gives_no_key_the_chat_prefix_or_the_master_label(store):
    token, _ = store.accounts.create_key(key_alias="team-a")
    for alias, code in (("chat:ada", "key_alias_reserved"), ("master", "key_alias_exists")):
        for call, kwargs in ((store.accounts.create_key, {}), (store.accounts.update_key, {"token": token})):
            with pytest.raises(APIError) as refused:
                as_http(call, key_alias=alias, **kwargs)
            assert (refused.value.status, refused.value.code, refused.value.param) == (400, code, "key_alias")
    assert store.accounts.update_key(token, key_alias="team-a", rpm_limit=5)["key_alias"] == "team-a"  # its own


def test_a_downgrade_keeps_the_rows_of_the_tables_it_rebuilds(tmp_path, capsys):
    """`treeserve gateway db downgrade 0006` on SQLite keeps every key, file, response, batch and line:
    its revisions rebuild api_keys, batches and holdings (copy, drop the old table, rename), and
    dropping the old copy with foreign keys on (the gateway's connections turn them on) deleted every
    key's files, batches and responses and every batch's lines through their ON DELETE CASCADE. The
    downgrade runs with them off, as `migrate` does, and the next start brings the rows back up."""
    from treeserve.cli_gateway import main

    url = f"sqlite:///{tmp_path / 'g.db'}"
    store = Store(url)
    store.migrate()
    store.accounts.create_user("ann")
    tokens = [store.accounts.create_key(user_id="ann", key_alias=f"k{i}")[0] for i in range(2)]
    key_ids = [store.accounts.key_info(t)["key_id"] for t in tokens]
    now = utcnow()
    with store.db.transaction() as conn:
        for i, key_id in enumerate(key_ids):
            conn.execute(text("INSERT INTO files (id, api_key_id, purpose, filename, bytes, content, created_at) "
                              "VALUES (:id, :key, 'batch', 'in.jsonl', 1, x'31', :now)"),
                         {"id": f"file-{i}", "key": key_id, "now": now})
            conn.execute(text("INSERT INTO stored_responses (id, api_key_id, response, history, input_items, "
                              "created_at) VALUES (:id, :key, '{}', '[]', '[]', :now)"),
                         {"id": f"resp-{i}", "key": key_id, "now": now})
            conn.execute(text("INSERT INTO batches (id, api_key_id, endpoint, input_file_id, completion_window, "
                              "status, total, created_at, expires_at) VALUES (:id, :key, '/v1/chat/completions', "
                              ":file, '24h', 'in_progress', 2, :now, :now)"),
                         {"id": f"batch-{i}", "key": key_id, "file": f"file-{i}", "now": now})
            for line in range(2):
                conn.execute(text("INSERT INTO batch_lines (batch_id, line, custom_id, url, body, status) "
                                  "VALUES (:batch, :line, :custom, '/v1/chat/completions', '{}', 'pending')"),
                             {"batch": f"batch-{i}", "line": line, "custom": f"c{line}"})
    tables = ("users", "api_keys", "files", "stored_responses", "batches", "batch_lines")

    def counts():
        with store.db.session() as conn:
            return {t: conn.scalar(text(f"SELECT count(*) FROM {t}")) for t in tables}
    before = counts()
    assert before == {"users": 1, "api_keys": 2, "files": 2, "stored_responses": 2, "batches": 2, "batch_lines": 4}
    assert main(["gateway", "db", "downgrade", "0006", "--database", url]) == 0
    assert "0006" in capsys.readouterr().out
    with store.db.session() as conn:
        assert conn.scalar(text("SELECT version_num FROM alembic_version")) == "0006"
        assert conn.execute(text("PRAGMA foreign_key_check")).fetchall() == []
    assert counts() == before
    store.migrate()
    assert counts() == before
    assert [k["key_alias"] for k in store.accounts.list_keys("ann")] == ["k0", "k1"]
    store.close()


def test_the_alias_and_chat_key_migrations_keep_every_key(tmp_path):
    """Migration 0011 keeps an alias on its oldest key and renames later holders (the index needs it);
    0012 flags a user's oldest chat-made key `chat:<user>` as their web chat key, not an admin's."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    store = _store_at_revision(url, "0010")
    rows = [("dup", None, "{}"), ("dup", None, "{}"), ("dup #2", None, "{}"),
            ("chat:ada", "ada", '{"purpose": "web chat"}'), ("chat:bob", "bob", '{"team": "x"}'),
            ("chat:ada", "ada", '{"purpose": "web chat"}'), ("chat:cy", "cy", "null"), ("chat:dee", "dee", "[1]")]
    with store.db.transaction() as conn:
        for user in ("ada", "bob", "cy", "dee"):
            conn.execute(text("INSERT INTO users (user_id, spend, reserved, metadata, created_at) "
                              "VALUES (:u, 0, 0, '{}', :t)"), {"u": user, "t": utcnow()})
        for i, (alias, user, metadata) in enumerate(rows):
            conn.execute(text("INSERT INTO api_keys (token_hash, key_name, key_alias, user_id, spend, reserved, "
                              "in_flight, blocked, metadata, created_at) VALUES (:h, 'sk-...', :a, :u, 0, 0, 0, 0, "
                              ":m, :t)"), {"h": f"h{i}", "a": alias, "u": user, "m": metadata, "t": utcnow()})
    store.close()
    store = Store(url)
    store.migrate()
    try:
        with store.db.session() as conn:
            keys = conn.execute(select(ApiKey.id, ApiKey.key_alias, ApiKey.web_chat).order_by(ApiKey.id)).all()
            assert [tuple(k) for k in keys] == [(1, "dup", False), (2, "dup #2.1", False), (3, "dup #2", False),
                                                (4, "chat:ada", True), (5, "chat:bob", False),
                                                (6, "chat:ada #6", False), (7, "chat:cy", False),
                                                (8, "chat:dee", False)]  # (metadata null, a list: no purpose)
            assert compare_metadata(MigrationContext.configure(conn.connection()), Base.metadata) == []
    finally:
        store.close()


def test_only_a_database_that_cannot_serve_is_an_outage(store, tmp_path):
    """A 503 to retry is for a database that cannot be reached or used now (PostgreSQL's SQLSTATE
    class 08, 57P01-57P03, 53300; SQLite's file that cannot be opened, or locked); a deadlock, a
    serialization failure, a cancelled query or a missing table are OperationalErrors too, but the
    statement's fault (a 500), as they were all taken for an outage."""
    from sqlalchemy import create_engine, exc

    from treeserve.gateway.database import database_down

    def error_of(engine, sql: str) -> exc.DBAPIError:
        with pytest.raises(exc.DBAPIError) as raised, engine.connect() as conn:
            conn.execute(text(sql))
        return raised.value

    if store.db.dialect == "postgresql":
        raise_state = "DO $$ BEGIN RAISE EXCEPTION 'for the test' USING ERRCODE = '{}'; END $$"
        states = {"40P01": False, "40001": False, "57014": False, "57P01": True, "57P03": True, "53300": True,
                  "08006": True}
        errors = {s: error_of(store.db.engine, raise_state.format(s)) for s in states}
        assert all(isinstance(e, exc.OperationalError) for e in errors.values()), errors
        assert {s: database_down(e) for s, e in errors.items()} == states
        nobody = create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/x")
        assert database_down(error_of(nobody, "SELECT 1"))
    else:
        missing = error_of(store.db.engine, "SELECT * FROM no_such_table")
        assert isinstance(missing, exc.OperationalError) and not database_down(missing)
        gone = create_engine(f"sqlite:///{tmp_path / 'no-such-folder' / 'g.db'}")
        assert database_down(error_of(gone, "SELECT 1"))


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_response_id_with_a_nul_is_not_stored(store):
    """`previous_response_id` (or `responses.input_tokens.count`'s) holding a NUL: no such response (OpenAI's
    400 previous_response_not_found), where PostgreSQL refused the lookup (a 500 schemathesis found)."""
    import asyncio

    from treeserve.gateway.response_store import DatabaseResponseStore
    from treeserve.wire.responses_api import StoredResponse

    responses = DatabaseResponseStore(store.db)
    stored = StoredResponse({"id": "resp_1", "output": []}, [{"role": "user", "content": "x"}], [])
    asyncio.run(responses.put(stored, None))
    assert asyncio.run(responses.get("resp_1", None)).history == stored.history
    assert asyncio.run(responses.get("resp_\x00", None)) is None


class _Psycopg2Error(Exception):
    """What psycopg2 raises: its SQLSTATE is `pgcode` (psycopg 3's is `sqlstate`), its details `diag`."""

    def __init__(self, pgcode: str | None, constraint: str | None = None):
        super().__init__("psycopg2 error")
        self.pgcode = pgcode
        self.diag = type("Diagnostics", (), {"constraint_name": constraint})()


def test_psycopg2s_errors_are_classified_by_their_pgcode():
    """A `postgresql+psycopg2://` gateway (psycopg2 installed by its operator) read no SQLSTATE from
    its errors (psycopg2 names it `pgcode`): every failed statement (a deadlock, a missing table) was
    an outage (a 503), and a key alias taken a 500 instead of 400 key_alias_exists."""
    from sqlalchemy import exc

    from treeserve.gateway.database import database_down, violates_unique

    def operational(pgcode):
        return exc.OperationalError("SELECT 1", {}, _Psycopg2Error(pgcode))
    assert {s: database_down(operational(s)) for s in ("40P01", "42P01", "57014", "57P01", "08006", None)} == {
        "40P01": False, "42P01": False, "57014": False, "57P01": True, "08006": True, None: True}
    taken = exc.IntegrityError("INSERT", {}, _Psycopg2Error("23505", "ix_api_keys_key_alias"))
    assert violates_unique(taken, "ix_api_keys_key_alias", "api_keys.key_alias")
    assert not violates_unique(taken, "ix_api_keys_token_hash", "api_keys.token_hash")
    other = exc.IntegrityError("INSERT", {}, _Psycopg2Error("23503", "ix_api_keys_key_alias"))  # (a foreign key)
    assert not violates_unique(other, "ix_api_keys_key_alias", "api_keys.key_alias")


def test_a_database_url_with_another_driver_is_refused_at_startup(postgres):
    """Only SQLite and PostgreSQL through psycopg (3, or psycopg2 where installed) are read right; any
    other driver is refused by name at startup, not misread at the first error. A bare `postgresql://`
    (LiteLLM's DATABASE_URL spelling) is psycopg 3, the one installed: it was psycopg2, SQLAlchemy's
    default, and failed with `No module named 'psycopg2'`."""
    from treeserve.gateway.database import Database

    for url in ("postgresql+pg8000://u@h/db", "postgresql+asyncpg://u@h/db", "mysql+pymysql://u@h/db"):
        with pytest.raises(ValueError, match="not supported: use postgresql\\+psycopg://") as refused:
            Database(url)
        assert repr(url.split(":")[0]) in str(refused.value)
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="'postgresql\\+psycopg2' needs psycopg2, which is not installed"):
            Database("postgresql+psycopg2://u@h/db")
    url = postgres.new_database()
    assert url.startswith("postgresql+psycopg://")
    bare = Store(url.replace("postgresql+psycopg://", "postgresql://"))
    try:
        bare.migrate()
        assert bare.db.engine.dialect.driver == "psycopg"
        assert bare.accounts.create_user("ann")["user_id"] == "ann"
    finally:
        bare.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_batch_usage_migration_moves_expiry_and_fills_tokens_and_model(backend, request, tmp_path):
    """Migration 0013: an expired batch's time moves from `completed_at` (where it was kept) to
    `expired_at`; lines answered before it get their billed tokens from their spend rows; a batch
    whose lines all ran one model names it (one of several models: none)."""
    url = f"sqlite:///{tmp_path / 'old.db'}" if backend == "sqlite" else \
        request.getfixturevalue("postgres").new_database()
    store = _store_at_revision(url, "0012")
    now = utcnow()
    with store.db.transaction() as conn:
        for batch_id, status, models in (("b-exp", "expired", ["gen", "gen"]), ("b-mix", "completed", ["gen", "prm"])):
            conn.execute(text("INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, total, "
                              "created_at, completed_at, expires_at) VALUES (:i, '/v1/chat/completions', 'f', '24h', "
                              ":s, 2, :t, :t, :t)"), {"i": batch_id, "s": status, "t": now})
            for line, model in enumerate(models):
                request_id = f"{batch_id}-{line}"
                conn.execute(text("INSERT INTO batch_lines (batch_id, line, custom_id, url, body, status, "
                                  "status_code, request_id) VALUES (:b, :l, :c, '/v1/chat/completions', '{}', "
                                  "'done', 200, :r)"), {"b": batch_id, "l": line, "c": f"c{line}", "r": request_id})
                conn.execute(text("INSERT INTO spend_logs (request_id, model, route, stream, status, prompt_tokens, "
                                  "completion_tokens, cost, started_at, ended_at) VALUES (:r, :m, 'chat', :f, "
                                  "'success', :p, 2, 0, :t, :t)"),
                             {"r": request_id, "m": model, "p": 3 + line, "t": now, "f": False})
    store.close()
    store = Store(url)
    store.migrate()
    try:
        expired, mixed = store.batches.get("b-exp", None), store.batches.get("b-mix", None)
        assert expired["completed_at"] is None and expired["expired_at"] == int(now.timestamp())
        assert mixed["completed_at"] == int(now.timestamp()) and mixed["expired_at"] is None
        assert (expired["model"], mixed["model"]) == ("gen", None)
        assert expired["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0},
                                    "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0},
                                    "total_tokens": 11}
        with store.db.session() as conn:
            assert compare_metadata(MigrationContext.configure(conn.connection()), Base.metadata) == []
    finally:
        store.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_undoing_the_batch_usage_migration_keeps_every_line(backend, request, tmp_path):
    """Revision 0013's downgrade drops its columns in place: rebuilding SQLite's batches (as a batch
    alter does) would delete every batch's lines through their ON DELETE CASCADE."""
    from alembic import command
    from alembic.config import Config

    from treeserve.gateway.database import MIGRATIONS

    url = f"sqlite:///{tmp_path / 'g.db'}" if backend == "sqlite" else request.getfixturevalue("postgres").new_database()
    store = Store(url)
    store.migrate()
    try:
        file_id = store.files.create(None, "batch", "b.jsonl", b'{"custom_id": "a", "body": {"model": "gen"}}\n')["id"]
        store.batches.create(None, file_id, "/v1/chat/completions", "24h", None)
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        with store.db.engine.begin() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, "0012")
        with store.db.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM batch_lines")).scalar() == 1
    finally:
        store.close()


def test_a_conversation_deleted_while_a_stopped_answer_is_stored_fails_nothing(store, monkeypatch):
    """The chat deletes a conversation between add_message's owner check and its insert (a Stop's
    answer being stored as the user deletes its conversation). On PostgreSQL the insert then failed on
    the foreign key: an IntegrityError in the log, not the ConversationNotFound the route expects. Now
    the check locks the row: the delete waits for the answer to be stored, then removes it too."""
    import threading

    from treeserve.gateway.chat.store import ChatStore
    from treeserve.gateway.errors import ConversationNotFound

    store.accounts.create_user("ada")
    chats = ChatStore(store.db, store.accounts)
    conversation = chats.create("ada", "hi", {})["id"]
    real, failures = ChatStore._owned, []

    def delete():
        try:
            chats.delete("ada", conversation)
        except Exception as exc:  # noqa: BLE001 (reported by the assertion below)
            failures.append(exc)
    deleting = threading.Thread(target=delete)

    def owned(conn, user_id, conversation_id, *args, **kwargs):
        found = real(conn, user_id, conversation_id, *args, **kwargs)
        if deleting.ident is None:  # add_message's check: the delete runs now, and commits unless held back
            deleting.start()
            deleting.join(timeout=1)
        return found
    monkeypatch.setattr(ChatStore, "_owned", staticmethod(owned))
    try:
        stored = chats.add_message("ada", conversation, "assistant", "stopped here")
    except ConversationNotFound:
        stored = None
    deleting.join(timeout=30)
    assert not deleting.is_alive() and not failures, failures
    assert stored is None or stored["content"] == "stopped here"
    with pytest.raises(ConversationNotFound):
        chats.get("ada", conversation)


def _rows_written(store: Store, run) -> list[tuple[str, str]]:
    """(table, the row it names) of each UPDATE or upsert `run` issues, in the order issued."""
    import re

    from sqlalchemy import event
    from sqlalchemy.sql.dml import Insert, Update

    written: list[tuple[str, str]] = []

    def record(conn, clause, multiparams, params, execution_options):
        if isinstance(clause, (Update, Insert)) and clause.table.name != "spend_logs":
            sql = str(clause.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True}))
            names = re.search(r"WHERE (.*?)(?: RETURNING|$)", sql, re.S) if isinstance(clause, Update) else None
            written.append((clause.table.name, names.group(1) if names else sql.split("VALUES", 1)[1][:60]))
    event.listen(store.db.engine, "before_execute", record)
    try:
        run()
    finally:
        event.remove(store.db.engine, "before_execute", record)
    return written


def test_a_settlement_batch_writes_its_rows_in_one_lock_order(store):
    """A batch wrote its keys, users and teams in the order its requests came (a dict's), so two
    gateway processes settling the same ones in other orders deadlocked on PostgreSQL (one batch
    aborted, retried row by row). Keys by id, then users, then teams by id; rate windows and daily
    totals by key after them. A sweep gives back in the same order."""
    from treeserve.gateway.settlement import commit_settlements

    for user in ("b", "a"):
        store.accounts.create_user(user)
    for team in ("t2", "t1"):
        store.teams.create_team(team, [])
    owners = [dict(user_id="b", team_id="t2"), dict(user_id="a", team_id="t1"), dict(user_id="b", team_id="t1")]
    keys = [store.accounts.authenticate(store.accounts.create_key(**o, max_budget=1.0, rpm_limit=100)[0])
            for o in owners]
    store.instances.heartbeat()
    held = [store.admission.admit(k, 0.1) for k in reversed(keys)]  # (keys 3, 2, 1)
    items = [Settlement(r, f"req-{i}", "m", None, "chat", False, "success", Usage(1, 1), 0.05, utcnow())
             for i, r in enumerate(held)]
    written = _rows_written(store, lambda: commit_settlements(store.db, items))
    tables = [table for table, _ in written]
    assert tables == ["api_keys"] * 3 + ["users"] * 2 + ["teams"] * 2 + ["rate_windows"] * 3 + ["daily_spend"] * 3
    ids = [int(where.rsplit("=", 1)[1].split()[0]) for table, where in written if table == "api_keys"]
    assert ids == sorted(ids) == [k.id for k in keys]
    for table, order in (("users", ["'a'", "'b'"]), ("teams", ["'t1'", "'t2'"])):
        named = [next(n for n in order if n in where) for t, where in written if t == table]
        assert named == order, written
    windows = [where for table, where in written if table == "rate_windows"]
    assert windows == sorted(windows, key=lambda w: int(w.split("rate_windows.key_id = ")[1].split()[0])), windows
    held = [store.admission.admit(k, 0.1) for k in reversed(keys)]
    with store.db.transaction() as s:  # (this process is dead: a sweep gives its holdings back)
        s.execute(update(Instance).values(seen_at=utcnow() - dt.timedelta(minutes=5)))
        s.execute(update(Holding).values(created_at=utcnow() - dt.timedelta(minutes=5)))
    other = Store(store.db.url)
    try:
        written = _rows_written(other, other.instances.sweep)
    finally:
        other.close()
    assert [t for t, _ in written] == ["api_keys"] * 3 + ["users"] * 2 + ["teams"] * 2, written
    ids = [int(where.rsplit("=", 1)[1].split()[0]) for table, where in written if table == "api_keys"]
    assert ids == [k.id for k in keys]
    for table, order in (("users", ["'a'", "'b'"]), ("teams", ["'t1'", "'t2'"])):
        assert [next(n for n in order if n in where) for t, where in written if t == table] == order, written


def test_admission_counts_a_request_in_its_minute_after_holding_its_key(store):
    """A key with a budget and an rpm_limit (no max_parallel_requests) was admitted by writing its
    minute's row, then its key's; a settlement writes the key's, then the minute's: an admission and
    a settlement of the same key at once deadlocked on PostgreSQL. Keys, users and teams come first."""
    store.accounts.create_user("u")
    store.teams.create_team("t", [])
    key = store.accounts.authenticate(store.accounts.create_key(user_id="u", team_id="t", max_budget=1.0,
                                                                rpm_limit=100)[0])
    written = [t for t, _ in _rows_written(store, lambda: store.admission.admit(key, 0.1))]
    assert written.index("rate_windows") > max(written.index(t) for t in ("api_keys", "users", "teams")), written


@pytest.mark.parametrize("deleting", ["user", "keys"])
def test_deleting_a_users_keys_while_a_settlement_writes_them_waits_instead_of_deadlocking(store, deleting):
    """/user/delete (and /key/delete of several keys) deleted the keys in the order the database found
    them, not by id: a key written since (a new secret: /key/regenerate) lies after the others, so the
    delete took a later key's row and waited for an earlier one that a settlement batch held, while
    the batch (keys by id: settlement.locked_in_order's LOCK ORDER) waited for the later one; PostgreSQL
    aborted one of them (a deadlock). Keys are now locked by id before any is deleted."""
    import threading

    from sqlalchemy.orm import Session

    from treeserve.gateway import keys as keylib

    store.accounts.create_user("u")
    first, second = (store.accounts.create_key(user_id="u")[0] for _ in range(2))
    first = store.accounts.regenerate_key(first)[0]  # (its row written again: after the second's)
    with store.db.session() as s:
        ids = [s.scalar(select(ApiKey.id).where(ApiKey.token_hash == keylib.hash_key(t))) for t in (first, second)]
    assert ids[0] < ids[1]
    errors: list[Exception] = []

    def delete_them():
        try:
            store.accounts.delete_users(["u"]) if deleting == "user" else store.accounts.delete_keys([second, first])
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    with Session(store.db.engine) as settling, settling.begin():  # (a settlement batch: the first key, then the second)
        settling.execute(update(ApiKey).where(ApiKey.id == ids[0]).values(spend=ApiKey.spend + 1.0))
        deleter = threading.Thread(target=delete_them)
        deleter.start()
        deleter.join(0.5)  # (waiting for the first key's row)
        try:
            settling.execute(update(ApiKey).where(ApiKey.id == ids[1]).values(spend=ApiKey.spend + 1.0))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    deleter.join(30)
    assert not deleter.is_alive() and errors == [], errors
    with store.db.session() as s:
        assert s.scalars(select(ApiKey.id).where(ApiKey.id.in_(ids))).all() == []


@pytest.mark.parametrize("owner", ["user", "team", "team, another key"])
def test_a_users_budget_reset_at_admission_waits_for_its_keys_row_instead_of_deadlocking(store, owner):
    """Admission reset a budget whose period had ended before it held anything: a user's (or team's)
    due while its key's was not wrote the user's row, then the key's (its reservation), against the
    LOCK ORDER (keys first: settlement.locked_in_order); a settlement batch of the same key at that
    moment (its key's row, then its user's) deadlocked with it on PostgreSQL, one aborted. A team's
    written before its user's deadlocked so with a settlement of another key of the user and team
    (the user's row, then the team's). The rows before the one reset are now taken first."""
    import threading

    from sqlalchemy.orm import Session

    from treeserve.gateway.schema import Team

    store.accounts.create_user("u", **({"max_budget": 10.0, "budget_duration": "1d"} if owner == "user" else {}))
    team = None
    if owner != "user":
        store.teams.create_team("t", [], max_budget=10.0, budget_duration="1d")
        team = "t"
    token = store.accounts.create_key(user_id="u", team_id=team, max_budget=5.0)[0]
    table, where = (User, User.user_id == "u") if owner == "user" else (Team, Team.team_id == "t")
    with store.db.transaction() as s:  # (its period over)
        s.execute(update(table).where(where).values(spend=3.0, budget_reset_at=utcnow() - dt.timedelta(seconds=1)))
    key = store.accounts.authenticate(token)
    errors: list[Exception] = []

    def admit():
        try:
            store.admission.admit(key, 0.1)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    first = update(ApiKey).where(ApiKey.id == key.id).values(spend=ApiKey.spend + 1.0)
    if owner == "team, another key":  # (its key's row, then its user's, then the team's)
        first = update(User).where(User.user_id == "u").values(spend=User.spend + 1.0)
    with Session(store.db.engine) as settling, settling.begin():  # (a settlement: the key's row, then its owner's)
        settling.execute(first)
        admitting = threading.Thread(target=admit)
        admitting.start()
        admitting.join(0.5)  # (waiting for the key's row)
        try:
            settling.execute(update(table).where(where).values(spend=table.spend + 1.0))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    admitting.join(30)
    assert not admitting.is_alive() and errors == [], errors
    with store.db.session() as s:
        assert s.scalar(select(table.spend).where(where)) in (0.0, 1.0)  # (reset, before or after the settlement's)
        assert s.scalar(select(table.reserved).where(where)) == pytest.approx(0.1)


@pytest.mark.parametrize("writing", ["/key/generate", "/key/update", "/team/member_add"])
def test_a_team_key_given_to_a_user_waits_for_a_settlement_instead_of_deadlocking(store, writing):
    """/key/generate (and /key/update) with a `team_id` and a `user_id` locked the team's row (no key
    outlives its team; /team/member_add too), then wrote the user's (made if there is none: INSERT ... ON CONFLICT, which on
    PostgreSQL waits for a transaction writing the row): the team's before the user's, against the LOCK
    ORDER (settlement.locked_in_order); a settlement of another key of the user and team at that moment
    (the user's row, then the team's) deadlocked with it on PostgreSQL. The user's row comes first."""
    import threading

    from sqlalchemy.orm import Session

    from treeserve.gateway.schema import Team

    store.accounts.create_user("u")
    store.teams.create_team("t", [])
    other = store.accounts.create_key()[0]
    errors: list[Exception] = []

    def write():
        try:
            if writing == "/key/generate":
                store.accounts.create_key(user_id="u", team_id="t")
            elif writing == "/key/update":
                store.accounts.update_key(other, user_id="u", team_id="t")
            else:  # (the members' users are made if there are none, as LiteLLM's)
                store.teams.add_members("t", [("u", "user")])
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    with Session(store.db.engine) as settling, settling.begin():  # (a settlement: the user's row, then the team's)
        settling.execute(update(User).where(User.user_id == "u").values(spend=User.spend + 1.0))
        writer = threading.Thread(target=write)
        writer.start()
        writer.join(0.5)
        try:
            settling.execute(update(Team).where(Team.team_id == "t").values(spend=Team.spend + 1.0))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    writer.join(30)
    assert not writer.is_alive() and errors == [], errors
    if writing == "/team/member_add":
        assert [m["user_id"] for m in store.teams.team("t")["members_with_roles"]] == ["u"]
    else:
        assert [k["team_id"] for k in store.accounts.list_keys("u")] == ["t"]


def test_a_request_refused_by_its_rate_limit_holds_nothing_on_its_key_user_or_team(store):
    """Admission reserves a request's worst case on its key, user and team before counting it in its
    minute (LOCK ORDER; LiteLLM, too, checks budgets at auth, before its rate limiter): one refused
    by its rpm_limit gives back all it reserved (the slot with it), in the same transaction."""
    from treeserve.gateway.errors import RateLimitExceeded
    from treeserve.gateway.schema import Team

    store.accounts.create_user("u", max_budget=10.0)
    store.teams.create_team("t", [], max_budget=10.0)
    token = store.accounts.create_key(user_id="u", team_id="t", max_budget=5.0, rpm_limit=1,
                                      max_parallel_requests=5)[0]
    key = store.accounts.authenticate(token)
    first = store.admission.admit(key, 0.5)
    with pytest.raises(RateLimitExceeded):
        store.admission.admit(key, 0.5)
    with store.db.session() as s:
        assert s.execute(select(ApiKey.reserved, ApiKey.in_flight).where(ApiKey.id == key.id)).one() == (0.5, 1)
        assert s.scalar(select(User.reserved).where(User.user_id == "u")) == 0.5
        assert s.scalar(select(Team.reserved).where(Team.team_id == "t")) == 0.5
        assert s.scalar(select(func.count()).select_from(Holding)) == 1
    store.admission.release(first, 0.0)


def test_pruning_past_minutes_while_a_settlement_writes_them_waits_instead_of_deadlocking(request):
    """Pruning past minutes (prune_rate_windows, a chore of every gateway process) was one DELETE, which
    takes its rows in the order it finds them, not by key: a settlement batch of another process
    writing the minutes of requests that ran for minutes (by key: settlement.locked_in_order's LOCK
    ORDER) held the first key's and waited for the second's, which the prune held while it waited for
    the first; PostgreSQL aborted one (the batch, retried row by row). The rows are now locked by key
    and minute before any is deleted."""
    import threading

    from sqlalchemy.orm import Session

    store = Store(request.getfixturevalue("postgres").new_database())
    store.migrate()
    past = int(utcnow().timestamp() // 60) - 5
    with store.db.transaction() as s:  # (the second key's minute stored first: a plain DELETE meets it first)
        s.execute(insert(RateWindow), [dict(key_id=2, window=past, requests=1, tokens=0),
                                       dict(key_id=1, window=past, requests=1, tokens=0)])
    errors: list[Exception] = []
    pruned: list[int] = []

    def prune():
        try:
            pruned.append(store.admission.prune_rate_windows())
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    try:
        with Session(store.db.engine) as settling, settling.begin():  # (a settlement: the minutes by key)
            settling.execute(update(RateWindow).where(RateWindow.key_id == 1).values(tokens=RateWindow.tokens + 1))
            pruner = threading.Thread(target=prune)
            pruner.start()
            pruner.join(0.5)  # (waiting for the first key's minute)
            try:
                settling.execute(update(RateWindow).where(RateWindow.key_id == 2)
                                 .values(tokens=RateWindow.tokens + 1))
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        pruner.join(30)
        assert not pruner.is_alive() and errors == [], errors
        assert pruned == [2]
    finally:
        store.close()


@pytest.mark.parametrize("writing", ["/team/new", "/team/member_add"])
def test_members_added_while_their_users_are_deleted_wait_instead_of_deadlocking(request, writing):
    """/team/new and /team/member_add wrote the members' rows in the order the request named them, each
    holding its user's row (the foreign key check's FOR KEY SHARE): named out of id order, they held a
    later user's row and waited for an earlier one's, which /user/delete of both (the users' rows by
    id, FOR UPDATE: settlement.locked_in_order's LOCK ORDER) held while it waited for the later one;
    PostgreSQL aborted one. Members are now written by user id."""
    import threading

    from sqlalchemy.orm import Session

    store = Store(request.getfixturevalue("postgres").new_database())
    store.migrate()
    for user_id in ("a", "b"):
        store.accounts.create_user(user_id)
    if writing == "/team/member_add":
        store.teams.create_team("t", [])
    members = [("b", "user"), ("a", "user")]  # (not by id)
    errors: list[Exception] = []

    def write():
        try:
            if writing == "/team/new":
                store.teams.create_team("t", members)
            else:
                store.teams.add_members("t", members)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    try:
        with Session(store.db.engine) as deleting, deleting.begin():  # (/user/delete: the users' rows by id)
            deleting.execute(select(User.user_id).where(User.user_id == "a").with_for_update()).all()
            writer = threading.Thread(target=write)
            writer.start()
            writer.join(0.5)  # (waiting for the first user's row)
            try:
                deleting.execute(select(User.user_id).where(User.user_id == "b").with_for_update()).all()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        writer.join(30)
        assert not writer.is_alive() and errors == [], errors
        assert sorted(m["user_id"] for m in store.teams.team("t")["members_with_roles"]) == ["a", "b"]
    finally:
        store.close()


def _batch_lines_running(store: Store, lines: tuple[int, ...]) -> None:
    """Batch "b" (the master key's) with `lines` running, stored in that order."""
    from treeserve.gateway.schema import Batch, BatchLine

    now = utcnow()
    with store.db.transaction() as s:
        s.execute(insert(Batch).values(id="b", endpoint="/v1/chat/completions", input_file_id="f",
                                       completion_window="24h", status="in_progress", total=len(lines),
                                       created_at=now, expires_at=now + dt.timedelta(days=1)))
        s.execute(insert(BatchLine), [dict(batch_id="b", line=line, custom_id=str(line), url="/v1/chat/completions",
                                           body={}, status="running") for line in lines])


def _line_settlement(line: int) -> Settlement:
    from treeserve.gateway.settlement import Reservation

    return Settlement(Reservation(None, None, 0.0, False, 0), f"r{line}", "m", None, "chat", False, "success",
                      Usage(1, 1), 0.0, utcnow(), batch_line=("b", line), answer=(200, b'{"id": "x"}'))


@pytest.mark.parametrize("side", ["take_up", "settlement"])
def test_a_settlement_answering_batch_lines_while_they_are_taken_up_waits_instead_of_deadlocking(request, side):
    """A batch's lines left running go back to pending (`take_up`, and `claim` of a batch whose lease
    ran out) in one UPDATE, which takes them in the order it finds them; a settlement batch wrote its
    lines' answers in the order the requests ended. Two lines each took in the other's order: each
    held one and waited for the other, PostgreSQL aborted one (the settlement retried row by row).
    Both now take a batch's lines by line."""
    import threading

    from sqlalchemy.orm import Session

    from treeserve.gateway.schema import BatchLine
    from treeserve.gateway.settlement import commit_settlements

    store = Store(request.getfixturevalue("postgres").new_database())
    store.migrate()
    # (the second line stored first, a plain UPDATE of them all meets it first; as many as a real batch's, so
    # that the planner reads the table rather than the index)
    _batch_lines_running(store, (2, 1, *range(3, 500)))
    with store.db.transaction() as s:
        s.execute(text("ANALYZE batch_lines"))
    errors: list[Exception] = []

    def run():
        try:
            if side == "take_up":
                store.batches.take_up("b")
            else:
                commit_settlements(store.db, [_line_settlement(2), _line_settlement(1)])  # (ended out of order)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    def line(number: int):
        return (BatchLine.batch_id == "b") & (BatchLine.line == number)
    try:
        with Session(store.db.engine) as other, other.begin():  # (the other side, by line)
            other.execute(select(BatchLine.line).where(line(1)).with_for_update()).all()
            runner = threading.Thread(target=run)
            runner.start()
            runner.join(0.5)  # (waiting for the first line)
            try:
                other.execute(select(BatchLine.line).where(line(2)).with_for_update()).all()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        runner.join(30)
        assert not runner.is_alive() and errors == [], errors
        with store.db.session() as s:
            ended = s.scalars(select(BatchLine.status).where(BatchLine.line.in_([1, 2]))).all()
        assert ended == ["pending" if side == "take_up" else "done"] * 2
    finally:
        store.close()


def test_a_key_deleted_while_its_settlement_is_mid_flight_waits_and_loses_no_spend(request):
    """A settlement batch holds its keys' rows FOR NO KEY UPDATE (settlement.lock_keys), weaker than
    FOR UPDATE: /key/delete (FOR UPDATE, then DELETE) still waits for the batch's commit, so the
    request's spend reaches its user, and its spend row is written, whichever commits first."""
    import time

    url = request.getfixturevalue("postgres").new_database()
    owner, deleter, blocker = Store(url), Store(url), Store(url)
    owner.migrate()
    results, errors = [], []
    try:
        owner.accounts.create_user("u")
        token, _ = owner.accounts.create_key(user_id="u", max_budget=1.0, max_parallel_requests=1)
        reservation = owner.admission.admit(owner.accounts.authenticate(token), 0.25)
        with blocker.db.transaction() as hold:  # (the user's row held: the batch waits on it, its key's row held)
            hold.execute(update(User).where(User.user_id == "u").values(spend=User.spend))
            settle = _in_thread(lambda: owner.ledger.settle(Settlement(
                reservation, "r", "m", None, "chat", False, "success", Usage(1, 1), 0.1, utcnow())), results, errors)
            time.sleep(1.0)
            delete = _in_thread(lambda: deleter.accounts.delete_keys([token]), results, errors)
            delete.join(1.0)
            assert delete.is_alive()  # (waiting for the batch)
        settle.join(30)
        delete.join(30)
        assert errors == []
        assert _owed(owner, "u") == ([], (0.0, 0.1))
        assert [row["request_id"] for row in owner.ledger.logs(user_id="u")] == ["r"]
    finally:
        for each in (owner, deleter, blocker):
            each.close()


# ---- the Conversations API's store: appends checked as they are written -----------------------------
class _AddedMeanwhile:
    """A conversation store (a real one) at which, once a conversation's items have been read, another
    request adds `item` before the reader appends: the race of two requests adding the same item id."""

    def __init__(self, kept, item: dict):
        self.kept, self.item = kept, item

    def __getattr__(self, name):
        return getattr(self.kept, name)

    async def items(self, conversation_id: str, owner):
        held = await self.kept.items(conversation_id, owner)
        if self.item is not None:
            await self.kept.append(conversation_id, [self.item], owner, None)
            self.item = None
        return held


def _conversation_appends_are_checked_as_written(kept) -> None:
    import asyncio

    from treeserve.wire.conversations import stored_items
    from treeserve.wire.conversations_api import ConversationsAPI

    item = stored_items([{"role": "user", "content": "b", "id": "msg_b"}])[0]
    output = stored_items([{"role": "assistant", "content": "c"}])[0]

    async def run():
        api = ConversationsAPI(kept)
        conversation_id = (await api.create([{"role": "user", "content": "a"}], None))["id"]
        with pytest.raises(APIError) as caught:  # (an add whose item another add wrote meanwhile)
            await ConversationsAPI(_AddedMeanwhile(kept, item)).add_items(conversation_id, [dict(item)])
        await api.append(conversation_id, [item, output], None)  # (a response whose input item was added so)
        listed = await api.list_items(conversation_id, limit=100, order="asc")
        return caught.value, [each["id"] for each in listed["data"]]

    refused, ids = asyncio.run(run())
    assert (refused.status, refused.param) == (400, "items[0].id"), refused.message  # (it was a 404: no conversation)
    assert ids[1:] == ["msg_b", output["id"]]  # (the output was dropped, or the item kept twice)


def test_conversation_appends_are_checked_as_written(store):
    """Two requests adding an item of the same id at once: the second a 400 naming the item (it was a
    404, `conversation not found`); a response whose input item was added so meanwhile keeps its output
    in the conversation, the item once (the whole append failed on the unique index, silently)."""
    from treeserve.gateway.conversation_store import DatabaseConversationStore
    _conversation_appends_are_checked_as_written(DatabaseConversationStore(store.db))


def test_the_servers_conversation_appends_are_checked_as_written():
    """As above, in the server's memory (the item was kept twice)."""
    from treeserve.wire.conversations_api import MemoryConversationStore
    _conversation_appends_are_checked_as_written(MemoryConversationStore())
