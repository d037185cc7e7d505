"""The live page: `GET /dashboard` (one self-contained HTML page, nothing fetched from elsewhere)
and `GET /dashboard/data` (its numbers as JSON, read from the metrics registry at each call).
Open without an API key, as `/metrics` is: they show the same numbers."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from nowait.gateway.dashboard import dashboard_numbers
from nowait.gateway.service import gateway_of

PAGE = Path(__file__).resolve().parent.parent / "static" / "dashboard.html"

router = APIRouter()


@cache
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(page(), headers={"cache-control": "no-cache"})


@router.get("/dashboard/data")
async def dashboard_data(request: Request) -> dict:
    gateway = gateway_of(request)
    gateway.metrics.refresh(gateway.backends.values(), gateway.policy)  # the gauges, as a scrape sets them
    return dashboard_numbers(gateway.metrics.registry)
