"""Shared by the tenant tests: a clock tests can move, a live server with an admin key whose
config is also a YAML file (so `nowait keys` and the server share one key store), and raw HTTP
helpers for the status codes and headers the openai client hides."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.gateway_support import FakeUpstream, base_config, free_port, live_server, save_tiny_models

ADMIN_KEY = "admin-test-key"


class ManualClock:
    """Stands still until a test moves it."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tenant_config(root: Path, codec, **overrides: Any) -> tuple[dict, Path]:
    """A config (tiny models, the fake upstream's frontier API, the test key of the tenant
    `default`, an admin key) and the same config as a YAML file."""
    models = save_tiny_models(root / "models", codec)
    auth = {"admin_keys": [ADMIN_KEY], "admin_keys_env": None, **overrides.pop("auth", {})}
    config = base_config(models, root / "data", free_port(), auth=auth, **overrides)
    path = root / "nowait.yaml"
    path.write_text(yaml.safe_dump(config))
    return config, path


@contextmanager
def tenant_server(config: dict, clock: ManualClock | None = None, upstream: FakeUpstream | None = None):
    with live_server(config, upstream) as live:
        if clock is not None:
            live.gateway.use_clock(clock)
        yield live


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


def chat(server, key: str | None, model: str = "ar", max_tokens: int = 4, **nowait: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": "Name: Ada"}]}
    if nowait:
        body["nowait"] = nowait
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=bearer(key), timeout=60)


def create_key(server, tenant: str, **settings: Any) -> dict:
    """A key through /admin/keys; the answer holds its secret (`key`) and id."""
    response = httpx.post(f"{server.base_url}/admin/keys", json={"tenant": tenant, **settings},
                          headers=bearer(ADMIN_KEY), timeout=30)
    assert response.status_code == 200, response.text
    return response.json()
