"""Run tags that say what produced a run: source commit, package versions, device, host.

Every run (any tracker) is tagged with:

- ``mlflow.source.git.commit``: ``git rev-parse HEAD`` of the checkout fedexp is imported
  from (MLflow's standard tag, shown in the run's overview), and ``fedexp.git.dirty``
  (``true``/``false``: whether tracked files of that checkout differ from the commit,
  ``conf/`` included). Both are left out quietly when fedexp is not imported from a git
  checkout (an installed wheel) or git is missing.
- ``fedexp.version.<package>`` for python, torch, fedexp, mlflow, hydra-core, monai, numpy
  (``absent`` where a package is not installed). Read from the installed metadata: nothing
  is imported for it (a tabular run still imports no MONAI).
- ``fedexp.device``: the resolved device (``cpu``, ``cuda:0``, ...) and ``fedexp.device.name``:
  the GPU's name, or the CPU's model.
- ``fedexp.host``: the machine's host name.

A resumed run is re-tagged: the tags describe its latest attempt.
"""

from __future__ import annotations

import functools
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import torch

#: MLflow's standard tag for the source commit.
GIT_COMMIT_TAG = "mlflow.source.git.commit"
GIT_DIRTY_TAG = "fedexp.git.dirty"
DEVICE_TAG, DEVICE_NAME_TAG, HOST_TAG = "fedexp.device", "fedexp.device.name", "fedexp.host"
VERSION_PREFIX = "fedexp.version."
#: Distributions whose versions are recorded (``python`` is the interpreter).
PACKAGES = ("torch", "fedexp", "mlflow", "hydra-core", "monai", "numpy")
_GIT_TIMEOUT_S = 10.0


def _git(args: list[str], cwd: Path) -> str | None:
    """``git <args>`` in ``cwd``: its stripped output, None when it fails or git is missing."""
    try:
        proc = subprocess.run(
            ["git", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_tags(package_dir: Path | None = None) -> dict[str, str]:
    """The commit and dirty state of the git checkout holding fedexp's source.

    Args:
        package_dir: the folder of the ``fedexp`` package (default: the imported one).

    Returns:
        ``{GIT_COMMIT_TAG: sha, GIT_DIRTY_TAG: "true"|"false"}``, or ``{}`` when the package
        is not a tracked part of a git checkout (a wheel installed into some other repository's
        virtual environment does not count).
    """
    if package_dir is None:
        import fedexp

        package_dir = Path(fedexp.__file__).resolve().parent
    if _git(["ls-files", "--error-unmatch", "__init__.py"], package_dir) is None:
        return {}
    commit = _git(["rev-parse", "HEAD"], package_dir)
    if not commit:
        return {}
    status = _git(["status", "--porcelain", "--untracked-files=no"], package_dir)
    tags = {GIT_COMMIT_TAG: commit}
    if status is not None:
        tags[GIT_DIRTY_TAG] = "true" if status else "false"
    return tags


def version_tags() -> dict[str, str]:
    """``fedexp.version.<name>`` for python and :data:`PACKAGES` (``absent`` if missing)."""
    tags = {f"{VERSION_PREFIX}python": platform.python_version()}
    for name in PACKAGES:
        try:
            tags[f"{VERSION_PREFIX}{name}"] = metadata.version(name)
        except metadata.PackageNotFoundError:
            tags[f"{VERSION_PREFIX}{name}"] = "absent"
    return tags


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_tags(device: torch.device) -> dict[str, str]:
    """``fedexp.device`` (``cpu``, ``cuda:0``, ...) and ``fedexp.device.name``.

    A CUDA device without an index (``device=cuda`` or ``auto``) is named by the index torch
    uses for it (the current device).
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {DEVICE_TAG: f"cuda:{index}", DEVICE_NAME_TAG: torch.cuda.get_device_name(index)}
    if device.type == "cpu":
        return {DEVICE_TAG: "cpu", DEVICE_NAME_TAG: _cpu_name()}
    return {DEVICE_TAG: str(device), DEVICE_NAME_TAG: str(device)}


@functools.cache
def _code_tags() -> dict[str, str]:
    """The commit, dirty state and versions of the code this process runs: read once.

    The process runs the code it imported, whatever the checkout holds later; and a sweep's
    runs in one process (the stacked launcher's, the basic one's) then pay three ``git``
    processes and the packages' metadata once, not once a run (11 ms a run on this machine).
    """
    return {**git_tags(), **version_tags()}


def run_tags(device: torch.device) -> dict[str, str]:
    """Every provenance tag of a run on ``device`` (see the module's docstring)."""
    return {**_code_tags(), **device_tags(device), HOST_TAG: socket.gethostname()}
