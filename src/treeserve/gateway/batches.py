"""The Batch API's rows: a batch, read from an uploaded JSONL file into one row per request line
(`validating` while it is read); the lease under which one gateway process runs it (`in_progress`);
its lines' states; and, once every line has an answer, its output and error files (`finalizing`
while they are written, then `completed`; or `cancelled`, `expired`). Counts are always read from
the lines, so they cannot drift from them. Calls are blocking: the routes and the runner run them in worker threads."""
from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import uuid

from sqlalchemy import and_, case, func, insert, or_, select, update

from treeserve import jsonl
from treeserve.errors import ParamError
from treeserve.gateway import batch_file
from treeserve.gateway.batch_file import ENDPOINTS
from treeserve.gateway.database import Database
from treeserve.gateway.errors import BatchConflict, BatchNotFound
from treeserve.gateway.files import Files, page, past
from treeserve.gateway.schema import Batch, BatchLine, aware, utcnow
from treeserve.wire.responses import ResponsesRequest, from_chat, new_id, skeleton

log = logging.getLogger("treeserve.gateway")
COMPLETION_WINDOWS = {"24h": dt.timedelta(hours=24)}
LEASE = dt.timedelta(seconds=10)  # a process that stops renewing its lease for this long leaves its batches
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
VALIDATING = "validating"  # the lease owner of a batch whose create call is reading its file
# a create call renews its lease on the batch it validates every third of this (however long its file
# takes to read); one that has not renewed it for this long (its gateway killed) left it
VALIDATION_LEASE = dt.timedelta(seconds=60)
LISTED = 100


def _mine(batch_id: str, owner: int | None):
    return and_(Batch.id == batch_id, Batch.api_key_id.is_(None) if owner is None else Batch.api_key_id == owner)


def _stamp(value: dt.datetime | None) -> int | None:
    return int(aware(value).timestamp()) if value is not None else None


