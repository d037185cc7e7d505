"""The tenants' keys over HTTP, for admin keys only (`NOWAIT_ADMIN_KEYS`; auth.py refuses every
other key with 401 before a handler runs):

    POST   /admin/keys            create a key; its secret is in this answer and nowhere else
    GET    /admin/keys[?tenant=]  the keys' records, never a secret
    DELETE /admin/keys/{key_id}   revoke a key (honoured from the next request on)
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from nowait.gateway.errors import APIError, bad_request
from nowait.gateway.keys import KeySettings
from nowait.gateway.service import gateway_of
from nowait.router import DataClass

router = APIRouter()


class KeyCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(min_length=1)
    models: list[str] | None = Field(None, description="router model and engine names (default: all)")
    data_class_floor: DataClass | None = None
    requests_per_minute: int | None = Field(None, gt=0)
    tokens_per_minute: int | None = Field(None, gt=0)
    budget_usd_per_day: float | None = Field(None, gt=0)
    expires_in_days: float | None = Field(None, gt=0)


@router.post("/admin/keys")
async def create_key(body: KeyCreateRequest, request: Request) -> dict:
    try:
        settings = KeySettings(tenant=body.tenant, models=tuple(body.models) if body.models else None,
                               data_class_floor=body.data_class_floor, requests_per_minute=body.requests_per_minute,
                               tokens_per_minute=body.tokens_per_minute, budget_usd_per_day=body.budget_usd_per_day,
                               expires_in_days=body.expires_in_days)
    except ValueError as error:
        raise bad_request(str(error), code="invalid_value") from None
    secret, record = await asyncio.to_thread(gateway_of(request).keys.create, settings)
    return {**record.public(), "key": secret}


@router.get("/admin/keys")
async def list_keys(request: Request, tenant: str | None = None) -> dict:
    records = await asyncio.to_thread(gateway_of(request).keys.list, tenant)
    return {"object": "list", "data": [r.public() for r in records]}


@router.delete("/admin/keys/{key_id}")
async def revoke_key(key_id: str, request: Request) -> dict:
    record = await asyncio.to_thread(gateway_of(request).keys.revoke, key_id)
    if record is None:
        raise APIError(404, f"No such API key: {key_id}", param="key_id", code="key_not_found")
    return {**record.public(), "revoked": True}
