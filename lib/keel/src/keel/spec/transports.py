"""Which expert-dispatch transport a run uses: an execution detail, never part of a run's identity.

`TRANSPORTS` is the one registry of what each transport is: what its capacity factor sizes (if
anything), whether it drops assignments past that capacity, whether it moves tokens between
devices, whether XLA:CPU runs it and what plays its part where it cannot run. The planner's
buffer sizes, the kernel's capacity and the CPU twin's stand-ins all read it.

Plain (no jax), so run configs can hold a `TransportSpec` and `keel plan` can reject a transport
the target platform cannot run before any compute is spent.
"""

from dataclasses import dataclass
from enum import StrEnum


class TransportName(StrEnum):
    """The closed set of transports (`TRANSPORTS` says what each one is). A member equals its
    string, so configs may be written either way: `TransportPhase(0, "ring")`."""

    DENSE = "dense"
    LOCAL = "local"
    FIXED_ALL_TO_ALL = "fixed_all_to_all"
    RING = "ring"
    FIXED_POOLED_ALL_TO_ALL = "fixed_pooled_all_to_all"
    RAGGED_ALL_TO_ALL = "ragged_all_to_all"

    def __repr__(self) -> str:  # in messages, as the user wrote it: 'ring'
        return repr(self.value)

    @property
    def code(self) -> int:
        """The member as a number, how a compiled step reports the transport it ran (`of_code`)."""
        return list(TransportName).index(self)

    @classmethod
    def of_code(cls, code: int) -> "TransportName":
        return list(cls)[code]


@dataclass(frozen=True)
class Transport:
    """One way of getting tokens to their experts and the outputs back."""

    description: str
    capacity: str | None = None
    """What the capacity factor sizes, as a multiple of the even share of assignments: the fixed
    (sender, expert) cells, the destination pools, or the receiver's buffer of the ragged
    transport; None: no capacity (dropless, or no tokens moved). Assignments past a capacity are
    dropped (contribute zero) and counted."""
    pads_sends: bool = False
    """Whether the bytes sent are the capacity-padded buffers (else only the real assignments)."""
    waves: bool = False
    """Whether it sends in `num_waves` static waves, each overlapping its transfer with the expert
    compute of the one before (1/num_waves of the transfer is exposed); others read no waves."""
    moves_tokens: bool = True
    accelerator_only: bool = False
    """XLA:CPU answers `UNIMPLEMENTED: HLO opcode 'ragged-all-to-all' is not supported by XLA:CPU ThunkEmitter`."""
    cpu_stand_in: TransportName | None = None
    """The CPU-capable transport that plays its part on a simulated rack (same drop behaviour where possible)."""


TRANSPORTS: dict[TransportName, Transport] = {
    TransportName.DENSE: Transport("every expert on every token, masked by the routing weights (the reference; tests only)",
                       moves_tokens=False),
    TransportName.LOCAL: Transport("grouped expert matmuls on each device's own tokens with every expert gathered "
                       "(no expert parallelism)", moves_tokens=False),
    TransportName.FIXED_ALL_TO_ALL: Transport("expert parallel over `expert`: fixed (sender, expert) capacity cells, overflow "
                                  "dropped and counted", capacity="sender cell", pads_sends=True),
    TransportName.RING: Transport("expert parallel over `expert`: all-gather tokens, psum-scatter outputs; dropless"),
    TransportName.FIXED_POOLED_ALL_TO_ALL: Transport("expert parallel over `expert`: destination-pooled fixed buffers sent in "
                                         "static waves", capacity="destination pool", pads_sends=True, waves=True),
    TransportName.RAGGED_ALL_TO_ALL: Transport("expert parallel over `expert`: ragged all-to-all, rows grouped by expert, "
                                   "a receiver buffer of capacity x the even share (GPU/TPU only)",
                                   capacity="receiver buffer", accelerator_only=True,
                                                     cpu_stand_in=TransportName.RING),
}

def transport_name(value: str, field: str) -> TransportName:
    """`value` as a TransportName; a ValueError naming `field` and the choices when it is none."""
    try:
        return TransportName(value)
    except ValueError:
        raise ValueError(f"{field}={value!r} is not a transport: use one of "
                         f"{', '.join(sorted(t.value for t in TransportName))}") from None


ACCELERATOR_ONLY = frozenset(name for name, t in TRANSPORTS.items() if t.accelerator_only)


@dataclass(frozen=True)
class TransportSpec:
    """A transport and the knobs only some transports read."""

    name: TransportName = TransportName.LOCAL
    capacity_factor: float | None = None
    """Capacity (see `Transport.capacity`) as a multiple of the even share; None: the model's
    `capacity_factor` when the transport has a capacity. The trainer always passes the resolved
    run's value. `ring` ignores it (dropless)."""
    num_waves: int = 1
    """Static waves of the pooled transport (fixed_pooled_all_to_all only; the hero used 3)."""

    def __post_init__(self):
        object.__setattr__(self, "name", transport_name(self.name, "TransportSpec.name"))
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"TransportSpec.capacity_factor={self.capacity_factor} must be positive")
        if self.num_waves < 1:
            raise ValueError(f"TransportSpec.num_waves={self.num_waves} must be >= 1")


def kernel_capacity_factor(name: str, capacity_factor: float | None, expert_parallel: int) -> float | None:
    """The capacity factor grug's kernel is handed for `name`: each device's expert rows are that
    many times its tokens x experts_per_token. A fixed-capacity transport's declared factor; `ring`'s
    is `expert_parallel`, since it gathers every shard's tokens and sizes its buffers to hold all of
    their assignments (dropless); None for `local` and `dense`, which pad nothing."""
    if not TRANSPORTS[name].moves_tokens:
        return None
    return float(max(expert_parallel, 1)) if name == "ring" else capacity_factor


def check_transport_supported(transport: "str | TransportSpec", platform: str) -> None:
    """Raise a ValueError naming the fix if `transport` cannot run on `platform` ('cpu', 'gpu', 'tpu')."""
    name = transport.name if isinstance(transport, TransportSpec) else TransportSpec(transport).name
    if name in ACCELERATOR_ONLY and platform == "cpu":
        raise ValueError(
            f"transport={name!r} needs a GPU or TPU: XLA:CPU does not implement ragged-all-to-all. "
            f"On CPU use 'fixed_all_to_all', {TRANSPORTS[name].cpu_stand_in!r} (its stand-in) or 'local'."
        )
