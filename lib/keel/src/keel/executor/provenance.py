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

# Environment variables: anything like *_API_KEY, *_TOKEN, *_SECRET, passwords, credentials.
_SECRET_ENV = re.compile(r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_KEY)", re.IGNORECASE)
# Config fields and --set keys: a whole (last) name that is a secret, or ends like one; not counts
# like `experts_per_token` or names like `tokenizer`. Secret environment values are cut out anyway.
_SECRET_FIELD = re.compile(
    r"(^|\.)(token|secret|password|passwd|credentials?)$"
    r"|(^|[._])(api_?key|access_token|auth_token|hf_token|secret_key|private_key|password)$",
    re.IGNORECASE,
)
_MIN_SECRET_LEN = 6
_RECORDED_ENV = ("KEEL_", "JAX_", "XLA_", "WANDB_", "HF_", "IRIS_", "CUDA_VISIBLE", "TPU_")
_PACKAGES = ("keel", "marin-levanter", "marin-haliax", "marin-fray", "jax", "jaxlib", "equinox", "optax")
REDACTED = "<redacted>"


def is_secret_env(name: str) -> bool:
    return bool(_SECRET_ENV.search(name))


def is_secret_field(name: str) -> bool:
    return bool(_SECRET_FIELD.search(name))


def _secret_values() -> list[str]:
    return [v for k, v in os.environ.items() if is_secret_env(k) and len(v) >= _MIN_SECRET_LEN]


def scrub(value: Any, _secrets: list[str] | None = None) -> Any:
    """A copy of a JSON-like value with secret-named fields redacted and the values of secret
    environment variables cut out of every string, wherever they were copied to."""
    secrets = _secret_values() if _secrets is None else _secrets
    if isinstance(value, dict):
        return {k: (REDACTED if isinstance(k, str) and is_secret_field(k) else scrub(v, secrets)) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, secrets) for v in value]
    if isinstance(value, str):
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, REDACTED)
    return value


def _scrub_argv(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        key, eq, _ = arg.partition("=")
        out.append(f"{key}={REDACTED}" if eq and is_secret_field(key) else arg)
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
        "env": {k: (REDACTED if is_secret_env(k) else v) for k, v in sorted(env.items())},
    }
