"""scripts/gpu-check.sh: it parses, it runs every step issues 24 and 27 name, and its timeouts fit in 8 minutes.

Running all of it is `scripts/gpu-check.sh OUT --cpu-smoke` (minutes on this CPU, so not a test
here); one step of it runs here through NOWAIT_GPU_CHECK_ONLY."""

from __future__ import annotations

import json
import os
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
    assert len(steps) == 8 and len(env) == 1
    assert sum(steps) + sum(env) <= 8 * 60


def test_every_step_of_the_issue_is_there():
    text = SCRIPT.read_text()
    for command in ("bench physics", "bench engines", "bench batching --model ar", "bench batching --model diffusion",
                    "bench peers", "--shape \"$big_ar\"", "--shape \"$big_diffusion\"", "--shape \"$big_gemma\""):
        assert command in text, command
    assert "big_ar=llama-3.1-8b big_diffusion=llada-8b big_gemma=diffusiongemma-26b-a4b" in text
    assert "big_gemma=diffusiongemma-tiny" in text  # the smoke run's, the same code path at a few MB
    assert "--concurrency 1,4,16,64" in text and "--concurrency 1,8" in text


def test_the_diffusiongemma_step_runs_on_the_cpu_smoke_path(tmp_path):
    # the script's own command line for the step, on the CPU at the tiny shape; every other step skipped
    env = {**os.environ, "NOWAIT_GPU_CHECK_ONLY": "shape-diffusiongemma-tiny"}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "--cpu-smoke"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    summary = [line.split("\t") for line in (tmp_path / "summary.tsv").read_text().splitlines()[1:]]
    ran = {name: status for name, status, _ in summary}
    assert ran["shape-diffusiongemma-tiny"] == "0"
    assert ran["physics"].startswith("skipped") and ran["engines"].startswith("skipped")
    report = json.loads((tmp_path / "shape-diffusiongemma-tiny.json").read_text())
    assert [c["name"] for c in report["cases"]] == ["denoise-canvas16-b1", "denoise-canvas16-b8"]
    assert report["dtype"] == "fp32" and report["device"] == "cpu"
