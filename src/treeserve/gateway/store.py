"""The gateway's services over one database, built together: what a gateway process (or a CLI
command) opens. Callers use the services themselves:

- `accounts` (gateway/accounts.py): users, keys, who a key is;
- `teams` (gateway/teams.py): teams, their members, and deleting a team with its keys;
- `admission` (gateway/admission.py): parallel slots, per-minute counts, budget reservations;
- `ledger` (gateway/ledger.py): settlements, spend logs, daily totals, exports;
- `instances` (gateway/instances.py): this process's heartbeat, the sweep of dead processes' holdings;
- `heartbeat` (gateway/heartbeat.py): the thread that beats, apart from the ledger's writer thread;
- `files`, `batches` (gateway/files.py, gateway/batches.py): the Files and Batch APIs' rows.

Each raises domain errors (gateway/errors.py), never HTTP ones; calls are blocking (the app runs
them in worker threads)."""
from __future__ import annotations

from treeserve.gateway.accounts import Accounts
from treeserve.gateway.admission import Admission
from treeserve.gateway.batches import Batches
from treeserve.gateway.database import Database
from treeserve.gateway.files import Files
from treeserve.gateway.heartbeat import HEARTBEAT_INTERVAL, Heartbeat
from treeserve.gateway.instances import Instances
from treeserve.gateway.ledger import Ledger
from treeserve.gateway.settlement import PRUNE_INTERVAL
from treeserve.gateway.teams import Teams


class Store:
    def __init__(self, url: str):
        self.db = Database(url)
        self.accounts = Accounts(self.db)
        self.teams = Teams(self.db)
        self.instances = Instances(self.db)
        self.admission = Admission(self.db, self.instances.instance_id)
        self.files = Files(self.db)
        self.batches = Batches(self.db, self.files)
        self.heartbeat = Heartbeat(self.instances.heartbeat, HEARTBEAT_INTERVAL)
        self.ledger = Ledger(self.db, chores=[("prune", PRUNE_INTERVAL, self.admission.prune_rate_windows),
                                              ("sweep", PRUNE_INTERVAL, self.instances.sweep)])

    def migrate(self) -> None:
        self.db.migrate()

    def start(self) -> None:
        """Heartbeats (a thread of their own), sweeps and settlements (the ledger's writer thread) from now on."""
        self.heartbeat.start()
        self.ledger.start()

    def close(self) -> None:
        """Commits the settlements queued (still beating meanwhile), then stops beating."""
        try:
            self.ledger.close()
        finally:
            self.heartbeat.close()
            self.db.close()
