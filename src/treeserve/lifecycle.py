"""Process lifecycle: SIGTERM and SIGINT end a command alike, with status 0 once its `finally`
blocks have stopped its children (a second signal cuts that short), and a child started by a
treeserve command dies with it, even when the parent is killed with SIGKILL (issue #40). The
servers drain before they end (wire/drain.py); a server's start cut short by a signal exits 128 +
its number (`start_cut_short_by_signals`).

uvicorn catches SIGINT and SIGTERM, shuts down gracefully, restores the handlers it found and then
raises the signal again. With Python's default SIGTERM handler that last step kills the process on
the spot, skipping every `finally`: `treeserve chat` left its `treeserve serve` child running.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import threading

PARENT_ENV = "TREESERVE_DIE_WITH_PARENT"  # the parent's pid, set for the children it starts
_PR_SET_PDEATHSIG = 1
# looked up here, not in a forked child (a `preexec_fn` must not load libraries)
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def exit_on_signals(service: bool = True) -> None:
    """SIGTERM and SIGINT raise SystemExit in the main thread, so cleanup runs: status 0 for a
    `service` (a long-running command: stopping it is how it ends), else 128 + the signal's number
    (130, 143: the shell's convention for a job cut short). A no-op off the main thread, where a
    command run in-process cannot take signals. The servers put their own handlers in place while
    they serve."""
    if threading.current_thread() is threading.main_thread():
        handler = _exit if service else _exit_cut_short
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)


@contextlib.contextmanager
def start_cut_short_by_signals():
    """While a server starts (its models load, its tensor-parallel ranks start): SIGTERM and SIGINT
    exit 128 + the signal's number once the start's `finally` blocks have stopped what it started. A
    start cut short is no success (a supervisor must not read it as a clean stop; vLLM's serve ends
    non-zero there too); once it serves, the server's own handlers drain and exit 0. A no-op off the
    main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _exit_cut_short) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _exit(signum, frame) -> None:
    _say_stopping(signum)
    raise SystemExit(0)


def _exit_cut_short(signum, frame) -> None:
    _say_stopping(signum)
    raise SystemExit(128 + signum)


def _say_stopping(signum: int) -> None:
    """`treeserve: SIGINT: stopping` on stderr, on a line of its own: a progress bar in the middle of
    its run (eval's, search's) leaves stderr at the end of its line, which the message joined (in a
    log file or a pipe; on a terminal after the ^C)."""
    start = "\n" if _progress_bar_open() else ""
    print(f"{start}treeserve: {signal.Signals(signum).name}: stopping", file=sys.stderr, flush=True)


def _progress_bar_open() -> bool:
    """Whether a tqdm bar is shown and not yet closed (tqdm is not imported for this)."""
    std = sys.modules.get("tqdm.std")
    try:
        return std is not None and any(not bar.disable for bar in list(std.tqdm._instances))
    except (AttributeError, RuntimeError):  # (no bar made yet; the set changing under the signal)
        return False


@contextlib.contextmanager
def signals_between_callbacks(loop):
    """While `loop` runs in the main thread (`bench serve`'s asyncio.run): the SIGTERM and SIGINT
    handlers of `exit_on_signals` run as the loop's callbacks, so their SystemExit surfaces between two
    callbacks, where the runner's cleanup then cancels every task. Raised wherever the main thread
    was, it could land inside a protocol's callback or asyncio's own bookkeeping (a callback half
    scheduled: the cleanup waited for it for ever). Put back as they were on the way out."""
    ours = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)
            if threading.current_thread() is threading.main_thread()}
    ours = {sig: handler for sig, handler in ours.items() if handler in (_exit, _exit_cut_short)}
    for sig, handler in ours.items():
        loop.add_signal_handler(sig, handler, sig, None)
    try:
        yield
    finally:
        for sig, handler in ours.items():
            loop.remove_signal_handler(sig)  # (which puts the default back)
            signal.signal(sig, handler)


def child_env() -> dict[str, str]:
    """The environment for a child that must not outlive this process (see `follow_parent`)."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


def follow_parent() -> None:
    """Where the parent asked for it (`child_env`): on Linux, SIGTERM to this process when the
    parent dies, whatever kills it; if the parent is already gone, exit now."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    die_with_parent()
    if os.getppid() != int(parent):  # it died before the request took effect
        raise SystemExit(0)


def die_with_parent() -> None:
    """On Linux, SIGTERM to this process when its parent dies. Also a `preexec_fn` for a child that
    is not a treeserve command (a peer engine started by `bench sweep`): it outlives the exec. The
    parent must stay alive in the thread that started the child (Linux ties it to that thread)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def exit_now(code: int) -> None:
    """Ends the process with `code` after what Python's own exit does that matters here (other
    non-daemon threads joined, atexit handlers run: logging flushed, multiprocessing's children
    reaped), but without the interpreter's teardown of every module and object, which takes one to
    two seconds with PyTorch loaded: a server stopped for a restart is gone that much sooner. For
    the long-running servers only, whose files are closed by then (`treeserve.cli.run`)."""
    getattr(threading, "_shutdown", lambda: None)()  # what the interpreter's exit does first: executors told to stop, threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


@contextlib.contextmanager
def heap_frozen_while_it_runs():
    """For a command that runs its engines and returns (`search`, `eval`, `run`): the startup heap
    frozen while the command runs, unfrozen after it, so that a caller running the command in its
    own process (tests call `treeserve.cli.main`) can collect the engines' cycles afterwards."""
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def freeze_startup_heap() -> int:
    """Moves every object alive now to the garbage collector's permanent generation (what vLLM's
    engine does once it has started): modules, configs, tokenizers and the engines' Python objects
    live until the process ends, yet each full collection walked all of them. Called by the
    long-running commands once they are built (serve, worker, gateway): `treeserve serve` held
    ~290k such objects, and each full collection stopped its engine loop for up to ~240 ms (the
    longest gap between two streamed tokens; ~64 ms with the heap frozen, docs/BENCHMARKS.md).
    Garbage is collected first, so what building left behind is freed, not kept. Only for a
    process that is the command, not a library call inside someone's program (whose heap it would
    freeze for good). Returns the frozen count."""
    gc.collect()
    gc.freeze()
    count = gc.get_freeze_count()
    logging.getLogger(__name__).info("startup heap frozen: %d objects that full collections skip", count)
    return count
