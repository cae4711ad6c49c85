"""Reading traced programs in tests: every equation of a jaxpr, those of its nested jaxprs (scan,
cond, remat, shard_map, pjit bodies) included."""

from collections.abc import Iterator

import jax


def equations(jaxpr) -> Iterator:
    """Each equation of `jaxpr` (a Jaxpr or ClosedJaxpr), depth first, nested ones after their parent."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(inner, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
                    yield from equations(inner)
