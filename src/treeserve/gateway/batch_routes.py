"""OpenAI's Files and Batch APIs on the gateway: `/v1/files` (upload JSONL with purpose `batch`,
list, retrieve, content, delete) and `/v1/batches` (create, retrieve, list, cancel), per key. The
batches themselves run in the background (gateway/batch_runner.py)."""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, File, Form, Query, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, field_validator
from starlette.concurrency import run_in_threadpool

from treeserve.gateway.auth import Auth
from treeserve.gateway.batches import Batches
from treeserve.gateway.fields import NO_NUL, PathId, Text
from treeserve.gateway.files import LISTED, MAX_FILE_BYTES, PURPOSES, Files
from treeserve.gateway.keys import KeyRecord
from treeserve.wire.errors import APIError


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    input_file_id: Text
    endpoint: Text
    completion_window: Text  # (required, as OpenAI's: a 400 naming it when missing)
    metadata: dict[Text, Text] | None = None

    @field_validator("metadata")
    @classmethod
    def _openai_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's limits: at most 16 pairs, keys of at most 64 characters, values of at most 512."""
        if metadata is not None and (len(metadata) > 16
                                     or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())):
            raise ValueError("at most 16 pairs, keys of at most 64 characters and values of at most 512")
        return metadata


def batch_routes(files: Files, batches: Batches, auth: Auth) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/files")
    async def upload(file: UploadFile = File(...), purpose: str = Form(...),
                     key: KeyRecord = Depends(auth.require_key)):
        if purpose not in PURPOSES:
            raise APIError(400, f"purpose: only {', '.join(PURPOSES)} files are taken here, got {purpose!r}",
                           param="purpose")
        content = await file.read(MAX_FILE_BYTES + 1)
        if len(content) > MAX_FILE_BYTES:
            raise APIError(413, f"file: larger than {MAX_FILE_BYTES} bytes", param="file", code="file_too_large")
        filename = (file.filename or "upload.jsonl").replace("\x00", "")
        return await run_in_threadpool(files.create, key.id, purpose, filename, content)

    @routes.get("/v1/files")
    async def list_files(purpose: str | None = Query(None, max_length=32, pattern=NO_NUL),
                         after: str | None = Query(None, max_length=64, pattern=NO_NUL),
                         limit: int = Query(LISTED, ge=1, le=LISTED), order: Literal["asc", "desc"] = "desc",
                         key: KeyRecord = Depends(auth.require_key)):
        return await run_in_threadpool(files.list, key.id, purpose, after, limit, order)

    @routes.get("/v1/files/{file_id}")
    async def get_file(file_id: PathId, key: KeyRecord = Depends(auth.require_key)):
        return await run_in_threadpool(files.get, file_id, key.id)

    @routes.get("/v1/files/{file_id}/content", response_class=Response,
                responses={200: {"description": "the file's bytes (JSONL)", "content": {"application/jsonl": {}}}})
    async def file_content(file_id: PathId, key: KeyRecord = Depends(auth.require_key)):
        return Response(await run_in_threadpool(files.content, file_id, key.id), media_type="application/jsonl")

    @routes.delete("/v1/files/{file_id}")
    async def delete_file(file_id: PathId, key: KeyRecord = Depends(auth.require_key)):
        return await run_in_threadpool(files.delete, file_id, key.id)

    @routes.post("/v1/batches")
    async def create_batch(body: BatchCreateRequest, key: KeyRecord = Depends(auth.require_key)):
        return await run_in_threadpool(batches.create, key.id, body.input_file_id, body.endpoint,
                                       body.completion_window, body.metadata)

    @routes.get("/v1/batches")
    async def list_batches(after: str | None = Query(None, max_length=64, pattern=NO_NUL),
                           limit: int = Query(20, ge=1, le=100), key: KeyRecord = Depends(auth.require_key)):
        return await run_in_threadpool(batches.list, key.id, after, limit)

    @routes.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: PathId, key: KeyRecord = Depends(auth.require_key)):
        return await run_in_threadpool(batches.get, batch_id, key.id)

    @routes.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: PathId, key: KeyRecord = Depends(auth.require_key)):
        return await run_in_threadpool(batches.cancel, batch_id, key.id)

    return routes
