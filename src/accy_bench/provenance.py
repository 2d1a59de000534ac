"""Where a benchmark's numbers come from: the device, the versions, the commit it ran on."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .rig import Rig, driver, nvrtc_version, ok

__all__ = ["describe_run", "git_revision"]


def describe_run(rig: Rig) -> dict[str, Any]:
    """The date, Python, platform, device, versions and git revision of a run."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": _device_name(rig),
        "versions": _versions(),
        "git": git_revision(),
    }


def git_revision() -> dict[str, Any]:
    """The commit this code runs from and whether the tree has changes.

    ``$ACCY_REVISION``, where set, names the commit instead: a copy of the tree
    sent to another machine (the GPU machine's) may carry a stale repository.
    ``None`` where neither says.
    """
    given = os.environ.get("ACCY_REVISION")
    if given:
        return {"commit": given, "dirty": False}
    try:
        commit = _git("rev-parse", "HEAD").strip()
        status = _git("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(status.strip())}


def _git(*arguments: str) -> str:
    """The output of a git command run in this package's folder."""
    return subprocess.run(
        ["git", *arguments],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout


def _device_name(rig: Rig) -> str:
    d = driver()
    raw = ok(d.cuDeviceGetName(256, rig.device), "name")
    name = raw.split(b"\0", 1)[0].decode()
    return f"{name} (sm_{rig.cc[0]}{rig.cc[1]})"


def _versions() -> dict[str, str]:
    from importlib import metadata

    d = driver()
    versions = {"driver": str(ok(d.cuDriverGetVersion(), "driver version"))}
    for name in (
        "cuda-bindings",
        "cuda-core",
        "anyio",
        "msgspec",
        "numpy",
        "trio",
        "uvloop",
        "cupy-cuda13x",
        "torch",
    ):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    versions["nvrtc"] = ".".join(map(str, nvrtc_version()))
    return versions
