"""The engine thread's loop (gateway/workers.py): a step that raises fails its requests, is
counted, logged and timed for /readyz, and the thread serves on; the thread sleeps only when
it had nothing to do; `stop` waits for it a bounded time. Written against mutmut's survivors
(docs/testing.md)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nowait.engines.ar import AutoregressiveEngine, EngineConfig
from nowait.gateway.workers import ArWorker, EngineWorker
from tests.conftest import build_model
from tests.worker_support import RecordingStats, drain, kinds, make_ticket

WORDS = "Amount: 12\n"


@pytest.fixture(scope="module")
def model(codec):
    return build_model(0, vocab_size=codec.vocab_size)


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the worker thread did not get there"
        time.sleep(0.01)


class FailsTwice(ArWorker):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.grad_seen: list[bool] = []
        self.to_fail = 2

    def _advance(self) -> bool:
        self.grad_seen.append(torch.is_grad_enabled())
        if self._active and self.to_fail:
            self.to_fail -= 1
            raise RuntimeError(f"boom {self.to_fail}")
        return super()._advance()


def test_the_thread_fails_its_requests_on_a_bug_and_keeps_serving(model, codec, caplog):
    engine = AutoregressiveEngine(model, codec, EngineConfig(max_num_seqs=4))
    worker = FailsTwice("ar", engine, codec, RecordingStats())
    assert (worker.failures, worker.last_failure, worker.last_failure_at) == (0, None, None)
    before = int(time.time())
    worker.start()
    try:
        tickets = []
        for _ in range(2):
            ticket = make_ticket(codec.encode(WORDS))
            tickets.append(ticket)
            worker.put(ticket)
            wait_for(lambda ticket=ticket: ticket.events.qsize() == 2)
        assert worker.failures == 2 and worker.last_failure == "RuntimeError: boom 0"
        assert before <= worker.last_failure_at <= time.time()
        for ticket in tickets:
            accepted, failed = drain(ticket)
            assert (accepted.kind, failed.kind) == ("accepted", "failed")
            assert (failed.error.status, failed.error.code, failed.error.type) == (500, "engine_error",
                                                                                   "server_error")
        assert failed.error.message == "engine 'ar' failed: boom 0"
        third = make_ticket(codec.encode(WORDS))
        worker.put(third)
        wait_for(lambda: third.events.qsize() == 2)
        assert kinds(drain(third)) == ["accepted", "done"] and worker.failures == 2
        assert not any(worker.grad_seen)  # the engine thread never records gradients
    finally:
        worker.stop()
    assert not worker._thread.is_alive()
    assert caplog.messages.count("engine ar failed a step; failing the requests in it") == 2


class RecordingWake(threading.Event):
    """The worker's wake-up event, keeping each wait's timeout (and waiting only briefly)."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def wait(self, timeout: float | None = None) -> bool:
        self.log.append(("wait", timeout))
        return super().wait(0.01)


class Scripted(EngineWorker):
    """Steps that report work, report none, or raise, in a fixed order; then the thread stops."""

    def __init__(self, script: list) -> None:
        super().__init__("scripted", None, None, RecordingStats())
        self.script, self.log = list(script), []
        self._wake = RecordingWake(self.log)

    def _drop_cancelled(self) -> None:
        pass

    def _advance(self) -> bool:
        if not self.script:
            self._stopping = True
            return True
        step = self.script.pop(0)
        self.log.append(("step", step))
        if step == "raise":
            raise RuntimeError("scripted")
        return step

    def _fail_step(self, error) -> None:
        pass


def test_the_thread_sleeps_only_after_a_step_without_work():
    worker = Scripted([True, True, False, "raise", True, False])
    worker.start()
    worker._thread.join(30)
    assert not worker._thread.is_alive()
    assert worker.log == [("step", True), ("step", True), ("step", False), ("wait", 0.5), ("step", "raise"),
                          ("wait", 0.5), ("step", True), ("step", False), ("wait", 0.5)]


class Stuck(EngineWorker):
    def __init__(self) -> None:
        super().__init__("stuck", None, None, RecordingStats())
        self.entered, self.release = threading.Event(), threading.Event()

    def _drop_cancelled(self) -> None:
        pass

    def _advance(self) -> bool:
        self.entered.set()
        self.release.wait(30)
        return False


def test_stop_waits_for_the_thread_only_as_long_as_it_is_told():
    """A stuck engine step must not hold up the server's shutdown: `stop` gives up after its
    timeout and leaves the (daemon) thread behind."""
    worker = Stuck()
    worker.start()
    assert worker.entered.wait(30)
    worker.stop(timeout_s=0.05)
    assert worker._thread.is_alive()
    worker.release.set()
    worker._thread.join(30)
    assert not worker._thread.is_alive()
