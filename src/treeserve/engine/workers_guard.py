"""What stopped an engine, kept: with tensor parallelism, an error while the ranks work together
becomes the error of the worker that caused it (`WorkerDiedError`, naming the rank), and every
later step raises it again."""
from __future__ import annotations


class WorkersGuard:
    def __init__(self, executor=None):
        self.executor = executor
        self.failed: BaseException | None = None

    def __enter__(self) -> None:
        if self.failed is not None:
            raise self.failed

    def __exit__(self, kind, exc, traceback) -> bool:
        if exc is None or self.executor is None or not isinstance(exc, Exception):
            return False
        self.failed = self.executor.failure(exc)
        if self.failed is exc:
            return False
        raise self.failed from exc

    def check(self) -> None:
        """Raises the error that stopped the engine, or a worker's death (checked while idle too,
        so a server's /health turns 503 without waiting for a request)."""
        if self.failed is not None:
            raise self.failed
        if self.executor is not None:
            try:
                self.executor.check()
            except Exception as exc:
                self.failed = exc
                raise
