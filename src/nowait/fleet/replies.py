"""What crosses from an engine replica to the gateway: an Attempt, a text delta, or an error the
gateway answers as it would answer its own.

`APIError` is sent as its fields, not pickled: an exception with its own constructor does not
survive pickling with its status and code intact.
"""

from __future__ import annotations

from dataclasses import dataclass

from nowait.gateway.domain import Attempt
from nowait.gateway.errors import APIError


@dataclass(frozen=True)
class Reply:
    """One item from a replica: kind is open (the engine accepted a stream), delta, done or error."""

    kind: str
    text: str = ""
    attempt: Attempt | None = None
    error: dict | None = None
    replica: str = ""

    def raise_error(self) -> None:
        if self.error is not None:
            raise api_error(self.error)


def error_fields(error: APIError) -> dict:
    return {"status": error.status, "message": error.message, "type": error.type, "param": error.param,
            "code": error.code, "headers": dict(error.headers)}


def api_error(fields: dict) -> APIError:
    return APIError(fields["status"], fields["message"], type=fields["type"], param=fields["param"],
                    code=fields["code"], headers=fields["headers"])
