"""`treeserve chat` stopped by SIGTERM (as a service manager stops it), SIGINT or SIGKILL leaves no
`treeserve serve` child behind (issue #40): SIGTERM and SIGINT run its cleanup and exit 0; on
SIGKILL the child notices its parent's death (PR_SET_PDEATHSIG) and stops itself."""
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from gateway_support import _free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _serve_child(pid: int) -> int:
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_chat_leaves_no_server_behind(tmp_path, sig):
    port, serve_port = _free_port(), _free_port()
    chat = subprocess.Popen([sys.executable, "-m", "treeserve.cli", "chat", "--port", str(port),
                             "--serve-port", str(serve_port), "--database", f"sqlite:///{tmp_path / 'gw.db'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # the page answers once the server and the gateway are up
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("treeserve chat did not come up")
        serve = _serve_child(chat.pid)
        chat.send_signal(sig)
        code = chat.wait(60)
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
        assert _gone(serve, 60), f"the serve child {serve} outlived treeserve chat after {sig.name}"
    finally:
        chat.kill()
