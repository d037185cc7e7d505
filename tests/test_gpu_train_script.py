"""scripts/gpu-train.sh: it parses, its timeouts fit one device call, it never writes the bundled
models, and its CPU smoke run trains, exports and measures both models end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-train.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_timeouts_fit_one_device_call_at_the_default_budget():
    text = SCRIPT.read_text()
    minutes = float(re.search(r"NOWAIT_TRAIN_MINUTES:-([\d.]+)", text).group(1))
    slack = int(re.search(r"m \* 60 \+ (\d+)", text).group(1))
    groups = re.findall(r'^for where in ((?:"[^"]+" ?)+); do', text, flags=re.M)
    evals = [int(limit) for limit in re.findall(r'^\s*step "eval-\S+" (\d+) ', text, flags=re.M)]
    assert len(groups) == 1 and len(evals) == 3  # three evaluations at once per group
    wheels = 90  # scripts/gpu-lib.sh's install limit
    assert minutes * 60 + slack + len(groups[0].split('" "')) * max(evals) + wheels <= 590


def test_every_training_run_exports_under_out_dir():
    lines = [line for line in SCRIPT.read_text().splitlines() if re.match(r"^step train-", line)]
    assert len(lines) == 2
    text = SCRIPT.read_text()
    for kind in ("ar", "diffusion"):
        assert f'--out "$out/{kind}"' in text and f'--init-from "$root/src/nowait/assets/{kind}"' in text
    assert "--tier mixed" in text and "--prompt-isolation 0.5" in text


def test_the_cpu_smoke_run_trains_exports_and_measures_both_models(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), str(out), "--cpu-smoke"], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "NOWAIT_TRAIN_RUNS": str(tmp_path / "runs"), "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    ran = {line.split("\t")[0]: line.split("\t")[1] for line in (out / "summary.tsv").read_text().splitlines()[1:]}
    assert ran["train-ar"] == ran["train-diffusion"] == ran["models"] == "0"
    assert len([name for name in ran if name.startswith("eval-")]) == 9
    report = json.loads((out / "eval-ar-hard-test.json").read_text())
    assert report["tier"] == "hard" and set(report["hard_layouts"]) == {"held_out", "training"}
    fresh = json.loads((out / "eval-template-hard-fresh.json").read_text())
    assert fresh["settings"]["structured"] is True
    with tarfile.open(out / "models.tgz") as archive:
        names = set(archive.getnames())
    assert {"ar/model.safetensors", "diffusion/model.safetensors", "diffusion/config.json"} <= names
    settings = json.loads((out / "diffusion" / "config.json").read_text())["nowait"]["training"]["settings"]
    assert settings["eval_tier"] == "mixed" and settings["hard_fraction"] == 0.5
    assert settings["data_start"] == 40000000 and settings["prompt_isolation"] == 0.5
