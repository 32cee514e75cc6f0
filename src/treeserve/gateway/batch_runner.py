"""Running batches: the gateway process that holds a batch's lease sends its pending lines through
the request path (`GatewayService.dispatch`: the key's models, rate limits and budget, routing,
fallbacks), at most `concurrency` lines at once over all batches, each queued on its server behind interactive
requests (`priority` 1), so that batch work takes a bounded share of the backends. A line's answer is written in the transaction that bills it
(gateway/settlement.py), so a process killed at any moment leaves each line answered and billed,
or neither; the process that takes the lease next (another, or this one restarted) runs the lines
that have no answer. A key (or its user) whose spend has reached its budget fails its line with that
error (and so the rest, in turn); a budget filled by what requests in flight hold (their worst cases,
the batch's own lines' among them) waits for them to settle, as a rate limit waits, out of the line's
concurrency slot; no backend able to answer (an outage, a restart) sends the line again later, backing off
from RETRY_DELAY to RETRY_DELAY_MAX, for as long as the batch's completion window lasts (OpenAI's rule:
an outage delays a batch, it does not fail its lines; the window's end fails those still unanswered)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi.responses import Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from treeserve.gateway.accounts import Accounts
from treeserve.gateway.auth import MASTER
from treeserve.gateway.batches import Batches
from treeserve.gateway.errors import BudgetExceeded, GatewayError, LimitExceeded
from treeserve.gateway.http_errors import to_api_error
from treeserve.gateway.keys import KeyRecord
from treeserve.gateway.ledger import Ledger
from treeserve.gateway.response_store import DatabaseResponseStore
from treeserve.gateway.schema import utcnow
from treeserve.gateway.service import GatewayService
from treeserve.wire.errors import APIError, from_validation_error
from treeserve.wire.responses import ResponsesRequest, chat_request
from treeserve.wire.responses_api import previous_not_found

log = logging.getLogger("treeserve.gateway")
RETRY_DELAY = 1.0      # seconds before a line no backend could answer is sent again, doubling with each
RETRY_DELAY_MAX = 30.0  # such answer in a row up to this
HOLD_WAIT = 0.25       # seconds before a line refused for what requests in flight hold of its budget is sent
HOLD_WAIT_MAX = 4.0    # again, doubling with each such refusal in a row up to this
POLL_INTERVAL = 0.5    # seconds between looks for batches to run (and lease renewals)
CHUNK = 4              # lines a batch holds in hand (running, or waiting for a slot), per concurrency slot
# Seconds a running batch trusts its key (blocked, deleted, expired, given a budget or other models) and
# its status (cancelled) before a line reads them again (one primary-key read each)
RECHECK = 0.5
KEY_GONE = {"code": "invalid_api_key", "message": "the batch's key was deleted, blocked or expired", "param": None}
# the error of each line not sent when a batch ends early (cancelled: its lines stay pending)
STOP_ERRORS = {"key_gone": KEY_GONE, "expired": {"code": "batch_expired", "param": None,
                                                 "message": "the batch's completion window ended before this line ran"}}


class LineFailed(Exception):
    """A line that cannot be answered: its error-file entry."""

    def __init__(self, code: str | None, message: str, param: str | None = None):
        super().__init__(message)
        self.error = {"code": code, "message": message, "param": param}


@dataclass
class _Run:
    """A batch being run here: its key and whether it is being cancelled, as last read."""
    batch_id: str
    owner: int | None
    key: KeyRecord | None = None
    cancelling: bool = False
    checked: float = -RECHECK
    stopped: str | None = None  # how it ends, once it must end before its lines are all run


class BatchRunner:
    def __init__(self, batches: Batches, accounts: Accounts, ledger: Ledger, service: GatewayService,
                 responses: DatabaseResponseStore, instance_id: str, concurrency: int = 8,
                 priority: int | None = 1):
        self.batches, self.accounts, self.ledger, self.service = batches, accounts, ledger, service
        self.metrics = service.metrics
        self.responses, self.instance_id, self.priority = responses, instance_id, priority
        self.concurrency, self.slots = concurrency, asyncio.Semaphore(concurrency)
        self.running: dict[str, asyncio.Task] = {}
        self.attempts: dict[tuple[str, int], int] = {}    # (batch, line): sends no backend could answer
        self.hold_waits: dict[tuple[str, int], int] = {}  # (batch, line): refusals for held budget in a row

    async def run(self) -> None:
        """Until cancelled: takes and renews leases, and runs each leased batch in a task of its own."""
        try:
            while True:
                try:
                    leased = await run_in_threadpool(self.batches.claim, self.instance_id)
                except Exception:
                    log.exception("looking for batches to run failed")
                    leased = []
                for batch_id in leased:
                    task = self.running.get(batch_id)
                    if task is None or task.done():
                        self.running[batch_id] = asyncio.create_task(self._guarded(batch_id))
                await asyncio.sleep(POLL_INTERVAL)
        finally:
            tasks = [t for t in self.running.values() if not t.done()]
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*tasks, return_exceptions=True)
                # (settlements written before the lease goes: another process would send their lines again)
                await run_in_threadpool(self.ledger.flush)
                await run_in_threadpool(self.batches.release, list(self.running), self.instance_id)

    async def _guarded(self, batch_id: str) -> None:
        try:
            await self._batch(batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: running it failed; it is taken up again", batch_id)

    async def _batch(self, batch_id: str) -> None:
        """Keeps CHUNK x concurrency of the batch's lines in hand, a new one taken as each ends (a slow
        line holds only its own slot), until none is pending or the batch is cancelled or expires."""
        await run_in_threadpool(self.ledger.flush)  # (this process's settlements of its lines written first)
        state = await run_in_threadpool(self.batches.take_up, batch_id)  # (lines left running here: pending again)
        if state["status"] == "validating":  # (its create call stopped mid-way, its lease expired)
            await run_in_threadpool(self.batches.interrupted, batch_id)
            return
        run, window = _Run(batch_id, state["owner"]), CHUNK * self.concurrency
        log.info("batch %s: %d of %d lines to run", batch_id, state["pending"], state["request_counts"]["total"])
        in_hand: dict[int, asyncio.Task] = {}
        try:
            while run.stopped is None:
                await self._check_stop(run, state["expires"])
                if run.stopped is None and len(in_hand) <= window // 2:  # (read half a window at a time)
                    for line in await run_in_threadpool(self.batches.pending, batch_id, window - len(in_hand),
                                                        set(in_hand)):
                        in_hand[line[0]] = asyncio.create_task(self._line(run, *line))
                if not in_hand:
                    break
                done, _ = await asyncio.wait(in_hand.values(), timeout=RECHECK, return_when=asyncio.FIRST_COMPLETED)
                for number in [n for n, task in in_hand.items() if task in done]:
                    in_hand.pop(number).result()
            await asyncio.gather(*in_hand.values())  # (stopped: those sent end, the others send nothing)
        except BaseException:  # (the gateway stops: what is not answered is run again)
            for task in in_hand.values():
                task.cancel()
            await asyncio.gather(*in_hand.values(), return_exceptions=True)
            raise
        await run_in_threadpool(self.ledger.flush)  # the lines' answers are written with their settlements
        if run.stopped in STOP_ERRORS:  # (after every line in hand has ended: none is sent after this)
            await run_in_threadpool(self.batches.fail_pending, batch_id, STOP_ERRORS[run.stopped])
        ending = {"cancelled": "cancelled", "expired": "expired"}.get(run.stopped, "completed")
        # (a cancel that came after its last line ended: cancelled, not completed)
        ending = await run_in_threadpool(self.batches.finalize, batch_id, ending)
        for counts in (self.attempts, self.hold_waits):  # (of lines that ended unanswered: cancelled, expired)
            for batch_line in [k for k in counts if k[0] == batch_id]:
                del counts[batch_line]
        self.metrics.batches.labels(ending).inc()
        log.info("batch %s: %s", batch_id, ending)

    async def _check_stop(self, run: _Run, expires) -> None:
        """Sets `run.stopped` when the batch must end before its lines are all run: `cancelled`,
        `expired`, or `key_gone`; the lines not sent then fail with its error (STOP_ERRORS) once
        those in hand have ended."""
        await self._recheck(run)
        if run.cancelling:
            run.stopped = "cancelled"
        elif run.key is None:
            run.stopped = "key_gone"
        elif utcnow() >= expires:
            run.stopped = "expired"

    async def _line(self, run: _Run, line: int, custom_id: str, endpoint: str, body: dict) -> None:
        """The line sent once (it stays pending to be sent again, when it must wait); an error of the
        gateway's own (its database, say) is logged and leaves the line to be taken up again."""
        try:
            async with self.slots:
                await self._recheck(run)  # (a slot may have taken a while: the key and the batch as they are now)
                if run.cancelling or run.key is None or run.stopped is not None:
                    return  # nothing new starts once the batch is ending (the line stays pending)
                delay = await self._send_line(run.batch_id, run.key, line, custom_id, endpoint, body)
            deadline = time.monotonic() + delay  # (out of its slot: other lines, and other batches, run meanwhile)
            while time.monotonic() < deadline and run.stopped is None and not run.cancelling:
                await asyncio.sleep(min(RECHECK, deadline - time.monotonic()))
        except Exception:
            log.exception("batch %s line %d (%s): sending it failed; it is taken up again", run.batch_id, line,
                          custom_id)
            with contextlib.suppress(Exception):
                await run_in_threadpool(self.batches.mark, run.batch_id, line, "pending")

    async def _recheck(self, run: _Run) -> None:
        """The batch's key and status read again, if RECHECK seconds have passed."""
        started = time.monotonic()
        if started - run.checked < RECHECK:
            return
        run.checked = started  # (the lines waiting meanwhile use what is read now)

        def read() -> tuple[str, KeyRecord | None]:
            key = MASTER if run.owner is None else self.accounts.key_record(run.owner)
            return self.batches.status(run.batch_id), key
        status, run.key = await run_in_threadpool(read)
        run.cancelling = status == "cancelling"

    async def _send_line(self, batch_id: str, key: KeyRecord, line: int, custom_id: str, endpoint: str,
                         body: dict) -> float:
        """Sends the line once; the seconds to wait before it is sent again (0: it ended, answered or failed)."""
        request_id = f"{batch_id}-{line}-{uuid.uuid4().hex[:8]}"
        if not await run_in_threadpool(self.batches.mark, batch_id, line, "running", request_id):
            return 0.0  # no longer pending (failed meanwhile, or another process runs it): not sent
        try:
            response = await self._send(endpoint, body, key, (batch_id, line), request_id)
        except LimitExceeded as exc:  # the key's rate or parallel limit: wait, then run it again
            return await self._requeue(batch_id, line, exc.retry_after)
        except (GatewayError, APIError, LineFailed) as exc:
            if isinstance(exc, BudgetExceeded) and not exc.spent:
                # held by requests in flight (the batch's own lines among them): what they leave comes back
                return await self._requeue(batch_id, line, self._hold_delay((batch_id, line)))
            self.metrics.batch_lines.labels("refused").inc()
            await run_in_threadpool(self.batches.mark, batch_id, line, "failed", request_id, _error(exc))
            return self._ended((batch_id, line))
        except Exception as exc:
            log.exception("batch %s line %d (%s) failed", batch_id, line, custom_id)
            response = _unanswered(exc)
        if response.status_code in (429, 503):  # no backend could answer: nothing was billed or written
            self.metrics.batch_lines.labels("retried").inc()
            return await self._again(batch_id, line, response)
        self.metrics.batch_lines.labels("answered").inc()
        return self._ended((batch_id, line))

    async def _requeue(self, batch_id: str, line: int, seconds: float) -> float:
        self.metrics.batch_lines.labels("waited").inc()
        await run_in_threadpool(self.batches.mark, batch_id, line, "pending")
        return seconds

    def _hold_delay(self, batch_line: tuple[str, int]) -> float:
        """HOLD_WAIT, doubling with each refusal of the line in a row, up to HOLD_WAIT_MAX."""
        waits = self.hold_waits[batch_line] = self.hold_waits.get(batch_line, 0) + 1
        return min(HOLD_WAIT * 2 ** (waits - 1), HOLD_WAIT_MAX)

    def _ended(self, batch_line: tuple[str, int]) -> float:
        self.attempts.pop(batch_line, None)
        self.hold_waits.pop(batch_line, None)
        return 0.0

    async def _send(self, endpoint: str, body: dict, key: KeyRecord, batch_line: tuple[str, int],
                    request_id: str) -> Response:
        if endpoint == "/v1/search":  # (a search is background work on its server already)
            return await self.service.dispatch(endpoint, body, key, batch_line, request_id)
        if endpoint != "/v1/responses":
            return await self.service.dispatch(endpoint, self._background(body), key, batch_line, request_id)
        try:
            request = ResponsesRequest.model_validate(body)
        except ValidationError as exc:
            error = from_validation_error(exc)
            raise LineFailed(error.code, error.message, error.param) from None
        if request.conversation is not None:  # (a line's response would be appended in no set order)
            raise LineFailed("unsupported_parameter", "conversation: not supported in a batch; use "
                             "previous_response_id, or send the conversation's items", "conversation")
        history = []
        if request.previous_response_id is not None:
            previous = await self.responses.get(request.previous_response_id, key.id)
            if previous is None:
                error = previous_not_found(request.previous_response_id)
                raise LineFailed(error.code, error.message, error.param)
            history = previous.history
        try:
            chat = chat_request(request, history) | {"model": request.model}
        except ValueError as exc:
            raise LineFailed("invalid_value", str(exc), getattr(exc, "param", None)) from None
        return await self.service.dispatch("/v1/chat/completions", self._background(chat), key, batch_line,
                                           request_id)

    def _background(self, body: dict) -> dict:
        """The line's request queued behind interactive ones on its server (`priority`, unless the
        line sets its own or the gateway is configured without: `batch_priority: null`)."""
        return body if self.priority is None or "priority" in body else body | {"priority": self.priority}

    async def _again(self, batch_id: str, line: int, response: Response) -> float:
        """The line pending again, to be sent after a delay that doubles with each attempt no backend answered."""
        attempts = self.attempts[(batch_id, line)] = self.attempts.get((batch_id, line), 0) + 1
        delay = min(RETRY_DELAY * 2 ** (attempts - 1), RETRY_DELAY_MAX)
        if attempts & (attempts - 1) == 0:  # (the 1st, 2nd, 4th, 8th ... time: a log line, not one a retry)
            log.warning("batch %s line %d: no backend could answer (HTTP %d, %d times in a row); sent again in %.0f s",
                        batch_id, line, response.status_code, attempts, delay)
        await run_in_threadpool(self.batches.mark, batch_id, line, "pending")
        return delay


def _error(exc: Exception) -> dict:
    if isinstance(exc, LineFailed):
        return exc.error
    error = to_api_error(exc) if isinstance(exc, GatewayError) else exc
    return {"code": error.code, "message": error.message, "param": error.param}


def _unanswered(exc: Exception) -> Response:
    return Response(status_code=503, content=f"{type(exc).__name__}: {exc}".encode())
