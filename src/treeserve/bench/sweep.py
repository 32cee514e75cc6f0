"""`treeserve bench sweep sweep.yaml`: start each server, wait for health, benchmark it, stop it.

    out: runs/sweep                  # one run directory per server below it, and a comparison
    bench:                           # options of `treeserve bench serve`, for every server
      concurrency: [1, 4, 16]
      num_requests: 32
    servers:
      - name: treeserve
        command: treeserve serve --port 8011      # any command line: vllm serve, llama-server, ...
        base_url: http://127.0.0.1:8011
        env: {OMP_NUM_THREADS: "8"}              # optional
        startup_timeout: 600                      # seconds, optional
        bench: {output_len: 64}                   # optional per-server overrides

A server without `command` is one already running. The sweep exits non-zero when a server failed
to become healthy or died before it was stopped.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from treeserve.bench.overhead import wait_healthy
from treeserve.bench.run import BenchConfig, run_benchmark, write_json
from treeserve.errors import ParamError
from treeserve.lifecycle import die_with_parent

DEFAULT_STARTUP_TIMEOUT_S = 600.0
STOP_GRACE_S = 15.0


@dataclass
class ServerSpec:
    name: str
    base_url: str
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S
    bench: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, row: dict, position: int) -> "ServerSpec":
        unknown = sorted(set(row) - {"name", "base_url", "command", "env", "startup_timeout", "bench"})
        if unknown:
            raise ParamError(f"servers[{position}]", f"unknown key(s) {', '.join(unknown)}")
        if "base_url" not in row:
            raise ParamError(f"servers[{position}]", "base_url is required")
        command = row.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        if command is not None:  # no shell runs it: `~` and `$VAR` are expanded here, word by word
            command = [os.path.expandvars(os.path.expanduser(str(word))) for word in command]
        return cls(name=str(row.get("name") or f"server{position}"), base_url=row["base_url"], command=command,
                   env={k: str(v) for k, v in (row.get("env") or {}).items()},
                   startup_timeout=float(row.get("startup_timeout", DEFAULT_STARTUP_TIMEOUT_S)),
                   bench=dict(row.get("bench") or {}))


def load_sweep(path: Path) -> tuple[Path, dict, list[ServerSpec]]:
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"sweep file {path} does not exist")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(spec) - {"out", "bench", "servers"})
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}; expected out, bench, servers")
    if not spec.get("servers"):
        raise ValueError(f"{path}: 'servers' must list at least one server")
    servers = [ServerSpec.from_dict(row, i) for i, row in enumerate(spec["servers"])]
    if len({s.name for s in servers}) != len(servers):
        raise ValueError(f"{path}: server names must be unique")
    out = Path(spec.get("out") or path.with_suffix(""))
    return out, dict(spec.get("bench") or {}), servers


class ServerProcess:
    """A server started from its command line, in its own process group (stopped whole), logging to
    a file; it gets SIGTERM if the sweep dies, even by SIGKILL (a parent-death signal)."""

    def __init__(self, spec: ServerSpec, log_path: Path):
        self.spec = spec
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(spec.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **spec.env}, start_new_session=True,
                                        preexec_fn=die_with_parent)
        self.died_with: int | None = None

    def stop(self) -> None:
        """Stops the server; if it had already exited, that was a death, and its code is kept."""
        if self.process.poll() is not None:
            self.died_with = self.process.returncode
        else:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        self.log.close()

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


def run_sweep(path: Path) -> int:
    """Benchmarks every server of the sweep file in turn; 0 when every server stayed up."""
    out, bench, servers = load_sweep(path)
    out.mkdir(parents=True, exist_ok=True)
    results = [run_one(server, out / server.name, bench) for server in servers]
    write_json(out / "sweep.json", {"servers": results})
    finished = [out / r["name"] for r in results if r.get("summary")]
    if len(finished) > 1:
        from treeserve.bench.report import compare_runs

        compare_runs(finished, out)
    for r in results:
        print(f"{r['name']}: {r['status']}" + (f" ({r['error']})" if r.get("error") else ""))
    return 0 if all(r["status"] == "ok" for r in results) else 1


def run_one(server: ServerSpec, run_dir: Path, bench: dict) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    config = BenchConfig.from_dict({**bench, **server.bench, "base_url": server.base_url, "out": str(run_dir)})
    result = {"name": server.name, "base_url": server.base_url, "command": server.command, "status": "ok"}
    process = None
    try:
        process = ServerProcess(server, run_dir / "server.log") if server.command else None
        began = time.monotonic()
        wait_healthy(server.base_url, process.process if process else None, server.startup_timeout)
        result["startup_s"] = time.monotonic() - began
        if process is not None:
            config.server_pid = process.process.pid
        run_benchmark(config)
        result["summary"] = str(run_dir / "summary.json")
    except Exception as exc:  # the sweep goes on to the next server and reports this one as failed
        result.update(status="failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        if process is not None:
            process.stop()
            if process.died_with is not None:
                result.update(status="died", exit_code=process.died_with,
                              error=f"server exited with code {process.died_with}; see {run_dir / 'server.log'}")
    return result