class Batches:
    def __init__(self, db: Database, files: Files):
        self.db, self.files = db, files

    # ---- the API -----------------------------------------------------------------------------
    def create(self, owner: int | None, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict | None) -> dict:
        """The batch, `validating` (visible to list and retrieve) while its file's lines are read,
        then `in_progress` with them, or `failed` with their errors (OpenAI's: created, then failed)."""
        if endpoint not in ENDPOINTS:
            raise ParamError("endpoint", f"must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
        if completion_window not in COMPLETION_WINDOWS:
            raise ParamError("completion_window", f"must be one of {', '.join(COMPLETION_WINDOWS)}, "
                                                  f"got {completion_window!r}")
        if self.files.get(input_file_id, owner, "input_file_id")["purpose"] != "batch":
            raise ParamError("input_file_id", "the file's purpose must be batch")
        now, batch_id = utcnow(), f"batch_{uuid.uuid4().hex}"
        with self.db.transaction() as conn:  # (leased while this call validates it: see `validate`)
            conn.execute(insert(Batch).values(
                id=batch_id, api_key_id=owner, endpoint=endpoint, input_file_id=input_file_id,
                completion_window=completion_window, total=0, extra=metadata, created_at=now, status="validating",
                expires_at=now + COMPLETION_WINDOWS[completion_window], lease_owner=VALIDATING,
                lease_expires=now + VALIDATION_LEASE))
        try:
            with self._renewing(batch_id):
                self.validate(batch_id)
        except BaseException:
            self.interrupted(batch_id)
            raise
        return self.get(batch_id, owner)

    @contextlib.contextmanager
    def _renewing(self, batch_id: str):
        """The create call's validation lease renewed (a heartbeat thread) while the body runs: a file
        that takes longer than VALIDATION_LEASE to read is not taken for an interrupted create."""
        lease, stop = VALIDATION_LEASE, threading.Event()

        def renew() -> None:
            while not stop.wait(lease.total_seconds() / 3):
                try:
                    with self.db.transaction() as conn:
                        conn.execute(update(Batch).where(Batch.id == batch_id, Batch.lease_owner == VALIDATING)
                                     .values(lease_expires=utcnow() + lease))
                except Exception:  # (the next beat tries again; the lease lapses only after three missed)
                    log.exception("batch %s: renewing its validation lease failed", batch_id)
        beat = threading.Thread(target=renew, name=f"validating {batch_id}", daemon=True)
        beat.start()
        try:
            yield
        finally:
            stop.set()
            beat.join()

    def validate(self, batch_id: str) -> None:
        """Reads a `validating` batch's input file: the batch goes `in_progress` with its lines, or
        `failed` with their errors, its lease free for a runner. Only a batch still validating
        changes (a cancel may have come meanwhile: the runner ends it)."""
        with self.db.session() as conn:
            batch = conn.execute(select(Batch).where(Batch.id == batch_id)).scalar()
        if batch is None or batch.status != "validating":  # (its key deleted meanwhile; cancelled)
            self._end_validation_lease(batch_id)  # (a runner ends a cancelled one now, not once the lease lapses)
            return
        found = batch_file.read(self.files.content(batch.input_file_id, batch.api_key_id, "input_file_id"),
                                batch.endpoint)
        now = utcnow()
        started = {"status": "in_progress", "in_progress_at": now, "model": _one_model(found.lines)} \
            if not found.errors else \
            {"status": "failed", "failed_at": now, "errors": found.errors}
        with self.db.transaction() as conn:
            moved = conn.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "validating").values(
                total=len(found.lines), lease_owner=None, lease_expires=None, **started)).rowcount
            if moved and found.lines:
                conn.execute(insert(BatchLine.__table__), [
                    dict(batch_id=batch_id, line=i, custom_id=custom_id, url=url, body=body, status="pending")
                    for i, (custom_id, url, body) in enumerate(found.lines)])
        if not moved:
            self._end_validation_lease(batch_id)

    def _end_validation_lease(self, batch_id: str) -> None:
        """The create call's lease on a batch no longer validating given up: a runner takes it at once."""
        with self.db.transaction() as conn:
            conn.execute(update(Batch).where(Batch.id == batch_id, Batch.lease_owner == VALIDATING)
                         .values(lease_owner=None, lease_expires=None))

    def interrupted(self, batch_id: str) -> None:
        """A batch whose create call stopped while reading its file (an error; the gateway killed: the
        runner that takes its lease calls this) ends `failed`, none of its lines run: its creator
        got no answer naming it and may well have created it again."""
        error = batch_file.error("validation_interrupted", "the gateway stopped while reading the batch's input "
                                 "file; no line was run: create the batch again", "input_file_id")
        with self.db.transaction() as conn:
            conn.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "validating").values(
                status="failed", failed_at=utcnow(), errors=[error], lease_owner=None, lease_expires=None))

    def get(self, batch_id: str, owner: int | None) -> dict:
        with self.db.session() as conn:
            batch = conn.execute(select(Batch).where(_mine(batch_id, owner))).scalar()
            if batch is None:
                raise BatchNotFound(batch_id)
            return self._object(conn, batch)

    def list(self, owner: int | None, after: str | None = None, limit: int = 20) -> dict:
        limit = max(1, min(limit, LISTED))
        query = select(Batch).where(Batch.api_key_id.is_(None) if owner is None else Batch.api_key_id == owner)
        with self.db.session() as conn:
            if after is not None:
                anchor = conn.execute(select(Batch.created_at, Batch.id).where(_mine(after, owner))).first()
                if anchor is None:
                    raise BatchNotFound(after, "after")
                query = query.where(past(Batch.created_at, Batch.id, anchor))
            batches = conn.execute(query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)).scalars()
            data = [self._object(conn, b) for b in list(batches)]
        return page(data, limit)

    def cancel(self, batch_id: str, owner: int | None) -> dict:
        with self.db.transaction() as conn:
            status = conn.scalar(select(Batch.status).where(_mine(batch_id, owner)))
            if status is None:
                raise BatchNotFound(batch_id)
            if status in ("validating", "in_progress"):
                conn.execute(update(Batch).where(Batch.id == batch_id)
                             .values(status="cancelling", cancelling_at=utcnow()))
            elif status not in ("cancelling", "cancelled"):
                raise BatchConflict(f"batch_id: the batch is {status}; only a batch in progress can be cancelled",
                                    "batch_id")
        return self.get(batch_id, owner)

    # ---- the runner's ------------------------------------------------------------------------
    def claim(self, instance_id: str) -> list[str]:
        """The batches this process runs now: those it leases already (renewed), and those whose
        lease is free or expired (taken; their lines left running by a process that died go back
        to pending: an answer is written with its spend row, so a running line has neither)."""
        now = utcnow()
        free = or_(Batch.lease_owner.is_(None), Batch.lease_expires < now, Batch.lease_owner == instance_id)
        with self.db.session() as conn:  # a read first: a gateway with no batch to run writes nothing
            if conn.execute(select(Batch.id).where(Batch.status.in_(ACTIVE), free).limit(1)).first() is None:
                return []
        leased, taken = [], []
        with self.db.transaction() as conn:
            rows = conn.execute(select(Batch.id, Batch.lease_owner).where(Batch.status.in_(ACTIVE), free)).all()
            for row in rows:  # each a conditional update: of two processes after one batch, one gets it
                if conn.execute(update(Batch).where(Batch.id == row.id, free)
                                .values(lease_owner=instance_id, lease_expires=now + LEASE)).rowcount:
                    leased.append(row.id)
                    if row.lease_owner != instance_id:
                        taken.append(row.id)
            if taken:
                _running_to_pending(conn, taken)
        return leased

    def release(self, batch_ids: list[str], instance_id: str) -> None:
        """Gives up this process's leases (it is stopping): another process takes them at once."""
        if batch_ids:
            with self.db.transaction() as conn:
                conn.execute(update(Batch).where(Batch.id.in_(batch_ids), Batch.lease_owner == instance_id)
                             .values(lease_owner=None, lease_expires=None))

    def take_up(self, batch_id: str) -> dict:
        """The batch's row (as the API shows it, plus its owner, expiry and pending lines' count), as
        this process starts running it, with the lines it left running (a run of it here that failed,
        its settlements written since: an answered line is done) pending again."""
        with self.db.transaction() as conn:
            _running_to_pending(conn, [batch_id])
            batch = conn.execute(select(Batch).where(Batch.id == batch_id)).scalar()
            pending = conn.scalar(select(func.count()).select_from(BatchLine)
                                  .where(BatchLine.batch_id == batch_id, BatchLine.status == "pending"))
            return self._object(conn, batch) | {"owner": batch.api_key_id, "expires": aware(batch.expires_at),
                                                "pending": pending}

    def pending(self, batch_id: str, limit: int, skip: set[int] = frozenset()) -> list[tuple[int, str, str, dict]]:
        """Up to `limit` of the batch's pending lines, in line order, but those in `skip` (in hand already)."""
        with self.db.session() as conn:
            rows = conn.execute(select(BatchLine.line, BatchLine.custom_id, BatchLine.url, BatchLine.body)
                                .where(BatchLine.batch_id == batch_id, BatchLine.status == "pending",
                                       BatchLine.line.not_in(skip) if skip else True)
                                .order_by(BatchLine.line).limit(limit)).all()
        return [tuple(row) for row in rows]

    def status(self, batch_id: str) -> str | None:
        with self.db.session() as conn:
            return conn.scalar(select(Batch.status).where(Batch.id == batch_id))

    def mark(self, batch_id: str, line: int, status: str, request_id: str | None = None,
             error: dict | None = None) -> bool:
        """A line's state: running (its request sent: only a pending line), pending (to run again),
        failed (with its error). False when the line was in no state to take it."""
        before = ("pending",) if status == "running" else ("pending", "running")
        with self.db.transaction() as conn:
            return bool(conn.execute(update(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.line == line,
                                                             BatchLine.status.in_(before))
                                     .values(status=status, request_id=request_id, error=error)).rowcount)

    def fail_pending(self, batch_id: str, error: dict) -> None:
        with self.db.transaction() as conn:
            conn.execute(update(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.status == "pending")
                         .values(status="failed", error=error))

    def finalize(self, batch_id: str, ending: str = "completed") -> str:
        """Ends the batch (`completed`, `cancelled` or `expired`) with its output file (answers with
        status 200) and error file (the rest), in line order, written in the transaction that ends
        it. A batch completing is `finalizing` meanwhile; one cancelled since its last line ended
        ends `cancelled`. The status it ended with."""
        if ending == "completed":
            ending = self._finalizing(batch_id)
        with self.db.session() as conn:
            batch = conn.execute(select(Batch).where(Batch.id == batch_id)).scalar()
            lines = conn.execute(select(BatchLine).where(BatchLine.batch_id == batch_id,
                                                         BatchLine.status.in_(("done", "failed")))
                                 .order_by(BatchLine.line)).scalars().all()
        output, errors, unreadable = self._records(lines)
        now = utcnow()
        stamps = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}
        with self.db.transaction() as conn:
            files = {name: self.files.insert(conn, batch.api_key_id, "batch_output", f"{batch_id}_{name}.jsonl",
                                             jsonl.dumps(records).encode())["id"]
                     for name, records in (("output", output), ("error", errors)) if records}
            for number, error in unreadable.items():  # (counted as failed, as the error file has them)
                conn.execute(update(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.line == number)
                             .values(status="failed", error=error))
            conn.execute(update(Batch).where(Batch.id == batch_id).values(
                status=ending, output_file_id=files.get("output"), error_file_id=files.get("error"),
                lease_owner=None, lease_expires=None, **{stamps[ending]: now}))
        return ending

    def _finalizing(self, batch_id: str) -> str:
        """The batch `finalizing` (from `in_progress`; one taken up after a restart may be so already),
        and so `completed` next; or `cancelled` next, when a cancel came after its last line ended."""
        with self.db.transaction() as conn:
            if conn.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "in_progress")
                            .values(status="finalizing", finalizing_at=utcnow())).rowcount:
                return "completed"
            status = conn.scalar(select(Batch.status).where(Batch.id == batch_id))
        return "cancelled" if status == "cancelling" else "completed"

    @staticmethod
    def _records(lines: list[BatchLine]) -> tuple[list[dict], list[dict], dict[int, dict]]:
        """The output file's records, the error file's, and the errors of answered lines whose answer
        cannot be written (by line number)."""
        output, errors, unreadable = [], [], {}
        for line in lines:
            record = _output_line(line)
            if record["error"] is not None and line.status == "done":
                unreadable[line.line] = record["error"]
            (output if line.status == "done" and line.status_code == 200 and line.line not in unreadable
             else errors).append(record)
        return output, errors, unreadable

    # ---- helpers -----------------------------------------------------------------------------
    def _object(self, conn, batch: Batch) -> dict:
        done = case((and_(BatchLine.status == "done", BatchLine.status_code == 200), 1), else_=0)
        failed = case((or_(BatchLine.status == "failed",
                           and_(BatchLine.status == "done", BatchLine.status_code != 200)), 1), else_=0)
        sums = conn.execute(select(*(func.coalesce(func.sum(c), 0) for c in (
            done, failed, BatchLine.input_tokens, BatchLine.cached_tokens, BatchLine.output_tokens,
            BatchLine.reasoning_tokens))).where(BatchLine.batch_id == batch.id)).one()
        completed, failures, input_tokens, cached, output_tokens, reasoning = map(int, sums)
        return {"id": batch.id, "object": "batch", "endpoint": batch.endpoint,
                "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
                "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
                "status": batch.status, "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
                "created_at": _stamp(batch.created_at), "in_progress_at": _stamp(batch.in_progress_at),
                "expires_at": _stamp(batch.expires_at), "finalizing_at": _stamp(batch.finalizing_at),
                "completed_at": _stamp(batch.completed_at), "failed_at": _stamp(batch.failed_at),
                "expired_at": _stamp(batch.expired_at),
                "cancelling_at": _stamp(batch.cancelling_at), "cancelled_at": _stamp(batch.cancelled_at),
                "request_counts": {"total": batch.total, "completed": completed, "failed": failures},
                "metadata": batch.extra, "model": batch.model,
                "usage": {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
                          "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
                          "total_tokens": input_tokens + output_tokens}}


