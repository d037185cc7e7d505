"""The gateway in this process: uvicorn in a thread on a free loopback port.

The demo talks to it only through HTTP (the official API, as any client would); running it in
process just saves the user a second terminal. Model loading happens in the app's lifespan,
so `start` returns once the engines are loaded and the port is accepting.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nowait.gateway.config import GatewayConfig

STARTUP_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessGateway:
    """`with InProcessGateway(config) as gateway:` serves `config` on 127.0.0.1 for the block."""

    def __init__(self, config: GatewayConfig) -> None:
        import uvicorn

        from nowait.gateway.app import create_app

        self.port = config.server.port or free_port()
        self.app = create_app(config)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="nowait-demo-gateway", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> InProcessGateway:
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the gateway did not start (see the log above)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the gateway did not start within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self) -> InProcessGateway:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
