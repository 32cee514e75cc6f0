"""Throwaway services on loopback for the gateway's tests and benchmarks: a PostgreSQL cluster
(Debian's initdb and pg_ctl, run as the `postgres` user when root) and a RabbitMQ node, each on free
ports with its files in a directory of its own. Both can be stopped and started again on the same
ports and files (the chaos run kills and restarts the broker)."""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

from treeserve.ports import free_port


def postgres_bin() -> Path | None:
    """The directory of initdb and pg_ctl: Debian keeps them in /usr/lib/postgresql/N/bin."""
    if shutil.which("initdb") and shutil.which("pg_ctl"):
        return Path(shutil.which("pg_ctl")).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return Path(versions[-1]).parent if versions else None


def _as_postgres(args: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as the `postgres` user there."""
    if os.geteuid() != 0:
        return args
    runuser = shutil.which("runuser")
    if runuser:
        return [runuser, "-u", "postgres", "--", *args]
    return ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(args)]


class PostgresCluster:
    def __init__(self, root: Path):
        self.bin = postgres_bin()
        self.data, self.sockets = root / "data", root / "sockets"
        self.port = free_port()
        self.log = root / "postgres.log"

    def start(self) -> None:
        for path in (self.data, self.sockets):
            path.mkdir(parents=True)
        if os.geteuid() == 0:
            shutil.chown(self.data.parent, "postgres")
            for path in (self.data, self.sockets):
                shutil.chown(path, "postgres")
        self._run([str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                   "--no-sync", "-E", "UTF8"])
        options = f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options, "-w",
                   "-t", "60", "start"])

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])

    def new_database(self) -> str:
        import psycopg

        name = f"gw_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def _run(self, args: list[str]) -> None:
        done = subprocess.run(_as_postgres(args), capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{Path(args[0]).name} failed ({done.returncode}): {done.stderr or done.stdout}")


def rabbitmq_server() -> str | None:
    for candidate in ("/usr/lib/rabbitmq/bin/rabbitmq-server", shutil.which("rabbitmq-server")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


class RabbitNode:
    """A RabbitMQ node on free ports, its files under `root`; `url` is its AMQP URL."""

    def __init__(self, root: Path):
        self.server, self.root = rabbitmq_server(), root
        self.port, dist_port = free_port(), free_port()
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/"
        (root / "enabled_plugins").write_text("[].\n")
        self.env = dict(os.environ, HOME=str(root), RABBITMQ_NODENAME=f"treeserve{self.port}@localhost",
                        RABBITMQ_NODE_IP_ADDRESS="127.0.0.1", RABBITMQ_NODE_PORT=str(self.port),
                        RABBITMQ_DIST_PORT=str(dist_port), RABBITMQ_MNESIA_BASE=str(root / "mnesia"),
                        RABBITMQ_LOG_BASE=str(root / "log"), RABBITMQ_ENABLED_PLUGINS_FILE=str(root / "enabled_plugins"),
                        RABBITMQ_PLUGINS_EXPAND_DIR=str(root / "plugins"), RABBITMQ_PID_FILE=str(root / "pid"),
                        RABBITMQ_CONFIG_FILE=str(root / "rabbitmq"), ERL_EPMD_ADDRESS="127.0.0.1")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90) -> None:
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen([self.server], env=self.env, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.listening():
            if self.proc.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("RabbitMQ did not start")
            time.sleep(0.2)

    def listening(self) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """The node and its helper processes (its process group); SIGKILL for a crash."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        # epmd and the node's other helpers share the group: none may hold the ports for a restart
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None
