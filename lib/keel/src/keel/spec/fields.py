"""A check every config dataclass shares: its counts are whole numbers.

Python does not check annotations, and a float where a count belongs runs another run than the
one declared: `num_steps=300.5` trains 301 steps and never writes its final checkpoint;
`experts_per_token=2.5` fails only inside the step, after compiling.
"""

from __future__ import annotations

import dataclasses
import numbers

COUNT_TYPES = ("int", "int | None")
"""How a count field is annotated (the spec modules use `from __future__ import annotations`)."""


def not_whole(config) -> str | None:
    """'field=value' for the first field annotated as a count whose value is not a whole number
    (a bool is not one either); None when every count is."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.type in COUNT_TYPES and value is not None and (isinstance(value, bool)
                                                            or not isinstance(value, numbers.Integral)):
            return f"{f.name}={value!r}"
    return None
