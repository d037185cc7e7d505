"""scripts/gpu-check.sh: it parses, it runs every step issue 24 names, and its timeouts fit in 8 minutes.

Running it is `scripts/gpu-check.sh OUT --cpu-smoke` (minutes on this CPU, so not a test here)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_gpu_timeouts_fit_in_eight_minutes():
    text = SCRIPT.read_text()
    steps = [int(limit) for limit in re.findall(r"^\s*step \S+ (\d+) ", text, flags=re.M)]
    env = [int(limit) for limit in re.findall(r"^timeout (\d+) ", text, flags=re.M)]
    assert len(steps) == 7 and len(env) == 1
    assert sum(steps) + sum(env) <= 8 * 60


def test_every_step_of_the_issue_is_there():
    text = SCRIPT.read_text()
    for command in ("bench physics", "bench engines", "bench batching --model ar", "bench batching --model diffusion",
                    "bench peers", "--shape \"$big_ar\"", "--shape \"$big_diffusion\""):
        assert command in text, command
    assert "big_ar=llama-3.1-8b big_diffusion=llada-8b" in text
    assert "--concurrency 1,4,16,64" in text and "--concurrency 1,8" in text
