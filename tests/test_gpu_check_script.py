"""scripts/gpu-check.sh: it parses, it runs every step issues 24 and 27 name, and its timeouts fit in 8 minutes.

Running all of it is `scripts/gpu-check.sh OUT --cpu-smoke` (minutes on this CPU, so not a test
here); one step of it runs here through NOWAIT_GPU_CHECK_ONLY."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check.sh"


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_gpu_timeouts_fit_in_eight_minutes():
    text = SCRIPT.read_text()
    steps = [int(limit) for limit in re.findall(r"^\s*step \S+ (\d+) ", text, flags=re.M)]
    env = [int(limit) for limit in re.findall(r"^timeout (\d+) ", text, flags=re.M)]
    assert len(steps) == 10 and len(env) == 1
    assert sum(steps) + sum(env) <= 8 * 60


def test_every_step_of_the_issue_is_there():
    text = SCRIPT.read_text()
    for command in ("bench physics", "bench engines", "bench batching --model ar", "bench batching --model diffusion",
                    "bench peers", "--cuda-graphs off", "--shape \"$big_ar\"", "--shape \"$big_diffusion\"",
                    "--shape \"$big_gemma\""):
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


WHEELS = SCRIPT.parent / "gpu-wheels.sh"
PINS = SCRIPT.parent / "gpu_pins.py"


def test_wheels_script_parses():
    subprocess.run(["bash", "-n", str(WHEELS)], check=True)


def test_pins_are_the_installed_versions_without_torch(tmp_path):
    from importlib import metadata

    skipped = tmp_path / "skipped.txt"
    done = subprocess.run([sys.executable, str(PINS), "--python-version", "3.12", "--skip", "numpy,matplotlib",
                           "--skipped", str(skipped), str(PINS.parent.parent / "pyproject.toml")],
                          capture_output=True, text=True, check=True)
    pins = dict(line.split("==") for line in done.stdout.splitlines())
    assert pins["pydantic"] == metadata.version("pydantic") and pins["llguidance"] == metadata.version("llguidance")
    assert "pydantic-core" in pins and "starlette" in pins  # what the roots need, not only the roots
    assert not [name for name in pins if re.match(r"torch|triton|nvidia-|numpy|matplotlib", name)]
    assert "tomli" not in pins and "exceptiongroup" not in pins  # needed below 3.11 only
    assert skipped.read_text().splitlines() == [f"matplotlib=={metadata.version('matplotlib')}",
                                                f"numpy=={metadata.version('numpy')}"]


def _probe_wheel(folder: Path) -> None:
    # a one-module wheel, to see the install path put a carried package in the venv
    folder.mkdir()
    info = "gpucheck_probe-1.0.dist-info"
    files = {"gpucheck_probe.py": "VALUE = 7\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpucheck-probe\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / "gpucheck_probe-1.0-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


def test_carried_wheels_go_into_a_venv_that_still_sees_the_devices_torch(tmp_path):
    _probe_wheel(tmp_path / "wheels")
    venv = tmp_path / "venv"
    env = {**os.environ, "PYTHON": sys.executable, "NOWAIT_GPU_FORCE_WHEELS": "1",
           "NOWAIT_GPU_WHEELS": str(tmp_path / "wheels"), "NOWAIT_GPU_VENV": str(venv), "NOWAIT_GPU_CHECK_ONLY": "none"}
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), str(out), "--cpu-smoke"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr + (out / "wheels.err").read_text()
    ran = {line.split("\t")[0]: line.split("\t")[1] for line in (out / "summary.tsv").read_text().splitlines()[1:]}
    assert ran["wheels"] == "0" and ran["env"] == "0"
    report = json.loads((out / "env.json").read_text())
    assert report["python_executable"] == str(venv / "bin" / "python")
    assert report["torch_file"].startswith(sys.prefix)  # the calling interpreter's torch, reached from the venv
    check = "import gpucheck_probe, nowait.cli; print(gpucheck_probe.__file__)"
    where = subprocess.run([str(venv / "bin" / "python"), "-c", check], capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(venv))


def test_a_python_without_nowaits_packages_and_no_wheels_says_so(tmp_path):
    bare = tmp_path / "bare-python"  # the site folder off: typer, pydantic and torch do not import
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    (tmp_path / "wheels").mkdir()
    env = {**os.environ, "PYTHON": str(bare), "NOWAIT_GPU_WHEELS": str(tmp_path / "wheels"),
           "NOWAIT_GPU_CHECK_ONLY": "none", "NOWAIT_GPU_VENV": str(tmp_path / "no-venv")}
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), str(out), "--cpu-smoke"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert "holds no wheels" in done.stderr
    assert "wheels\tskipped (no wheels)\t0" in (out / "summary.tsv").read_text()
    assert "No module named" in (out / "wheels.err").read_text()


def test_a_venv_an_earlier_run_built_is_used_again(tmp_path):
    """The second prepared run on a warm machine (gpu-train.sh after gpu-check.sh) takes the venv
    the first built, without installing the wheels again."""
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    built = tmp_path / "venv" / "bin"
    built.mkdir(parents=True)
    (built / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # one where nowait imports
    (built / "python").chmod(0o755)
    env = {**os.environ, "PYTHON": str(bare), "NOWAIT_GPU_WHEELS": str(tmp_path / "no-wheels"),
           "NOWAIT_GPU_CHECK_ONLY": "none", "NOWAIT_GPU_VENV": str(tmp_path / "venv")}
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), str(out), "--cpu-smoke"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"wheels\treused {tmp_path / 'venv'}\t0" in (out / "summary.tsv").read_text()
    assert json.loads((out / "env.json").read_text())["python_executable"] == sys.executable
