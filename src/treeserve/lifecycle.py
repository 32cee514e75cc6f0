"""Process lifecycle: SIGTERM ends a command the way Ctrl-C does (its `finally` blocks stop its
children), and a child started by a treeserve command dies with it, even when the parent is
killed with SIGKILL (issue #40).

uvicorn catches SIGINT and SIGTERM, shuts down gracefully, restores the handlers it found and then
raises the signal again. With Python's default SIGTERM handler that last step kills the process on
the spot, skipping every `finally`: `treeserve chat` left its `treeserve serve` child running.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PARENT_ENV = "TREESERVE_DIE_WITH_PARENT"  # the parent's pid, set for the children it starts
_PR_SET_PDEATHSIG = 1


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(0) in the main thread, so cleanup runs and the exit status is 0
    (a no-op off the main thread, where a command run in-process cannot take signals)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit)


def _exit(signum, frame) -> None:
    raise SystemExit(0)


def child_env() -> dict[str, str]:
    """The environment for a child that must not outlive this process (see `follow_parent`)."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


def follow_parent() -> None:
    """Where the parent asked for it (`child_env`): on Linux, SIGTERM to this process when the
    parent dies, whatever kills it; if the parent is already gone, exit now."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the request took effect
        raise SystemExit(0)
