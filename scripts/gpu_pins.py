"""The pins scripts/gpu-wheels.sh downloads: pyproject's run-time requirements and everything they
need, at the versions installed in the running environment (the venv CI tests).

    python scripts/gpu_pins.py [--python-version 3.12] [--skip N,N] [--skipped FILE] pyproject.toml

Prints `name==version` lines. Markers are read for x86-64 Linux CPython at --python-version, so a
dependency only an older Python needs is left out. torch, triton, nvidia-* and cuda-* are never
listed (the GPU machine's own CUDA build is used); --skip names go to --skipped FILE instead.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

NEVER = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|setuptools)$")


def target_environment(version: str) -> dict[str, str]:
    """The marker environment of the GPU machine's interpreter."""
    return {**default_environment(), "python_version": version, "python_full_version": f"{version}.0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix",
            "extra": ""}


def closure(requirements: list[str], version: str) -> dict[str, str]:
    """Every distribution the requirements need on the target, with its installed version."""
    env = target_environment(version)
    pins: dict[str, str] = {}
    missing: list[str] = []
    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo = []
    for line in requirements:
        req = Requirement(line)
        if (req.marker is None or req.marker.evaluate(env)) and not NEVER.match(canonicalize_name(req.name)):
            todo.append((req.name, tuple(sorted(req.extras))))
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, extras) in seen:
            continue
        seen.add((key, extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        first = key not in pins
        pins[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            # A later visit with new extras adds only what those extras bring.
            if req.marker is not None:
                wanted = ["", *extras] if first else list(extras)
                if not any(req.marker.evaluate({**env, "extra": e}) for e in wanted):
                    continue
            elif not first:
                continue
            if not NEVER.match(canonicalize_name(req.name)):
                todo.append((req.name, tuple(sorted(req.extras))))
    if missing:
        raise SystemExit(f"not installed here, so no version to pin: {', '.join(sorted(set(missing)))}")
    return pins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject")
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--skip", default="")
    parser.add_argument("--skipped", default=None)
    args = parser.parse_args()
    with open(args.pyproject, "rb") as f:
        requirements = tomllib.load(f)["project"]["dependencies"]
    pins = closure(requirements, args.python_version)
    left = {canonicalize_name(name) for name in args.skip.split(",") if name}
    lines = [f"{key}=={pins[key]}" for key in sorted(pins)]
    if args.skipped:
        with open(args.skipped, "w") as f:
            f.writelines(line + "\n" for line in lines if line.split("==")[0] in left)
    sys.stdout.writelines(line + "\n" for line in lines if line.split("==")[0] not in left)


if __name__ == "__main__":
    main()
