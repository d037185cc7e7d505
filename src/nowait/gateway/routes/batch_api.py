"""The OpenAI Files and Batch APIs over the gateway's SQLite store:

    POST /v1/files, GET /v1/files[/{id}[/content]], DELETE /v1/files/{id}
    POST /v1/batches, GET /v1/batches[/{id}], POST /v1/batches/{id}/cancel

The store is synchronous (sqlite3), so each call runs in a thread off the event loop. Every
object belongs to the caller's tenant: another tenant's id answers exactly as an id that does
not exist (404; never 403, which would tell that it exists), and lists show the caller's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal, TypeVar

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response

from nowait.gateway.batches import BATCH_ENDPOINTS, COMPLETION_WINDOWS, BatchOwner
from nowait.gateway.config import BatchConfig
from nowait.gateway.errors import APIError, bad_request
from nowait.gateway.schemas import Batch, BatchCreateRequest, BatchList, FileDeleted, FileList, FileObject
from nowait.gateway.service import gateway_of
from nowait.gateway.tenants import caller_in

T = TypeVar("T")

FILE_PURPOSES = ("batch", "batch_output", "user_data", "assistants", "fine-tune", "vision")
FilePurpose = Literal["batch", "batch_output", "user_data", "assistants", "fine-tune", "vision"]
# OpenAI's bounds for the list pages; an unbounded `limit` reached SQLite as an integer it
# cannot hold (OverflowError, a 500). Ids are short: a longer `after` cannot name an object.
MAX_FILES_PAGE = 10000
MAX_BATCHES_PAGE = 100
MAX_ID_CHARS = 64

router = APIRouter()


def tenant_of(request: Request) -> str:
    return caller_in(request.scope).tenant


def not_found(what: str, object_id: str, param: str) -> APIError:
    """The one 404 for an id the caller cannot see: unknown and another tenant's read the same,
    code `not_found` for files and batches alike, so the answer never confirms that it exists."""
    return APIError(404, f"No such {what} object: {object_id}", param=param, code="not_found")


async def stored(lookup: Callable[[str, str], T | None], object_id: str, tenant: str, what: str, param: str) -> T:
    """The caller's stored object `lookup` finds, or the 404 for an id it cannot see."""
    found = await asyncio.to_thread(lookup, object_id, tenant)
    if found is None:
        raise not_found(what, object_id, param)
    return found


async def existing_file(request: Request, file_id: str) -> FileObject:
    return await stored(gateway_of(request).store.get_file, file_id, tenant_of(request), "File", "file_id")


async def existing_batch(request: Request, batch_id: str) -> Batch:
    return await stored(gateway_of(request).store.get_batch, batch_id, tenant_of(request), "Batch", "batch_id")


# --- files ---

def check_batch_file_size(content: bytes, limits: BatchConfig) -> None:
    """OpenAI's bounds on a batch input file, checked when it is uploaded, before it is stored."""
    if len(content) > limits.max_file_bytes:
        raise bad_request(f"a batch input file may hold at most {limits.max_file_bytes} bytes; this one has "
                          f"{len(content)} (batches.max_file_bytes)", param="file", code="batch_file_too_large")
    lines = sum(1 for line in content.splitlines() if line.strip())
    if lines > limits.max_file_lines:
        raise bad_request(f"a batch input file may hold at most {limits.max_file_lines} requests; this one has "
                          f"{lines} (batches.max_file_lines)", param="file", code="batch_file_too_many_lines")


@router.post("/v1/files")
async def upload_file(request: Request, file: UploadFile = File(...), purpose: FilePurpose = Form(...)) -> dict:
    # The purposes are a Literal so the OpenAPI document lists them; the check below keeps the
    # message naming them all.
    if purpose not in FILE_PURPOSES:
        raise bad_request(f"purpose must be one of {', '.join(FILE_PURPOSES)}, got {purpose!r}", param="purpose")
    content = await file.read()
    if purpose == "batch":
        check_batch_file_size(content, gateway_of(request).config.batches)
    store = gateway_of(request).store
    created = await asyncio.to_thread(store.create_file, file.filename or "upload.jsonl", purpose, content,
                                      tenant=tenant_of(request))
    return created.model_dump()


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = Query(None, max_length=MAX_ID_CHARS),
                     limit: int = Query(MAX_FILES_PAGE, ge=1, le=MAX_FILES_PAGE)) -> dict:
    files = await asyncio.to_thread(gateway_of(request).store.list_files, purpose, limit, tenant_of(request))
    return FileList(data=files).model_dump()


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, request: Request) -> dict:
    return (await existing_file(request, file_id)).model_dump()


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    await existing_file(request, file_id)
    content = await asyncio.to_thread(gateway_of(request).store.file_content, file_id, tenant_of(request))
    if content is None:  # deleted meanwhile
        raise not_found("File", file_id, "file_id")
    return Response(content, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict:
    await existing_file(request, file_id)
    deleted = await asyncio.to_thread(gateway_of(request).store.delete_file, file_id, tenant_of(request))
    return FileDeleted(id=file_id, deleted=deleted).model_dump()


# --- batches ---

@router.post("/v1/batches")
async def create_batch(body: BatchCreateRequest, request: Request) -> dict:
    gateway = gateway_of(request)
    if body.endpoint not in BATCH_ENDPOINTS:
        raise bad_request(f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {body.endpoint!r}",
                          param="endpoint", code="unsupported_endpoint")
    if body.completion_window not in COMPLETION_WINDOWS:
        raise bad_request(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}",
                          param="completion_window")
    caller = caller_in(request.scope)
    # Another tenant's file is answered as a missing one: a batch names only its caller's files.
    found = await asyncio.to_thread(gateway.store.get_file, body.input_file_id, caller.tenant)
    if found is None:
        raise bad_request(f"input_file_id {body.input_file_id!r}: no such file", param="input_file_id",
                          code="invalid_input_file")
    if found.purpose != "batch":
        raise bad_request(f"input_file_id {body.input_file_id!r} was uploaded with purpose {found.purpose!r}; "
                          "a batch needs purpose 'batch'", param="input_file_id", code="invalid_input_file")
    # Committed before we answer: an accepted batch is on disk (batches.py, rule 1).
    batch = await asyncio.to_thread(gateway.store.create_batch, body.input_file_id, body.endpoint,
                                    body.completion_window, body.metadata, BatchOwner(caller.tenant, caller.key_id))
    gateway.runner.wake()
    return batch.model_dump()


@router.get("/v1/batches")
async def list_batches(request: Request, limit: int = Query(20, ge=1, le=MAX_BATCHES_PAGE),
                       after: str | None = Query(None, max_length=MAX_ID_CHARS)) -> dict:
    store = gateway_of(request).store
    batches = await asyncio.to_thread(store.list_batches, limit + 1, after, tenant_of(request))
    page = batches[:limit]
    return BatchList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                     has_more=len(batches) > limit).model_dump()


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, request: Request) -> dict:
    return (await existing_batch(request, batch_id)).model_dump()


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict:
    gateway = gateway_of(request)
    batch = await existing_batch(request, batch_id)
    if batch.status in ("cancelling", "cancelled"):
        return batch.model_dump()
    if not await asyncio.to_thread(gateway.store.request_cancel, batch_id, tenant_of(request)):
        raise APIError(409, f"batch {batch_id} is {batch.status}; only a validating or in-progress batch can "
                            "be cancelled", param="batch_id", code="batch_not_cancellable")
    gateway.runner.wake()
    return (await existing_batch(request, batch_id)).model_dump()
