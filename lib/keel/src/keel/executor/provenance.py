"""Where and how a step ran, recorded in `step.json`; secrets never reach the record."""

from __future__ import annotations

import functools
import getpass
import importlib.metadata
import os
import re
import socket
import subprocess
import sys
import time
from typing import Any

_SECRET = re.compile(r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_KEY)", re.IGNORECASE)
_RECORDED_ENV = ("KEEL_", "JAX_", "XLA_", "WANDB_", "HF_", "IRIS_", "CUDA_VISIBLE", "TPU_")
_PACKAGES = ("keel", "marin-levanter", "marin-haliax", "marin-fray", "jax", "jaxlib", "equinox", "optax")
REDACTED = "<redacted>"


def is_secret_name(name: str) -> bool:
    return bool(_SECRET.search(name))


def scrub(value: Any) -> Any:
    """A copy of a JSON-like value with every secret-named key's value redacted."""
    if isinstance(value, dict):
        return {k: (REDACTED if isinstance(k, str) and is_secret_name(k) else scrub(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


def _scrub_argv(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        key, eq, _ = arg.partition("=")
        out.append(f"{key}={REDACTED}" if eq and is_secret_name(key) else arg)
    return out


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=1)
def _static() -> dict:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    commit = _git("rev-parse", "HEAD")
    dirty = None if commit is None else bool(_git("status", "--porcelain", "--untracked-files=no"))
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = None
    return {"git_commit": commit, "git_dirty": dirty, "user": user, "host": socket.gethostname(), "python": sys.version.split()[0], "packages": versions}


def provenance() -> dict:
    """Provenance of this launch; the expensive parts (git, package metadata) are computed once."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_RECORDED_ENV)}
    return {
        **_static(),
        "time": time.time(),
        "pid": os.getpid(),
        "argv": _scrub_argv(list(sys.argv)),
        "env": {k: (REDACTED if is_secret_name(k) else v) for k, v in sorted(env.items())},
    }
