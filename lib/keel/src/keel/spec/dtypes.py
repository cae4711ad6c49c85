"""Bytes per element of the dtypes a run declares: the one table the planner's figures use."""

from __future__ import annotations

from keel.spec.checks import PlanError

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4}


def bytes_of(dtype: str, field: str) -> int:
    """Bytes per element of `dtype`; an unknown one is a `PlanError` naming `field`."""
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"{field}={dtype!r} is unknown: use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]
