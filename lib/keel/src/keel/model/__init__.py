"""keel.model: the Haliax MoE language model (attention, routing, expert transports, norms).

Runtime: imported where a step trains or evaluates. Its config, `MoELMConfig`, and the transport
registry are declarations in `keel.spec`.
"""


def __getattr__(name: str):
    """A declaration that moved to `keel.spec` says so, instead of a bare ImportError."""
    import keel.spec

    if name in keel.spec.__all__:
        raise ImportError(f"{__name__}.{name} is a declaration: import it from keel.spec (from keel.spec import {name})")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
