"""`Hardware`: what one accelerator and one rack of them offer, as declared facts for the planner."""

from __future__ import annotations

import os
from dataclasses import dataclass

from keel.model.transport_spec import ACCELERATOR_ONLY

PLATFORMS = ("gpu", "tpu", "cpu")
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclass(frozen=True)
class Hardware:
    """An accelerator kind and how a run uses its racks.

    `gpus_per_rack` is how many devices of a rack a run uses (a GB200 NVL72 rack has 72 GPUs; the
    hero uses 64 of them, 16 hosts x 4). `peak_flops_per_device` is the dense bf16 peak used for
    MFU (None: no meaningful peak, e.g. simulated CPU devices). `platform` is the JAX platform;
    on "cpu" the devices are simulated, as many as the step's topology asks for, in the step's own
    process (`process_env`).
    """

    name: str
    gpus_per_rack: int
    hbm_per_device_gb: float
    physical_gpus_per_rack: int | None = None
    peak_flops_per_device: float | None = None
    supports_ragged_all_to_all: bool = False
    platform: str = "gpu"

    def __post_init__(self):
        if self.platform not in PLATFORMS:
            raise ValueError(f"Hardware.platform={self.platform!r} is unknown: use one of {', '.join(PLATFORMS)}")
        if self.gpus_per_rack <= 0:
            raise ValueError(f"Hardware.gpus_per_rack={self.gpus_per_rack} must be positive")
        if self.physical_gpus_per_rack is not None and self.gpus_per_rack > self.physical_gpus_per_rack:
            raise ValueError(
                f"Hardware.gpus_per_rack={self.gpus_per_rack} exceeds physical_gpus_per_rack="
                f"{self.physical_gpus_per_rack}: a run cannot use more GPUs than a rack has"
            )
        if self.hbm_per_device_gb <= 0:
            raise ValueError(f"Hardware.hbm_per_device_gb={self.hbm_per_device_gb} must be positive")

    @property
    def hbm_per_rack_gb(self) -> float:
        return self.hbm_per_device_gb * self.gpus_per_rack

    def process_env(self, num_devices: int) -> dict[str, str]:
        """Environment variables a step's process needs to see `num_devices` devices of this kind.

        Simulated CPU racks need XLA to split the host into that many devices (before jax is
        imported, hence a fresh process); real accelerators are found by jax as they are.
        """
        if self.platform != "cpu":
            return {}
        kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
        return {"XLA_FLAGS": " ".join([*kept, f"{_DEVICE_COUNT_FLAG}={num_devices}"]), "JAX_PLATFORMS": "cpu"}

    def supports_transport(self, transport: str) -> bool:
        """Whether the backend can run an expert transport (XLA:CPU lacks ragged-all-to-all)."""
        return transport not in ACCELERATOR_ONLY or self.supports_ragged_all_to_all
