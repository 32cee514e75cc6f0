"""Spend-log queries at a million rows (LiteLLM's users report theirs getting slow there): fills a
fresh SQLite gateway database with `--rows` spend rows over `--keys` keys and 30 days, then times
the queries `/spend/logs` runs (one key's day, one user's week) and a key's daily totals.

    python benchmarks/spend_logs_scale.py [--rows 1000000] [--keys 1000] [--database URL]
"""
from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import insert

from treeserve.gateway.schema import SpendLog
from treeserve.gateway.store import Store

BATCH = 20_000


def fill(store: Store, rows: int, keys: int, start: dt.datetime) -> None:
    rng = random.Random(0)
    for first in range(0, rows, BATCH):
        batch = []
        for i in range(first, min(rows, first + BATCH)):
            key = rng.randrange(keys)
            at = start + dt.timedelta(seconds=rng.randrange(30 * 86400))
            batch.append(dict(request_id=f"r{i}", key_id=key, user_id=f"u{key % 100}", model="m", backend="b",
                              route="chat", stream=False, status="success", prompt_tokens=100,
                              completion_tokens=50, cost=0.001, started_at=at, ended_at=at))
        with store.db.transaction() as conn:
            conn.execute(insert(SpendLog.__table__), batch)


def timed(query, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        query()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--database", help="default: a new SQLite file in a temporary directory")
    args = parser.parse_args()
    store = Store(args.database or f"sqlite:///{Path(tempfile.mkdtemp()) / 'spend.db'}")
    store.migrate()
    start = dt.datetime(2026, 10, 1, tzinfo=dt.timezone.utc)
    began = time.perf_counter()
    fill(store, args.rows, args.keys, start)
    print(f"{args.rows:,} spend rows over {args.keys} keys written in {time.perf_counter() - began:.1f} s")
    day, week = dt.timedelta(days=1), dt.timedelta(days=7)
    mid = start + dt.timedelta(days=14)
    key_day = timed(lambda: store.ledger.logs(7, None, mid, mid + day, 100_000))
    user_week = timed(lambda: store.ledger.logs(None, "u7", mid, mid + week, 100_000))
    print(f"one key's day ({len(store.ledger.logs(7, None, mid, mid + day, 100_000))} rows): {key_day:.1f} ms median")
    print(f"one user's week ({len(store.ledger.logs(None, 'u7', mid, mid + week, 100_000))} "
          f"rows): {user_week:.1f} ms median")
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
