"""The README's and docs' commands, run as a new user would run them, on the bundled models.

A fenced block preceded by a `<!-- readme-test: {...} -->` line (invisible on the rendered page) is
run as written, in a scratch directory that has the checkout's `.venv`, `data/` and `examples/`:
`bash` blocks with bash (-e, pipefail), `python` blocks with this interpreter. The marker's JSON may
name `serve` (the arguments of a `treeserve serve` started for the block; the block's port 8000 is
rewritten to the server's, 4000 to a free one for a gateway it starts, 8001 and 8002 to free ones for
replicas it starts), `expect` (text its output
must contain), `stdin` and `timeout`. A block fails on a non-zero exit, a missing expectation or its
timeout; whatever it left running in the background (a gateway started with `&`) is stopped with it."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from treeserve.bench.health import wait_healthy
from treeserve.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- readme-test: (\{.*\}) -->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass
class Block:
    where: str               # file:line of the block's first line
    language: str            # bash or python
    code: str
    serve: list[str] | None = None
    expect: list[str] = field(default_factory=list)
    timeout: float = 300.0


def marked_blocks(path: Path) -> list[Block]:
    """The blocks of one Markdown file that a marker line names, in order."""
    lines = path.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        marker = MARKER.match(line)
        if marker is None:
            continue
        opening = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        assert opening and opening.group(1) in ("bash", "python"), \
            f"{path.name}:{i + 1}: a readme-test marker must stand right above a ```bash or ```python block"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        options = json.loads(marker.group(1))
        blocks.append(Block(f"{path.relative_to(ROOT)}:{i + 3}", opening.group(1), "\n".join(lines[i + 2:end]),
                            **options))
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in marked_blocks(path)]


def test_the_readme_marks_the_commands_a_new_user_runs_first():
    """The quick start's requests, the offline API, `run`, the client, the gateway, search and eval."""
    readme = {block.where for block in BLOCKS if block.where.startswith("README")}
    assert len(readme) >= 7, f"marked README blocks: {sorted(readme)}"


@pytest.fixture
def scratch(tmp_path):
    """A directory laid out as the checkout is for a user: `.venv/bin/treeserve` works there."""
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    for name in ("data", "examples", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_marked_block_runs_as_written(block, scratch):
    ports = {port: str(free_port()) for port in ("8000", "8001", "8002", "4000")}
    code = re.sub(r"(?<=[:= ])(8000|8001|8002|4000)\b", lambda m: ports[m.group(1)], block.code)
    server = _start_server(block.serve, ports["8000"], scratch) if block.serve is not None else None
    try:
        output = _run(block, code, scratch)
    finally:
        if server is not None:
            _stop(server)
    missing = [text for text in block.expect if text not in output]
    assert not missing, f"{block.where}: the output lacks {missing}:\n{output[-4000:]}"


def _environment() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}


def _start_server(args: list[str], port: str, cwd: Path) -> subprocess.Popen:
    log = open(cwd / "server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "treeserve.cli", "serve", *args, "--port", port], cwd=cwd,
                              stdout=log, stderr=subprocess.STDOUT, env=_environment())
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, timeout=300)
    except (RuntimeError, TimeoutError) as error:
        _stop(server)
        pytest.fail(f"treeserve serve {' '.join(args)}: {error}\n{(cwd / 'server.log').read_text()[-3000:]}")
    return server


def _run(block: Block, code: str, cwd: Path) -> str:
    """Runs the block in a session of its own (its background jobs die with it); its output goes to
    a file, not a pipe, which a background job would hold open."""
    command = ["bash", "-e", "-o", "pipefail", "-c", code] if block.language == "bash" else [sys.executable, "-c", code]
    out = cwd / "block.out"
    with open(out, "wb") as sink:
        process = subprocess.Popen(command, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=_environment(), start_new_session=True)
        try:
            status = process.wait(block.timeout)
        except subprocess.TimeoutExpired:
            status = None
        finally:
            _stop_group(process)
    output = out.read_text(errors="replace")
    assert status is not None, f"{block.where}: still running after {block.timeout:.0f} s:\n{output[-4000:]}"
    assert status == 0, f"{block.where}: exited {status}:\n{output[-4000:]}"
    return output


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the block's session (a gateway it started drains and exits), SIGKILL after 30 s."""
    for sig, patience in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            if process.poll() is not None and not _group_alive(process.pid):
                return
            time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
