"""keel.mesh: the JAX device mesh a step runs on (`keel.mesh.mesh.build_mesh`).

Runtime: the racks, hardware and placement rules it is built from are declarations in `keel.spec`.
"""


def __getattr__(name: str):
    """A declaration that moved to `keel.spec` says so, instead of a bare ImportError."""
    import keel.spec

    if name in keel.spec.__all__:
        raise ImportError(f"{__name__}.{name} is a declaration: import it from keel.spec (from keel.spec import {name})")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
