"""Freed memory kept in the process: glibc's thresholds set, and a step's temporaries reused
instead of faulted in again (nowait.host_memory)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from nowait import host_memory

# A fresh interpreter per case: the thresholds are process state, and the test process's own
# heap has already been shaped by everything before it.
FAULTS_SCRIPT = """
import json, resource, sys
import torch
from nowait.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
x = torch.randn(2048, 512)
def step():  # several live temporaries of 4 MiB, freed at the end, as a forward's activations are
    parts = [x * float(k) for k in range(4)]
    return float(sum(p.sum() for p in parts))
for _ in range(40):  # the heap settles into its size first
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults_per_step": faults / 100}))
"""


def _faults(mode: str, env: dict[str, str] | None = None) -> dict:
    # glibc's defaults, whatever the environment running the tests sets for the allocator.
    inherited = {k: v for k, v in os.environ.items()
                 if k != host_memory.ENV_SWITCH and not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT, mode], capture_output=True, text=True, check=True,
                         env={**inherited, **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")


@glibc
def test_kept_memory_stops_the_page_faults_of_each_step():
    default = _faults("default")
    kept = _faults("keep")
    assert kept["applied"] is True
    # 4 MiB temporaries are 1,024 pages each. glibc's defaults raise the mmap threshold to the
    # largest block freed and trim the heap once twice that lies free at its top: four of them
    # freed together go back to the kernel, and every step faults them in again.
    # (How many depends on where small blocks land between them: 250 to 4,064 measured.)
    assert default["faults_per_step"] > 200
    # Kept: the heap reuses them (a late growth of the heap can still fault one block in once).
    assert kept["faults_per_step"] < 20


@glibc
def test_the_switch_leaves_glibc_defaults():
    off = _faults("keep", {host_memory.ENV_SWITCH: "0"})
    assert off["applied"] is False
    assert off["faults_per_step"] > 200


def test_switch_values():
    assert host_memory.wanted({}) is True
    assert host_memory.wanted({host_memory.ENV_SWITCH: "1"}) is True
    for off in ("0", "false", "No", " off "):
        assert host_memory.wanted({host_memory.ENV_SWITCH: off}) is False


def test_the_first_answer_holds(monkeypatch):
    calls = []
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setattr(host_memory, "_set_thresholds", lambda: calls.append(1) or True)
    assert host_memory.keep_freed_memory() is True
    assert host_memory.keep_freed_memory() is True
    assert calls == [1]
