"""The OpenAPI document the gateway serves at /openapi.json, completed from the same pydantic
models the routes validate with and answer in.

FastAPI writes the request bodies and parameters; this module adds what it cannot see, because
the handlers return plain dicts and answer errors through `errors.py`: the 200 bodies (OpenAI's
objects, the stream as `text/event-stream`), the error object for every status an operation can
answer (in place of FastAPI's 422, which the gateway never sends: validation is a 400), the bearer
key, unique operation ids, and the links that tie an uploaded file to the batch that reads it and
a batch to its output file, so a client generator (or a stateful fuzzer) can follow them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from nowait.gateway.schemas import (
    Batch,
    BatchList,
    ChatCompletion,
    ErrorResponse,
    FileDeleted,
    FileList,
    FileObject,
    ModelCard,
    ModelList,
    TextCompletion,
)

REF = "#/components/schemas/{model}"

# What each operation answers with 200, by (method, path).
ANSWERS: dict[tuple[str, str], type[BaseModel]] = {
    ("post", "/v1/chat/completions"): ChatCompletion,
    ("post", "/v1/completions"): TextCompletion,
    ("get", "/v1/models"): ModelList,
    ("get", "/v1/models/{model_id}"): ModelCard,
    ("post", "/v1/files"): FileObject,
    ("get", "/v1/files"): FileList,
    ("get", "/v1/files/{file_id}"): FileObject,
    ("delete", "/v1/files/{file_id}"): FileDeleted,
    ("post", "/v1/batches"): Batch,
    ("get", "/v1/batches"): BatchList,
    ("get", "/v1/batches/{batch_id}"): Batch,
    ("post", "/v1/batches/{batch_id}/cancel"): Batch,
}
# Answers that are not JSON: a file's bytes (JSON Lines), Prometheus' text format.
RAW_ANSWERS = {("get", "/v1/files/{file_id}/content"): "application/jsonl", ("get", "/metrics"): "text/plain"}
EMPTY_ANSWERS = {("get", "/health"), ("get", "/ping"), ("post", "/ping")}  # vLLM's probes: an empty 200
STREAMED = {"/v1/chat/completions", "/v1/completions", "/v1/responses"}

ERROR_MEANINGS = {
    400: "invalid request (bad JSON, a field out of range, an unsupported option)",
    401: "missing or unknown API key",
    403: "the key may not use this model, or the data class forbids the destination",
    404: "no such model (model_not_found), route, or file or batch for this tenant (not_found: another "
         "tenant's id answers the same)",
    409: "the batch cannot be cancelled in its state",
    413: "the request body is larger than server.max_request_bytes",
    429: "a rate limit, a daily budget or an engine's queue is full (Retry-After says when to retry)",
    500: "a server bug (the message names the exception; the log has the traceback)",
    502: "the upstream engine answered with an error",
    503: "starting, draining, an engine unavailable, or the store cannot write now (Retry-After)",
    504: "the engine did not answer within the request's timeout",
}
COMMON_ERRORS = (400, 401, 403, 404, 413, 429, 500, 503)
EXTRA_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("post", "/v1/chat/completions"): (502, 504),
    ("post", "/v1/completions"): (502, 504),
    ("post", "/v1/responses"): (502, 504),
    ("post", "/v1/batches/{batch_id}/cancel"): (409,),
}
KEYLESS_PREFIXES = ("/healthz", "/readyz", "/metrics", "/health", "/ping", "/version", "/dashboard", "/tokenize",
                    "/detokenize")


def _operation_ids(paths: dict[str, dict[str, Any]]) -> dict[tuple[str, str], str]:
    """Unique operation ids: FastAPI gives a route with two methods one id for both."""
    seen: set[str] = set()
    ids = {}
    for path, operations in paths.items():
        for method, operation in operations.items():
            op_id = operation.get("operationId", f"{method}_{path}")
            if op_id in seen:
                op_id = f"{op_id}_{method}"
            operation["operationId"] = op_id
            seen.add(op_id)
            ids[(method, path)] = op_id
    return ids


def _add_model(document: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template=REF, mode="serialization")
    components = document.setdefault("components", {}).setdefault("schemas", {})
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": REF.format(model=model.__name__)}


def _links(ids: dict[tuple[str, str], str]) -> dict[tuple[str, str], dict[str, Any]]:
    """file -> batch creation -> batch -> its output file (and back to its input file)."""
    file_id = "$response.body#/id"
    batch_reads = {"operationId": ids[("post", "/v1/batches")],
                   "requestBody": {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                   "completion_window": "24h"}}
    by_batch_id = {"batch_id": "$response.body#/id"}
    return {
        ("post", "/v1/files"): {
            "CreateBatchFromFile": batch_reads,
            "GetFile": {"operationId": ids[("get", "/v1/files/{file_id}")], "parameters": {"file_id": file_id}},
            "GetFileContent": {"operationId": ids[("get", "/v1/files/{file_id}/content")],
                               "parameters": {"file_id": file_id}},
        },
        ("post", "/v1/batches"): {
            "GetBatch": {"operationId": ids[("get", "/v1/batches/{batch_id}")], "parameters": by_batch_id},
            "CancelBatch": {"operationId": ids[("post", "/v1/batches/{batch_id}/cancel")],
                            "parameters": by_batch_id},
        },
        ("get", "/v1/batches/{batch_id}"): {
            "GetOutputFile": {"operationId": ids[("get", "/v1/files/{file_id}/content")],
                              "parameters": {"file_id": "$response.body#/output_file_id"}},
            "GetInputFile": {"operationId": ids[("get", "/v1/files/{file_id}")],
                             "parameters": {"file_id": "$response.body#/input_file_id"}},
        },
    }


def complete_document(document: dict[str, Any]) -> dict[str, Any]:
    """`document` (FastAPI's) with the answers, errors, key and links added in place."""
    paths = document.get("paths", {})
    ids = _operation_ids(paths)
    error_ref = _add_model(document, ErrorResponse)
    for name in ("HTTPValidationError", "ValidationError"):  # never answered: validation is a 400
        document["components"]["schemas"].pop(name, None)
    document["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer",
                                                            "description": "an API key (auth.api_keys or nowait keys)"}}
    links = _links(ids)
    for path, operations in paths.items():
        for method, operation in operations.items():
            key = (method, path)
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            ok = responses.setdefault("200", {"description": "Successful Response"})
            if key in ANSWERS:
                ok["content"] = {"application/json": {"schema": _add_model(document, ANSWERS[key])}}
            if key in EMPTY_ANSWERS:
                ok.pop("content", None)
            if key in RAW_ANSWERS:
                ok["content"] = {RAW_ANSWERS[key]: {"schema": {"type": "string"}}}
            if path in STREAMED:
                ok.setdefault("content", {})["text/event-stream"] = {
                    "schema": {"type": "string", "description": "server-sent events, `data: [DONE]` last"}}
            if key in links:
                ok["links"] = links[key]
            for status in (*COMMON_ERRORS, *EXTRA_ERRORS.get(key, ())):
                responses[str(status)] = {"description": ERROR_MEANINGS[status],
                                          "content": {"application/json": {"schema": error_ref}}}
            if path.startswith(KEYLESS_PREFIXES):  # a probe's 503 is its own status object
                responses["503"]["content"]["application/json"]["schema"] = {"type": "object"}
            else:
                operation["security"] = [{"apiKey": []}]
    return document


def install_openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """Make `app.openapi()` (and /openapi.json) serve the completed document, built once."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            with warnings.catch_warnings():  # FastAPI's duplicate-id warning: _operation_ids fixes them
                warnings.simplefilter("ignore", UserWarning)
                document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                       description="nowait's OpenAI-compatible gateway")
            app.openapi_schema = complete_document(document)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return openapi
