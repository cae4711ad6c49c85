"""Which expert-dispatch transport a run uses: an execution detail, never part of a run's identity.

Plain (no jax), so run configs can hold a `TransportSpec` and `keel plan` can reject a transport
the target platform cannot run before any compute is spent.
"""

from dataclasses import dataclass

TRANSPORTS: dict[str, str] = {
    "dense": "every expert on every token, masked by the routing weights (the reference; tests only)",
    "local": "grouped expert matmuls on each device's own tokens with every expert gathered (no expert parallelism)",
    "fixed_all_to_all": "expert parallel over `expert`: fixed (sender, expert) capacity cells, overflow dropped and counted",
    "ring": "expert parallel over `expert`: all-gather tokens, psum-scatter outputs; dropless",
    "fixed_pooled_all_to_all": "expert parallel over `expert`: destination-pooled fixed buffers sent in static waves",
    "ragged_all_to_all": "expert parallel over `expert`: ragged all-to-all, rows grouped by expert (GPU/TPU only)",
}

# XLA:CPU answers `UNIMPLEMENTED: HLO opcode 'ragged-all-to-all' is not supported by XLA:CPU ThunkEmitter`.
ACCELERATOR_ONLY = frozenset({"ragged_all_to_all"})


@dataclass(frozen=True)
class TransportSpec:
    """A transport and the knobs only some transports read."""

    name: str = "local"
    capacity_factor: float | None = None
    """Capacity of the fixed-capacity transports (per (sender, expert) cell, or per destination
    pool for fixed_pooled_all_to_all) as a multiple of the even share; None: the model's
    `capacity_factor`. `ring` ignores it (dropless)."""
    num_waves: int = 1
    """Static waves of the pooled transport (fixed_pooled_all_to_all only; the hero used 3)."""

    def __post_init__(self):
        if self.name not in TRANSPORTS:
            raise ValueError(f"TransportSpec.name={self.name!r} is not a transport: use one of {sorted(TRANSPORTS)}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"TransportSpec.capacity_factor={self.capacity_factor} must be positive")
        if self.num_waves < 1:
            raise ValueError(f"TransportSpec.num_waves={self.num_waves} must be >= 1")


def check_transport_supported(transport: "str | TransportSpec", platform: str) -> None:
    """Raise a ValueError naming the fix if `transport` cannot run on `platform` ('cpu', 'gpu', 'tpu')."""
    name = transport.name if isinstance(transport, TransportSpec) else TransportSpec(transport).name
    if name in ACCELERATOR_ONLY and platform == "cpu":
        raise ValueError(
            f"transport={name!r} needs a GPU or TPU: XLA:CPU does not implement ragged-all-to-all. "
            "On CPU use 'fixed_all_to_all', 'ring' (dropless) or 'local'."
        )
