"""A fingerprint of a step function's source, so `keel plan` can say a cached output was made by
code that has since changed.

The code is not part of a step's identity: a comment or a refactor would re-key every output, and
library upgrades would invalidate every cache. Instead each SUCCESS records the fingerprint of the
function that made it, and a cached step whose function now reads differently is still cached but
says so, with the `--force` that reruns it. Only the function's own source counts, not what it calls.
"""

from __future__ import annotations

import functools
import hashlib
import inspect

from keel.executor.step import StepFunction


def qualified_name(fn) -> str:
    """`module.qualname` of a step's function: what its content identity names."""
    return f"{fn.__module__}.{fn.__qualname__}"


@functools.lru_cache(maxsize=None)
def fingerprint(fn) -> str | None:
    """BLAKE2b of the function's source, or None when it has none to read (a builtin, a REPL lambda).

    A `StepFunction` is read from its module's file without importing it (the planner must not pay
    for jax), and gives the same text `inspect.getsource` gives for the imported function."""
    try:
        source = fn.source() if isinstance(fn, StepFunction) else inspect.getsource(fn)
    except (OSError, TypeError, SyntaxError, ValueError):  # ValueError: not UTF-8; running the step says what is wrong
        return None
    return hashlib.blake2b(source.encode(), digest_size=8).hexdigest()


def describe_change(name: str, fn, recorded: str | None) -> str:
    """Why a cached output may be out of date with its step's function, or '' when it is not."""
    now = fingerprint(fn)
    if recorded is None or now is None or now == recorded:
        return ""
    return (f"{getattr(fn, '__qualname__', 'its function')} changed since this output was made "
            f"(the code is not part of the identity): `--force '^{name}$'` reruns it")