def _running_to_pending(conn, batch_ids: list[str]) -> None:
    """The batches' running lines pending again, locked by (batch, line) first: a settlement batch writes
    its lines' answers in that order (settlement.apply_settlements). An UPDATE alone took them in the
    order it found them, and deadlocked with a settlement answering two of them in the other order."""
    running = BatchLine.batch_id.in_(batch_ids) & (BatchLine.status == "running")
    conn.execute(select(BatchLine.line).where(running).order_by(BatchLine.batch_id, BatchLine.line)
                 .with_for_update()).all()
    conn.execute(update(BatchLine).where(running).values(status="pending"))


def _one_model(lines: list[tuple]) -> str | None:
    """The model every line names; None where they name several, or one no served model's name is
    (longer than the column holds, or with a NUL, which PostgreSQL's text refuses: each line is
    answered with its 404, and the batch is not refused for it)."""
    models = {body["model"] for _, _, body in lines}
    model = models.pop() if len(models) == 1 else None
    return model if model is not None and len(model) <= Batch.model.type.length and "\x00" not in model else None


def _output_line(line: BatchLine) -> dict:
    """OpenAI's output-file record of a line: its response (status, request id, body), or its error."""
    record = {"id": f"batch_req_{uuid.uuid5(uuid.NAMESPACE_OID, f'{line.batch_id}/{line.line}').hex}",
              "custom_id": line.custom_id, "response": None, "error": line.error}
    if line.status == "done":
        body = line.response
        if line.url == "/v1/responses" and line.status_code == 200:
            try:
                request = ResponsesRequest.model_validate(line.body)
                body = from_chat(skeleton(request, new_id("resp"), request.model or ""), body)
            except (ValueError, LookupError, TypeError, AttributeError) as exc:  # (a backend's answer of no chat)
                record["error"] = {"code": "invalid_backend_response", "param": None,
                                   "message": f"the backend's answer is not a chat completion ({type(exc).__name__}: "
                                              f"{exc}); its request id is {line.request_id}"}
                return record
        record["response"] = {"status_code": line.status_code, "request_id": line.request_id, "body": body}
    return record
